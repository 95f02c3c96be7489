"""Java checks and JVM options shared by the JVM-backed environments (TextWorldExpress, ScienceWorld)."""

from __future__ import annotations

import os
import shutil
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
