"""Training model-FLOPs utilisation (MFU) of agentevo's trainer at a fixed shape, padded vs padding-free.

The shape is the one the performance issue measured on an H200: a ~110M-parameter Llama (hidden 768, 12 layers,
12 heads, MLP 3072, vocabulary 2,048 like the tiny default's tokenizer), 16 rows per optimiser step, rows up to
1,024 tokens, the loss on every token (BC's token-mean NLL through `train()`). Rows have lengths drawn between
`--min-frac` x and 1 x `--seq` (seeded), so padding-free packing has padding to remove; `--min-frac 1` gives
full-length rows.

Model FLOPs per step, PaLM's count (Chowdhery et al. 2022, appendix B), over real tokens only:
    sum over rows of  l * (6 * N_matmul + 12 * n_layers * d_model * l)
where N_matmul counts every matmul weight the forward multiplies by (attention, MLP and the LM head, also when the
head is tied to the embedding; not the embedding lookup or norms) and l is the row's real length. Padding and
recomputation are not counted, so a trainer that wastes work shows a lower MFU.

Peak: on a CUDA GPU the dense bf16 peak from the datasheet of known parts (H100 / H200 SXM 989 TFLOP/s, H100 PCIe
756, A100 312, L40S 362, L4 121), else pass `--peak-tflops`. On the CPU there is no datasheet number: the peak is
measured here as the best of a few square matmuls in the training's compute dtype on the same threads, so the CPU
MFU reads "of this CPU's measured matmul rate" and is not comparable with a GPU's. Target (GPU): >= 35% of the bf16
peak.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_mfu.py            # the bench shape (CPU: minutes)
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_mfu.py --smoke    # a 2-layer toy shape (seconds)
    python bench/bench_mfu.py --attn flash_attention_2               # GPU with flash-attn: packs into one row
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by a substring of torch.cuda.get_device_name(); first match wins
GPU_BF16_PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H200", 989.4), ("H100", 989.4), ("A100", 312.0), ("L40S", 362.0),
                        ("L4", 121.0)]
TARGET_MFU = 0.35


def gpu_peak_tflops(name: str) -> float | None:
    """Datasheet dense bf16 peak of a known GPU by its torch name, else None."""
    return next((peak for key, peak in GPU_BF16_PEAK_TFLOPS if key in name), None)


def matmul_params(model: Any) -> int:
    """Weights the forward multiplies by: every 2-D parameter but the input embedding, plus the LM head when it is
    the (tied) embedding matrix."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    n = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p is not emb)
    return n + (head.numel() if head is emb else 0)


def model_flops(lengths: list[int], n_matmul: int, n_layers: int, d_model: int) -> float:
    """PaLM's training FLOPs (forward + backward) for rows of these real lengths."""
    return float(sum(n * (6 * n_matmul + 12 * n_layers * d_model * n) for n in lengths))


def row_lengths(n: int, seq: int, min_frac: float, seed: int) -> list[int]:
    """n row lengths, uniform in [min_frac * seq, seq] (seeded)."""
    rng = random.Random(seed)
    lo = max(2, int(round(min_frac * seq)))
    return [rng.randint(lo, seq) for _ in range(n)]


def measured_matmul_tflops(dtype: Any, device: Any, n: int = 2048, reps: int = 5) -> float:
    """Best TFLOP/s of n x n x n matmuls in dtype on device (the CPU's 'peak' for MFU; threads as set)."""
    import torch

    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    (a @ b).sum().item()  # warm up kernels / AMX tiles
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        (a @ b)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def build_model(args: argparse.Namespace, attn: str | None) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=max(2048, args.seq), tie_word_embeddings=True)
    if attn:
        cfg._attn_implementation = attn
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg)


