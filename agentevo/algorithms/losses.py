"""Token-level losses shared by the recipes: log-probs, aggregation, NLL, IQL critic, clipped ratio, KL, DPO, AWR.

Conventions: token tensors are [B, N] (batch, token positions) with a boolean-like mask of the same shape;
vocabulary tensors are [..., V]. Teacher, reference, old-policy, target and advantage inputs are treated as
constants (detached) so gradients flow only into the trained model. Provenance tags refer to
reference/methods-spec.md: [S] paper, [P:x] public source, [O] our choice, [I] inferred.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "LOGPROB_CHUNK_TOKENS",
    "LOSS_AGG_MODES",
    "aggregate",
    "append_tail_bucket",
    "awr_loss",
    "bellman_targets",
    "clipped_ratio_objective",
    "dpo_loss",
    "expectile_loss",
    "full_forward_kl",
    "iql_q_loss",
    "iql_value_loss",
    "kl_k3",
    "nll_loss",
    "polyak_update",
    "student_topk",
    "teacher_topk",
    "token_entropy",
    "token_logprobs",
    "topk_forward_kl",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# Log-ratios are clamped to ±20 before exp() so a badly off-policy token cannot overflow to inf [O].
_MAX_LOG_RATIO = 20.0
# Upper clamp on log Σ_K p before computing the tail bucket, so the bucket stays > 0 [P:SDPO].
_TAIL_LOG_MASS_MAX = -1e-7


# ---------------------------------------------------------------------------------------------------------------
# Token log-probs and aggregation


# Rows of [tokens, V] turned into float32 at a time by token_logprobs: bounds its extra memory to CHUNK x V floats.
LOGPROB_CHUNK_TOKENS = 1024


class _SelectedLogprob(torch.autograd.Function):
    """log p(target) from logits [N, V] in float32, chunk by chunk; backward recomputes softmax per chunk.

    Saves only the logits (in their own dtype), the targets and the per-row logsumexp, so neither pass holds an
    [N, V] float32 tensor (the plain path's fp32 cast and softmax are N x V floats each).
    """

    @staticmethod
    def forward(ctx: object, logits: Tensor, targets: Tensor, chunk: int) -> Tensor:  # type: ignore[override]
        n = logits.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk):
            z = logits[s : s + chunk].float()
            lse[s : s + chunk] = torch.logsumexp(z, dim=-1)
            out[s : s + chunk] = z.gather(-1, targets[s : s + chunk, None]).squeeze(-1) - lse[s : s + chunk]
        ctx.save_for_backward(logits, targets, lse)  # type: ignore[attr-defined]
        ctx.chunk = chunk  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        logits, targets, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        chunk = ctx.chunk  # type: ignore[attr-defined]
        grad_logits = torch.empty_like(logits)
        grad = grad.float()
        for s in range(0, logits.shape[0], chunk):
            g = grad[s : s + chunk, None]
            # d/dz [z_t - logsumexp(z)] = onehot(t) - softmax(z)
            gz = torch.exp(logits[s : s + chunk].float() - lse[s : s + chunk, None]).mul_(-g)
            gz.scatter_add_(-1, targets[s : s + chunk, None], g)
            grad_logits[s : s + chunk] = gz.to(logits.dtype)
        return grad_logits, None, None


def token_logprobs(logits: Tensor, input_ids: Tensor, chunk_tokens: int = LOGPROB_CHUNK_TOKENS) -> Tensor:
    """Log-prob of each next token: out[:, j] = log p(input_ids[:, j+1] | input_ids[:, :j+1]), shape [B, L−1]."""
    # Alignment [S §1.3]: logits[:, :-1] predict input_ids[:, 1:], so column j belongs to token position j+1;
    # mask the result with action_mask[:, 1:]. float32 values, computed chunk_tokens positions at a time (gather −
    # logsumexp, no full log_softmax), so memory does not grow with L x V in float32 (a 151,936-token vocabulary at
    # 4 x 8K tokens would be ~20 GB for the cast alone).
    b, length, vocab = logits.shape
    if length < 2:
        return logits.new_zeros((b, 0), dtype=torch.float32)
    rows = [
        _SelectedLogprob.apply(logits[i, :-1], input_ids[i, 1:], max(1, chunk_tokens))  # a contiguous view per row
        for i in range(b)
    ]
    return torch.stack(rows)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) at every position, shape logits.shape[:-1] (pass logits[:, :-1] to align)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    # Zero-probability entries (−inf logits) contribute 0 instead of 0·(−inf) = NaN.
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(dim=-1)


def aggregate(values: Tensor, mask: Tensor, mode: str = "token-mean") -> Tensor:
    """Reduce per-token values [B, N] under a mask to a scalar with one of LOSS_AGG_MODES."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {LOSS_AGG_MODES}")
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must have the same shape")
    v2 = values.reshape(1, -1) if values.dim() == 1 else values.reshape(-1, values.shape[-1])
    m2 = mask.reshape(v2.shape).bool()
    # where() instead of multiplication so non-finite values at masked positions cannot leak in as NaN.
    masked = torch.where(m2, v2, torch.zeros_like(v2))
    if mode == "token-mean":
        # [P:DAPO] Σ_all tokens ℓ / N_tokens_in_batch; 0 (still attached to the graph) when nothing is masked in.
        return masked.sum() / m2.sum().clamp(min=1)
    n_tok = m2.sum(dim=-1)
    per_seq = masked.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / n_tok.clamp(min=1)
    # Rows without any masked token (padding rows, fully truncated samples) are not sequences of the mean [O].
    has_tokens = n_tok > 0
    return torch.where(has_tokens, per_seq, torch.zeros_like(per_seq)).sum() / has_tokens.sum().clamp(min=1)


