"""RSD configuration (methods-spec section 4.2 hyper-parameters, 4.7 flags, and the RSD-table baselines of §5).

Provenance tags: [S] paper summary, [P:x] public source, [O] our choice, [I] inferred.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentevo.errors import ConfigError
from agentevo.options import check_choice, option

COMPONENTS = ("prec", "lessons", "reflect", "future")
POSITIONS = ("system", "before_history", "before_current_step")
RETRIEVALS = ("content_overlap", "fts", "random")
TEACHER_MODES = ("follow_freeze", "always_follow", "fixed_init", "ema")
REFRESH_MODES = ("all", "lessons_only", "precedents_only", "frozen_round1")
KL_KINDS = ("forward", "reverse", "jsd")
WRITERS = ("rule", "policy", "http")
RULE_SEARCH = ("off", "frontier", "random")


@dataclass
class RSDConfig:
    """RSD: every field carries its provenance tag from methods-spec ([S], [P:x], [O], [I])."""

    # -- rounds (§4.2, §4.3 steps 1-2, 7) --------------------------------------------------------------
    rounds: int = option("rounds R [S: 10]", 10, ge=1)
    tasks_per_round: int = option("training tasks drawn per round, one trajectory each [S: 200]", 200, ge=1)
    rollout_temperature: float = option("sampling temperature of the acting student [O: 1.0]", 1.0, ge=0)
    lr: float = option("learning rate of the distillation update [S: 3e-6, full parameters]", 3e-6, gt=0)
    epochs: float = option("passes over the round's trajectories [S: 1]", 1.0, gt=0)
    # -- loss (§4.3 steps 5-6) -------------------------------------------------------------------------
    topk: int = option("teacher top-k tokens kept for the KL [S: 20]", 20, ge=1)
    topk_tail: bool = option("add the SDPO tail bucket 1 - sum_K p to both distributions [P:SDPO; off = OPSD renormalised]",
                             False)
    topk_from: str = option("whose top-k ids form the support: teacher [O/P:OPSD] or student (round-start student) "
                            "[P:SDPO]", "teacher")
    kl: str = option("divergence on the top-k support: forward KL(p_T||p_S) [S], reverse, or jsd (generalised JSD, "
                     "kl_beta) [P:GKD]", "forward")
    kl_beta: float = option("beta of the generalised JSD (kl=jsd) [P:GKD]", 0.5, gt=0, lt=1)
    # -- teacher schedule (§4.4) -------------------------------------------------------------------------
    teacher: str = option("teacher weights: follow_freeze [S], always_follow [S ablation], fixed_init [P:OPSD], "
                          "ema [P:OPSD]", "follow_freeze")
    ema_decay: float = option("teacher <- decay*teacher + (1-decay)*student after each round (teacher=ema) [O]",
                              0.5, ge=0, lt=1)
    metric_split: str = option("split whose greedy success is the schedule / rule metric M_r [I: validation]", "dev")
    # -- context rule (§4.3 step 4; the whitelist of §4.5) ------------------------------------------------
    components: list[str] = option("components on: prec, lessons, reflect, future [S: all four]",
                                   factory=lambda: list(COMPONENTS))
    n_prec: int = option("precedents per context [S: 2]", 2, ge=0, le=16)
    retrieval: str = option("precedent ranking: content_overlap [S], fts (SQLite BM25 rank), random [S ablation]",
                            "content_overlap")
    position: str = option("where the context goes: system, before_history, before_current_step [O]",
                           "before_history")
    teacher_temp: float = option("teacher softmax temperature [O: 1.0]", 1.0, ge=0.05, le=5)
    # -- context material (§4.3 step 3) -------------------------------------------------------------------
    match_on: str = option("text matched for precedents: goal [S] or goal_and_first_obs (envs whose goal text is "
                           "the same for every task, e.g. CookingWorld) [O]", "goal")
    prec_format: str = option("how a precedent is shown: actions (goal + action list) or full (verbatim) [O]",
                              "actions")
    lessons_from: str = option("trajectories the lesson writer reads: both [S], success, failure", "both")
    lessons_per_outcome: int = option("successes and failures sampled per task type for a lesson [O: 4]", 4, ge=1)
    refresh: str = option("what is rebuilt each round: all [S], lessons_only, precedents_only, frozen_round1", "all")
    future_max_steps: int | None = option("future-hindsight steps shown (null = all, verbatim [S])", None, ge=1)
    ctx_max_tokens: int | None = option("cap on the context's tokens, cut at the end (null = none) [O]", None, ge=1)
    writer: str = option("who writes lessons and reflections: policy (same model) [S], http (OpenAI-compatible "
                         "endpoint), rule (env signals and score changes; the tiny-model stand-in) [O]", "policy")
    writer_url: str | None = option("base URL of the OpenAI-compatible endpoint (writer=http / frontier proposer)",
                                    None)
    writer_model: str = option("model name sent to the endpoint", "gpt-4o-mini")
    writer_api_key_env: str | None = option("name of the environment variable holding the endpoint's API key", None)
    writer_max_tokens: int = option("token budget of one written lesson / reflection [O]", 256, ge=1)
    # -- rule search (§4.5) ----------------------------------------------------------------------------
    rule_search: str = option("off (fixed rule), frontier (LLM proposer behind writer_url), random [S]", "off")
    probe: bool = option("training-free probe before committing a candidate rule [S]", True)
    probe_tasks: int = option("training tasks in the probe slice, greedy [O: 32]", 32, ge=1)
    accept_margin: float = option("keep a rule if success >= best - margin, in percentage points [S: 0.5]", 0.5, ge=0)
    # -- inference / measurement (§4.6) --------------------------------------------------------------------
    infer_ctx: bool = option("also evaluate the evolved student with (pre-action) context at inference [S ablation]",
                             False)
    internalisation: bool = option("evaluate the base with context at the end (internalisation measure) [S]", True)
    premise_stop: bool = option("stop before distilling when the teacher with context is not better than the student "
                                "without it (round-1 premise check; off = warn in the report and distil anyway) [O]",
                                False)
    # -- tiny-model warm start (methods-spec §7 item 9) -----------------------------------------------------
    ctx_warm_start: bool = option("after BC, train on a mix of plain and privileged-context demos so the teacher can "
                                  "read context (tiny models only) [O]", False)
    ctx_warm_fraction: float = option("demos that also get a context-augmented copy [O]", 0.5, ge=0, le=1)
    ctx_warm_keep_plain: float = option("share of the context-augmented demos that keep their plain row too; the "
                                        "others are taught only with context, so their answers can be fitted by "
                                        "reading the context rather than by recalling the plain rows [O]",
                                        1.0, ge=0, le=1)
    ctx_warm_steps: int = option("steps per context-augmented demo (each is its own row) [O]", 3, ge=1)
    ctx_warm_epochs: float = option("epochs of the context-aware warm start [O]", 2.0, gt=0)
    ctx_warm_same_task: float = option("probability that a warm-start precedent is the demo's own task (a solved "
                                       "earlier attempt) [O]", 0.7, ge=0, le=1)
    ctx_warm_detours: float = option("share of context-augmented demos taken from a replay with scripted wasted steps "
                                     "(look, inventory, a repeated take) whose rows target the next useful action, so "
                                     "the teacher learns what the future reveals about a mistake [O]", 0.0, ge=0, le=1)
    ctx_warm_detour_prob: float = option("per-step chance of a scripted wasted step in those replays [O]",
                                         0.3, gt=0, lt=1)
    # -- RSD-table baselines (§5) ------------------------------------------------------------------------
    bon_n: int = option("BoN: samples per task [S: 16]", 16, ge=1)
    bon_rounds: int = option("BoN: rounds; round r > 1 samples with round r-1's policy and fine-tunes from the base on "
                             "every round's kept samples [O: 1]", 1, ge=1)
    bon_with_expert: bool = option("BoN: SFT on the expert demos plus the kept samples, from the base, instead of the "
                                   "kept samples alone (expert iteration / ReST: keeps what BC taught) [O: false]", False)
    bon_with_wins: bool = option("BoN: fine-tune on the kept samples; false plays no episodes and fine-tunes the base "
                                 "on the expert demos alone with the same schedule (needs bon_with_expert and one "
                                 "round): the control that says what the extra fine-tune gives without practice "
                                 "[O: true]", True)
    reflexion_attempts: int = option("Reflexion: attempts per task [S: 3]", 3, ge=1)
    gt_epochs: float | None = option("GT-SFT epochs (null = optim.epochs, the SFT recipe's) [O]", None, gt=0)

    def validate(self) -> None:
        if self.rounds < 1:
            raise ConfigError(f"rsd.rounds must be >= 1 (got {self.rounds}); the paper uses 10")
        if self.tasks_per_round < 1:
            raise ConfigError(f"rsd.tasks_per_round must be >= 1 (got {self.tasks_per_round})")
        if self.topk < 1:
            raise ConfigError(f"rsd.topk must be >= 1 (got {self.topk}); the paper uses 20")
        if self.lr <= 0 or self.epochs <= 0:
            raise ConfigError("rsd.lr and rsd.epochs must be > 0")
        if self.rollout_temperature < 0:
            raise ConfigError(f"rsd.rollout_temperature must be >= 0 (got {self.rollout_temperature})")
        check_choice("rsd", "topk_from", self.topk_from, ("teacher", "student"))
        check_choice("rsd", "kl", self.kl, KL_KINDS)
        if not 0.0 < self.kl_beta < 1.0:
            raise ConfigError(f"rsd.kl_beta must be in (0, 1) (got {self.kl_beta})")
        check_choice("rsd", "teacher", self.teacher, TEACHER_MODES)
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"rsd.ema_decay must be in [0, 1) (got {self.ema_decay})")
        check_choice("rsd", "metric_split", self.metric_split, ("train", "dev", "test"))
        for c in self.components:
            check_choice("rsd", "components", c, COMPONENTS)
        if not 0 <= self.n_prec <= 16:
            raise ConfigError(f"rsd.n_prec must be in [0, 16] (got {self.n_prec})")
        check_choice("rsd", "retrieval", self.retrieval, RETRIEVALS)
        check_choice("rsd", "position", self.position, POSITIONS)
        if not 0.05 <= self.teacher_temp <= 5.0:
            raise ConfigError(f"rsd.teacher_temp must be in [0.05, 5] (got {self.teacher_temp})")
        check_choice("rsd", "match_on", self.match_on, ("goal", "goal_and_first_obs"))
        check_choice("rsd", "prec_format", self.prec_format, ("actions", "full"))
        check_choice("rsd", "lessons_from", self.lessons_from, ("both", "success", "failure"))
        check_choice("rsd", "refresh", self.refresh, REFRESH_MODES)
        check_choice("rsd", "writer", self.writer, WRITERS)
        check_choice("rsd", "rule_search", self.rule_search, RULE_SEARCH)
        if (self.writer == "http" or self.rule_search == "frontier") and not self.writer_url:
            raise ConfigError("rsd.writer=http and rsd.rule_search=frontier need rsd.writer_url "
                              "(an OpenAI-compatible base URL such as http://localhost:8000/v1)")
        if self.probe_tasks < 1:
            raise ConfigError(f"rsd.probe_tasks must be >= 1 (got {self.probe_tasks})")
        if self.accept_margin < 0:
            raise ConfigError(f"rsd.accept_margin must be >= 0 points (got {self.accept_margin})")
        if not 0.0 <= self.ctx_warm_fraction <= 1.0 or not 0.0 <= self.ctx_warm_same_task <= 1.0 \
                or not 0.0 <= self.ctx_warm_keep_plain <= 1.0:
            raise ConfigError("rsd.ctx_warm_fraction, rsd.ctx_warm_keep_plain and rsd.ctx_warm_same_task must be in "
                              "[0, 1]")
        if not 0.0 <= self.ctx_warm_detours <= 1.0 or not 0.0 < self.ctx_warm_detour_prob < 1.0:
            raise ConfigError("rsd.ctx_warm_detours must be in [0, 1] and rsd.ctx_warm_detour_prob in (0, 1)")
        if self.ctx_warm_steps < 1 or self.ctx_warm_epochs <= 0:
            raise ConfigError("rsd.ctx_warm_steps must be >= 1 and rsd.ctx_warm_epochs > 0")
        if self.bon_n < 1 or self.reflexion_attempts < 1 or self.bon_rounds < 1:
            raise ConfigError("rsd.bon_n, rsd.bon_rounds and rsd.reflexion_attempts must be >= 1")
        if not self.bon_with_wins and (not self.bon_with_expert or self.bon_rounds != 1):
            raise ConfigError("rsd.bon_with_wins=false fine-tunes on the expert demos alone, which needs "
                              f"rsd.bon_with_expert=true (got {str(self.bon_with_expert).lower()}) and "
                              f"rsd.bon_rounds=1 (got {self.bon_rounds}): no round changes the demos")
        if self.future_max_steps is not None and self.future_max_steps < 1:
            raise ConfigError("rsd.future_max_steps must be >= 1 or null")
        if self.ctx_max_tokens is not None and self.ctx_max_tokens < 1:
            raise ConfigError("rsd.ctx_max_tokens must be >= 1 or null")
