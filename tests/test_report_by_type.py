"""Run reports break each evaluation down by task type when the tasks span several types."""

from __future__ import annotations

from agentevo.data.store import ExperienceStore
from agentevo.data.types import Trajectory
from agentevo.envs.base import Task
from agentevo.eval.report import _task_type_lines


def _traj(task_type: str, k: int, reward: float, success: bool) -> Trajectory:
    task = Task("scienceworld", f"scienceworld/test/{task_type}/{k}", "test", task_type)
    return Trajectory(task, "self", "bc", "instr", [], reward, success)


def test_task_type_table_has_mean_reward_and_success_per_type(tmp_path) -> None:  # noqa: ANN001
    store = ExperienceStore(tmp_path / "experience.db")
    for k, (ttype, r, s) in enumerate([("find-plant", 0.2, False), ("lifespan", 1.0, True), ("find-plant", 0.5, False),
                                       ("lifespan", 0.3, False)]):
        store.add(_traj(ttype, k, r, s), "eval/bc/test", k)
    store.add(_traj("find-plant", 9, 1.0, True), "eval/round-1/test", 0)
    rows = [("bc", "test", {}), ("round-1", "test", {})]
    lines = _task_type_lines(store, rows)
    assert "| task type | bc (test) | round-1 (test) |" in lines
    # find-plant under bc: rewards 0.2, 0.5 -> 0.350, 0 of 2 solved; lifespan: (1.0 + 0.3) / 2 = 0.650, 1 of 2
    assert "| find-plant | 0% / 0.350 (n=2) | 100% / 1.000 (n=1) |" in lines
    assert "| lifespan | 50% / 0.650 (n=2) | - |" in lines
    single = ExperienceStore(tmp_path / "one.db")
    single.add(_traj("find-plant", 0, 0.1, False), "eval/bc/test", 0)
    assert _task_type_lines(single, [("bc", "test", {})]) == []
    store.close()
    single.close()
