"""The study's numbers from its run folders: test success per evaluation, each RSD round's teacher numbers and
Self-Guide's per-update diagnostics.

usage: python summarise.py [RUNS_DIR]   (default runs/real)
"""
import json
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/real")


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


for run in sorted(p for p in root.iterdir() if (p / "state.json").exists()):
    state = json.loads((run / "state.json").read_text())
    evals = {k[5:]: v["test"]["success_rate"] for k, v in state.items() if k.startswith("eval/") and "test" in v}
    print(f"{run.name}: test " + ", ".join(f"{k} {pct(v)}" for k, v in evals.items()))
    for key, v in state.items():
        if key.endswith("/teacher") and "separation" in v:
            upd = state.get(key.replace("teacher", "update"), {})
            print(f"  {key}: teacher {v['teacher']}, separation {v['separation']:.2f}, kl {v['kl_pre']:.3f} -> "
                  f"{upd.get('kl_post', float('nan')):.3f}, act success {pct(state[key.replace('teacher', 'act')]['success_rate'])}")
        if key.startswith("update-"):
            shown = {x: round(v[x], 3) for x in ("lambda", "verdict_auc_progress", "guide_agreement", "kl",
                                                  "zero_var_frac") if v.get(x) is not None}
            print(f"  {key}: {shown}")
    if "expert-guided" in state and "self_verdicts" in state["expert-guided"]:
        e = state["expert-guided"]
        # runs before self_verdict_oracle_steps counted agreement over every demo step
        judged = (f" (over {e['self_verdict_oracle_steps']} steps the score judged)"
                  if "self_verdict_oracle_steps" in e else "")
        print(f"  demos: self verdicts {e['self_verdicts']}, agree with oracle {num(e['self_verdict_oracle_agreement'])}"
              f"{judged}, AUC progress {num(e['verdict_auc_progress'])}")
    if "round-1/sample" in state or any(k.startswith("bon") for k in state):
        print("  " + ", ".join(f"{k}: {v}" for k, v in state.items() if k.startswith(("bon", "round-1/s"))))
