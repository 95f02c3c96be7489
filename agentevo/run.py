"""A run: its folder, resolved config, experience store, metrics, resumable phases, env pools and policies."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from agentevo import dist
from agentevo.config import RunConfig, _build, config_to_dict, dump_config, read_yaml_mapping
from agentevo.data.store import ExperienceStore
from agentevo.data.types import Trajectory
from agentevo.envs import TaskList, make_env
from agentevo.errors import AgentevoError, ConfigError
from agentevo.eval.metrics import eval_collection, summarize
from agentevo.files import write_text_atomic
from agentevo.machine import STATE_KEY as MACHINE
from agentevo.machine import idle_cores
from agentevo.models import placement
from agentevo.models.backend import Sampling, TransformersPolicy, load_pretrained, set_torch_threads
from agentevo.rollout.engine import EpisodeRequest, PolicyActor, run_episodes
from agentevo.rollout.workers import make_pool
from agentevo.train.tracking import MetricsLogger

log = logging.getLogger(__name__)

_PHASE_FAILED = "__agentevo_phase_failed__"
LOCK_FILE = ".lock"  # flock'ed while a process owns the folder; never deleted (a new inode would let two in)
FINISHED = "finished"  # the state.json phase a run records once its recipe has returned (resume and study skip it)
OWNER_FILE = "owner.json"  # who holds the lock: pid, host, command, start time


def _start_threads(configured: int | None, starts: list[dict[str, Any]] | None) -> int | None:
    """The torch threads of this start: the config's, else the count the run's first start chose (a resume
    computes what an uninterrupted run would), else None (Run takes the idle cores)."""
    if configured is not None:
        return configured
    return int(starts[0]["threads"]) if starts and isinstance(starts[0].get("threads"), int) else None


def auto_threads(idle: float, local_processes: int = 1) -> int:
    """The automatic torch thread count: this process's share of the idle cores (each of the run's processes on
    this machine takes one share, so ranks do not oversubscribe the cores), at least 1."""
    return max(1, round(idle / max(1, local_processes)))


def check_run_name(name: str, output_dir: str | Path) -> None:
    """Refuse a run name that is not exactly one folder name under the output dir."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name or os.path.isabs(name):
        raise ConfigError(f"run name {name!r} must be one folder name under {str(output_dir)!r} (not empty, '.', "
                          "'..', an absolute path or anything with '/' or '\\'); give e.g. --name my-run")


