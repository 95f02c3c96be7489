"""Where a probe-guide policy errs: per collection of a run (rollouts of each update, each evaluation), the rate of
wrong presses at each light of the row and the success rate. With noise_at=random the demos err anywhere, so a
method that only reads the outcome must find the wrong light by itself; this shows which lights it fixed.
Usage (repository root): python docs/studies/real_model_probes/scripts/light_errors.py runs/real/sg6r-const-s0 [...]"""
import sys

from agentevo.data.store import ExperienceStore


def light_rates(trajs: list) -> tuple[list[str], float, int]:
    wrong: dict[int, list[int]] = {}
    for t in trajs:
        light = 0
        for s in t.steps:
            verdict = s.next_obs.split(".")[0]
            if verdict not in ("Correct", "Wrong button"):
                continue  # an invalid action: the light does not move
            wrong.setdefault(light, [0, 0])
            wrong[light][0] += 1
            wrong[light][1] += verdict == "Wrong button"
            light += 1
    rates = [f"{100 * b / a:4.1f}" for _, (a, b) in sorted(wrong.items())]
    success = sum(bool(t.success) for t in trajs) / max(len(trajs), 1)
    return rates, success, len(trajs)


for run in sys.argv[1:]:
    print(run)
    st = ExperienceStore(f"{run}/experience.db")
    for c in sorted(st.collections(), key=lambda c: (not c.startswith("eval"), len(c), c)):
        if not (c.startswith("update-") or c.startswith("eval/")):
            continue
        rates, success, n = light_rates(st.load(collection=c))
        print(f"  {c:28s} n={n:4d} success {100 * success:5.1f}%  wrong % per light: {' '.join(rates)}")
