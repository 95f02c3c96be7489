"""Paired comparison of sampled evaluations (agentevo eval ... --set eval.temperature=1.0 --set eval.samples=4):
each run folder holds one evaluation; per task the success averaged over its samples; arm minus baseline paired by
task (bootstrap interval over tasks, sign test on the tasks that differ), and the wrong-press rate per light.
Usage (repository root): python docs/studies/real_model_probes/scripts/sampled_compare.py [--pool] BASE ARM [BASE ARM ...]
--pool: also one paired result over all the pairs (rows = pairs, e.g. one per seed; the same tasks in each)."""
import sys
from collections import defaultdict

from agentevo.data.store import ExperienceStore
from agentevo.eval.stats import format_p, paired_difference


def per_task(run: str) -> tuple[dict[str, float], int, list[float]]:
    store = ExperienceStore(f"{run}/experience.db")
    (collection,) = [c for c in store.collections() if c.startswith("eval/")]
    wins: dict[str, list[float]] = defaultdict(list)
    wrong: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    trajs = store.load(collection=collection)
    for t in trajs:
        wins[t.task.task_id].append(100.0 * bool(t.success))
        light = 0
        for s in t.steps:
            verdict = s.next_obs.split(".")[0]
            if verdict in ("Correct", "Wrong button"):
                wrong[light][0] += 1
                wrong[light][1] += verdict == "Wrong button"
                light += 1
    rates = [100 * b / a for _, (a, b) in sorted(wrong.items())]
    return {k: sum(v) / len(v) for k, v in wins.items()}, len(trajs), rates


args = sys.argv[1:]
pool = "--pool" in args
args = [a for a in args if a != "--pool"]
pooled_arm: list[list[float]] = []
pooled_base: list[list[float]] = []
for base, arm in zip(args[::2], args[1::2], strict=True):
    (b, nb, rb), (a, na, ra) = per_task(base), per_task(arm)
    tasks = sorted(b)
    if sorted(a) != tasks:
        raise SystemExit(f"{base} and {arm} were evaluated on different tasks")
    r = paired_difference([[a[t] for t in tasks]], [[b[t] for t in tasks]])
    pooled_arm.append([a[t] for t in tasks])
    pooled_base.append([b[t] for t in tasks])
    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    print(f"{arm} ({na} episodes) {mean(a):.1f}% vs {base} ({nb}) {mean(b):.1f}%: {r.mean:+.1f} points "
          f"[{r.lo:+.1f}, {r.hi:+.1f}], tasks better / worse {r.wins} / {r.losses}, {format_p(r.p)}")
    print(f"  wrong % per light: {base}: {' '.join(f'{x:.1f}' for x in rb)}; {arm}: {' '.join(f'{x:.1f}' for x in ra)}")
if pool:
    r = paired_difference(pooled_arm, pooled_base)
    arm_mean = sum(map(sum, pooled_arm)) / sum(map(len, pooled_arm))
    base_mean = sum(map(sum, pooled_base)) / sum(map(len, pooled_base))
    print(f"pooled over {r.n_pairs} pairs x {r.n_tasks} tasks: {arm_mean:.1f}% vs {base_mean:.1f}%: {r.mean:+.1f} points "
          f"[{r.lo:+.1f}, {r.hi:+.1f}], task-pairs better / worse {r.wins} / {r.losses}, {format_p(r.p)}")
