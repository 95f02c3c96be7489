"""agentevo's BC trainer side by side with TRL's SFTTrainer: same model, rows, batches, optimiser, precision, steps.

The parent builds the data once: a TWX expert collection (agentevo's collect_expert), the tiny model with its tokenizer
trained on those demos (saved as a save_pretrained folder), and the BC rows rendered by agentevo (expert_samples). Each
trainer then runs in a fresh subprocess of the same shape (both import torch, transformers, trl and agentevo; torch
threads pinned), alternating A B / B A over the repeats, and the medians are reported:

* agentevo: agentevo.train.loop.train with agentevo.algorithms.bc.nll_loss (what bc.train_bc -> finetune runs).
* TRL: trl.SFTTrainer on the same rows given pre-tokenized (input_ids + completion_mask, completion_only_loss=True),
  so both train on exactly the reply tokens. Its rows come in agentevo's micro-batch order (sequential sampler), so
  every step sees the same batch and the same padding in both, and the per-step losses can be compared.

Both: AdamW (torch.optim.AdamW; TRL optim=adamw_torch), same lr / betas / weight decay / grad clip, cosine schedule
without warmup (both define it identically), right padding to the longest row of the micro-batch, activation
checkpointing off (or --gradient-checkpointing: on in both; SFTConfig's own default is on), fp32 (or --bf16: bf16
autocast over fp32 weights in both). Tokens/s counts real (non-pad) tokens of the rows processed; "steady" is
steps 2..N (first step and setup excluded), "end to end" from agentevo's rows to the last step (agentevo: train();
TRL: datasets.Dataset, SFTTrainer construction with its dataset preparation, trainer.train()); "CPU" divides by
the process's CPU seconds instead of wall seconds (steady steps), which a loaded machine disturbs far less than wall
time when torch runs one thread. Peak memory: the training's peak RSS (ru_maxrss) above the RSS at its start (CUDA:
max_memory_allocated).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_trl_sft.py                 # 16 tasks, 12 steps of 8 rows, 3 repeats
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_trl_sft.py --bf16          # bf16 autocast (AMX / AVX512-BF16 CPUs)
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_trl_sft.py --smoke         # 2 tasks, 3 steps of 4 rows, 1 repeat
Needs the bench extra: pip install -e '.[bench,twx]'.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TRAINERS = ("agentevo", "trl")


# -- data: built once by the parent ------------------------------------------------------------------------------


def build_data(out: Path, env: str, tasks: int, window: int, max_length: int, seed: int) -> dict[str, Any]:
    """Expert demos -> tiny model + tokenizer (out/model) and agentevo's BC rows (out/rows.json); returns row stats."""
    from agentevo.algorithms import bc
    from agentevo.config import load_config
    from agentevo.models.policy import initial_policy, tokenizer_corpus
    from agentevo.run import Run

    cfg = load_config(None, [f"env.name={env}", f"env.n_train={tasks}", "env.n_test=1", f"seed={seed}",
                             f"agent.history_window={window}", f"optim.max_length={max_length}",
                             f"output_dir={out}", "name=run"], method="bc")
    run = Run.create(cfg, quiet=True)
    try:
        demos = bc.collect_expert(run, cfg.bc.n_expert)
        policy = initial_policy(cfg, tokenizer_corpus(run.signal_env.instruction(), demos))
        samples = bc.expert_samples(policy, demos, window, max_length)
    finally:
        run.close()
    policy.save(out / "model")
    rows = [{"input_ids": s.input_ids, "spans": [list(sp) for sp in s.spans]} for s in samples]
    _write_json(out / "rows.json", rows)
    return {"demos": len(demos), "rows": len(rows), "vocab": len(policy.tokenizer),
            "parameters": sum(p.numel() for p in policy.model.parameters()),
            "row_tokens": sum(len(r["input_ids"]) for r in rows),
            "reply_tokens": sum(s.n_action_tokens for s in samples)}


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def epochs_for(steps: int, batch_size: int, n_rows: int) -> float:
    """optim.epochs that gives exactly `steps` optimiser steps in agentevo's plan (ceil(n * epochs / micro))."""
    return (steps * batch_size - 0.5) / n_rows


def plan(n_rows: int, args: argparse.Namespace) -> list[list[int]]:
    """agentevo's micro-batch plan (row indices) for these settings: what both trainers consume, in order."""
    from agentevo.train.loop import plan_micro_batches

    return plan_micro_batches(n_rows, _optim(args, n_rows), args.seed)


