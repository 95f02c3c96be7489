"""Environment worker pools: many env instances stepped concurrently, in threads or in processes.

Every reset/step has a deadline (`step_timeout_s`, rollout.step_timeout_s): an env that gives no answer in time
(a wedged or SIGSTOPped JVM, a deadlock) is killed, its call answered with EnvCrashedError, and the next call gets
a fresh env, so `run_episodes` retries the episode instead of waiting forever.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from typing import Any

from agentevo.envs import ENVIRONMENTS, make_env
from agentevo.envs.java import kill_jvm
from agentevo.errors import AgentevoError, EnvCrashedError

log = logging.getLogger(__name__)

Call = tuple[int, str, tuple[Any, ...]]

DEFAULT_STEP_TIMEOUT_S = 120.0  # the default of rollout.step_timeout_s, for pools built outside a run
STARTUP_TIMEOUT_S = 60.0  # how long a new worker process may take to start (imports), at least the step timeout


def timeout_error(env_name: str, i: int, method: str, timeout_s: float) -> EnvCrashedError:
    """The error a call gets when its env gave no answer within the step timeout."""
    return EnvCrashedError(
        f"{env_name} worker {i}: {method} gave no answer within rollout.step_timeout_s = {timeout_s:g} s; the "
        f"environment was killed and is restarted (raise rollout.step_timeout_s if it is just slow)"
    )


def _descendants(pid: int) -> list[int]:
    """Process ids of pid's children, grandchildren, ... (read from Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            # the command name (2nd field) may hold spaces and ')': the parent pid is the 2nd field after the last ')'
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_process_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (a worker and the JVM it started; SIGKILL ends stopped ones too)."""
    # Collect the tree first: once the worker is dead its JVM is re-parented and can no longer be found.
    for p in [*_descendants(pid), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _close_quietly(env: Any) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 - a dead or hung env may fail to close
        pass


class _Abandoned(Exception):
    """Raised in a worker thread whose env was given up as hung: the thread stops without touching the slot."""


class ThreadEnvPool:
    """Env instances in this process, called from threads (right for JVM envs: the work is in the JVM)."""

    def __init__(self, env_name: str, env_params: dict[str, Any], size: int,
                 step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S) -> None:
        self.env_name, self.env_params, self.size = env_name, dict(env_params), size
        self.step_timeout_s = step_timeout_s
        self._envs: list[Any] = [None] * size
        # Bumped when slot i's env is given up as hung; a thread holding an older generation must stop.
        self._gen = [0] * size
        self._lock = threading.RLock()

    def _env(self, i: int, gen: int) -> Any:
        with self._lock:
            if self._gen[i] != gen:
                raise _Abandoned
            env = self._envs[i]
        if env is None:
            env = make_env(self.env_name, **self.env_params)
            with self._lock:
                if self._gen[i] != gen:  # given up while it was being built
                    _close_quietly(env)
                    raise _Abandoned
                self._envs[i] = env
        return env

    def _run(self, i: int, method: str, args: tuple[Any, ...], gen: int) -> Any:
        env = self._env(i, gen)
        try:
            return getattr(env, method)(*args)
        except AgentevoError:
            raise
        except Exception as exc:  # an env that raised something unexpected is treated as crashed
            with self._lock:
                mine = self._envs[i] is env  # not if the slot already holds a fresh env
            if mine:
                self.restart(i)
            raise EnvCrashedError(f"{self.env_name}[{i}].{method} failed: {exc!r}") from exc

    def map(self, calls: list[Call]) -> list[Any]:
        """Run the calls, concurrently across envs and in order per env; each result is a value or an exception."""
        by_env: dict[int, list[int]] = {}
        for k, (i, _, _) in enumerate(calls):
            by_env.setdefault(i, []).append(k)
        results: list[Any] = [None] * len(calls)
        answered: set[int] = set()
        started: dict[int, float] = {}  # env -> when its call in flight started
        finished = {i: threading.Event() for i in by_env}
        gens = {i: self._gen[i] for i in by_env}

        def run_in_order(i: int, ks: list[int]) -> None:
            try:
                for k in ks:
                    with self._lock:
                        if self._gen[i] != gens[i]:
                            return
                        started[i] = time.monotonic()
                    _, method, args = calls[k]
                    try:
                        value: Any = self._run(i, method, args, gens[i])
                    except _Abandoned:
                        return
                    except Exception as exc:  # noqa: BLE001 - returned to the caller, which decides
                        value = exc
                    with self._lock:
                        if self._gen[i] != gens[i]:
                            return  # answered late: the caller already has a timeout error for it
                        results[k] = value
                        answered.add(k)
            finally:
                finished[i].set()

        # Daemon threads, one per env per call batch: a thread stuck in a hung env is abandoned, and a daemon
        # thread neither blocks the next batch (as a busy executor slot would) nor the interpreter's exit.
        for i, ks in by_env.items():
            threading.Thread(target=run_in_order, args=(i, ks), name=f"env-{i}", daemon=True).start()
        timeout = self.step_timeout_s
        for i, ks in by_env.items():
            while not finished[i].wait(None if timeout is None else self._wait_s(started.get(i), timeout)):
                with self._lock:
                    t0 = started.get(i)
                    if finished[i].is_set() or t0 is None or time.monotonic() - t0 < timeout:  # type: ignore[operator]
                        continue
                    unanswered = [k for k in ks if k not in answered]
                    if not unanswered:  # the thread is just finishing
                        continue
                    hung = unanswered[0]
                    self._abandon(i)
                    for k in unanswered:
                        results[k] = timeout_error(self.env_name, i, calls[hung][1], timeout)  # type: ignore[arg-type]
                    log.warning("%s[%d].%s hung for %g s: the env is abandoned and rebuilt", self.env_name, i,
                                calls[hung][1], timeout)
                break
        return results

    @staticmethod
    def _wait_s(t0: float | None, timeout: float) -> float:
        return 0.05 if t0 is None else max(0.01, t0 + timeout - time.monotonic())

    def _abandon(self, i: int) -> None:
        """Give up env i as hung: the next call builds a fresh one; its thread is left behind."""
        with self._lock:
            self._gen[i] += 1
            env, self._envs[i] = self._envs[i], None
        if env is None:
            return
        # A thread cannot be killed in Python. A JVM env's JVM can: killing it makes the blocked py4j call fail,
        # and the abandoned thread ends. Any other env is closed in the background (which may unblock it) and
        # its thread, if it stays stuck, is a daemon that costs a thread, not the run.
        kill_jvm(env)
        threading.Thread(target=_close_quietly, args=(env,), name=f"env-{i}-close", daemon=True).start()

    def restart(self, i: int) -> None:
        """Close env i; the next call builds a fresh one."""
        with self._lock:
            env, self._envs[i] = self._envs[i], None
        if env is not None:
            _close_quietly(env)

    def close(self) -> None:
        """Close every env."""
        for i in range(self.size):
            self.restart(i)


def registry_entry(env_name: str) -> Any:
    """The environment's registry entry, passed to spawned workers: their fresh import of agentevo.envs lacks
    environments registered at run time (plug-ins, tests)."""
    return ENVIRONMENTS.get(env_name)


def install_registry_entry(env_name: str, entry: Any) -> None:
    """Add the parent's registry entry for env_name in a worker process (a no-op when it is already known)."""
    if entry is not None:
        ENVIRONMENTS.setdefault(env_name, entry)


