"""Steps per second of the fast text environments (TextWorldExpress, local WebShop, SearchQA), replaying their experts.

Usage: python bench/bench_text_envs.py [--splits train dev test] [--repeats 3] [--smoke]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from agentevo.envs.searchqa import SearchQAEnv
from agentevo.envs.textworld_express import CookingWorldEnv, TWCEnv
from agentevo.envs.webshop import WebShopEnv


def replay(env: Any, splits: list[str], repeats: int) -> dict[str, float]:
    """Replay the expert on every task of the splits `repeats` times; time reset+step only (not expert planning)."""
    plans = [(task, env.expert(task)) for split in splits for task in env.tasks(split)]
    steps = episodes = 0
    reward = 0.0
    elapsed = 0.0
    for _ in range(repeats):
        for task, actions in plans:
            t0 = time.perf_counter()
            env.reset(task)
            for action in actions:
                _, _, _, info = env.step(action)
            elapsed += time.perf_counter() - t0
            steps += len(actions)
            episodes += 1
            reward += info["score"]
    return {"episodes": episodes, "steps": steps, "seconds": elapsed, "steps_per_s": steps / elapsed,
            "episodes_per_s": episodes / elapsed, "mean_reward": reward / episodes}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the benchmark, print one line per environment and return the results."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--splits", nargs="+", default=["train", "dev", "test"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="2 tasks per split, the test split, 1 repeat (seconds)")
    args = ap.parse_args(argv)
    n = 2 if args.smoke else 50
    if args.smoke:
        args.splits, args.repeats = ["test"], 1
    envs = (
        ("twx-cookingworld", lambda: CookingWorldEnv(n_train=n, n_dev=n, n_test=n)),
        ("twx-twc", lambda: TWCEnv(n_train=n, n_dev=n, n_test=n)),
        ("webshop(local)", lambda: WebShopEnv(backend="local")),
        ("searchqa", SearchQAEnv),
    )
    out: dict[str, dict[str, float]] = {}
    for name, make in envs:
        t0 = time.perf_counter()
        env = make()
        build = time.perf_counter() - t0
        res = replay(env, args.splits, args.repeats)
        print(
            f"{name:15s} build {build * 1000:7.1f} ms | {res['episodes']:5d} episodes {res['steps']:6d} steps "
            f"in {res['seconds']:6.2f} s | {res['steps_per_s']:9.0f} steps/s {res['episodes_per_s']:8.0f} episodes/s "
            f"| expert mean final score {res['mean_reward']:.3f}"
        )
        env.close()
        out[name] = res
    return out


if __name__ == "__main__":
    main()
