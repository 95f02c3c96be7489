"""Cached continuation_logprobs vs the previous one-batch version on a run's demo steps: same scores, same verdicts,
CPU seconds of each. usage: python judge_equiv.py MODEL_DIR RUN_DIR [N_DEMOS]  (the commit's check: smollm2-hf,
runs/real/sg-smol-self, 12 demos -> 24/24 verdicts equal, max score diff 1.07e-4, 2.03x less CPU)"""
import sys
import time
from pathlib import Path

import torch

from agentevo.algorithms import losses
from agentevo.algorithms.selfguide.recipe import SelfJudge, continuation_logprobs, verdict_text
from agentevo.data.store import ExperienceStore
from agentevo.data.tensors import StepSample, collate
from agentevo.envs import make_env
from agentevo.models import placement
from agentevo.models.backend import TransformersPolicy, load_pretrained
from agentevo.rollout.engine import Episode, EpisodeRequest


@torch.no_grad()
def old(policy, prompt, conts):
    n = len(prompt)
    rows = [StepSample([*prompt, *c], [(n, n + len(c))], 0, [1]) for c in conts]
    batch = collate(rows, policy.pad_id)
    logits = policy.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    picked = losses.token_logprobs(logits, batch["input_ids"])
    return [float(x) for x in (picked * batch["action_mask"][:, 1:]).sum(dim=1)]

torch.set_num_threads(1)
placement.configure(dtype="float32")
model, tok = load_pretrained(sys.argv[1])
policy = TransformersPolicy(model, tok, "judge", batch_size=8)
demos = ExperienceStore(Path(sys.argv[2]) / "experience.db").load(collection="expert-guided")
env = make_env("probe-guide")
judge = SelfJudge(policy, env.instruction(), 2, "none", "before")
diffs, agree, n, t_old, t_new = [], 0, 0, 0.0, 0.0
for traj in demos[: int(sys.argv[3]) if len(sys.argv) > 3 else None]:
    stored = traj.meta.get("verdicts", [])
    for t in range(1, len(traj.steps)):
        ep = Episode(EpisodeRequest(traj.task, 0), 0, first_obs=traj.first_obs, goal=traj.goal)
        ep.steps = traj.steps[:t]
        action = traj.steps[t].parsed_action
        conts = [policy.renderer.encode_reply(verdict_text(action, v, False, "none", "before"))[:-1] for v in (1, 0, -1)]
        sc = {}
        for name, fn in (("old", old), ("new", continuation_logprobs)):
            t0 = time.process_time()
            seen = fn(policy, judge.prompt_ids(ep), conts)
            blank = fn(policy, judge.prompt_ids(ep, content_free=True), conts)
            dt = time.process_time() - t0
            if name == "old":
                t_old += dt
            else:
                t_new += dt
            sc[name] = [a - b for a, b in zip(seen, blank, strict=True)]
        diffs.append(max(abs(a - b) for a, b in zip(sc["old"], sc["new"], strict=True)))
        pick = (1, 0, -1)[max(range(3), key=sc["new"].__getitem__)]
        agree += pick == stored[t - 1][1]
        n += 1
print(f"steps {n}; verdicts equal to the stored run's {agree}/{n}; max |score diff| {max(diffs):.2e}; "
      f"CPU s old {t_old:.1f} new {t_new:.1f} (x{t_old / t_new:.2f})")
