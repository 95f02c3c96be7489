"""GRPO and Self-Guide configuration (methods-spec sections 3.2-3.4 and 5)."""

from __future__ import annotations

from dataclasses import dataclass

from agentevo.errors import ConfigError
from agentevo.options import option


@dataclass
class GRPOConfig:
    """GRPO for multi-turn agents (and its DAPO variant)."""

    group_size: int = option("trajectories per task G [O: 8]", 8)
    eps_low: float = option("lower clip [P:DAPO 0.2]", 0.2)
    eps_high: float = option("upper clip [GRPO 0.2; DAPO 0.28]", 0.2)

    def validate(self) -> None:
        if self.group_size < 2:
            raise ConfigError(f"grpo.group_size must be >= 2 for group-normalised advantages (got {self.group_size})")


@dataclass
class SelfGuideConfig:
    """Self-Guide on top of GRPO."""

    lambda_max: float = option("maximum trust weight of the internal advantage [O: 0.5]", 0.5)

    def validate(self) -> None:
        if self.lambda_max < 0:
            raise ConfigError(f"selfguide.lambda_max must be >= 0 (got {self.lambda_max})")
