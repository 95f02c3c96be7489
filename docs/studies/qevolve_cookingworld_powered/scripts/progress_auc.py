"""Does Q-Evolve's process reward point the right way? AUC of the round's training advantage A_t for 'this step raised
the env score' (progress) against the other steps of the policy's own episodes, beside the outcome-only advantage
(final reward minus the task's mean), the mean advantage of progress / neutral / flagged steps, and the same AUC for
other process rewards recomputed from the stored V (labels/round-1.json). No model needed.
Usage (repository root): python docs/studies/qevolve_cookingworld_powered/scripts/progress_auc.py runs/qe-s0 ..."""
import json
import sys
from collections import defaultdict

from agentevo.algorithms import advantages as adv_math
from agentevo.algorithms.qevolve.recipe import step_labels
from agentevo.config import load_config
from agentevo.data.store import ExperienceStore
from agentevo.eval.metrics import auc


def mean(xs: list[float]) -> float:
    return sum(xs) / max(1, len(xs))


for path in sys.argv[1:]:
    store = ExperienceStore(f"{path}/experience.db")
    stored = json.load(open(f"{path}/labels/round-1.json"))
    q = load_config(f"{path}/config.yaml").qevolve
    by_key = {int(t.meta["store_id"]): t for c in ("expert", "round-1/self") for t in store.load(collection=c)}
    rows = [(by_key[k], a, v) for k, a, v in zip(stored["keys"], stored["adv"], stored["v"], strict=True)
            if by_key[k].source != "expert"]
    task_returns = defaultdict(list)
    for t, _, _ in rows:
        task_returns[t.task.task_id].append(t.final_reward)
    adv, outcome, progress, flagged = [], [], [], []
    for t, a, _ in rows:
        m = mean(task_returns[t.task.task_id])
        for s, x in zip(t.steps, a, strict=True):
            adv.append(x)
            outcome.append(t.final_reward - m)
            progress.append(s.reward > 0)
            flagged.append(s.signal != "none")
    alternatives = {}
    for name, pr_aux, lam in (("gae lam 0.5", False, 0.5), ("gae lam 0 (td)", False, 0.0),
                              ("gae_aux lam 0", True, 0.0)):
        xs = []
        for t, _, v in rows:
            lab = step_labels(t, q)
            r = [e + x for e, x in zip(lab.r_env, lab.r_aux, strict=True)] if pr_aux else lab.r_env
            xs += adv_math.gae(r, v, lab.done, q.gamma, lam).tolist()
        alternatives[name] = round(auc(xs, progress), 3)
    neutral = [x for x, p, f in zip(adv, progress, flagged, strict=True) if not p and not f]
    print(path, {"steps": len(adv), "progress_frac": round(mean(progress), 3),
                 f"AUC A_t ({q.pr} lam {q.lam:g}, trained)": round(auc(adv, progress), 3),
                 "AUC outcome-only": round(auc(outcome, progress), 3), **{f"AUC {k}": v for k, v in alternatives.items()},
                 "mean A progress": round(mean([x for x, p in zip(adv, progress, strict=True) if p]), 3),
                 "mean A neutral": round(mean(neutral), 3),
                 "mean A flagged": round(mean([x for x, f in zip(adv, flagged, strict=True) if f]), 3)})