class RunLock:
    """Exclusive ownership of a run folder: an OS lock (flock) held from Run() to Run.close(), dropped by the OS
    when the process dies, so a crash never leaves a stale lock; owner.json says who holds it."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir
        self._file: Any = open(run_dir / LOCK_FILE, "a")  # noqa: SIM115 - held open for the life of the run
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise AgentevoError(f"run folder {str(run_dir)!r} is in use by {self.holder()}; wait for it to end (or "
                                "stop it), or pick another --name") from None
        except OSError as exc:
            self._file.close()
            raise AgentevoError(f"cannot lock run folder {str(run_dir)!r} ({exc}); put runs on a local disk "
                                "(--output-dir)") from None
        command = " ".join(sys.argv).replace("\n", " ")
        write_text_atomic(run_dir / OWNER_FILE, json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(), "command": command[:300],
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }))

    def holder(self) -> str:
        """The lock holder as recorded in owner.json (pid, host, command, start time)."""
        try:
            info = json.loads((self.dir / OWNER_FILE).read_text())
            return (f"pid {info['pid']} on {info['host']} (`{info['command']}`, since {info['started']})")
        except (OSError, ValueError, KeyError, TypeError):
            return "another process (it has not recorded itself in owner.json yet)"

    def release(self) -> None:
        """Drop the lock (idempotent); owner.json goes with it."""
        if self._file.closed:
            return
        try:
            (self.dir / OWNER_FILE).unlink(missing_ok=True)
        finally:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()


def _prepare_folder(run_dir: Path, existing: str) -> None:
    """What to do with what the folder already holds (called with its lock held): 'resume' keeps it, 'refuse'
    stops at a run folder, 'overwrite' empties one, 'eval' reuses only an `agentevo eval` folder."""
    if existing == "resume":
        return
    config = run_dir / "config.yaml"
    if not config.exists():
        # a new run may start on a store seeded by `agentevo import` (docs/data.md); anything else is not ours
        if any(p.name not in (LOCK_FILE, OWNER_FILE) and not p.name.startswith("experience.db")
               for p in run_dir.iterdir()):
            raise ConfigError(f"{str(run_dir)!r} exists and is not a run folder (no config.yaml); pick another "
                              "--name (or --output-dir)")
        return
    if existing == "overwrite":
        for child in run_dir.iterdir():
            if child.name in (LOCK_FILE, OWNER_FILE):
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        return
    if existing == "eval":
        try:
            method = (yaml.safe_load(config.read_text()) or {}).get("method")
        except (yaml.YAMLError, AttributeError):
            method = "unreadable"
        if method == "eval":
            return
        raise ConfigError(f"{str(run_dir)!r} is the folder of a {method} run; `agentevo eval` never writes into "
                          "another run's folder: pick another --name")
    raise ConfigError(f"run folder {str(run_dir)!r} already exists; continue it with `agentevo resume {run_dir}`, "
                      "pick another --name, or add --overwrite to start it over")


def _read_state(path: Path) -> dict[str, Any]:
    """state.json, or {} for a new run; a truncated or edited file is a one-line error naming the fix."""
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        state = None
    if not isinstance(state, dict):
        raise AgentevoError(f"{str(path)!r} is not a valid state file (truncated or edited?); restore it, or start "
                            f"the run again with `agentevo train ... --name {path.parent.name} --overwrite`")
    return state


def _progress_columns() -> list[Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn()]


class ProgressBar:
    """Advance or set a rich progress task; with `plain` (output piped: rich would show nothing until the end) print
    a plain line "DESCRIPTION: 12/50 (24%) 00:31 elapsed" at each tenth of the total and at least every `interval`
    seconds of progress instead; no-op when both are None (quiet)."""

    def __init__(self, progress: Any, task: Any, plain: str | None = None, total: int | None = None,
                 interval: float = 30.0, clock: Callable[[], float] = time.monotonic, out: Any = None) -> None:
        self._progress, self._task = progress, task
        self._plain, self._total, self._interval, self._clock, self._out = plain, total, interval, clock, out
        self._completed, self._tenth, self._printed = 0, 0, -1
        self._start = self._last = clock()

    def advance(self, n: int = 1) -> None:
        """Count n more items done."""
        if self._progress is not None:
            self._progress.advance(self._task, n)
        if self._plain is not None:
            self._completed += n
            self._tick()

    def update(self, completed: int, total: int | None = None, **fields: Any) -> None:
        """Set the items done (and the total, when given)."""
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, total=total)
        if self._plain is not None:
            self._completed = completed
            self._total = total if total is not None else self._total
            self._tick()

    def finish(self) -> None:
        """Print the plain line of where it ended, unless that line was the last one printed."""
        if self._plain is not None and self._printed != self._completed:
            self._line(self._clock())

    def _tick(self) -> None:
        now = self._clock()
        tenth = 10 * self._completed // self._total if self._total else 0
        if tenth > self._tenth or now - self._last >= self._interval:
            self._tenth = max(self._tenth, tenth)
            self._line(now)

    def _line(self, now: float) -> None:
        minutes, seconds = divmod(int(now - self._start), 60)
        hours, minutes = divmod(minutes, 60)
        elapsed = f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes:02d}:{seconds:02d}"
        done = (f"{self._completed}/{self._total} ({100 * self._completed // self._total}%)" if self._total
                else str(self._completed))
        print(f"{self._plain}: {done} {elapsed} elapsed", file=self._out or sys.stdout, flush=True)
        self._last, self._printed = now, self._completed

    def training_callback(self) -> Callable[[int, int, dict[str, float]], None]:
        """An on_step callback for train()."""
        return lambda step, total, record: self.update(step, total)


class RunView:
    """A run folder opened to be read (`agentevo report`): no lock, no tracker, nothing written but the report, so it
    works while the run goes on and on a machine without the run's tracker packages."""

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        path = self.dir / "config.yaml"
        if not path.exists():
            raise ConfigError(f"{str(self.dir)!r} is not a run folder (no config.yaml); give runs/NAME")
        self.cfg: RunConfig = _build(RunConfig, read_yaml_mapping(path))
        self.state: dict[str, Any] = _read_state(self.dir / "state.json")
        self.store = ExperienceStore(self.dir / "experience.db")
        self.logger = MetricsLogger(self.dir, enabled=False)  # reads metrics.jsonl, writes nothing
        starts = self.state.get(MACHINE)
        self.threads = _start_threads(self.cfg.model.torch_threads, starts) or "idle cores at start"

    def close(self) -> None:
        """Close the store."""
        self.store.close()


