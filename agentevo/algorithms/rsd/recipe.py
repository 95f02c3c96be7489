"""RSD: self-evolving agents through privileged retrospective distillation (methods-spec §4).

One model is student and teacher. Each round r = 1..R:
    1. sample tasks_per_round training tasks (stratified by task type) ................ sample_tasks
    2. act: the student (plain ReAct prompt, T=1.0) plays one trajectory per task, stored with its outcome
       in collection round-r/act ...................................................... phase round-r/act
    3. rebuild the context material from the accumulated bank B: precedents, lessons per task type,
       a reflection per episode; future hindsight H_t is read off each episode ......... phase round-r/context
    4. C_t = rule(P, L, F, H_t) placed at the rule's position in the teacher's prompt
    5. the teacher (weights per the schedule) re-scores the student's own reply tokens under teacher forcing,
       no grad; its top-k ids and log-probs per reply token are cached to disk ......... phase round-r/teacher
    6. student loss on the plain prompt (no context ever reaches it):
           l_{t,j} = sum_{v in K} p~_T(v) (log p~_T(v) - log p~_S(v)),  K = top20(p_T), renormalised
           L = (1/N_tok) sum l_{t,j}           -- no reward anywhere
    7. one epoch, lr 3e-6 ............................................................. phase round-r/update
    8. greedy evaluation without context (M_r on the validation split) ................. phase eval/round-r
       teacher schedule: follow the student while M_r >= peak, then freeze at the best .. phase round-r/schedule
       rule search (optional): accept/revert the round's rule, propose + probe the next .. phase round-r/rule
Per-round metrics go to metrics.jsonl under phase 'rsd/round' (names fixed; see docs/methods/rsd.md).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentevo.algorithms import losses
from agentevo.algorithms.bc import (
    WARM_START_PHASES,
    ensure_reply_ids,
    expert_samples,
    import_warm_start,
    nll_loss,
    warm_start,
)
from agentevo.algorithms.rsd.context import (
    ContextRule,
    LLMProposer,
    Material,
    RandomProposer,
    accept_rule,
    assemble_context,
    build_material,
    clip_tokens,
    context_rows,
    evaluate_with_context,
    future_hindsight,
    match_text,
    pre_action_context_fn,
    probe_rule,
    rank_precedents,
    render_precedent,
    step_contexts,
)
from agentevo.algorithms.rsd.writers import RuleWriter, http_client_from_config, make_writer
from agentevo.algorithms.selfguide.recipe import GuidedExpertActor
from agentevo.data.tensors import StepSample, collate, forward_logits, trajectory_samples
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import SIGNAL_NONE, Task, sample_tasks
from agentevo.errors import AgentevoError
from agentevo.eval.metrics import auc, summarize
from agentevo.files import replacing, write_text_atomic
from agentevo.models.backend import Sampling
from agentevo.rollout.engine import EpisodeRequest, PolicyActor
from agentevo.train.finetune import finetune

if TYPE_CHECKING:
    from agentevo.run import Run

# token_labels are float32: indices into the teacher cache are exact below 2**24.
_MAX_CACHE_TOKENS = 2**24

# ---------------------------------------------------------------------------------------------------------------
# Teacher schedule (§4.4)


@dataclass
class TeacherState:
    """Which checkpoint teaches the next round, whether it is frozen, and the best validation metric so far."""

    ckpt: str
    frozen: bool
    best_metric: float
    best_round: int
    best_ckpt: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TeacherState:
        return cls(**d)


def update_teacher(state: TeacherState, round_idx: int, metric: float, student_ckpt: str, mode: str) -> TeacherState:
    """The teacher for round r+1 after the student of round r scored `metric` (M_r).

    follow_freeze [S]: follow the latest student while M_r >= max_{r'<=r} M_{r'}; at the first drop, freeze at
    argmax_{r'} M_{r'} for good. always_follow: the latest student. fixed_init: unchanged. ema: the caller writes
    the averaged weights to `teacher-r` and the state points there.
    """
    improved = metric >= state.best_metric
    best = (metric, round_idx, student_ckpt) if improved else (state.best_metric, state.best_round, state.best_ckpt)
    new = TeacherState(state.ckpt, state.frozen, *best)
    if mode == "always_follow":
        new.ckpt = student_ckpt
    elif mode == "ema":
        new.ckpt = f"teacher-{round_idx}"
    elif mode == "follow_freeze" and not state.frozen:
        if improved:
            new.ckpt = student_ckpt
        else:
            new.frozen, new.ckpt = True, new.best_ckpt
    return new


# ---------------------------------------------------------------------------------------------------------------
# The distillation loss (§4.3 step 6)


def topk_divergence(
    student_logits: torch.Tensor,
    ids: torch.Tensor,
    teacher_logp: torch.Tensor,
    kind: str = "forward",
    beta: float = 0.5,
    tail: bool = False,
) -> torch.Tensor:
    """Per-token divergence between teacher and student on the K cached ids (renormalised, or + tail bucket).

    forward = KL(p_T||p_S) [S] (losses.topk_forward_kl); reverse = KL(p_S||p_T); jsd = beta KL(p_T||M) +
    (1 - beta) KL(p_S||M), M = beta p_T + (1 - beta) p_S [P:GKD]. Gradients flow only into the student.
    """
    if kind == "forward":
        return losses.topk_forward_kl(student_logits, ids, teacher_logp, tail_bucket=tail)
    z = student_logits.float()
    s_k = z.gather(-1, ids)
    t = teacher_logp.detach().float()
    if tail:
        s = losses.append_tail_bucket(s_k - torch.logsumexp(z, dim=-1, keepdim=True))
        t = losses.append_tail_bucket(t)
    else:
        s = s_k - torch.logsumexp(s_k, dim=-1, keepdim=True)
        t = t - torch.logsumexp(t, dim=-1, keepdim=True)
    if kind == "reverse":
        return (s.exp() * (s - t)).sum(-1)
    mix = torch.logsumexp(torch.stack([t + torch.log(torch.tensor(beta)), s + torch.log(torch.tensor(1.0 - beta))]),
                          dim=0)
    return beta * (t.exp() * (t - mix)).sum(-1) + (1.0 - beta) * (s.exp() * (s - mix)).sum(-1)


def make_distill_loss(cache: TeacherCache, kind: str = "forward", beta: float = 0.5, tail: bool = False,
                      ) -> Callable[[Any, dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]:
    """loss_fn(model, batch) for train(): token-mean divergence to the cached teacher top-k on reply tokens."""

    def loss_fn(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        logits = forward_logits(model, batch)[:, :-1]
        mask = batch["action_mask"][:, 1:]
        # Logits at position p-1 predict the token at p: the reply token's cache row index sits at p.
        index = batch["tk_index"][:, 1:].round().long().clamp(min=0).cpu()
        ids, t_lp = cache.topk_rows(index, logits.device)
        per_token = topk_divergence(logits, ids, t_lp, kind, beta, tail)
        return losses.aggregate(per_token, mask, "token-mean"), {"tokens": float(mask.sum())}

    return loss_fn


# ---------------------------------------------------------------------------------------------------------------
# The teacher cache (§4.3 step 5): top-k ids and log-probs per reply token, computed once per round


def id_dtype(vocab_size: int) -> torch.dtype:
    """The smallest signed int type that holds every token id of the vocabulary (int16 up to 32,767 ids)."""
    return torch.int16 if vocab_size <= torch.iinfo(torch.int16).max else torch.int32


@dataclass
class TeacherCache:
    """Per reply token, in (trajectory, step, token) order: the teacher's top-k ids and log-probs, plus the teacher's
    and the round-start student's log-prob of the token actually taken.

    After scoring the cache is compacted (compact_): log-probs in float16, ids in id_dtype(V); it is saved and loaded
    that way, and every reader converts a slice back with topk_rows (int64 ids, float32 log-probs)."""

    offsets: dict[tuple[int, int], tuple[int, int]]  # (traj index, t) -> (start row, n tokens)
    ids: torch.Tensor  # [N, K] int64 while scoring; id_dtype(V) once compact
    logp: torch.Tensor  # [N, K] full-vocabulary log-probs under softmax(z / T_teach); float32, then float16
    teacher_token_logp: torch.Tensor  # [N] log p_T(a_t^j), temperature 1
    student_token_logp: torch.Tensor  # [N] log pi_r(a_t^j), the student before this round's update
    vocab_size: int = 0  # V of the teacher's logits (set by score_teacher); picks the id type

    @classmethod
    def empty(cls, trajs: Sequence[Trajectory], k: int) -> TeacherCache:
        offsets, n = {}, 0
        for i, traj in enumerate(trajs):
            for s in traj.steps:
                offsets[(i, s.t)] = (n, len(s.action_ids))
                n += len(s.action_ids)
        if n >= _MAX_CACHE_TOKENS:
            raise ValueError(f"{n} reply tokens in one round exceed the cache index limit {_MAX_CACHE_TOKENS}")
        return cls(offsets, torch.zeros((n, k), dtype=torch.long), torch.zeros((n, k)), torch.zeros(n), torch.zeros(n))

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    def compact_(self) -> TeacherCache:
        """In place: float16 top-k log-probs, ids in the smallest int type that holds the vocabulary (1/3 of the
        float32 + int64 bytes at V <= 32,767); fp16 keeps 11 significant bits, ample for a distillation target."""
        vocab = self.vocab_size or (int(self.ids.max()) + 1 if self.ids.numel() else 1)
        self.ids = self.ids.to(id_dtype(vocab))
        self.logp = self.logp.to(torch.float16)
        return self

    def topk_rows(self, index: torch.Tensor, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached top-k at these rows as the losses take them: int64 ids, float32 log-probs."""
        return self.ids[index].to(device=device, dtype=torch.long), self.logp[index].to(device=device,
                                                                                         dtype=torch.float32)

    def nbytes(self) -> int:
        """Bytes of the tensors (= on disk, less the offsets): top-k ids and log-probs + two float32 token log-probs."""
        k = self.ids.shape[1]
        return self.n_tokens * (k * (self.ids.element_size() + self.logp.element_size()) + 8)

    def save(self, path: Path) -> None:
        """Write it compact (see compact_; this object is left as it is), atomically."""
        small = dataclasses.replace(self).compact_()
        with replacing(path) as tmp:
            torch.save({"offsets": [[i, t, a, n] for (i, t), (a, n) in self.offsets.items()],
                        "ids": small.ids, "logp": small.logp, "teacher_token_logp": self.teacher_token_logp,
                        "student_token_logp": self.student_token_logp, "vocab_size": self.vocab_size}, tmp)

    @classmethod
    def load(cls, path: Path) -> TeacherCache:
        """Read a saved cache; it stays compact (readers convert slices with topk_rows)."""
        blob = torch.load(path, weights_only=True)
        offsets = {(int(i), int(t)): (int(a), int(n)) for i, t, a, n in blob["offsets"]}
        cache = cls(offsets, blob["ids"], blob["logp"], blob["teacher_token_logp"], blob["student_token_logp"],
                    int(blob.get("vocab_size", 0)))
        return cache.compact_()  # a cache saved before compaction existed (int32 ids, float32 log-probs)

    def rows_of(self, sample: StepSample) -> list[int]:
        """Cache rows of a sample's reply tokens, in span order."""
        out: list[int] = []
        for t in sample.steps:
            start, n = self.offsets[(sample.traj_index, t)]
            out.extend(range(start, start + n))
        return out


