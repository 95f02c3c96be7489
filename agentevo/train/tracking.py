"""Metrics: one JSON line per record in runs/NAME/metrics.jsonl (the source of truth for `report` and `compare`),
copied to the experiment trackers named by tracking.report_to (TensorBoard, Weights & Biases, Trackio, MLflow).

The trackers are called directly behind one small interface (Tracker) rather than through accelerate.tracking:
its trackers check PartialState on every call, write TensorBoard under logging_dir/run_name, keep MLflow's run in
the global fluent state and, except wandb's, have no tables; ours write into the run folder, resume the same
tracker run on `agentevo resume` and log the evaluation sample tables to every back-end."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentevo.config import flatten_dotted
from agentevo.errors import AgentevoError, ConfigError, MissingDependencyError
from agentevo.files import write_text_atomic

log = logging.getLogger(__name__)


class MetricsLogger:
    """Appends metric records under fixed names; readable while the run goes on (`tail -f metrics.jsonl`)."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = False, enabled: bool = True,
                 report_to: Sequence[str] = (), project: str = "agentevo", run_name: str | None = None,
                 samples: int = 8, config: dict[str, Any] | None = None) -> None:
        """enabled=False (the other ranks of a distributed run) keeps the reader and writes nothing; report_to names
        the trackers (tensorboard=True adds TensorBoard); they start at the first record, so a run opened only to be
        read (`agentevo report`) starts none."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.enabled = enabled
        names = check_report_to([*report_to, *(["tensorboard"] if tensorboard else [])])
        self.report_to = names if enabled else []
        self.project, self.samples, self.config = project, samples, config
        self.run_name = run_name or Path(run_dir).resolve().name
        self._trackers: list[Tracker] | None = None  # None: not started yet
        self._failed: set[str] = set()  # back-ends whose last write failed (one warning per outage)
        # phase -> the highest step a resumed phase replays: the trackers got those records before the interruption
        self._replayed: dict[str, int] = {}

    def log(self, phase: str, step: int, metrics: dict[str, Any]) -> None:
        """Write one record: the phase (e.g. 'bc/train', 'eval/bc/test'), a step counter and scalar metrics."""
        if not self.enabled:
            return
        record = {"time": time.time(), "phase": phase, "step": step, **metrics}
        self._end_partial_line()
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record, default=float) + "\n")
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if scalars and not self._sent_before(phase, step):
            for tracker in self.trackers():
                self._guard(tracker, tracker.log, phase, step, scalars)

    def log_samples(self, phase: str, step: int, trajectories: Sequence[Any]) -> int:
        """Log the first `samples` trajectories as a table (task id, actions, observations, reward, success) to the
        trackers; metrics.jsonl keeps only scalars (the episodes are in experience.db). Returns the rows logged."""
        if not self.enabled or not self.samples or not self.report_to or not trajectories:
            return 0
        if self._sent_before(phase, step):
            return 0
        rows = sample_rows(trajectories[: self.samples])
        for tracker in self.trackers():
            self._guard(tracker, tracker.log_table, phase, step, list(SAMPLE_COLUMNS), rows)
        return len(rows)

    def _sent_before(self, phase: str, step: int) -> bool:
        """A record a resumed phase logs again (drop_after removed it from metrics.jsonl): the trackers have it."""
        return step <= self._replayed.get(phase, step - 1)

    def trackers(self) -> list[Tracker]:
        """The started trackers (started here on first use)."""
        if self._trackers is None:
            self._trackers = []
            try:
                for name in self.report_to:
                    self._trackers.append(start_tracker(name, self.path.parent, self.project, self.run_name,
                                                        self.config))
            except BaseException:
                self.close()
                raise
        return self._trackers

    def _guard(self, tracker: Tracker, method: Any, *args: Any) -> None:
        """A tracker that fails mid-run (network, disk) costs a warning, never the run: metrics.jsonl has it all."""
        try:
            method(*args)
        except Exception as exc:  # noqa: BLE001 - any back-end error; metrics.jsonl already holds the record
            if tracker.name not in self._failed:
                log.warning("tracker %s failed to log (%s: %s); metrics.jsonl keeps every record", tracker.name,
                            type(exc).__name__, exc)
            self._failed.add(tracker.name)
        else:
            self._failed.discard(tracker.name)

    def _end_partial_line(self) -> None:
        """A kill mid-write leaves a last line without its newline: end it, so the next record is a line of its own
        (readers skip the partial one)."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with open(self.path, "rb+") as fh:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")

    def _read(self) -> list[dict[str, Any]]:
        """Every record in the file; a line that is not a JSON record (what a kill mid-write leaves) is skipped
        with a warning."""
        if not self.path.exists():
            return []
        out = []
        for number, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict) or "phase" not in record:
                log.warning("%s line %d is not a complete record (a run killed while writing it?); skipped",
                            self.path, number)
                continue
            out.append(record)
        return out

    def records(self, phase: str | None = None) -> list[dict[str, Any]]:
        """All records so far (optionally of one phase)."""
        return [r for r in self._read() if phase is None or r["phase"] == phase]

    def drop_after(self, phase: str, step: int) -> int:
        """Remove the phase's records with a step above `step` (a resumed phase logs those steps again), and any
        partial lines; the file is rewritten atomically. The trackers, which received the dropped records before
        the interruption, are not sent the replayed steps again (an exact resume logs the same values). Returns how
        many records were dropped."""
        if not self.enabled or not self.path.exists():
            return 0
        lines = self.path.read_text().splitlines()
        records = self._read()
        keep, dropped = [], []
        for r in records:
            (dropped if r["phase"] == phase and isinstance(r.get("step"), int) and r["step"] > step else keep).append(r)
        if dropped:
            self._replayed[phase] = max(self._replayed.get(phase, step), *(r["step"] for r in dropped))
        if len(keep) == len(lines):
            return 0
        write_text_atomic(self.path, "".join(json.dumps(r, default=float) + "\n" for r in keep))
        return len(records) - len(keep)

    def close(self) -> None:
        """Flush and finish the trackers (idempotent)."""
        trackers, self._trackers = self._trackers or [], []  # closed: nothing starts again
        for tracker in trackers:
            self._guard(tracker, tracker.close)


