"""Q-Evolve configuration (methods-spec section 2.2 / 2.5), plus the ETO and QLASS baselines' settings."""

from __future__ import annotations

from dataclasses import dataclass

from agentevo.errors import ConfigError
from agentevo.options import option


@dataclass
class QEvolveConfig:
    """Q-Evolve: every field carries its provenance tag from methods-spec ([S], [P:x], [O], [I])."""

    n_iters: int = option("evolving iterations K [S: ALFWorld 2, SciWorld 2, WebShop 3]", 2)
    eps_low: float = option("lower clip eps_low; must exceed eps_high [S inequality, O value]", 0.28)
    eps_high: float = option("upper clip eps_high [O]", 0.20)

    def validate(self) -> None:
        if self.eps_low <= self.eps_high:
            raise ConfigError(
                f"qevolve.eps_low ({self.eps_low}) must be greater than qevolve.eps_high ({self.eps_high}): "
                "Q-Evolve clips asymmetrically with eps_low > eps_high (methods-spec 2.3 step 5)"
            )