def reply_logits(model: Any, rows: Sequence[StepSample], pad_id: int, batch_size: int,
                 ) -> Iterator[tuple[StepSample, torch.Tensor, torch.Tensor]]:
    """Per row: the logits that predict each reply token [n_reply, V] (float32, cpu) and those tokens, no grad. The
    forward runs under placement.autocast(), the precision the student's distillation loss runs in."""
    from agentevo.models import placement

    order = sorted(range(len(rows)), key=lambda i: len(rows[i].input_ids))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.no_grad(), placement.autocast():
        for start in range(0, len(order), batch_size):
            chunk = [rows[i] for i in order[start : start + batch_size]]
            batch = collate(chunk, pad_id)
            logits = model(input_ids=batch["input_ids"].to(device),
                           attention_mask=batch["attention_mask"].to(device)).logits
            for b, row in enumerate(chunk):
                pos = torch.tensor([p for s, e in row.spans for p in range(s, e)], dtype=torch.long)
                yield row, logits[b, (pos - 1).to(device)].float().cpu(), batch["input_ids"][b, pos]
    model.train(was_training)


def _scatter(cache_tensor: torch.Tensor, cache: TeacherCache, row: StepSample, values: torch.Tensor) -> None:
    cache_tensor[torch.tensor(cache.rows_of(row), dtype=torch.long)] = values


