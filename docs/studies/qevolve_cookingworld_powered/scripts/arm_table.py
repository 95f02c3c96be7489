"""One row per run of the qe200 study (configs/study/qevolve_cookingworld.study.yaml): held-out success and
invalid-action and format-error rates of its BC start and of its last evaluation, and the premise rows each report prints
(critic ranking, flagged-step credit, progress AUC of the advantages, whether the update followed them, KL).

    python docs/studies/qevolve_cookingworld_powered/scripts/arm_table.py [RUN_OR_ARCHIVE_FOLDER ...]

Without arguments it reads the study's archives (docs/studies/qevolve_cookingworld_powered/runs/qe200-*).
Reads each folder's state.json only; prints a markdown table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def last_eval(state: dict) -> tuple[str, dict] | tuple[None, None]:
    """The last evaluation phase after BC (eval/round-1, eval/eto-iter-3, eval/grpo-update-12, ...)."""
    evals = [k for k in state if k.startswith("eval/") and k not in ("eval/init", "eval/bc")]
    return (evals[-1], state[evals[-1]]["test"]) if evals else (None, None)


def fmt(x: float | None, pct: bool = False) -> str:
    if x is None:
        return ""
    return f"{100 * x:.1f}" if pct else f"{x:.2f}"


def row(folder: Path) -> str:
    state = json.loads((folder / "state.json").read_text())
    bc = state.get("eval/bc", {}).get("test", {})
    phase, end = last_eval(state)
    critic = state.get("round-1/critic", {}).get("diag", {})
    adv = state.get("round-1/advantages", {}).get("diag", {})
    pol = state.get("round-1/policy", {})
    follow = pol.get("diag", {}) if isinstance(pol.get("diag"), dict) else {}
    reused = "yes" if "imported_from" in state.get("round-1/critic", {}) else ""
    cells = [
        folder.name, fmt(bc.get("success_rate"), True), fmt((end or {}).get("success_rate"), True), phase or "",
        f"{fmt(bc.get('invalid_rate'), True)} -> {fmt((end or {}).get('invalid_rate'), True)}",
        f"{fmt(bc.get('format_error_rate'), True)} -> {fmt((end or {}).get('format_error_rate'), True)}",
        fmt(critic.get("auc_v_states")), reused,
        fmt(adv["flagged_adv"] - adv["unflagged_adv"]) if "flagged_adv" in adv else "",
        fmt(adv.get("progress_auc")), fmt(follow.get("follow_auc")), fmt(pol.get("kl_ref")),
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str]) -> None:
    folders = [Path(a) for a in argv] or sorted((HERE / "runs").glob("qe200-*"))
    print("| run | BC | end | end phase | invalid actions, BC -> end | format errors, BC -> end "
          "| critic AUC V(s_t) same step | critic reused | flagged - other A | progress AUC of A | update follows A "
          "| KL to BC |")
    print("|---" * 12 + "|")
    for f in folders:
        if (f / "state.json").exists():
            print(row(f))


if __name__ == "__main__":
    main(sys.argv[1:])
