"""Generation speed: transformers' generate vs the policy's cached paths, side by side on the same model and prompts.

Each measurement plays `--turns` turns of `batch` episodes as the rollout engine does (every prompt extends the
previous one by the reply and an observation; all episodes share an instruction) and counts generated tokens per
second, prefill included. Modes, interleaved per repeat (median of --repeats):
  generate   transformers' model.generate (prefix_cache=0)
  prefix     the earlier cached path (padded cache rebuilt per call, finished rows copied out)
  slots-own  persistent per-episode KV rows, decode attention reading every row's own copy of the instruction
  slots      the default: the same, reading the instruction all rows share once per step on the CPU
             (shared-prefix attention; on a GPU it equals slots-own)
  slots-bf16 the default under bf16 autocast (only where the device has bf16: AMX/AVX512-BF16 CPUs, most GPUs)
Greedy fp32 replies of every mode are checked to be token-identical to generate's.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_generate.py             # tiny default model, CPU or GPU
    .venv/bin/python bench/bench_generate.py --smoke                      # seconds: a 2-layer model, batch 1 and 4
    python bench/bench_generate.py --shape 768x12x12x3072 --batches 1,8,64   # GPU: the issue's ~110M shape
    .venv/bin/python bench/bench_generate.py --model Qwen/Qwen2.5-0.5B-Instruct --batches 1,8,32
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from typing import Any

import torch

from agentevo.models import placement
from agentevo.models.backend import Sampling, TransformersPolicy

CORPUS = [
    "You are in the kitchen. In one part of the room you see a fridge that is closed. There is a counter with a knife.",
    "Thought: I need the knife.\nAction: take knife",
    "Observation: You take the knife. The fridge is closed. To the north you see a pantry with a cookbook.",
    "Your task is to cook a meal. Check the cookbook in the kitchen for the recipe, then prepare and eat it.",
    "Thought: I should open the fridge.\nAction: open fridge",
    "Observation: You open the fridge, revealing a red potato, a yellow bell pepper and a block of cheese.",
] * 10


def build_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """The tiny default model (or --model), on the process's device, in eval mode."""
    if args.model:
        from agentevo.models.backend import load_pretrained

        model, tokenizer = load_pretrained(args.model)
    else:
        from agentevo.config import TinyModelConfig
        from agentevo.models.tiny import build_tiny_model, train_tokenizer

        tokenizer = train_tokenizer(CORPUS, 2048)
        if args.smoke:
            cfg = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
        elif args.shape:
            hidden, layers, heads, mlp = (int(x) for x in args.shape.split("x"))
            cfg = TinyModelConfig(hidden_size=hidden, num_layers=layers, num_heads=heads, intermediate_size=mlp)
        else:
            cfg = TinyModelConfig()
        model = placement.place(build_tiny_model(cfg, tokenizer, 0))
    return model.eval(), tokenizer


def episodes(tokenizer: Any, batch: int, instruction_repeats: int) -> tuple[list[list[int]], list[int]]:
    """First prompts of `batch` episodes (a shared instruction, then each episode's own observation) and the
    observation appended after every reply."""
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    instruction = enc(" ".join(CORPUS[:6]) * instruction_repeats)
    prompts = [instruction + enc(" ".join(CORPUS[(i % 6) : (i % 6) + 1 + i % 3])) for i in range(batch)]
    return prompts, enc(" " + CORPUS[2])


