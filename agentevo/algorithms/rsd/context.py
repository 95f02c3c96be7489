"""RSD's privileged retrospective context (methods-spec §4.3 steps 3-4, §4.5).

Material rebuilt each round from the experience bank B:
    precedents P(u)   completed trajectories ranked by |CW(u) ∩ CW(u')| (content words of the goal), ties -> most
                      recent, top n_prec, the current episode excluded
    lessons L(type)   one per task type per round, written from that round's successes and failures
    reflection F(τ)   earliest critical mistake + better action, one per trajectory
    hindsight H_t(τ)  the interaction after step t verbatim (o_{t+1}, a_{t+1}, ..., o_{T+1}) + final feedback
A ContextRule (the only thing rule search may change) assembles C_t = rule(P, L, F, H_t) and places it in the
teacher's prompt. Also here: the whitelist, the random and LLM proposers, the acceptance test, and the
training-free probe.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentevo.agent.chat import Message
from agentevo.agent.prompt import HistoryTurn, build_messages
from agentevo.algorithms.rsd.config import POSITIONS, RETRIEVALS
from agentevo.algorithms.rsd.writers import outcome_text
from agentevo.data.store import content_words
from agentevo.data.tensors import StepSample
from agentevo.data.types import Trajectory
from agentevo.errors import ConfigError
from agentevo.models.backend import Sampling
from agentevo.rollout.engine import Episode, EpisodeRequest, PolicyActor

if TYPE_CHECKING:
    from agentevo.run import Run

# -- the rule and its whitelist (§4.5) ---------------------------------------------------------------------------

# The grid random search draws from; an LLM proposal may use any value inside the validated ranges.
WHITELIST: dict[str, tuple[Any, ...]] = {
    "n_prec": (0, 1, 2, 3, 4),
    "retrieval": RETRIEVALS,
    "use_prec": (True, False),
    "use_lessons": (True, False),
    "use_reflection": (True, False),
    "use_future": (True, False),
    "position": POSITIONS,
    "teacher_temp": (0.5, 0.7, 1.0, 1.5, 2.0),
}
_N_PREC_MAX = 8
_TEMP_RANGE = (0.25, 3.0)


@dataclass(frozen=True)
class ContextRule:
    """How the context is assembled: the whitelisted knobs, nothing about the training algorithm."""

    n_prec: int = 2
    retrieval: str = "content_overlap"
    use_prec: bool = True
    use_lessons: bool = True
    use_reflection: bool = True
    use_future: bool = True
    position: str = "before_history"
    teacher_temp: float = 1.0

    @classmethod
    def from_config(cls, rsd: Any) -> ContextRule:
        """The fixed rule of the config (rsd.components, n_prec, retrieval, position, teacher_temp)."""
        comps = set(rsd.components)
        return cls(rsd.n_prec, rsd.retrieval, "prec" in comps, "lessons" in comps, "reflect" in comps,
                   "future" in comps, rsd.position, float(rsd.teacher_temp))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ContextRule:
        """A validated rule from a mapping whose keys are whitelist names (missing keys keep the defaults)."""
        unknown = sorted(set(data) - set(WHITELIST))
        if unknown:
            raise ConfigError(f"rule key {unknown[0]!r} is not in the whitelist; allowed: {', '.join(WHITELIST)}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key == "n_prec":
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _N_PREC_MAX:
                    raise ConfigError(f"rule n_prec must be an integer in [0, {_N_PREC_MAX}] (got {value!r})")
            elif key == "teacher_temp":
                if isinstance(value, bool) or not isinstance(value, (int, float)) \
                        or not _TEMP_RANGE[0] <= value <= _TEMP_RANGE[1]:
                    raise ConfigError(f"rule teacher_temp must be a number in {list(_TEMP_RANGE)} (got {value!r})")
                value = float(value)
            elif key.startswith("use_"):
                if not isinstance(value, bool):
                    raise ConfigError(f"rule {key} must be true or false (got {value!r})")
            elif value not in WHITELIST[key]:
                raise ConfigError(f"rule {key} must be one of {', '.join(WHITELIST[key])} (got {value!r})")
            kwargs[key] = value
        return cls(**kwargs)


def accept_rule(success: float, best: float, margin_points: float = 0.5) -> bool:
    """Keep a rule if its round's success (rate) is >= the historical best minus margin_points percentage points."""
    # Compared in points, with a 1e-9 slack so a success exactly at the boundary is kept despite float rounding.
    return 100.0 * success >= 100.0 * best - margin_points - 1e-9


