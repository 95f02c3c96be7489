"""Environment workers as Ray actors: the pool interface of rollout/workers.py, spread over a Ray cluster.

Each env instance lives in its own Ray actor (a separate process, on any node of the cluster), so one crashed
environment takes down one worker, which is replaced; `run_episodes` then replays that episode from its reset,
exactly as with the process pool. A call with no answer within `step_timeout_s` (a hung env) gets its actor killed
(with the processes it started, such as a JVM, when the actor runs on this node) and is answered EnvCrashedError,
so the episode is retried on a fresh actor. Calls to one actor run in the order they were sent (Ray runs a synchronous
actor's tasks from one caller in submission order), so `map` keeps the per-env order `run_episodes` relies on.

Connecting: an already initialised Ray is used as it is; else `ray.init(address=...)` joins the cluster named by
`address` or the RAY_ADDRESS variable, and with neither starts a local Ray on this machine. Every node must be
able to import agentevo and the environment's extra (install the same environment on each node).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from agentevo.errors import AgentevoError, EnvCrashedError, MissingDependencyError
from agentevo.rollout.workers import (
    DEFAULT_STEP_TIMEOUT_S,
    install_registry_entry,
    kill_process_tree,
    registry_entry,
    timeout_error,
)

log = logging.getLogger(__name__)

Call = tuple[int, str, tuple[Any, ...]]

_PASS_THROUGH = ("ConfigError", "MissingDependencyError")  # user errors: re-raised as such, the worker is fine


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError(
            "rollout.workers = ray needs Ray: pip install 'agentevo[ray]' (or set rollout.workers to thread/process)"
        ) from exc
    return ray


class EnvWorker:
    """The body of one Ray actor: an env instance built on first use, rebuilt after it fails."""

    def __init__(self, env_name: str, env_params: dict[str, Any], entry: Any = None) -> None:
        os.environ["OMP_NUM_THREADS"] = "1"
        install_registry_entry(env_name, entry)
        self.env_name, self.env_params = env_name, env_params
        self.env: Any = None

    def pid(self) -> int:
        """This worker's process id (tests kill it)."""
        return os.getpid()

    def where(self) -> tuple[str, int]:
        """(Ray node id, process id) of this worker: the pool kills a hung local worker's processes by pid."""
        return _ray().get_runtime_context().get_node_id(), os.getpid()

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        """Run env.method(*args); an unexpected exception closes the env and is raised as EnvCrashedError."""
        from agentevo.envs import make_env

        try:
            if self.env is None:
                self.env = make_env(self.env_name, **self.env_params)
            return getattr(self.env, method)(*args)
        except AgentevoError as exc:
            if type(exc).__name__ in _PASS_THROUGH:
                raise
            self._drop_env()
            raise EnvCrashedError(f"{self.env_name}.{method}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a broken env is rebuilt on the next call
            self._drop_env()
            raise EnvCrashedError(f"{self.env_name}.{method}: {type(exc).__name__}: {exc}") from None

    def _drop_env(self) -> None:
        env, self.env = self.env, None
        if env is not None:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - a dead env may fail to close
                pass

    def close(self) -> None:
        """Close the env (before the actor is killed)."""
        self._drop_env()


class RayEnvPool:
    """`size` env instances in Ray actors: map(calls), restart(i), close(), size (see ThreadEnvPool)."""

    def __init__(
        self,
        env_name: str,
        env_params: dict[str, Any],
        size: int,
        address: str | None = None,
        num_cpus: float | None = None,
        init_kwargs: dict[str, Any] | None = None,
        step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S,
    ) -> None:
        ray = _ray()
        self.env_name, self.env_params, self.size = env_name, dict(env_params), size
        self.step_timeout_s = step_timeout_s
        if not ray.is_initialized():
            ray.init(address=address or os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     logging_level=logging.WARNING, **(init_kwargs or {}))
        if num_cpus is None:
            # One CPU per env where the cluster has them; else share, so `size` actors always fit (a pool that
            # asks for more CPUs than the cluster has would wait forever for its actors).
            num_cpus = min(1.0, float(ray.cluster_resources().get("CPU", 1.0)) / max(1, size))
        self.num_cpus = num_cpus
        self._remote = ray.remote(num_cpus=num_cpus, max_restarts=0, max_task_retries=0)(EnvWorker)
        self._actors: list[Any] = [None] * size
        self._where: list[Any] = [None] * size  # ref to each actor's (node id, pid), asked for when it starts

    def _actor(self, i: int) -> Any:
        if self._actors[i] is None:
            self._actors[i] = self._remote.remote(self.env_name, self.env_params, registry_entry(self.env_name))
            self._where[i] = self._actors[i].where.remote()  # runs before any env call, so it is there if it hangs
        return self._actors[i]

    def worker_pid(self, i: int) -> int:
        """Process id of worker i, starting it if needed (tests kill it)."""
        return int(_ray().get(self._actor(i).pid.remote()))

    def map(self, calls: list[Call]) -> list[Any]:
        """Send every call, then collect the answers; a dead or hung worker yields EnvCrashedError and is replaced."""
        ray = _ray()
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        starting = {i for i, _, _ in calls if self._actors[i] is None}
        refs = [self._actor(i).call.remote(method, args) for i, method, args in calls]
        if starting and self.step_timeout_s is not None:
            # Starting an actor (scheduling, a new process) is Ray's time, not the env's: the deadlines count
            # from when the new actors are up.
            try:
                ray.get([self._where[i] for i in starting])
            except Exception:  # noqa: BLE001 - an actor that failed to start is reported by its calls below
                pass
        sent_at = time.monotonic()
        last_answer: dict[int, float] = {}  # an actor runs its calls in order: see ProcessEnvPool.map
        results: list[Any] = []
        dead: set[int] = set()
        hung: dict[int, EnvCrashedError] = {}
        for (i, method, _), ref in zip(calls, refs, strict=True):
            if i in hung:
                results.append(hung[i])
                continue
            timeout = None
            if self.step_timeout_s is not None:
                deadline = max(sent_at, last_answer.get(i, sent_at)) + self.step_timeout_s
                timeout = max(0.0, deadline - time.monotonic())
            try:
                results.append(ray.get(ref, timeout=timeout))
                last_answer[i] = time.monotonic()
            except GetTimeoutError:
                dead.add(i)
                self._kill(i)
                hung[i] = timeout_error(self.env_name, i, method, self.step_timeout_s)  # type: ignore[arg-type]
                log.warning("%s worker %d hung in %s for %g s: actor killed", self.env_name, i, method,
                            self.step_timeout_s)
                results.append(hung[i])
            except RayTaskError as exc:
                last_answer[i] = time.monotonic()
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                if isinstance(cause, AgentevoError):
                    results.append(cause)
                else:
                    results.append(EnvCrashedError(f"{self.env_name} worker {i}.{method}: {cause!r}"))
            except RayActorError as exc:
                if i not in dead:  # every later call to the same dead actor fails the same way
                    dead.add(i)
                    self.restart(i)
                results.append(EnvCrashedError(f"{self.env_name} worker {i} died during {method}: {exc}"))
        return results

    def _kill(self, i: int) -> None:
        """Kill hung worker i at once (no polite close: it is busy); the next call starts a fresh actor."""
        ray = _ray()
        actor, self._actors[i] = self._actors[i], None
        where, self._where[i] = self._where[i], None
        if actor is None:
            return
        try:
            node, pid = ray.get(where, timeout=5)
            # ray.kill ends the actor's process but not the JVM it started, which a SIGSTOP would keep alive:
            # kill the whole tree when it runs here (on another node, a running JVM exits when its parent dies).
            if node == ray.get_runtime_context().get_node_id():
                kill_process_tree(int(pid))
        except Exception:  # noqa: BLE001 - the actor may never have started
            pass
        ray.kill(actor, no_restart=True)

    def restart(self, i: int) -> None:
        """Stop worker i; the next call starts a fresh actor."""
        actor, self._actors[i] = self._actors[i], None
        self._where[i] = None
        if actor is None:
            return
        ray = _ray()
        try:
            ray.get(actor.close.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - a dead actor cannot close its env
            pass
        ray.kill(actor, no_restart=True)

    def close(self) -> None:
        """Stop every worker (the Ray runtime itself stays up for the next pool)."""
        for i in range(self.size):
            self.restart(i)