def score_teacher(model: Any, rows: Sequence[StepSample], cache: TeacherCache, k: int, temperature: float,
                  pad_id: int, batch_size: int, support: torch.Tensor | None = None) -> None:
    """Fill the cache with the teacher's top-k (or its log-probs at the given support ids) for every reply token."""
    for row, z, tok in reply_logits(model, rows, pad_id, batch_size):
        cache.vocab_size = int(z.shape[-1])
        if support is None:
            ids, lp = losses.teacher_topk(z, k, temperature)
        else:
            # --topk_from student: the round-start student's top-k ids; the teacher's full-vocab log-probs there.
            ids = support[torch.tensor(cache.rows_of(row), dtype=torch.long)]
            lp = torch.log_softmax(z / temperature, dim=-1).gather(-1, ids)
        _scatter(cache.ids, cache, row, ids)
        _scatter(cache.logp, cache, row, lp)
        _scatter(cache.teacher_token_logp, cache, row, torch.log_softmax(z, -1).gather(-1, tok[:, None])[:, 0])


def student_pass(model: Any, rows: Sequence[StepSample], cache: TeacherCache, pad_id: int, batch_size: int,
                 rsd: Any, topk_ids: bool = False) -> dict[str, Any]:
    """The student on its plain prompts: log-prob of each taken token, per-token divergence to the cached teacher,
    and (for --topk_from student) its own top-k ids."""
    token_logp = torch.zeros(cache.n_tokens)
    div = torch.zeros(cache.n_tokens)
    support = torch.zeros((cache.n_tokens, rsd.topk), dtype=torch.long) if topk_ids else None
    for row, z, tok in reply_logits(model, rows, pad_id, batch_size):
        index = torch.tensor(cache.rows_of(row), dtype=torch.long)
        token_logp[index] = torch.log_softmax(z, -1).gather(-1, tok[:, None])[:, 0]
        if support is not None:
            support[index] = z.topk(rsd.topk, dim=-1).indices
        else:
            div[index] = topk_divergence(z, *cache.topk_rows(index), rsd.kl, rsd.kl_beta, rsd.topk_tail)
    return {"token_logp": token_logp, "divergence": div, "support": support}


# ---------------------------------------------------------------------------------------------------------------
# Samples: the student's plain rows (with cache indices) and the teacher's context rows


def student_samples(renderer: Any, trajs: Sequence[Trajectory], cache: TeacherCache, window: int,
                    max_length: int) -> list[StepSample]:
    """Training rows of the plain student prompt (prefix='' by construction), each reply token labelled with its
    row in the teacher cache."""
    out = []
    for i, traj in enumerate(trajs):
        for sample in trajectory_samples(renderer, traj, i, window, max_length):
            sample.token_labels["tk_index"] = [float(r) for r in cache.rows_of(sample)]
            out.append(sample)
    return out


def teacher_rows(renderer: Any, trajs: Sequence[Trajectory], contexts: Sequence[Sequence[str]], position: str,
                 window: int, max_length: int) -> tuple[list[StepSample], int]:
    """Rows of (C_t placed at position ⊕ student prompt ⊕ a_t) for every episode; also how many were cut."""
    rows, cut = [], 0
    for i, (traj, ctxs) in enumerate(zip(trajs, contexts, strict=True)):
        r, c = context_rows(renderer, traj, i, window, max_length, ctxs, position)
        rows += r
        cut += c
    return rows, cut


# ---------------------------------------------------------------------------------------------------------------
# Helpers


def eval_splits(cfg: Any) -> list[str]:
    """The report's splits plus the schedule's metric split."""
    return list(dict.fromkeys([*cfg.eval.splits, cfg.rsd.metric_split]))


def _round_of(traj: Trajectory) -> int:
    return int(str(traj.meta.get("collection", "round-0/")).split("/")[0].split("-")[1])


def load_bank(run: Run, up_to: int) -> list[Trajectory]:
    """B: every acted trajectory of rounds 1..up_to."""
    return [t for t in run.store.load(prefix="round-") if t.meta.get("collection", "").endswith("/act")
            and _round_of(t) <= up_to]


def _token_counter(tokenizer: Any) -> Callable[[str], int]:
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0


# ---------------------------------------------------------------------------------------------------------------
# The base: BC warm start, and for tiny models a context-aware warm start (methods-spec §7 item 9)


def round_tasks(run: Run, r: int) -> list[Task]:
    """The training tasks RSD's round r plays (baselines play round 1's, so they spend rollouts on the same tasks)."""
    return sample_tasks(list(run.tasks("train")), run.cfg.rsd.tasks_per_round, random.Random(run.cfg.seed * 1000 + r))


def sampling_actor(run: Run, checkpoint: str, seed: int) -> PolicyActor:
    """The checkpoint acting at RSD's rollout temperature (on model.backend)."""
    cfg = run.cfg
    sampling = Sampling(cfg.rsd.rollout_temperature, cfg.rollout.top_p, cfg.agent.max_new_tokens, seed=seed)
    return PolicyActor(run.rollout_policy(checkpoint), run.signal_env.instruction(), cfg.agent.history_window,
                       sampling)


CTX_WARM_START_PHASES = (*WARM_START_PHASES, "ctx-bc", "eval/ctx-bc")
# the rsd settings that shape the context-aware warm start; the rule's whitelisted knobs (components, n_prec,
# retrieval, position, teacher_temp) are not among them: ablations and rule search keep their base model, as in
# the paper, whose every arm starts from the same instruction-tuned model
CTX_WARM_START_KEYS = ("ctx_warm_start", "ctx_warm_fraction", "ctx_warm_keep_plain", "ctx_warm_steps", "ctx_warm_epochs",
                       "ctx_warm_same_task", "ctx_warm_detours", "ctx_warm_detour_prob", "match_on", "prec_format",
                       "future_max_steps", "ctx_max_tokens", "lessons_per_outcome", "writer")
DETOUR_COLLECTION = "expert-detour"


def source_has_ctx_base(source: Path) -> bool:
    state_path = source / "state.json"
    return state_path.exists() and "ctx-bc" in json.loads(state_path.read_text())


