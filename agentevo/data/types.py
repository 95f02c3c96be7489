"""Step and Trajectory: what one episode leaves behind, with the policy's own token ids and log-probs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from agentevo.envs.base import Task


@dataclass
class Step:
    """One agent turn: what the agent saw, what it produced (tokens and log-probs), and what happened."""

    t: int  # 1-based step index
    obs: str  # o_t, what the agent saw before acting
    action_text: str  # the whole assistant message ("Thought: ...\nAction: ...")
    action_ids: list[int]  # token ids of the assistant message as the policy produced them
    logprobs: list[float] | None  # behaviour log-probs of action_ids (None for expert / scripted steps)
    parsed_action: str | None  # None means a format error
    next_obs: str  # o_{t+1}
    reward: float  # env reward after this action (score change)
    done: bool
    score: float = 0.0  # the env's normalised score after this action
    signal: str = "none"  # format / invalid / repeat / none (Q-Evolve's retrospective label source)
    info: dict[str, Any] = field(default_factory=dict)  # method fields: aux reward, guide text/verdict, ...

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return asdict(self)


@dataclass
class Trajectory:
    """A finished episode: task, who acted, every step, and the outcome."""

    task: Task
    source: str  # "expert" | "self" | "gold" | ...
    policy_id: str  # which checkpoint acted (needed for old-policy ratios)
    instruction: str
    steps: list[Step]
    final_reward: float
    success: bool
    goal: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def length(self) -> int:
        """Number of agent turns."""
        return len(self.steps)

    @property
    def first_obs(self) -> str:
        """The reset observation (o_1)."""
        return self.steps[0].obs if self.steps else ""


def final_reward(scores: list[float], mode: str) -> float:
    """Trajectory reward from the score after each step: the last one, or the highest one ('max')."""
    if not scores:
        return 0.0
    if mode == "max":
        return max(0.0, max(scores))
    if mode == "last":
        return scores[-1]
    raise ValueError(f"final_reward_mode must be 'last' or 'max', got {mode!r}")
