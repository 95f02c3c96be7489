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


def test_grpo_task_order_sequential_or_one_seeded_permutation() -> None:
    import pytest

    from agentevo.algorithms.grpo.recipe import task_order, update_tasks
    from agentevo.envs.base import Task
    from agentevo.errors import ConfigError

    tasks = [Task(env="e", task_id=f"t{k}", split="train", task_type="a") for k in range(10)]
    assert task_order(tasks, "sequential", 0) == tasks
    shuffled = task_order(tasks, "shuffled", 0)
    assert sorted(t.task_id for t in shuffled) == sorted(t.task_id for t in tasks) and shuffled != tasks
    assert task_order(tasks, "shuffled", 0) == shuffled  # fixed by the seed: a resumed run takes the same tasks
    assert task_order(tasks, "shuffled", 1) != shuffled
    # updates walk the permutation: 10 tasks, 4 per update -> update 3 wraps to the permutation's start
    assert update_tasks(shuffled, 3, 4) == [*shuffled[8:], *shuffled[:2]]
    with pytest.raises(ConfigError, match="grpo.task_order must be one of sequential, shuffled"):
        load_config(None, ["grpo.task_order=random"], method="grpo")


def test_qevolve_tasks_per_round_draws_a_fixed_subset_per_round(tmp_path) -> None:  # noqa: ANN001
    from agentevo.algorithms.qevolve.recipe import self_tasks
    from agentevo.run import Run

    cfg = load_config(None, ["env.n_train=8", "env.n_test=1", "env.params={max_steps: 15}", "qevolve.tasks_per_round=3",
                             f"output_dir={tmp_path}", "name=draw"], method="qevolve")
    run = Run.create(cfg, quiet=True)
    try:
        train_ids = [t.task_id for t in run.tasks("train")]
        draws = [[t.task_id for t in self_tasks(run, r)] for r in (1, 2, 3)]
        assert all(len(d) == 3 == len(set(d)) and set(d) <= set(train_ids) for d in draws)
        assert len({tuple(d) for d in draws}) > 1  # a fresh draw each round
        assert [t.task_id for t in self_tasks(run, 1)] == draws[0]  # the same draw when a round resumes
        assert self_tasks(run, 1).hash != run.tasks("train").hash  # the report names the subset it played
        run.cfg.qevolve.tasks_per_round = None
        assert [t.task_id for t in self_tasks(run, 1)] == train_ids  # null: every training task, as the paper
    finally:
        run.close()


def test_warm_start_model_path_relative_or_absolute_is_one_folder(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """bc.warm_start_from compares model.path by folder: 'models/x' from the working directory equals its absolute
    path; another folder or a missing one does not."""
    from agentevo.algorithms.bc import _same_folder

    (tmp_path / "models/x").mkdir(parents=True)
    (tmp_path / "models/y").mkdir()
    monkeypatch.chdir(tmp_path)
    assert _same_folder("models/x", str(tmp_path / "models/x"))
    assert _same_folder("./models/x/", "models/x")
    assert not _same_folder("models/x", str(tmp_path / "models/y"))
    assert not _same_folder("models/z", "models/z") and not _same_folder(None, "models/x")