def nll_loss(logp: Tensor, mask: Tensor, mode: str = "token-mean") -> Tensor:
    """Negative log-likelihood of the masked tokens (BC / SFT)."""
    return aggregate(-logp, mask, mode)


# ---------------------------------------------------------------------------------------------------------------
# IQL critic (Q-Evolve step 3)


def expectile_loss(diff: Tensor, tau: float) -> Tensor:
    """Element-wise asymmetric squared loss |τ − 1(diff < 0)|·diff² (diff = target − prediction)."""
    if not 0.0 < tau < 1.0:
        raise ValueError(f"expectile tau must be in (0, 1), got {tau}")
    # [P:IQL] positive residuals (target above the prediction) weigh τ, negative ones 1 − τ: τ > 0.5 pushes the
    # prediction towards an upper expectile of the target.
    weight = torch.where(diff < 0, torch.full_like(diff, 1.0 - tau), torch.full_like(diff, tau))
    return weight * diff.pow(2)


def _weighted_mean(per_step: Tensor, weights: Tensor | None) -> Tensor:
    """Σ w·x / Σ w with constant weights (plain mean when weights is None)."""
    if weights is None:
        return per_step.mean() if per_step.numel() else per_step.sum()
    w = weights.detach().to(per_step.dtype)
    # Normalising by Σw (not the batch size) keeps the loss scale independent of the success rate [O §2.3].
    return (w * per_step).sum() / w.sum().clamp(min=1e-12)


def iql_value_loss(q_target_min: Tensor, v: Tensor, weights: Tensor | None = None, tau: float = 0.7) -> Tensor:
    """Weighted expectile loss of V(s_t) against the (constant) min of the target Q heads."""
    # [P:IQL] V is fitted to min_i Q̄_i of the *target* heads; w_t weighting [S]; τ=0.7 default [P:IQL].
    return _weighted_mean(expectile_loss(q_target_min.detach() - v, tau), weights)


def iql_q_loss(q_preds: Tensor | Sequence[Tensor], target: Tensor, weights: Tensor | None = None) -> Tensor:
    """Weighted squared TD loss Σ_t w_t Σ_i (y_t − Q_i)² / Σ_t w_t over all Q heads (heads stacked on dim 0)."""
    q = q_preds if isinstance(q_preds, Tensor) else torch.stack(list(q_preds))
    # Sum over heads, weighted mean over steps [S §2.3 L_Q]; the Bellman target is a constant.
    per_step = (target.detach().unsqueeze(0) - q).pow(2).sum(dim=0)
    return _weighted_mean(per_step, weights)


def bellman_targets(rewards: Tensor, next_v: Tensor, dones: Tensor, gamma: float) -> Tensor:
    """Q targets y_t = r_t + γ(1 − done_t)V(s_{t+1}), detached."""
    not_done = 1.0 - dones.to(next_v.dtype)
    # V is detached [S §2.3]; terminal steps (incl. max-step truncation) do not bootstrap [O].
    return (rewards.to(next_v.dtype) + gamma * not_done * next_v).detach()