def import_ctx_warm_start(run: Run, source: Path) -> dict[str, Any]:
    """bc.warm_start_from for the RSD table: a run that finished the context-aware warm start gives its demos, BC
    and ctx-bc (so every arm and seed of a study starts from one base)."""
    return import_warm_start(run, source, "expert", CTX_WARM_START_PHASES, {"rsd": CTX_WARM_START_KEYS},
                             checkpoints=("init", "bc", "ctx-bc"))


def collect_detour_demos(run: Run) -> dict[str, Any]:
    """The gold plans replayed with scripted wasted steps (Self-Guide's demo detours, without guide lines)."""
    cfg = run.cfg
    actor = GuidedExpertActor(cfg.agent.thoughts, cfg.rsd.ctx_warm_detour_prob, cfg.seed, with_guide=False,
                              position="before")
    tasks = run.tasks("train", cfg.bc.n_expert)
    trajs = run.collect(actor, [EpisodeRequest(t, k) for k, t in enumerate(tasks)], DETOUR_COLLECTION,
                        "expert demos with detours")
    return {**summarize(trajs), "detours": sum(len(t.meta.get("detours", [])) for t in trajs)}


def detour_rows(renderer: Any, twin: Trajectory, index: int, window: int, max_length: int, contexts: Sequence[str],
                position: str, steps: Sequence[int]) -> list[StepSample]:
    """Context rows at a replay's wasted steps whose target is the next (useful) action: the context's future shows
    the wasted step's outcome and what came next, so a model trained on them learns what hindsight reveals about a
    mistake. Each row gets its own copy of the trajectory, so later rows keep the true history."""
    rows: list[StepSample] = []
    for t in steps:
        wasted, useful = twin.steps[t - 1], twin.steps[t]
        target = dataclasses.replace(wasted, action_text=useful.action_text, action_ids=list(useful.action_ids))
        fixed = dataclasses.replace(twin, steps=[*twin.steps[: t - 1], target, *twin.steps[t:]])
        rows += context_rows(renderer, fixed, index, window, max_length, contexts, position, steps=[t])[0]
    return rows


def prepare_base(run: Run) -> tuple[str, dict[str, Any]]:
    """warm_start (expert demos -> BC); with rsd.ctx_warm_start, a further pass on plain + context demos.

    Returns the base checkpoint's name ('bc' or 'ctx-bc') and the phase results. Every RSD-table recipe starts
    from this base so their numbers compare. bc.warm_start_from may name a plain BC run (this run then makes its
    own ctx-bc) or an RSD-table run that already made ctx-bc (imported).
    """
    source = Path(run.cfg.bc.warm_start_from) if run.cfg.bc.warm_start_from else None
    if source is not None and run.cfg.rsd.ctx_warm_start and source_has_ctx_base(source):
        run.phase("warm_start_from", lambda: import_ctx_warm_start(run, source))
    results = warm_start(run)
    if not run.cfg.rsd.ctx_warm_start:
        return "bc", results
    if run.cfg.rsd.ctx_warm_detours > 0 and "ctx-bc" not in run.state:
        results[DETOUR_COLLECTION] = run.phase(DETOUR_COLLECTION, lambda: collect_detour_demos(run))
    results["ctx-bc"] = run.phase("ctx-bc", lambda: context_warm_start(run, "bc", "ctx-bc"), all_ranks=True)
    results["eval/ctx-bc"] = run.phase("eval/ctx-bc", lambda: run.evaluate(run.rollout_policy("ctx-bc"), "ctx-bc"))
    return "ctx-bc", results


def context_warm_start(run: Run, start: str, name: str) -> dict[str, Any]:
    """BC on every demo plainly plus, for a fraction of demos, a few steps carrying a privileged context built with
    the same rule and rendering the teacher will use: precedents (the demo's own task as a solved earlier attempt
    with probability ctx_warm_same_task, else the most similar other demos), rule-written lessons and reflection,
    and the future hindsight of that step. With ctx_warm_detours, some of those demos are replaced by their replay
    with scripted wasted steps, and the rows sit at the wasted steps with the next useful action as the target.
    Saves checkpoints/<name>."""
    cfg, rsd = run.cfg, run.cfg.rsd
    rng = random.Random(cfg.seed + 17)
    demos = [t for t in run.store.load(collection="expert") if t.success]
    policy = run.load_policy(start)
    ensure_reply_ids(policy, demos)
    rule, writer = ContextRule.from_config(rsd), RuleWriter()
    lessons = {tt: writer.lessons(tt, [d for d in demos if d.task.task_type == tt][: rsd.lessons_per_outcome], [])
               for tt in {d.task.task_type for d in demos}}
    twins = {t.task.task_id: t for t in run.store.load(collection=DETOUR_COLLECTION)} if rsd.ctx_warm_detours else {}
    ensure_reply_ids(policy, list(twins.values()))
    # Demos taught only with context: their answer is in no plain row, so the context rows cannot be fitted by
    # recalling what the plain rows teach (the tiny model otherwise memorises task -> answer and never reads).
    # A separate stream, so ctx_warm_keep_plain=1 leaves the draws (and the base) as they were.
    plain_rng = random.Random(cfg.seed + 23)
    samples: list[StepSample] = []
    n_ctx = n_detour = 0
    ctx_only: set[int] = set()
    for k, demo in enumerate(demos):
        if rng.random() >= rsd.ctx_warm_fraction or not demo.steps:
            continue
        if rsd.ctx_warm_keep_plain < 1.0 and plain_rng.random() >= rsd.ctx_warm_keep_plain:
            ctx_only.add(k)
        # the episode the rows are cut from: the clean demo, or its replay with wasted steps
        twin = twins.get(demo.task.task_id)
        wasted = [t for t in (twin.meta.get("detours", []) if twin else []) if t < twin.length]
        played = twin if twin is not None and wasted and rng.random() < rsd.ctx_warm_detours else demo
        text = match_text(demo.goal, demo.first_obs, rsd.match_on)
        others = rank_precedents(demos, text, rule.n_prec, rule.retrieval, exclude=[demo.meta["store_id"]],
                                 match_on=rsd.match_on, rng=rng)
        precs = ([demo, *others] if rng.random() < rsd.ctx_warm_same_task else others)[: rule.n_prec]
        reflection = writer.reflection(played)
        ctxs = [clip_tokens(assemble_context(rule, precs, lessons[demo.task.task_type], reflection,
                                             future_hindsight(played, s.t, rsd.future_max_steps),
                                             rsd.prec_format).render(), policy.tokenizer, rsd.ctx_max_tokens)
                for s in played.steps]
        if played is twin:
            steps = rng.sample(wasted, min(rsd.ctx_warm_steps, len(wasted)))
            rows = detour_rows(policy.renderer, played, len(demos) + k, cfg.agent.history_window,
                               cfg.optim.max_length, ctxs, rule.position, steps)
            n_detour += len(rows)
        else:
            steps = rng.sample([s.t for s in demo.steps], min(rsd.ctx_warm_steps, demo.length))
            rows, _ = context_rows(policy.renderer, demo, len(demos) + k, cfg.agent.history_window,
                                   cfg.optim.max_length, ctxs, rule.position, steps=steps)
        samples += rows
        n_ctx += len(rows)
    plain = expert_samples(policy, [d for k, d in enumerate(demos) if k not in ctx_only], cfg.agent.history_window,
                           cfg.optim.max_length)
    samples = plain + samples
    optim = dataclasses.replace(cfg.optim, epochs=rsd.ctx_warm_epochs)
    stats = finetune(run, policy, samples, nll_loss, name, optim=optim)
    return {**stats, "samples": len(samples), "context_rows": n_ctx, "detour_rows": n_detour,
            "context_only_demos": len(ctx_only)}


