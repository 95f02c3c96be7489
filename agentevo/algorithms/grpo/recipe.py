"""GRPO for multi-turn agents, and its DAPO variant (methods-spec §5 'GRPO', §3.2 'Policy loss').

    A_i   = (R_i − mean_g R_g) / (std_g R_g + ε)                      one outcome advantage per trajectory,
                                                                      broadcast to every reply token of τ_i
    ρ_tok = π_θ(tok) / π_old(tok)                                     π_old = the behaviour log-probs stored
                                                                      with each step (on-policy rollouts)
    L     = −(1/N_tok) Σ min(ρ A, clip(ρ, 1−ε_low, 1+ε_high) A) + β_KL (1/N_tok) Σ KL_k3(π_θ ‖ π_ref)

GRPO: ε_low = ε_high = 0.2. DAPO: ε_high = 0.28 and groups whose rewards are all equal are dropped.

The recipe:
  0. warm start: expert demos -> BC; π_0 = π_ref = the BC policy.
  for update k = 1..K:
  1. take the next `tasks_per_update` training tasks (split order, or `task_order: shuffled`) and play G trajectories of each with π_{k−1}
     (temperature T, behaviour log-probs stored with every step);
  2. R_i = final reward (optionally minus an invalid-action penalty), A_i = group-normalised R_i;
     DAPO drops all-equal groups;
  3. broadcast A_i to the reply tokens, compute π_ref's log-probs of the same tokens;
  4. minimise L over the batch (ppo_epochs passes, constant lr, one AdamW state kept across updates);
  5. checkpoint; every eval_every updates evaluate greedily (eval/update-k) with the env steps used so far.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentevo import dist
from agentevo.algorithms import losses
from agentevo.algorithms.advantages import group_normalise
from agentevo.algorithms.bc import warm_start
from agentevo.algorithms.grpo.config import GRPOConfig
from agentevo.data.tensors import (
    StepSample,
    collate,
    forward_logits,
    packing_collate,
    trajectory_samples,
)
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.errors import AgentevoError, ConfigError
from agentevo.eval import diagnostics
from agentevo.eval.metrics import summarize
from agentevo.files import finish_interrupted_swap, replacing_dir
from agentevo.models import placement
from agentevo.models.backend import (
    DamagedCheckpointError,
    Sampling,
    TransformersPolicy,
    verify_manifest,
    write_manifest,
)
from agentevo.models.policy import with_lora
from agentevo.rollout.engine import EpisodeRequest, PolicyActor

if TYPE_CHECKING:
    from agentevo.run import Run

LossFn = Callable[[Any, dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]


# ---------------------------------------------------------------------------------------------------------------
# 1. Groups of rollouts


def update_tasks(tasks: Sequence[Task], k: int, n: int) -> list[Task]:
    """The n training tasks of update k (1-based): consecutive in the fixed list, wrapping around."""
    return [tasks[((k - 1) * n + j) % len(tasks)] for j in range(n)]


def task_order(tasks: Sequence[Task], order: str, seed: int) -> list[Task]:
    """The list `update_tasks` walks: the split as it is, or one permutation of it fixed by the run's seed."""
    out = list(tasks)
    if order == "shuffled":
        random.Random(seed * 104729 + 17).shuffle(out)
    return out


def group_requests(tasks: Sequence[Task], group_size: int, meta: dict[str, Any] | None = None) -> list[EpisodeRequest]:
    """G requests per task; slot = i·G + g, and meta records the group so it survives the store."""
    return [
        EpisodeRequest(task, i * group_size + g, meta={**(meta or {}), "group": i, "member": g})
        for i, task in enumerate(tasks)
        for g in range(group_size)
    ]


