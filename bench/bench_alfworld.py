"""Reset time and steps/s of the ALFWorld adapter on expert replays, fast path vs stock TextWorld.

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/bench_alfworld.py [--split dev] [--n 12] [--cache-dir DIR]
       [--modes fast,stock] [--data-path DIR] [--smoke]

Games are the first n of the split (generated from the alfworld wheel unless --data-path / ALFWORLD_DATA points at
real data); generation time is reported separately and cached, so a second run measures play only. For each mode
every game is reset twice (cold: load + reset of a game not loaded; warm: reset of the loaded game) and its expert
walkthrough is replayed; only env.reset / env.step calls are timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from agentevo.envs import alfworld as aw


def _fmt(xs: list[float], unit: float = 1.0) -> str:
    """median / mean / max of a list of seconds, in the given unit."""
    if not xs:
        return "n/a"
    return f"median {statistics.median(xs) * unit:.3g}  mean {statistics.mean(xs) * unit:.3g}  max {max(xs) * unit:.3g}"


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark, print reset times, steps/s per mode and per task type, and the fast/stock ratio; returns
    steps/s per mode."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", default="dev", choices=("train", "dev", "test"))
    parser.add_argument("--n", type=int, default=12, help="games (the first n of the split)")
    parser.add_argument("--cache-dir", default=None, help="generated-games cache (default ~/.cache/agentevo/alfworld)")
    parser.add_argument("--data-path", default=None, help="real ALFWorld data (default: ALFWORLD_DATA if it has data)")
    parser.add_argument("--modes", default="fast,stock", help="comma list of fast, stock")
    parser.add_argument("--smoke", action="store_true", help="one game of the dev split (seconds once generated)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.split, args.n = "dev", 1

    limits = {"n_train": None, "n_dev": None, "n_test": None}
    limits[f"n_{args.split}"] = args.n
    common = dict(data_path=args.data_path, cache_dir=args.cache_dir, **limits)
    env = aw.ALFWorldEnv(fast=True, **common)
    tasks = list(env.tasks(args.split))
    print(f"source={env.source} root={env.root} split={args.split} n={len(tasks)} hash={env.tasks(args.split).hash}")

    gen_times = []
    for task in tasks:
        t0 = time.perf_counter()
        missing = not (env.root / task.params["game"]).exists()
        env.gamefile(task)
        if missing:
            gen_times.append(time.perf_counter() - t0)
    experts = {task.task_id: env.expert(task) for task in tasks}
    env.close()
    if gen_times:
        print(f"generation (planner + replay check), {len(gen_times)} games: {_fmt(gen_times)} s")
    else:
        print("generation: all games cached")

    results: dict[str, dict[str, list[float]]] = {}
    for mode in args.modes.split(","):
        fast = mode == "fast"
        aw.uninstall_speedups()  # start every mode with empty caches
        if fast:
            aw.install_speedups()
        env = aw.ALFWorldEnv(fast=fast, **common)
        cold, warm, steps, won = [], [], [], 0
        per_type: dict[str, list[float]] = defaultdict(list)
        for task in tasks:
            t0 = time.perf_counter()
            env.reset(task)
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            env.reset(task)
            warm.append(time.perf_counter() - t0)
            info: dict = {}
            for action in experts[task.task_id]:
                t0 = time.perf_counter()
                _, _, done, info = env.step(action)
                dt = time.perf_counter() - t0
                steps.append(dt)
                per_type[task.task_type].append(dt)
                if done:
                    break
            won += bool(info.get("won"))
        env.close()
        results[mode] = {"steps": steps}
        print(f"\n[{mode}] expert replays won {won}/{len(tasks)}")
        print(f"  reset cold (load+reset): {_fmt(cold)} s")
        print(f"  reset warm (same game):  {_fmt(warm)} s")
        print(f"  step: {_fmt(steps, 1000)} ms  ->  {len(steps) / sum(steps):.1f} steps/s over {len(steps)} steps")
        for task_type, xs in sorted(per_type.items()):
            print(
                f"    {task_type:32s} {len(xs) / sum(xs):7.1f} steps/s  (median {statistics.median(xs) * 1000:.0f} ms)"
            )
    aw.install_speedups()
    if "fast" in results and "stock" in results:
        ratio = (len(results["fast"]["steps"]) / sum(results["fast"]["steps"])) / (
            len(results["stock"]["steps"]) / sum(results["stock"]["steps"])
        )
        print(f"\nfast / stock steps/s: {ratio:.1f}x")
    return {mode: len(r["steps"]) / sum(r["steps"]) for mode, r in results.items()}


if __name__ == "__main__":
    main()
