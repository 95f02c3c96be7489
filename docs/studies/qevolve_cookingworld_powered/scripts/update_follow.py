"""Did a Q-Evolve round's policy update move its training actions the way their advantages asked? Recomputes, from
a finished run's checkpoints (pi_BC = pi_0 and round-1) and labels/round-1.json, the report's update-follow check
(diagnostics.update_follow): the AUC of log pi_1 - log pi_0 per step for A > 0 over A < 0, the mean change where
A > 0 / A < 0, and for the rule-flagged steps. Runs reported before the check existed get it this way.
Usage (repository root): python docs/studies/qevolve_cookingworld_powered/scripts/update_follow.py runs/qe-s0 ..."""
import json
import sys

import torch

from agentevo.algorithms.bc import ensure_reply_ids
from agentevo.algorithms.qevolve import recipe as qe
from agentevo.run import Run

torch.set_num_threads(int(sys.argv[1]) if sys.argv[1].isdigit() else 1)
for path in [a for a in sys.argv[1:] if not a.isdigit()]:
    run = Run.open(path, quiet=True)
    cfg = run.cfg
    data = qe.hybrid_dataset(run, 1)
    saved = json.loads(qe.labels_path(run, 1).read_text())
    old_policy = run.load_policy("bc")
    ensure_reply_ids(old_policy, data.trajs)
    samples = qe.policy_samples(old_policy.renderer, data, saved["adv"], cfg.agent.history_window,
                                cfg.optim.max_length)
    micro = cfg.qevolve.policy_micro_batch_size
    old = qe.span_logprobs(old_policy.model, samples, old_policy.pad_id, micro)
    new = qe.span_logprobs(run.load_policy("round-1").model, samples, old_policy.pad_id, micro)
    out = qe.update_follow_record(data, samples, old, new)
    print(path, {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()})
    run.close()