def split_groups(trajs: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories grouped by meta['group'] (group order, members in slot order)."""
    groups: dict[int, list[Trajectory]] = {}
    for traj in sorted(trajs, key=lambda t: t.meta.get("slot", 0)):
        groups.setdefault(int(traj.meta["group"]), []).append(traj)
    return [groups[g] for g in sorted(groups)]


# ---------------------------------------------------------------------------------------------------------------
# 2. Outcome advantages


def flagged(step: Step, cfg: GRPOConfig) -> bool:
    """Whether the step counts as an invalid action for the penalty (by its signal)."""
    return cfg.invalid_penalty > 0 and step.signal in cfg.penalty_signals


def group_returns(group: Sequence[Trajectory], cfg: GRPOConfig) -> torch.Tensor:
    """R_i per trajectory; in penalty_mode 'return' minus coef x the number of flagged steps [P:verl-agent]."""
    out = []
    for traj in group:
        r = traj.final_reward
        if cfg.penalty_mode == "return":
            r -= cfg.invalid_penalty * sum(flagged(s, cfg) for s in traj.steps)
        out.append(r)
    return torch.tensor(out, dtype=torch.float32)


def outcome_advantages(returns: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor | None:
    """Group-normalised advantages of one group, or None when DAPO drops it (all rewards equal)."""
    if cfg.drop_groups and bool((returns == returns[0]).all()):
        return None
    # All-equal groups under plain GRPO get zeros (group_normalise), i.e. only the KL term acts on them.
    return group_normalise(returns, eps=cfg.adv_eps)


def step_penalties(traj: Trajectory, cfg: GRPOConfig) -> list[float]:
    """Per-step advantage offsets: −coef on flagged steps in penalty_mode 'step', else zeros."""
    if cfg.penalty_mode != "step":
        return [0.0] * traj.length
    return [-cfg.invalid_penalty if flagged(s, cfg) else 0.0 for s in traj.steps]


# ---------------------------------------------------------------------------------------------------------------
# 3. Training rows with per-token advantages, behaviour and reference log-probs


def label_sample(sample: StepSample, token_adv: dict[int, list[float]]) -> StepSample:
    """Attach per-token advantages (by step t) and the behaviour log-probs (π_old) to a training row."""
    if sample.behaviour_logprobs is None:
        raise ValueError("GRPO trains on the policy's own rollouts: every step needs its behaviour log-probs")
    adv: list[float] = []
    for (start, end), t in zip(sample.spans, sample.steps, strict=True):
        values = token_adv[t]
        if len(values) != end - start:
            raise ValueError(f"step {t}: {len(values)} advantages for a reply of {end - start} tokens")
        adv.extend(values)
    sample.token_labels["adv"] = adv
    sample.token_labels["old_logp"] = list(sample.behaviour_logprobs)
    return sample


def outcome_samples(renderer: Any, traj: Trajectory, traj_index: int, a_env: float, cfg: GRPOConfig, window: int,
                    max_length: int) -> list[StepSample]:
    """GRPO rows of one trajectory: A_i (+ step penalty) on every reply token."""
    offsets = step_penalties(traj, cfg)
    token_adv = {s.t: [a_env + offsets[s.t - 1]] * len(s.action_ids) for s in traj.steps}
    return [label_sample(s, token_adv) for s in trajectory_samples(renderer, traj, traj_index, window, max_length)]


@torch.no_grad()
def add_ref_logprobs(ref_model: Any, samples: list[StepSample], pad_id: int, micro_batch_size: int) -> None:
    """token_labels['ref_logp']: π_ref's log-prob of every reply token (computed once per update)."""
    from agentevo.data.tensors import reply_logprobs

    ref_model.eval()
    device = next(ref_model.parameters()).device
    for start in range(0, len(samples), micro_batch_size):
        chunk = samples[start : start + micro_batch_size]
        batch = collate(chunk, pad_id)
        logp, _ = reply_logprobs(ref_model, {k: v.to(device) for k, v in batch.items()})
        logp = logp.cpu()
        for row, s in enumerate(chunk):
            s.token_labels["ref_logp"] = [v for a, b in s.spans for v in logp[row, a:b].tolist()]


# ---------------------------------------------------------------------------------------------------------------
# 4. The loss and the policy update


def grpo_loss(cfg: GRPOConfig) -> LossFn:
    """Clipped-ratio objective against the behaviour log-probs plus β·k3 KL to the reference, aggregated per cfg."""

    def loss_fn(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        logits = forward_logits(model, batch)
        picked = losses.token_logprobs(logits, batch["input_ids"])
        logp = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)  # aligned to input positions
        mask = batch["action_mask"]
        pg, clip = losses.clipped_ratio_objective(logp, batch["old_logp"], batch["adv"], mask, cfg.eps_low,
                                                  cfg.clip_high, cfg.loss_agg)
        kl = losses.aggregate(losses.kl_k3(logp, batch["ref_logp"]), mask, cfg.loss_agg)
        loss = pg + cfg.beta_kl * kl
        stats = {"pg_loss": float(pg.detach()), "kl": float(kl.detach()), "tokens": float(mask.sum()),
                 **{k: float(v) for k, v in clip.items()}}
        if cfg.log_entropy:
            with torch.no_grad():
                ent = losses.token_entropy(logits[:, :-1])
                ent = torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)
                stats["entropy"] = float(losses.aggregate(ent, mask, "token-mean"))
        return loss, stats

    return loss_fn


