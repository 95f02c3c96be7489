"""Rollout throughput: the batched engine (N envs, one batched generation per turn) vs one env at a time.

Same model, same tasks, greedy decoding, measured side by side in one run. Prints environment steps per second
for each and their ratio (median of --repeats runs each).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_rollout.py --model runs/NAME/checkpoints/bc
Without --model it first trains the tiny model by BC on a few demos (about a minute) so the policy acts.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from agentevo.config import load_config
from agentevo.models.backend import Sampling, TransformersPolicy, load_pretrained
from agentevo.rollout.engine import EpisodeRequest, PolicyActor, run_episodes
from agentevo.rollout.workers import make_pool
from agentevo.run import Run


def quick_bc_model(workdir: Path) -> Path:
    """A tiny model BC-trained briefly on CookingWorld demos (valid-looking actions, not a good policy)."""
    from agentevo.algorithms.bc import warm_start

    cfg = load_config(
        "configs/demo_twx_bc.yaml",
        ["env.n_train=40", "env.n_test=4", "optim.epochs=2", "eval.n_tasks=4"],
        name="bench-bc", output_dir=str(workdir),
    )
    run = Run.create(cfg, quiet=True)
    try:
        warm_start(run)
    finally:
        run.close()
    return run.checkpoint_dir("bc")


def measure(policy: TransformersPolicy, env, tasks, n_parallel: int, window: int, max_new: int) -> tuple[float, int]:  # noqa: ANN001
    """Seconds and env steps to play all tasks with n_parallel episodes in flight."""
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
    return elapsed, sum(1 for t in trajs for s in t.steps if s.parsed_action is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: a quick BC model)")
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_path = Path(args.model) if args.model else quick_bc_model(Path(tempfile.mkdtemp()))
    model, tokenizer = load_pretrained(model_path)
    policy = TransformersPolicy(model, tokenizer, "bench", batch_size=args.parallel)
    from agentevo.envs import make_env

    env = make_env("twx-cookingworld", n_test=args.tasks, max_steps=args.max_steps)
    tasks = list(env.tasks("test"))
    rates: dict[int, list[float]] = {1: [], args.parallel: []}
    for r in range(args.repeats):
        for n in (args.parallel, 1):
            seconds, steps = measure(policy, env, tasks, n, 20, 32)
            rates[n].append(steps / seconds)
            print(f"repeat {r}: {n:2d} env(s) in flight: {steps} env steps in {seconds:6.1f} s = {steps / seconds:7.1f} steps/s")
    env.close()
    batched, single = statistics.median(rates[args.parallel]), statistics.median(rates[1])
    print(f"\nmedian steps/s: batched ({args.parallel} envs) {batched:.1f} | one at a time {single:.1f} | "
          f"ratio {batched / single:.2f}x  (target >= 4x)")


if __name__ == "__main__":
    main()