def random_rule(current: ContextRule, rng: random.Random) -> ContextRule:
    """A uniform draw from the whitelist grid, different from the current rule (the random-search proposer)."""
    for _ in range(100):
        cand = ContextRule(**{k: rng.choice(v) for k, v in WHITELIST.items()})
        if cand != current:
            return cand
    return current


def parse_rule_json(text: str) -> ContextRule:
    """The first JSON object in text, validated against the whitelist (ConfigError when it is not)."""
    match = re.search(r"\{.*\}", text, re.DOTALL)
    if match is None:
        raise ConfigError("the proposal holds no JSON object")
    try:
        data = json.loads(match.group(0))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"the proposal is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError("the proposal must be a JSON object")
    return ContextRule.from_dict(data)


PROPOSER_PROMPT = (
    "You tune how a privileged retrospective context is assembled for a self-distillation teacher. Only these "
    "fields may change (JSON types): n_prec (integer 0-8, number of precedent trajectories), retrieval "
    "(one of {retrievals}), use_prec / use_lessons / use_reflection / use_future (booleans: component "
    "switches), position (one of {positions}), teacher_temp (number {tmin}-{tmax}). The training algorithm "
    "cannot change.\n\nHistory of rules and the student's validation success after each round:\n{history}\n\n"
    "Current rule: {current}\n\nReply with one JSON object holding a new rule and nothing else."
)


