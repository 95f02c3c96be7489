"""Q-Evolve: self-evolving agents with in-distribution optimisation (methods-spec §2, arXiv 2606.07367).

    0. BC warm start: pi_0 := pi_BC (warm_start).
    for round r = 1..K (the paper's k = r − 1):
    1. hybrid data: roll pi_{r-1} (T=0.7) n_self_per_task times on every training task (or a draw of
       tasks_per_round) -> D_self;
       D = D_expert ∪ D_self (refresh: this round's D_self; accumulate: every round's).
    2. retrospective labels: r_aux_t from the step's signal (format > invalid > repeat > none).
    3. weighted-IQL critic on D: V step (expectile vs min target Q) -> Q step (Bellman with r_env + r_aux)
       -> Polyak on the target heads; w_t = 0.5(t/T + d) + 0.5. (round1_critic_from: reuse a run's round-1
       critic fitted with the same settings on the same D, for ablations that differ only after it.)
    4. process rewards: GAE with r_env only (or q_minus_v / td / gae_aux), normalised over D.
    5. policy improvement on the same D: clipped ratio against pi_old = pi_{r-1} with eps_low > eps_high,
       + alpha * k3 KL to pi_BC, token-mean (or AWR; or none: the critic reranks candidates at test time).
    6. evaluate pi_r greedily (eval/round-r); pi_r collects the next round's data.

Every step is a resumable phase (round-r/collect, round-r/label, round-r/critic, round-r/advantages,
round-r/policy, eval/round-r); models live in checkpoints/round-r (policy) and checkpoints/round-r-critic.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentevo.agent.prompt import build_messages
from agentevo.algorithms import advantages as adv_math
from agentevo.algorithms import losses
from agentevo.algorithms.bc import ensure_reply_ids, warm_start
from agentevo.algorithms.qevolve.config import QEvolveConfig
from agentevo.config import with_defaults
from agentevo.data.store import ExperienceStore
from agentevo.data.tensors import StepSample, collate, forward_logits, reply_logprobs, trajectory_samples
from agentevo.data.types import Trajectory
from agentevo.envs.base import SIGNAL_NONE, SIGNALS
from agentevo.errors import ConfigError
from agentevo.eval import diagnostics
from agentevo.eval.metrics import auc, auc_same_step, summarize
from agentevo.files import replacing_dir, write_text_atomic
from agentevo.models.backend import Generation, Sampling, TransformersPolicy, load_pretrained
from agentevo.models.critic import (
    Critic,
    CriticFit,
    CriticItem,
    add_critic_adapter,
    critic_rows,
    critic_values,
    fit_critic,
    load_critic_weights,
    save_critic,
)
from agentevo.models.policy import with_lora
from agentevo.rollout.engine import EpisodeRequest, PolicyActor
from agentevo.train.finetune import finetune
from agentevo.train.tracking import MetricsLogger

if TYPE_CHECKING:
    from agentevo.envs.base import TaskList
    from agentevo.run import Run


def run(run: Run) -> dict[str, Any]:
    """The Q-Evolve recipe end to end; returns every phase's result (evaluation tables under eval/...)."""
    results = warm_start(run)  # step 0: expert demos -> pi_BC (checkpoints/bc)
    for r in range(1, run.cfg.qevolve.n_iters + 1):
        results.update(evolve_round(run, r))
    results["plots"] = plot_rounds(run)
    return results


def evolve_round(run: Run, r: int) -> dict[str, Any]:
    """One evolving iteration (steps 1-6), each step a resumable phase."""
    cache: dict[str, Any] = {}  # models built in this process, reused by the next phase of the round
    out: dict[str, Any] = {}
    out[f"round-{r}/collect"] = run.phase(f"round-{r}/collect", lambda: collect_self(run, r))  # step 1
    data = hybrid_dataset(run, r)
    out[f"round-{r}/label"] = run.phase(f"round-{r}/label", lambda: data_stats(run, r, data))  # step 2
    out[f"round-{r}/critic"] = run.phase(f"round-{r}/critic", lambda: train_critic(run, r, data, cache))  # step 3
    out[f"round-{r}/advantages"] = run.phase(
        f"round-{r}/advantages", lambda: compute_advantages(run, r, data, cache)
    )  # step 4
    out[f"round-{r}/policy"] = run.phase(f"round-{r}/policy", lambda: improve_policy(run, r, data), all_ranks=True)  # step 5
    out[f"eval/round-{r}"] = run.phase(f"eval/round-{r}", lambda: evaluate_round(run, r))  # step 6
    return out


# ---------------------------------------------------------------------------------------------------------------
# Policies


def policy_name(q: QEvolveConfig, r: int) -> str:
    """Checkpoint name of pi_r (pi_0 = BC; with pi=none the policy is never updated)."""
    return "bc" if r == 0 or q.pi == "none" else f"round-{r}"


def _lora_config(model: Any, cfg: Any) -> Any:
    from peft import LoraConfig

    lora = cfg.model.lora
    present = {name.split(".")[-1] for name, _ in model.named_modules()}
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=[m for m in lora.target_modules if m in present], task_type="CAUSAL_LM")


def load_round_policy(run: Run, r: int) -> TransformersPolicy:
    """pi_r. With LoRA: the BC model as a frozen base plus the policy adapter "default" (fresh for pi_0)."""
    cfg = run.cfg
    name = policy_name(cfg.qevolve, r)
    if not cfg.model.lora.enabled:
        return run.load_policy(name)
    policy = run.load_policy("bc", policy_id=name)
    if name == "bc":
        with_lora(policy, cfg)  # LoRA B = 0: the same function as pi_BC
    else:
        from peft import PeftModel

        policy.model = PeftModel.from_pretrained(policy.model, run.checkpoint_dir(name), is_trainable=True)
    return policy


def acting_policy(run: Run, r: int) -> Any:
    """pi_r for collection and evaluation on model.backend. With LoRA, pi_r is an adapter on pi_BC: served by vLLM
    on the BC weights when model.vllm.enable_lora, else acted by transformers (an HTTP server cannot take it)."""
    cfg = run.cfg
    name = policy_name(cfg.qevolve, r)
    if not cfg.model.lora.enabled:
        return run.rollout_policy(name)
    if cfg.model.backend == "vllm" and cfg.model.vllm.enable_lora:
        return run.rollout_policy("bc") if name == "bc" else run.rollout_adapter("bc", run.checkpoint_dir(name), name)
    return load_round_policy(run, r)


