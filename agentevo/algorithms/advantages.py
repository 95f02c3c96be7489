"""Per-step rewards, weights and advantages shared by the recipes (Q-Evolve, Self-Guide/GRPO, AWR).

Conventions: step tensors are float32 with time on the last dimension (index 0 is step t=1); functions that
recurse over time (GAE, returns) accept leading batch dimensions. Provenance tags refer to
reference/methods-spec.md: [S] paper, [P:x] public source, [O] our choice, [I] inferred.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import torch
from torch import Tensor

from agentevo.envs.base import SIGNAL_FORMAT, SIGNAL_INVALID, SIGNAL_NONE, SIGNAL_REPEAT

__all__ = [
    "TRUST_SCHEDULES",
    "awr_weights",
    "discounted_returns",
    "gae",
    "group_normalise",
    "group_normalise_steps",
    "internal_rewards_from_verdicts",
    "normalise",
    "q_minus_v",
    "retrospective_rewards",
    "step_weights",
    "td_errors",
    "trust_weight",
]

TRUST_SCHEDULES = ("staged", "constant", "none")

# Highest precedence first: format error > invalid action > repeated observation [O, spec §2.3 step 2].
_SIGNAL_PRECEDENCE = (SIGNAL_FORMAT, SIGNAL_INVALID, SIGNAL_REPEAT, SIGNAL_NONE)


def _f32(x: Tensor | Sequence[float]) -> Tensor:
    """The input as a float32 tensor (no copy when it already is one)."""
    return torch.as_tensor(x, dtype=torch.float32)


def step_weights(T: int, d: bool) -> Tensor:
    """Weighted-IQL step weights w_t = 0.5·(t/T + d) + 0.5 for t = 1..T (d: final env return ≠ 0)."""
    if T < 1:
        raise ValueError(f"step_weights needs T >= 1, got {T}")
    t = torch.arange(1, T + 1, dtype=torch.float32)
    # [S] §2.3 step 3: failures get (0.5, 1.0], successes (1.0, 1.5]; later steps weigh more.
    return 0.5 * (t / T + float(bool(d))) + 0.5


def retrospective_rewards(
    signals: Sequence[str | Collection[str]],
    r_fmt: float = -0.1,
    r_inv: float = -0.1,
    r_repeat: float = -0.1,
) -> Tensor:
    """Q-Evolve's retrospective auxiliary reward r_aux per step from its signal(s)."""
    # Penalty values −0.1 each are [O] (verl-agent's invalid-action coefficient 0.1, spec §2.2).
    values = {SIGNAL_FORMAT: r_fmt, SIGNAL_INVALID: r_inv, SIGNAL_REPEAT: r_repeat, SIGNAL_NONE: 0.0}
    out = []
    for i, sig in enumerate(signals):
        flags = {sig} if isinstance(sig, str) else set(sig)
        unknown = flags - set(values)
        if unknown:
            raise ValueError(f"step {i + 1}: unknown signal(s) {sorted(unknown)}; expected {_SIGNAL_PRECEDENCE}")
        # A step that raised several flags takes the highest-precedence one (format > invalid > repeat) [O].
        label = next((s for s in _SIGNAL_PRECEDENCE if s in flags), SIGNAL_NONE)
        out.append(values[label])
    return torch.tensor(out, dtype=torch.float32)


def td_errors(
    rewards: Tensor | Sequence[float],
    values: Tensor | Sequence[float],
    dones: Tensor | Sequence[bool],
    gamma: float,
) -> Tensor:
    """One-step TD errors δ_t = r_t + γ(1 − done_t)V(s_{t+1}) − V(s_t); `values` has T+1 entries."""
    r, v, not_done = _f32(rewards), _f32(values), 1.0 - _f32(dones)
    if v.shape[-1] != r.shape[-1] + 1:
        raise ValueError(f"values must have T+1 entries (V(s_1..s_{{T+1}})): got {v.shape[-1]} for T={r.shape[-1]}")
    # A terminal step does not bootstrap from V(s_{T+1}) [S/O §2.3 step 4; max-step truncation is terminal, O].
    return r + gamma * not_done * v[..., 1:] - v[..., :-1]


