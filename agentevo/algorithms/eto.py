"""ETO (Song et al. 2024): explore, pair agent failures with expert successes, DPO; iterate (methods-spec §5).

Starting from SFT (π_0 = checkpoints/bc), iteration i = 1..n_iters:

 1. Explore: play every training task once with π_{i-1} at T=0.7.
 2. Pair each agent trajectory with the expert's for the same task by final reward:
      agent < expert -> chosen = expert, rejected = agent cut to len(expert) + 5 turns;
      agent > expert -> chosen = agent,  rejected = expert;      ties are dropped.
 3. Reference: log π_ref(y) = log π_{i-1}(y), summed over every reply token of the trajectory, computed once.
 4. DPO on the pairs (prompt = instruction + first observation; the loss covers all reply turns):
      L = −log σ(β[(log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))])
    with β = 0.1, lr = 1e-6 in iteration 1 and β = 0.5, lr = 5e-7 later; constant-with-warmup schedule.
 5. Evaluate π_i (greedy) and count the environment steps spent so far.

Expert replies are tokenized with the policy's tokenizer; agent replies keep the token ids they were sampled as.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from agentevo import dist
from agentevo.algorithms import losses
from agentevo.algorithms.bc import warm_start
from agentevo.data.tensors import StepSample, collate, reply_logprobs, trajectory_samples
from agentevo.data.types import Trajectory
from agentevo.eval.diagnostics import format_drift
from agentevo.eval.metrics import summarize
from agentevo.models.backend import Sampling, TransformersPolicy
from agentevo.rollout.engine import EpisodeRequest, PolicyActor
from agentevo.train.finetune import finetune

if TYPE_CHECKING:
    from agentevo.run import Run

# -- 2. preference pairs -------------------------------------------------------------------------


@dataclass
class PairSpec:
    """A trajectory-level preference: which trajectory is chosen, which rejected, and why."""

    task_id: str
    chosen: Trajectory
    rejected: Trajectory
    kind: str  # "lose" (agent below expert: expert chosen) or "win" (agent above expert: agent chosen)


def truncate(traj: Trajectory, n_steps: int) -> Trajectory:
    """The trajectory's first n_steps turns (a shallow copy; steps are shared)."""
    return dataclasses.replace(traj, steps=traj.steps[:n_steps])


def preference_pairs(
    expert: dict[str, Trajectory], agent: list[Trajectory], extra_turns: int | None
) -> tuple[list[PairSpec], dict[str, int]]:
    """ETO's pairs (construct_preference.py) and the win / tie / lose / no-expert counts."""
    pairs: list[PairSpec] = []
    counts = {"win": 0, "tie": 0, "lose": 0, "no_expert": 0}
    for traj in agent:
        gold = expert.get(traj.task.task_id)
        if gold is None or not gold.steps or not traj.steps:
            counts["no_expert"] += 1
            continue
        if traj.final_reward < gold.final_reward:
            counts["lose"] += 1
            # A failed exploration can run to max_steps; ETO cuts it so the rejected side is not mostly padding
            # of wandering turns the chosen side never had.
            rejected = traj if extra_turns is None else truncate(traj, gold.length + extra_turns)
            pairs.append(PairSpec(traj.task.task_id, gold, rejected, "lose"))
        elif traj.final_reward > gold.final_reward:
            counts["win"] += 1
            pairs.append(PairSpec(traj.task.task_id, traj, gold, "win"))
        else:
            counts["tie"] += 1
    return pairs, counts


# -- 3./4. DPO on trajectory pairs ----------------------------------------------------------------


@dataclass
class PreferencePair:
    """Training rows of a pair (a trajectory is one packed row, or one row per step) and its reference sums."""

    task_id: str
    chosen: list[StepSample]
    rejected: list[StepSample]
    ref_chosen: float = 0.0
    ref_rejected: float = 0.0


def trajectory_rows(policy: TransformersPolicy, traj: Trajectory, index: int, window: int,
                    max_length: int) -> list[StepSample]:
    """Rows covering every reply of the trajectory; expert replies are tokenized with this policy's tokenizer."""
    for step in traj.steps:
        if not step.action_ids:
            step.action_ids = policy.renderer.encode_reply(step.action_text)
    return trajectory_samples(policy.renderer, traj, index, window, max_length)