# -- trackers ---------------------------------------------------------------------------------------

TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")
_MODULE = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}
SAMPLE_COLUMNS = ("task_id", "actions", "observations", "reward", "success")
_CELL_CHARS = 300  # one observation in a sample table: enough to read the episode, not a page per cell
IDS_FILE = "trackers.json"  # the tracker run ids of this folder, so `agentevo resume` continues the same runs


def check_report_to(report_to: Sequence[str]) -> list[str]:
    """The trackers named by tracking.report_to, checked: known names, 'none' alone, each one's package installed
    (a one-line ConfigError naming the pip extra otherwise). Duplicates are dropped."""
    names = list(dict.fromkeys(str(n).strip().lower() for n in report_to))
    for name in names:
        if name not in (*TRACKERS, "none"):
            raise ConfigError(f"tracking.report_to: unknown tracker {name!r}; choose from none, {', '.join(TRACKERS)}")
    if "none" in names:
        if len(names) > 1:
            raise ConfigError(f"tracking.report_to: 'none' cannot be combined with other trackers (got {names}); "
                              "use [] or [none] for metrics.jsonl only")
        return []
    for name in names:
        if importlib.util.find_spec(_MODULE[name]) is None:
            raise MissingDependencyError(f"tracking.report_to: {name} is not installed; install it with "
                              f"pip install 'agentevo[{name}]' (or drop {name} from tracking.report_to)")
    return names