class RandomProposer:
    """Uniform random search over the whitelist grid (the paper's same-budget baseline)."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def propose(self, current: ContextRule, history: list[dict[str, Any]]) -> ContextRule | None:
        return random_rule(current, self.rng)


class LLMProposer:
    """An LLM (behind an OpenAI-compatible endpoint) proposes one rule as JSON; invalid answers get one retry."""

    name = "frontier"

    def __init__(self, client: Any, max_tokens: int = 256) -> None:
        self.client, self.max_tokens = client, max_tokens
        self.last_error = ""

    def propose(self, current: ContextRule, history: list[dict[str, Any]]) -> ContextRule | None:
        prompt = PROPOSER_PROMPT.format(
            retrievals=", ".join(RETRIEVALS), positions=", ".join(POSITIONS), tmin=_TEMP_RANGE[0],
            tmax=_TEMP_RANGE[1], history=json.dumps(history, indent=None) if history else "(none yet)",
            current=json.dumps(current.to_dict()),
        )
        conv = [{"role": "user", "content": prompt}]
        for _ in range(2):
            answer = self.client.chat_many([conv], self.max_tokens)[0]
            try:
                return parse_rule_json(answer)
            except ConfigError as exc:
                self.last_error = str(exc)
                conv = conv + [{"role": "assistant", "content": answer},
                               {"role": "user", "content": f"Invalid: {exc}. Reply with a valid JSON rule only."}]
        return None  # no candidate this round; the current rule stays


# -- precedents ----------------------------------------------------------------------------------------------------


def match_text(goal: str, first_obs: str, match_on: str) -> str:
    """The text whose content words rank precedents: the goal [S], or goal + first observation [O]."""
    return goal if match_on == "goal" else f"{goal}\n{first_obs}"


def _store_id(traj: Trajectory) -> int:
    return int(traj.meta.get("store_id", 0))


def rank_precedents(
    bank: Sequence[Trajectory],
    text: str,
    n: int,
    retrieval: str = "content_overlap",
    exclude: Sequence[int] = (),
    match_on: str = "goal",
    rng: random.Random | None = None,
    fts_ids: Sequence[int] | None = None,
) -> list[Trajectory]:
    """Top-n completed trajectories of the bank for this text, the excluded store ids left out.

    content_overlap: score |CW(u) ∩ CW(u')|, ties -> most recent (largest store id) [S/O]; fts: the order of the
    store's full-text search (fts_ids, best first); random: a uniform sample [S ablation].
    """
    if n <= 0:
        return []
    excluded = set(exclude)
    # The filter [S]: only completed trajectories are precedents.
    cands = [t for t in bank if t.success and _store_id(t) not in excluded]
    if retrieval == "random":
        return (rng or random.Random(0)).sample(cands, min(n, len(cands)))
    if retrieval == "fts":
        by_id = {_store_id(t): t for t in cands}
        return [by_id[i] for i in (fts_ids or []) if i in by_id][:n]
    query = content_words(text)
    scored = sorted(
        cands,
        key=lambda t: (len(query & content_words(match_text(t.goal, t.first_obs, match_on))), _store_id(t)),
        reverse=True,
    )
    return scored[:n]


def render_precedent(traj: Trajectory, k: int, fmt: str = "actions") -> str:
    """One precedent: its goal and action list (compact), or the verbatim interaction (full)."""
    head = f"Precedent {k} (solved in {traj.length} steps; task: {traj.goal})"
    if fmt == "actions":
        return f"{head}: " + "; ".join(s.parsed_action or "(no action)" for s in traj.steps)
    lines = [head + ":", traj.first_obs]
    for s in traj.steps:
        lines += [s.action_text, f"Observation: {s.next_obs}"]
    return "\n".join(lines)


# -- future hindsight ----------------------------------------------------------------------------------------------


def future_hindsight(traj: Trajectory, t: int, max_steps: int | None = None) -> str:
    """H_t(τ): o_{t+1}, then (a_{t+1}, o_{t+2}), ... verbatim, and the final outcome; t=0 gives the whole episode.

    max_steps caps the later actions shown (None = all, as the paper [S]).
    """
    lines: list[str] = []
    if t >= 1:
        lines.append(f"Observation: {traj.steps[t - 1].next_obs}")
    later = traj.steps[t:]
    if max_steps is not None and len(later) > max_steps:
        later = later[:max_steps]
        cut = True
    else:
        cut = False
    for s in later:
        lines += [s.action_text, f"Observation: {s.next_obs}"]
    if cut:
        lines.append("(...)")
    lines.append(outcome_text(traj))
    return "\n".join(lines)


# -- assembling and placing the context ----------------------------------------------------------------------------

CONTEXT_HEADER = "Privileged notes (written after the episode):"


@dataclass
class ContextParts:
    """The four components of C_t as text (empty when off)."""

    precedents: list[str] = field(default_factory=list)
    lessons: str = ""
    reflection: str = ""
    future: str = ""
    future_label: str = "What happened after this step"

    def render(self) -> str:
        """C_t: a header and the components that are on, in the fixed order P, L, F, H."""
        parts = list(self.precedents)
        if self.lessons:
            parts.append(f"Lessons: {self.lessons}")
        if self.reflection:
            parts.append(f"Reflection: {self.reflection}")
        if self.future:
            parts.append(f"{self.future_label}:\n{self.future}")
        return "\n".join([CONTEXT_HEADER, *parts]) if parts else ""

    def lengths(self, count: Callable[[str], int]) -> dict[str, int]:
        """Size of each component (count = a token counter)."""
        return {"prec": sum(count(p) for p in self.precedents), "lessons": count(self.lessons),
                "reflect": count(self.reflection), "future": count(self.future)}


def assemble_context(
    rule: ContextRule,
    precedents: Sequence[Trajectory],
    lessons: str,
    reflection: str,
    future: str,
    prec_format: str = "actions",
    future_label: str = "What happened after this step",
) -> ContextParts:
    """C_t = rule(P, L, F, H_t): each component kept only when the rule switches it on."""
    return ContextParts(
        precedents=[render_precedent(p, k + 1, prec_format) for k, p in enumerate(precedents[: rule.n_prec])]
        if rule.use_prec else [],
        lessons=lessons if rule.use_lessons else "",
        reflection=reflection if rule.use_reflection else "",
        future=future if rule.use_future else "",
        future_label=future_label,
    )


def context_messages(
    instruction: str, goal: str, first_obs: str, history: list[HistoryTurn], window: int, context: str,
    position: str,
) -> list[Message]:
    """The student's messages with the context placed at `position` (no context = the student's prompt exactly)."""
    if not context:
        return build_messages(instruction, goal, first_obs, history, window)
    if position == "before_history":
        return build_messages(instruction, goal, first_obs, history, window, prefix=context)
    messages = build_messages(instruction, goal, first_obs, history, window)
    if position == "system":
        return [Message("system", context), *messages]
    if position == "before_current_step":
        if len(messages) == 1:  # the first step: the current observation is the task itself
            return build_messages(instruction, goal, first_obs, history, window, prefix=context)
        last = messages[-1]
        return [*messages[:-1], Message("user", f"{context}\n\n{last.text}")]
    raise ConfigError(f"unknown context position {position!r}; use one of {', '.join(POSITIONS)}")


def context_prompt_ids(renderer: Any, traj: Trajectory, t: int, window: int, context: str, position: str) -> list[int]:
    """Teacher prompt ids for step t of a stored trajectory: the student's prompt with the context placed in it."""
    history = [HistoryTurn(s.action_ids, s.next_obs) for s in traj.steps[: t - 1]]
    messages = context_messages(traj.instruction, traj.goal, traj.first_obs, history, window, context, position)
    return renderer.render(messages, add_generation_prompt=True).ids


