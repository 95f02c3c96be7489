"""Q-Evolve configuration (methods-spec section 2.2 / 2.5), plus the ETO and QLASS baselines' settings."""

from __future__ import annotations

from dataclasses import dataclass

from agentevo.errors import ConfigError
from agentevo.options import check_choice, check_fields, option

PR_CHOICES = ("gae", "q_minus_v", "td", "gae_aux")
PI_CHOICES = ("bppo", "awr", "none")
CRITIC_ARCHS = ("lasttoken", "each_token", "separate_encoder")
CRITIC_INITS = ("policy", "bc", "prev_critic")
BUFFERS = ("refresh", "accumulate")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass
class QEvolveConfig:
    """Q-Evolve: every field carries its provenance tag from methods-spec ([S], [P:x], [O], [I])."""

    # -- the loop (2.3 steps 1, 6)
    n_iters: int = option("evolving iterations K [S: ALFWorld 2, SciWorld 2, WebShop 3]", 2, ge=1)
    round1_data_from: str | None = option(
        "a run folder whose round-1 self-collected data this run reuses: ablations that differ only after collection "
        "(rr, wiql, pr, pi, ...) then train on the same D_self; seed, pi_BC and collection settings must match [O]",
        None)
    round1_critic_from: str | None = option(
        "a run folder whose fitted round-1 critic this run reuses instead of fitting its own: ablations that differ "
        "only after the critic (pr, lam, pi, the policy update) then read the same V and Q and skip the fit; every "
        "setting up to the critic and the round-1 data must match (checked), e.g. with round1_data_from [O]", None)
    n_self_per_task: int = option("self-collected trajectories per training task N_self [S '33 per task', meaning §8]",
                                  33, ge=1)
    tasks_per_round: int | None = option(
        "training tasks a round collects D_self on: null = every training task [S]; N = a fresh seeded draw of N "
        "per round (stratified by task type), e.g. to practise on tasks beyond the BC demos' [O]", None, ge=1)
    collect_temperature: float = option("sampling temperature for D_self [P:ETO explore cfg, O for Q-Evolve]",
                                        0.7, ge=0)
    buffer: str = option("D_self each round: 'refresh' (replace) or 'accumulate' (keep older rounds) [O]", "refresh")
    # -- step 2: retrospective reward labelling
    rr: bool = option("retrospective aux rewards in the critic reward (false = 'w/o RR') [S]", True)
    r_fmt: float = option("aux reward of a format error [O: verl-agent invalid-action coef 0.1]", -0.1)
    r_inv: float = option("aux reward of an invalid action [O]", -0.1)
    r_repeat: float = option("aux reward of a repeated observation (no progress) [O]", -0.1)
    sci_dense: bool = option("r_env = per-step score deltas instead of the terminal final reward [O]", False)
    # -- step 3: weighted-IQL critic
    wiql: bool = option("step weights w_t in the critic losses (false = plain IQL, 'w/o W-IQL') [S]", True)
    tau: float = option("IQL expectile tau [P:IQL MuJoCo 0.7; 0.9 for very sparse]", 0.7, gt=0, lt=1)
    gamma: float = option("discount for the critic and GAE [O: IQL default]", 0.99, ge=0, le=1)
    polyak: float = option("Polyak rate rho of the target Q heads per optimiser step [O: 0.05, fits the critic in "
                           "critic_steps; IQL's 0.005 leaves the targets at init for a few hundred steps, see "
                           "docs/methods/qevolve.md 'critic budget']", 0.05, ge=0, le=1)
    critic_arch: str = option("critic readout: lasttoken (implemented) | each_token | separate_encoder", "lasttoken")
    critic_init: str = option("critic backbone init: policy (pi_k) | bc (pi_BC) | prev_critic [O]", "policy")
    critic_hidden: int = option("width of the critic MLP heads hidden->W->ReLU->W->ReLU->1 [P:QLASS 1024]", 1024, ge=1)
    critic_lr: float = option("critic learning rate [P:QLASS QNet 2e-5]", 2e-5, gt=0)
    critic_steps: int = option("critic optimiser steps per round, D reshuffled each pass [O: 500, measured; see "
                               "docs/methods/qevolve.md 'critic budget']", 500, ge=1)
    critic_epochs: int | None = option("legacy budget: when set, critic epochs over D instead of critic_steps "
                                       "[P:QLASS 2; too few steps on small D]", None, ge=1)
    critic_batch_size: int = option("trajectories per critic optimiser step [P:QLASS 64]", 64, ge=1)
    critic_micro_batch_size: int = option("trajectories per critic forward/backward [O]", 8, ge=1)
    critic_grad_clip: float = option("critic gradient-norm clip (0 = off) [O]", 1.0, ge=0)
    critic_holdout: float = option("fraction of training tasks held out of critic fitting for calibration [O §2.4]",
                                   0.1, ge=0, lt=1)
    # -- step 4: process rewards
    pr: str = option("process reward: gae (r_env only) | q_minus_v ('w/o GAE') | td | gae_aux [S]", "gae")
    lam: float = option("GAE lambda [O: PPO default]", 0.95, ge=0, le=1)
    adv_norm: bool = option("normalise A over the dataset (mean/std) [P:BPPO]", True)
    # -- step 5: policy improvement
    pi: str = option("policy improvement: bppo | awr ('w/o PI + AWR') | none ('w/o PI', critic reranks) [S]", "bppo")
    eps_low: float = option("lower clip eps_low; must exceed eps_high [S inequality, O value]", 0.28, gt=0, lt=1)
    eps_high: float = option("upper clip eps_high [O]", 0.20, ge=0)
    kl_alpha: float = option("alpha of the k3 KL(pi_theta || pi_BC) penalty [O]", 0.01, ge=0)
    loss_agg: str = option("policy loss aggregation: token-mean | seq-mean-token-mean | seq-mean-token-sum [O DAPO]",
                           "token-mean")
    policy_lr: float = option("policy learning rate [O]", 1e-6, gt=0)
    policy_epochs: float = option("policy epochs over D [O]", 1.0, gt=0)
    policy_batch_size: int = option("training rows per policy optimiser step [O: 64 trajectories]", 64, ge=1)
    policy_micro_batch_size: int = option("training rows per policy forward/backward [O]", 8, ge=1)
    policy_seed: int | None = option(
        "seed of the policy update's minibatch order in round r (S + r; null: the run's seed). An arm that changes "
        "only this, reusing the round-1 data and critic, measures how far the order alone moves the result: the "
        "noise floor the ablations are read against [O]", None, ge=0)
    awr_beta: float = option("AWR temperature beta (pi=awr) [P:IQL]", 3.0, gt=0)
    awr_cap: float = option("AWR weight cap (pi=awr) [P:IQL]", 100.0, gt=0)
    # -- 'w/o PI': critic reranking at test time
    rerank_n: int = option("candidate replies the critic reranks per step when pi=none [O/I: 4]", 4, ge=1)
    rerank_temperature: float = option("sampling temperature of the reranked candidates [O]", 0.7, ge=0)

    def validate(self) -> None:
        check_fields(self, "qevolve")  # single-field ranges, from the fields' option(ge=..., gt=...) bounds
        if self.eps_low <= self.eps_high:
            raise ConfigError(
                f"qevolve.eps_low ({self.eps_low}) must be greater than qevolve.eps_high ({self.eps_high}): "
                "Q-Evolve clips asymmetrically with eps_low > eps_high (methods-spec 2.3 step 5)"
            )
        choices = {"pr": PR_CHOICES, "pi": PI_CHOICES, "critic_arch": CRITIC_ARCHS, "critic_init": CRITIC_INITS,
                   "buffer": BUFFERS, "loss_agg": LOSS_AGGS}
        for key, allowed in choices.items():
            check_choice("qevolve", key, getattr(self, key), allowed)
        if self.critic_arch != "lasttoken":
            raise ConfigError(
                f"qevolve.critic_arch={self.critic_arch!r} is not implemented in this version; use 'lasttoken' "
                "(V at the last token of each observation turn, Q at the last token of each reply)"
            )
        for big, small in (("critic_batch_size", "critic_micro_batch_size"),
                           ("policy_batch_size", "policy_micro_batch_size")):
            b, m = getattr(self, big), getattr(self, small)
            if m < 1 or b < m or b % m:
                raise ConfigError(f"qevolve.{big} ({b}) must be a positive multiple of qevolve.{small} ({m})")