# ---------------------------------------------------------------------------------------------------------------
# The rounds


def run(run: Run) -> dict[str, Any]:
    """RSD end to end: base, R rounds, internalisation; returns the evaluation table and per-round records."""
    base, results = prepare_base(run)
    return {**results, **rsd_rounds(run, base)}


def gold_context(gold: Trajectory, fmt: str) -> str:
    """GT-OPSD's privileged context: the task's gold trajectory."""
    return "Privileged notes:\nGold trajectory for this task: " + render_precedent(gold, 1, fmt).split(": ", 1)[-1]


def rsd_rounds(run: Run, base: str, label: str = "rsd", gold: dict[str, Trajectory] | None = None) -> dict[str, Any]:
    """R rounds of act -> context -> teacher top-k -> forward-KL update -> eval -> schedule -> rule search.

    With `gold` (task id -> gold trajectory) the teacher reads the gold trajectory instead of the retrospective
    context (GT-OPSD) and rule search is off.
    """
    cfg, rsd = run.cfg, run.cfg.rsd
    splits = eval_splits(cfg)
    window = cfg.agent.history_window
    results: dict[str, Any] = {}
    results["eval/base"] = run.phase("eval/base", lambda: run.evaluate(run.rollout_policy(base), base, splits))
    m0 = results["eval/base"][rsd.metric_split]["success_rate"]
    teacher = TeacherState(base, False, m0, 0, base)
    rule0 = ContextRule.from_config(rsd)
    rule_state: dict[str, Any] = {"current": rule0.to_dict(), "fallback": rule0.to_dict(), "candidate": False,
                                  "best": m0, "history": []}
    # GT-OPSD can only teach tasks that have a completed gold trajectory.
    train_tasks = [t for t in run.tasks("train") if gold is None or t.task_id in gold]
    student = base
    for r in range(1, rsd.rounds + 1):
        rule = ContextRule.from_dict(rule_state["current"])
        work = run.dir / label / f"round-{r}"
        # 1-2. sample tasks; the student acts, one trajectory per task
        tasks = sample_tasks(train_tasks, rsd.tasks_per_round, random.Random(cfg.seed * 1000 + r))

        def act(student: str = student, tasks: list[Task] = tasks, r: int = r) -> dict[str, Any]:
            policy = run.load_policy(student)
            sampling = Sampling(rsd.rollout_temperature, cfg.rollout.top_p, cfg.agent.max_new_tokens,
                                seed=cfg.seed * 7919 + r)
            actor = PolicyActor(policy, run.signal_env.instruction(), window, sampling)
            trajs = run.collect(actor, [EpisodeRequest(t, k) for k, t in enumerate(tasks)], f"round-{r}/act",
                                f"round {r}: act")
            return summarize(trajs)

        act_stats = run.phase(f"round-{r}/act", act)
        trajs = run.store.load(collection=f"round-{r}/act")

        # 3. context material from the accumulated bank
        def context(student: str = student, trajs: list[Trajectory] = trajs, r: int = r,
                    rule: ContextRule = rule, work: Path = work) -> dict[str, Any]:
            return _build_context(run, r, student, trajs, rule, work)

        ctx_stats = {} if gold is not None else run.phase(f"round-{r}/context", context)

        # 4-5. teacher top-k under the privileged context, cached to disk
        def teach(student: str = student, trajs: list[Trajectory] = trajs, rule: ContextRule = rule,
                  teacher_ckpt: str = teacher.ckpt, work: Path = work, r: int = r) -> dict[str, Any]:
            stats = _score_round(run, r, trajs, rule, teacher_ckpt, student, work, gold)
            premise = {k: stats[k] for k in PREMISE_KEYS if stats.get(k) is not None}
            if r == 1:  # teacher and student are the same weights here: the context is the only difference
                run.logger.log(f"diag/{label}", 0, premise)
                check_premise(premise, rsd.premise_stop)
            else:  # a later teacher: does it still read its context as well as round 1's did?
                first = run.state.get("round-1/teacher", {}).get("separation")
                run.logger.log(f"diag/{label}", r - 1, {**premise, **({} if first is None else
                                                                       {"separation_round1": first})})
            return stats

        teach_stats = run.phase(f"round-{r}/teacher", teach)

        # 6-7. forward-KL update of the student on its plain prompts
        def update(student: str = student, trajs: list[Trajectory] = trajs, work: Path = work,
                   r: int = r) -> dict[str, Any]:
            return _update_round(run, r, trajs, student, work)

        update_stats = run.phase(f"round-{r}/update", update, all_ranks=True)
        student = f"round-{r}"

        # 8. evaluation without context; teacher schedule; rule search
        def evaluate(r: int = r) -> dict[str, Any]:
            return run.evaluate(run.rollout_policy(f"round-{r}"), f"round-{r}", splits)

        results[f"eval/round-{r}"] = run.phase(f"eval/round-{r}", evaluate)
        metric = results[f"eval/round-{r}"][rsd.metric_split]["success_rate"]

        def schedule(state: TeacherState = teacher, r: int = r, metric: float = metric) -> dict[str, Any]:
            new = update_teacher(state, r, metric, f"round-{r}", rsd.teacher)
            if rsd.teacher == "ema":
                _write_ema_teacher(run, state.ckpt, f"round-{r}", new.ckpt, rsd.ema_decay)
            return new.to_dict()

        teacher = TeacherState.from_dict(run.phase(f"round-{r}/schedule", schedule))

        def search(state: dict[str, Any] = rule_state, r: int = r, metric: float = metric) -> dict[str, Any]:
            return _rule_step(run, r, state, metric, label, enabled=gold is None)

        rule_state = run.phase(f"round-{r}/rule", search)
        record = _round_record(results[f"eval/round-{r}"], act_stats, ctx_stats, teach_stats, update_stats,
                               teacher, rule_state, rule)
        run.logger.log(f"{label}/round", r, record)
        results[f"{label}/round-{r}"] = record

    # Internalisation [S]: success(evolved, no context) - success(base, with context); context = what exists
    # before acting (precedents + lessons), at the rule's position.
    if rsd.internalisation and gold is None:
        results.update(_with_context_evals(run, base, student, rule_state, splits, label))
    return results