def gae(
    rewards: Tensor | Sequence[float],
    values: Tensor | Sequence[float],
    dones: Tensor | Sequence[bool],
    gamma: float,
    lam: float,
) -> Tensor:
    """Generalised advantage estimates A_t = δ_t + γλ(1 − done_t)A_{t+1}, A_{T+1} = 0 (values: T+1 entries)."""
    delta = td_errors(rewards, values, dones, gamma)
    not_done = 1.0 - _f32(dones)
    adv = torch.zeros_like(delta)
    if delta.shape[-1] == 0:
        return adv
    running = torch.zeros_like(delta[..., 0])
    # Backward recursion; a done step cuts the recursion so nothing leaks across an episode end [S §2.3 step 4].
    for t in range(delta.shape[-1] - 1, -1, -1):
        running = delta[..., t] + gamma * lam * not_done[..., t] * running
        adv[..., t] = running
    return adv


def q_minus_v(q_min: Tensor | Sequence[float], v: Tensor | Sequence[float]) -> Tensor:
    """One-step advantage A_t = min_i Q_i(s_t, a_t) − V(s_t) ("w/o GAE"); `v` may carry the extra V(s_{T+1})."""
    q, vv = _f32(q_min), _f32(v)
    if vv.shape[-1] == q.shape[-1] + 1:
        vv = vv[..., :-1]  # accept the same T+1 value vector that gae() takes [O]
    return q - vv


def _all_equal(x: Tensor) -> bool:
    """Whether every entry of x is exactly the same value (true for 0 or 1 entries)."""
    return x.numel() <= 1 or bool((x == x.reshape(-1)[0]).all())


def normalise(x: Tensor | Sequence[float], eps: float = 1e-8) -> Tensor:
    """Standardise a flat tensor to (x − mean)/(std + eps); constant or single-element input gives zeros."""
    v = _f32(x)
    # Exactly-equal entries carry no ranking information: return zeros instead of rounding noise / eps or the
    # NaN that the sample std of one element would give [O].
    if _all_equal(v):
        return torch.zeros_like(v)
    # Sample std (Bessel-corrected, torch.std's default) everywhere in this module [O]; eps 1e-8 is [P:BPPO].
    return (v - v.mean()) / (v.std() + eps)


def group_normalise(rewards: Tensor | Sequence[float], eps: float = 1e-6) -> Tensor:
    """GRPO group-relative advantages (R_i − mean R)/(std R + eps) along the last dim; all-equal groups give zeros."""
    r = _f32(rewards)
    if r.shape[-1] == 0:
        return r.clone()
    mean = r.mean(dim=-1, keepdim=True)
    # Sample std (unbiased, torch.std's default as in common GRPO code), [O]; with G=1 or an all-equal group the
    # std is 0/NaN, and the advantage is defined as 0 (such a group carries no learning signal) [O].
    std = r.std(dim=-1, keepdim=True) if r.shape[-1] > 1 else torch.zeros_like(mean)
    equal = (r == r[..., :1]).all(dim=-1, keepdim=True)
    out = (r - mean) / (std + eps)
    return torch.where(equal, torch.zeros_like(out), out)


def group_normalise_steps(per_traj: Sequence[Tensor | Sequence[float]], eps: float = 1e-6) -> list[Tensor]:
    """Normalise ragged per-step values with one mean/std pooled over all steps of all trajectories in a group."""
    parts = [_f32(p).reshape(-1) for p in per_traj]
    if not parts:
        return []
    flat = torch.cat(parts)
    # [I] §3.2: Â_int uses mean_{g,s} and std_{g,s} over every step of the group; same std convention as above.
    if _all_equal(flat):
        normed = torch.zeros_like(flat)
    else:
        normed = (flat - flat.mean()) / (flat.std() + eps)
    return list(torch.split(normed, [p.numel() for p in parts]))


