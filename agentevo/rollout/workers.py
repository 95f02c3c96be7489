"""Environment worker pools: many env instances stepped concurrently, in threads or in processes."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agentevo.envs import make_env
from agentevo.errors import AgentevoError, EnvCrashedError

log = logging.getLogger(__name__)

Call = tuple[int, str, tuple[Any, ...]]


class ThreadEnvPool:
    """Env instances in this process, called from a thread pool (right for JVM envs: the work is in the JVM)."""

    def __init__(self, env_name: str, env_params: dict[str, Any], size: int) -> None:
        self.env_name, self.env_params, self.size = env_name, dict(env_params), size
        self._envs: list[Any] = [None] * size
        self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="env")

    def _env(self, i: int) -> Any:
        if self._envs[i] is None:
            self._envs[i] = make_env(self.env_name, **self.env_params)
        return self._envs[i]

    def _run(self, i: int, method: str, args: tuple[Any, ...]) -> Any:
        try:
            return getattr(self._env(i), method)(*args)
        except AgentevoError:
            raise
        except Exception as exc:  # an env that raised something unexpected is treated as crashed
            self.restart(i)
            raise EnvCrashedError(f"{self.env_name}[{i}].{method} failed: {exc!r}") from exc

    def map(self, calls: list[Call]) -> list[Any]:
        """Run the calls, concurrently across envs and in order per env; each result is a value or an exception."""
        by_env: dict[int, list[int]] = {}
        for k, (i, _, _) in enumerate(calls):
            by_env.setdefault(i, []).append(k)
        results: list[Any] = [None] * len(calls)

        def run_in_order(ks: list[int]) -> None:
            for k in ks:
                i, method, args = calls[k]
                try:
                    results[k] = self._run(i, method, args)
                except Exception as exc:  # noqa: BLE001 - returned to the caller, which decides
                    results[k] = exc

        for future in [self._executor.submit(run_in_order, ks) for ks in by_env.values()]:
            future.result()
        return results

    def restart(self, i: int) -> None:
        """Close env i; the next call builds a fresh one."""
        env, self._envs[i] = self._envs[i], None
        if env is not None:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - a dead env may fail to close
                pass

    def close(self) -> None:
        """Close every env and the thread pool."""
        for i in range(self.size):
            self.restart(i)
        self._executor.shutdown(wait=True)


def _worker_main(conn: Any, env_name: str, env_params: dict[str, Any]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
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

    def __init__(self, env_name: str, env_params: dict[str, Any], size: int) -> None:
        self.env_name, self.env_params, self.size = env_name, dict(env_params), size
        self._ctx = mp.get_context("spawn")
        self._workers: list[tuple[Any, Any] | None] = [None] * size

    def _worker(self, i: int) -> tuple[Any, Any]:
        if self._workers[i] is None:
            parent, child = self._ctx.Pipe()
            proc = self._ctx.Process(target=_worker_main, args=(child, self.env_name, self.env_params), daemon=True)
            proc.start()
            child.close()
            self._workers[i] = (proc, parent)
        return self._workers[i]  # type: ignore[return-value]

    def worker_pid(self, i: int) -> int | None:
        """Process id of worker i (tests kill it)."""
        w = self._workers[i]
        return None if w is None else w[0].pid

    def map(self, calls: list[Call]) -> list[Any]:
        """Send every call, then collect the answers; a dead worker yields EnvCrashedError and is restarted."""
        sent: list[Any] = []  # the connection each call went to, or the exception that stopped it
        for i, method, args in calls:
            try:
                conn = self._worker(i)[1]
                conn.send((method, args))
                sent.append(conn)
            except (BrokenPipeError, OSError) as exc:
                self.restart(i)
                sent.append(EnvCrashedError(f"{self.env_name} worker {i} is gone: {exc!r}"))
        results: list[Any] = []
        for (i, method, _), conn in zip(calls, sent, strict=True):
            if isinstance(conn, Exception):
                results.append(conn)
                continue
            try:
                answer = conn.recv()
            except (EOFError, OSError) as exc:
                self.restart(i)
                results.append(EnvCrashedError(f"{self.env_name} worker {i} died during {method}: {exc!r}"))
                continue
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

    def restart(self, i: int) -> None:
        """Stop worker i; the next call starts a fresh one."""
        w, self._workers[i] = self._workers[i], None
        if w is None:
            return
        proc, conn = w
        try:
            conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        conn.close()

    def close(self) -> None:
        """Stop all workers."""
        for i in range(self.size):
            self.restart(i)


def make_pool(env_name: str, env_params: dict[str, Any], size: int, backend: str) -> ThreadEnvPool | ProcessEnvPool:
    """A pool of `size` env instances in threads or processes."""
    if backend == "thread":
        return ThreadEnvPool(env_name, env_params, size)
    if backend == "process":
        return ProcessEnvPool(env_name, env_params, size)
    if backend == "ray":
        from agentevo.rollout.ray_pool import RayEnvPool

        return RayEnvPool(env_name, env_params, size)
    raise ValueError(f"unknown worker backend {backend!r}")