class PolicyTrainer:
    """The trained policy, its AdamW state kept across updates, and atomic save/restore of both.

    Under `accelerate launch` (DDP only: rank 0 rolls out with the same in-memory model, which FSDP / ZeRO-3 would
    shard) the model and optimiser are prepared once; each optimiser batch's micro-batches are dealt round-robin to
    the ranks and every rank's loss is scaled so that DDP's mean over ranks is the single-process gradient.
    """

    def __init__(self, policy: TransformersPolicy, run_cfg: Any, cfg: GRPOConfig) -> None:
        self.policy, self.cfg = policy, cfg
        self.lora = run_cfg.model.lora.enabled
        self.model = with_lora(policy, run_cfg)
        self.collate = packing_collate(self.model) if run_cfg.optim.padding_free else collate
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.params = params
        # Constant lr, one optimiser for the whole run: RL updates are a stream, not separate fine-tunings [O].
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=run_cfg.optim.betas,
                                           weight_decay=run_cfg.optim.weight_decay)
        self.accelerator: Any = None
        self.world, self.rank = dist.world_size(), dist.rank()

    def distribute(self) -> None:
        """Prepare model and optimiser for DDP (call after restore(); a no-op with one process)."""
        if self.world == 1 or self.accelerator is not None:
            return
        from accelerate import Accelerator
        from accelerate.utils import DistributedType

        dist.ensure_group()
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available())
        if self.accelerator.distributed_type not in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU):
            raise ConfigError(
                f"GRPO / Self-Guide under accelerate launch need DDP (configs/accelerate/ddp.yaml), not "
                f"{self.accelerator.distributed_type.value}: rank 0 rolls out with the trained model, which FSDP / "
                "ZeRO-3 shard; use the DDP config (with LoRA for large models)")
        self.wrapped, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)

    def _local_micro_batches(self, micro: list[list[int]]) -> list[tuple[list[int], float]]:
        """This rank's micro-batches of one optimiser batch and their loss scales (a zero-weight stand-in when
        the batch has fewer micro-batches than ranks, so every rank takes part in DDP's all-reduce)."""
        if self.world == 1:
            return [(ids, 1.0) for ids in micro]
        mine = [(ids, float(self.world)) for j, ids in enumerate(micro) if j % self.world == self.rank]
        return mine or [(micro[0], 0.0)]

    def update(self, samples: list[StepSample], loss_fn: LossFn, seed: int,
               on_step: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, float]:
        """ppo_epochs shuffled passes in optimiser batches of cfg.batch_size rows; returns the mean statistics."""
        cfg = self.cfg
        self.distribute()
        model = self.model if self.accelerator is None else self.wrapped
        rng = random.Random(seed)
        device = next(self.model.parameters()).device
        records: list[dict[str, float]] = []
        model.train()
        for _ in range(cfg.ppo_epochs):
            order = list(range(len(samples)))
            rng.shuffle(order)
            for start in range(0, len(order), cfg.batch_size):
                batch_ids = order[start : start + cfg.batch_size]
                micro = [batch_ids[j : j + cfg.micro_batch_size] for j in range(0, len(batch_ids), cfg.micro_batch_size)]
                self.optimizer.zero_grad()
                acc: dict[str, float] = {}
                local = self._local_micro_batches(micro)
                for n, (ids, scale) in enumerate(local):
                    batch = {k: v.to(device) for k, v in self.collate([samples[i] for i in ids], self.policy.pad_id).items()}
                    sync = self.accelerator is None or n == len(local) - 1
                    with contextlib.nullcontext() if sync else self.accelerator.no_sync(model):
                        # the precision the reference and behaviour log-probs were scored in (model.dtype auto:
                        # bf16 autocast on bf16 hardware), as train() does for every other policy update
                        with placement.autocast():
                            loss, stats = loss_fn(model, batch)
                        # Micro-batches of a short last batch weigh by their share of its rows.
                        (loss * (scale * len(ids) / len(batch_ids))).backward()
                    counted = 1.0 if scale else 0.0  # a stand-in micro-batch adds nothing to the record
                    for key, v in {"loss": float(loss.detach()), **stats}.items():
                        # token counts add up over micro-batches; everything else is a row-weighted mean
                        share = 1.0 if key == "tokens" else len(ids) / len(batch_ids)
                        acc[key] = acc.get(key, 0.0) + counted * v * share
                acc = self._sum_over_ranks(acc, device)
                acc["grad_norm"] = self._clip(cfg.grad_clip) if cfg.grad_clip > 0 else 0.0
                self.optimizer.step()
                records.append(acc)
                if on_step is not None:
                    on_step(len(records), acc)
        self.model.eval()
        return {k: sum(r[k] for r in records) / len(records) for k in records[0]} if records else {}

    def _sum_over_ranks(self, acc: dict[str, float], device: torch.device) -> dict[str, float]:
        """Each rank's share of the batch statistics, added up: the same record on every rank."""
        if self.accelerator is None:
            return acc
        keys = sorted(acc)  # the same keys on every rank: every rank runs at least one micro-batch
        sums = torch.tensor([acc[k] for k in keys], dtype=torch.float64, device=device)
        return dict(zip(keys, self.accelerator.reduce(sums, reduction="sum").tolist(), strict=True))

    def _clip(self, max_norm: float) -> float:
        if self.accelerator is None:
            return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        return float(self.accelerator.clip_grad_norm_(self.wrapped.parameters(), max_norm))

    # -- checkpoints ---------------------------------------------------------------------------------
    def save(self, path: Path, state: dict[str, Any]) -> None:
        """Write model (adapter when LoRA), tokenizer, optimiser and `state` to path atomically."""
        with replacing_dir(path) as tmp:
            self.model.save_pretrained(tmp / "model")
            self.policy.tokenizer.save_pretrained(tmp / "model")
            torch.save({"optimizer": self.optimizer.state_dict()}, tmp / "optimizer.pt")
            (tmp / "state.json").write_text(json.dumps(state))
            write_manifest(tmp)

    def restore(self, path: Path) -> dict[str, Any] | None:
        """Load weights and optimiser from a save() folder; returns its state, or None when there is none.

        The files are checked against the folder's manifest first and optimizer.pt is read with weights_only=True
        (nothing in it runs); a damaged or refused checkpoint is a one-line error, since the updates it stands
        for are already recorded in state.json and cannot be replayed from an earlier point.
        """
        if not (finish_interrupted_swap(path) / "state.json").exists():
            return None
        from safetensors.torch import load_file

        fix = (f"move {path} aside and restore it from a copy, or start the run again; the recorded updates need "
               "these weights")
        try:
            verify_manifest(path)
        except DamagedCheckpointError as exc:
            raise AgentevoError(f"{exc} ({fix})") from None
        try:
            blob = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
            state = json.loads((path / "state.json").read_text())
        except pickle.UnpicklingError:
            raise AgentevoError(f"refusing to load {path / 'optimizer.pt'}: it holds objects other than tensors and "
                                f"plain values, so it is damaged or was crafted (loading it could run code); {fix}"
                                ) from None
        except (OSError, RuntimeError, ValueError, EOFError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise AgentevoError(f"checkpoint {path} is damaged ({first}); {fix}") from None
        if self.lora:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, load_file(str(path / "model" / "adapter_model.safetensors")))
        else:
            missing, unexpected = self.model.load_state_dict(load_file(str(path / "model" / "model.safetensors")),
                                                             strict=False)
            if unexpected or [k for k in missing if "lm_head" not in k]:
                raise RuntimeError(f"{path} does not match the policy (missing {missing}, unexpected {unexpected})")
        self.optimizer.load_state_dict(blob["optimizer"])
        return state

    def export(self, path: Path) -> None:
        """A plain save_pretrained folder of the current policy (LoRA merged into a copy) for `agentevo eval`."""
        if not self.lora:
            self.policy.save(path)
            return
        import copy

        from agentevo.models.backend import save_pretrained_atomic

        merged = copy.deepcopy(self.model).merge_and_unload()
        save_pretrained_atomic(merged, self.policy.tokenizer, path)


