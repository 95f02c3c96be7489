"""Episode metrics: success rate, average reward, steps, and format / invalid / repeat rates."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentevo.data.types import Trajectory


def eval_collection(label: str, split: str) -> str:
    """The experience-store collection of one evaluation: eval/<policy label>/<split>."""
    return f"eval/{label}/{split}"


def summarize(trajs: list[Trajectory]) -> dict[str, Any]:
    """Aggregate metrics over trajectories (rates are per step for the signals, per episode otherwise)."""
    n = len(trajs)
    if n == 0:
        return {"n": 0}
    steps = [s for t in trajs for s in t.steps]
    n_steps = max(1, len(steps))
    return {
        "n": n,
        "success_rate": sum(t.success for t in trajs) / n,
        "avg_reward": sum(t.final_reward for t in trajs) / n,
        "mean_steps": len(steps) / n,
        "format_error_rate": sum(s.signal == "format" for s in steps) / n_steps,
        "invalid_rate": sum(s.signal == "invalid" for s in steps) / n_steps,
        "repeat_rate": sum(s.signal == "repeat" for s in steps) / n_steps,
        "env_steps": sum(1 for s in steps if s.parsed_action is not None),
    }


def auc(scores: Sequence[float], positive: Sequence[bool]) -> float | None:
    """ROC AUC of scores for the positive class (Mann-Whitney, ties count 1/2); None without both classes."""
    pos = [s for s, p in zip(scores, positive, strict=True) if p]
    neg = [s for s, p in zip(scores, positive, strict=True) if not p]
    if not pos or not neg:
        return None
    wins = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg)
    return wins / (len(pos) * len(neg))