# ---------------------------------------------------------------------------------------------------------------
# Step 1: hybrid data


def collect_self(run: Run, r: int) -> dict[str, Any]:
    """Roll pi_{r-1} at the collection temperature, n_self_per_task times per training task, into round-r/self."""
    cfg, q = run.cfg, run.cfg.qevolve
    if r == 1 and q.round1_data_from:
        return import_round1_data(run, Path(q.round1_data_from))
    policy = acting_policy(run, r - 1)
    tasks = self_tasks(run, r)
    sampling = Sampling(q.collect_temperature, cfg.rollout.top_p, cfg.agent.max_new_tokens, seed=cfg.seed * 7919 + r)
    actor = PolicyActor(policy, run.signal_env.instruction(), cfg.agent.history_window, sampling)
    requests = [
        EpisodeRequest(task, i * q.n_self_per_task + j, meta={"round": r})
        for i, task in enumerate(tasks)
        for j in range(q.n_self_per_task)
    ]
    trajs = run.collect(actor, requests, f"round-{r}/self", f"round {r}: collect with {policy.policy_id}")
    return {"policy": policy.policy_id, "task_hash": tasks.hash, **summarize(trajs)}


def self_tasks(run: Run, r: int) -> TaskList:
    """Round r's collection tasks: the whole training split, or a seeded draw of qevolve.tasks_per_round."""
    tasks, n = run.tasks("train"), run.cfg.qevolve.tasks_per_round
    return tasks if n is None else tasks.sample(n, random.Random(run.cfg.seed * 7919 + 1000 + r))


ROUND1_DATA_KEYS = ("seed", "env", "model", "agent", "bc", "rollout.top_p", "qevolve.n_self_per_task",
                    "qevolve.collect_temperature", "qevolve.tasks_per_round")
# Settings read only after the critic is fitted (steps 4-6, and the loop): runs that differ in nothing else fit the
# same round-1 critic on the same D, so an ablation of pr or pi can reuse the full method's (round1_critic_from).
AFTER_CRITIC_KEYS = ("n_iters", "round1_data_from", "round1_critic_from", "pr", "lam", "adv_norm", "pi", "eps_low",
                     "eps_high", "kl_alpha", "loss_agg", "policy_lr", "policy_epochs", "policy_batch_size",
                     "policy_micro_batch_size", "policy_seed", "awr_beta", "awr_cap", "rerank_n", "rerank_temperature")


def round1_critic_keys() -> tuple[str, ...]:
    """The settings a reused round-1 critic must share: the data's, the critic's input length and every qevolve
    setting read up to the critic fit."""
    qkeys = (f"qevolve.{f.name}" for f in dataclasses.fields(QEvolveConfig) if f.name not in AFTER_CRITIC_KEYS)
    return tuple(dict.fromkeys((*ROUND1_DATA_KEYS, "optim.max_length", *qkeys)))