def _build_context(run: Run, r: int, student: str, trajs: list[Trajectory], rule: ContextRule,
                   work: Path) -> dict[str, Any]:
    """Phase round-r/context: material.json (lessons, reflections, precedent ids) and its statistics."""
    cfg, rsd = run.cfg, run.cfg.rsd
    # --refresh: which parts follow the growing bank; the frozen ones stay at round 1 [S ablation].
    prec_round = r if rsd.refresh in ("all", "precedents_only") else 1
    refresh_lessons = rsd.refresh in ("all", "lessons_only") or r == 1
    previous = {}
    if r > 1:
        previous = Material.from_json(json.loads((work.parent / f"round-{r - 1}" / "material.json").read_text())).lessons
    bank = load_bank(run, prec_round)
    policy = run.load_policy(student) if rsd.writer == "policy" else None
    writer = make_writer(rsd, policy)
    material = build_material(trajs, bank, writer, rule, rsd, random.Random(cfg.seed * 31 + r), previous,
                              refresh_lessons, fts=lambda text: run.store.search_goals(text, limit=500))
    write_text_atomic(work / "material.json", json.dumps({**material.to_json(), "bank_round": prec_round}, indent=1))
    n = max(1, len(trajs))
    same = sum(bool(ids) and any(b.meta["store_id"] == ids[0] and b.task.task_id == t.task.task_id for b in bank)
               for t, ids in ((t, material.precedents[t.meta["store_id"]]) for t in trajs))
    return {"bank": len(bank), "bank_success": sum(t.success for t in bank), "lessons": len(material.lessons),
            "with_precedent": sum(bool(v) for v in material.precedents.values()) / n, "top_is_same_task": same / n}


def _round_contexts(run: Run, r: int, trajs: list[Trajectory], rule: ContextRule, work: Path, tokenizer: Any,
                    gold: dict[str, Trajectory] | None) -> tuple[list[list[str]], dict[str, float]]:
    """C_t for every step of every episode, clipped to ctx_max_tokens, and the mean size of each component."""
    rsd = run.cfg.rsd
    count = _token_counter(tokenizer)
    if gold is not None:
        out = [[clip_tokens(gold_context(gold[t.task.task_id], rsd.prec_format), tokenizer, rsd.ctx_max_tokens)]
               * t.length for t in trajs]
        sizes = [count(c[0]) for c in out if c]
        return out, {"ctx_tokens": sum(sizes) / max(1, len(sizes))}
    data = json.loads((work / "material.json").read_text())
    material = Material.from_json(data)
    bank_by_id = {t.meta["store_id"]: t for t in load_bank(run, int(data["bank_round"]))}
    out, totals, n_steps = [], {"prec": 0, "lessons": 0, "reflect": 0, "future": 0, "total": 0}, 0
    for traj in trajs:
        parts = step_contexts(traj, material, bank_by_id, rule, rsd)
        texts = [clip_tokens(p.render(), tokenizer, rsd.ctx_max_tokens) for p in parts]
        out.append(texts)
        for p, text in zip(parts, texts, strict=True):
            for key, v in p.lengths(count).items():
                totals[key] += v
            totals["total"] += count(text)
            n_steps += 1
    return out, {f"ctx_tokens_{k}": v / max(1, n_steps) for k, v in totals.items()}


def _score_round(run: Run, r: int, trajs: list[Trajectory], rule: ContextRule, teacher_ckpt: str, student: str,
                 work: Path, gold: dict[str, Trajectory] | None) -> dict[str, Any]:
    """Phase round-r/teacher: teacher top-k per reply token (no grad) -> work/teacher_topk.pt, plus diagnostics."""
    cfg, rsd = run.cfg, run.cfg.rsd
    window, max_length, bs = cfg.agent.history_window, cfg.optim.max_length, cfg.optim.micro_batch_size
    student_policy = run.load_policy(student)
    teacher_policy = student_policy if teacher_ckpt == student else run.load_policy(teacher_ckpt)
    contexts, ctx_stats = _round_contexts(run, r, trajs, rule, work, teacher_policy.tokenizer, gold)
    rows, cut = teacher_rows(teacher_policy.renderer, trajs, contexts, rule.position, window, max_length)
    cache = TeacherCache.empty(trajs, rsd.topk)
    plain = student_samples(student_policy.renderer, trajs, cache, window, max_length)
    support = None
    if rsd.topk_from == "student":
        support = student_pass(student_policy.model, plain, cache, student_policy.pad_id, bs, rsd, topk_ids=True)["support"]
    score_teacher(teacher_policy.model, rows, cache, rsd.topk, rule.teacher_temp, teacher_policy.pad_id, bs, support)
    cache.compact_()  # kl_pre and the update read the same (float16) values
    pre = student_pass(student_policy.model, plain, cache, student_policy.pad_id, bs, rsd)
    cache.student_token_logp = pre["token_logp"]
    cache.save(work / "teacher_topk.pt")
    taken = torch.tensor([tok for t in trajs for s in t.steps for tok in s.action_ids], dtype=torch.long)
    ids, logp = cache.topk_rows(torch.arange(cache.n_tokens))
    top1 = ids.gather(-1, logp.argmax(-1, keepdim=True))[:, 0]
    return {
        "teacher": teacher_ckpt, "rule": rule.to_dict(), "tokens": cache.n_tokens, "cache_bytes": cache.nbytes(),
        "teacher_rows": len(rows), "teacher_rows_cut": cut, "kl_pre": float(pre["divergence"].mean()),
        "top1_mismatch": float((top1 != taken).float().mean()) if len(taken) else 0.0,
        "teacher_token_logp": float(cache.teacher_token_logp.mean()),
        "student_token_logp": float(cache.student_token_logp.mean()), **flagged_step_auc(cache, trajs),
        **outcome_separation(cache, trajs), **ctx_stats,
    }