def polyak_update(target_params: Iterable[Tensor], online_params: Iterable[Tensor], rho: float) -> None:
    """In place: θ̄ ← (1 − ρ)θ̄ + ρθ for each target/online parameter pair."""
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"Polyak rate must be in [0, 1], got {rho}")
    # ρ=0.005 after every optimiser step is the [P:IQL] default (set by the caller).
    with torch.no_grad():
        for tgt, src in zip(list(target_params), list(online_params), strict=True):
            tgt.lerp_(src.to(tgt.dtype), rho)


# ---------------------------------------------------------------------------------------------------------------
# Policy objectives


def clipped_ratio_objective(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/BPPO clipped surrogate loss −mean(min(ηA, clip(η, 1−ε_low, 1+ε_high)A)) and its clip statistics."""
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    a = adv.detach().to(logp.dtype)
    ratio = torch.exp((logp - old_logp.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    # Asymmetric clip [S §2.3 step 5]: Q-Evolve uses ε_low > ε_high (0.28/0.20, values O); GRPO symmetric 0.2,
    # DAPO 0.2/0.28 [P:DAPO]. Outside the band on the side the advantage pushes towards, min() picks the
    # constant clipped term, so the token's gradient is exactly zero.
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = -torch.minimum(ratio * a, clipped * a)
    loss = aggregate(per_token, mask, mode)
    with torch.no_grad():
        m = mask.bool()
        n = m.sum().clamp(min=1)
        r = ratio.detach()
        stats = {
            # Token fractions over all masked tokens, whatever the loss mode [O §2.4].
            "clip_frac_low": ((r < 1.0 - eps_low) & (a < 0) & m).sum() / n,
            "clip_frac_high": ((r > 1.0 + eps_high) & (a > 0) & m).sum() / n,
            "ratio_mean": torch.where(m, r, torch.zeros_like(r)).sum() / n,
        }
    return loss, stats


K3_MAX = 10.0  # per-token cap of the k3 value, as verl's low_var_kl, OpenRLHF and SkyRL clamp it


def kl_k3(logp: Tensor, ref_logp: Tensor, max_value: float | None = K3_MAX) -> Tensor:
    """Per-token k3 estimate of KL(π‖π_ref): exp(ref − logp) − (ref − logp) − 1 (reference detached), capped at
    max_value (None: uncapped)."""
    # [O §1.3, standard in GRPO code]; expm1 keeps it ≥ 0 for tiny differences, the clamp_min only guards
    # rounding; the log-ratio clamp avoids overflow. The cap: one token the policy has pushed ~10 nats below the
    # reference would otherwise be worth e^10 / N of the whole batch's KL, and its gradient, −(e^Δ − 1), would
    # outweigh every other token's (a KL of 163 per token and a gradient norm of 341 in one Self-Guide update on
    # SmolLM2, docs/methods/selfguide.md); a capped token contributes 10 and no gradient.
    lr = (ref_logp.detach() - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    k3 = (torch.expm1(lr) - lr).clamp_min(0.0)
    return k3 if max_value is None else k3.clamp_max(max_value)


def dpo_loss(
    policy_chosen_logp: Tensor,
    policy_rejected_logp: Tensor,
    ref_chosen_logp: Tensor,
    ref_rejected_logp: Tensor,
    beta: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair DPO loss −log σ(β[(π_w − ref_w) − (π_l − ref_l)]) from sequence log-prob sums, plus reward stats."""
    # [P:ETO] β=0.1 in iteration 1, 0.5 later (set by the caller); the reference is a constant.
    chosen = beta * (policy_chosen_logp - ref_chosen_logp.detach())
    rejected = beta * (policy_rejected_logp - ref_rejected_logp.detach())
    losses = -F.logsigmoid(chosen - rejected)
    with torch.no_grad():
        stats = {
            "reward_chosen": chosen.mean(),
            "reward_rejected": rejected.mean(),
            "reward_margin": (chosen - rejected).mean(),
            "reward_accuracy": (chosen > rejected).float().mean(),
        }
    return losses, stats


def awr_loss(logp: Tensor, weights: Tensor, mask: Tensor, mode: str = "token-mean") -> Tensor:
    """Advantage-weighted regression loss −agg(w · log π) with constant per-token weights."""
    # [P:IQL] actor form; weights come from advantages.awr_weights and must not carry gradient.
    return aggregate(-weights.detach().to(logp.dtype) * logp, mask, mode)


# ---------------------------------------------------------------------------------------------------------------
# Distillation KLs (RSD step 6, GT-OPSD)


def _forward_kl_from_logprobs(teacher_logp: Tensor, student_logp: Tensor) -> Tensor:
    """Σ_v p_T(v)(log p_T(v) − log p_S(v)) over the last dim; entries with p_T = 0 contribute 0."""
    p = teacher_logp.exp()
    terms = p * (teacher_logp - student_logp)
    return torch.where(p > 0, terms, torch.zeros_like(terms)).sum(dim=-1)


def teacher_topk(teacher_logits: Tensor, k: int, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """The teacher's top-k token ids and their full-vocabulary log-probs under softmax(z/T), no gradient."""
    if not 1 <= k <= teacher_logits.shape[-1]:
        raise ValueError(f"k must be in [1, {teacher_logits.shape[-1]}], got {k}")
    with torch.no_grad():
        # Log-probs are *not* renormalised over the k ids so the tail-bucket variant can recover 1 − Σ_K p;
        # topk_forward_kl renormalises when needed. k=20 and T_teach=1.0 defaults live in the recipe [S/O §4.2].
        logp = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
        vals, ids = logp.topk(k, dim=-1)
    return ids, vals


def student_topk(
    student_logits: Tensor, teacher_logits: Tensor, k: int, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """The student's top-k ids and the teacher's full-vocabulary log-probs at them (`--topk_from student`)."""
    if not 1 <= k <= student_logits.shape[-1]:
        raise ValueError(f"k must be in [1, {student_logits.shape[-1]}], got {k}")
    with torch.no_grad():
        # [P:SDPO] support = the student's top-k; feed the result to topk_forward_kl (usually with tail_bucket).
        ids = student_logits.detach().topk(k, dim=-1).indices
        logp = torch.log_softmax(teacher_logits.float() / temperature, dim=-1).gather(-1, ids)
    return ids, logp


def append_tail_bucket(topk_logprobs: Tensor) -> Tensor:
    """Extend full-vocabulary log-probs of K ids with the tail bucket log(1 − Σ_K p): shape [..., K+1]."""
    # [P:SDPO] log(−expm1(log Σ_K p)) is the stable form of log(1 − Σ_K p); the clamp keeps the bucket > 0
    # when K covers (almost) all mass.
    log_mass = torch.logsumexp(topk_logprobs, dim=-1, keepdim=True).clamp(max=_TAIL_LOG_MASS_MAX)
    return torch.cat([topk_logprobs, torch.log(-torch.expm1(log_mass))], dim=-1)


def topk_forward_kl(
    student_logits: Tensor,
    teacher_topk_ids: Tensor,
    teacher_topk_logprobs: Tensor,
    tail_bucket: bool = False,
) -> Tensor:
    """Per-token forward KL(p_T‖p_S) restricted to K ids (renormalised), or over K ∪ {tail} with tail_bucket."""
    z = student_logits.float()
    t_lp = teacher_topk_logprobs.detach().float()
    s_k = z.gather(-1, teacher_topk_ids)
    if tail_bucket:
        # [P:SDPO] both distributions keep their full-vocabulary mass on K plus one bucket for the rest; the
        # teacher log-probs must therefore be full-vocabulary ones (as teacher_topk returns).
        s_lp = s_k - torch.logsumexp(z, dim=-1, keepdim=True)
        return _forward_kl_from_logprobs(append_tail_bucket(t_lp), append_tail_bucket(s_lp))
    # [P:OPSD, S/O §4.3 step 6] renormalise both over K; only the student's K logits are needed.
    t_ren = t_lp - torch.logsumexp(t_lp, dim=-1, keepdim=True)
    s_ren = s_k - torch.logsumexp(s_k, dim=-1, keepdim=True)
    return _forward_kl_from_logprobs(t_ren, s_ren)


def full_forward_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Per-token forward KL(p_T‖p_S) over the whole vocabulary, p_T = softmax(teacher_logits/T) detached."""
    t_lp = torch.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    s_lp = torch.log_softmax(student_logits.float(), dim=-1)
    return _forward_kl_from_logprobs(t_lp, s_lp)
