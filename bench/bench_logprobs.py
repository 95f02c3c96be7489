"""Peak memory of the training log-prob path at a large vocabulary: chunked selective log-softmax vs the plain one.

Each variant runs forward + backward of log p(next token) over [B, L, V] logits in a fresh subprocess, and the
subprocess's peak resident memory above its baseline is reported (CPU; on a GPU, torch.cuda.max_memory_allocated).
The plain path is what agentevo did before (cast the whole logits to float32, gather - logsumexp); the chunked path is
agentevo.algorithms.losses.token_logprobs. Prints both peaks and their ratio, and the largest value difference.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_logprobs.py              # B=1, L=2048, V=151,936 (Qwen3), bf16
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_logprobs.py --smoke      # tiny shapes (the test suite runs this)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def _child(variant: str, b: int, length: int, vocab: int, dtype: str) -> None:
    import torch

    from agentevo.algorithms.losses import token_logprobs

    def peak_mb() -> float:
        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(b, length, vocab, generator=g).to(device=device, dtype=getattr(torch, dtype))
    ids = torch.randint(0, vocab, (b, length), generator=g).to(device)
    logits.requires_grad_(True)
    base = peak_mb()
    if variant == "plain":
        z = logits[:, :-1].float()
        out = z.gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
    else:
        out = token_logprobs(logits, ids)
    out.sum().backward()
    print(json.dumps({"peak_mb": peak_mb() - base, "sum": float(out.detach().double().sum())}))


def measure(variant: str, b: int, length: int, vocab: int, dtype: str) -> dict[str, float]:
    """Run one variant in a fresh interpreter; its peak memory above baseline (MiB) and the sum of its values."""
    code = f"import sys; sys.path.insert(0, 'bench'); from bench_logprobs import _child; " \
           f"_child({variant!r}, {b}, {length}, {vocab}, {dtype!r})"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the bench runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.length, args.vocab = 1, 64, 4096
    plain = measure("plain", args.batch, args.length, args.vocab, args.dtype)
    chunked = measure("chunked", args.batch, args.length, args.vocab, args.dtype)
    rel = abs(plain["sum"] - chunked["sum"]) / max(1.0, abs(plain["sum"]))
    print(f"logprobs [B={args.batch}, L={args.length}, V={args.vocab}] {args.dtype}, forward + backward")
    print(f"  peak memory above baseline: plain {plain['peak_mb']:.0f} MiB, chunked {chunked['peak_mb']:.0f} MiB "
          f"(ratio plain/chunked {plain['peak_mb'] / max(chunked['peak_mb'], 1e-9):.2f}x)")
    print(f"  relative difference of the summed log-probs: {rel:.2e}")
    return {"plain_mb": plain["peak_mb"], "chunked_mb": chunked["peak_mb"], "rel_diff": rel}


if __name__ == "__main__":
    main()
