"""How a pretrained model judges the guide probe's demo steps: the three verdict lines scored raw (sum of log-probs)
and calibrated (minus the score with the last observation replaced by "N/A", as SelfJudge does).

usage: python judge_probe.py MODEL_DIR RUN_DIR [DTYPE]   (RUN_DIR: a selfguide run on probe-guide, whose expert-guided
demos are re-scored; DTYPE float32 (default) or auto)
"""
import sys
from collections import Counter
from pathlib import Path

from agentevo.algorithms.selfguide.recipe import SelfJudge, continuation_logprobs, oracle_verdict, verdict_text
from agentevo.data.store import ExperienceStore
from agentevo.envs import make_env
from agentevo.models import placement
from agentevo.models.backend import TransformersPolicy, load_pretrained
from agentevo.rollout.engine import Episode, EpisodeRequest

placement.configure(dtype=sys.argv[3] if len(sys.argv) > 3 else "float32")  # auto = as the runs
model, tok = load_pretrained(sys.argv[1])
policy = TransformersPolicy(model, tok, "judge", batch_size=8)
judge = SelfJudge(policy, make_env("probe-guide").instruction(), 2, "none", "before")
demos = ExperienceStore(Path(sys.argv[2]) / "experience.db").load(collection="expert-guided")
counts: Counter = Counter()
for traj in demos:
    for t in range(1, len(traj.steps)):
        ep = Episode(EpisodeRequest(traj.task, 0), 0, first_obs=traj.first_obs, goal=traj.goal)
        ep.steps = traj.steps[:t]
        action = traj.steps[t].parsed_action
        lines = [policy.renderer.encode_reply(verdict_text(action, v, False, "none", "before"))[:-1] for v in (1, 0, -1)]
        raw = continuation_logprobs(policy, judge.prompt_ids(ep), lines)
        calibrated = judge.scores(ep, action)
        pick_raw = (1, 0, -1)[max(range(3), key=raw.__getitem__)]
        pick_cal = max(calibrated, key=calibrated.__getitem__)
        counts[(ep.steps[-1].next_obs.split(".")[0], oracle_verdict(ep.steps), pick_raw, pick_cal)] += 1
print("last observation | oracle verdict | raw pick | calibrated pick | steps")
for (obs, oracle, raw_pick, cal_pick), n in sorted(counts.items()):
    print(f"{obs} | {oracle:+d} | {raw_pick:+d} | {cal_pick:+d} | {n}")