def _worker_main(conn: Any, env_name: str, env_params: dict[str, Any], entry: Any = None) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    install_registry_entry(env_name, entry)
    conn.send(("ready",))  # starting a process is not the env's time: the parent's deadlines start from here
    env = None
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        method, args = msg
        try:
            if env is None:
                env = make_env(env_name, **env_params)
            conn.send(("ok", getattr(env, method)(*args)))
        except Exception as exc:  # noqa: BLE001 - sent back to the parent
            conn.send(("err", exc.__class__.__name__, str(exc), traceback.format_exc()))
            if not isinstance(exc, AgentevoError) or isinstance(exc, EnvCrashedError):
                try:
                    if env is not None:
                        env.close()
                finally:
                    env = None
    if env is not None:
        env.close()


class ProcessEnvPool:
    """One worker process per env instance (isolation: a crash takes down one worker, which is restarted)."""

    def __init__(self, env_name: str, env_params: dict[str, Any], size: int,
                 step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S) -> None:
        self.env_name, self.env_params, self.size = env_name, dict(env_params), size
        self.step_timeout_s = step_timeout_s
        self._ctx = mp.get_context("spawn")
        self._workers: list[tuple[Any, Any] | None] = [None] * size
        self._starting: set[int] = set()  # workers whose "ready" message is not read yet

    def _worker(self, i: int) -> tuple[Any, Any]:
        if self._workers[i] is None:
            self._starting.add(i)
            parent, child = self._ctx.Pipe()
            proc = self._ctx.Process(
                target=_worker_main, args=(child, self.env_name, self.env_params, registry_entry(self.env_name)),
                daemon=True,
            )
            proc.start()
            child.close()
            self._workers[i] = (proc, parent)
        return self._workers[i]  # type: ignore[return-value]

    def worker_pid(self, i: int) -> int | None:
        """Process id of worker i (tests kill it)."""
        w = self._workers[i]
        return None if w is None else w[0].pid

    def map(self, calls: list[Call]) -> list[Any]:
        """Send every call, then collect the answers; a dead or hung worker yields EnvCrashedError and is restarted."""
        sent: list[Any] = []  # the connection each call went to, or the exception that stopped it
        for i, method, args in calls:
            try:
                conn = self._worker(i)[1]
                conn.send((method, args))
                sent.append(conn)
            except (BrokenPipeError, OSError) as exc:
                self.restart(i)
                sent.append(EnvCrashedError(f"{self.env_name} worker {i} is gone: {exc!r}"))
        sent_at = time.monotonic()
        # A worker runs its calls in order, so call k starts no earlier than the previous answer from its worker:
        # its deadline counts from then (reading that answer late only makes the deadline later, never earlier).
        last_answer: dict[int, float] = {}
        hung: dict[int, EnvCrashedError] = {}  # workers killed or lost in this batch: their later calls fail too
        for i in sorted(self._starting):
            failure = self._await_ready(i)
            if failure is not None:
                hung[i] = failure
            last_answer[i] = time.monotonic()
        results: list[Any] = []
        for (i, method, _), conn in zip(calls, sent, strict=True):
            if isinstance(conn, Exception):
                results.append(conn)
                continue
            if i in hung:
                results.append(hung[i])
                continue
            if self.step_timeout_s is not None:
                deadline = max(sent_at, last_answer.get(i, sent_at)) + self.step_timeout_s
                try:
                    ready = conn.poll(max(0.0, deadline - time.monotonic()))
                except (EOFError, OSError):
                    ready = True  # recv below reports the dead worker
                if not ready:
                    self._kill(i)
                    hung[i] = timeout_error(self.env_name, i, method, self.step_timeout_s)
                    log.warning("%s worker %d hung in %s for %g s: killed", self.env_name, i, method,
                                self.step_timeout_s)
                    results.append(hung[i])
                    continue
            try:
                answer = conn.recv()
            except (EOFError, OSError) as exc:
                self.restart(i)
                results.append(EnvCrashedError(f"{self.env_name} worker {i} died during {method}: {exc!r}"))
                continue
            last_answer[i] = time.monotonic()
            if answer[0] == "ok":
                results.append(answer[1])
            else:
                _, name, text, _tb = answer
                if name in ("ConfigError", "MissingDependencyError"):
                    from agentevo import errors

                    results.append(getattr(errors, name)(text))
                else:
                    results.append(EnvCrashedError(f"{self.env_name} worker {i}.{method}: {name}: {text}"))
        return results

    def _await_ready(self, i: int) -> EnvCrashedError | None:
        """Read new worker i's "ready" message; an error when it died or did not start in time (it is killed)."""
        self._starting.discard(i)
        w = self._workers[i]
        if w is None:
            return None
        limit = None if self.step_timeout_s is None else max(STARTUP_TIMEOUT_S, self.step_timeout_s)
        try:
            if w[1].poll(limit):
                w[1].recv()
                return None
        except (EOFError, OSError) as exc:
            self.restart(i)
            return EnvCrashedError(f"{self.env_name} worker {i} died while starting: {exc!r}")
        self._kill(i)
        return EnvCrashedError(f"{self.env_name} worker {i} did not start within {limit:g} s")

    def _kill(self, i: int) -> None:
        """Kill worker i and the processes it started (its JVM) at once; the next call starts a fresh one."""
        w, self._workers[i] = self._workers[i], None
        self._starting.discard(i)
        if w is None:
            return
        proc, conn = w
        kill_process_tree(proc.pid)
        proc.join(timeout=5)
        conn.close()

    def restart(self, i: int) -> None:
        """Stop worker i; the next call starts a fresh one."""
        w, self._workers[i] = self._workers[i], None
        self._starting.discard(i)
        if w is None:
            return
        proc, conn = w
        try:
            conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        proc.join(timeout=5)
        if proc.is_alive():
            kill_process_tree(proc.pid)
            proc.join(timeout=5)
        conn.close()

    def close(self) -> None:
        """Stop all workers."""
        for i in range(self.size):
            self.restart(i)


def make_pool(
    env_name: str, env_params: dict[str, Any], size: int, backend: str,
    step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S,
) -> Any:
    """A pool of `size` env instances in threads, processes or Ray actors; a reset/step past step_timeout_s
    (None: no limit) kills its env."""
    if backend == "thread":
        return ThreadEnvPool(env_name, env_params, size, step_timeout_s)
    if backend == "process":
        return ProcessEnvPool(env_name, env_params, size, step_timeout_s)
    if backend == "ray":
        from agentevo.rollout.ray_pool import RayEnvPool

        return RayEnvPool(env_name, env_params, size, step_timeout_s=step_timeout_s)
    raise ValueError(f"unknown worker backend {backend!r}")
