"""RSD configuration (methods-spec section 4.2 / 4.7)."""

from __future__ import annotations

from dataclasses import dataclass

from agentevo.errors import ConfigError
from agentevo.options import option


@dataclass
class RSDConfig:
    """RSD: every field carries its provenance tag from methods-spec ([S], [P:x], [O], [I])."""

    rounds: int = option("rounds R [S: 10]", 10)
    topk: int = option("teacher top-k tokens kept for the forward KL [S: 20]", 20)

    def validate(self) -> None:
        if self.topk < 1:
            raise ConfigError(f"rsd.topk must be >= 1 (got {self.topk}); the paper uses 20")
