"""What one Q-Evolve arm changes in the round-1 advantages of another run on the same round-1 data, step by step.
Both runs' labels/round-1.json are paired by trajectory: by their `slots` (collection/slot, written since 2026-12-07),
or, for older files, by D's order (expert by slot, then the round's self data by slot), checked against both stores
(same task, same reply token ids). Prints the correlation and sign agreement of A, V's level, and the mean
advantage of each group of steps (expert, own successes and failures, rule-flagged steps, thirds of the episode).
Usage (repository root): python docs/studies/qevolve_cookingworld_powered/scripts/advantage_pairs.py RUN_A RUN_B"""
import json
import sys

import numpy as np

from agentevo.data.store import ExperienceStore


def dataset(run: str) -> list:
    store = ExperienceStore(f"{run}/experience.db")
    own = sorted(store.load(collection="round-1/self"), key=lambda t: t.meta["slot"])
    return sorted(store.load(collection="expert"), key=lambda t: t.meta["slot"]) + own


def paired(run_a: str, run_b: str) -> tuple[list, dict, dict]:
    la, lb = (json.loads(open(f"{r}/labels/round-1.json").read()) for r in (run_a, run_b))
    ta, tb = dataset(run_a), dataset(run_b)
    for run, trajs, lab in ((run_a, ta, la), (run_b, tb, lb)):
        if [int(t.meta["store_id"]) for t in trajs] != lab["keys"]:
            sys.exit(f"error: {run}/labels/round-1.json is not D in this order; rerun its advantages phase")
    if "slots" in la and "slots" in lb and la["slots"] != lb["slots"]:
        sys.exit("error: the two runs' round-1 data differ (slots); pair runs that share qevolve.round1_data_from")
    for x, y in zip(ta, tb, strict=True):
        if x.task.task_id != y.task.task_id or [s.action_ids for s in x.steps] != [s.action_ids for s in y.steps]:
            sys.exit("error: the two runs' round-1 data differ; pair runs that share qevolve.round1_data_from")
    return ta, la, lb


run_a, run_b = sys.argv[1:3]
trajs, la, lb = paired(run_a, run_b)
rows = []
for i, t in enumerate(trajs):
    for k, s in enumerate(t.steps):
        rows.append({"expert": t.source == "expert", "won": t.final_reward != 0, "third": min(2, 3 * k // t.length),
                     "flag": s.signal != "none", "a": la["adv"][i][k], "b": lb["adv"][i][k],
                     "va": la["v"][i][k], "vb": lb["v"][i][k]})
a, b = np.array([r["a"] for r in rows]), np.array([r["b"] for r in rows])
va, vb = np.array([r["va"] for r in rows]), np.array([r["vb"] for r in rows])
print(f"{len(trajs)} trajectories, {len(rows)} steps: A = {run_a}, B = {run_b}")
print(f"corr(A_A, A_B) {np.corrcoef(a, b)[0, 1]:.3f}; same sign {np.mean(np.sign(a) == np.sign(b)):.3f}; "
      f"mean |A_A - A_B| {np.abs(a - b).mean():.3f}; V: {va.mean():.3f} vs {vb.mean():.3f} (corr "
      f"{np.corrcoef(va, vb)[0, 1]:.3f})")
groups = {
    "expert": lambda r: r["expert"],
    "own, won": lambda r: not r["expert"] and r["won"],
    "own, lost": lambda r: not r["expert"] and not r["won"],
    "own, rule-flagged": lambda r: not r["expert"] and r["flag"],
    "own, not flagged": lambda r: not r["expert"] and not r["flag"],
    "own, first third": lambda r: not r["expert"] and r["third"] == 0,
    "own, middle third": lambda r: not r["expert"] and r["third"] == 1,
    "own, last third": lambda r: not r["expert"] and r["third"] == 2,
}
print("| steps | n | mean A (A) | mean A (B) | B - A | A > 0 (A) | A > 0 (B) |")
print("|---|---|---|---|---|---|---|")
for name, pick in groups.items():
    m = np.array([pick(r) for r in rows])
    if m.any():
        print(f"| {name} | {m.sum()} | {a[m].mean():+.3f} | {b[m].mean():+.3f} | {(b[m] - a[m]).mean():+.3f} | "
              f"{np.mean(a[m] > 0):.2f} | {np.mean(b[m] > 0):.2f} |")
