"""RSD distillation cost: the teacher's top-20 cached once vs full-vocabulary distillation, measured in one run.

Three ways to train a student towards a teacher that reads a longer (privileged-context) prompt:
  topk-cache   teacher pass once (no grad) -> top-k ids + log-probs per reply token -> training reads the cache
               (what agentevo.algorithms.rsd.recipe does)
  full-cache   teacher pass once -> the full-vocabulary log-probs per reply token are kept for training
  full-live    the teacher runs next to the student at every training step (no cache), full-vocabulary KL
Each variant runs in a fresh subprocess on the same synthetic rows (random token ids, a share of reply tokens),
so the peak resident memory (CPU) or peak allocated memory (CUDA) of one does not leak into the next.
Printed: cache size, peak memory over the process baseline, teacher time, training time, and the final KL; first, the
bytes per reply token of the compact top-k cache (float16 log-probs, int16/int32 ids, as agentevo.algorithms.rsd.recipe saves
it) vs the previous float32 + int32 cache and the full float32 vocabulary row, at 2K and 150K vocabularies.

Usage: python bench/bench_rsd.py [--vocab 2048 32000] [--rows 16] [--length 384] [--context 128] [--k 20] [--smoke]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time
from typing import Any


def _peak_mb() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _variant(args: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentevo.algorithms import losses
    from agentevo.algorithms.rsd.recipe import id_dtype

    torch.set_num_threads(args["threads"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = LlamaConfig(vocab_size=args["vocab"], hidden_size=args["hidden"], intermediate_size=3 * args["hidden"],
                      num_hidden_layers=args["layers"], num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=args["length"] + args["context"] + 8, tie_word_embeddings=True)
    torch.manual_seed(0)
    student = LlamaForCausalLM(cfg).to(device)
    # Same architecture and size; a different init so the KL values are not ~0 (the cost does not depend on it).
    torch.manual_seed(1)
    teacher = LlamaForCausalLM(cfg).to(device).eval()
    g = torch.Generator().manual_seed(1)
    n, length, ctx = args["rows"], args["length"], args["context"]
    plain = torch.randint(0, args["vocab"], (n, length), generator=g)
    context = torch.randint(0, args["vocab"], (n, ctx), generator=g)
    with_ctx = torch.cat([context, plain], dim=1)
    n_reply = int(args["reply_frac"] * length)
    reply = torch.zeros((n, length), dtype=torch.bool)
    reply[:, length - n_reply :] = True  # the last share of each row plays the role of reply tokens
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base_mb = _peak_mb()
    mb = args["micro_batch"]
    k = args["k"]
    mode = args["mode"]

    def teacher_logits(rows: slice) -> torch.Tensor:
        """Teacher logits predicting the reply tokens of these rows: [b, n_reply, V]."""
        z = teacher(input_ids=with_ctx[rows].to(device)).logits
        return z[:, ctx + length - n_reply - 1 : ctx + length - 1]

    # 1. the teacher pass (once) for the cached variants
    t0 = time.perf_counter()
    cache: list[Any] = []
    cache_bytes = 0
    if mode != "full-live":
        with torch.no_grad():
            for s in range(0, n, mb):
                z = teacher_logits(slice(s, s + mb)).float()
                if mode == "topk-cache":
                    ids, lp = losses.teacher_topk(z, k)
                    entry = (ids.to(id_dtype(args["vocab"])).cpu(), lp.to(torch.float16).cpu())  # as rsd saves it
                else:
                    entry = (torch.log_softmax(z, -1).cpu(),)
                cache.append(entry)
                cache_bytes += sum(t.numel() * t.element_size() for t in entry)
                del z
    teacher_s = time.perf_counter() - t0

    # 2. one epoch of training
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    student.train()
    t0 = time.perf_counter()
    kl = 0.0
    for b, s in enumerate(range(0, n, mb)):
        rows = slice(s, s + mb)
        z_s = student(input_ids=plain[rows].to(device)).logits[:, length - n_reply - 1 : length - 1]
        if mode == "topk-cache":
            ids, lp = cache[b]
            per_tok = losses.topk_forward_kl(z_s, ids.long().to(device), lp.float().to(device))
        elif mode == "full-cache":
            t_lp = cache[b][0].to(device)
            per_tok = losses.full_forward_kl(z_s, t_lp)  # log-probs are valid logits: softmax(log p) = p
        else:
            with torch.no_grad():
                z_t = teacher_logits(rows)
            per_tok = losses.full_forward_kl(z_s, z_t)
        loss = per_tok.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        kl = float(loss.detach())
    train_s = time.perf_counter() - t0
    return {"mode": mode, "cache_mb": cache_bytes / 2**20, "peak_mb": _peak_mb() - base_mb, "teacher_s": teacher_s,
            "train_s": train_s, "kl_last": kl, "reply_tokens": n * n_reply}


def cache_bytes_per_token(vocab: int, k: int) -> dict[str, int]:
    """Bytes per reply token: the compact top-k cache, the previous float32 + int32 one, the full float32 row."""
    import torch

    from agentevo.algorithms.rsd.recipe import id_dtype

    ids = torch.empty((), dtype=id_dtype(vocab)).element_size()
    token_logps = 2 * 4  # teacher's and student's log-prob of the taken token, float32
    return {"compact": k * (ids + 2) + token_logps, "previous": k * (4 + 4) + token_logps, "full": 4 * vocab,
            "id_bits": 8 * ids}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Print the cache bytes per token, then run the three variants per vocabulary size (one line each, + ratios)."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vocab", type=int, nargs="+", default=[2048, 32000])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--length", type=int, default=384)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reply-frac", type=float, default=0.25)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="round-robin repeats; the fastest time of each is kept")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: checks the bench runs (seconds)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.vocab, args.rows, args.length, args.context, args.hidden, args.layers = [256], 2, 32, 8, 32, 1
        args.micro_batch = 2
    sizes = {}
    for vocab in (2048, 151_936):
        sizes[vocab] = b = cache_bytes_per_token(vocab, args.k)
        print(f"V={vocab:6d} top-{args.k} cache: {b['compact']} bytes/token (float16 + int{b['id_bits']}"
              f" ids) vs {b['previous']} (float32 + int32) vs the full float32 row {b['full']:,}: "
              f"{100 * b['compact'] / b['full']:.3f}% of the row (was {100 * b['previous'] / b['full']:.3f}%)", flush=True)
    ctx = mp.get_context("spawn")
    modes = ("topk-cache", "full-cache", "full-live")
    per_vocab: dict[int, dict[str, dict[str, Any]]] = {}
    for vocab in args.vocab:
        per_vocab[vocab] = out = {}
        # Round-robin over the variants so a burst of load on a shared machine hits all of them alike.
        for _ in range(args.repeats):
            for mode in modes:
                job = {"vocab": vocab, "rows": args.rows, "length": args.length, "context": args.context,
                       "reply_frac": args.reply_frac, "hidden": args.hidden, "layers": args.layers,
                       "micro_batch": args.micro_batch, "k": args.k, "threads": args.threads, "mode": mode}
                with ctx.Pool(1) as pool:
                    res = pool.apply(_variant, (job,))
                if mode in out:
                    for key in ("teacher_s", "train_s"):
                        res[key] = min(res[key], out[mode][key])
                out[mode] = res
        for mode in modes:
            r = out[mode]
            print(f"V={vocab:6d} {mode:11s} | reply tokens {r['reply_tokens']:6d} | cache {r['cache_mb']:9.2f} MiB | "
                  f"peak +{r['peak_mb']:8.1f} MiB | teacher {r['teacher_s']:6.2f} s | train {r['train_s']:6.2f} s | "
                  f"KL(last step) {r['kl_last']:.4f}", flush=True)
        a, fc, fl = out["topk-cache"], out["full-cache"], out["full-live"]
        print(f"V={vocab:6d} ratios: full-cache/top{args.k} cache size {fc['cache_mb'] / max(a['cache_mb'], 1e-9):.0f}x,"
              f" peak memory full-cache/top{args.k} {fc['peak_mb'] / max(a['peak_mb'], 1e-9):.2f}x,"
              f" full-live/top{args.k} {fl['peak_mb'] / max(a['peak_mb'], 1e-9):.2f}x;"
              f" total time full-cache/top{args.k} {(fc['teacher_s'] + fc['train_s']) / (a['teacher_s'] + a['train_s']):.2f}x,"
              f" full-live/top{args.k} {(fl['teacher_s'] + fl['train_s']) / (a['teacher_s'] + a['train_s']):.2f}x")
    return {"bytes_per_token": sizes, "variants": per_vocab}


if __name__ == "__main__":
    main()
