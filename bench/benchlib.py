"""Shared bench helpers: the CPU line, a quick BC policy that acts, and env steps per point of held-out gain."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# The tiny default (configs/demo_twx_bc.yaml) trained briefly: valid-looking actions, not a good policy.
BC_OVERRIDES = ["env.n_train=40", "env.n_test=20", "optim.epochs=2"]
# Smoke: a smaller model, 2 demos, 2 test tasks, 3-step episodes (seconds, not a policy).
SMOKE_BC_OVERRIDES = [
    "env.n_train=2", "env.n_dev=2", "env.n_test=2", "env.params.max_steps=3", "optim.epochs=1",
    "model.tiny={hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64, vocab_size: 256}",
    "agent.max_new_tokens=8", "rollout.n_parallel=2", "rollout.batch_size=2",
]


def cpu_line() -> str:
    """`lscpu` Model name, whether AMX / AVX512-BF16 are present, cores, and the load average (the machine may be shared)."""
    model = "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except OSError:
        pass
    flags: set[str] = set()
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("flags"):
                flags = set(ln.split(":", 1)[1].split())
                break
    except OSError:
        pass
    amx = "yes" if {"amx_bf16", "amx_tile"} <= flags else "no"
    bf16 = "yes" if "avx512_bf16" in flags else "no"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"CPU: {model} | AMX: {amx} | AVX512-BF16: {bf16} | {os.cpu_count()} cores | load average {load}"


def bc_run(workdir: Path, smoke: bool = False, extra: list[str] | None = None) -> Path:
    """A finished BC run folder on the tiny default (demos, init/bc checkpoints, eval/bc): other runs import it with
    bc.warm_start_from, so every method starts from the same policy that acts."""
    from agentevo.algorithms.bc import warm_start
    from agentevo.config import load_config
    from agentevo.run import Run

    overrides = (SMOKE_BC_OVERRIDES if smoke else BC_OVERRIDES) + (extra or [])
    cfg = load_config(ROOT / "configs/demo_twx_bc.yaml", overrides, name="bench-bc", output_dir=str(workdir))
    run = Run.create(cfg, quiet=True)
    try:
        warm_start(run)
    finally:
        run.close()
    return run.dir


def quick_bc_model(workdir: Path, smoke: bool = False) -> Path:
    """The checkpoint folder of bc_run's policy."""
    return bc_run(workdir, smoke) / "checkpoints" / "bc"


def steps_per_point(run_dir: Path, split: str = "test") -> dict[str, Any]:
    """Env steps the run collected after BC, held-out success of BC and of its last round/update, and their ratio."""
    import re

    from agentevo.eval.compare import load_points

    points = load_points(run_dir, split)
    bc = next(p for p in points if p.label == "bc")
    final = [p for p in points if re.fullmatch(r"(round|update)-\d+", p.label)][-1]
    gain = 100 * (final.success - bc.success)  # percentage points
    steps = final.env_steps or 0.0
    return {"label": final.label, "bc": 100 * bc.success, "final": 100 * final.success, "gain": gain,
            "env_steps": steps, "per_point": steps / gain if gain > 0 else None}


def format_per_point(r: dict[str, Any]) -> str:
    """'N env steps / +1 point', or 'no gain' when held-out success did not rise (no negative or infinite ratio)."""
    return f"{r['per_point']:.0f}" if r["per_point"] is not None else "no gain"