def _clip(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _CELL_CHARS else text[: _CELL_CHARS - 3] + "..."


def sample_rows(trajectories: Sequence[Any]) -> list[list[Any]]:
    """One table row per trajectory: task id, the numbered actions, the numbered observations (the reset one as
    0.), final reward and success. A reply that did not parse shows as '(unparsed) <text>'."""
    rows = []
    for traj in trajectories:
        actions = [f"{s.t}. {s.parsed_action if s.parsed_action is not None else '(unparsed) ' + _clip(s.action_text)}"
                   for s in traj.steps]
        observations = [f"0. {_clip(traj.first_obs)}", *(f"{s.t}. {_clip(s.next_obs)}" for s in traj.steps)]
        rows.append([traj.task.task_id, "\n".join(actions), "\n".join(observations), float(traj.final_reward),
                     bool(traj.success)])
    return rows


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table (TensorBoard's text plugin renders it); cell newlines become <br>, pipes are escaped."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _read_ids(run_dir: Path) -> dict[str, Any]:
    try:
        ids = json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def _save_id(run_dir: Path, name: str, value: Any) -> None:
    ids = {**_read_ids(run_dir), name: value}
    write_text_atomic(run_dir / IDS_FILE, json.dumps(ids, indent=1))


class Tracker:
    """One back-end: scalars under '<phase>/<key>' against the phase's own step, tables, close."""

    name = "tracker"

    def log(self, phase: str, step: int, scalars: dict[str, float]) -> None:
        """Log one record's scalars."""
        raise NotImplementedError

    def log_table(self, phase: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        """Log a table (the evaluation samples)."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush and finish."""


class TensorBoardTracker(Tracker):
    """Event files in runs/NAME/tensorboard (as before); tables as markdown text."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, config: dict[str, Any] | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        if config:
            import yaml

            # four-space indent: a code block in the text plugin's markdown
            text = "\n".join("    " + line for line in yaml.safe_dump(config, sort_keys=False).splitlines())
            self.writer.add_text("config", text, 0)

    def log(self, phase: str, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(f"{phase}/{key}", value, step)
        self.writer.flush()

    def log_table(self, phase: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.writer.add_text(f"{phase}/samples", markdown_table(columns, rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A wandb run in runs/NAME/wandb (WANDB_MODE=offline works without an account); each phase's metrics are
    plotted against its own '<phase>/step', since wandb's global step only goes up and phases restart theirs."""

    name = "wandb"

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any] | None) -> None:
        import wandb

        self.wandb = wandb
        run_id = _read_ids(run_dir).get("wandb") or secrets.token_hex(4)  # wandb ids: short, [a-z0-9]
        self.run = wandb.init(project=project, name=run_name, id=run_id, resume="allow", dir=str(run_dir),
                              config=config, reinit="create_new")
        _save_id(run_dir, "wandb", run_id)
        self._defined: set[str] = set()

    def _define(self, phase: str, keys: Sequence[str]) -> None:
        step_key = f"{phase}/step"
        if step_key not in self._defined:
            self.run.define_metric(step_key, hidden=True)
            self._defined.add(step_key)
        for key in keys:
            if key not in self._defined:  # per key, not '<phase>/*': phases nest (round-1/critic/epoch)
                self.run.define_metric(key, step_metric=step_key)
                self._defined.add(key)

    def log(self, phase: str, step: int, scalars: dict[str, float]) -> None:
        data = {f"{phase}/{k}": v for k, v in scalars.items() if k != "step"}
        self._define(phase, list(data))
        self.run.log({**data, f"{phase}/step": step})

    def log_table(self, phase: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        key = f"{phase}/samples"
        self._define(phase, [key])
        self.run.log({key: self.wandb.Table(columns=columns, data=rows), f"{phase}/step": step})

    def close(self) -> None:
        self.run.finish()


class TrackioTracker(Tracker):
    """A Trackio run (local SQLite under TRACKIO_DIR unless a Space is configured); tables as trackio.Table."""

    name = "trackio"

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any] | None) -> None:
        import trackio

        self.trackio = trackio
        resume = "allow" if _read_ids(run_dir).get("trackio") == run_name else "never"
        self.run = trackio.init(project=project, name=run_name, config=config, resume=resume)
        _save_id(run_dir, "trackio", run_name)

    def log(self, phase: str, step: int, scalars: dict[str, float]) -> None:
        self.run.log({f"{phase}/{k}": v for k, v in scalars.items()}, step=step)

    def log_table(self, phase: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({f"{phase}/samples": self.trackio.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowTracker(Tracker):
    """An MLflow run in experiment `project` on MLFLOW_TRACKING_URI (mlflow's default store when unset); the
    config as params, tables as JSON artifacts under samples/ (log_table when pandas is there)."""

    name = "mlflow"
    _KEY = re.compile(r"[^\w\-. /]")  # what MLflow accepts in a metric name

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any] | None) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient()
        run_id = _read_ids(run_dir).get("mlflow")
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(project))
            run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in flatten_dotted(config or {}).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(run_id, params=params[i:i + 100])
            _save_id(run_dir, "mlflow", run_id)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, phase: str, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(self._KEY.sub("_", f"{phase}/{k}"), v, now, step)
                                                    for k, v in scalars.items()])

    def log_table(self, phase: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        path = f"samples/{self._KEY.sub('_', phase)}/step-{step}.json"
        if importlib.util.find_spec("pandas") is not None:
            self.client.log_table(self.run_id, {c: [r[k] for r in rows] for k, c in enumerate(columns)}, path)
        else:  # mlflow-skinny without pandas: the same 'split' layout log_table writes
            self.client.log_dict(self.run_id, {"columns": columns, "data": rows}, path)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def start_tracker(name: str, run_dir: Path, project: str, run_name: str, config: dict[str, Any] | None) -> Tracker:
    """Start one tracker; a back-end that cannot start (no login, unreachable server) is a one-line error."""
    try:
        if name == "tensorboard":
            return TensorBoardTracker(run_dir, config)
        if name == "wandb":
            return WandbTracker(run_dir, project, run_name, config)
        if name == "trackio":
            return TrackioTracker(run_dir, project, run_name, config)
        if name == "mlflow":
            return MLflowTracker(run_dir, project, run_name, config)
    except ImportError as exc:
        raise MissingDependencyError(f"tracking.report_to: {name} cannot be imported ({exc}); install it with "
                          f"pip install 'agentevo[{name}]'") from None
    except Exception as exc:  # noqa: BLE001 - each library has its own errors; all mean "this tracker did not start"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        hint = {"wandb": "run `wandb login`, or set WANDB_MODE=offline",
                "mlflow": "set MLFLOW_TRACKING_URI to a reachable server or store"}.get(name, "check its settings")
        raise AgentevoError(f"tracker {name} could not start ({type(exc).__name__}: {first}); {hint}, or drop it "
                            "from tracking.report_to") from None
    raise ConfigError(f"tracking.report_to: unknown tracker {name!r}; choose from none, {', '.join(TRACKERS)}")