def collate_pairs(pairs: list[PreferencePair], pad_id: int) -> dict[str, Any]:
    """All rows of the pairs in one padded batch, with each row's pair index and side (0 chosen, 1 rejected)."""
    rows: list[StepSample] = []
    pair_index: list[int] = []
    side: list[int] = []
    for p, pair in enumerate(pairs):
        for s, samples in ((0, pair.chosen), (1, pair.rejected)):
            rows.extend(samples)
            pair_index.extend([p] * len(samples))
            side.extend([s] * len(samples))
    batch = collate(rows, pad_id)
    batch["pair_index"] = torch.tensor(pair_index, dtype=torch.long)
    batch["side"] = torch.tensor(side, dtype=torch.long)
    batch["ref_chosen"] = torch.tensor([p.ref_chosen for p in pairs], dtype=torch.float32)
    batch["ref_rejected"] = torch.tensor([p.ref_rejected for p in pairs], dtype=torch.float32)
    return batch


def sequence_logps(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Σ log π over the reply tokens of each trajectory, shape [n_pairs, 2] (column 0 chosen, 1 rejected)."""
    logp, mask = reply_logprobs(model, batch)
    per_row = torch.where(mask.bool(), logp, torch.zeros_like(logp)).sum(dim=-1)
    n_pairs = batch["ref_chosen"].shape[0]
    # A trajectory spread over several rows (history window shorter than the episode) sums over its rows.
    slot = batch["pair_index"] * 2 + batch["side"]
    return torch.zeros(n_pairs * 2, dtype=per_row.dtype, device=per_row.device).index_add(0, slot, per_row).view(
        n_pairs, 2)


def dpo_loss_fn(beta: float) -> Any:
    """loss_fn for train(): the mean DPO loss over the pairs of a micro-batch."""

    def loss_fn(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        seq = sequence_logps(model, batch)
        per_pair, stats = losses.dpo_loss(seq[:, 0], seq[:, 1], batch["ref_chosen"], batch["ref_rejected"], beta)
        return per_pair.mean(), {k: float(v) for k, v in stats.items()}

    return loss_fn


@torch.no_grad()
def pair_logps(model: Any, pairs: list[PreferencePair], pad_id: int, micro_batch_size: int) -> list[list[float]]:
    """[Σ log π(chosen), Σ log π(rejected)] of every pair under the model as it is now."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out: list[list[float]] = []
    for start in range(0, len(pairs), micro_batch_size):
        batch = collate_pairs(pairs[start : start + micro_batch_size], pad_id)
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        out += sequence_logps(model, batch).cpu().tolist()
    model.train(was_training)
    return out


def fill_reference(model: Any, pairs: list[PreferencePair], pad_id: int, micro_batch_size: int) -> None:
    """Set each pair's reference sums from the model as it is now (π_ref = the current policy)."""
    for pair, (c, r) in zip(pairs, pair_logps(model, pairs, pad_id, micro_batch_size), strict=True):
        pair.ref_chosen, pair.ref_rejected = c, r


def dpo_diagnostics(pairs: list[PreferencePair], after: list[list[float]], beta: float) -> dict[str, float]:
    """After DPO: mean reward margin β[(Δchosen) − (Δrejected)], its accuracy, and the mean log-prob drift
    log π − log π_ref of the chosen and of the rejected trajectories (diagnostics.eto_dpo)."""
    d_c = [c - p.ref_chosen for p, (c, _) in zip(pairs, after, strict=True)]
    d_r = [r - p.ref_rejected for p, (_, r) in zip(pairs, after, strict=True)]
    n = max(1, len(pairs))
    return {"reward_margin": beta * sum(c - r for c, r in zip(d_c, d_r, strict=True)) / n,
            "reward_accuracy": sum(c > r for c, r in zip(d_c, d_r, strict=True)) / n,
            "chosen_logp_drift": sum(d_c) / n, "rejected_logp_drift": sum(d_r) / n}


def train_dpo(run: Run, policy: TransformersPolicy, specs: list[PairSpec], iteration: int,
              name: str) -> dict[str, float]:
    """DPO of the policy on the pairs with this iteration's β and lr; saves checkpoints/<name>."""
    cfg, eto = run.cfg, run.cfg.eto
    window, max_length = cfg.agent.history_window, cfg.optim.max_length
    pairs = [
        PreferencePair(s.task_id, trajectory_rows(policy, s.chosen, 2 * k, window, max_length),
                       trajectory_rows(policy, s.rejected, 2 * k + 1, window, max_length))
        for k, s in enumerate(specs)
    ]
    fill_reference(policy.model, pairs, policy.pad_id, eto.micro_batch_size)
    beta = eto.beta if iteration == 1 else eto.beta_later
    optim = dataclasses.replace(
        cfg.optim, lr=eto.lr if iteration == 1 else eto.lr_later, epochs=eto.epochs, batch_size=eto.batch_size,
        micro_batch_size=eto.micro_batch_size, warmup_ratio=eto.warmup_ratio,
    )
    stats = finetune(run, policy, pairs, dpo_loss_fn(beta), name, optim=optim, seed=cfg.seed + iteration,
                     log_phase=f"eto/iter-{iteration}/train", collate_fn=collate_pairs, schedule=eto.schedule,
                     reload_after=True)
    # Premise check: did DPO separate the pairs without pushing the chosen trajectories down?
    diag = dpo_diagnostics(pairs, pair_logps(policy.model, pairs, policy.pad_id, eto.micro_batch_size), beta)
    run.logger.log("diag/eto", iteration, diag)
    return {**stats, "beta": beta, "lr": optim.lr, "diag": diag}


# -- the recipe ----------------------------------------------------------------------------------


def _iteration(run: Run, i: int, current: str, expert: dict[str, Trajectory]) -> dict[str, Any]:
    """One ETO iteration from checkpoint `current`; returns its phases' results."""
    cfg, eto = run.cfg, run.cfg.eto
    name = f"eto-iter-{i}"
    collection = f"eto/iter-{i}/explore"

    def explore() -> dict[str, Any]:
        policy = run.load_policy(current)
        sampling = Sampling(eto.explore_temperature, eto.explore_top_p, cfg.agent.max_new_tokens,
                            seed=cfg.seed * 1000 + i)
        actor = PolicyActor(policy, run.signal_env.instruction(), cfg.agent.history_window, sampling)
        tasks = run.tasks("train")
        trajs = run.collect(actor, [EpisodeRequest(t, k) for k, t in enumerate(tasks)], collection,
                            f"{name} explore")
        m = summarize(trajs)
        return {k: m[k] for k in ("n", "success_rate", "avg_reward", "mean_steps", "env_steps")} | {
            "resets": len(trajs), "task_hash": tasks.hash}

    out: dict[str, Any] = {"explore": run.phase(f"eto/iter-{i}/explore", explore)}

    def dpo() -> dict[str, Any]:
        specs, counts = preference_pairs(expert, run.store.load(collection=collection), eto.rejected_extra_turns)
        policy = run.load_policy(current)
        if not specs:  # every exploration tied its expert: nothing to prefer, the policy carries over
            policy.policy_id = name
            if run.main:
                policy.save(run.checkpoint_dir(name))
            dist.barrier()
            return {**counts, "pairs": 0}
        return {**counts, "pairs": len(specs), **train_dpo(run, policy, specs, i, name)}

    out["dpo"] = run.phase(f"eto/iter-{i}/dpo", dpo, all_ranks=True)
    out[f"eval/{name}"] = run.phase(f"eval/{name}", lambda: run.evaluate(run.rollout_policy(name), name))
    return out


def run(run: Run) -> dict[str, Any]:
    """ETO end to end: BC warm start, then n_iters of explore -> pairs -> DPO -> eval."""
    cfg = run.cfg
    results = warm_start(run)
    expert = {t.task.task_id: t for t in run.store.load(collection="expert")}
    # Env steps: the expert demos (shared with every method that starts from SFT) plus every exploration step.
    expert_steps = summarize(list(expert.values())).get("env_steps", 0)
    total = 0
    current = "bc"
    for i in range(1, cfg.eto.n_iters + 1):
        it = _iteration(run, i, current, expert)
        total += it["explore"]["env_steps"]
        record = {
            "pairs": it["dpo"]["pairs"], "win": it["dpo"]["win"], "tie": it["dpo"]["tie"],
            "lose": it["dpo"]["lose"],
            "explore_success_rate": it["explore"]["success_rate"], "explore_avg_reward": it["explore"]["avg_reward"],
            "env_steps_explore": it["explore"]["env_steps"], "env_steps_total": total + expert_steps,
            "env_steps_expert": expert_steps,
        }
        for split, metrics in it[f"eval/eto-iter-{i}"].items():
            record[f"{split}_success_rate"] = metrics["success_rate"]
            record[f"{split}_avg_reward"] = metrics["avg_reward"]
        run.logger.log("eto", i, record)
        # Does DPO keep the replies in the action format? (likelihood displacement shows here first)
        drift = format_drift(it[f"eval/eto-iter-{i}"], results.get("eval/bc") or {})
        if drift:
            run.logger.log("diag/eto", i, drift)
        results[f"eto/iter-{i}"] = {**it["explore"], **it["dpo"], "env_steps_total": total + expert_steps}
        results[f"eval/eto-iter-{i}"] = it[f"eval/eto-iter-{i}"]
        current = f"eto-iter-{i}"
    results["env_steps"] = {"expert": expert_steps, "explore": total, "total": total + expert_steps}
    return results
