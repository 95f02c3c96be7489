"""Self-Guide configuration (methods-spec section 3; the method section is not public, hence mostly [I]/[O]).

Every field carries its provenance tag: [S] paper, [P:x] public source, [O] our choice, [I] inferred. The GRPO
settings Self-Guide trains with are `grpo.*` (agentevo/algorithms/grpo/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from agentevo.errors import ConfigError
from agentevo.options import check_choice, option

GUIDE_MODES = ("none", "infer_only", "train")  # spec's "off" is "none": YAML 1.1 reads a bare off as false
SCHEDULES = ("staged", "constant", "none")
HISTORY_GUIDES = ("staged", "none", "last", "all")
GUIDE_TOKENS_ADV = ("env", "combined")
INT_NORMS = ("group", "step", "none")
GUIDE_POSITIONS = ("before", "after")
DEMO_VERDICTS = ("oracle", "self")


@dataclass
class SelfGuideConfig:
    """Self-Guide on top of GRPO (methods-spec section 3; the method section is not public, hence mostly [I]/[O])."""

    guide: str = option(
        "'none' (the spec's off): no guide line (env-only GRPO from the same demos); 'infer_only': guide-BC warm "
        "start and evaluation, no RL; 'train': Self-Guide + GRPO [I]", "train")
    lambda_max: float = option("maximum trust weight of the internal advantage [O: 0.5]", 0.5, ge=0)
    schedule: str = option("trust schedule of lambda: staged | constant (lambda_max from update 1) | none (lambda=0) [I]",
                           "staged")
    breakpoints: tuple[float, float] = option("stage breakpoints as fractions of the updates [O: 20% / 50%]",
                                              (0.2, 0.5), ge=0, le=1)
    gamma_int: float = option("discount of the internal return-to-go [O: 0.95]", 0.95, ge=0, le=1)
    int_norm: str = option("normalisation of the internal return: group (over all steps of the group) | step (over "
                           "the group's episodes at the same step index, so an agent that always says 'good' gets "
                           "zero) | none [I]", "group")
    guide_tokens_adv: str = option("advantage of the guide tokens: env (outcome only) | combined (hacking ablation) [I]",
                                   "env")
    history_guides: str = option(
        "past guides kept in the prompt's history: staged (I: none, II: last one, III: all) | none | last | all [I]",
        "staged")
    guide_position: str = option("'before' the Thought (steers the action) | 'after' the Action (reward without "
                                 "conditioning ablation) [I]", "before")
    guide_max_tokens: int = option("tokens added to agent.max_new_tokens for the guide line [O: 64]", 64, ge=1)
    demo_detour_prob: float = option(
        "guide-BC stand-in: probability that a demo step is replaced by a scripted detour (invalid or idle action) "
        "so demos show 'bad' verdicts; detour replies are not trained on [O]", 0.15, ge=0, lt=1)
    demo_verdicts: str = option(
        "who judges the guide-BC demos' steps: oracle (the environment's score change) [O] or self (the pretrained "
        "model itself, before any training: of the three verdict lines it picks the one it finds most likely after "
        "the episode so far; needs model.path) [I: the paper's agent writes its own assessment]", "oracle")

    def validate(self) -> None:
        check_choice("selfguide", "guide", self.guide, GUIDE_MODES)
        check_choice("selfguide", "schedule", self.schedule, SCHEDULES)
        check_choice("selfguide", "int_norm", self.int_norm, INT_NORMS)
        check_choice("selfguide", "guide_tokens_adv", self.guide_tokens_adv, GUIDE_TOKENS_ADV)
        check_choice("selfguide", "history_guides", self.history_guides, HISTORY_GUIDES)
        check_choice("selfguide", "guide_position", self.guide_position, GUIDE_POSITIONS)
        check_choice("selfguide", "demo_verdicts", self.demo_verdicts, DEMO_VERDICTS)
        if self.lambda_max < 0:
            raise ConfigError(f"selfguide.lambda_max must be >= 0 (got {self.lambda_max})")
        lo, hi = self.breakpoints
        if not 0 <= lo <= hi <= 1:
            raise ConfigError(f"selfguide.breakpoints must satisfy 0 <= lo <= hi <= 1 (got {self.breakpoints})")
        if not 0 <= self.gamma_int <= 1:
            raise ConfigError(f"selfguide.gamma_int must be in [0, 1] (got {self.gamma_int})")
        if self.guide_max_tokens < 1:
            raise ConfigError(f"selfguide.guide_max_tokens must be >= 1 (got {self.guide_max_tokens})")
        if not 0 <= self.demo_detour_prob < 1:
            raise ConfigError(f"selfguide.demo_detour_prob must be in [0, 1) (got {self.demo_detour_prob})")