def context_rows(
    renderer: Any,
    traj: Trajectory,
    traj_index: int,
    window: int,
    max_length: int,
    contexts: Sequence[str],
    position: str,
    steps: Sequence[int] | None = None,
) -> tuple[list[StepSample], int]:
    """Rows of (context ⊕ student prompt ⊕ a_t) for the chosen steps, packed when prompts are prefixes of each
    other (a context constant over the episode); returns the rows and how many were cut on the left."""
    chosen = [s for s in traj.steps if steps is None or s.t in steps]
    prompts = {s.t: context_prompt_ids(renderer, traj, s.t, window, contexts[s.t - 1], position) for s in chosen}
    if chosen and steps is None:
        last = chosen[-1]
        full = prompts[last.t] + list(last.action_ids)
        packable = all(full[: len(prompts[s.t]) + len(s.action_ids)] == prompts[s.t] + list(s.action_ids)
                       for s in chosen)
        if packable and len(full) <= max_length:
            spans = [(len(prompts[s.t]), len(prompts[s.t]) + len(s.action_ids)) for s in chosen]
            return [StepSample(full, spans, traj_index, [s.t for s in chosen])], 0
    rows, cut = [], 0
    for s in chosen:
        room = max_length - len(s.action_ids)
        if room < 1:
            raise ValueError(f"a reply of {len(s.action_ids)} tokens does not fit max_length={max_length}")
        prompt = prompts[s.t]
        if len(prompt) > room:
            cut += 1
            prompt = prompt[-room:]
        rows.append(StepSample(prompt + list(s.action_ids), [(len(prompt), len(prompt) + len(s.action_ids))],
                               traj_index, [s.t]))
    return rows, cut


def clip_tokens(text: str, tokenizer: Any, max_tokens: int | None) -> str:
    """Cut text to its first max_tokens tokens (None = unchanged)."""
    if max_tokens is None or not text:
        return text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens]) + " (...)"


# -- the round's material ------------------------------------------------------------------------------------------