class Run:
    """Everything one experiment writes lives under runs/NAME/ (see DESIGN.md, 'The run directory')."""

    def __init__(self, cfg: RunConfig, run_dir: Path, quiet: bool = False, existing: str = "resume") -> None:
        self.cfg = cfg
        self.dir = run_dir
        self.main = dist.is_main()  # under `accelerate launch` only rank 0 collects, evaluates and writes
        self.quiet = quiet or not self.main
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock: RunLock | None = None
        error: AgentevoError | None = None
        if self.main:  # rank 0 owns the folder for every rank
            try:
                self._lock = RunLock(self.dir)
                _prepare_folder(self.dir, existing)
                write_text_atomic(self.dir / "config.yaml", dump_config(cfg))
            except AgentevoError as exc:
                error = exc
        failed = dist.broadcast(None if error is None else str(error))  # no rank goes on into a refused folder
        if failed is not None:
            self._release()
            raise error or AgentevoError(failed)
        self.state_path = self.dir / "state.json"
        try:
            self.state: dict[str, Any] = _read_state(self.state_path)
            self.store = ExperienceStore(self.dir / "experience.db")
            track = cfg.tracking
            self.logger = MetricsLogger(self.dir, enabled=self.main, report_to=track.report_to, project=track.project,
                                        run_name=track.run_name or self.dir.name, samples=track.samples,
                                        config=config_to_dict(cfg))
        except BaseException:
            self._release()
            raise
        threads = _start_threads(cfg.model.torch_threads, self.state.get(MACHINE))
        idle = idle_cores() if self.main else 0.0  # one sample for the choice and the warning
        if threads is None:  # rank 0's sample sets every rank's count (ranks computing alike; results reproduce)
            threads = dist.broadcast(auto_threads(idle, dist.local_world_size()))
        self.threads = set_torch_threads(threads)
        placement.configure(cfg.model.device, cfg.model.dtype, cfg.model.attn_implementation)
        if self.main and FINISHED not in self.state:  # reopening a finished run (report rewrite) computes nothing
            self._record_machine(idle)
        self._signal_env: Any = None
        self._engine: Any = None  # the vLLM engine of this run (model.backend = vllm), kept across rounds

    def _record_machine(self, idle: float) -> None:
        """Append this start's machine to state.json; warn when the configured threads meet cores another job
        holds, and when a resume runs on other hardware, threads or torch than the first start (floats may differ)."""
        from agentevo import machine

        now = machine.describe(self.threads, str(placement.device()), idle, placement.describe())
        warning = machine.busy_warning(self.threads, idle, now["cores"])
        if warning and self.cfg.model.torch_threads is not None:  # asked for; the automatic count is the user's call
            print(f"warning: {self.dir.name}: {warning}", file=sys.stderr)
        starts = list(self.state.get(MACHINE) or [])
        if starts:
            diff = machine.resume_difference(starts[0], now)
            if diff:
                print(f"warning: {self.dir.name} started on {machine.summary(starts[0])} and resumes with {diff}: "
                      "what it computes from here on may differ from an uninterrupted run", file=sys.stderr)
        self.state[MACHINE] = starts + [now]
        write_text_atomic(self.state_path, json.dumps(self.state, indent=1, default=str))

    # -- creation ------------------------------------------------------------------------------
    @classmethod
    def create(cls, cfg: RunConfig, quiet: bool = False, overwrite: bool = False) -> Run:
        """A new run folder: an existing run folder of that name is refused (resume it with Run.open), emptied
        with overwrite, or, for `agentevo eval` (method eval), reused when it is an eval folder."""
        if cfg.name is None:
            base = f"{cfg.method}-{cfg.env.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            name, k = base, 1
            while (Path(cfg.output_dir) / name).exists():  # two runs started in the same second
                k += 1
                name = f"{base}-{k}"
            # every rank of a distributed run must name the same folder, whatever its clock says
            cfg.name = dist.broadcast(name)
        check_run_name(cfg.name, cfg.output_dir)
        existing = "overwrite" if overwrite else "eval" if cfg.method == "eval" else "refuse"
        return cls(cfg, Path(cfg.output_dir) / cfg.name, quiet=quiet, existing=existing)

    @classmethod
    def open(cls, run_dir: str | Path, quiet: bool = False) -> Run:
        """Reopen a run folder from its config.yaml (for `agentevo resume`)."""
        run_dir = Path(run_dir)
        path = run_dir / "config.yaml"
        if not path.exists():
            raise ConfigError(f"{str(run_dir)!r} is not a run folder (no config.yaml); give runs/NAME")
        cfg = _build(RunConfig, read_yaml_mapping(path))
        cfg.validate()
        return cls(cfg, run_dir, quiet=quiet, existing="resume")

    # -- phases --------------------------------------------------------------------------------
    def phase(self, name: str, fn: Callable[[], Any], all_ranks: bool = False) -> Any:
        """Run fn once: its JSON result is recorded in state.json and returned again on resume.

        Under `accelerate launch`, fn runs on rank 0 and its result is broadcast (collection, evaluation, anything
        that writes the run folder); with all_ranks every rank runs it (training through train()).
        """
        if name in self.state:
            return self.state[name]
        if self.main or all_ranks:
            try:
                result = fn()
            except BaseException as exc:
                if not all_ranks:
                    dist.broadcast({_PHASE_FAILED: f"{type(exc).__name__}: {exc}"})
                raise
        else:
            result = None
        if not all_ranks:
            result = dist.broadcast(result)
            if isinstance(result, dict) and _PHASE_FAILED in result:
                raise AgentevoError(f"phase {name} failed on rank 0 ({result[_PHASE_FAILED]}); see its output")
        self.state[name] = result
        if self.main:
            write_text_atomic(self.state_path, json.dumps(self.state, indent=1, default=str))
        dist.barrier()
        return result

    # -- environments --------------------------------------------------------------------------
    @property
    def env_params(self) -> dict[str, Any]:
        c = self.cfg.env
        return {**c.params, "n_train": c.n_train, "n_dev": c.n_dev, "n_test": c.n_test}

    @property
    def signal_env(self) -> Any:
        """A local env instance for task lists, signals and the instruction (no episodes are played on it)."""
        if self._signal_env is None:
            self._signal_env = make_env(self.cfg.env.name, **self.env_params)
        return self._signal_env

    def tasks(self, split: str, n: int | None = None) -> TaskList:
        """The fixed task list of a split (first n)."""
        return self.signal_env.tasks(split).head(n)

    @contextmanager
    def pool(self, size: int | None = None) -> Iterator[Any]:
        """An env worker pool sized for the rollout engine."""
        p = make_pool(self.cfg.env.name, self.env_params, size or self.cfg.rollout.n_parallel, self.cfg.rollout.workers,
                      self.cfg.rollout.step_timeout_s)
        try:
            yield p
        finally:
            p.close()

    # -- policies ------------------------------------------------------------------------------
    def checkpoint_dir(self, name: str) -> Path:
        return self.dir / "checkpoints" / name

    def load_policy(self, name_or_path: str | Path, policy_id: str | None = None) -> TransformersPolicy:
        """A policy from a checkpoint name of this run, or a path."""
        path = Path(name_or_path)
        if not path.exists():
            path = self.checkpoint_dir(str(name_or_path))
        model, tokenizer = load_pretrained(path)
        return TransformersPolicy(
            model, tokenizer, policy_id or path.name, self.cfg.rollout.batch_size, self.cfg.rollout.prefix_cache,
            self.cfg.rollout.prefix_cache_gb, shared_prefix_attention=self.cfg.rollout.shared_prefix_attention,
        )

    def rollout_policy(self, name_or_path: str | Path, policy_id: str | None = None) -> Any:
        """The policy that acts (rollouts, evaluation) with model.backend: transformers, vLLM or HTTP.

        Training still takes load_policy()'s TransformersPolicy. A vLLM engine is started once per run and
        refreshed in place with each new checkpoint; an HTTP policy talks to a server that already serves it.
        """
        path = Path(name_or_path)
        if not path.exists():
            path = self.checkpoint_dir(str(name_or_path))
        policy_id = policy_id or path.name
        backend = self.cfg.model.backend
        if backend == "transformers":
            return self.load_policy(path, policy_id)
        if backend == "vllm":
            from agentevo.models.vllm_backend import VLLMPolicy

            if self._engine is None:
                self._engine = VLLMPolicy(path, None, policy_id, self.cfg.model.vllm, self.cfg.seed)
            elif self._engine.model_path != path or self._engine.weights_id != policy_id:
                self._engine.refresh(path, policy_id)
            else:
                self._engine.drop_adapter()
            return self._engine
        from transformers import AutoTokenizer

        from agentevo.models.http_backend import HTTPPolicy

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return HTTPPolicy.from_config(self.cfg.model.http, tokenizer, policy_id, self.cfg.rollout.batch_size)

    def rollout_adapter(self, base: str, adapter: Path, policy_id: str) -> Any:
        """A LoRA policy for rollouts on the vLLM engine: `base`'s weights (loaded once) with the adapter folder
        `adapter` served on top (model.vllm.enable_lora), so a new round's adapter costs no weight reload."""
        engine = self.rollout_policy(base)
        engine.load_adapter(adapter, policy_id)
        return engine

    def actor(self, policy: Any, sampling: Sampling, source: str = "self") -> Any:
        """The actor for a policy: ReAct prompts as token ids, or as chat text for an HTTP server in chat mode."""
        from agentevo.models.http_backend import HTTPPolicy, http_actor

        if isinstance(policy, HTTPPolicy):
            return http_actor(policy, self.signal_env.instruction(), self.cfg.agent.history_window, sampling, source)
        return PolicyActor(policy, self.signal_env.instruction(), self.cfg.agent.history_window, sampling, source)

    # -- collection and evaluation ------------------------------------------------------------
    @contextmanager
    def progress(self, description: str, total: int | None = None) -> Iterator[ProgressBar]:
        """A progress bar (rich) for rollouts or training; plain periodic lines when stdout is not a terminal (piped
        to a log); silent when the run is quiet."""
        from rich.progress import Progress

        if self.quiet:
            yield ProgressBar(None, None)
            return
        if not sys.stdout.isatty():
            bar = ProgressBar(None, None, plain=description, total=total)
            try:
                yield bar
            finally:
                bar.finish()
            return
        with Progress(*_progress_columns(), transient=False) as progress:
            yield ProgressBar(progress, progress.add_task(description, total=total))

    def collect(
        self,
        actor: Any,
        requests: list[EpisodeRequest],
        collection: str,
        description: str,
        pool: Any = None,
    ) -> list[Trajectory]:
        """Play the requests not yet stored in `collection`, storing each trajectory as it finishes."""
        done = self.store.done_slots(collection)
        todo = [r for r in requests if r.slot not in done]
        if todo:
            def store(req: EpisodeRequest, traj: Trajectory) -> None:
                self.store.add(traj, collection, req.slot)

            with self.progress(description, len(requests)) as bar:
                bar.advance(len(requests) - len(todo))
                if pool is None:
                    with self.pool() as p:
                        run_episodes(actor, p, todo, self.signal_env, store, bar.advance, self.cfg.rollout.max_retries)
                else:
                    run_episodes(actor, pool, todo, self.signal_env, store, bar.advance, self.cfg.rollout.max_retries)
        return self.store.load(collection=collection)

    def eval_sampling(self, max_new_tokens: int | None = None) -> Sampling:
        """Decoding of every evaluation: greedy, or eval.temperature / top_p with eval.seed."""
        e = self.cfg.eval
        n = self.cfg.agent.max_new_tokens if max_new_tokens is None else max_new_tokens
        if e.temperature <= 0:
            return Sampling(temperature=0.0, max_new_tokens=n)
        return Sampling(e.temperature, e.top_p, n, seed=e.seed)

    def evaluate(self, policy: TransformersPolicy, label: str, splits: list[str] | None = None,
                 prefix_fn: Callable[[Any], str] | None = None) -> dict[str, dict[str, Any]]:
        """Evaluation on the fixed splits (eval.*: greedy by default); metrics per split (collection
        eval/LABEL/SPLIT)."""
        actor = self.actor(policy, self.eval_sampling())
        return self.evaluate_actor(actor, label, splits, prefix_fn=prefix_fn)

    def evaluate_actor(self, actor: Any, label: str, splits: list[str] | None = None, pool: Any = None,
                       prefix_fn: Callable[[Any], str] | None = None,
                       extra: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
        """Evaluate any actor on the fixed splits (eval/LABEL/SPLIT); `extra` is added to each split's metrics.
        With eval.samples k > 1 each task is played k times (slots j * n_tasks + task index)."""
        out = {}
        e = self.cfg.eval
        for split in splits or e.splits:
            tasks = self.tasks(split, e.n_tasks)
            requests = [EpisodeRequest(t, j * len(tasks) + k, prefix=prefix_fn(t) if prefix_fn else "")
                        for j in range(e.samples) for k, t in enumerate(tasks)]
            trajs = self.collect(actor, requests, eval_collection(label, split), f"eval {label} on {split}", pool=pool)
            sampled = {"temperature": e.temperature, "samples_per_task": e.samples} if e.temperature > 0 else {}
            metrics = {**summarize(trajs), "task_hash": tasks.hash, "split": split, **sampled, **(extra or {})}
            self.logger.drop_after(eval_collection(label, split), -1)  # logged before a kill, not yet in state.json
            self.logger.log(eval_collection(label, split), 0, {k: v for k, v in metrics.items() if k != "split"})
            self.logger.log_samples(eval_collection(label, split), 0, trajs)  # the first tracking.samples episodes
            out[split] = metrics
        return out

    def close(self) -> None:
        """Close the store, the logger, the local env and the vLLM engine; then give up the folder."""
        try:
            if self._engine is not None:
                self._engine.close()
            if self._signal_env is not None:
                self._signal_env.close()
            self.store.close()
            self.logger.close()
        finally:
            self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()


def require(condition: bool, message: str) -> None:
    """Raise a user-facing error when a precondition does not hold."""
    if not condition:
        raise AgentevoError(message)
