"""The premise table of the BoN + SFT study, from run folders' stored episodes (round 1 predates diag/bon_sft).

Usage: python docs/studies/bon_sft_cookingworld/scripts/premise_numbers.py runs/bon2-s0 runs/bon2-s1 ...
"""
import json
import sys

from agentevo.algorithms.rsd.bon_sft import bon_premise_numbers, round_names
from agentevo.data.store import ExperienceStore

for run in sys.argv[1:]:
    store = ExperienceStore(f"{run}/experience.db")
    demo_ids = {t.task.task_id for t in store.load(collection="expert")}
    for r in (1, 2):
        samples = store.load(collection=round_names(r)[1])
        if not samples:
            continue
        new_tasks = {t.task.task_id for t in samples} - demo_ids
        solved_new = {t.task.task_id for t in samples if t.success} & new_tasks
        print(json.dumps({"run": run, "round": r, **bon_premise_numbers(samples, demo_ids),
                          "pass_at_n_new_tasks": len(solved_new) / max(1, len(new_tasks)),
                          "per_episode_success": sum(t.success for t in samples) / len(samples)}))
    store.close()
