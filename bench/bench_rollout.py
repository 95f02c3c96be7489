"""Rollout throughput: the batched engine (N envs, one batched generation per turn) vs one env at a time.

Same model, same tasks, greedy decoding, measured side by side in one run, with the cross-turn prefix KV cache of
the transformers backend on and off. Prints environment steps per second for each and only like-for-like ratios
(median of --repeats runs each; every measurement starts with an empty cache):
  batching: batched vs one at a time with the same cache setting (both on; both off), target >= 3x at 16 envs;
  cache: cache vs no cache at the same batching (batched; one at a time).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_rollout.py --model runs/NAME/checkpoints/bc
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_rollout.py --smoke      # seconds: checks it runs
Without --model it first trains the tiny model by BC on a few demos (about a minute) so the policy acts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import cpu_line, quick_bc_model  # noqa: E402

from agentevo.models.backend import Sampling, TransformersPolicy, load_pretrained  # noqa: E402
from agentevo.rollout.engine import EpisodeRequest, PolicyActor, run_episodes  # noqa: E402
from agentevo.rollout.workers import make_pool  # noqa: E402

BATCHING_TARGET = 3.0  # batched / one at a time, same cache setting, at 16 envs in flight


def measure(policy: TransformersPolicy, env, tasks, n_parallel: int, window: int, max_new: int) -> tuple[float, int]:  # noqa: ANN001
    """Seconds and episode steps to play all tasks with n_parallel episodes in flight."""
    actor = PolicyActor(policy, env.instruction(), window, Sampling(temperature=0.0, max_new_tokens=max_new))
    pool = make_pool(env.name, {"n_test": len(tasks)}, n_parallel, "thread")
    try:
        # start the JVMs before timing: a worker pool is built once per run, not per episode
        pool.map([(i, "reset", (tasks[0],)) for i in range(n_parallel)])
        start = time.perf_counter()
        trajs = run_episodes(actor, pool, [EpisodeRequest(t, k) for k, t in enumerate(tasks)], env)
        elapsed = time.perf_counter() - start
    finally:
        pool.close()
    # every turn is an episode step: a reply without a parsable action gets the format-error observation
    return elapsed, sum(t.length for t in trajs)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure the four modes, print rates and like-for-like ratios; returns the median rates and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder, or a folder with a GGUF file (default: a quick BC model)")
    parser.add_argument("--gguf-file", help="GGUF file name inside --model (e.g. SmolLM2-135M-Instruct.Q4_1.gguf)")
    parser.add_argument("--max-new", type=int, default=32, help="max new tokens per reply")
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=20, help="history window of the prompts")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the same for every mode)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 tasks, 1 repeat: checks the bench runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tasks, args.parallel, args.repeats, args.max_steps, args.max_new = 2, 2, 1, 2, 4
    torch.set_num_threads(args.threads)
    print(cpu_line(), flush=True)
    model_path = Path(args.model) if args.model else quick_bc_model(Path(tempfile.mkdtemp()), args.smoke)
    model, tokenizer = load_pretrained(model_path, args.gguf_file)
    cached = TransformersPolicy(model, tokenizer, "bench", batch_size=args.parallel, prefix_cache=2 * args.parallel)
    plain = TransformersPolicy(model, tokenizer, "bench", batch_size=args.parallel, prefix_cache=0)
    from agentevo.envs import make_env

    env = make_env("twx-cookingworld", n_test=args.tasks, max_steps=args.max_steps)
    tasks = list(env.tasks("test"))
    modes = [("cache", args.parallel), ("cache", 1), ("no cache", args.parallel), ("no cache", 1)]
    rates: dict[tuple[str, int], list[float]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode in modes:
            policy = cached if mode[0] == "cache" else plain
            if policy.kv_cache is not None:
                policy.kv_cache.clear()  # every measurement starts cold
            seconds, steps = measure(policy, env, tasks, mode[1], args.window, args.max_new)
            rates[mode].append(steps / seconds)
            print(f"repeat {r}: {mode[0]:>8}, {mode[1]:2d} env(s) in flight: {steps} steps in {seconds:6.1f} s "
                  f"= {steps / seconds:7.1f} steps/s", flush=True)
    env.close()
    med = {m: statistics.median(v) for m, v in rates.items()}
    n = args.parallel
    print(f"\nmedian episode steps/s ({args.tasks} tasks, window {args.window}, {torch.get_num_threads()} torch thread(s)):")
    for kind in ("cache", "no cache"):
        print(f"  {kind:>8}: batched ({n} envs) {med[(kind, n)]:6.1f} | one at a time {med[(kind, 1)]:6.1f}")
    ratios = {"batching (cache on)": med[("cache", n)] / med[("cache", 1)],
              "batching (cache off)": med[("no cache", n)] / med[("no cache", 1)],
              f"cache ({n} envs)": med[("cache", n)] / med[("no cache", n)],
              "cache (one at a time)": med[("cache", 1)] / med[("no cache", 1)]}
    print("like-for-like ratios:")
    for name, value in ratios.items():
        print(f"  {name:<22} {value:5.2f}x")
    holds = all(ratios[k] >= BATCHING_TARGET for k in ("batching (cache on)", "batching (cache off)"))
    at = "" if n == 16 else f" (measured at {n} envs, not 16)"
    print(f"target: batching >= {BATCHING_TARGET:.0f}x at 16 envs with the same cache setting: "
          f"{'holds' if holds else 'does not hold'}{at}")
    return {"rates": {f"{k} x{p}": v for (k, p), v in med.items()}, "ratios": ratios, "target_holds": holds}


if __name__ == "__main__":
    main()
