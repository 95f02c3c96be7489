"""Where does a Q-Evolve run's round-1 critic rank states? Over the policy's own episodes, fitted and held-out
separately: AUC of V(s_1) for the episode's success; of V(s_t) over every state, pairs only within a step
(metrics.auc_same_step); of -t (what step index alone gives, the confound the same-step AUC removes); and the
leave-one-out AUC of the task's other episodes' success rate (how much of success is task difficulty).
Usage (repository root): python docs/studies/qevolve_cookingworld_powered/scripts/critic_ranking.py runs/qe-s0 ..."""
import sys
from collections import defaultdict

import torch

from agentevo.algorithms.qevolve import recipe as qe
from agentevo.eval.metrics import auc, auc_same_step
from agentevo.models.critic import critic_values
from agentevo.run import Run

torch.set_num_threads(1)
for path in sys.argv[1:]:
    run = Run.open(path, quiet=True)
    q = run.cfg.qevolve
    data = qe.hybrid_dataset(run, 1)
    critic, policy = qe.load_round_critic(run, 1)
    items = qe.critic_items(run, policy, data)
    with torch.no_grad():
        values = critic_values(critic, items, policy.pad_id)
    held = [qe.is_holdout(t.task.task_id, q.critic_holdout, run.cfg.seed) for t in data.trajs]
    won = [bool(t.success) for t in data.trajs]
    for name, side in (("fitted", False), ("held-out", True)):
        idx = [i for i, t in enumerate(data.trajs) if t.source != "expert" and held[i] == side]
        states = [(values[i]["v"][t], t, won[i]) for i in idx for t in range(items[i].T)]
        v, steps, y = (list(x) for x in zip(*states, strict=True))
        by_task = defaultdict(list)
        for i in idx:
            by_task[data.trajs[i].task.task_id].append(won[i])
        loo = [(sum(o[:k] + o[k + 1:]) / (len(o) - 1), o[k]) for o in by_task.values() if len(o) > 1
               for k in range(len(o))]
        print(f"{path} {name}: episodes {len(idx)}, success {sum(won[i] for i in idx) / len(idx):.3f}, "
              f"AUC V(s_1) {auc([values[i]['v'][0] for i in idx], [won[i] for i in idx]):.3f}, "
              f"AUC V(s_t) same step {auc_same_step(v, steps, y):.3f}, AUC -t {auc([-t for t in steps], y):.3f}, "
              f"LOO task success rate AUC {auc(*zip(*loo, strict=True)) if loo else float('nan'):.3f}")
    run.close()
