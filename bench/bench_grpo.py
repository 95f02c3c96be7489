"""Cost of one GRPO update split by phase (rollout with groups, advantages + reference log-probs, policy update),
and rollout throughput with groups; optionally the same update with Self-Guide's cut-history rows.

Usage: OMP_NUM_THREADS=1 python bench/bench_grpo.py [--model runs/NAME/checkpoints/bc] [--tasks 4] [--group 4]
       [--max-steps 12] [--parallel 8] [--guided] [--untrained] [--smoke]
Without --model the tiny default is first BC-trained briefly (benchlib.quick_bc_model) so the policy acts; with
--untrained an untrained tiny Llama is built instead (its replies are mostly format errors, so every episode runs to
max_steps with full generation budgets: a worst case for generation, a best case for the env). Env steps per point
of held-out gain for GRPO are in bench_methods.py.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import cpu_line, quick_bc_model  # noqa: E402

from agentevo.algorithms.grpo.config import GRPOConfig
from agentevo.algorithms.grpo.recipe import (  # noqa: E402
    PolicyTrainer,
    add_ref_logprobs,
    group_requests,
    group_returns,
    grpo_loss,
    outcome_advantages,
    outcome_samples,
    split_groups,
)
from agentevo.algorithms.selfguide.recipe import guided_samples, make_masker
from agentevo.config import RunConfig, TinyModelConfig
from agentevo.envs import make_env
from agentevo.models.backend import Sampling, TransformersPolicy, load_pretrained
from agentevo.rollout.engine import PolicyActor, run_episodes
from agentevo.rollout.workers import make_pool


def build_policy(path: str | None, batch_size: int) -> TransformersPolicy:
    """A checkpoint, or an untrained tiny model with a tokenizer trained on the env instruction and demos."""
    if path:
        model, tok = load_pretrained(path)
        return TransformersPolicy(model, tok, "bench", batch_size)
    from agentevo.models.tiny import build_tiny_model, train_tokenizer

    env = make_env("twx-cookingworld", n_train=4)
    texts = [env.instruction()] + [" ".join(env.expert(t)) for t in env.tasks("train")] * 10
    env.close()
    tok = train_tokenizer(texts + ["Thought: Action: Observation: Guide: Verdict: good bad neutral"], 1024)
    return TransformersPolicy(build_tiny_model(TinyModelConfig(), tok, 0), tok, "bench", batch_size)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run one update, print the phase costs and return them (seconds)."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tasks", type=int, default=4, help="tasks per update")
    ap.add_argument("--group", type=int, default=4, help="G trajectories per task")
    ap.add_argument("--max-steps", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--parallel", type=int, default=8, help="episodes in flight (= generation batch)")
    ap.add_argument("--guided", action="store_true", help="also time Self-Guide's per-step rows (past guides cut)")
    ap.add_argument("--untrained", action="store_true", help="an untrained tiny Llama instead of the quick BC model")
    ap.add_argument("--smoke", action="store_true", help="tiny model and shapes: checks the bench runs (seconds)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tasks, args.group, args.max_steps, args.max_new_tokens, args.parallel = 2, 2, 2, 4, 2
    torch.manual_seed(0)
    print(cpu_line(), flush=True)
    if args.model is None and not args.untrained:
        args.model = str(quick_bc_model(Path(tempfile.mkdtemp(prefix="bench-grpo-")), args.smoke))
    policy = build_policy(args.model, args.parallel)
    cfg = GRPOConfig(lr=1e-5, batch_size=8, micro_batch_size=4, group_size=args.group)
    params = {"n_train": args.tasks, "max_steps": args.max_steps}
    signal_env = make_env("twx-cookingworld", **params)
    tasks = list(signal_env.tasks("train"))[: args.tasks]
    for t in tasks:
        object.__setattr__(t, "max_steps", args.max_steps)
    requests = group_requests(tasks, args.group)
    pool = make_pool("twx-cookingworld", params, args.parallel, "thread")
    try:
        # warm the JVMs so their start-up is not billed to the rollout
        t0 = time.perf_counter()
        pool.map([(i, "reset", (tasks[0],)) for i in range(pool.size)])
        jvm_s = time.perf_counter() - t0

        # 1. rollout with groups
        actor = PolicyActor(policy, signal_env.instruction(), args.window,
                            Sampling(1.0, 1.0, args.max_new_tokens, seed=0))
        t0 = time.perf_counter()
        trajs = run_episodes(actor, pool, requests, signal_env)
        rollout_s = time.perf_counter() - t0
    finally:
        pool.close()
        signal_env.close()
    for traj, req in zip(trajs, requests, strict=True):
        traj.meta.update(slot=req.slot)
    turns = sum(t.length for t in trajs)
    env_steps = sum(s.parsed_action is not None for t in trajs for s in t.steps)
    gen_tokens = sum(len(s.action_ids) for t in trajs for s in t.steps)

    # 2. advantages (labelling) and reference log-probs
    ref = copy.deepcopy(policy.model).eval().requires_grad_(False)
    t0 = time.perf_counter()
    samples = []
    for group in split_groups(trajs):
        adv = outcome_advantages(group_returns(group, cfg), cfg)
        for traj, a in zip(group, adv.tolist(), strict=True):
            samples += outcome_samples(policy.renderer, traj, len(samples), a, cfg, args.window, 4096)
    label_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    add_ref_logprobs(ref, samples, policy.pad_id, cfg.micro_batch_size)
    ref_s = time.perf_counter() - t0

    # 3. policy update
    trainer = PolicyTrainer(policy, RunConfig(), cfg)
    t0 = time.perf_counter()
    stats = trainer.update(samples, grpo_loss(cfg), seed=0)
    update_s = time.perf_counter() - t0

    total = rollout_s + label_s + ref_s + update_s
    n_tok = sum(s.n_action_tokens for s in samples)
    row_tok = sum(len(s.input_ids) for s in samples)
    print(f"GRPO update: {args.tasks} tasks x G={args.group} = {len(trajs)} trajectories, {turns} turns, "
          f"{env_steps} env steps, {gen_tokens} generated tokens; torch threads {torch.get_num_threads()}")
    print(f"  env workers start (not billed)   {jvm_s:8.2f} s")
    for name, sec in (("rollout with groups", rollout_s), ("advantages (labels + rows)", label_s),
                      ("reference log-probs", ref_s), ("policy update", update_s)):
        print(f"  {name:32s} {sec:8.2f} s  {100 * sec / total:5.1f}%")
    print(f"  total                            {total:8.2f} s")
    print(f"rollout throughput: {len(trajs) / rollout_s:.2f} episodes/s, {turns / rollout_s:.1f} turns/s, "
          f"{env_steps / rollout_s:.1f} env steps/s, {gen_tokens / rollout_s:.0f} generated tokens/s")
    print(f"training rows: {len(samples)} rows, {row_tok} tokens ({n_tok} reply tokens); "
          f"update {row_tok / update_s:.0f} tokens/s; ratio_mean {stats.get('ratio_mean', float('nan')):.4f}")

    if args.guided:
        # Self-Guide with past guides cut (stage I): the history changes between steps, so one row per step.
        mask_fn = make_masker(policy.tokenizer, "before")
        t0 = time.perf_counter()
        rows = [r for k, t in enumerate(trajs) for r in guided_samples(policy.renderer, t, k, args.window, 4096, 0, mask_fn)]
        for r in rows:
            r.token_labels["adv"] = [0.0] * r.n_action_tokens
            r.token_labels["old_logp"] = list(r.behaviour_logprobs or [0.0] * r.n_action_tokens)
        add_ref_logprobs(ref, rows, policy.pad_id, cfg.micro_batch_size)
        g_label = time.perf_counter() - t0
        t0 = time.perf_counter()
        trainer.update(rows, grpo_loss(cfg), seed=0)
        g_update = time.perf_counter() - t0
        g_tok = sum(len(r.input_ids) for r in rows)
        print(f"Self-Guide stage-I rows (past guides cut): {len(rows)} rows, {g_tok} tokens "
              f"({g_tok / max(1, row_tok):.1f}x the packed rows); rows + ref log-probs {g_label:.2f} s, "
              f"update {g_update:.2f} s ({g_update / update_s:.1f}x the packed update)")
    return {"rollout_s": rollout_s, "label_s": label_s, "ref_s": ref_s, "update_s": update_s}


if __name__ == "__main__":
    main()
