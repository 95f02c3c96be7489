"""Java checks and JVM options shared by the JVM-backed environments (TextWorldExpress, ScienceWorld)."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager

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
    """Start JVMs inside this block with a bounded heap, a serial GC and one processor's worth of threads."""
    previous = os.environ.get("JAVA_TOOL_OPTIONS")
    os.environ["JAVA_TOOL_OPTIONS"] = f"-Xmx{max_heap_mb}m -XX:+UseSerialGC -XX:ActiveProcessorCount=1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("JAVA_TOOL_OPTIONS", None)
        else:
            os.environ["JAVA_TOOL_OPTIONS"] = previous


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
