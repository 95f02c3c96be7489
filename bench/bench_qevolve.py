"""Cost of one Q-Evolve round split by phase (collection, labels, critic, advantages, policy update, evaluation).

Starts from a short BC warm start on the tiny default (benchlib.bc_run, or --bc-from a finished BC run folder), so
the policy acts, runs one evolving round in a fresh run folder and prints the wall time of every phase, each round
phase's share of the round, and env steps per point of held-out gain.

Usage: OMP_NUM_THREADS=1 python bench/bench_qevolve.py [--bc-from runs/BC] [--set KEY=VALUE ...] [--smoke]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_methods import SMOKE, method_config  # noqa: E402
from benchlib import bc_run, cpu_line, format_per_point, steps_per_point  # noqa: E402

# Small enough for 2 shared CPU cores; every value can be overridden with --set.
DEFAULTS = ["qevolve.n_iters=1", "qevolve.n_self_per_task=2", "qevolve.critic_epochs=1"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run one round from BC with timed phases, print the table and return the phase times."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bc-from", default=None, help="a finished BC run folder (default: a short BC warm start)")
    ap.add_argument("--set", action="append", default=[], help="dotted override, e.g. qevolve.n_self_per_task=4")
    ap.add_argument("--output-dir", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model and budgets: checks the bench runs (seconds)")
    args = ap.parse_args(argv)

    from agentevo.algorithms.qevolve import recipe as qevolve
    from agentevo.run import Run

    out = Path(args.output_dir or tempfile.mkdtemp(prefix="bench-qevolve-"))
    print(cpu_line(), flush=True)
    bc_dir = Path(args.bc_from) if args.bc_from else bc_run(out, args.smoke)
    cfg = method_config("qevolve", bc_dir, (SMOKE["qevolve"] if args.smoke else DEFAULTS) + args.set, out)
    run = Run.create(cfg, quiet=True)
    times: dict[str, float] = {}
    phase = run.phase

    def timed(name: str, fn: Any, **kwargs: Any) -> Any:
        # Run.phase takes keyword options (all_ranks=True for the policy update): pass them on
        t0 = time.perf_counter()
        result = phase(name, fn, **kwargs)
        times[name] = time.perf_counter() - t0
        return result

    run.phase = timed  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        results = qevolve.run(run)
    finally:
        run.close()
    total = time.perf_counter() - t0

    labels = results["round-1/label"]
    critic = results["round-1/critic"]
    print(f"run folder: {run.dir}")
    print(f"torch threads: {run.threads}; D = {labels['n_expert']} expert + {labels['n_self']} self trajectories, "
          f"{labels['n_steps']} steps; critic fitted on {critic['n_fit']} trajectories")
    print(f"{'phase':<22}{'seconds':>10}{'share of round':>16}")
    round_phases = [k for k in times if k.startswith("round-1/") or k == "eval/round-1"]
    round_total = sum(times[k] for k in round_phases)
    for name, sec in times.items():
        share = f"{100 * sec / round_total:.1f}%" if name in round_phases else ""
        print(f"{name:<22}{sec:>10.1f}{share:>16}")
    print(f"{'round 1 total':<22}{round_total:>10.1f}")
    print(f"{'everything':<22}{total:>10.1f}")
    collect = results["round-1/collect"]
    print(f"collection: {collect['n']} episodes, {collect['env_steps']} env steps, "
          f"{collect['env_steps'] / max(times['round-1/collect'], 1e-9):.1f} env steps/s")
    for split, m in results["eval/round-1"].items():
        print(f"eval {split}: BC {100 * results['eval/bc'][split]['success_rate']:.1f}% -> "
              f"round 1 {100 * m['success_rate']:.1f}% ({m['n']} tasks)")
    gain = steps_per_point(run.dir)
    print(f"env steps / +1 point held-out success: {format_per_point(gain)} "
          f"({gain['env_steps']:.0f} env steps, {gain['gain']:+.1f} points)")
    return times


if __name__ == "__main__":
    main()
