"""Configuration of the ETO and QLASS baselines (methods-spec section 5)."""

from __future__ import annotations

from dataclasses import dataclass

from agentevo.errors import ConfigError
from agentevo.options import option


@dataclass
class ETOConfig:
    """ETO: DPO on expert-vs-agent trajectory pairs, iterated."""

    n_iters: int = option("exploration + DPO iterations [P:ETO script: 3]", 3)
    beta: float = option("DPO beta of the first iteration [P:ETO 0.1]", 0.1)

    def validate(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"eto.beta must be > 0 (got {self.beta})")


@dataclass
class QLASSConfig:
    """QLASS: exploration trees, a Q-network on the SFT model, Q-guided action selection."""

    max_depth: int = option("exploration tree depth [P:QLASS 8]", 8)
    n_candidates: int = option("candidate actions per step at inference [P:QLASS script 2]", 2)

    def validate(self) -> None:
        if self.n_candidates < 1:
            raise ConfigError(f"qlass.n_candidates must be >= 1 (got {self.n_candidates})")
