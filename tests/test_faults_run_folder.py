"""Run folders have one owner, are never silently reused, and `agentevo eval` never touches another run (issue 18)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentevo.cli import main
from agentevo.config import load_config
from agentevo.errors import AgentevoError, ConfigError
from agentevo.run import Run

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _error(capsys: Any, argv: list[str]) -> str:
    """The one error line of a CLI call that must fail with status 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err[len("error: "):]


def _make(tmp_path: Path, name: str | None = "r", overwrite: bool = False, *sets: str) -> Run:
    cfg = load_config(None, ["env.n_train=2", *sets], name=name, output_dir=str(tmp_path))
    return Run.create(cfg, quiet=True, overwrite=overwrite)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "a\\b", "ABSOLUTE"])
def test_a_run_name_is_one_folder_under_the_output_dir(capsys, tmp_path, name: str) -> None:  # noqa: ANN001
    out = tmp_path / "runs"
    name = str(tmp_path / "abs") if name == "ABSOLUTE" else name
    for command in (["train"], ["eval", "--model", "configs"]):  # eval: refused before it looks at the model
        err = _error(capsys, [*command, "--name", name, "--output-dir", str(out)])
        assert err == (f"run name {name!r} must be one folder name under {str(out)!r} (not empty, '.', '..', an "
                       "absolute path or anything with '/' or '\\'); give e.g. --name my-run")
        assert list(tmp_path.iterdir()) == []  # nothing was created, inside or outside the output dir


