"""RSD on probe-hindsight: at the colour token of each round-r student reply, is the teacher's top-1 the password
(read from the round's saved top-k cache)? Chance is 25%.

usage: python teacher_top1.py RUN_DIR ROUND
"""
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from agentevo.algorithms.rsd.recipe import TeacherCache
from agentevo.data.store import ExperienceStore
from agentevo.envs.probes import COLOURS, vault_password

run, r = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1
tok = AutoTokenizer.from_pretrained(run / "checkpoints/bc")
cache = TeacherCache.load(run / f"rsd/round-{r}/teacher_topk.pt")
store = ExperienceStore(run / "experience.db")
trajs = store.load(collection=f"round-{r}/act")
n = top_pw = pw_in = stud_top = 0
for i, t in enumerate(trajs):
    s = t.steps[0]
    pw = vault_password(t.task.params["vault"])
    if (i, 1) not in cache.offsets:
        continue
    a, m = cache.offsets[(i, 1)]
    ids, logp = cache.topk_rows(torch.arange(a, a + m))
    pieces = [tok.decode([x]) for x in s.action_ids[:m]]
    pos = next((j for j, p in enumerate(pieces) if p.strip() in COLOURS), None)
    if pos is None:
        continue
    n += 1
    top = tok.decode([int(ids[pos, 0])]).strip()
    top_pw += top == pw
    stud_top += top == pieces[pos].strip()
    pw_in += pw in {tok.decode([int(x)]).strip() for x in ids[pos]}
print(f"{run.name} round {r}: {n} replies; teacher top-1 = password {top_pw / n:.2f}; = student's colour {stud_top / n:.2f}; "
      f"password in top-k {pw_in / n:.2f}")