def _update_round(run: Run, r: int, trajs: list[Trajectory], student: str, work: Path) -> dict[str, Any]:
    """Phase round-r/update: one epoch of the distillation loss; saves checkpoints/round-r; Δlog p diagnostics."""
    cfg, rsd = run.cfg, run.cfg.rsd
    cache = TeacherCache.load(work / "teacher_topk.pt")
    policy = run.load_policy(student)
    samples = student_samples(policy.renderer, trajs, cache, cfg.agent.history_window, cfg.optim.max_length)
    optim = dataclasses.replace(cfg.optim, lr=rsd.lr, epochs=rsd.epochs)
    loss_fn = make_distill_loss(cache, rsd.kl, rsd.kl_beta, rsd.topk_tail)
    stats = finetune(run, policy, samples, loss_fn, f"round-{r}", optim=optim, seed=cfg.seed + r,
                     log_phase=f"round-{r}/train", reload_after=True)
    post = student_pass(policy.model, samples, cache, policy.pad_id, cfg.optim.micro_batch_size, rsd)
    return {**stats, "samples": len(samples), "kl_post": float(post["divergence"].mean()),
            **delta_logp(cache, post["token_logp"])}


def delta_logp(cache: TeacherCache, after: torch.Tensor) -> dict[str, float]:
    """Δlog p per step = log pi_{r+1}(a_t|h_t) - log pi_r(a_t|h_t), averaged over teacher-disfavoured steps
    (log p_T(a_t) < log p_S(a_t), sums over the reply's tokens) and over the others [S §4.6]."""
    dis, fav = [], []
    for start, n in cache.offsets.values():
        if n == 0:
            continue
        sl = slice(start, start + n)
        change = float(after[sl].sum() - cache.student_token_logp[sl].sum())
        (dis if cache.teacher_token_logp[sl].sum() < cache.student_token_logp[sl].sum() else fav).append(change)
    return {"dlogp_disfavoured": sum(dis) / len(dis) if dis else 0.0,
            "dlogp_favoured": sum(fav) / len(fav) if fav else 0.0,
            "disfavoured_steps": len(dis), "favoured_steps": len(fav)}


def step_gaps(cache: TeacherCache, trajs: Sequence[Trajectory]) -> Iterator[tuple[Trajectory, Step, float]]:
    """Per step with reply tokens: (trajectory, step, log p_T(a_t) - log pi_r(a_t)), sums over the reply's tokens."""
    for i, traj in enumerate(trajs):
        for s in traj.steps:
            start, n = cache.offsets[(i, s.t)]
            if n:
                sl = slice(start, start + n)
                yield traj, s, float(cache.teacher_token_logp[sl].sum() - cache.student_token_logp[sl].sum())


def flagged_step_auc(cache: TeacherCache, trajs: Sequence[Trajectory]) -> dict[str, float | int | None]:
    """Does the teacher's re-scoring flag the student's mistakes? Per step, the teacher's disfavour
    log pi_r(a_t) - log p_T(a_t) (sums over the reply's tokens); the AUC of it for the steps the environment flagged
    (invalid, repeated or malformed actions) against the others: 0.5 = blind to them, 1 = disfavours every flagged
    step more than any other."""
    disfavour, flagged = [], []
    for _, step, gap in step_gaps(cache, trajs):
        disfavour.append(-gap)
        flagged.append(step.signal != SIGNAL_NONE)
    return {"teacher_auc_flagged": auc(disfavour, flagged), "flagged_steps": sum(flagged)}


def outcome_separation(cache: TeacherCache, trajs: Sequence[Trajectory]) -> dict[str, float | int | None]:
    """Does the context make the teacher prefer what succeeded? Per step, gap = log p_T(a_t) - log pi_r(a_t) (sums
    over the reply's tokens); its mean over the steps of successful episodes (success_gap), of failed ones
    (failure_gap), and separation = success_gap - failure_gap. A teacher that reads the answer raises the student's
    right actions and lowers its wrong ones: separation > 0. The mean over all sampled tokens (teacher_token_logp)
    cannot show this: most samples of a weak student are wrong, so a teacher that knows the answer lowers it."""
    gaps: dict[bool, list[float]] = {True: [], False: []}
    for traj, _, gap in step_gaps(cache, trajs):
        gaps[bool(traj.success)].append(gap)
    win = sum(gaps[True]) / len(gaps[True]) if gaps[True] else None
    lose = sum(gaps[False]) / len(gaps[False]) if gaps[False] else None
    return {"success_gap": win, "failure_gap": lose,
            "separation": win - lose if win is not None and lose is not None else None,
            "success_steps": len(gaps[True]), "failure_steps": len(gaps[False])}


PREMISE_KEYS = ("teacher_token_logp", "student_token_logp", "teacher_auc_flagged", "success_gap", "failure_gap",
                "separation", "success_steps", "failure_steps")


def check_premise(values: dict[str, Any], stop: bool) -> None:
    """RSD's premise before the first update: the teacher with the context is better than the student without it.
    Judged by the outcome separation (the teacher raises successful actions more than failed ones relative to the
    student) when the round has both outcomes; else, as before, by the mean log-prob of the student's own reply
    tokens. Warn in the report (diag/rsd); with `stop` (rsd.premise_stop) raise instead of distilling from a
    teacher that is not better."""
    if not stop:
        return
    if values.get("separation") is not None:
        if values["separation"] <= 0:
            raise AgentevoError(
                f"rsd premise fails: relative to the student, the teacher with context does not favour the round-1 "
                f"steps of successful episodes over those of failed ones (separation {values['separation']:.3f} "
                "nats per step); fix the context (rsd.ctx_*, rsd.ctx_warm_start) or set rsd.premise_stop=false to "
                "distil anyway")
        return
    if "teacher_token_logp" not in values or "student_token_logp" not in values:
        return
    gap = values["teacher_token_logp"] - values["student_token_logp"]
    if gap < 0:
        raise AgentevoError(
            f"rsd premise fails: the teacher with context gives the round-1 replies a lower mean token log-prob "
            f"({values['teacher_token_logp']:.3f}) than the student without it ({values['student_token_logp']:.3f}); "
            "fix the context (rsd.ctx_*, rsd.ctx_warm_start) or set rsd.premise_stop=false to distil anyway")


