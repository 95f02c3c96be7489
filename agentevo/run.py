"""A run: its folder, resolved config, experience store, metrics, resumable phases, env pools and policies."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from agentevo import dist
from agentevo.config import RunConfig, _build, dump_config
from agentevo.data.store import ExperienceStore
from agentevo.data.types import Trajectory
from agentevo.envs import TaskList, make_env
from agentevo.errors import AgentevoError, ConfigError
from agentevo.eval.metrics import eval_collection, summarize
from agentevo.models import placement
from agentevo.models.backend import Sampling, TransformersPolicy, load_pretrained, set_torch_threads
from agentevo.rollout.engine import EpisodeRequest, PolicyActor, run_episodes
from agentevo.rollout.workers import make_pool
from agentevo.train.tracking import MetricsLogger

log = logging.getLogger(__name__)

_PHASE_FAILED = "__agentevo_phase_failed__"


def _progress_columns() -> list[Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn()]


class ProgressBar:
    """Advance or set a rich progress task (no-op when quiet)."""

    def __init__(self, progress: Any, task: Any) -> None:
        self._progress, self._task = progress, task

    def advance(self, n: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)

    def update(self, completed: int, total: int | None = None, **fields: Any) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, total=total)

    def training_callback(self) -> Callable[[int, int, dict[str, float]], None]:
        """An on_step callback for train()."""
        return lambda step, total, record: self.update(step, total)


class Run:
    """Everything one experiment writes lives under runs/NAME/ (see DESIGN.md, 'The run directory')."""

    def __init__(self, cfg: RunConfig, run_dir: Path, quiet: bool = False) -> None:
        self.cfg = cfg
        self.dir = run_dir
        self.main = dist.is_main()  # under `accelerate launch` only rank 0 collects, evaluates and writes
        self.quiet = quiet or not self.main
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.main:
            (self.dir / "config.yaml").write_text(dump_config(cfg))
        self.store = ExperienceStore(self.dir / "experience.db")
        self.logger = MetricsLogger(self.dir, enabled=self.main)
        self.state_path = self.dir / "state.json"
        self.state: dict[str, Any] = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.threads = set_torch_threads(cfg.model.torch_threads)
        placement.configure(cfg.model.device, cfg.model.dtype)
        self._signal_env: Any = None
        self._engine: Any = None  # the vLLM engine of this run (model.backend = vllm), kept across rounds

    # -- creation ------------------------------------------------------------------------------
    @classmethod
    def create(cls, cfg: RunConfig, quiet: bool = False) -> Run:
        """A new run folder (or the existing one of the same name, which is then resumed)."""
        # every rank of a distributed run must name the same folder, whatever its clock says
        name = cfg.name or dist.broadcast(f"{cfg.method}-{cfg.env.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        cfg.name = name
        return cls(cfg, Path(cfg.output_dir) / name, quiet=quiet)

    @classmethod
    def open(cls, run_dir: str | Path, quiet: bool = False) -> Run:
        """Reopen a run folder from its config.yaml (for `agentevo resume`)."""
        run_dir = Path(run_dir)
        path = run_dir / "config.yaml"
        if not path.exists():
            raise ConfigError(f"{str(run_dir)!r} is not a run folder (no config.yaml); give runs/NAME")
        cfg = _build(RunConfig, yaml.safe_load(path.read_text()))
        cfg.validate()
        return cls(cfg, run_dir, quiet=quiet)

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
            tmp = self.state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.state, indent=1, default=str))
            os.replace(tmp, self.state_path)
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
        p = make_pool(self.cfg.env.name, self.env_params, size or self.cfg.rollout.n_parallel, self.cfg.rollout.workers)
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
            self.cfg.rollout.prefix_cache_gb,
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
        """A progress bar (rich) for rollouts or training; silent when the run is quiet."""
        from rich.progress import Progress

        if self.quiet:
            yield ProgressBar(None, None)
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

    def evaluate(self, policy: TransformersPolicy, label: str, splits: list[str] | None = None,
                 prefix_fn: Callable[[Any], str] | None = None) -> dict[str, dict[str, Any]]:
        """Greedy evaluation on the fixed splits; metrics per split (stored as collection eval/LABEL/SPLIT)."""
        actor = self.actor(policy, Sampling(temperature=0.0, max_new_tokens=self.cfg.agent.max_new_tokens))
        return self.evaluate_actor(actor, label, splits, prefix_fn=prefix_fn)

    def evaluate_actor(self, actor: Any, label: str, splits: list[str] | None = None, pool: Any = None,
                       prefix_fn: Callable[[Any], str] | None = None,
                       extra: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
        """Evaluate any actor on the fixed splits (eval/LABEL/SPLIT); `extra` is added to each split's metrics."""
        out = {}
        for split in splits or self.cfg.eval.splits:
            tasks = self.tasks(split, self.cfg.eval.n_tasks)
            requests = [EpisodeRequest(t, k, prefix=prefix_fn(t) if prefix_fn else "") for k, t in enumerate(tasks)]
            trajs = self.collect(actor, requests, eval_collection(label, split), f"eval {label} on {split}", pool=pool)
            metrics = {**summarize(trajs), "task_hash": tasks.hash, "split": split, **(extra or {})}
            self.logger.log(eval_collection(label, split), 0, {k: v for k, v in metrics.items() if k != "split"})
            out[split] = metrics
        return out

    def close(self) -> None:
        """Close the store, the logger, the local env and the vLLM engine."""
        if self._engine is not None:
            self._engine.close()
        if self._signal_env is not None:
            self._signal_env.close()
        self.store.close()
        self.logger.close()


def require(condition: bool, message: str) -> None:
    """Raise a user-facing error when a precondition does not hold."""
    if not condition:
        raise AgentevoError(message)