@dataclass
class Material:
    """What one round's contexts are built from: lessons per type, reflections and precedents per episode."""

    lessons: dict[str, str] = field(default_factory=dict)
    reflections: dict[int, str] = field(default_factory=dict)  # store id -> F(τ)
    precedents: dict[int, list[int]] = field(default_factory=dict)  # store id -> precedent store ids, best first

    def to_json(self) -> dict[str, Any]:
        return {"lessons": self.lessons, "reflections": {str(k): v for k, v in self.reflections.items()},
                "precedents": {str(k): v for k, v in self.precedents.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Material:
        return cls(dict(data["lessons"]), {int(k): v for k, v in data["reflections"].items()},
                   {int(k): list(v) for k, v in data["precedents"].items()})


def lesson_inputs(
    trajs: Sequence[Trajectory], lessons_from: str, per_outcome: int, rng: random.Random
) -> dict[str, tuple[list[Trajectory], list[Trajectory]]]:
    """Per task type: up to per_outcome successes and failures of this round (as lessons_from allows) [S/O]."""
    out: dict[str, tuple[list[Trajectory], list[Trajectory]]] = {}
    for task_type in sorted({t.task.task_type for t in trajs}):
        of_type = [t for t in trajs if t.task.task_type == task_type]
        wins = [t for t in of_type if t.success] if lessons_from in ("both", "success") else []
        losses = [t for t in of_type if not t.success] if lessons_from in ("both", "failure") else []
        out[task_type] = (rng.sample(wins, min(per_outcome, len(wins))), rng.sample(losses, min(per_outcome, len(losses))))
    return out


def build_material(
    trajs: Sequence[Trajectory],
    bank: Sequence[Trajectory],
    writer: Any,
    rule: ContextRule,
    rsd: Any,
    rng: random.Random,
    previous_lessons: dict[str, str] | None = None,
    refresh_lessons: bool = True,
    fts: Callable[[str], list[int]] | None = None,
) -> Material:
    """Step 3: precedents for every episode of the round (own episode excluded), lessons per type, reflections."""
    material = Material(lessons=dict(previous_lessons or {}))
    if refresh_lessons or not material.lessons:
        for task_type, (wins, losses) in lesson_inputs(trajs, rsd.lessons_from, rsd.lessons_per_outcome, rng).items():
            material.lessons[task_type] = writer.lessons(task_type, wins, losses)
    tops: list[Trajectory | None] = []
    # Rank for the largest n any rule may ask for, so a candidate rule can reuse the list [O].
    depth = max(rule.n_prec, max(WHITELIST["n_prec"]))
    for traj in trajs:
        text = match_text(traj.goal, traj.first_obs, rsd.match_on)
        precs = rank_precedents(bank, text, depth, rule.retrieval, exclude=[_store_id(traj)], match_on=rsd.match_on,
                                rng=rng, fts_ids=fts(text) if fts and rule.retrieval == "fts" else None)
        material.precedents[_store_id(traj)] = [_store_id(p) for p in precs]
        same_task = [p for p in precs if p.task.task_id == traj.task.task_id]
        tops.append(same_task[0] if same_task else None)
    for traj, text in zip(trajs, writer.reflections(list(trajs), tops), strict=True):
        material.reflections[_store_id(traj)] = text
    return material


def step_contexts(
    traj: Trajectory, material: Material, bank_by_id: dict[int, Trajectory], rule: ContextRule, rsd: Any
) -> list[ContextParts]:
    """C_t for every step t of an episode under the rule."""
    sid = _store_id(traj)
    precs = [bank_by_id[i] for i in material.precedents.get(sid, []) if i in bank_by_id]
    lessons = material.lessons.get(traj.task.task_type, "")
    reflection = material.reflections.get(sid, "")
    return [
        assemble_context(rule, precs, lessons, reflection,
                         future_hindsight(traj, s.t, rsd.future_max_steps) if rule.use_future else "",
                         rsd.prec_format)
        for s in traj.steps
    ]


# -- acting with a context (probe, Harness@Inf, internalisation) -----------------------------------------------------


class ContextActor(PolicyActor):
    """A policy acting with a context placed at `position`; ctx_fn(episode) is called once per episode."""

    def __init__(self, policy: Any, instruction: str, window: int, sampling: Sampling,
                 ctx_fn: Callable[[Episode], str], position: str, source: str = "self") -> None:
        super().__init__(policy, instruction, window, sampling, source)
        self.ctx_fn, self.position = ctx_fn, position

    def prompt_ids(self, ep: Episode) -> list[int]:
        meta = ep.request.meta
        if "context" not in meta:
            meta["context"] = self.ctx_fn(ep)  # kept in the stored trajectory's meta
        messages = context_messages(self.instruction, ep.goal, ep.first_obs, ep.history, self.window,
                                    meta["context"], self.position)
        return self.policy.renderer.render(messages, add_generation_prompt=True).ids


def evaluate_with_context(run: Run, policy: Any, label: str, splits: Sequence[str], ctx_fn: Callable[[Episode], str],
                          position: str) -> dict[str, dict[str, Any]]:
    """Evaluation (eval.*) with a context in the prompt (collections eval/LABEL/SPLIT), like Run.evaluate."""
    actor = ContextActor(policy, run.signal_env.instruction(), run.cfg.agent.history_window, run.eval_sampling(),
                         ctx_fn, position)
    return run.evaluate_actor(actor, label, list(splits))


def pre_action_context_fn(bank: Sequence[Trajectory], lessons: dict[str, str], rule: ContextRule, rsd: Any,
                          tokenizer: Any) -> Callable[[Episode], str]:
    """Context that exists before acting (precedents + lessons): for Harness@Inf and the internalisation measure."""

    def ctx(ep: Episode) -> str:
        text = match_text(ep.goal, ep.first_obs, rsd.match_on)
        precs = rank_precedents(bank, text, rule.n_prec, rule.retrieval, match_on=rsd.match_on,
                                rng=random.Random(ep.request.slot))
        parts = assemble_context(dataclasses.replace(rule, use_reflection=False, use_future=False), precs,
                                 lessons.get(ep.request.task.task_type, ""), "", "", rsd.prec_format)
        return clip_tokens(parts.render(), tokenizer, rsd.ctx_max_tokens)

    return ctx


def probe_rule(run: Run, policy: Any, rule: ContextRule, earlier: Sequence[Trajectory], bank: Sequence[Trajectory],
               material: Material, label: str) -> float:
    """Training-free probe [S; reading I]: greedy success on training tasks that have an earlier attempt in B, the
    candidate rule's context (built from that attempt and the bank) in the prompt."""
    rsd = run.cfg.rsd
    by_task = {t.task.task_id: t for t in earlier}

    def ctx(ep: Episode) -> str:
        prev = by_task[ep.request.task.task_id]
        text = match_text(prev.goal, prev.first_obs, rsd.match_on)
        precs = rank_precedents(bank, text, rule.n_prec, rule.retrieval, match_on=rsd.match_on,
                                rng=random.Random(ep.request.slot))
        parts = assemble_context(rule, precs, material.lessons.get(prev.task.task_type, ""),
                                 material.reflections.get(_store_id(prev), ""),
                                 future_hindsight(prev, 0, rsd.future_max_steps), rsd.prec_format,
                                 future_label="Your earlier attempt at this task")
        return clip_tokens(parts.render(), policy.tokenizer, rsd.ctx_max_tokens)

    actor = ContextActor(policy, run.signal_env.instruction(), run.cfg.agent.history_window,
                         Sampling(temperature=0.0, max_new_tokens=run.cfg.agent.max_new_tokens), ctx, rule.position)
    trajs = run.collect(actor, [EpisodeRequest(t.task, k) for k, t in enumerate(earlier)], f"probe/{label}",
                        f"probe {label}")
    return sum(t.success for t in trajs) / max(1, len(trajs))
