"""What a run records about its machine: parsing, idle cores, the busy warning, resume threads, the report lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentevo import machine
from agentevo.config import load_config
from agentevo.eval.report import write_report
from agentevo.run import Run

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 sha_ni
processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 sha_ni
"""


def test_cpuinfo_gives_the_model_and_the_features_that_matter() -> None:
    assert machine.parse_cpuinfo(CPUINFO) == ("AMD EPYC 9R14", ["avx2", "avx512f", "avx512_bf16"])
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16\nCPU implementer\t: 0x41\n"
    assert machine.parse_cpuinfo(arm) == (None, [])  # no model name line, none of FEATURES
    assert machine.parse_cpuinfo("flags : amx_bf16 avx512f\n") == (None, ["avx512f", "amx_bf16"])


def test_busy_cores_come_from_two_proc_stat_readings() -> None:
    before = machine.cpu_times("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 50 0 25 400 25 0 0 0 0 0\n")
    after = machine.cpu_times("cpu  200 0 100 850 50 0 0 0 0 0\n")
    assert before == (150, 1000)  # busy = user + nice + system + irq + softirq + steal; idle + iowait idle
    assert after == (300, 1200)
    assert machine.busy_cores(before, after, 2) == pytest.approx(2 * 150 / 200)  # 1.5 of 2 cores busy
    assert machine.cpu_times("intr 1 2 3\n") is None


def test_idle_cores_fall_back_to_the_load_average_without_proc_stat(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (1.25, 0.0, 0.0))
    assert machine.idle_cores(2, interval=0.0, stat=tmp_path / "missing") == pytest.approx(0.75)
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (9.0, 0.0, 0.0))
    assert machine.idle_cores(2, interval=0.0, stat=tmp_path / "missing") == 0.0


def test_the_busy_warning_fires_for_pinned_threads_on_busy_cores_only() -> None:
    warning = machine.busy_warning(2, 0.3, 2)
    assert warning is not None and "2 torch threads on 2 cores with 0.3 idle" in warning
    assert "model.torch_threads" in warning
    assert machine.busy_warning(2, 1.5, 2) is None  # one core's worth of other work: a fair share, no pile-up
    assert machine.busy_warning(1, 0.0, 2) is None  # one thread does not spin-wait on others


def test_resume_difference_and_compute_time() -> None:
    first = {"cpu": "A", "threads": 2, "device": "cpu", "torch": "2.13.0", "started": 100.0}
    assert machine.resume_difference(first, dict(first, started=500.0, cores=8)) == ""
    assert machine.resume_difference(first, dict(first, cpu="B", threads=4)) == "cpu 'A' -> 'B'; threads 2 -> 4"
    starts = [first, dict(first, started=200.0)]
    # records before the first start are ignored; 100 -> 150 and 200 -> 260 are counted, the gap 150 -> 200 is not
    assert machine.compute_seconds(starts, [90.0, 110.0, 150.0, 205.0, 260.0]) == pytest.approx(110.0)
    assert machine.compute_seconds([first], []) == 0.0


def _state(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "state.json").read_text())


def test_a_run_records_each_start_and_a_resume_keeps_its_first_thread_count(tmp_path: Path, monkeypatch: Any,
                                                                            capsys: Any) -> None:
    import agentevo.run as run_module

    monkeypatch.setattr(run_module, "idle_cores", lambda: 2.2)  # two idle cores at the first start
    cfg = load_config(None, ["env.n_train=2"], name="r", output_dir=str(tmp_path))
    run = Run.create(cfg, quiet=True)
    run.logger.log("bc/train", 1, {"loss": 1.0})
    run.close()
    (first,) = _state(tmp_path / "r")[machine.STATE_KEY]
    assert first["threads"] == 2 and first["idle_cores"] == 2.2
    assert first["cpu"] == machine.cpu_description()[0] and isinstance(first["started"], float)

    monkeypatch.setattr(run_module, "idle_cores", lambda: 0.4)  # busy at the resume: auto would pick 1 thread
    run = Run.open(tmp_path / "r", quiet=True)
    assert run.threads == 2  # the first start's count: the resume computes what an uninterrupted run would
    run.close()
    assert capsys.readouterr().err == ""  # same hardware; the busy cores are recorded, not warned of (not pinned)
    starts = _state(tmp_path / "r")[machine.STATE_KEY]
    assert [s["threads"] for s in starts] == [2, 2] and starts[1]["idle_cores"] == 0.4

    state = _state(tmp_path / "r")
    state[machine.STATE_KEY][0]["cpu"] = "Some Other CPU"
    (tmp_path / "r" / "state.json").write_text(json.dumps(state))
    run = Run.open(tmp_path / "r", quiet=True)
    err = capsys.readouterr().err
    assert "warning: r started on Some Other CPU (" in err and f"-> {machine.cpu_description()[0]!r}" in err
    report = write_report(run).read_text()
    run.close()
    assert f"- machine: Some Other CPU ({first['cores']} cores" in report and "2 torch threads" in report
    assert "- precision: float32 on cpu (model.dtype" in report or "- precision: float32 weights" in report
    for k in (1, 2):  # both later starts ran on another CPU than the (edited) first start
        assert f"- resume {k} ran with cpu 'Some Other CPU' -> " in report
    assert "over 3 starts" in report and "2 of its starts found fewer idle cores than threads" in report
    assert "**machine**" not in report  # not listed as a phase

    run = Run.open(tmp_path / "r", quiet=True)
    run.phase("finished", lambda: {"at": "now"})
    run.close()
    capsys.readouterr()  # that start's own resume warning
    run = Run.open(tmp_path / "r", quiet=True)  # reopened after it finished (`agentevo resume` rewrites the report)
    run.close()
    assert len(_state(tmp_path / "r")[machine.STATE_KEY]) == 4 and "warning" not in capsys.readouterr().err


def test_pinned_threads_on_a_busy_machine_warn_at_the_start(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    import agentevo.run as run_module

    monkeypatch.setattr(run_module, "idle_cores", lambda: 0.2)
    cfg = load_config(None, ["env.n_train=2", "model.torch_threads=2"], name="busy", output_dir=str(tmp_path))
    Run.create(cfg, quiet=True).close()
    err = capsys.readouterr().err
    assert err.startswith("warning: busy: 2 torch threads on ") and "with 0.2 idle" in err
    cfg = load_config(None, ["env.n_train=2"], name="auto", output_dir=str(tmp_path))
    run = Run.create(cfg, quiet=True)  # the automatic count takes the 1 thread there is room for: no warning
    run.close()
    assert run.threads == 1 and capsys.readouterr().err == ""


def test_automatic_threads_share_the_idle_cores_among_the_runs_processes(tmp_path: Path, monkeypatch: Any) -> None:
    from agentevo import run as run_module
    from agentevo.config import load_config
    from agentevo.run import Run, auto_threads

    assert [auto_threads(2.2), auto_threads(2.2, 2), auto_threads(0.3), auto_threads(15.6, 8), auto_threads(7, 0)] \
        == [2, 1, 1, 2, 7]
    # 2 ranks of one run on a machine with 2.2 idle cores: 1 thread each, not 2 each (4 threads on 2 cores)
    monkeypatch.setattr(run_module, "idle_cores", lambda: 2.2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = load_config(None, ["env.n_train=2"], name="ranks", output_dir=str(tmp_path))
    run = Run.create(cfg, quiet=True)
    assert run.threads == 1 and run.state["machine"][0]["threads"] == 1
    run.close()
