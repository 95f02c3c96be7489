"""agentevo archive: a run's record without weights, which compare reads exactly as it reads the run."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from agentevo.cli import main
from agentevo.data.archive import archive_run
from agentevo.data.store import ExperienceStore
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.errors import ConfigError
from agentevo.eval.compare import compare
from agentevo.eval.metrics import eval_collection


def _traj(task_id: str, label: str, won: int, n_steps: int) -> Trajectory:
    steps = [Step(t, f"obs {t}", f"Action: press {t}", [5, 6, t], [-0.5, -0.25, -1.0], f"press {t}", f"next {t}",
                  0.0, t == n_steps, info={"guide": "Next: press"}) for t in range(1, n_steps + 1)]
    return Trajectory(Task("probe-guide", task_id, "test", "lights"), "self", label, "", steps, float(won), bool(won),
                      goal=f"light {task_id}")


def _run(root: Path, name: str, wins: dict[str, list[int]]) -> Path:
    """A finished-looking run: record files, lock file, a checkpoint, evaluations per label (tasks t0, t1, ...) and
    one training collection of 3 trajectories."""
    run = root / name
    (run / "checkpoints" / "update-1").mkdir(parents=True)
    (run / "checkpoints" / "update-1" / "model.safetensors").write_bytes(b"\0" * 4096)
    (run / "plots").mkdir()
    (run / "plots" / "success.png").write_bytes(b"png")
    (run / "config.yaml").write_text("method: grpo\nenv:\n  name: probe-guide\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    (run / "owner.json").write_text('{"pid": 1}')
    state = {f"eval/{label}": {"test": {"success_rate": sum(w) / len(w), "avg_reward": sum(w) / len(w)}}
             for label, w in wins.items()}
    (run / "state.json").write_text(json.dumps(state))
    store = ExperienceStore(run / "experience.db")
    for k in range(3):
        store.add(_traj(f"t{k}", "bc", k % 2, 4), "update-1/rollouts", k)
    for label, w in wins.items():
        for k, won in enumerate(w):
            store.add(_traj(f"t{k}", label, won, 2), eval_collection(label, "test"), k)
    store.close()
    return run


def _counts(db: Path) -> tuple[int, int, list[str]]:
    con = sqlite3.connect(db)
    try:
        n_traj = con.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0]
        n_steps = con.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
        colls = [r[0] for r in con.execute("SELECT DISTINCT collection FROM trajectories ORDER BY collection")]
    finally:
        con.close()
    return n_traj, n_steps, colls


def test_archive_keeps_the_record_and_the_evaluations_and_compare_reads_it_alike(tmp_path: Path) -> None:
    base = _run(tmp_path / "runs", "a-s0", {"bc": [0, 0, 1, 0], "update-1": [1, 0, 1, 0]})
    arm = _run(tmp_path / "runs", "b-s0", {"bc": [0, 0, 1, 0], "update-1": [1, 1, 1, 1]})
    out = tmp_path / "archive"
    summary = archive_run(arm, out)
    dest = out / "b-s0"
    assert summary.path == dest
    # record files and plots are copied; the lock file and the checkpoints are not
    assert sorted(p.name for p in dest.iterdir()) == ["config.yaml", "experience.db", "metrics.jsonl", "plots",
                                                      "state.json"]
    assert (dest / "state.json").read_text() == (arm / "state.json").read_text()
    # 2 evaluations x 4 tasks with 2 steps each; the 3 rollouts of update-1 (4 steps each) are left out
    assert _counts(dest / "experience.db") == (8, 16, ["eval/bc/test", "eval/update-1/test"])
    assert (summary.trajectories, summary.collections, summary.left_out) == (8, 2, 3)
    assert not list(dest.glob("experience.db-*"))  # one file: no WAL or shared-memory file beside it
    # the stored steps come back as written: token ids, log-probs and the method's info
    store = ExperienceStore(dest / "experience.db")
    (traj,) = [t for t in store.load(collection="eval/update-1/test") if t.task.task_id == "t2"]
    assert traj.steps[1].action_ids == [5, 6, 2] and traj.steps[1].logprobs == [-0.5, -0.25, -1.0]
    assert traj.steps[0].info == {"guide": "Next: press"} and traj.success and traj.goal == "light t2"
    store.close()
    # compare pairs the archive with the baseline exactly as it pairs the run: update-1 is +50 (t1 and t3 won)
    archive_run(base, out)
    from_runs = compare([base, arm], "test", tmp_path / "c1", baseline="a")
    from_archive = compare([out / "a-s0", out / "b-s0"], "test", tmp_path / "c2", baseline="a")
    assert from_archive.paired_table == from_runs.paired_table and from_archive.table == from_runs.table
    assert "+50.0" in from_archive.paired_table


def test_archive_of_chosen_collections_without_steps_replaces_an_older_one(tmp_path: Path) -> None:
    run = _run(tmp_path / "runs", "g-s1", {"bc": [1, 0]})
    out = tmp_path / "archive"
    archive_run(run, out)
    (out / "g-s1" / "stale.txt").write_text("from an older archive")
    summary = archive_run(run, out, collections=["update-%", "eval/bc/%"], steps=False)
    assert not (out / "g-s1" / "stale.txt").exists() and not (out / "g-s1.old").exists()
    assert _counts(out / "g-s1" / "experience.db") == (5, 0, ["eval/bc/test", "update-1/rollouts"])
    assert (summary.trajectories, summary.left_out, summary.steps) == (5, 0, False)
    # the run itself is untouched: still every trajectory and step
    assert _counts(run / "experience.db") == (5, 16, ["eval/bc/test", "update-1/rollouts"])


def test_archive_errors_name_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a run folder .* give runs/NAME"):
        archive_run(tmp_path / "empty", tmp_path / "out")
    run = _run(tmp_path, "r-s0", {"bc": [1]})
    with pytest.raises(ConfigError, match="onto itself; pick another folder"):
        archive_run(run, tmp_path)
    with pytest.raises(ConfigError, match="at least one --collection pattern"):
        archive_run(run, tmp_path / "out", collections=[])
    assert main(["archive", str(run), "--out", str(tmp_path / "out")]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{run} -> {tmp_path / 'out' / 'r-s0'}: 1 trajectory in 1 collection (with their steps)")
    assert line.endswith("left out: checkpoints and 3 other trajectories")
    assert main(["archive", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    assert "is not a run folder" in capsys.readouterr().err