def setting_mismatch(ours: dict[str, Any], theirs: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    """'key is A here but B there' for the first dotted key whose value differs between two config dicts."""
    for key in keys:
        a, b = ours, theirs
        for part in key.split("."):
            a, b = (a or {}).get(part), (b or {}).get(part)
        if a != b:
            return f"{key} is {a!r} here but {b!r} in"
    return None


def _source_run(option: str, source: Path, phase: str, what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A source run's state and config (settings it predates at their defaults), checked to exist and to have
    finished `phase`."""
    import yaml

    state_path, config_path = source / "state.json", source / "config.yaml"
    if not state_path.exists() or not config_path.exists():
        raise ConfigError(f"qevolve.{option}: {str(source)!r} is not a run folder; give runs/NAME")
    state = json.loads(state_path.read_text())
    if phase not in state:
        raise ConfigError(f"qevolve.{option}: {str(source)!r} has not finished its {what}")
    return state, with_defaults(yaml.safe_load(config_path.read_text()))


def import_round1_data(run: Run, source: Path) -> dict[str, Any]:
    """Copy round-1/self from a run that collected it with the same seed, pi_BC and collection settings."""
    import yaml

    state, theirs = _source_run("round1_data_from", source, "round-1/collect", "round-1 collection")
    ours = yaml.safe_load((run.dir / "config.yaml").read_text())
    mismatch = setting_mismatch(ours, theirs, ROUND1_DATA_KEYS)
    if mismatch:
        raise ConfigError(f"qevolve.round1_data_from: {mismatch} {str(source)!r}; "
                          "the data would not be what this run collects")
    store = ExperienceStore(source / "experience.db")
    try:
        trajs = store.load(collection="round-1/self")
    finally:
        store.close()
    run.store.add_missing("round-1/self", ((int(t.meta["slot"]), t) for t in trajs))
    return {**state["round-1/collect"], "imported_from": str(source)}


@dataclass
class Dataset:
    """D = D_expert ∪ D_self for one round, in a fixed order (expert first, then by collection and slot)."""

    trajs: list[Trajectory]

    @property
    def keys(self) -> list[int]:
        """Store row ids: name D within this run's store."""
        return [int(t.meta["store_id"]) for t in self.trajs]

    @property
    def slots(self) -> list[str]:
        """'collection/slot' per trajectory: the same across runs that share round-1 data (their row ids differ)."""
        return [f"{t.meta['collection']}/{t.meta['slot']}" for t in self.trajs]


def hybrid_dataset(run: Run, r: int) -> Dataset:
    """D_expert plus this round's self data (refresh) or every round's so far (accumulate)."""
    q = run.cfg.qevolve
    rounds = [r] if q.buffer == "refresh" else list(range(1, r + 1))
    self_data = [t for k in rounds for t in run.store.load(collection=f"round-{k}/self")]
    self_data.sort(key=lambda t: (t.meta["collection"], t.meta["slot"]))
    expert = sorted(run.store.load(collection="expert"), key=lambda t: t.meta["slot"])
    return Dataset(expert + self_data)


# ---------------------------------------------------------------------------------------------------------------
# Step 2: retrospective labels (and the per-step quantities the critic needs)


@dataclass
class StepLabels:
    """Per step of one trajectory: r_env, r_aux, done, w (all length T), and d = 1[final return != 0]."""

    r_env: list[float]
    r_aux: list[float]
    done: list[bool]
    w: list[float]
    d: bool

    def critic_rewards(self, rr: bool) -> list[float]:
        """r_t = r_env + r_aux (rr on) or r_env (rr off)."""
        return [e + a for e, a in zip(self.r_env, self.r_aux, strict=True)] if rr else list(self.r_env)


def step_labels(traj: Trajectory, q: QEvolveConfig) -> StepLabels:
    """Labels of one trajectory (methods-spec §2.3 steps 2-3)."""
    T = traj.length
    # Sparse env reward [O]: r_env_T = final reward (ETO); sci_dense: the env's per-step score deltas.
    r_env = [float(s.reward) for s in traj.steps] if q.sci_dense else [0.0] * (T - 1) + [float(traj.final_reward)]
    r_aux = adv_math.retrospective_rewards([s.signal for s in traj.steps], q.r_fmt, q.r_inv, q.r_repeat).tolist()
    # Every episode ends in a terminal step, max-step truncation included [O]: failures are worth 0 after T.
    done = [False] * (T - 1) + [True]
    d = traj.final_reward != 0
    w = adv_math.step_weights(T, d).tolist() if q.wiql else [1.0] * T  # wiql off: plain IQL
    return StepLabels(r_env, r_aux, done, w, d)


def data_stats(run: Run, r: int, data: Dataset) -> dict[str, Any]:
    """Step 2 bookkeeping: what D holds, aux-label fractions, env steps consumed so far (logged as data/...)."""
    q = run.cfg.qevolve
    expert = [t for t in data.trajs if t.source == "expert"]
    own = [t for t in data.trajs if t.source != "expert"]
    fresh = run.store.load(collection=f"round-{r}/self")
    collected = [run.store.load(collection=f"round-{k}/self") for k in range(1, r + 1)]
    steps = [s for t in data.trajs for s in t.steps]
    n_steps = max(1, len(steps))
    labels = [step_labels(t, q) for t in data.trajs]
    stats: dict[str, Any] = {
        "n_expert": len(expert),
        "n_self": len(own),
        "n_steps": len(steps),
        "self_success_rate": summarize(fresh).get("success_rate", 0.0),
        "self_mean_return": summarize(fresh).get("avg_reward", 0.0),
        "self_mean_length": summarize(fresh).get("mean_steps", 0.0),
        "frac_d1": sum(lab.d for lab in labels) / max(1, len(labels)),
        "mean_r_aux": sum(sum(lab.r_aux) for lab in labels) / n_steps,
        # Env steps (actions that reached the environment) for the sample-efficiency comparison.
        "env_steps_expert": summarize(expert).get("env_steps", 0),
        "env_steps_round": summarize(fresh).get("env_steps", 0),
        "env_steps_cumulative": summarize(expert).get("env_steps", 0)
        + sum(summarize(c).get("env_steps", 0) for c in collected),
        "episodes_cumulative": len(expert) + sum(len(c) for c in collected),
    }
    for sig in SIGNALS:
        stats[f"aux_frac_{sig}"] = sum(s.signal == sig for s in steps) / n_steps
    run.logger.log("qevolve/data", r, stats)
    return stats


# ---------------------------------------------------------------------------------------------------------------
# Step 3: the weighted-IQL critic


def critic_items(run: Run, policy: TransformersPolicy, data: Dataset) -> list[CriticItem]:
    """One CriticItem per trajectory of D: its rows (full-trajectory render), r_t, done_t, w_t."""
    cfg, q = run.cfg, run.cfg.qevolve
    ensure_reply_ids(policy, data.trajs)
    items = []
    for key, traj in zip(data.keys, data.trajs, strict=True):
        lab = step_labels(traj, q)
        rows = critic_rows(policy.renderer, traj, cfg.optim.max_length, cfg.agent.history_window)
        items.append(CriticItem(rows, lab.critic_rewards(q.rr), lab.done, lab.w, key))
    return items


def is_holdout(task_id: str, fraction: float, seed: int) -> bool:
    """Whether a training task is held out of critic fitting (a fixed hash of the task id and seed)."""
    if fraction <= 0:
        return False
    h = int(hashlib.sha256(f"{seed}:{task_id}".encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def build_critic(run: Run, r: int, policy: TransformersPolicy, init: str | None = None) -> Critic:
    """The round-r critic before fitting: backbone from pi_{r-1} (policy), pi_BC (bc) or the last critic."""
    cfg, q = run.cfg, run.cfg.qevolve
    init = init or q.critic_init
    prev = run.checkpoint_dir(f"round-{r - 1}-critic")
    if init == "prev_critic" and not (prev / "heads.pt").exists():
        init = "policy"  # round 1 has no previous critic: start from pi_0 = pi_BC [O]
    if cfg.model.lora.enabled:
        # One copy of the base weights: the critic is a second adapter on the policy's base model.
        add_critic_adapter(policy.model, _lora_config(policy.model, cfg), "default" if init == "policy" else None)
        critic = Critic(policy.model, q.critic_hidden, adapter="critic", seed=cfg.seed + r)
    else:
        if init == "policy":
            lm = policy.model
        elif init == "bc":
            lm = run.load_policy("bc").model
        else:
            lm = load_pretrained(prev / "backbone")[0]
        critic = Critic(lm, q.critic_hidden, seed=cfg.seed + r)
    if init == "prev_critic":
        load_critic_weights(critic, prev)
    return critic


def load_round_critic(run: Run, r: int) -> tuple[Critic, TransformersPolicy]:
    """The fitted round-r critic (and pi_{r-1}, whose renderer and, with LoRA, base model it uses)."""
    cfg, q = run.cfg, run.cfg.qevolve
    policy = load_round_policy(run, r - 1)
    path = run.checkpoint_dir(f"round-{r}-critic")
    if cfg.model.lora.enabled:
        add_critic_adapter(policy.model, _lora_config(policy.model, cfg), None)
        critic = Critic(policy.model, q.critic_hidden, adapter="critic", seed=cfg.seed + r)
    else:
        critic = Critic(load_pretrained(path / "backbone")[0], q.critic_hidden, seed=cfg.seed + r)
    load_critic_weights(critic, path)
    critic.eval()
    return critic, policy


def train_critic(run: Run, r: int, data: Dataset, cache: dict[str, Any]) -> dict[str, Any]:
    """Fit V, Q1, Q2 by weighted IQL on D minus the held-out tasks (or, in round 1 with round1_critic_from, take a
    run's round-1 critic fitted with the same settings on the same D); calibration on the held-out ones."""
    cfg, q = run.cfg, run.cfg.qevolve
    held = [is_holdout(t.task.task_id, q.critic_holdout, cfg.seed) for t in data.trajs]
    n_fit = (len(held) - sum(held)) or len(held)  # every item when all are held out
    imported: dict[str, Any] = {}
    if r == 1 and q.round1_critic_from:
        critic, policy, last, recorded = import_round1_critic(run, Path(q.round1_critic_from))
        items = critic_items(run, policy, data)
        imported = {"imported_from": q.round1_critic_from}
    else:
        policy = load_round_policy(run, r - 1)
        items = critic_items(run, policy, data)
        critic, last = fit_round_critic(run, r, policy, items, held)
    cache["critic"], cache["policy"] = critic, policy
    # Calibration [§2.4]: does V(s_1) rank held-out returns / separate held-out successes?
    held_trajs = [t for t, h in zip(data.trajs, held, strict=True) if h]
    all_values = critic_values(critic, items, policy.pad_id)
    cache["values"] = all_values  # step 4 reuses them in this process
    held_values = [v for v, h in zip(all_values, held, strict=True) if h]
    v1 = [v["v"][0] for v in held_values]
    stats = {
        "n_fit": n_fit,
        "n_holdout": len(held_trajs),
        "loss_v_last_epoch": last.get("loss_v"),
        "loss_q_last_epoch": last.get("loss_q"),
        "spearman_v1_return": spearman(v1, [t.final_reward for t in held_trajs]),
        "auc_v1_success": auc(v1, [t.success for t in held_trajs]),
    }
    if imported:
        check_reused_critic(q.round1_critic_from, recorded, stats)
    run.logger.log(f"round-{r}/critic", 0, {k: v for k, v in stats.items() if v is not None})
    diag = critic_diagnostics(items, all_values, held, [t.success for t in data.trajs], q.gamma, q.polyak,
                              last, own=[t.source != "expert" for t in data.trajs])
    run.logger.log("diag/qevolve", r, diag)
    return {**stats, **imported, "diag": diag}


def fit_round_critic(run: Run, r: int, policy: TransformersPolicy, items: list[CriticItem],
                     held: list[bool]) -> tuple[Critic, dict[str, float]]:
    """Build the round-r critic, fit it on the items not held out, save it; returns it and the last pass's record
    (losses, steps, target / online head drift)."""
    cfg, q = run.cfg, run.cfg.qevolve
    fit_items = [it for it, h in zip(items, held, strict=True) if not h] or items
    critic = build_critic(run, r, policy)
    # The budget is critic_steps optimiser steps; critic_epochs (legacy) replaces it when set.
    fit = CriticFit(q.tau, q.gamma, q.polyak, q.critic_lr, q.critic_epochs or 1, q.critic_batch_size,
                    q.critic_micro_batch_size, q.critic_grad_clip, steps=0 if q.critic_epochs else q.critic_steps)
    phase = f"round-{r}/critic/train"
    with run.progress(f"round {r}: critic", None) as bar:
        def on_step(step: int, record: dict[str, float]) -> None:
            run.logger.log(phase, step, record)
            bar.update(step)

        epochs = fit_critic(critic, fit_items, fit, policy.pad_id, cfg.seed + r, on_step)
    for e in epochs:
        run.logger.log(f"round-{r}/critic/epoch", e["epoch"], e)
    save_critic(critic, run.checkpoint_dir(f"round-{r}-critic"), policy.tokenizer)
    return critic, (epochs[-1] if epochs else {})


def import_round1_critic(
    run: Run, source: Path
) -> tuple[Critic, TransformersPolicy, dict[str, float], dict[str, Any]]:
    """Copy a run's fitted round-1 critic (same settings up to the critic, same D) into this run and load it with
    pi_0; returns it, pi_0, the source's last critic pass record (for the drift diagnostics) and the source's
    round-1/critic result (for check_reused_critic)."""
    import yaml

    state, theirs = _source_run("round1_critic_from", source, "round-1/critic", "round-1 critic")
    ours = yaml.safe_load((run.dir / "config.yaml").read_text())
    mismatch = setting_mismatch(ours, theirs, round1_critic_keys())
    if mismatch:
        raise ConfigError(f"qevolve.round1_critic_from: {mismatch} {str(source)!r}; that critic was fitted with "
                          "other settings, so fit this run's own (drop round1_critic_from)")
    label, their_label = run.state.get("round-1/label") or {}, state.get("round-1/label") or {}
    if label != their_label:
        key = next(k for k in sorted(set(label) | set(their_label)) if label.get(k) != their_label.get(k))
        raise ConfigError(f"qevolve.round1_critic_from: this run's round-1 data differs from {str(source)!r}'s ({key}: "
                          f"{label.get(key)!r} here, {their_label.get(key)!r} there); set "
                          f"qevolve.round1_data_from to the same run")
    src = source / "checkpoints" / "round-1-critic"
    if not (src / "heads.pt").exists():
        raise ConfigError(f"qevolve.round1_critic_from: {str(src)!r} has no saved critic (heads.pt); give a run "
                          "folder with its checkpoints, not an archive")
    with replacing_dir(run.checkpoint_dir("round-1-critic")) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
    critic, policy = load_round_critic(run, 1)
    return critic, policy, last_critic_pass(source), state["round-1/critic"]


def last_critic_pass(source: Path) -> dict[str, float]:
    """The last round-1 critic pass record a run logged (losses, steps, head drift), followed through runs that
    reused their critic in turn; {} when none is found."""
    seen: set[Path] = set()
    while source not in seen:
        seen.add(source)
        passes = MetricsLogger(source, enabled=False).records("round-1/critic/epoch")
        if passes:
            return {k: v for k, v in passes[-1].items() if k not in ("time", "phase", "step")}
        state = source / "state.json"
        origin = json.loads(state.read_text()).get("round-1/critic", {}).get("imported_from") if state.exists() else None
        if not origin:
            break
        source = Path(origin)
    return {}


def check_reused_critic(source: str, theirs: dict[str, Any], stats: dict[str, Any]) -> None:
    """A reused critic must give the held-out calibration its source recorded in `theirs` (same weights, same D)."""
    for key in ("n_fit", "n_holdout", "auc_v1_success", "spearman_v1_return"):
        a, b = stats.get(key), theirs.get(key)
        if (a is None) != (b is None) or (a is not None and abs(float(a) - float(b)) > 1e-6):
            raise ConfigError(f"qevolve.round1_critic_from: the copied critic gives {key} {a!r} here but {b!r} in "
                              f"{source!r}; its weights or data are not what that run used, so fit this "
                              "run's own critic (drop round1_critic_from)")


def critic_diagnostics(items: list[CriticItem], values: list[dict[str, list[float]]], held: list[bool],
                       success: list[bool], gamma: float, polyak: float, last: dict[str, float],
                       own: list[bool] | None = None) -> dict[str, Any]:
    """Does the critic fit? Held-out AUC of V(s_t) for the episode's success over every state of the policy's own
    episodes, comparing states at the same step t (`own` marks them; all held-out episodes when None); of V(s_1) and
    min Q(s_1, a_1); explained variance of the held-out returns-to-go (of the critic's reward) by V, V spread
    against the returns' spread over D, and how far the target heads moved from their init (names of
    diagnostics.critic_fit)."""
    held_idx = [i for i, h in enumerate(held) if h]
    g_all = [diagnostics.returns_to_go(it.rewards, gamma) for it in items]
    v_states = [v["v"][: it.T] for v, it in zip(values, items, strict=True)]
    own_held = [i for i in held_idx if own is None or own[i]]
    states = [(x, t, success[i]) for i in own_held for t, x in enumerate(v_states[i])]
    out: dict[str, Any] = {
        "auc_v_states": auc_same_step(*map(list, zip(*states, strict=True))) if states else None,
        "n_holdout_own": len(own_held),
        "auc_v1": auc([values[i]["v"][0] for i in held_idx], [success[i] for i in held_idx]),
        "auc_q": auc([min(values[i]["q1"][0], values[i]["q2"][0]) for i in held_idx], [success[i] for i in held_idx]),
        "ev": diagnostics.explained_variance([x for i in held_idx for x in v_states[i]],
                                             [x for i in held_idx for x in g_all[i]]),
        "v_std": diagnostics.std([x for v in v_states for x in v]),
        "return_std": diagnostics.std([x for g in g_all for x in g]),
        "n_holdout": len(held_idx),
    }
    if last:
        out.update(target_drift=last["target_drift"], online_drift=last["online_drift"], steps=int(last["steps"]),
                   init_share=diagnostics.init_share(polyak, int(last["steps"])))
    return out


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1  # ties share their average rank
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman rank correlation (None when either side is constant or shorter than 2)."""
    if len(x) < 2 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    rx, ry = torch.tensor(_ranks(x)), torch.tensor(_ranks(y))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()))


# ---------------------------------------------------------------------------------------------------------------
# Step 4: process rewards


def process_rewards(pr: str, lab: StepLabels, values: dict[str, list[float]], gamma: float, lam: float) -> list[float]:
    """A_t for one trajectory from the critic's V (T+1) and Q heads (T): gae | q_minus_v | td | gae_aux."""
    v = values["v"]
    if pr == "gae":  # r_env only in delta [S]
        a = adv_math.gae(lab.r_env, v, lab.done, gamma, lam)
    elif pr == "gae_aux":  # r_env + r_aux in delta (the placement the paper argues against)
        a = adv_math.gae([e + x for e, x in zip(lab.r_env, lab.r_aux, strict=True)], v, lab.done, gamma, lam)
    elif pr == "td":  # potential-based shaping: GAE with lambda = 0
        a = adv_math.td_errors(lab.r_env, v, lab.done, gamma)
    elif pr == "q_minus_v":  # one-step advantage, 'w/o GAE'
        q_min = torch.minimum(torch.tensor(values["q1"]), torch.tensor(values["q2"]))
        a = adv_math.q_minus_v(q_min, v)
    else:
        raise ValueError(f"unknown process reward {pr!r}")
    return a.tolist()


def dataset_advantages(
    q: QEvolveConfig, labels: list[StepLabels], values: list[dict[str, list[float]]]
) -> tuple[list[list[float]], list[list[float]]]:
    """Per trajectory: the raw A_t and the A_t used for training (normalised over all steps of D when adv_norm)."""
    raw = [process_rewards(q.pr, lab, val, q.gamma, q.lam) for lab, val in zip(labels, values, strict=True)]
    flat = torch.tensor([a for adv in raw for a in adv])
    normed = adv_math.normalise(flat) if q.adv_norm else flat  # over the whole dataset [P:BPPO]
    return raw, [x.tolist() for x in torch.split(normed, [len(a) for a in raw])]


def labels_path(run: Run, r: int) -> Any:
    return run.dir / "labels" / f"round-{r}.json"


def compute_advantages(run: Run, r: int, data: Dataset, cache: dict[str, Any]) -> dict[str, Any]:
    """V/Q for every trajectory of D (one pass each), A_t per step, normalised over D; saved to labels/round-r.json."""
    q = run.cfg.qevolve
    if "critic" in cache:
        critic, policy = cache["critic"], cache["policy"]
    else:
        critic, policy = load_round_critic(run, r)
    items = critic_items(run, policy, data)
    values = cache.get("values") or critic_values(critic, items, policy.pad_id)
    labels = [step_labels(t, q) for t in data.trajs]
    raw, final = dataset_advantages(q, labels, values)
    flat = torch.tensor([a for adv in raw for a in adv])
    path = labels_path(run, r)
    write_text_atomic(path, json.dumps({"keys": data.keys, "slots": data.slots, "adv": final, "raw": raw,
                                        "v": [v["v"] for v in values]}))
    stats = {**value_stats(data, values, q.tau), **advantage_stats(data, final, flat)}
    run.logger.log(f"round-{r}/advantages", 0, stats)
    is_flagged = [s.signal != SIGNAL_NONE for t in data.trajs for s in t.steps]
    flagged = diagnostics.flagged_advantage([a for adv in final for a in adv], is_flagged)
    flagged.update(flagged_gap_alternatives(q, labels, values, is_flagged))
    flagged.update(progress_agreement(q, data.trajs, labels, values, final))
    run.logger.log("diag/qevolve", r, flagged)  # merged with the critic's record of this round in the report
    return {**stats, "diag": flagged}


# process rewards the flagged-step diagnostic also computes from the same critic values, so a failing report can
# say which setting would have passed (changing pr or lam does not change the critic: it is fitted before)
PR_ALTERNATIVES = (("gae", 0.5), ("gae", 0.0), ("gae_aux", None))
GAP_IF = diagnostics.FLAGGED_GAP_IF


def flagged_gap_alternatives(q: QEvolveConfig, labels: list[StepLabels], values: list[dict[str, list[float]]],
                             is_flagged: list[bool]) -> dict[str, float | None]:
    """Normalised advantage of rule-flagged steps minus the others' under other process rewards (PR_ALTERNATIVES;
    None = this run's lam), keyed 'flagged_gap_if_<pr>_lam<lam>' (flat scalars, so trackers plot them too)."""
    out: dict[str, float | None] = {}
    for pr, lam in PR_ALTERNATIVES:
        lam = q.lam if lam is None else lam
        if (pr, lam) == (q.pr, q.lam) or q.pr == "q_minus_v":
            continue
        alt = dataclasses.replace(q, pr=pr, lam=lam)
        _, final = dataset_advantages(alt, labels, values)
        d = diagnostics.flagged_advantage([a for adv in final for a in adv], is_flagged)
        out[f"{GAP_IF}{pr}_lam{lam:g}"] = diagnostics.flagged_gap(d)
    return out


# the process rewards progress_agreement also scores from the same critic values: one-step TD errors, with and
# without the rule rewards (lam 0 keeps V's own ranking of the next state; lam near 1 tends to the episode return)
PROGRESS_ALTERNATIVES = (("gae", 0.0), ("gae_aux", 0.0))


def progress_agreement(q: QEvolveConfig, trajs: list[Trajectory], labels: list[StepLabels],
                       values: list[dict[str, list[float]]], final: list[list[float]]) -> dict[str, Any]:
    """Does the process reward point the right way? Over the policy's own steps: the AUC of the training advantage
    A_t for 'this step raised the environment's score' (progress), the same AUC for the outcome-only advantage that
    every step of an episode shares (final reward minus its task's mean over D; what GRPO would give), and for the
    PROGRESS_ALTERNATIVES from the same critic values ('progress_auc_if_<pr>_lam<lam>'). Empty where no own step
    made progress or every one did."""
    own = [i for i, t in enumerate(trajs) if t.source != "expert"]
    progress = [s.reward > 0 for i in own for s in trajs[i].steps]
    if not own or all(progress) or not any(progress):
        return {}
    by_task: dict[str, list[float]] = {}
    for i in own:
        by_task.setdefault(trajs[i].task.task_id, []).append(trajs[i].final_reward)
    outcome = [trajs[i].final_reward - sum(by_task[trajs[i].task.task_id]) / len(by_task[trajs[i].task.task_id])
               for i in own for _ in trajs[i].steps]
    out: dict[str, Any] = {
        "progress_auc": auc([a for i in own for a in final[i]], progress),
        "progress_auc_outcome": auc(outcome, progress),
        "progress_frac": sum(progress) / len(progress),
    }
    for pr, lam in PROGRESS_ALTERNATIVES:
        if (pr, lam) == (q.pr, q.lam):
            continue
        alt = [process_rewards(pr, labels[i], values[i], q.gamma, lam) for i in own]
        out[f"{diagnostics.PROGRESS_AUC_IF}{pr}_lam{lam:g}"] = auc([a for adv in alt for a in adv], progress)
    return out


def value_stats(data: Dataset, values: list[dict[str, list[float]]], tau: float) -> dict[str, float]:
    """Critic statistics over D [§2.4]: V, Q1, Q2, min Q̄, expectile residual sign, V on expert vs self steps."""
    v = torch.tensor([x for val in values for x in val["v"][:-1]])
    q1 = torch.tensor([x for val in values for x in val["q1"]])
    q2 = torch.tensor([x for val in values for x in val["q2"]])
    qbar = torch.minimum(torch.tensor([x for val in values for x in val["qbar1"]]),
                         torch.tensor([x for val in values for x in val["qbar2"]]))
    is_expert = torch.tensor([t.source == "expert" for t in data.trajs for _ in t.steps])
    out = {
        "v_mean": float(v.mean()), "v_std": float(v.std()) if len(v) > 1 else 0.0,
        "q1_mean": float(q1.mean()), "q1_std": float(q1.std()) if len(q1) > 1 else 0.0,
        "q2_mean": float(q2.mean()), "q2_std": float(q2.std()) if len(q2) > 1 else 0.0,
        "qbar_mean": float(qbar.mean()),
        # Fraction of steps with min Q̄ above V. Spec §2.4 expects ≈ tau; like a tau-quantile, an upper expectile
        # leaves roughly 1 − tau of the residuals positive (see docs/methods/qevolve.md).
        "resid_pos_frac": float((qbar > v).float().mean()),
        "tau": tau,
    }
    for name, mask in (("expert", is_expert), ("self", ~is_expert)):
        if mask.any():
            out[f"v_mean_{name}"] = float(v[mask].mean())
    return out


def advantage_stats(data: Dataset, final: list[list[float]], raw_flat: torch.Tensor) -> dict[str, float]:
    """Mean / std / fraction > 0 of the advantages by source (expert, self) and by aux type [§2.4]."""
    a = torch.tensor([x for adv in final for x in adv])
    source = [("expert" if t.source == "expert" else "self") for t in data.trajs for _ in t.steps]
    signal = [s.signal for t in data.trajs for s in t.steps]
    out = {"raw_mean": float(raw_flat.mean()), "raw_std": float(raw_flat.std()) if len(raw_flat) > 1 else 0.0}
    groups = [(f"src_{g}", [x == g for x in source]) for g in ("expert", "self")]
    groups += [(f"aux_{g}", [x == g for x in signal]) for g in SIGNALS]
    for name, sel in groups:
        mask = torch.tensor(sel)
        if mask.any():
            part = a[mask]
            out[f"{name}_n"] = int(mask.sum())
            out[f"{name}_mean"] = float(part.mean())
            out[f"{name}_std"] = float(part.std()) if len(part) > 1 else 0.0
            out[f"{name}_pos_frac"] = float((part > 0).float().mean())
    return out


# ---------------------------------------------------------------------------------------------------------------
# Step 5: policy improvement


def policy_samples(
    renderer: Any, data: Dataset, adv: list[list[float]], window: int, max_length: int
) -> list[StepSample]:
    """Training rows of D with each reply's advantage A_t as the span label 'adv'."""
    samples = []
    for i, (traj, a) in enumerate(zip(data.trajs, adv, strict=True)):
        for s in trajectory_samples(renderer, traj, i, window, max_length):
            s.labels["adv"] = [a[t - 1] for t in s.steps]
            samples.append(s)
    return samples


@torch.no_grad()
def span_logprobs(model: Any, samples: list[StepSample], pad_id: int, batch_size: int) -> list[list[float]]:
    """log pi(token | prefix) of every reply token of each sample (spans concatenated), under `model`."""
    model.eval()
    out: list[list[float]] = []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        batch = collate(chunk, pad_id)
        device = next(model.parameters()).device
        logp, _ = reply_logprobs(model, {k: v.to(device) for k, v in batch.items()})
        logp = logp.cpu()
        for row, s in enumerate(chunk):
            out.append([x for a, b in s.spans for x in logp[row, a:b].tolist()])
    return out


def policy_loss(q: QEvolveConfig) -> Callable[[Any, dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]:
    """The step-5 loss: -J_clip + alpha * KL_k3(pi || pi_BC) (bppo), or the AWR loss (awr)."""

    def loss_fn(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        logits = forward_logits(model, batch)
        picked = losses.token_logprobs(logits, batch["input_ids"])
        logp = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)  # aligned to input positions
        mask = batch["action_mask"]
        kl_ref = losses.aggregate(losses.kl_k3(logp, batch["ref_logp"]), mask, q.loss_agg)
        stats: dict[str, float] = {}
        if q.pi == "bppo":
            objective, clip = losses.clipped_ratio_objective(
                logp, batch["old_logp"], batch["adv"], mask, q.eps_low, q.eps_high, q.loss_agg
            )
            loss = objective + q.kl_alpha * kl_ref
            stats = {k: float(v) for k, v in clip.items()}
        else:  # AWR as written in methods-spec §5: no clipping, no KL term
            weights = adv_math.awr_weights(batch["adv"], q.awr_beta, q.awr_cap)
            objective = losses.awr_loss(logp, weights, mask, q.loss_agg)
            loss = objective
        with torch.no_grad():
            entropy = losses.token_entropy(logits[:, :-1])
            entropy = torch.cat([torch.zeros_like(entropy[:, :1]), entropy], dim=1)
            stats.update(
                j_clip=float(-objective) if q.pi == "bppo" else 0.0,
                awr_loss=float(objective) if q.pi == "awr" else 0.0,
                kl_ref=float(kl_ref),
                kl_old=float(losses.aggregate(losses.kl_k3(logp, batch["old_logp"]), mask, q.loss_agg)),
                entropy=float(losses.aggregate(entropy, mask, q.loss_agg)),
                tokens=float(mask.sum()),
            )
        return loss, stats

    return loss_fn


def improve_policy(run: Run, r: int, data: Dataset) -> dict[str, Any]:
    """pi_r from pi_{r-1} on D with the round's advantages; old log-probs under pi_{r-1}, reference pi_BC."""
    cfg, q = run.cfg, run.cfg.qevolve
    if q.pi == "none":
        return {"skipped": "pi=none: the policy stays pi_BC; the critic reranks candidate replies at test time"}
    saved = json.loads(labels_path(run, r).read_text())
    if saved["keys"] != data.keys:
        raise RuntimeError(f"labels/round-{r}.json does not belong to this round's dataset; delete it and resume")
    policy = load_round_policy(run, r - 1)
    ensure_reply_ids(policy, data.trajs)
    samples = policy_samples(policy.renderer, data, saved["adv"], cfg.agent.history_window, cfg.optim.max_length)
    micro = q.policy_micro_batch_size
    # pi_old = pi_{r-1} for every reply token of D, expert ones included; computed once per round [S/O].
    old = span_logprobs(policy.model, samples, policy.pad_id, micro)
    if cfg.model.lora.enabled:
        with policy.model.disable_adapter():  # the shared base is pi_BC
            ref = span_logprobs(policy.model, samples, policy.pad_id, micro)
    else:
        ref = span_logprobs(run.load_policy("bc").model, samples, policy.pad_id, micro)
    for s, o, f in zip(samples, old, ref, strict=True):
        s.token_labels["old_logp"], s.token_labels["ref_logp"] = o, f
    # Sanity: stored behaviour log-probs (sampling time) against the recomputed pi_{r-1} ones, self data only.
    diffs = [abs(a - b) for s, o in zip(samples, old, strict=True) if s.behaviour_logprobs
             for a, b in zip(s.behaviour_logprobs, o, strict=True)]
    optim = dataclasses.replace(cfg.optim, lr=q.policy_lr, epochs=q.policy_epochs, batch_size=q.policy_batch_size,
                                micro_batch_size=q.policy_micro_batch_size)
    # With LoRA the round's policy is the adapter on pi_BC's frozen base: saved as an adapter, not merged.
    order_seed = (cfg.seed if q.policy_seed is None else q.policy_seed) + r
    stats = finetune(run, policy, samples, policy_loss(q), f"round-{r}", optim=optim, seed=order_seed,
                     log_phase=f"round-{r}/policy/train", model=policy.model.train(), merge_lora=False)
    # Did the update follow the advantages? log pi_r - log pi_{r-1} of every training action (one forward pass).
    follow = update_follow_record(data, samples, old, span_logprobs(policy.model, samples, policy.pad_id, micro))
    run.logger.log("diag/qevolve", r, follow)  # merged with the critic's and the advantages' records of the round
    return {**stats, "samples": len(samples),
            "old_vs_behaviour_abs_diff": sum(diffs) / len(diffs) if diffs else 0.0, "diag": follow}


def update_follow_record(data: Dataset, samples: list[StepSample], old: list[list[float]],
                         new: list[list[float]]) -> dict[str, Any]:
    """diagnostics.update_follow over every step of D: each reply's summed change new - old (span_logprobs rows of
    the same samples), its advantage label, and whether the rules flagged the step."""
    deltas, adv, flagged = [], [], []
    for s, o, n in zip(samples, old, new, strict=True):
        for t, a, d in zip(s.steps, s.labels["adv"], span_sums(s.spans, [y - x for x, y in zip(o, n, strict=True)]),
                           strict=True):
            deltas.append(d)
            adv.append(a)
            flagged.append(data.trajs[s.traj_index].steps[t - 1].signal != SIGNAL_NONE)
    return diagnostics.update_follow(deltas, adv, flagged)


def span_sums(spans: list[tuple[int, int]], per_token: list[float]) -> list[float]:
    """Sum of a concatenated per-reply-token list within each span (the layout of span_logprobs' rows)."""
    out, at = [], 0
    for a, b in spans:
        out.append(sum(per_token[at : at + b - a]))
        at += b - a
    if at != len(per_token):
        raise ValueError(f"spans cover {at} tokens but the row has {len(per_token)}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Step 6: evaluation ('w/o PI': critic reranking)


class RerankActor:
    """'w/o PI': the policy samples N replies per step; the critic keeps argmax min_i Q_i(s_t, a) unexecuted."""

    source = "self"

    def __init__(self, policy: TransformersPolicy, critic: Critic, instruction: str, window: int, n: int,
                 sampling: Sampling, max_length: int) -> None:
        self.policy, self.critic, self.instruction, self.window = policy, critic, instruction, window
        self.n, self.sampling, self.max_length = n, sampling, max_length
        self.policy_id = f"{policy.policy_id}+rerank{n}"
        self._calls = 0

    def needs_plan(self) -> bool:
        return False

    def critic_prompt(self, ep: Any) -> list[int]:
        """The full-history prompt the critic reads (as in training: no window)."""
        messages = build_messages(self.instruction, ep.goal, ep.first_obs, ep.history, max(1, len(ep.history)),
                                  prefix=ep.request.prefix)
        return self.policy.renderer.render(messages, add_generation_prompt=True).ids

    def act(self, episodes: list[Any]) -> list[Generation]:
        """Sample N candidates per episode, score each with the critic, return the best."""
        actor = PolicyActor(self.policy, self.instruction, self.window, self.sampling)
        prompts = [actor.prompt_ids(ep) for ep in episodes]
        sampling = self.sampling
        if sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=sampling.seed + self._calls)
        self._calls += 1
        cands = self.policy.generate([p for p in prompts for _ in range(self.n)], sampling)
        rows = []
        for i, ep in enumerate(episodes):
            base = self.critic_prompt(ep)
            for gen in cands[i * self.n : (i + 1) * self.n]:
                seq = base + list(gen.token_ids)
                rows.append(seq[-self.max_length :])
        scores = self.critic.score(rows, self.policy.pad_id).view(len(episodes), self.n)
        best = scores.argmax(dim=1).tolist()
        return [cands[i * self.n + b] for i, b in enumerate(best)]


def evaluate_actor(run: Run, actor: Any, label: str) -> dict[str, dict[str, Any]]:
    """run.evaluate for any actor: greedy splits, stored as eval/LABEL/SPLIT, metrics per split."""
    return run.evaluate_actor(actor, label)


def evaluate_round(run: Run, r: int) -> dict[str, dict[str, Any]]:
    """Greedy evaluation of pi_r (or, with pi=none, pi_BC with the round-r critic reranking candidates)."""
    cfg, q = run.cfg, run.cfg.qevolve
    if q.pi != "none":
        result = run.evaluate(acting_policy(run, r), f"round-{r}")
    else:
        critic, policy = load_round_critic(run, r)  # policy = pi_0 = pi_BC
        sampling = Sampling(q.rerank_temperature, cfg.rollout.top_p, cfg.agent.max_new_tokens,
                            seed=cfg.seed + 104729 * r)
        actor = RerankActor(policy, critic, run.signal_env.instruction(), cfg.agent.history_window, q.rerank_n,
                            sampling, cfg.optim.max_length)
        result = evaluate_actor(run, actor, f"round-{r}")
    log_round_drift(run, r, result)
    return result


def log_round_drift(run: Run, r: int, result: dict[str, dict[str, Any]]) -> None:
    """diag/qevolve row of round r: did the update keep the reply format (held-out format errors against the
    round's start policy) and how far did it move (KL to pi_BC on the training steps)?"""
    start = run.state.get("eval/bc" if r == 1 else f"eval/round-{r - 1}") or {}
    record: dict[str, Any] = diagnostics.format_drift(result, start)
    kl = (run.state.get(f"round-{r}/policy") or {}).get("kl_ref")
    if kl is not None:
        record["kl_ref"] = kl
    if record:
        run.logger.log("diag/qevolve", r, record)  # merged with the round's other diag/qevolve records


def plot_rounds(run: Run) -> list[str]:
    """plots/qevolve_rounds.png: success per round against cumulative env steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    q = run.cfg.qevolve
    points: dict[str, list[tuple[float, float]]] = {}
    for r in range(0, q.n_iters + 1):
        key = "eval/bc" if r == 0 else f"eval/round-{r}"
        steps = 0 if r == 0 else run.state.get(f"round-{r}/label", {}).get("env_steps_cumulative", 0)
        if r == 0:
            steps = run.state.get("round-1/label", {}).get("env_steps_expert", 0)
        for split, m in (run.state.get(key) or {}).items():
            points.setdefault(split, []).append((steps, 100 * m["success_rate"]))
    if not points:
        return []
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for split, pts in points.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=split)
    ax.set_xlabel("cumulative env steps (expert + self)")
    ax.set_ylabel("success rate (%)")
    ax.set_title("Q-Evolve: BC, then one point per round")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = run.dir / "plots" / "qevolve_rounds.png"
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path.relative_to(run.dir))]
