"""Reflexion, 3 attempts (methods-spec §5, RSD table): no weight update, extra attempts instead.

Per evaluation task: attempt 1 with the plain prompt; after a failure the same model (rsd.writer) writes a verbal
reflection from the trajectory and its outcome; the reflections (at most 3, most recent first) are prepended to
the next attempt; stop at success or after rsd.reflexion_attempts attempts. A task counts as solved if any
attempt succeeds [S count; protocol O following Reflexion]. Attempts are greedy (eval.temperature and eval.samples do not apply).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentevo.algorithms.rsd.recipe import prepare_base
from agentevo.algorithms.rsd.writers import make_writer
from agentevo.data.types import Trajectory
from agentevo.eval.metrics import summarize
from agentevo.models.backend import Sampling
from agentevo.rollout.engine import EpisodeRequest, PolicyActor

if TYPE_CHECKING:
    from agentevo.run import Run

MAX_REFLECTIONS = 3


def reflexion_prefix(reflections: list[str]) -> str:
    """The context of the next attempt: earlier reflections, most recent first."""
    if not reflections:
        return ""
    lines = [f"{k + 1}. {text}" for k, text in enumerate(reflections[:MAX_REFLECTIONS])]
    return "Reflections on your earlier attempts at this task (most recent first):\n" + "\n".join(lines) + "\n"


def reflexion_split(run: Run, policy: Any, writer: Any, split: str) -> dict[str, Any]:
    """Up to rsd.reflexion_attempts attempts per task of a split; metrics of the final attempt per task."""
    cfg = run.cfg
    tasks = run.tasks(split, cfg.eval.n_tasks)
    actor = PolicyActor(policy, run.signal_env.instruction(), cfg.agent.history_window,
                        Sampling(temperature=0.0, max_new_tokens=cfg.agent.max_new_tokens))
    reflections: dict[int, list[str]] = {k: [] for k in range(len(tasks))}
    final: dict[int, Trajectory] = {}
    solved_after: list[float] = []
    for attempt in range(1, cfg.rsd.reflexion_attempts + 1):
        todo = [k for k in range(len(tasks)) if not (k in final and final[k].success)]
        if todo:
            requests = [EpisodeRequest(tasks[k], k, prefix=reflexion_prefix(reflections[k])) for k in todo]
            trajs = run.collect(actor, requests, f"reflexion/{split}/attempt-{attempt}",
                                f"reflexion {split} attempt {attempt}")
            failed = []
            for traj in trajs:
                final[traj.meta["slot"]] = traj
                if not traj.success:
                    failed.append(traj)
            for traj, text in zip(failed, writer.reflections(failed), strict=True):
                reflections[traj.meta["slot"]].insert(0, text)
        solved_after.append(sum(t.success for t in final.values()) / max(1, len(tasks)))
    metrics = {**summarize([final[k] for k in sorted(final)]), "task_hash": tasks.hash, "split": split}
    metrics.update({f"success_at_{a + 1}": v for a, v in enumerate(solved_after)})
    run.logger.log(f"eval/reflexion/{split}", 0, {k: v for k, v in metrics.items() if k != "split"})
    return metrics


def run(run: Run) -> dict[str, Any]:
    """Reflexion end to end on the evaluation splits; returns the evaluation table."""
    base, results = prepare_base(run)

    def evaluate() -> dict[str, Any]:
        policy = run.load_policy(base)
        writer = make_writer(run.cfg.rsd, policy)
        return {split: reflexion_split(run, policy, writer, split) for split in run.cfg.eval.splits}

    results["eval/reflexion"] = run.phase("eval/reflexion", evaluate)
    return results
