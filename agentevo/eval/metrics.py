"""Episode metrics: success rate, average reward, steps, and format / invalid / repeat rates."""

from __future__ import annotations

from typing import Any

from agentevo.data.types import Trajectory


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