def run_variant(args: argparse.Namespace, padding_free: bool, lengths: list[int], work: Path) -> dict[str, Any]:
    """Train `args.steps` optimiser steps on the rows; steady-state seconds per step (the first step excluded)."""
    import torch

    from agentevo.algorithms.bc import nll_loss
    from agentevo.config import OptimConfig
    from agentevo.data.tensors import StepSample
    from agentevo.models import placement
    from agentevo.train.loop import plan_micro_batches, train

    model = placement.place(build_model(args, args.attn))
    rng = random.Random(args.seed + 1)
    # the "reply" is every token after the first, so the loss covers the row
    samples = [StepSample([rng.randrange(3, args.vocab) for _ in range(n)], [(1, n)], k, [1])
               for k, n in enumerate(lengths)]
    optim = OptimConfig(lr=1e-4, epochs=1, batch_size=args.rows, micro_batch_size=args.micro or args.rows,
                        max_length=args.seq, warmup_ratio=0.0, padding_free=padding_free, save_every=0)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ends: list[float] = []
    losses: list[float] = []

    def on_step(step: int, total: int, record: dict[str, float]) -> None:
        sync()
        ends.append(time.perf_counter())
        losses.append(record["loss"])

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    train(model, samples, nll_loss, optim, 0, work / ("packed" if padding_free else "padded"), args.seed,
          on_step=on_step, schedule="constant")
    if len(ends) != args.steps:
        raise RuntimeError(f"{len(ends)} optimiser steps ran, expected {args.steps}")
    timed = ends[-1] - ends[0] if args.steps > 1 else ends[0] - t0
    accum = optim.batch_size // optim.micro_batch_size
    plan = plan_micro_batches(len(samples), optim, args.seed)  # the rows of each step, in train()'s order
    first = accum if args.steps > 1 else 0
    timed_rows = [lengths[i] for mb in plan[first:] for i in mb]
    flops = model_flops(timed_rows, matmul_params(model), args.layers, args.hidden)
    return {"variant": "padding-free" if padding_free else "padded", "seconds_per_step": timed / max(1, args.steps - 1),
            "tokens_per_s": sum(timed_rows) / timed, "tflops": flops / timed / 1e12, "losses": losses,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--mlp", type=int, default=3072)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=1024, help="longest row (tokens)")
    p.add_argument("--min-frac", type=float, default=0.5, help="shortest row as a fraction of --seq (1: all full)")
    p.add_argument("--rows", type=int, default=16, help="rows per optimiser step")
    p.add_argument("--micro", type=int, default=0, help="rows per micro-batch (0: all rows of the step)")
    p.add_argument("--steps", type=int, default=4, help="optimiser steps; the first is warm-up and not timed")
    p.add_argument("--dtype", default="auto", help="model.dtype: auto (bf16 autocast where the hardware has it) or "
                   "float32")
    p.add_argument("--attn", default="sdpa", help="model.attn_implementation: eager, sdpa, flash_attention_2")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's bf16 peak, when not in the table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a 2-layer toy shape, 2 steps (seconds)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.heads, args.mlp, args.vocab = 64, 2, 2, 128, 256
        args.seq, args.rows, args.steps = 64, 4, 2

    import torch
    from benchlib import cpu_line

    from agentevo.models import placement

    placement.configure(device="auto", dtype=args.dtype, attn_implementation=args.attn)
    device = placement.device()
    compute = placement.autocast_dtype() or placement.dtype()
    if device.type == "cuda":
        name = torch.cuda.get_device_name()
        peak = args.peak_tflops or gpu_peak_tflops(name)
        peak_kind = "datasheet dense bf16" if peak else "unknown (pass --peak-tflops)"
        print(f"GPU: {name} | torch {torch.__version__} | {placement.describe()}")
    else:
        print(cpu_line())
        print(f"{placement.describe()}; {torch.get_num_threads()} torch threads")
        peak = args.peak_tflops or measured_matmul_tflops(compute, device, 256 if args.smoke else 2048)
        peak_kind = "passed" if args.peak_tflops else f"measured {str(compute).replace('torch.', '')} matmul"
    lengths = row_lengths(args.rows * args.steps, args.seq, args.min_frac, args.seed)
    results = []
    with tempfile.TemporaryDirectory() as work:
        for padding_free in (False, True):
            r = run_variant(args, padding_free, lengths, Path(work))
            r["mfu"] = r["tflops"] / peak if peak else None
            results.append(r)
    model = build_model(args, None)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"shape: {n_params / 1e6:.1f}M params ({matmul_params(model) / 1e6:.1f}M in matmuls), {args.rows} rows x "
          f"<= {args.seq} tokens per step ({sum(lengths) / len(lengths):.0f} real on average), attention {args.attn}, "
          f"{args.steps} steps ({args.steps - 1} timed)")
    print(f"peak: {peak:.1f} TFLOP/s ({peak_kind})" if peak else f"peak: {peak_kind}")
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        mem = f", peak memory {r['peak_mib']:.0f} MiB" if r["peak_mib"] is not None else ""
        print(f"  {r['variant']:<13} {r['tokens_per_s']:>10,.0f} real tokens/s  {r['tflops']:7.2f} TFLOP/s  "
              f"MFU {mfu}{mem}")
    padded, packed = results
    ratio = packed["tokens_per_s"] / padded["tokens_per_s"]
    loss_diff = max(abs(a - b) for a, b in zip(padded["losses"], packed["losses"], strict=True))
    print(f"padding-free / padded: {ratio:.2f}x tokens/s; largest per-step loss difference {loss_diff:.2e}")
    best = max(r["mfu"] or 0.0 for r in results)
    if device.type == "cuda" and peak:
        verdict = "holds" if best >= TARGET_MFU else "does not hold"
        print(f"target: MFU >= {100 * TARGET_MFU:.0f}% of the GPU's bf16 peak: {verdict} (best {100 * best:.1f}%)")
    else:
        print(f"target: MFU >= {100 * TARGET_MFU:.0f}% of a GPU's bf16 peak: not measured (no GPU; the CPU figure is "
              "of this CPU's measured matmul rate)")
    out = {"device": str(device), "peak_tflops": peak, "peak_kind": peak_kind, "params": n_params,
           "matmul_params": matmul_params(model), "lengths": lengths, "results": results, "packed_over_padded": ratio,
           "loss_max_abs_diff": loss_diff}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
