"""Java checks and JVM options shared by the JVM-backed environments (TextWorldExpress, ScienceWorld)."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agentevo.errors import MissingDependencyError


def require_java(env_name: str) -> None:
    """Fail with an install hint when no `java` executable is on PATH."""
    if shutil.which("java") is None:
        raise MissingDependencyError(
            f"{env_name} needs a Java runtime (17 or newer) and `java` is not on PATH; "
            "install it with `apt-get install -y default-jre-headless` (Debian/Ubuntu) or your OS's JDK package"
        )


@contextmanager
def bounded_jvm(max_heap_mb: int) -> Iterator[None]:
    """Start JVMs inside this block with a bounded heap, a serial GC, one processor's worth of threads and no
    hsperfdata file: the JVM's warning that such a file is locked by another process goes to stdout, where py4j
    reads the gateway's port, and the env's reset failed on it (seen in a study: "invalid literal for int() ...
    [warning][perf,memops] Cannot use file /tmp/hsperfdata_root/21135")."""
    previous = os.environ.get("JAVA_TOOL_OPTIONS")
    os.environ["JAVA_TOOL_OPTIONS"] = (f"-Xmx{max_heap_mb}m -XX:+UseSerialGC -XX:ActiveProcessorCount=1 "
                                       "-XX:-UsePerfData")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("JAVA_TOOL_OPTIONS", None)
        else:
            os.environ["JAVA_TOOL_OPTIONS"] = previous


_QUIET: dict[type, type] = {}


def quiet_when_half_built(simulator_cls: type) -> type:
    """The simulator class with a `__del__` that skips an instance whose JVM never started.

    TextWorldExpress's and ScienceWorld's `__del__` call `close()`, which reads `self._gateway`; when the JVM fails
    to start (a port py4j cannot read, a missing jar) the instance has none, and garbage collection printed an
    AttributeError traceback after the real error. The subclass is made once per class."""
    if simulator_cls not in _QUIET:

        def __del__(self: Any) -> None:
            if "_gateway" in self.__dict__:
                simulator_cls.__del__(self)  # type: ignore[attr-defined]

        _QUIET[simulator_cls] = type(simulator_cls.__name__, (simulator_cls,), {"__del__": __del__})
    return _QUIET[simulator_cls]


def jvm_process(simulator: Any) -> Any:
    """The subprocess.Popen of a py4j-backed simulator's JVM (its gateway's java_process), or None."""
    return getattr(getattr(simulator, "_gateway", None), "java_process", None)


def shutdown_jvm(simulator: Any, crashed: bool = False) -> None:
    """Close a py4j-backed simulator and make sure its JVM exits, whether it is alive, wedged or already dead.

    A dead JVM's py4j client is marked disconnected first, so that neither the shutdown nor the garbage collection of
    its Java object proxies dials the dead port again (each try logs a traceback). close() only asks the JVM to exit;
    one still running 5 s later is killed, so crashed or wedged JVMs never pile up. crashed=True (a call to it just
    failed) kills and reaps it first: a JVM killed a moment ago can have closed its socket before the OS reports it
    exited, and a polite close would dial it.
    """
    proc = jvm_process(simulator)
    if crashed and proc is not None and proc.poll() is None:
        _kill_and_reap(proc)
    if proc is not None and proc.poll() is not None:
        simulator._gateway._gateway_client.is_connected = False
    try:
        simulator.close()
    except Exception:  # noqa: BLE001 - a dead JVM cannot be shut down cleanly
        pass
    if proc is not None and proc.poll() is None:
        try:
            proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - still alive after the polite request
            _kill_and_reap(proc)


def _kill_and_reap(proc: Any) -> None:
    """SIGKILL (it ends even a stopped process) and wait for the exit, up to 5 s."""
    proc.kill()
    try:
        proc.wait(timeout=5)
    except Exception:  # noqa: BLE001 - unkillable (uninterruptible sleep); nothing more can be done here
        pass


def kill_jvm(env: object) -> bool:
    """SIGKILL the JVM of a JVM-backed env (one with jvm_pid()); False when it has none running.

    A hung or SIGSTOPped JVM answers no shutdown request, but SIGKILL ends even a stopped process, and the py4j
    call blocked on it then fails, which frees the thread that made it.
    """
    jvm_pid = getattr(env, "jvm_pid", None)
    if not callable(jvm_pid):
        return False
    try:
        pid = jvm_pid()
    except Exception:  # noqa: BLE001 - the env's bridge may already be half torn down
        return False
    if pid is None:
        return False
    try:
        os.kill(int(pid), signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True