def play(policy: TransformersPolicy, prompts: list[list[int]], obs: list[int], turns: int, max_new: int,
         precision: contextlib.AbstractContextManager[Any]) -> tuple[float, int, list[list[int]]]:
    """Seconds and generated tokens for `turns` turns of the episodes, and every reply's ids."""
    sampling = Sampling(temperature=0.0, max_new_tokens=max_new)
    replies: list[list[int]] = []
    tokens = 0
    if policy.kv_cache is not None:
        policy.kv_cache.clear()  # every measurement starts cold
    sync = torch.cuda.synchronize if policy.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with precision:
        for _ in range(turns):
            gens = policy.generate(prompts, sampling)
            tokens += sum(len(g.token_ids) for g in gens)
            replies += [g.token_ids for g in gens]
            prompts = [p + g.token_ids + obs for p, g in zip(prompts, gens, strict=True)]
    sync()
    return time.perf_counter() - start, tokens, replies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder or hub id in the local HF cache (default: tiny model)")
    parser.add_argument("--shape", help="a randomly initialised tiny-family model of HIDDENxLAYERSxHEADSxMLP instead of "
                        "the default (768x12x12x3072: ~115M parameters, the performance issue's GPU shape)")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (episodes in flight)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new", type=int, default=32, help="new tokens per reply (no stop token: all run)")
    parser.add_argument("--instruction", type=int, default=2, help="repeats of the shared instruction text")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    parser.add_argument("--smoke", action="store_true", help="a few seconds: tiny 2-layer model, batch 1 and 4")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.turns, args.max_new, args.repeats, args.instruction = "1,4", 2, 4, 1, 1
    torch.set_num_threads(args.threads)
    model, tokenizer = build_model(args)
    device = next(model.parameters()).device
    batches = [int(b) for b in args.batches.split(",")]
    bf16 = placement.detect_bf16(device)
    modes = ["generate", "prefix", "slots-own", "slots"] + (["slots-bf16"] if bf16.bf16 else [])
    policies = {
        "generate": TransformersPolicy(model, tokenizer, "g", batch_size=max(batches), prefix_cache=0),
        "prefix": TransformersPolicy(model, tokenizer, "p", batch_size=max(batches), prefix_cache=2 * max(batches),
                                     kv_engine="prefix"),
        "slots-own": TransformersPolicy(model, tokenizer, "o", batch_size=max(batches), prefix_cache=2 * max(batches),
                                        shared_prefix_attention=False),
        "slots": TransformersPolicy(model, tokenizer, "s", batch_size=max(batches), prefix_cache=2 * max(batches)),
    }
    # its own rows: sharing them with fp32 would reallocate them at every switch of precision
    policies["slots-bf16"] = TransformersPolicy(model, tokenizer, "b", batch_size=max(batches),
                                                prefix_cache=2 * max(batches))
    for mode in modes[1:4]:  # the model's attention must suit the mode, else the numbers would be another path's
        cache = policies[mode].kv_cache
        print(f"{mode}: {type(cache).__name__ if cache is not None else 'no cache (plain generate)'}")
    load = os.getloadavg()
    print(f"device {device} ({bf16.why}); attention {model.config._attn_implementation}; "
          f"{torch.get_num_threads()} torch thread(s); load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on "
          f"{os.cpu_count()} CPUs -- absolute numbers are not quiet-machine numbers, compare ratios")
    rates: dict[tuple[str, int], list[float]] = {(m, b): [] for m in modes for b in batches}
    identical = True
    for b in batches:
        prompts, obs = episodes(tokenizer, b, args.instruction)
        for r in range(args.repeats + 1):  # repeat 0 warms up and is not counted
            want: list[list[int]] | None = None
            for mode in modes:
                precision = (torch.autocast(device.type, dtype=torch.bfloat16) if mode.endswith("bf16")
                             else contextlib.nullcontext())
                seconds, tokens, replies = play(policies[mode], prompts, obs, args.turns, args.max_new, precision)
                if mode == "generate":
                    want = replies
                elif not mode.endswith("bf16") and replies != want:
                    identical = False
                if r > 0:
                    rates[(mode, b)].append(tokens / seconds)
        print(f"batch {b:3d}: " + "  ".join(f"{m} {statistics.median(rates[(m, b)]):7.0f}" for m in modes)
              + "  tokens/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\ngenerated tokens/s, prefill included (median of {args.repeats}; {args.turns} turns of {args.max_new} "
          f"new tokens; final load average {os.getloadavg()[0]:.1f}):")
    print(f"  {'batch':>5} " + " ".join(f"{m:>11}" for m in modes) + "   slots/prefix  slots/generate  shared/own"
          + ("  bf16/fp32" if "slots-bf16" in modes else ""))
    for b in batches:
        row = f"  {b:5d} " + " ".join(f"{med[(m, b)]:11.0f}" for m in modes)
        row += f"   {med[('slots', b)] / med[('prefix', b)]:11.2f}x  {med[('slots', b)] / med[('generate', b)]:13.2f}x"
        row += f"  {med[('slots', b)] / med[('slots-own', b)]:9.2f}x"
        if "slots-bf16" in modes:
            row += f"  {med[('slots-bf16', b)] / med[('slots', b)]:8.2f}x"
        print(row)
    top = max(batches)
    best = max((m for m in modes if m.startswith("slots")), key=lambda m: med[(m, top)])
    print(f"new/old at batch {top}: {med[('slots', top)] / med[('prefix', top)]:.2f}x fp32, "
          f"{med[(best, top)] / med[('prefix', top)]:.2f}x best ({best}) (target >= 3x on the CPU); "
          f"policy generate / model.generate: {med[('slots', top)] / med[('generate', top)]:.2f}x "
          f"(target >= 0.9x on a GPU, and the cache never slower than none)")
    print(f"greedy fp32 replies identical to model.generate in every mode: {'yes' if identical else 'NO'}")
    if not identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
