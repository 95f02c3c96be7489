"""Sample efficiency of Q-Evolve, GRPO and RSD side by side: env steps per point of held-out success gained over BC.

One BC run on the tiny default (a short warm start, so the policy acts) is imported by every method run
(bc.warm_start_from): all three start from the same policy, on the same env, agent and model settings (those of the
BC run; each method keeps its own section of configs/<method>_twx.yaml, scaled by the budgets below). Env steps are
the steps each method collected after BC (agentevo.eval.compare: Q-Evolve's self-collected steps, GRPO's
train_env_steps, RSD's acted steps); the gain is its last round / update minus BC on the test split, in points.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_methods.py [--methods qevolve grpo rsd] [--set KEY=VALUE ...]
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_methods.py --smoke     # seconds: checks it runs, no numbers
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, bc_run, cpu_line, format_per_point, steps_per_point  # noqa: E402

# Budgets for a CPU bench (each [O], overridable with --set method.key=value).
BUDGETS = {
    "qevolve": ["qevolve.n_iters=1", "qevolve.n_self_per_task=2"],
    "grpo": ["grpo.n_updates=4", "grpo.tasks_per_update=8", "grpo.group_size=4", "grpo.eval_every=4"],
    "rsd": ["rsd.rounds=1", "rsd.tasks_per_round=40", "rsd.probe_tasks=1"],
}
SMOKE = {
    "qevolve": ["qevolve.n_iters=1", "qevolve.n_self_per_task=1", "qevolve.critic_epochs=1", "qevolve.critic_hidden=16"],
    "grpo": ["grpo.n_updates=1", "grpo.tasks_per_update=2", "grpo.group_size=2", "grpo.eval_every=1"],
    "rsd": ["rsd.rounds=1", "rsd.tasks_per_round=2", "rsd.probe_tasks=1", "rsd.ctx_warm_start=false"],
}


def method_config(method: str, bc_dir: Path, overrides: list[str], workdir: Path) -> Any:
    """configs/<method>_twx.yaml with the BC run's env / agent / model / eval sections, importing that BC run."""
    from agentevo.config import load_config

    data = yaml.safe_load((ROOT / "configs" / f"{method}_twx.yaml").read_text())
    bc = yaml.safe_load((bc_dir / "config.yaml").read_text())
    for section in ("env", "agent", "model", "eval", "rollout"):
        data[section] = bc[section]  # warm_start_from demands equal env / agent / model settings
    data["optim"] = bc["optim"]  # only the (imported) BC used it; RSD's ctx-bc reads it too
    path = workdir / f"{method}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_config(path, [f"bc.warm_start_from={bc_dir}", *overrides], name=f"bench-{method}",
                       output_dir=str(workdir))


def run_method(method: str, bc_dir: Path, overrides: list[str], workdir: Path) -> dict[str, Any]:
    """Run the recipe from the shared BC; its steps-per-point record plus wall time."""
    from agentevo.recipes import get_recipe
    from agentevo.run import Run

    run = Run.create(method_config(method, bc_dir, overrides, workdir), quiet=True)
    t0 = time.perf_counter()
    try:
        get_recipe(method)(run)
    finally:
        run.close()
    return {**steps_per_point(run.dir), "seconds": time.perf_counter() - t0, "run": str(run.dir)}


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """BC once, then each method; prints one line per method and returns the records."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["qevolve", "grpo", "rsd"], choices=list(BUDGETS))
    ap.add_argument("--set", action="append", default=[], help="override for every method run, e.g. grpo.n_updates=8")
    ap.add_argument("--output-dir", default=None)
    ap.add_argument("--bc-from", default=None, help="a finished BC run folder (default: a short BC warm start)")
    ap.add_argument("--smoke", action="store_true", help="tiny model and budgets: checks the bench runs (seconds)")
    args = ap.parse_args(argv)
    work = Path(args.output_dir or tempfile.mkdtemp(prefix="bench-methods-"))
    print(cpu_line(), flush=True)
    t0 = time.perf_counter()
    bc_dir = Path(args.bc_from) if args.bc_from else bc_run(work, args.smoke)
    print(f"BC warm start: {bc_dir} ({time.perf_counter() - t0:.0f} s)", flush=True)
    out: dict[str, dict[str, Any]] = {}
    for method in args.methods:
        budget = (SMOKE if args.smoke else BUDGETS)[method]
        out[method] = r = run_method(method, bc_dir, budget + args.set, work)
        print(f"{method:8s} ({r['label']}): held-out success BC {r['bc']:5.1f}% -> {r['final']:5.1f}% "
              f"({r['gain']:+.1f} points) after {r['env_steps']:.0f} env steps | "
              f"env steps / +1 point held-out success: {format_per_point(r)} | {r['seconds']:.0f} s", flush=True)
    return out


if __name__ == "__main__":
    main()
