"""Experiment trackers (tracking.report_to): validation, the sample table, and each back-end read back offline."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentevo.config import TrackingConfig, _build, load_config
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.errors import AgentevoError, ConfigError, MissingDependencyError
from agentevo.train import tracking
from agentevo.train.tracking import MetricsLogger, markdown_table, sample_rows

RECORDS = [("bc/train", 1, {"loss": 2.5, "lr": 0.001}), ("bc/train", 2, {"loss": 1.25, "lr": 0.002}),
           ("eval/bc/test", 0, {"success_rate": 0.5, "mean_reward": 0.75, "task_hash": "abc123", "n": 3})]


def _traj(k: int) -> Trajectory:
    steps = [Step(1, "kitchen", "Action: open fridge", [1], None, "open fridge", "The fridge | is open.", 0.5, False),
             Step(2, "fridge", "gibberish", [2], None, None, "Nothing\nhappens.", 0.0, True)]
    return Trajectory(Task("twx", f"task-{k}", "test", "cook"), "self", "p", "instr", steps, 0.5 + k, k % 2 == 0)


def _log_all(logger: MetricsLogger) -> None:
    for phase, step, metrics in RECORDS:
        logger.log(phase, step, metrics)
    logger.log_samples("eval/bc/test", 0, [_traj(0), _traj(1), _traj(2)])


def _scalars_of_jsonl(run_dir: Path) -> dict[tuple[str, int], float]:
    """(phase/key, step) -> value, from metrics.jsonl: what every tracker must agree with."""
    out = {}
    for record in MetricsLogger(run_dir).records():
        for key, value in record.items():
            if key not in ("time", "phase", "step") and isinstance(value, (int, float)):
                out[(f"{record['phase']}/{key}", record["step"])] = float(value)
    return out


EXPECTED_ROWS = [
    ["task-0", "1. open fridge\n2. (unparsed) gibberish", "0. kitchen\n1. The fridge | is open.\n2. Nothing happens.",
     0.5, True],
    ["task-1", "1. open fridge\n2. (unparsed) gibberish", "0. kitchen\n1. The fridge | is open.\n2. Nothing happens.",
     1.5, False],
]


# -- validation -------------------------------------------------------------------------------------


def test_unknown_tracker_is_a_one_line_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["tracking.report_to=[tensorboard,comet]"])
    assert str(err.value) == ("tracking.report_to: unknown tracker 'comet'; choose from none, tensorboard, wandb, "
                              "trackio, mlflow")


def test_none_alone_means_no_tracker_and_cannot_be_combined() -> None:
    assert tracking.check_report_to(["none"]) == []
    assert tracking.check_report_to([]) == []
    with pytest.raises(ConfigError, match=r"'none' cannot be combined with other trackers"):
        _build(TrackingConfig, {"report_to": ["none", "wandb"]}).validate()


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None if name == "mlflow" else real(name))
    with pytest.raises(MissingDependencyError) as err:
        _build(TrackingConfig, {"report_to": ["mlflow"]}).validate()
    assert str(err.value) == ("tracking.report_to: mlflow is not installed; install it with pip install "
                              "'agentevo[mlflow]' (or drop mlflow from tracking.report_to)")


def test_default_is_metrics_jsonl_only(tmp_path: Path) -> None:
    """No tracker unless asked, even with TensorBoard installed (earlier versions wrote TensorBoard whenever it was
    importable; the README says so)."""
    assert TrackingConfig().report_to == []
    logger = MetricsLogger(tmp_path)
    _log_all(logger)
    logger.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_sample_rows_and_markdown_table() -> None:
    rows = sample_rows([_traj(0), _traj(1)])
    assert rows == EXPECTED_ROWS
    assert markdown_table(["a", "b"], [["x|y", "1\n2"]]) == "| a | b |\n|---|---|\n| x\\|y | 1<br>2 |"


def test_samples_are_the_first_n_episodes(tmp_path: Path) -> None:
    fake = _FakeTracker()
    logger = MetricsLogger(tmp_path, samples=2)
    logger.report_to, logger._trackers = ["fake"], [fake]
    assert logger.log_samples("eval/x/test", 0, [_traj(0), _traj(1), _traj(2)]) == 2
    assert fake.tables == [("eval/x/test", 0, list(tracking.SAMPLE_COLUMNS), EXPECTED_ROWS)]
    logger.samples = 0
    assert logger.log_samples("eval/x/test", 0, [_traj(0)]) == 0


class _FakeTracker(tracking.Tracker):
    name = "fake"

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.logged, self.tables = fail, [], []  # type: ignore[var-annotated]

    def log(self, phase: str, step: int, scalars: dict[str, float]) -> None:
        if self.fail:
            raise ConnectionError("server went away")
        self.logged.append((phase, step, scalars))

    def log_table(self, phase: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.tables.append((phase, step, columns, rows))


def test_a_failing_tracker_warns_once_and_metrics_jsonl_keeps_everything(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    logger = MetricsLogger(tmp_path)
    logger.report_to, logger._trackers = ["fake"], [_FakeTracker(fail=True)]
    with caplog.at_level(logging.WARNING, logger="agentevo.train.tracking"):
        _log_all(logger)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["tracker fake failed to log (ConnectionError: server went away); metrics.jsonl keeps every "
                        "record"]
    assert [(r["phase"], r["step"]) for r in logger.records()] == [(p, s) for p, s, _ in RECORDS]


def test_a_resumed_phase_does_not_send_its_replayed_steps_to_the_trackers_again(tmp_path: Path) -> None:
    first = MetricsLogger(tmp_path)
    first.report_to, first._trackers = ["fake"], [_FakeTracker()]
    for step in range(1, 6):
        first.log("bc/train", step, {"loss": 1.0 / step})
    first.log("eval/bc/test", 0, {"success_rate": 0.25})
    first.log_samples("eval/bc/test", 0, [_traj(0)])
    # killed; `agentevo resume` opens the folder in a new process, the trainer restarts from its step-2 checkpoint
    # and the evaluation, not yet in state.json, starts again
    resumed = MetricsLogger(tmp_path)
    tracker = _FakeTracker()
    resumed.report_to, resumed._trackers = ["fake"], [tracker]
    assert resumed.drop_after("bc/train", 2) == 3 and resumed.drop_after("eval/bc/test", -1) == 1
    for step in range(3, 8):
        resumed.log("bc/train", step, {"loss": 1.0 / step})
    resumed.log("eval/bc/test", 0, {"success_rate": 0.25})
    assert resumed.log_samples("eval/bc/test", 0, [_traj(0)]) == 0
    resumed.log("eval/bc/test", 1, {"success_rate": 0.5})  # a later point of the same phase is new
    assert [(p, s) for p, s, _ in tracker.logged] == [("bc/train", 6), ("bc/train", 7), ("eval/bc/test", 1)]
    assert tracker.tables == []
    # metrics.jsonl holds every record once
    assert [(r["phase"], r["step"]) for r in resumed.records()] == [
        *(("bc/train", s) for s in range(1, 3)), *(("bc/train", s) for s in range(3, 8)), ("eval/bc/test", 0),
        ("eval/bc/test", 1)]


# -- fake wandb / trackio modules: the adapters' calls, without the packages ---------------------------


def _fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() answers from sys.modules
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


class _FakeRun:
    def __init__(self, **kwargs: Any) -> None:
        self.init, self.defined, self.logged, self.finished = kwargs, [], [], False  # type: ignore[var-annotated]

    def define_metric(self, name: str, **kwargs: Any) -> None:
        self.defined.append((name, kwargs))

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        self.logged.append((data, step))

    def finish(self) -> None:
        self.finished = True


class _FakeTable:
    def __init__(self, columns: list[str], data: list[list[Any]]) -> None:
        self.columns, self.data = columns, data


def test_wandb_adapter_plots_each_phase_against_its_own_step_and_resumes_the_same_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[_FakeRun] = []
    _fake_module(monkeypatch, "wandb", init=lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1], Table=_FakeTable)
    logger = MetricsLogger(tmp_path / "r1", report_to=["wandb"], project="proj", config={"seed": 3})
    _log_all(logger)
    logger.close()
    run = runs[0]
    run_id = json.loads((tmp_path / "r1" / "trackers.json").read_text())["wandb"]
    assert run.init == {"project": "proj", "name": "r1", "id": run_id, "resume": "allow", "dir": str(tmp_path / "r1"),
                        "config": {"seed": 3}, "reinit": "create_new"}
    assert run.defined[:3] == [("bc/train/step", {"hidden": True}), ("bc/train/loss", {"step_metric": "bc/train/step"}),
                               ("bc/train/lr", {"step_metric": "bc/train/step"})]
    assert ("eval/bc/test/samples", {"step_metric": "eval/bc/test/step"}) in run.defined
    assert run.logged[:3] == [
        ({"bc/train/loss": 2.5, "bc/train/lr": 0.001, "bc/train/step": 1}, None),
        ({"bc/train/loss": 1.25, "bc/train/lr": 0.002, "bc/train/step": 2}, None),
        ({"eval/bc/test/success_rate": 0.5, "eval/bc/test/mean_reward": 0.75, "eval/bc/test/n": 3.0,
          "eval/bc/test/step": 0}, None)]
    table = run.logged[3][0]["eval/bc/test/samples"]
    assert (table.columns, table.data) == (list(tracking.SAMPLE_COLUMNS), [*EXPECTED_ROWS, sample_rows([_traj(2)])[0]])
    assert run.finished
    resumed = MetricsLogger(tmp_path / "r1", report_to=["wandb"])  # `agentevo resume`: the same wandb run
    resumed.log("bc/train", 3, {"loss": 1.0})
    resumed.close()
    assert runs[1].init["id"] == run_id


def test_tracker_that_cannot_start_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def init(**kwargs: Any) -> None:
        raise RuntimeError("api_key not configured (no-tty).\ncall wandb.login(key=[your_api_key])")

    _fake_module(monkeypatch, "wandb", init=init, Table=_FakeTable)
    logger = MetricsLogger(tmp_path, report_to=["wandb"])
    with pytest.raises(AgentevoError) as err:
        logger.log("bc/train", 1, {"loss": 1.0})
    assert str(err.value) == ("tracker wandb could not start (RuntimeError: api_key not configured (no-tty).); run "
                              "`wandb login`, or set WANDB_MODE=offline, or drop it from tracking.report_to")


def test_trackio_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[_FakeRun] = []
    _fake_module(monkeypatch, "trackio", init=lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1], Table=_FakeTable)
    logger = MetricsLogger(tmp_path / "r2", report_to=["trackio"], samples=1)
    _log_all(logger)
    logger.close()
    run = runs[0]
    assert run.init == {"project": "agentevo", "name": "r2", "config": None, "resume": "never"}
    assert [(d, s) for d, s in run.logged[:2]] == [({"bc/train/loss": 2.5, "bc/train/lr": 0.001}, 1),
                                                   ({"bc/train/loss": 1.25, "bc/train/lr": 0.002}, 2)]
    data, step = run.logged[3]
    assert step == 0 and data["eval/bc/test/samples"].data == EXPECTED_ROWS[:1]
    MetricsLogger(tmp_path / "r2", report_to=["trackio"]).log("bc/train", 3, {"loss": 1.0})
    assert runs[1].init["resume"] == "allow"  # the folder's own trackio run, continued


# -- the real packages, offline ---------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_event_files_hold_the_metrics_jsonl_values(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, report_to=["tensorboard"], config={"optim": {"lr": 0.001}})
    _log_all(logger)
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    got = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert got == pytest.approx(_scalars_of_jsonl(tmp_path))
    assert len(got) == 7  # task_hash (a string) is not a scalar
    texts = {tag: acc.Tensors(tag) for tag in acc.Tags()["tensors"]}
    table = texts["eval/bc/test/samples/text_summary"][0].tensor_proto.string_val[0].decode()
    assert table.splitlines()[:3] == ["| task_id | actions | observations | reward | success |", "|---|---|---|---|---|",
                                      "| task-0 | 1. open fridge<br>2. (unparsed) gibberish | 0. kitchen<br>1. The "
                                      "fridge \\| is open.<br>2. Nothing happens. | 0.5 | True |"]
    assert "lr: 0.001" in texts["config/text_summary"][0].tensor_proto.string_val[0].decode()


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow not installed")
def test_mlflow_file_store_holds_the_metrics_jsonl_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants a database store unless told
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, report_to=["mlflow"], project="exp", config={"optim": {"lr": 0.001}, "seed": 0})
    _log_all(logger)
    logger.close()
    client = MlflowClient(uri)
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    run = client.get_run(run_id)
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "exp"
    assert run.data.params == {"optim.lr": "0.001", "seed": "0"}
    got = {(m.key, m.step): m.value for key in run.data.metrics for m in client.get_metric_history(run_id, key)}
    assert got == pytest.approx(_scalars_of_jsonl(run_dir))
    table = json.loads(Path(client.download_artifacts(run_id, "samples/eval/bc/test/step-0.json", str(tmp_path)))
                       .read_text())
    assert table["columns"] == list(tracking.SAMPLE_COLUMNS)
    assert table["data"][:2] == EXPECTED_ROWS
    resumed = MetricsLogger(run_dir, report_to=["mlflow"], project="exp")  # `agentevo resume`: the same run
    resumed.log("bc/train", 3, {"loss": 1.0})
    resumed.close()
    assert [m.value for m in client.get_metric_history(run_id, "bc/train/loss")] == [2.5, 1.25, 1.0]
    assert len(client.search_runs([run.info.experiment_id])) == 1


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed")
def test_wandb_offline_run_in_the_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    logger = MetricsLogger(tmp_path, report_to=["wandb"])
    _log_all(logger)
    summary = dict(logger.trackers()[0].run.summary)
    logger.close()
    assert {k: summary[k] for k in ("bc/train/loss", "bc/train/lr", "eval/bc/test/success_rate")} == {
        "bc/train/loss": 1.25, "bc/train/lr": 0.002, "eval/bc/test/success_rate": 0.5}
    (table_file,) = tmp_path.glob("wandb/offline-run-*/files/media/table/eval/bc/test/samples_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == list(tracking.SAMPLE_COLUMNS)
    assert table["data"][:2] == EXPECTED_ROWS


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_run_evaluation_logs_its_first_episodes_as_a_table(tmp_path: Path, tiny_policy: Any) -> None:
    """Run.evaluate: metrics and the first tracking.samples episodes (those of experience.db) reach TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from agentevo.run import Run

    cfg = load_config(None, ["env.name=probe-constant", "eval.n_tasks=3", "tracking.report_to=[tensorboard]",
                             "tracking.samples=2", "agent.max_new_tokens=4", "model.torch_threads=1"],
                      method="bc", name="ev", output_dir=str(tmp_path))
    run = Run.create(cfg, quiet=True)
    try:
        metrics = run.evaluate(tiny_policy, "init")["test"]
        stored = run.store.load(collection="eval/init/test")
    finally:
        run.close()
    acc = EventAccumulator(str(tmp_path / "ev" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert acc.Scalars("eval/init/test/success_rate")[0].value == pytest.approx(metrics["success_rate"])
    table = acc.Tensors("eval/init/test/samples/text_summary")[0].tensor_proto.string_val[0].decode().splitlines()
    assert len(stored) == 3 and len(table) == 2 + 2  # header, rule, the first two episodes
    assert [row.split(" | ")[0] for row in table[2:]] == [f"| {t.task.task_id}" for t in stored[:2]]
    saved = yaml.safe_load((tmp_path / "ev" / "config.yaml").read_text())["tracking"]
    assert saved == {"report_to": ["tensorboard"], "project": "agentevo", "run_name": None, "samples": 2}
