"""RSD-table baselines that use gold trajectories (methods-spec §5): GT-SFT and GT-OPSD.

GT-SFT   SFT of the base on the gold trajectories of the training tasks (same lr/epochs as the SFT recipe) [S/O].
GT-OPSD  RSD's loss, teacher schedule and rounds unchanged, but the teacher's privileged context is the task's
         gold trajectory instead of the retrospective context [S; mechanism P:OPSD].
Both start from the same base as RSD (rsd.prepare_base), so the numbers compare.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from agentevo.algorithms.bc import expert_samples, nll_loss
from agentevo.algorithms.rsd.recipe import prepare_base, rsd_rounds
from agentevo.data.types import Trajectory
from agentevo.eval.metrics import summarize
from agentevo.rollout.engine import EpisodeRequest, ExpertActor
from agentevo.train.finetune import finetune

if TYPE_CHECKING:
    from agentevo.run import Run


class _TextOnly:
    """Gold replies are stored as text; the policy's tokenizer fills in ids when they are trained on."""

    def encode_reply(self, text: str) -> list[int]:
        return []


def collect_gold(run: Run) -> dict[str, Trajectory]:
    """The environment's gold trajectory for every training task (collection 'gold'), completed ones only."""
    tasks = run.tasks("train")
    trajs = run.collect(ExpertActor(_TextOnly(), run.cfg.agent.thoughts),
                        [EpisodeRequest(t, k) for k, t in enumerate(tasks)], "gold", "gold trajectories")
    return {t.task.task_id: t for t in trajs if t.success}


def run_gt_sft(run: Run) -> dict[str, Any]:
    """GT-SFT: base -> NLL on gold trajectories -> checkpoints/gt-sft -> eval."""
    cfg = run.cfg
    base, results = prepare_base(run)
    results["gold"] = run.phase("gold", lambda: summarize(list(collect_gold(run).values())))

    def sft() -> dict[str, Any]:
        gold = list(collect_gold(run).values())
        policy = run.load_policy(base)
        samples = expert_samples(policy, gold, cfg.agent.history_window, cfg.optim.max_length)
        optim = dataclasses.replace(cfg.optim, epochs=cfg.rsd.gt_epochs or cfg.optim.epochs)
        stats = finetune(run, policy, samples, nll_loss, "gt-sft", optim=optim)
        return {**stats, "samples": len(samples)}

    results["gt-sft"] = run.phase("gt-sft", sft, all_ranks=True)
    results["eval/gt-sft"] = run.phase("eval/gt-sft", lambda: run.evaluate(run.load_policy("gt-sft"), "gt-sft"))
    return results


def run_gt_opsd(run: Run) -> dict[str, Any]:
    """GT-OPSD: RSD's rounds with the gold trajectory as the teacher's privileged context (no rule search)."""
    base, results = prepare_base(run)
    results["gold"] = run.phase("gold", lambda: summarize(list(collect_gold(run).values())))
    gold = collect_gold(run)
    missing = [t.task_id for t in run.tasks("train") if t.task_id not in gold]
    if missing:
        # Tasks without a completed gold trajectory cannot be taught; they are dropped from the rounds [O].
        run.logger.log("gt_opsd/gold", 0, {"tasks_without_gold": len(missing)})
    return {**results, **rsd_rounds(run, base, label="gt_opsd", gold=gold)}