# ---------------------------------------------------------------------------------------------------------------
# 5. Logging and evaluation


def rollout_stats(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Success, return, length, signal rates and env steps of a rollout batch (prefixed 'rollout_')."""
    return {f"rollout_{k}": float(v) for k, v in summarize(list(trajs)).items()}


def evaluate_with(run: Run, actor: Any, label: str, pool: Any, extra: dict[str, Any] | None = None
                  ) -> dict[str, dict[str, Any]]:
    """Evaluation like Run.evaluate, with a given actor and env pool; `extra` is added to each split."""
    return run.evaluate_actor(actor, label, pool=pool, extra=extra)


def plot_success_vs_env_steps(run: Run, points: list[tuple[str, dict[str, dict[str, Any]]]], name: str) -> Path | None:
    """plots/<name>.png: held-out success against the training env steps, one line per split."""
    rows = [(m.get("train_env_steps", 0), split, m["success_rate"]) for _, res in points for split, m in res.items()
            if isinstance(m, dict) and "success_rate" in m]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for split in sorted({r[1] for r in rows}):
        pts = sorted((x, y) for x, s, y in rows if s == split)
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=split)
    ax.set_xlabel("training env steps")
    ax.set_ylabel("success rate (%)")
    ax.set_title(f"{run.cfg.method}: held-out success ({run.cfg.eval.protocol}) vs env steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = run.dir / "plots" / f"{name}.png"
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def eval_due(k: int, cfg: GRPOConfig) -> bool:
    """Evaluate after every eval_every updates and after the last one."""
    return k % cfg.eval_every == 0 or k == cfg.n_updates


def rollout_seed(run_seed: int, k: int) -> int:
    """The sampling seed of update k's collection (fresh per update, reproducible per run seed)."""
    return run_seed * 1_000_003 + k * 7919


def check_on_policy_backend(run: Run) -> None:
    """On-policy updates need a generator that can take each update's weights: transformers or vLLM."""
    if run.cfg.model.backend == "http":
        raise ConfigError(f"{run.cfg.method} rolls out with the policy it is training, but model.backend: http talks "
                          "to a server that keeps its own weights; use model.backend: vllm (weights refreshed every "
                          "update) or transformers")


def acting_policy(run: Run, trainer: PolicyTrainer, k: int) -> Any:
    """π_{k−1}, which rolls out update k: the trained model itself with model.backend transformers; with vLLM the
    weights after update k−1 loaded into the run's engine in place, from their evaluation export
    (checkpoints/update-{k−1}) when update k−1 was evaluated, else exported to checkpoints/rollout."""
    if run.cfg.model.backend == "transformers":
        return trainer.policy
    if k == 1:
        return run.rollout_policy("bc", policy_id="bc")
    name = f"update-{k - 1}"
    if not run.checkpoint_dir(name).exists():  # written atomically by run_updates' evaluation
        name = "rollout"
        trainer.export(run.checkpoint_dir(name))
    return run.rollout_policy(name, policy_id=f"update-{k - 1}")


DIAG_KEYS = ("zero_var_frac", "zero_var_won_frac", "kl", "clip_frac_low", "clip_frac_high", "guide_agreement",
             "guide_steps", "verdict_auc_success", "guide_format_error_rate", "verdict_good_on_flagged", "flagged_judged")


def update_diagnostics(record: dict[str, Any]) -> dict[str, Any]:
    """The numbers of diagnostics.policy_update (and Self-Guide's agreement, calibration and guide format) out of an
    update's record."""
    return {k: record[k] for k in DIAG_KEYS if record.get(k) is not None}


def group_diagnostics(groups: Sequence[Sequence[Trajectory]], cfg: GRPOConfig) -> dict[str, Any]:
    """Fraction of groups whose returns (as the advantages see them) are all equal: no GRPO signal; and of them,
    the groups in which every episode succeeded (solved tasks, graded apart from starved ones)."""
    returns = [group_returns(g, cfg).tolist() for g in groups]
    frac = diagnostics.zero_variance_fraction(returns)
    if frac is None:
        return {}
    won = diagnostics.all_won_fraction(returns, [[bool(t.success) for t in g] for g in groups])
    return {"zero_var_frac": frac, "zero_var_won_frac": won}


@dataclass
class Labelled:
    """One update's rollouts and training rows (with per-token advantages), and method-specific log fields."""

    trajs: list[Trajectory]
    t_rollout: float  # when the rollouts finished (perf_counter)
    samples: list[StepSample] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class UpdateLoop:
    """What the GRPO-style update loop trains and where it checkpoints."""

    policy: Any
    ref_model: Any
    trainer: PolicyTrainer
    latest: Path
    done: int  # updates finished before this process started (from the checkpoint)
    loss_fn: Callable[..., Any]
    log_name: str


def start_update_loop(run: Run, log_name: str) -> tuple[UpdateLoop, list[Task]]:
    """π_0 = π_ref = the BC checkpoint, the trainer resumed from checkpoints/latest, and the training tasks in the
    order the updates take them (grpo.task_order)."""
    cfg, g = run.cfg, run.cfg.grpo
    check_on_policy_backend(run)
    policy = run.load_policy("bc", policy_id="bc")
    ref_model = run.load_policy("bc").model.eval().requires_grad_(False)
    trainer = PolicyTrainer(policy, cfg, g)
    latest = run.checkpoint_dir("latest")
    done = (trainer.restore(latest) or {}).get("update", 0)
    loop = UpdateLoop(policy, ref_model, trainer, latest, done, grpo_loss(g), log_name)
    return loop, task_order(run.tasks("train"), g.task_order, cfg.seed)


def run_updates(
    run: Run,
    loop: UpdateLoop,
    rollout_and_label: Callable[[int, Any], Labelled],
    evaluate: Callable[[int, Any, dict[str, Any]], dict[str, dict[str, Any]]],
    results: dict[str, Any],
    eval_points: list[tuple[str, dict[str, dict[str, Any]]]],
) -> None:
    """Updates 1..n_updates, each a resumable phase: rollouts + labels (method-specific), reference log-probs,
    the clipped-ratio update, a checkpoint (weights + optimiser), then the record; evaluations when due."""
    cfg, g = run.cfg, run.cfg.grpo
    # Under accelerate launch only rank 0 plays episodes: the other ranks get its labelled rows and train with it.
    with run.pool() if run.main else contextlib.nullcontext(None) as pool:
        for k in range(1, g.n_updates + 1):
            if k > loop.done:

                def do_update(k: int = k) -> dict[str, Any]:
                    loop.policy.policy_id = f"update-{k - 1}" if k > 1 else "bc"
                    t0 = time.perf_counter()
                    labelled = dist.broadcast(rollout_and_label(k, pool) if run.main else None)
                    add_ref_logprobs(loop.ref_model, labelled.samples, loop.policy.pad_id, g.micro_batch_size)
                    t2 = time.perf_counter()
                    with run.progress(f"update {k}: policy update") as bar:
                        stats = loop.trainer.update(labelled.samples, loop.loss_fn, cfg.seed + k,
                                                    lambda s, r: bar.advance())
                    t3 = time.perf_counter()
                    trajs = labelled.trajs
                    prev = run.state.get(f"update-{k - 1}", {}).get("train_env_steps", 0) if k > 1 else 0
                    record = {
                        **rollout_stats(trajs), **stats, "groups_kept": 0, **labelled.extra,
                        "samples": len(labelled.samples),
                        "train_env_steps": prev + sum(s.parsed_action is not None for t in trajs for s in t.steps),
                        "time_rollout_s": labelled.t_rollout - t0, "time_advantage_s": t2 - labelled.t_rollout,
                        "time_update_s": t3 - t2,
                    }
                    record = dist.broadcast(record)  # rank 0's timings on every rank
                    diag_name = f"diag/{loop.log_name.split('/')[0]}"
                    for name in (loop.log_name, diag_name):  # a kill after logging but before the save: once only
                        run.logger.drop_after(name, k - 1)
                    run.logger.log(loop.log_name, k, record)
                    # Premise diagnostics of the update under fixed names (diag/grpo, diag/selfguide).
                    run.logger.log(diag_name, k, update_diagnostics(record))
                    if run.main:
                        loop.trainer.save(loop.latest, {"update": k, "record": record})
                    dist.barrier()
                    return record

                run.phase(f"update-{k}", do_update, all_ranks=True)
            elif f"update-{k}" not in run.state:
                # Crashed after the checkpoint but before the phase was recorded: take the record from it.
                run.phase(f"update-{k}", lambda: json.loads((loop.latest / "state.json").read_text())["record"])
            if eval_due(k, g):
                steps = run.state[f"update-{k}"]["train_env_steps"]

                def do_eval(k: int = k, steps: int = steps) -> dict[str, dict[str, Any]]:
                    loop.trainer.export(run.checkpoint_dir(f"update-{k}"))
                    return evaluate(k, pool, {"train_env_steps": steps, "update": k})

                results[f"eval/update-{k}"] = run.phase(f"eval/update-{k}", do_eval)
                eval_points.append((f"update-{k}", results[f"eval/update-{k}"]))
            results[f"update-{k}"] = run.state[f"update-{k}"]


# ---------------------------------------------------------------------------------------------------------------
# The recipe


def run(run: Run) -> dict[str, Any]:
    """GRPO (or DAPO) from the BC warm start; returns the evaluation table and per-update statistics."""
    cfg, g = run.cfg, run.cfg.grpo
    # 0. Warm start: π_0 = π_ref = BC.
    results: dict[str, Any] = dict(warm_start(run))
    loop, train_tasks = start_update_loop(run, "grpo/update")
    policy, trainer = loop.policy, loop.trainer
    window, max_len = cfg.agent.history_window, cfg.optim.max_length
    eval_points: list[tuple[str, dict[str, dict[str, Any]]]] = [("bc", results["eval/bc"])]

    def rollout_and_label(k: int, pool: Any) -> Labelled:
        # 1. G rollouts per task with the current policy.
        actor = PolicyActor(acting_policy(run, trainer, k), run.signal_env.instruction(), window,
                            Sampling(g.temperature, g.top_p, cfg.agent.max_new_tokens, seed=rollout_seed(cfg.seed, k)))
        requests = group_requests(update_tasks(train_tasks, k, g.tasks_per_update), g.group_size)
        trajs = run.collect(actor, requests, f"update-{k}/collect", f"update {k}: rollouts", pool=pool)
        t_rollout = time.perf_counter()
        # 2. Outcome advantages, broadcast to reply tokens.
        out = Labelled(trajs, t_rollout)
        groups = split_groups(trajs)
        out.extra["groups"] = len(groups)
        out.extra.update(group_diagnostics(groups, g))
        for group in groups:
            adv = outcome_advantages(group_returns(group, g), g)
            if adv is None:
                continue
            out.extra["groups_kept"] = out.extra.get("groups_kept", 0) + 1
            for traj, a in zip(group, adv.tolist(), strict=True):
                out.samples += outcome_samples(policy.renderer, traj, len(out.samples), a, g, window, max_len)
        return out

    def evaluate(k: int, pool: Any, extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
        actor = PolicyActor(policy, run.signal_env.instruction(), window, run.eval_sampling())
        return evaluate_with(run, actor, f"update-{k}", pool, extra)

    run_updates(run, loop, rollout_and_label, evaluate, results, eval_points)
    plot = plot_success_vs_env_steps(run, eval_points, "success_vs_env_steps")
    results["plots"] = [str(plot)] if plot else []
    return results
