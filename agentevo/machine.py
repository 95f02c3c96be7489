"""What a run ran on: CPU model and features, cores, torch threads, accelerator, library versions.

Every start of a run records one of these in its state.json (`machine`), so its report can quote the CPU model beside
its timing, a resume keeps the thread count the run started with (float results depend on it), and a resume on other
hardware, or a start on a busy machine, is named instead of silently changing or slowing the run.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

STATE_KEY = "machine"  # the state.json entry: a list with one describe() record per start of the run, first first
# CPU features that change what a CPU run can do fast (bf16 matmuls) or computes
FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
# what must match for a resumed run to compute what an uninterrupted one would
SAME_FOR_RESUME = ("cpu", "threads", "device", "torch")


def parse_cpuinfo(text: str) -> tuple[str | None, list[str]]:
    """(model name, the FEATURES present) from /proc/cpuinfo text; (None, []) when it names neither."""
    model: str | None = None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip() or None
        elif key in ("flags", "Features"):  # x86 / ARM spelling; every processor's, as a union
            flags.update(value.split())
    return model, [f for f in FEATURES if f in flags]


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, list[str]]:
    """This machine's CPU model (platform's answer where /proc/cpuinfo is missing) and its FEATURES."""
    try:
        model, features = parse_cpuinfo(cpuinfo.read_text(errors="replace"))
    except OSError:
        model, features = None, []
    return model or platform.processor() or platform.machine() or "unknown CPU", features


def cpu_times(stat_text: str) -> tuple[int, int] | None:
    """(busy, total) jiffies from the aggregate 'cpu' line of /proc/stat text (idle and iowait count as idle)."""
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
            idle = values[3] + (values[4] if len(values) > 4 else 0)
            return sum(values) - idle, sum(values)
    return None


def busy_cores(before: tuple[int, int], after: tuple[int, int], cores: int) -> float:
    """Cores busy between two cpu_times readings."""
    busy, total = after[0] - before[0], after[1] - before[1]
    return cores * busy / total if total > 0 else 0.0


def idle_cores(cores: int | None = None, interval: float = 0.05, stat: Path = Path("/proc/stat")) -> float:
    """Cores idle now: sampled from /proc/stat over `interval` seconds (the 1-minute load average where it cannot
    be read, which still counts a job that ended seconds ago as busy)."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    try:
        before = cpu_times(stat.read_text())
        time.sleep(interval)
        after = cpu_times(stat.read_text())
    except OSError:
        before = after = None
    if before is not None and after is not None and after[1] > before[1]:
        return max(0.0, cores - busy_cores(before, after, cores))
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return max(0.0, cores - load)


def describe(threads: int, device: str = "cpu", idle: float | None = None, precision: str | None = None
             ) -> dict[str, Any]:
    """This start's record: start time (epoch s), CPU model, features, cores, torch threads, device, torch and
    transformers versions, the cores idle at the start (another job's load makes its timing no timing) and the
    precision placement resolved (model.dtype)."""
    import torch
    import transformers

    cpu, features = cpu_description()
    if device.startswith("cuda") and torch.cuda.is_available():
        device = f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return {"started": round(time.time(), 1), "cpu": cpu, "features": features,
            "cores": os.cpu_count() or 1, "threads": threads, "device": device, "torch": torch.__version__,
            "transformers": transformers.__version__, "idle_cores": None if idle is None else round(idle, 1),
            "precision": precision}


def summary(rec: dict[str, Any]) -> str:
    """One line: 'AMD EPYC (2 cores; avx512f, avx512_bf16), 2 torch threads, cpu, torch 2.13.0'."""
    features = f"; {', '.join(rec['features'])}" if rec.get("features") else ""
    return (f"{rec.get('cpu', '?')} ({rec.get('cores', '?')} cores{features}), {rec.get('threads', '?')} torch "
            f"threads, {rec.get('device', '?')}, torch {rec.get('torch', '?')}")


def resume_difference(first: dict[str, Any], now: dict[str, Any]) -> str:
    """What differs between the start a run began with and this one, among SAME_FOR_RESUME ('' when nothing)."""
    return "; ".join(f"{key} {first.get(key)!r} -> {now.get(key)!r}" for key in SAME_FOR_RESUME
                     if first.get(key) != now.get(key))


def busy_warning(threads: int, idle: float, cores: int) -> str | None:
    """A warning when this run's torch threads (2 or more: one thread does not spin-wait on the others) exceed the
    idle cores by a core or more: another job is busy. The automatic count (idle cores) never triggers it."""
    if threads < 2 or threads < idle + 1:
        return None
    return (f"{threads} torch thread{'s' * (threads != 1)} on {cores} core{'s' * (cores != 1)} with {idle:.1f} idle: "
            "another job is using the CPU; torch processes that each use every core slow each other far more than "
            "2x (measured ~16x with two of them on 2 cores, docs/benchmarks.md), so this run's timing will not be "
            "one: let the other job finish, or give each job its own cores (model.torch_threads)")


def compute_seconds(starts: list[dict[str, Any]], record_times: list[float]) -> float:
    """Time the run computed: for each start, from its start to the last metrics record before the next start
    (time between a kill and the resume is not counted; a start that logged nothing counts 0)."""
    begins = [float(s["started"]) for s in starts if isinstance(s.get("started"), (int, float))]
    total = 0.0
    for i, begin in enumerate(begins):
        end = begins[i + 1] if i + 1 < len(begins) else float("inf")
        inside = [t for t in record_times if begin <= t < end]
        total += max(inside) - begin if inside else 0.0
    return total
