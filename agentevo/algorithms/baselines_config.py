"""Configuration of the ETO and QLASS baselines (methods-spec section 5).

Every field carries its provenance tag: [S] paper summary, [P:x] public source x (ETO = Yifan-Song793/ETO
`run_eto.sh` / `construct_preference.py`; QLASS = Rafa-zy/QLASS scripts and code), [O] our choice, [I] inferred.
The paper values are for Llama-2-7B; configs/eto_twx.yaml and configs/qlass_twx.yaml set tiny-model values.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentevo.errors import ConfigError
from agentevo.options import check_fields, option


@dataclass
class ETOConfig:
    """ETO: DPO on expert-vs-agent trajectory pairs, iterated."""

    n_iters: int = option("exploration + DPO iterations [P:ETO run_eto.sh: 3]", 3, ge=1)
    explore_temperature: float = option("sampling temperature of the exploration rollouts [P:ETO 0.7]", 0.7, gt=0)
    explore_top_p: float = option("nucleus sampling of the exploration rollouts [O: off]", 1.0, gt=0, le=1)
    rejected_extra_turns: int | None = option(
        "a rejected agent trajectory is cut to the expert's length + this many turns; null = never cut "
        "[P:ETO construct_preference.py: 5 for WebShop/SciWorld, none for ALFWorld]", 5, ge=0)
    beta: float = option("DPO beta of the first iteration [P:ETO 0.1]", 0.1, gt=0)
    beta_later: float = option("DPO beta of iterations 2.. [P:ETO 0.5]", 0.5, gt=0)
    lr: float = option("DPO learning rate of the first iteration [P:ETO 1e-6]", 1e-6, gt=0)
    lr_later: float = option("DPO learning rate of iterations 2.. [P:ETO 5e-7]", 5e-7, gt=0)
    epochs: float = option("DPO epochs over the pairs of one iteration [P:ETO 3]", 3.0, gt=0)
    batch_size: int = option("pairs per optimiser step [P:ETO 32]", 32, ge=1)
    micro_batch_size: int = option("pairs per forward/backward [O; ETO uses 2 per GPU]", 2, ge=1)
    warmup_ratio: float = option("warmup fraction of the constant-with-warmup schedule [P:ETO 0.1]", 0.1, ge=0, lt=1)
    schedule: str = option("learning-rate shape after warmup: constant or cosine [P:ETO constant_with_warmup]",
                           "constant")

    def validate(self) -> None:
        if self.n_iters < 1:
            raise ConfigError(f"eto.n_iters must be >= 1 (got {self.n_iters})")
        if self.beta <= 0 or self.beta_later <= 0:
            raise ConfigError(f"eto.beta and eto.beta_later must be > 0 (got {self.beta}, {self.beta_later})")
        if self.lr <= 0 or self.lr_later <= 0:
            raise ConfigError(f"eto.lr and eto.lr_later must be > 0 (got {self.lr}, {self.lr_later})")
        if self.explore_temperature <= 0:
            raise ConfigError(
                f"eto.explore_temperature must be > 0 (got {self.explore_temperature}): exploration samples"
            )
        if not 0 < self.explore_top_p <= 1:
            raise ConfigError(f"eto.explore_top_p must be in (0, 1] (got {self.explore_top_p})")
        if self.rejected_extra_turns is not None and self.rejected_extra_turns < 0:
            raise ConfigError(f"eto.rejected_extra_turns must be >= 0 or null (got {self.rejected_extra_turns})")
        if self.epochs <= 0:
            raise ConfigError(f"eto.epochs must be > 0 (got {self.epochs})")
        if self.micro_batch_size < 1 or self.batch_size % self.micro_batch_size:
            raise ConfigError(
                f"eto.batch_size ({self.batch_size}) must be a multiple of eto.micro_batch_size "
                f"({self.micro_batch_size}) >= 1"
            )
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"eto.warmup_ratio must be in [0, 1) (got {self.warmup_ratio})")
        if self.schedule not in ("constant", "cosine"):
            raise ConfigError(f"eto.schedule must be 'constant' or 'cosine' (got {self.schedule!r})")


@dataclass
class QLASSConfig:
    """QLASS: exploration trees, a Q-network on the SFT model, Q-guided action selection."""

    # 1. exploration trees
    n_tree_tasks: int | None = option("training tasks that get a tree (null = every training task) [P:QLASS all]",
                                      None, ge=1)
    tree_tasks: str = option("which n_tree_tasks: 'first' n, or 'spread' evenly over the training list (which is "
                             "ordered by task type for ScienceWorld / ALFWorld) [O]", "first")
    max_depth: int = option("branching happens at steps 1..max_depth [P:QLASS explore script 8]", 8, ge=1)
    samples_per_depth: int = option("children per expanded node [P:QLASS explore script 2]", 2, ge=1)
    min_prune_depth: int = option(
        "a successful rollout's own nodes are expanded only when it starts at this step or deeper "
        "[P:QLASS explore script 3]", 3, ge=0)
    prune_reward: float = option("a rollout's nodes are expanded only when its reward exceeds this [P:QLASS 0.01]",
                                 0.01)
    explore_temperature: float = option("exploratory sampling temperature [P:QLASS 2.0]", 2.0, gt=0)
    explore_top_k: int = option("exploratory top-k [P:QLASS 10]", 10, ge=1)
    explore_top_p: float = option("exploratory top-p [P:QLASS 0.5]", 0.5, gt=0, le=1)
    diversity_prompt: bool = option(
        "ask for a reply different from the node's existing children when branching [P:QLASS]", True)
    expert_branches: bool = option(
        "add the expert trajectory to its task's tree and branch one rollout off each of its first "
        "max_depth-1 steps [P:QLASS explore_sft_agent.py]", True)
    # 2. Q labels
    gamma: float = option("discount of the tree Bellman backup Q(n) = r(n) + gamma max_c Q(c) [P:QLASS 0.9]",
                          0.9, ge=0, le=1)
    max_nodes_per_tree: int | None = option(
        "QNet training nodes sampled per tree (null = all) [P:QLASS construct_q_data.py upper_num 300]", 300, ge=1)
    # 3. QNet
    head_hidden: int = option("QNet MLP width: h -> head_hidden -> head_hidden -> 1 [P:QLASS 1024]", 1024, ge=1)
    loss_tokens: str = option(
        "tokens regressed to the node label: 'all' (every token of the sequence) or 'reply' (the node's reply) "
        "[P:QLASS all]", "all")
    lr: float = option("QNet learning rate [P:QLASS 2e-5]", 2e-5, gt=0)
    epochs: float = option("QNet epochs [P:QLASS 2]", 2.0, gt=0)
    batch_size: int = option("QNet nodes per optimiser step [P:QLASS 64]", 64, ge=1)
    micro_batch_size: int = option("QNet nodes per forward/backward [O]", 8, ge=1)
    warmup_ratio: float = option("QNet warmup fraction (then cosine) [P:QLASS 0.03]", 0.03, ge=0, lt=1)
    # 4. Q-guided inference
    n_candidates: int = option("candidate actions per step at inference [P:QLASS eval script best_of_N 2]", 2, ge=1)
    candidate_temperature: float = option("sampling temperature of the candidates [P:QLASS sglang config 0.7]",
                                          0.7, gt=0)
    terminal_uses_reward: bool = option(
        "a candidate that ends the episode is valued by the env reward instead of the QNet "
        "[P:QLASS q_guided_inference.py]", True)

    def validate(self) -> None:
        check_fields(self, "qlass")  # single-field ranges, from the fields' option(ge=..., gt=...) bounds
        if self.tree_tasks not in ("first", "spread"):
            raise ConfigError(f"qlass.tree_tasks must be 'first' or 'spread' (got {self.tree_tasks!r})")
        if self.loss_tokens not in ("all", "reply"):
            raise ConfigError(f"qlass.loss_tokens must be 'all' or 'reply' (got {self.loss_tokens!r})")
        if self.head_hidden < 1 or self.lr <= 0 or self.epochs <= 0:
            raise ConfigError("qlass.head_hidden, qlass.lr and qlass.epochs must be > 0")
        if self.micro_batch_size < 1 or self.batch_size % self.micro_batch_size:
            raise ConfigError(
                f"qlass.batch_size ({self.batch_size}) must be a multiple of qlass.micro_batch_size "
                f"({self.micro_batch_size}) >= 1"
            )
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"qlass.warmup_ratio must be in [0, 1) (got {self.warmup_ratio})")
        if self.n_candidates < 1:
            raise ConfigError(f"qlass.n_candidates must be >= 1 (got {self.n_candidates})")
