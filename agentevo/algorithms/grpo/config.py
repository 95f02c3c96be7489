"""GRPO / DAPO configuration (methods-spec sections 3.2 and 5).

Every field carries its provenance tag: [S] paper, [P:x] public source, [O] our choice, [I] inferred.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentevo.errors import ConfigError
from agentevo.options import check_choice, option

ALGOS = ("grpo", "dapo")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
TASK_ORDERS = ("sequential", "shuffled")
PENALTY_MODES = ("return", "step")
PENALTY_SIGNALS = ("format", "invalid", "repeat")


@dataclass
class GRPOConfig:
    """GRPO for multi-turn agents (and its DAPO variant): G trajectories per task, outcome advantages."""

    algo: str = option("'grpo' (symmetric clip) or 'dapo' (clip-higher + drop all-equal groups) [P:DAPO]", "grpo")
    n_updates: int = option("policy updates K_tot (one rollout batch each) [O]", 20, ge=1)
    tasks_per_update: int = option("training tasks per update, taken in order and cycling [O: 16]", 16, ge=1)
    task_order: str = option(
        "order the updates take training tasks in: 'sequential' (the split's order) or 'shuffled' (one seeded "
        "permutation of the whole split, so updates reach tasks the BC demos did not cover) [O]", "sequential")
    group_size: int = option("trajectories per task G [O: 8, RSD's GRPO baseline / verl-agent]", 8, ge=2)
    temperature: float = option("rollout sampling temperature [O: 1.0, verl-agent]", 1.0, gt=0)
    top_p: float = option("rollout nucleus sampling [O: 1.0]", 1.0, gt=0, le=1)
    eps_low: float = option("lower clip eps_low [P:DAPO 0.2]", 0.2, ge=0, lt=1)
    eps_high: float | None = option("upper clip eps_high; null = 0.2 for grpo, 0.28 for dapo [P:DAPO]", None, ge=0)
    drop_equal_groups: bool | None = option(
        "drop groups whose rewards are all equal (DAPO dynamic sampling, no refill); null = true for dapo only", None)
    beta_kl: float = option("weight of the k3 KL to the reference (the BC policy) [O: 0.01]", 0.01, ge=0)
    loss_agg: str = option("loss aggregation: token-mean | seq-mean-token-mean | seq-mean-token-sum [P:DAPO token-mean]",
                           "token-mean")
    lr: float = option("policy learning rate, constant [O: 1e-6 full FT of a 7B model; raise it for the tiny one]",
                       1e-6, gt=0)
    ppo_epochs: int = option("passes over each rollout batch (1 = strictly on-policy, ratio 1 at the first step) [O]",
                             1, ge=1)
    batch_size: int = option("samples (training rows) per optimiser step [O]", 16, ge=1)
    micro_batch_size: int = option("samples per forward/backward [O]", 8, ge=1)
    grad_clip: float = option("gradient-norm clip (0 = off) [O]", 1.0, ge=0)
    adv_eps: float = option("epsilon in (R - mean)/(std + eps) [O]", 1e-6, gt=0)
    invalid_penalty: float = option(
        "invalid-action penalty coefficient (0 = off) [P:verl-agent invalid_action_penalty_coef 0.1]", 0.0, ge=0)
    penalty_mode: str = option(
        "'return': subtract coef x flagged steps from R before group normalisation; 'step': subtract coef from the "
        "advantage of the flagged step only [O]", "return")
    penalty_signals: list[str] = option("step signals that count as invalid actions [O]",
                                        factory=lambda: ["format", "invalid"])
    eval_every: int = option("evaluate (greedy, eval.splits) every this many updates and after the last [O]", 5, ge=1)
    log_entropy: bool = option("log the policy's token entropy on reply tokens (a full-vocabulary pass) [O]", True)

    @property
    def clip_high(self) -> float:
        """eps_high resolved by algo."""
        if self.eps_high is not None:
            return self.eps_high
        return 0.28 if self.algo == "dapo" else 0.2

    @property
    def drop_groups(self) -> bool:
        """Whether all-equal groups are dropped, resolved by algo."""
        if self.drop_equal_groups is not None:
            return self.drop_equal_groups
        return self.algo == "dapo"

    def validate(self) -> None:
        check_choice("grpo", "algo", self.algo, ALGOS)
        check_choice("grpo", "loss_agg", self.loss_agg, LOSS_AGGS)
        check_choice("grpo", "task_order", self.task_order, TASK_ORDERS)
        check_choice("grpo", "penalty_mode", self.penalty_mode, PENALTY_MODES)
        for sig in self.penalty_signals:
            check_choice("grpo", "penalty_signals[]", sig, PENALTY_SIGNALS)
        if self.group_size < 2:
            raise ConfigError(f"grpo.group_size must be >= 2 for group-normalised advantages (got {self.group_size})")
        for name in ("n_updates", "tasks_per_update", "ppo_epochs", "eval_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"grpo.{name} must be >= 1 (got {getattr(self, name)})")
        if not 0 <= self.eps_low < 1:
            raise ConfigError(f"grpo.eps_low must be in [0, 1) (got {self.eps_low})")
        if self.clip_high < 0:
            raise ConfigError(f"grpo.eps_high must be >= 0 (got {self.eps_high})")
        if self.temperature <= 0:
            raise ConfigError(f"grpo.temperature must be > 0: GRPO needs sampled, diverse groups (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"grpo.top_p must be in (0, 1] (got {self.top_p})")
        if self.beta_kl < 0 or self.invalid_penalty < 0:
            raise ConfigError("grpo.beta_kl and grpo.invalid_penalty must be >= 0")
        if self.lr <= 0:
            raise ConfigError(f"grpo.lr must be > 0 (got {self.lr})")
        if self.micro_batch_size < 1 or self.batch_size < self.micro_batch_size or self.batch_size % self.micro_batch_size:
            raise ConfigError(
                f"grpo.batch_size ({self.batch_size}) must be a positive multiple of grpo.micro_batch_size "
                f"({self.micro_batch_size})")