def normalise_per_step_index(per_traj: Sequence[Tensor | Sequence[float]], eps: float = 1e-6) -> list[Tensor]:
    """Normalise ragged per-step values across the trajectories of a group at each step index t: the mean/std of
    the values at t of every trajectory that has a step t. An index held by one trajectory, or with equal values,
    gives 0. Unlike group_normalise_steps, a value that depends on t alone (the return-to-go of a constant reward)
    normalises to 0."""
    parts = [_f32(p).reshape(-1) for p in per_traj]
    out = [torch.zeros_like(p) for p in parts]
    for t in range(max((p.numel() for p in parts), default=0)):
        rows = [i for i, p in enumerate(parts) if p.numel() > t]
        vals = torch.stack([parts[i][t] for i in rows])
        if _all_equal(vals):
            continue
        normed = (vals - vals.mean()) / (vals.std() + eps)
        for i, v in zip(rows, normed, strict=True):
            out[i][t] = v
    return out


def discounted_returns(rewards: Tensor | Sequence[float], gamma: float) -> Tensor:
    """Return-to-go G_t = Σ_{t'≥t} γ^{t'−t} r_{t'} along the last dim."""
    r = _f32(rewards)
    out = torch.zeros_like(r)
    if r.shape[-1] == 0:
        return out
    running = torch.zeros_like(r[..., 0])
    for t in range(r.shape[-1] - 1, -1, -1):
        running = r[..., t] + gamma * running
        out[..., t] = running
    return out


def internal_rewards_from_verdicts(verdicts: Sequence[int | None]) -> Tensor:
    """Self-Guide internal rewards: the verdict given at step t becomes r_int of step t−1; r_int_T = 0."""
    phi = []
    for i, v in enumerate(verdicts):
        if v is None:
            phi.append(0.0)  # missing/unparseable verdict maps to 0 [I §3.2]
        elif isinstance(v, bool) or v not in (-1, 0, 1):
            raise ValueError(f"step {i + 1}: verdict must be +1, 0, -1 or None, got {v!r}")
        else:
            phi.append(float(v))
    T = len(phi)
    # [I] §3.2: the guide written after o_t judges a_{t−1}; the verdict at t=1 has no previous action and is
    # dropped; the last action is judged by the terminal outcome only, so r_int_T = 0.
    return torch.tensor(phi[1:] + [0.0], dtype=torch.float32) if T else torch.zeros(0, dtype=torch.float32)


def trust_weight(
    step: int,
    total: int,
    lambda_max: float,
    breakpoints: tuple[float, float] = (0.2, 0.5),
    schedule: str = "staged",
) -> float:
    """Self-Guide trust λ(k) on the internal advantage at training step k of `total`."""
    if schedule == "none":
        return 0.0  # env-only GRPO: the internal reward never enters the advantage [O]
    if schedule == "constant":
        return float(lambda_max)  # "no schedule" ablation: λ_max from step 0 [I §3.4]
    if schedule != "staged":
        raise ValueError(f"unknown trust schedule {schedule!r}; expected one of {TRUST_SCHEDULES}")
    if total <= 0:
        raise ValueError(f"total must be positive, got {total}")
    lo, hi = breakpoints
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"breakpoints must satisfy 0 <= lo <= hi <= 1, got {breakpoints}")
    frac = step / total
    # [I] §3.2 stages, breakpoints 20%/50% [O]: λ=0 before lo, linear 0→λ_max on [lo, hi), λ_max from hi on.
    if frac < lo:
        return 0.0
    if frac >= hi:
        return float(lambda_max)
    return float(lambda_max) * (frac - lo) / (hi - lo)


def awr_weights(adv: Tensor | Sequence[float], beta: float = 3.0, cap: float = 100.0) -> Tensor:
    """Advantage-weighted-regression weights min(exp(β·A), cap)."""
    a = _f32(adv)
    # β=3.0 and cap 100 are [P:IQL]; clamping the exponent first avoids inf (and inf·0 = NaN gradients), the
    # final clamp removes float rounding of exp(log(cap)).
    return torch.exp(torch.clamp(beta * a, max=math.log(cap))).clamp(max=cap)
