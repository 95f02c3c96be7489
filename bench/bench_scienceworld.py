"""Steps/s of the ScienceWorld adapter's fast path vs the stock env.step, on the same gold action sequences.

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/bench_scienceworld.py [--repeats 3] [--tasks find-animal,...] [--smoke]

One JVM plays every gold replay twice per repeat, once per mode, alternating which mode goes first so that drift
in machine load hits both alike. Only step() calls are timed; resets and gold loading are not.
"""

from __future__ import annotations

import argparse
import statistics
import time

from agentevo.envs.base import Task
from agentevo.envs.scienceworld import ScienceWorldEnv, default_max_steps

DEFAULT_TASKS = "find-animal,chemistry-mix,power-component,use-thermometer,lifespan-longest-lived"


def _task(task_name: str, variation: int) -> Task:
    """A train-split Task for one variation."""
    return Task(
        env="scienceworld",
        task_id=f"scienceworld/train/{task_name}/{variation}",
        split="train",
        task_type=task_name,
        params={"task_name": task_name, "variation": variation, "simplification": "easy"},
        max_steps=default_max_steps(task_name),
    )


def _replay(env: ScienceWorldEnv, task: Task, actions: list[str]) -> tuple[list[float], bool]:
    """Reset, then time every step of the action sequence; returns per-step seconds and whether it succeeded."""
    env.reset(task)
    times: list[float] = []
    success = False
    for action in actions:
        t0 = time.perf_counter()
        _, _, done, info = env.step(action)
        times.append(time.perf_counter() - t0)
        success = bool(info["success"])
        if done:
            break
    return times, success


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark, print medians, throughput and the fast/stock ratio; returns steps/s per mode."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated task names (variation 0 of each)")
    parser.add_argument("--repeats", type=int, default=3, help="gold replays per task and mode")
    parser.add_argument("--jvm-heap-mb", type=int, default=512)
    parser.add_argument("--smoke", action="store_true", help="one task, one repeat (seconds)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tasks, args.repeats = "find-animal", 2  # 2: each mode once first (the quantiles need >= 2 steps)

    env = ScienceWorldEnv(jvm_heap_mb=args.jvm_heap_mb)
    t0 = time.perf_counter()
    env.reset(_task("find-animal", 0))
    print(f"JVM start + first reset: {time.perf_counter() - t0:.2f} s")
    per_mode: dict[str, list[float]] = {"fast": [], "stock": []}
    failures = 0
    try:
        demos: list[tuple[Task, list[str]]] = []
        for name in args.tasks.split(","):
            task = _task(name.strip(), 0)
            gold = env.expert(task)
            if gold is None:
                raise SystemExit(f"no gold path for {task.task_id}")
            demos.append((task, gold))
        print(f"tasks: {', '.join(t.task_type for t, _ in demos)}; gold steps: {[len(g) for _, g in demos]}")
        for rep in range(args.repeats):
            order = ("fast", "stock") if rep % 2 == 0 else ("stock", "fast")
            for task, gold in demos:
                for mode in order:
                    env.fast = mode == "fast"
                    times, ok = _replay(env, task, gold)
                    per_mode[mode].extend(times)
                    failures += 0 if ok else 1
    finally:
        env.close()

    print(f"{'mode':<6} {'steps':>6} {'median ms':>10} {'p90 ms':>8} {'steps/s (1/median)':>19} {'steps/s (total)':>16}")
    rates: dict[str, float] = {}
    for mode, times in per_mode.items():
        median = statistics.median(times)
        p90 = statistics.quantiles(times, n=10)[-1]
        rates[mode] = 1.0 / median
        print(
            f"{mode:<6} {len(times):>6} {1000 * median:>10.2f} {1000 * p90:>8.2f} {1.0 / median:>19.1f} "
            f"{len(times) / sum(times):>16.1f}"
        )
    print(f"speed-up (median step, fast / stock): {rates['fast'] / rates['stock']:.1f}x")
    print(f"gold replays that did not succeed: {failures}")
    return {**rates, "failures": failures}


if __name__ == "__main__":
    main()
