"""BoN-16 + SFT (rejection-sampling fine-tuning; methods-spec §5, RSD table).

1. from the base, sample bon_n trajectories per training task (rsd.rollout_temperature);
2. keep the successful ones (success filter) [S]; the report's diagnostics (diag/bon_sft) say how many practised
   tasks were solved, how many kept samples are on tasks without a demo, and how clean their steps are;
3. SFT (NLL) from the base on their own reply ids [O]; with rsd.bon_with_expert, on the expert demos too [O];
4. evaluate greedily without context;
5. with rsd.bon_rounds > 1, the latest round's policy samples the next round's tasks (a fresh draw) and each
   round's SFT, again from the base, trains on every round's kept samples so far (expert iteration) [O].

With rsd.bon_with_wins false, step 1 is skipped and step 3 trains on the demos alone (the continued-BC control:
the same fine-tune without the practice) [O].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentevo.algorithms.bc import expert_samples, nll_loss
from agentevo.algorithms.rsd.recipe import prepare_base, round_tasks, sampling_actor
from agentevo.data.types import Trajectory
from agentevo.envs.base import Task
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


def round_names(r: int) -> tuple[str, str, str, str]:
    """Round r's collect phase, sample collection, checkpoint and evaluation phase (round 1 keeps the one-round
    names, so a one-round run reads as before)."""
    if r == 1:
        return "bon/collect", "bon/samples", "bon-sft", "eval/bon-sft"
    return f"bon/collect-{r}", f"bon/samples-{r}", f"bon-sft-{r}", f"eval/bon-sft-{r}"


def run(run: Run) -> dict[str, Any]:
    """BoN-N + SFT end to end (rsd.bon_rounds rounds); returns the evaluation table."""
    cfg, rsd = run.cfg, run.cfg.rsd
    base, results = prepare_base(run)
    demo_ids = {t.task.task_id for t in run.store.load(collection="expert")}
    actor_checkpoint = base
    for r in range(1, rsd.bon_rounds + 1):
        collect_phase, collection, checkpoint, eval_phase = round_names(r)
        # Round 1 plays the tasks RSD's first round draws, so the two spend their rollouts on the same tasks.
        tasks = round_tasks(run, r)

        def collect(actor_checkpoint: str = actor_checkpoint, tasks: list[Task] = tasks, collection: str = collection,
                    r: int = r) -> dict[str, Any]:
            actor = sampling_actor(run, actor_checkpoint, cfg.seed * 7919 + r - 1)
            requests = [EpisodeRequest(t, k * rsd.bon_n + i, meta={"sample": i})
                        for k, t in enumerate(tasks) for i in range(rsd.bon_n)]
            label = f"BoN-{rsd.bon_n} samples" + (f", round {r}" if rsd.bon_rounds > 1 else "")
            trajs = run.collect(actor, requests, collection, label)
            premise = bon_premise_numbers(trajs, demo_ids)
            run.logger.log("diag/bon_sft", r, premise)
            return {**summarize(trajs), "tasks": len(tasks), f"pass@{rsd.bon_n}": premise["pass_at_n"],
                    "actor": actor_checkpoint}

        if rsd.bon_with_wins:
            results[collect_phase] = run.phase(collect_phase, collect)

        def sft(r: int = r, checkpoint: str = checkpoint) -> dict[str, Any]:
            kept = ([t for k in range(1, r + 1) for t in run.store.load(collection=round_names(k)[1], success=True)]
                    if rsd.bon_with_wins else [])
            demos = [t for t in run.store.load(collection="expert") if t.success] if rsd.bon_with_expert else []
            if not (kept if rsd.bon_with_wins else demos):
                return {"samples": 0, "skipped": "no successful sample" if rsd.bon_with_wins else "no successful demo"}
            policy = run.load_policy(base)
            window, max_length = cfg.agent.history_window, cfg.optim.max_length
            # kept samples carry the ids they were generated with; only the demos' text replies get tokenized
            samples = expert_samples(policy, [*demos, *kept], window, max_length)
            stats = finetune(run, policy, samples, nll_loss, checkpoint)
            return {**stats, "samples": len(samples), "trajectories": len(kept), "expert_trajectories": len(demos)}

        results[checkpoint] = run.phase(checkpoint, sft, all_ranks=True)
        if results[checkpoint].get("samples"):
            actor_checkpoint = checkpoint
        final = actor_checkpoint
        results[eval_phase] = run.phase(eval_phase, lambda final=final: run.evaluate(run.rollout_policy(final), final))
    return results
