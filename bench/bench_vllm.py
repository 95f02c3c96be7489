"""Generation throughput of vLLM vs transformers on the same token-id prompts, measured in one run (needs a GPU).

Both backends get the same ReAct-shaped prompts (rendered with the model's chat template) and the same sampling;
each is warmed up once, then timed on all prompts. Printed: prompts, generated tokens, seconds, tokens/s per
backend, the ratio, and how many greedy replies are identical token for token.

Usage: python bench/bench_vllm.py [--model PATH] [--prompts 256] [--max-new-tokens 64] [--batch-size 64]
       [--temperature 0.0] [--dtype bfloat16]
Without --model, a 4-layer tiny Llama is built (a plumbing check; give a real model for real numbers).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from agentevo.agent.chat import Message
from agentevo.models.backend import Generation, Sampling, TransformersPolicy, load_pretrained

ROOMS = ["kitchen", "pantry", "corridor", "backyard", "living room", "bedroom"]
OBJECTS = ["knife", "red apple", "cookbook", "yellow potato", "fridge", "stove", "counter", "carrot"]


def prompt_texts(n: int, seed: int = 0) -> list[str]:
    """n game-like first observations of varied length (a stand-in for rollout prompts)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        seen = ", ".join(rng.sample(OBJECTS, rng.randint(2, len(OBJECTS))))
        history = " ".join(f"You go to the {rng.choice(ROOMS)}." for _ in range(rng.randint(1, 12)))
        texts.append(f"Interact with the game. Reply 'Thought: ...' then 'Action: ...'.\n\nYou are in the "
                     f"{rng.choice(ROOMS)}. You see {seen}. {history} Your task is to cook a meal.")
    return texts


def timed(policy: Any, prompts: list[list[int]], sampling: Sampling) -> tuple[list[Generation], float]:
    """Generate once to warm up (compilation, CUDA graphs, caches), then time a full pass."""
    policy.generate(prompts[: min(8, len(prompts))], sampling)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    gens = policy.generate(prompts, sampling)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return gens, time.perf_counter() - t0


def tiny_model(folder: Path) -> Path:
    """A fresh tiny Llama with a tokenizer trained on the bench's own text."""
    from agentevo.config import TinyModelConfig
    from agentevo.models.tiny import build_tiny_model, train_tokenizer

    tok = train_tokenizer(prompt_texts(200) + ["Thought: I need the knife.\nAction: take knife"], 1024)
    model = build_tiny_model(TinyModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=768), tok, 0)
    TransformersPolicy(model, tok, "tiny").save(folder / "tiny")
    return folder / "tiny"


def main(argv: list[str] | None = None) -> None:
    """Run both backends and print one line each, then the ratio."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="save_pretrained folder (default: a freshly built tiny Llama)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64, help="transformers generation batch")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--smoke", action="store_true", help="8 prompts, 8 new tokens (needs a GPU and vllm)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.max_new_tokens, args.batch_size = 8, 8, 8
    if not torch.cuda.is_available():
        raise SystemExit("bench_vllm needs a CUDA GPU (vLLM runs only there)")
    from agentevo.models.vllm_backend import VLLMConfig, VLLMPolicy

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else tiny_model(Path(tmp))
        model, tok = load_pretrained(path)
        hf = TransformersPolicy(model.to(device="cuda", dtype=getattr(torch, args.dtype)), tok, "hf", args.batch_size)
        prompts = [hf.renderer.render([Message("user", t)], add_generation_prompt=True).ids
                   for t in prompt_texts(args.prompts)]
        sampling = Sampling(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=0)
        print(f"model {path} | {len(prompts)} prompts, mean {sum(map(len, prompts)) / len(prompts):.0f} tokens | "
              f"max_new_tokens {args.max_new_tokens} | temperature {args.temperature} | {args.dtype} | "
              f"{torch.cuda.get_device_name()}")
        hf_gens, hf_s = timed(hf, prompts, sampling)
        del hf, model
        torch.cuda.empty_cache()
        vl = VLLMPolicy(path, tok, "vllm", VLLMConfig(dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization))
        vl_gens, vl_s = timed(vl, prompts, sampling)
        vl.close()
    rows = {"transformers": (hf_gens, hf_s), "vllm": (vl_gens, vl_s)}
    rates = {}
    for name, (gens, seconds) in rows.items():
        tokens = sum(len(g.token_ids) for g in gens)
        rates[name] = tokens / seconds
        print(f"{name:>12}: {tokens:7d} tokens in {seconds:7.2f} s = {rates[name]:9.1f} tok/s, "
              f"{len(gens) / seconds:7.1f} prompts/s")
    same = sum(a.token_ids == b.token_ids for a, b in zip(hf_gens, vl_gens, strict=True))
    print(f"vllm / transformers = {rates['vllm'] / rates['transformers']:.1f}x; identical replies: {same}/{len(prompts)}"
          + (" (greedy; bf16 kernels differ, so some divergence is expected)" if args.temperature == 0 else ""))


if __name__ == "__main__":
    main()
