"""Padded vs padding-free training (`optim.padding_free`) on the same BC rows: tokens computed, tokens/s, same losses.

Builds TWX CookingWorld expert demos and the tiny default model once (bench_trl_sft.build_data), then trains the same
rows with agentevo's train() twice per repeat, padded and padding-free, interleaved (A B, B A, ...) from the same
initial weights, and prints per setting: rows, real tokens, tokens the forward computes (padded: rows x longest row of
each micro-batch; packed: packed rows x the same width), real tokens per CPU-second for each, their ratio, and the
largest per-step loss difference (packing must not change the loss). Two row shapes by default: one row per step
(`--window 2`: rows of many lengths, where padding is large) and one row per demo (`--window 15`, the demo's shape).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_packing.py            # 24 tasks, 10 steps of 16 rows, 3 repeats
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_packing.py --bf16     # bf16 autocast (AMX / AVX512-BF16 CPUs)
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_packing.py --smoke    # 2 tasks, 2 steps of 4 rows, 1 repeat
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def computed_tokens(lengths: list[int], plan: list[list[int]], packed: bool) -> int:
    """Token positions the forward runs over: padded rows x width, or packed rows x width, per micro-batch."""
    from agentevo.data.tensors import pack_bins

    total = 0
    for mb in plan:
        ls = [lengths[i] for i in mb]
        width = max(ls)
        total += width * (len(pack_bins(ls, width)) if packed else len(ls))
    return total


def train_once(model: Any, samples: list[Any], cfg: Any, pad_id: int, seed: int) -> tuple[float, list[float]]:
    """CPU seconds of the optimiser steps after the first (setup and warm-up excluded), and every step's loss."""
    from agentevo.algorithms.bc import nll_loss
    from agentevo.train.loop import train

    marks: list[float] = []
    losses: list[float] = []

    def on_step(step: int, total: int, record: dict[str, float]) -> None:
        marks.append(time.process_time())
        losses.append(record["loss"])

    with tempfile.TemporaryDirectory() as work:
        train(model, samples, nll_loss, cfg, pad_id, work, seed, on_step=on_step)
    return marks[-1] - marks[0], losses


def measure(data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Both layouts on the rows in `data`, interleaved over the repeats."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentevo.config import OptimConfig
    from agentevo.data.tensors import StepSample
    from agentevo.models import placement
    from agentevo.train.loop import plan_micro_batches

    torch.set_num_threads(args.threads)
    if args.bf16:
        placement.configure(dtype="auto")
    rows = json.loads((data / "rows.json").read_text())
    samples = [StepSample(input_ids=r["input_ids"], spans=[tuple(s) for s in r["spans"]], traj_index=k,
                          steps=list(range(1, len(r["spans"]) + 1))) for k, r in enumerate(rows)]
    base = AutoModelForCausalLM.from_pretrained(data / "model", dtype=torch.float32)
    pad_id = base.config.pad_token_id if base.config.pad_token_id is not None else 0
    epochs = (args.steps * args.batch_size - 0.5) / len(samples)
    cfgs = {free: OptimConfig(lr=1e-3, epochs=epochs, batch_size=args.batch_size, micro_batch_size=args.batch_size,
                              warmup_ratio=0.0, save_every=0, max_length=args.max_length, padding_free=free)
            for free in (False, True)}
    plan = plan_micro_batches(len(samples), cfgs[False], args.seed)
    lengths = [len(s.input_ids) for s in samples]
    real = sum(lengths[i] for mb in plan for i in mb)
    steady_real = sum(lengths[i] for mb in plan[1:] for i in mb)
    cpu: dict[bool, list[float]] = {False: [], True: []}
    losses: dict[bool, list[float]] = {}
    for r in range(args.repeats):
        for free in ((False, True) if r % 2 == 0 else (True, False)):
            seconds, curve = train_once(copy.deepcopy(base), samples, cfgs[free], pad_id, args.seed)
            cpu[free].append(seconds)
            losses.setdefault(free, curve)
    rate = {free: steady_real / statistics.median(s) if statistics.median(s) > 0 else float("nan")
            for free, s in cpu.items()}
    return {
        "window": args.window, "rows": len(samples), "steps": len(plan), "real_tokens": real,
        "padded_tokens": computed_tokens(lengths, plan, False), "packed_tokens": computed_tokens(lengths, plan, True),
        "padded_cpu_tok_s": rate[False], "packed_cpu_tok_s": rate[True], "ratio": rate[True] / rate[False],
        "loss_max_abs_diff": max(abs(a - b) for a, b in zip(losses[False], losses[True], strict=True)),
        "loss_step1": losses[False][0],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Build the data per window, measure both layouts, print the table; returns the summary."""
    from bench_trl_sft import build_data

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=24, help="training tasks with one expert demo each")
    ap.add_argument("--windows", type=int, nargs="+", default=[2, 15],
                    help="agent.history_window values (2: a row per step; 15: a row per demo)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast over fp32 weights")
    ap.add_argument("--smoke", action="store_true", help="2 tasks, 2 steps of 4 rows, 1 repeat")
    ap.add_argument("--out", default=None, help="also write the summary as JSON here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tasks, args.steps, args.batch_size, args.repeats = 2, 2, 4, 1
    results = []
    for window in args.windows:
        args.window = window
        with tempfile.TemporaryDirectory(prefix="bench-pack-") as tmp:
            build_data(Path(tmp), "twx-cookingworld", args.tasks, window, args.max_length, args.seed)
            results.append(measure(Path(tmp), args))
    print(f"padded vs padding-free BC, tiny default model, {args.threads} thread(s), "
          f"{'bf16 autocast' if args.bf16 else 'fp32'}, {args.repeats} repeat(s), median CPU time of steps 2..N")
    print(f"{'window':>6} {'rows':>5} {'real tok':>9} {'padded':>9} {'packed':>9} {'pad tok/s':>10} "
          f"{'packed tok/s':>12} {'ratio':>6} {'max |dloss|':>11}")
    for r in results:
        print(f"{r['window']:>6} {r['rows']:>5} {r['real_tokens']:>9} {r['padded_tokens']:>9} {r['packed_tokens']:>9} "
              f"{r['padded_cpu_tok_s']:>10.0f} {r['packed_cpu_tok_s']:>12.0f} {r['ratio']:>6.2f} "
              f"{r['loss_max_abs_diff']:>11.2e}")
    summary = {"results": results, "threads": args.threads, "bf16": args.bf16, "repeats": args.repeats}
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