def test_a_second_process_is_refused_while_the_owner_runs_and_the_lock_dies_with_it(tmp_path) -> None:  # noqa: ANN001
    run = _make(tmp_path)
    d = tmp_path / "r"
    (d / "keep.txt").write_text("mine")
    owner = json.loads((d / "owner.json").read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    try:
        # another process: resume, and a train --overwrite that would empty the folder, are both refused
        out = _python(
            "import sys\nfrom agentevo.cli import main\n"
            f"a = main(['resume', {str(d)!r}, '--quiet'])\n"
            f"b = main(['train', '--name', 'r', '--output-dir', {str(tmp_path)!r}, '--overwrite', '--quiet'])\n"
            "print(a, b)\n")
        assert out.stdout.split() == ["2", "2"], out.stderr
        lines = out.stderr.strip().splitlines()
        expected = (f"error: run folder {str(d)!r} is in use by pid {os.getpid()} on {socket.gethostname()} "
                    f"(`{owner['command']}`, since {owner['started']}); wait for it to end (or stop it), "
                    "or pick another --name")
        assert lines == [expected, expected]
        assert (d / "keep.txt").read_text() == "mine" and (d / "config.yaml").exists()
    finally:
        run.close()
    assert not (d / "owner.json").exists()  # a clean close takes the owner record with the lock

    # a holder that dies without closing (SIGKILL) leaves no stale lock behind
    out = _python(f"import os, signal\nfrom agentevo.run import Run\nr = Run.open({str(d)!r}, quiet=True)\n"
                  "print(r.dir, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert out.returncode == -signal.SIGKILL and out.stdout.strip() == str(d), out.stderr
    assert json.loads((d / "owner.json").read_text())["pid"] != os.getpid()  # the dead holder's record is left
    again = Run.open(d, quiet=True)
    try:
        assert json.loads((d / "owner.json").read_text())["pid"] == os.getpid()
    finally:
        again.close()


def test_an_in_process_second_run_on_a_held_folder_is_refused(tmp_path) -> None:  # noqa: ANN001
    run = _make(tmp_path)
    try:
        with pytest.raises(AgentevoError, match=rf"is in use by pid {os.getpid()} "):
            Run.open(tmp_path / "r", quiet=True)
    finally:
        run.close()
    Run.open(tmp_path / "r", quiet=True).close()  # released by close()


def test_train_refuses_an_existing_name_and_overwrite_starts_over(capsys, monkeypatch, tmp_path) -> None:  # noqa: ANN001
    _make(tmp_path, "r", False, "seed=3").close()
    d = tmp_path / "r"
    config = (d / "config.yaml").read_bytes()
    (d / "state.json").write_text(json.dumps({"expert": {"n": 2}}))
    (d / "checkpoints").mkdir()
    (d / "checkpoints" / "old.txt").write_text("old")
    err = _error(capsys, ["train", "--name", "r", "--output-dir", str(tmp_path), "--set", "seed=4"])
    assert err == (f"run folder {str(d)!r} already exists; continue it with `agentevo resume {d}`, pick another "
                   "--name, or add --overwrite to start it over")
    assert (d / "config.yaml").read_bytes() == config and (d / "checkpoints" / "old.txt").exists()

    seen: dict[str, Any] = {}

    def fake_recipe(run: Run) -> int:
        files = sorted(p.name for p in run.dir.iterdir() if not p.name.startswith("experience.db-"))  # sqlite WAL
        seen.update(state=dict(run.state), files=files, seed=run.cfg.seed)
        run.close()
        return 0

    monkeypatch.setattr("agentevo.cli._run_recipe", fake_recipe)
    assert main(["train", "--name", "r", "--output-dir", str(tmp_path), "--set", "seed=4", "--overwrite"]) == 0
    assert list(seen["state"]) == ["machine"] and len(seen["state"]["machine"]) == 1  # the old phases are gone
    assert seen["files"] == [".lock", "config.yaml", "experience.db", "owner.json", "state.json"] and seen["seed"] == 4
    assert yaml.safe_load((d / "config.yaml").read_text())["seed"] == 4


def test_a_folder_that_is_not_a_run_is_never_used_or_emptied(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "compare").mkdir()
    (tmp_path / "compare" / "compare.md").write_text("table")
    for overwrite in (False, True):
        with pytest.raises(ConfigError) as info:
            _make(tmp_path, "compare", overwrite)
        assert str(info.value) == (f"{str(tmp_path / 'compare')!r} exists and is not a run folder (no config.yaml); "
                                   "pick another --name (or --output-dir)")
    assert sorted(p.name for p in (tmp_path / "compare").iterdir()) == [".lock", "compare.md"]

    # a store seeded by `agentevo import` (no config.yaml yet) is where a new run starts: it is kept
    from agentevo.data.store import ExperienceStore
    from agentevo.data.types import Step, Trajectory
    from agentevo.envs.base import Task

    (tmp_path / "seeded").mkdir()
    store = ExperienceStore(tmp_path / "seeded" / "experience.db")
    task = Task("twx-cookingworld", "t0", "train", "cookingworld", {}, 5)
    store.add(Trajectory(task, "expert", "file", "Instr.", [Step(1, "obs", "Action: look", [5], [0.0], "look",
                                                               "next", 0.0, True)], 1.0, True), "expert", 1_000_000)
    store.close()
    run = _make(tmp_path, "seeded")
    try:
        assert run.store.count("expert") == 1
    finally:
        run.close()


def test_unnamed_runs_started_in_the_same_second_get_their_own_folders(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setattr("agentevo.run.time.strftime", lambda fmt, *a: "20260101-000000")
    first, second = _make(tmp_path, None), _make(tmp_path, None)
    first.close()
    second.close()
    assert (first.dir.name, second.dir.name) == ("bc-twx-cookingworld-20260101-000000",
                                                 "bc-twx-cookingworld-20260101-000000-2")


def test_a_truncated_state_file_is_a_one_line_error(capsys, tmp_path) -> None:  # noqa: ANN001
    _make(tmp_path).close()
    state = tmp_path / "r" / "state.json"
    state.write_text('{"expert": {"n": 2, "succ')
    err = _error(capsys, ["resume", str(tmp_path / "r"), "--quiet"])
    assert err == (f"{str(state)!r} is not a valid state file (truncated or edited?); restore it, or start the run "
                   "again with `agentevo train ... --name r --overwrite`")
    state.write_text('{"expert": {"n": 2}}')
    run = Run.open(tmp_path / "r", quiet=True)  # the failed open released the folder
    try:
        assert run.state["expert"] == {"n": 2} and len(run.state["machine"]) == 1  # this start's record added
    finally:
        run.close()


def test_envs_play_ends_cleanly_at_end_of_input_and_on_ctrl_c(capsys, monkeypatch) -> None:  # noqa: ANN001
    def eof(prompt: str = "") -> str:
        raise EOFError

    def ctrl_c(prompt: str = "") -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", eof)
    assert main(["envs", "play", "searchqa"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "Traceback" not in captured.out
    monkeypatch.setattr("builtins.input", ctrl_c)
    assert main(["envs", "play", "searchqa"]) == 130
    captured = capsys.readouterr()
    assert captured.out.endswith("\nstopped\n") and captured.err == ""


def test_ctrl_c_names_the_run_folder_to_resume(capsys, monkeypatch, tmp_path) -> None:  # noqa: ANN001
    def interrupted(run: Run) -> int:
        run.close()
        raise KeyboardInterrupt

    monkeypatch.setattr("agentevo.cli._run_recipe", interrupted)
    assert main(["train", "--name", "k", "--output-dir", str(tmp_path), "--quiet"]) == 130
    assert capsys.readouterr().err == f"interrupted; continue with `agentevo resume {tmp_path / 'k'}`\n"
    assert main(["resume", str(tmp_path / "k"), "--quiet"]) == 130
    assert capsys.readouterr().err == f"interrupted; continue with `agentevo resume {tmp_path / 'k'}`\n"

    def ctrl_c(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr("agentevo.cli.cmd_envs", ctrl_c)  # no run folder made: no resume hint (none left over)
    assert main(["envs", "list"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


# -- agentevo eval ------------------------------------------------------------------------------------------------

DEMO_ENV = {"name": "twx-cookingworld", "params": {
    "max_steps": 2, "game_params": {"numLocations": 1, "numIngredients": 1, "numDistractorItems": 2, "includeDoors": 0}}}
EVAL = ["--quiet", "--n", "1", "--set", "env.params.max_steps=2", "--set", "agent.max_new_tokens=3",
        "--set", "rollout.n_parallel=1", "--set", "rollout.workers=thread"]


def _train_folder(tmp_path: Path, name: str, policy: Any) -> Path:
    """A training run's folder (method bc, the demo's one-room games) with a checkpoint named bc."""
    d = tmp_path / name
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump({"method": "bc", "name": name, "env": DEMO_ENV}))
    policy.save(d / "checkpoints" / "bc")
    return d / "checkpoints" / "bc"


def _eval_keys(tmp_path: Path) -> dict[str, Any]:
    return {k: v for k, v in json.loads((tmp_path / "ev" / "state.json").read_text()).items() if k.startswith("eval/")}


def test_eval_label_is_keyed_by_weights_and_settings(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    import torch

    from agentevo.eval.metrics import checkpoint_digest, eval_label

    a = _train_folder(tmp_path, "a", tiny_policy)
    b = tmp_path / "b" / "bc"
    tiny_policy.save(b)
    settings = {"env": DEMO_ENV, "eval": {"splits": ["test"], "n_tasks": 1}}
    assert checkpoint_digest(a) == checkpoint_digest(b) and eval_label(a, settings) == eval_label(b, settings)
    assert eval_label(a, settings).startswith("bc-") and len(eval_label(a, settings)) == len("bc-") + 8
    assert eval_label(a, {**settings, "eval": {"splits": ["dev"], "n_tasks": 1}}) != eval_label(a, settings)
    assert eval_label(a, {**settings, "eval": {"splits": ["test"], "n_tasks": 2}}) != eval_label(a, settings)
    with torch.no_grad():
        next(tiny_policy.model.parameters()).add_(0.01)
    try:
        tiny_policy.save(b)
    finally:
        with torch.no_grad():
            next(tiny_policy.model.parameters()).sub_(0.01)
    assert eval_label(b, settings) != eval_label(a, settings)  # same folder name, other weights


def test_eval_never_touches_another_run_and_caches_only_its_own_key(capsys, tiny_policy, tmp_path) -> None:  # noqa: ANN001
    import sqlite3

    import torch

    ckpt = _train_folder(tmp_path, "train", tiny_policy)
    config = (tmp_path / "train" / "config.yaml").read_bytes()
    demo = ["-c", "configs/demo_twx_bc.yaml", "--output-dir", str(tmp_path)]
    err = _error(capsys, ["eval", "--model", str(ckpt), "--name", "train", *demo, *EVAL])
    assert err == (f"{str(tmp_path / 'train')!r} is the folder of a bc run; `agentevo eval` never writes into "
                   "another run's folder: pick another --name")
    assert (tmp_path / "train" / "config.yaml").read_bytes() == config
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == [".lock", "checkpoints", "config.yaml"]

    def collections() -> dict[str, int]:
        with sqlite3.connect(tmp_path / "ev" / "experience.db") as conn:
            return dict(conn.execute("SELECT collection, COUNT(*) FROM trajectories GROUP BY collection").fetchall())

    assert main(["eval", "--model", str(ckpt), "--name", "ev", *demo, *EVAL]) == 0
    out = capsys.readouterr()
    assert "warning" not in out.err  # the training run's own games: no warning
    (test_key,) = _eval_keys(tmp_path)
    assert test_key.startswith("eval/bc-") and test_key[len("eval/"):] in out.out  # the table shows the label
    assert list(_eval_keys(tmp_path)[test_key]) == ["test"] and collections() == {f"{test_key}/test": 1}
    assert yaml.safe_load((tmp_path / "ev" / "config.yaml").read_text())["method"] == "eval"

    # another split is evaluated anew, not answered with the cached test result
    assert main(["eval", "--model", str(ckpt), "--name", "ev", "--split", "dev", *demo, *EVAL]) == 0
    dev_key = next(k for k in _eval_keys(tmp_path) if k != test_key)
    assert list(_eval_keys(tmp_path)[dev_key]) == ["dev"] and collections()[f"{dev_key}/dev"] == 1

    # another model whose checkpoint folder is also called bc: its own evaluation, never the first one's numbers
    with torch.no_grad():
        next(tiny_policy.model.parameters()).add_(0.5)
    try:
        other = _train_folder(tmp_path, "other", tiny_policy)
    finally:
        with torch.no_grad():
            next(tiny_policy.model.parameters()).sub_(0.5)
    assert main(["eval", "--model", str(other), "--name", "ev", *demo, *EVAL]) == 0
    assert len(_eval_keys(tmp_path)) == 3 and len(collections()) == 3

    # the same evaluation again is answered from its own cache: no new key, no new episode
    before = _eval_keys(tmp_path)
    assert main(["eval", "--model", str(ckpt), "--name", "ev", *demo, *EVAL]) == 0
    assert _eval_keys(tmp_path) == before and sum(collections().values()) == 3
    capsys.readouterr()

    # the default CookingWorld games are not the ones the checkpoint was trained on: a one-line warning says so
    assert main(["eval", "--model", str(ckpt), "--name", "ev", "--output-dir", str(tmp_path), *EVAL]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: {ckpt} was trained (in {tmp_path / 'train'}) with other twx-cookingworld settings: "
                        f"env.params game_params differ(s), so these are not its games; evaluate with its settings, "
                        f"e.g. -c {tmp_path / 'train' / 'config.yaml'}"]


def test_report_reads_a_run_that_is_going_on_without_its_trackers(tmp_path: Path) -> None:
    """`agentevo report` takes no lock and starts no tracker: it works beside the running owner, and on a machine
    without the run's tracker packages."""
    from agentevo.run import RunLock

    cfg = load_config(None, [f"output_dir={tmp_path}", "name=live"])
    Run.create(cfg, quiet=True).close()
    config = tmp_path / "live" / "config.yaml"
    config.write_text(config.read_text().replace("report_to: []", "report_to:\n  - a-tracker-not-installed-here"))
    owner = RunLock(tmp_path / "live")  # the training process still holds its folder
    try:
        assert main(["report", str(tmp_path / "live")]) == 0
    finally:
        owner.release()
    assert (tmp_path / "live" / "report.md").exists()
    assert "a-tracker-not-installed-here" in config.read_text()  # the run's config is not rewritten
