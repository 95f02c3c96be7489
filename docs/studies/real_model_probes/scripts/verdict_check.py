"""On probe-guide the right verdict on the last press is in the observation ("Correct." / "Wrong button."). Per
collection of a Self-Guide run: how often the agent's verdict says bad after a wrong press and good after a right one.
`right` is every step that was not a wrong press, invalid actions and format errors included (as in every number the
study quotes); `after invalid` breaks down the verdicts that followed an invalid action or a format error (a subset of
`right`, where the light did not move): good / neutral / bad / no verdict.
Usage (repository root): python docs/studies/real_model_probes/scripts/verdict_check.py runs/real/sg6-self-s0"""
import sys

from agentevo.algorithms.selfguide.recipe import parse_guide
from agentevo.data.store import ExperienceStore

st = ExperienceStore(f"{sys.argv[1]}/experience.db")
for c in sorted(st.collections(), key=lambda c: (len(c), c)):
    if not (c.startswith("update-") or c.startswith("eval/")):
        continue
    n = {"wrong": [0, 0], "right": [0, 0]}
    invalid = {"good": 0, "neutral": 0, "bad": 0, "none": 0}
    for t in st.load(collection=c):
        for prev, s in zip(t.steps, t.steps[1:], strict=False):
            v = parse_guide(s.action_text)[1]
            kind = "wrong" if prev.next_obs.startswith("Wrong button") else "right"
            n[kind][0] += 1
            n[kind][1] += (v == -1) if kind == "wrong" else (v == 1)
            if prev.signal in ("invalid", "format"):
                invalid[{1: "good", 0: "neutral", -1: "bad", None: "none"}[v]] += 1
    counts = {k: f"{b}/{a}" for k, (a, b) in n.items()}
    if sum(invalid.values()):
        counts["after invalid"] = " ".join(f"{k} {v}" for k, v in invalid.items())
    print(c, counts)
