"""Cost of one Q-Evolve round split by phase (collection, labels, critic, advantages, policy update, evaluation).

Runs the BC warm start and one evolving round in a fresh run folder and prints the wall time of every phase, and
each round phase's share of the round, all measured in this one run.

Usage: OMP_NUM_THREADS=1 python bench/bench_qevolve.py [--config configs/qevolve_twx.yaml] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

# Small enough for 2 shared CPU cores; every value can be overridden with --set.
DEFAULTS = [
    "env.n_train=16", "env.n_test=8",
    "model.tiny={hidden_size: 128, num_layers: 2, num_heads: 4, intermediate_size: 384, vocab_size: 1024}",
    "bc.n_expert=16", "qevolve.n_iters=1", "qevolve.n_self_per_task=2", "qevolve.critic_epochs=1",
]


def main() -> None:
    """Run BC + one round with timed phases and print the table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="configs/qevolve_twx.yaml")
    ap.add_argument("--set", action="append", default=[], help="dotted override, e.g. qevolve.n_self_per_task=4")
    ap.add_argument("--output-dir", default=None)
    args = ap.parse_args()

    from agentevo.algorithms import qevolve
    from agentevo.config import load_config
    from agentevo.run import Run

    out = args.output_dir or tempfile.mkdtemp(prefix="bench-qevolve-")
    cfg = load_config(args.config, DEFAULTS + args.set, name="bench", output_dir=out)
    run = Run.create(cfg, quiet=True)
    times: dict[str, float] = {}
    phase = run.phase

    def timed(name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        result = phase(name, fn)
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


if __name__ == "__main__":
    main()
