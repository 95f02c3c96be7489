"""Rollout throughput: the batched engine (N envs, one batched generation per turn) vs one env at a time.

Same model, same tasks, greedy decoding, measured side by side in one run, with the cross-turn prefix KV cache of
the transformers backend on and off. Prints environment steps per second for each and their ratios (median of
--repeats runs each; every measurement starts with an empty cache).

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


def main() -> None:
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_path = Path(args.model) if args.model else quick_bc_model(Path(tempfile.mkdtemp()))
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
    print(f"\nmedian episode steps/s ({args.tasks} tasks, window {args.window}, {torch.get_num_threads()} torch thread(s)):")
    for kind in ("cache", "no cache"):
        b, s1 = med[(kind, args.parallel)], med[(kind, 1)]
        print(f"  {kind:>8}: batched ({args.parallel} envs) {b:6.1f} | one at a time {s1:6.1f} | ratio {b / s1:.2f}x")
    print(f"  batched with cache vs one at a time without (the engine before prefix caching): "
          f"{med[('cache', args.parallel)] / med[('no cache', 1)]:.2f}x   (target >= 4x batched vs one at a time)")


if __name__ == "__main__":
    main()
