"""Which actions a Q-Evolve round made more frequent where they are invalid, and what credit they got in training.
For each action that the round-1 policy takes invalidly more often than BC on the held-out games: the episodes with
it before / after, and the mean (and summed) round-1 advantage of its valid and invalid uses in the training data
(labels/round-1.json). A per-state advantage that is right (valid uses up, invalid uses down) still raises an action
everywhere when the policy cannot tell the states apart.
Usage (repository root): python docs/studies/qevolve_cookingworld_powered/scripts/action_credit.py runs/qe-s0 ..."""
import json
import sys
from collections import Counter, defaultdict

from agentevo.data.store import ExperienceStore


def action(step) -> str:  # noqa: ANN001
    return step.action_text.split("Action:")[-1].strip()


def invalid_uses(store: ExperienceStore, collection: str) -> tuple[Counter, Counter]:
    steps, episodes = Counter(), Counter()
    for t in store.load(collection=collection):
        seen = {action(s) for s in t.steps if s.signal == "invalid"}
        steps.update(action(s) for s in t.steps if s.signal == "invalid")
        episodes.update(seen)
    return steps, episodes


for run in sys.argv[1:]:
    store = ExperienceStore(f"{run}/experience.db")
    before, ep_before = invalid_uses(store, "eval/bc/test")
    after, ep_after = invalid_uses(store, "eval/round-1/test")
    labels = json.load(open(f"{run}/labels/round-1.json"))
    by_key = {int(t.meta["store_id"]): t for c in ("expert", "round-1/self") for t in store.load(collection=c)}
    credit: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for k, adv in zip(labels["keys"], labels["adv"], strict=True):
        t = by_key[k]
        for s, a in zip(t.steps, adv, strict=True):
            credit[(action(s), t.source, "invalid" if s.signal == "invalid" else "valid")].append(a)
    print(run, f"held-out invalid steps {sum(before.values())} -> {sum(after.values())}")
    for act, n in (after - before).most_common(3):
        parts = []
        for src in ("expert", "self"):
            for kind in ("valid", "invalid"):
                xs = credit.get((act, src, kind), [])
                if xs:
                    parts.append(f"{src} {kind} n={len(xs)} mean A {sum(xs) / len(xs):+.2f} (sum {sum(xs):+.0f})")
        print(f"  {act!r}: invalid steps {before[act]} -> {after[act]} (+{n}), episodes {ep_before[act]} -> "
              f"{ep_after[act]}; round-1 advantages: {'; '.join(parts)}")
