"""Replay a GRPO run's first update offline and print the per-step k3 KL to the reference (the study's check that
the logged KL is real drift). Usage: python docs/studies/qevolve_cookingworld_powered/scripts/grpo_kl_replay.py
(edit RUN for another seed)."""
from agentevo.algorithms.grpo import recipe as grpo
from agentevo.run import Run

RUN = "runs/grpo-s1"
run = Run.open(RUN, quiet=True)
cfg, g = run.cfg, run.cfg.grpo
trajs = run.store.load(collection="update-1/collect")
policy = run.load_policy("bc", policy_id="bc")
ref = run.load_policy("bc").model.eval().requires_grad_(False)
samples = []
for group in grpo.split_groups(trajs):
    adv = grpo.outcome_advantages(grpo.group_returns(group, g), g)
    if adv is None:
        continue
    for traj, a in zip(group, adv.tolist(), strict=True):
        samples += grpo.outcome_samples(policy.renderer, traj, len(samples), a, g, 15, 2048)
grpo.add_ref_logprobs(ref, samples, policy.pad_id, 8)
trainer = grpo.PolicyTrainer(policy, cfg, g)
stats = trainer.update(samples, grpo.grpo_loss(g), cfg.seed + 1, lambda s, r: print(s, {k: f"{v:.3g}" for k, v in r.items() if k in ("kl", "ratio_mean", "clip_frac_low", "pg_loss")}))
print("mean", stats.get("kl"))
run.close()
