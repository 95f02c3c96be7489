"""BoN-16 + SFT (rejection-sampling fine-tuning; methods-spec §5, RSD table).

1. from the base, sample bon_n trajectories per training task (rsd.rollout_temperature);
2. keep the successful ones (success filter) [S]; the report's diagnostics (diag/bon_sft) say how many practised
   tasks were solved, how many kept samples are on tasks without a demo, and how clean their steps are;
3. SFT (NLL) on their own reply ids, one round [O]; with rsd.bon_with_expert, on the expert demos too [O];
4. evaluate greedily without context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentevo.algorithms.bc import expert_samples, nll_loss
from agentevo.algorithms.rsd import prepare_base, round_tasks, sampling_actor
from agentevo.data.tensors import trajectory_samples
from agentevo.data.types import Trajectory
from agentevo.eval.metrics import summarize
from agentevo.rollout.engine import EpisodeRequest
from agentevo.train.finetune import finetune

if TYPE_CHECKING:
    from agentevo.run import Run


def bon_premise_numbers(samples: list[Trajectory], demo_task_ids: set[str]) -> dict[str, float | None]:
    """The numbers the report's BoN diagnostics read (diag/bon_sft): the share of practised tasks solved at least
    once, the share of kept successes on tasks without an expert demo, and the invalid-action rate of kept steps."""
    kept = [t for t in samples if t.success]
    tasks = {t.task.task_id for t in samples}
    kept_steps = [s for t in kept for s in t.steps]
    return {
        "pass_at_n": len({t.task.task_id for t in kept}) / max(1, len(tasks)),
        "kept": len(kept),
        "kept_new_task_share": (sum(t.task.task_id not in demo_task_ids for t in kept) / len(kept)) if kept else None,
        "kept_invalid_rate": (sum(s.signal == "invalid" for s in kept_steps) / len(kept_steps)) if kept_steps else None,
    }


def run(run: Run) -> dict[str, Any]:
    """BoN-N + SFT end to end; returns the evaluation table."""
    cfg, rsd = run.cfg, run.cfg.rsd
    base, results = prepare_base(run)
    # The same tasks RSD's first round draws, so the two spend their rollouts on the same tasks.
    tasks = round_tasks(run, 1)

    def collect() -> dict[str, Any]:
        actor = sampling_actor(run, base, cfg.seed * 7919)
        requests = [EpisodeRequest(t, k * rsd.bon_n + i, meta={"sample": i})
                    for k, t in enumerate(tasks) for i in range(rsd.bon_n)]
        trajs = run.collect(actor, requests, "bon/samples", f"BoN-{rsd.bon_n} samples")
        premise = bon_premise_numbers(trajs, {t.task.task_id for t in run.store.load(collection="expert")})
        run.logger.log("diag/bon_sft", 1, premise)
        return {**summarize(trajs), "tasks": len(tasks), f"pass@{rsd.bon_n}": premise["pass_at_n"]}

    results["bon/collect"] = run.phase("bon/collect", collect)

    def sft() -> dict[str, Any]:
        kept = run.store.load(collection="bon/samples", success=True)
        if not kept:
            return {"samples": 0, "skipped": "no successful sample"}
        policy = run.load_policy(base)
        window, max_length = cfg.agent.history_window, cfg.optim.max_length
        demos = [t for t in run.store.load(collection="expert") if t.success] if rsd.bon_with_expert else []
        samples = expert_samples(policy, demos, window, max_length)
        samples += [s for k, t in enumerate(kept, start=len(demos))
                    for s in trajectory_samples(policy.renderer, t, k, window, max_length)]
        stats = finetune(run, policy, samples, nll_loss, "bon-sft")
        return {**stats, "samples": len(samples), "trajectories": len(kept), "expert_trajectories": len(demos)}

    results["bon-sft"] = run.phase("bon-sft", sft, all_ranks=True)
    final = "bon-sft" if results["bon-sft"].get("samples") else base
    results["eval/bon-sft"] = run.phase("eval/bon-sft", lambda: run.evaluate(run.rollout_policy(final), final))
    return results