def _optim(args: argparse.Namespace, n_rows: int) -> Any:
    from agentevo.config import OptimConfig

    return OptimConfig(lr=args.lr, epochs=epochs_for(args.steps, args.batch_size, n_rows),
                       batch_size=args.batch_size, micro_batch_size=args.micro_batch_size, warmup_ratio=0.0,
                       weight_decay=args.weight_decay, betas=(0.9, 0.95), grad_clip=1.0, save_every=0,
                       max_length=args.max_length, gradient_checkpointing=args.gradient_checkpointing)


# -- one trainer in a child process ------------------------------------------------------------------------------


def _rss_mib() -> float:
    """Resident memory of this process now (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _maxrss_mib() -> float:
    """Peak resident memory of this process so far (MiB; ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(trainer: str, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Train one trainer on the saved data; its timings, per-step losses and peak memory."""
    import torch
    import transformers
    import trl  # noqa: F401  (imported by both children, so they have the same shape)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentevo.models import placement

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    rows = json.loads((data / "rows.json").read_text())
    order = plan(len(rows), args)
    model = AutoModelForCausalLM.from_pretrained(data / "model", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(data / "model")
    cuda = torch.cuda.is_available()
    if args.bf16:
        placement.configure(dtype="auto")  # model.dtype auto: bf16 autocast over fp32 weights on bf16 hardware
    step_ends: list[tuple[float, float]] = []  # (wall, process CPU) seconds at the end of each optimiser step
    losses: list[float] = []
    with tempfile.TemporaryDirectory() as work:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        rss_start, maxrss_start = _rss_mib(), _maxrss_mib()
        t0, c0 = time.perf_counter(), time.process_time()
        if trainer == "agentevo":
            _train_agentevo(model, tokenizer, rows, args, Path(work), step_ends, losses)
        else:
            _train_trl(model, tokenizer, rows, order, args, Path(work), step_ends, losses)
        t1, c1 = time.perf_counter(), time.process_time()
    accum = args.batch_size // args.micro_batch_size
    real = [sum(len(rows[i]["input_ids"]) for mb in order[s * accum:(s + 1) * accum] for i in mb)
            for s in range(args.steps)]
    padded = [sum(len(mb) * max(len(rows[i]["input_ids"]) for i in mb) for mb in order[s * accum:(s + 1) * accum])
              for s in range(args.steps)]
    if len(step_ends) != args.steps:
        raise RuntimeError(f"{trainer}: {len(step_ends)} optimiser steps ran, expected {args.steps}")
    steady_s, steady_cpu = step_ends[-1][0] - step_ends[0][0], step_ends[-1][1] - step_ends[0][1]
    steady = args.steps > 1 and steady_s > 0 and steady_cpu > 0
    return {
        "trainer": trainer,
        "tokens": sum(real), "padded_tokens": sum(padded),
        "seconds": t1 - t0,
        "tok_s": sum(real) / (t1 - t0),
        "steady_tok_s": sum(real[1:]) / steady_s if steady else float("nan"),
        "cpu_tok_s": sum(real[1:]) / steady_cpu if steady else float("nan"),
        "cpu_seconds": c1 - c0,
        "first_step_s": step_ends[0][0] - t0,
        # the training's peak above its start: the process peak is the training's when it exceeds the earlier one
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else _maxrss_mib() - rss_start,
        "peak_before_mib": maxrss_start - rss_start,
        "losses": losses,
        "threads": torch.get_num_threads(),
    }


def _train_agentevo(model: Any, tokenizer: Any, rows: list[dict[str, Any]], args: argparse.Namespace, work: Path,
                    step_ends: list[tuple[float, float]], losses: list[float]) -> None:
    from agentevo.algorithms.bc import nll_loss
    from agentevo.data.tensors import StepSample
    from agentevo.train.loop import train

    samples = [StepSample(r["input_ids"], [tuple(sp) for sp in r["spans"]], k, list(range(1, len(r["spans"]) + 1)))
               for k, r in enumerate(rows)]

    def on_step(step: int, total: int, record: dict[str, float]) -> None:
        step_ends.append((time.perf_counter(), time.process_time()))
        losses.append(record["loss"])

    train(model, samples, nll_loss, _optim(args, len(rows)), tokenizer.pad_token_id, work / "agentevo", args.seed,
          on_step=on_step)


def _train_trl(model: Any, tokenizer: Any, rows: list[dict[str, Any]], order: list[list[int]],
               args: argparse.Namespace, work: Path, step_ends: list[tuple[float, float]], losses: list[float]) -> None:
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    flat = [i for mb in order for i in mb]

    def completion_mask(r: dict[str, Any]) -> list[int]:
        mask = [0] * len(r["input_ids"])
        for start, end in r["spans"]:
            mask[start:end] = [1] * (end - start)
        return mask

    # Pre-tokenized rows in agentevo's order: SFTTrainer skips tokenization and builds labels from completion_mask.
    dataset = datasets.Dataset.from_dict({"input_ids": [rows[i]["input_ids"] for i in flat],
                                          "completion_mask": [completion_mask(rows[i]) for i in flat]})

    class Timer(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            step_ends.append((time.perf_counter(), time.process_time()))

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict[str, float] | None = None,
                   **k: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    config = SFTConfig(
        output_dir=str(work / "trl"), max_steps=args.steps, per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.batch_size // args.micro_batch_size, learning_rate=args.lr,
        lr_scheduler_type="cosine", warmup_steps=0, weight_decay=args.weight_decay, adam_beta1=0.9, adam_beta2=0.95,
        # gradient_checkpointing set explicitly: SFTConfig's default is True, agentevo's (optim.gradient_checkpointing)
        # False; left at the defaults TRL recomputes every layer's forward in the backward (~30% more compute here)
        gradient_checkpointing=args.gradient_checkpointing,
        max_grad_norm=1.0, optim=args.trl_optim, bf16=args.bf16, fp16=False, use_cpu=not torch.cuda.is_available(),
        completion_only_loss=True, packing=False, padding_free=args.trl_padding_free,
        # agentevo's rows are already cut to max_length; TRL refuses max_length with padding_free and no packing
        max_length=None if args.trl_padding_free else args.max_length,
        train_sampling_strategy="sequential", shuffle_dataset=False, seed=args.seed, data_seed=args.seed,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[Timer()])
    trainer.train()


# -- the parent: interleaved repeats, medians ---------------------------------------------------------------------


def run_child(trainer: str, data: Path, argv: list[str], threads: int) -> dict[str, Any]:
    """One trainer in a fresh interpreter with pinned thread counts; its result dict."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, __file__, *argv, "--child", trainer, "--data", str(data)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{trainer} child failed (exit {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _med(results: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in results)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Build the data, run both trainers interleaved, print the ratio table; returns the summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="twx-cookingworld")
    ap.add_argument("--tasks", type=int, default=16, help="training tasks with one expert demo each")
    ap.add_argument("--window", type=int, default=3, help="agent.history_window (>= episode length packs a demo "
                                                          "into one row)")
    ap.add_argument("--steps", type=int, default=12, help="optimiser steps")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=None, help="default: the batch size (no accumulation)")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in both trainers")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of each trainer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast over fp32 weights in both")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="activation checkpointing in both (default: off in both; TRL's own default is on)")
    ap.add_argument("--trl-optim", default="adamw_torch", help="TRL's optim (adamw_torch = agentevo's torch AdamW; "
                                                               "transformers' default is adamw_torch_fused)")
    ap.add_argument("--trl-padding-free", action="store_true", help="TRL padding_free=True (rows concatenated)")
    ap.add_argument("--smoke", action="store_true", help="2 tasks, 3 steps of 4 rows, 1 repeat")
    ap.add_argument("--out", default=None, help="also write the summary as JSON here")
    ap.add_argument("--child", choices=TRAINERS, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.tasks, args.steps, args.batch_size, args.repeats = 2, 3, 4, 1
    args.micro_batch_size = args.micro_batch_size or args.batch_size
    if args.batch_size % args.micro_batch_size:
        ap.error("--batch-size must be a multiple of --micro-batch-size")
    if args.child:
        print(json.dumps(child(args.child, Path(args.data), args)))
        return {}

    # what the children re-parse: the resolved settings, never --smoke / --out
    child_argv = ["--steps", str(args.steps), "--batch-size", str(args.batch_size),
                  "--micro-batch-size", str(args.micro_batch_size), "--max-length", str(args.max_length),
                  "--lr", str(args.lr), "--weight-decay", str(args.weight_decay), "--threads", str(args.threads),
                  "--seed", str(args.seed), "--trl-optim", args.trl_optim,
                  *(["--bf16"] if args.bf16 else []), *(["--trl-padding-free"] if args.trl_padding_free else []),
                  *(["--gradient-checkpointing"] if args.gradient_checkpointing else [])]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        data = Path(tmp)
        t0 = time.perf_counter()
        info = build_data(data, args.env, args.tasks, args.window, args.max_length, args.seed)
        build_s = time.perf_counter() - t0
        results: dict[str, list[dict[str, Any]]] = {t: [] for t in TRAINERS}
        for r in range(args.repeats):
            for trainer in (TRAINERS if r % 2 == 0 else TRAINERS[::-1]):  # A B, B A, ...: drift hits both alike
                results[trainer].append(run_child(trainer, data, child_argv, args.threads))
    load_after = os.getloadavg()

    a, t = results["agentevo"], results["trl"]
    pairs = {key: [x[key] / y[key] for x, y in zip(a, t, strict=True)] for key in ("steady_tok_s", "cpu_tok_s")}
    loss_a, loss_t = a[0]["losses"], t[0]["losses"]
    diffs = [abs(x - y) for x, y in zip(loss_a, loss_t, strict=False)]
    summary = {
        "data": info, "build_s": build_s, "steps": args.steps, "batch_size": args.batch_size,
        "micro_batch_size": args.micro_batch_size, "precision": "bf16 autocast" if args.bf16 else "fp32",
        "threads": args.threads, "repeats": args.repeats, "trl_optim": args.trl_optim,
        "trl_padding_free": args.trl_padding_free, "gradient_checkpointing": args.gradient_checkpointing,
        "tokens": a[0]["tokens"], "padded_tokens": a[0]["padded_tokens"],
        **{name: {k: _med(rs, k) for k in ("steady_tok_s", "cpu_tok_s", "tok_s", "first_step_s", "peak_mib")}
           for name, rs in results.items()},
        "ratio_steady": _med(a, "steady_tok_s") / _med(t, "steady_tok_s"),
        "ratio_cpu": _med(a, "cpu_tok_s") / _med(t, "cpu_tok_s"),
        "ratio_end_to_end": _med(a, "tok_s") / _med(t, "tok_s"),
        "ratio_pairs": pairs,
        "loss_step1": [loss_a[0], loss_t[0]] if loss_a and loss_t else None,
        "loss_max_abs_diff": max(diffs) if diffs else None,
        "loadavg": [load_before[0], load_after[0]],
    }
    print(f"BC/SFT on {info['rows']} agentevo BC rows of {info['demos']} {args.env} expert demos "
          f"({info['row_tokens']} tokens, {info['reply_tokens']} reply tokens), tiny Llama "
          f"{info['parameters'] / 1e6:.2f}M params, vocab {info['vocab']}; data built in {build_s:.1f} s")
    print(f"{args.steps} steps x batch {args.batch_size} (micro {args.micro_batch_size}), max_length {args.max_length}, "
          f"AdamW lr {args.lr}, {summary['precision']}, gradient checkpointing "
          f"{'on' if args.gradient_checkpointing else 'off'} in both, torch threads {args.threads}, {args.repeats} interleaved "
          f"repeats (medians); {summary['tokens']} real tokens per run, {summary['padded_tokens']} with padding "
          f"({100 * (1 - summary['tokens'] / summary['padded_tokens']):.1f}% pad)")
    print(f"{'':10s} {'steady tok/s':>13s} {'CPU tok/s':>10s} {'end-to-end tok/s':>17s} {'first step s':>13s} "
          f"{'peak MiB':>9s}")
    for name in TRAINERS:
        m = summary[name]
        print(f"{name:10s} {m['steady_tok_s']:13.0f} {m['cpu_tok_s']:10.0f} {m['tok_s']:17.0f} "
              f"{m['first_step_s']:13.2f} {m['peak_mib']:9.0f}")
    print(f"ratio agentevo / TRL: steady {summary['ratio_steady']:.3f} (per pair "
          f"{', '.join(f'{p:.3f}' for p in pairs['steady_tok_s'])}), CPU {summary['ratio_cpu']:.3f} (per pair "
          f"{', '.join(f'{p:.3f}' for p in pairs['cpu_tok_s'])}), end to end {summary['ratio_end_to_end']:.3f}")
    if summary["loss_step1"]:
        print(f"same tokens check: step-1 loss agentevo {loss_a[0]:.6f} vs TRL {loss_t[0]:.6f}; "
              f"max |diff| over {len(diffs)} steps {summary['loss_max_abs_diff']:.2e}")
    print(f"load average (1 min) {load_before[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} CPUs")
    if args.out:
        _write_json(Path(args.out), summary)
    return summary


if __name__ == "__main__":
    main()
