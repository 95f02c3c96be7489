"""Recipes train on every task the env keeps: env.n_train is applied by the env (per task type for ScienceWorld)."""

from __future__ import annotations

from agentevo.algorithms import bc
from agentevo.algorithms.qlass import tree_task_indices
from agentevo.config import load_config


def test_expert_demos_cover_every_training_task_the_env_keeps(tmp_path) -> None:  # noqa: ANN001
    from agentevo.run import Run

    cfg = load_config(None, ["env.n_train=2", "env.n_test=1", "env.params={max_steps: 15}",
                             f"output_dir={tmp_path}", "name=per-type"], method="bc")
    run = Run.create(cfg, quiet=True)
    try:
        # A per-type limit (ScienceWorld: n_train per task type) keeps more tasks than env.n_train says.
        run.signal_env.limits["train"] = 4
        assert len(run.tasks("train")) == 4
        demos = bc.collect_expert(run, cfg.bc.n_expert)
        assert sorted(d.task.task_id for d in demos) == sorted(t.task_id for t in run.tasks("train"))
    finally:
        run.close()


def test_tree_task_indices_first_and_spread() -> None:
    assert tree_task_indices(100, 20, "first") == list(range(20))
    assert tree_task_indices(100, 20, "spread") == list(range(0, 100, 5))
    assert tree_task_indices(10, 3, "spread") == [0, 3, 6]
    assert tree_task_indices(10, None, "spread") == list(range(10))
    assert tree_task_indices(4, 9, "first") == [0, 1, 2, 3]