def _write_ema_teacher(run: Run, teacher_ckpt: str, student_ckpt: str, out: str, decay: float) -> None:
    """teacher <- decay * teacher + (1 - decay) * student, saved as checkpoints/<out>."""
    teacher, student = run.load_policy(teacher_ckpt, out), run.load_policy(student_ckpt)
    losses.polyak_update(teacher.model.parameters(), student.model.parameters(), 1.0 - decay)
    teacher.save(run.checkpoint_dir(out))


def _rule_step(run: Run, r: int, state: dict[str, Any], metric: float, label: str, enabled: bool) -> dict[str, Any]:
    """Accept or revert the rule the round used (success >= best - 0.5 pt), then propose and probe the next one."""
    rsd = run.cfg.rsd
    history = [*state["history"], {"round": r, "rule": state["current"], "success": metric}]
    if state["candidate"]:
        keep = accept_rule(metric, state["best"], rsd.accept_margin)
        decision, accepted = ("kept" if keep else "reverted"), (state["current"] if keep else state["fallback"])
    else:
        decision, accepted = "fixed", state["current"]
    out = {"current": accepted, "fallback": accepted, "candidate": False, "best": max(state["best"], metric),
           "history": history, "decision": decision, "proposal": None, "probe": {}}
    if not enabled or rsd.rule_search == "off" or r >= rsd.rounds:
        return out
    proposer = RandomProposer(run.cfg.seed * 101 + r) if rsd.rule_search == "random" else \
        LLMProposer(http_client_from_config(rsd), rsd.writer_max_tokens)
    current = ContextRule.from_dict(accepted)
    cand = proposer.propose(current, history)
    if cand is None or cand == current:
        return out
    out["proposal"] = cand.to_dict()
    take = True
    if rsd.probe:
        policy = run.load_policy(f"round-{r}")
        earlier = run.store.load(collection=f"round-{r}/act")
        earlier = random.Random(run.cfg.seed + r).sample(earlier, min(rsd.probe_tasks, len(earlier)))
        work = run.dir / label / f"round-{r}"
        data = json.loads((work / "material.json").read_text())
        bank, material = load_bank(run, int(data["bank_round"])), Material.from_json(data)
        p_cur = probe_rule(run, policy, current, earlier, bank, material, f"round-{r}/current")
        p_cand = probe_rule(run, policy, cand, earlier, bank, material, f"round-{r}/candidate")
        out["probe"] = {"current": p_cur, "candidate": p_cand}
        take = p_cand >= p_cur
    if take:
        out["current"], out["candidate"] = cand.to_dict(), True
    return out


def _with_context_evals(run: Run, base: str, student: str, rule_state: dict[str, Any], splits: list[str],
                        label: str) -> dict[str, Any]:
    """eval/base+ctx (internalisation) and, with --infer_ctx, eval/final+ctx ('context added back')."""
    rsd = run.cfg.rsd
    rule = ContextRule.from_dict(rule_state["current"])
    data = json.loads((run.dir / label / f"round-{rsd.rounds}" / "material.json").read_text())
    bank = load_bank(run, rsd.rounds)
    out: dict[str, Any] = {}
    diag_label = label  # the loop below reuses the name `label`
    targets = [("base+ctx", base)] + ([("final+ctx", student)] if rsd.infer_ctx else [])
    for label, ckpt in targets:
        def ev(ckpt: str = ckpt, label: str = label) -> dict[str, Any]:
            policy = run.load_policy(ckpt)
            fn = pre_action_context_fn(bank, data["lessons"], rule, rsd, policy.tokenizer)
            res = evaluate_with_context(run, policy, label, splits, fn, rule.position)
            plain = run.state.get("eval/base", {}).get(rsd.metric_split)
            if label == "base+ctx" and plain and rsd.metric_split in res:  # the premise in success: C helps base
                run.logger.log(f"diag/{diag_label}", 0, {"success_base": plain["success_rate"],
                                                         "success_base_ctx": res[rsd.metric_split]["success_rate"]})
            return res

        out[f"eval/{label}"] = run.phase(f"eval/{label}", ev)
    final = run.state.get(f"eval/{student}", {})
    out["internalisation"] = {s: final[s]["success_rate"] - out["eval/base+ctx"][s]["success_rate"]
                              for s in splits if s in final}
    run.logger.log("rsd/internalisation", 0, out["internalisation"])
    return out


def _round_record(ev: dict[str, Any], act: dict[str, Any], ctx: dict[str, Any], teach: dict[str, Any],
                  upd: dict[str, Any], teacher: TeacherState, rule_state: dict[str, Any],
                  rule: ContextRule) -> dict[str, Any]:
    """The fixed per-round metric names of §4.6."""
    rec: dict[str, Any] = {f"success_{s}": m["success_rate"] for s, m in ev.items()}
    rec.update({
        "act_success": act.get("success_rate", 0.0), "teacher_ckpt": teach.get("teacher", ""),
        "next_teacher_ckpt": teacher.ckpt, "teacher_frozen": int(teacher.frozen),
        "kl_pre": teach.get("kl_pre", 0.0), "kl_post": upd.get("kl_post", 0.0), "loss": upd.get("loss", 0.0),
        "top1_mismatch": teach.get("top1_mismatch", 0.0), "teacher_auc_flagged": teach.get("teacher_auc_flagged"),
        "dlogp_disfavoured": upd.get("dlogp_disfavoured", 0.0), "dlogp_favoured": upd.get("dlogp_favoured", 0.0),
        "disfavoured_steps": upd.get("disfavoured_steps", 0), "cache_bytes": teach.get("cache_bytes", 0),
        "rule": json.dumps(rule.to_dict(), sort_keys=True), "rule_decision": rule_state.get("decision", "fixed"),
        "probe_current": rule_state.get("probe", {}).get("current", -1.0),
        "probe_candidate": rule_state.get("probe", {}).get("candidate", -1.0),
        "top_is_same_task": ctx.get("top_is_same_task", 0.0),
    })
    rec.update({k: v for k, v in teach.items() if k.startswith("ctx_tokens")})
    return rec
