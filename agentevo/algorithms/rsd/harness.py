"""Harness@Inf (methods-spec §5, RSD table): no training; the base model reads privileged context at inference.

1. the base plays one trajectory per training task (as RSD's round 1 would): the bank B;
2. lessons per task type are written from B (rsd.writer);
3. greedy evaluation with the context that exists before acting - precedents ranked from B by content-word
   overlap, and the lessons - placed at the rule's position [I: reflection and future hindsight need a finished
   episode, so they cannot be given at inference].
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from agentevo.algorithms.rsd.context import ContextRule, evaluate_with_context, lesson_inputs, pre_action_context_fn
from agentevo.algorithms.rsd.recipe import eval_splits, prepare_base, round_tasks, sampling_actor
from agentevo.algorithms.rsd.writers import make_writer
from agentevo.eval.metrics import summarize
from agentevo.rollout.engine import EpisodeRequest

if TYPE_CHECKING:
    from agentevo.run import Run


def run(run: Run) -> dict[str, Any]:
    """Harness@Inf end to end; returns the evaluation table."""
    cfg, rsd = run.cfg, run.cfg.rsd
    base, results = prepare_base(run)
    tasks = round_tasks(run, 1)

    def bank() -> dict[str, Any]:
        actor = sampling_actor(run, base, cfg.seed * 7919)
        return summarize(run.collect(actor, [EpisodeRequest(t, k) for k, t in enumerate(tasks)], "harness/bank",
                                     "harness: bank"))

    results["harness/bank"] = run.phase("harness/bank", bank)
    trajs = run.store.load(collection="harness/bank")

    def lessons() -> dict[str, str]:
        writer = make_writer(rsd, run.load_policy(base) if rsd.writer == "policy" else None)
        groups = lesson_inputs(trajs, rsd.lessons_from, rsd.lessons_per_outcome, random.Random(cfg.seed))
        return {tt: writer.lessons(tt, wins, losses) for tt, (wins, losses) in groups.items()}

    written = run.phase("harness/lessons", lessons)
    rule = ContextRule.from_config(rsd)

    def evaluate() -> dict[str, Any]:
        policy = run.load_policy(base)
        fn = pre_action_context_fn(trajs, written, rule, rsd, policy.tokenizer)
        return evaluate_with_context(run, policy, "harness", eval_splits(cfg), fn, rule.position)

    results["eval/harness"] = run.phase("eval/harness", evaluate)
    return results
