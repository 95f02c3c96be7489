"""Self-Guide: a self-written guide line steers the next action and, as a verdict, becomes a step reward
(methods-spec §3; the paper's method section is not public, so the design is the spec's [I]/[O] proposal).

Each reply is

    Guide: <did the last action make progress, what next> Verdict: good|neutral|bad
    Thought: ...
    Action: ...

    r_int_{t−1}  = φ(verdict_t)  (good +1, neutral 0, bad −1; missing 0; the verdict at t=1 is ignored; r_int_T = 0)
    G_int_{i,t}  = Σ_{t'≥t} γ_int^{t'−t} r_int_{i,t'}
    Â_int_{i,t}  = (G_int_{i,t} − mean_{g,s} G_int) / (std_{g,s} G_int + ε)       over all steps of the group
    A_{i,t}      = A_env_i + λ(k) · Â_int_{i,t}      on the Thought + Action tokens of step t
    A_guide_{i,t}= A_env_i                           on the Guide tokens (outcome only: no self-reward)

and the GRPO/DAPO loss of agentevo.algorithms.grpo.recipe. λ(k) follows the stage-wise trust schedule (I: λ=0, past
guides dropped from the history; II: λ ramps to λ_max, the last past guide kept; III: λ_max, all guides kept).

The recipe:
  0. guide-BC warm start (small-scale stand-in for a model that can already write guides): expert demos whose
     replies carry guide lines derived from the environment's score changes, with scripted detours so that
     'bad' verdicts occur; BC on the expert steps only; π_0 = π_ref.
  for update k = 1..K:
  1. stage, λ(k) and the history retention of k; G rollouts per task with the guided actor;
  2. A_env per group (DAPO drops all-equal groups); verdicts -> r_int -> G_int -> Â_int; per-token advantages
     with the guide tokens located by token positions in the stored reply ids;
  3-4. reference log-probs, clipped-ratio + KL update (grpo.PolicyTrainer);
  5. verdict distribution, calibration AUCs, λ, guide length, format errors; checkpoint; periodic evaluation.

Switches (selfguide.guide): 'none' (the spec's 'off') = env-only GRPO from the same demos without guide lines; 'infer_only' = the
guide-BC model evaluated with its guides, no RL; 'train' = Self-Guide + GRPO.
"""

from __future__ import annotations

import inspect
import random
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentevo.agent.prompt import HistoryTurn, build_messages, expert_reply
from agentevo.algorithms import losses
from agentevo.algorithms.advantages import (
    discounted_returns,
    group_normalise_steps,
    internal_rewards_from_verdicts,
    normalise_per_step_index,
    trust_weight,
)
from agentevo.algorithms.bc import WARM_START_PHASES, _TextOnlyRenderer, import_warm_start, nll_loss
from agentevo.algorithms.grpo.config import GRPOConfig
from agentevo.algorithms.grpo.recipe import (
    Labelled,
    acting_policy,
    evaluate_with,
    group_diagnostics,
    group_requests,
    group_returns,
    label_sample,
    outcome_advantages,
    plot_success_vs_env_steps,
    rollout_seed,
    run_updates,
    split_groups,
    start_update_loop,
    step_penalties,
    update_tasks,
)
from agentevo.algorithms.selfguide.config import SelfGuideConfig
from agentevo.data.tensors import StepSample, collate, trajectory_samples
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import SIGNAL_FORMAT, SIGNAL_INVALID, SIGNAL_NONE, SIGNAL_REPEAT
from agentevo.errors import ConfigError
from agentevo.eval.diagnostics import guide_agreement
from agentevo.eval.metrics import auc, eval_collection
from agentevo.models.backend import Generation, Sampling
from agentevo.models.policy import initial_policy, tokenizer_corpus
from agentevo.rollout.engine import Episode, EpisodeRequest, PolicyActor
from agentevo.train.finetune import finetune

if TYPE_CHECKING:
    from agentevo.run import Run

VERDICTS = {"good": 1, "neutral": 0, "bad": -1}
VERDICT_WORDS = {v: k for k, v in VERDICTS.items()}
_VERDICT_RE = re.compile(r"Verdict:[ \t]*([A-Za-z]+)")
MaskFn = Callable[[Sequence[int]], list[bool]]


# ---------------------------------------------------------------------------------------------------------------
# The guide line: parsing and its token span


def guide_char_span(text: str, position: str = "before") -> tuple[int, int] | None:
    """[start, end) of the guide in a reply's text: from 'Guide:' to the Thought/Action (or the end when after)."""
    g = text.find("Guide:")
    if g < 0:
        return None
    if position == "after":
        return g, len(text)
    ends = [i for i in (text.find("Thought:", g), text.find("Action:", g)) if i >= 0]
    return g, min(ends) if ends else len(text)


def parse_guide(reply: str, position: str = "before") -> tuple[str | None, int | None]:
    """(guide text, φ(verdict)) of a reply; (None, None) without a guide; φ is None when the verdict is unparseable."""
    span = guide_char_span(reply, position)
    if span is None:
        return None, None
    region = reply[span[0] + len("Guide:") : span[1]]
    m = _VERDICT_RE.search(region)
    if m is None:
        return region.strip(), None
    return region[: m.start()].strip(), VERDICTS.get(m.group(1).lower())


def guide_token_mask(tokenizer: Any, ids: Sequence[int], position: str = "before") -> list[bool]:
    """Which reply tokens are guide tokens, by token position: token j covers the characters that decoding
    ids[:j+1] adds to ids[:j]; it is a guide token when its last character lies in the guide's span.

    The stored ids are only decoded, never re-tokenized. Tokens that decode to nothing (the end-of-turn token)
    are never guide tokens; a token straddling the boundary (e.g. '.\\n' or '\\nThought') goes to the side of
    its last character.
    """
    def decode(part: Sequence[int]) -> str:
        return tokenizer.decode(list(part), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    span = guide_char_span(decode(ids), position)
    if span is None:
        return [False] * len(ids)
    g0, g1 = span
    mask, prev = [], 0
    for j in range(1, len(ids) + 1):
        end = max(prev, len(decode(ids[:j])))
        mask.append(end > prev and g0 <= end - 1 < g1)
        prev = end
    return mask


def make_masker(tokenizer: Any, position: str, enabled: bool = True) -> MaskFn:
    """A cached guide_token_mask for one tokenizer (all False when guides are off)."""
    cache: dict[tuple[int, ...], list[bool]] = {}

    def mask(ids: Sequence[int]) -> list[bool]:
        key = tuple(ids)
        if key not in cache:
            cache[key] = guide_token_mask(tokenizer, key, position) if enabled else [False] * len(key)
        return cache[key]

    return mask


# ---------------------------------------------------------------------------------------------------------------
# Stages: trust λ(k) and how many past guides the history shows


def stage_of(step: int, total: int, breakpoints: tuple[float, float]) -> int:
    """Stage I, II or III of training step `step` of `total` (the same breakpoints as trust_weight)."""
    frac = step / total
    return 1 if frac < breakpoints[0] else 2 if frac < breakpoints[1] else 3


def guides_kept(mode: str, stage: int) -> int | None:
    """Past guides shown in the history: 0, the last 1, or None (= all)."""
    if mode == "staged":
        return {1: 0, 2: 1, 3: None}[stage]
    return {"none": 0, "last": 1, "all": None}[mode]


def guided_history(turns: Sequence[tuple[Sequence[int], str]], mask_fn: MaskFn, keep: int | None) -> list[HistoryTurn]:
    """History turns as the prompt shows them: a past reply older than the `keep` most recent loses its guide
    tokens (cut by token span; the remaining stored ids are spliced in unchanged)."""
    n = len(turns)
    out = []
    for j, (ids, next_obs) in enumerate(turns):
        age = n - j  # 1 = the previous turn
        if keep is None or age <= keep:
            out.append(HistoryTurn(list(ids), next_obs))
        else:
            out.append(HistoryTurn([i for i, m in zip(ids, mask_fn(ids), strict=True) if not m], next_obs))
    return out


class GuidedActor(PolicyActor):
    """A policy actor whose prompts keep only the configured number of past guides."""

    def __init__(self, policy: Any, instruction: str, window: int, sampling: Sampling, keep: int | None,
                 mask_fn: MaskFn, source: str = "self") -> None:
        super().__init__(policy, instruction, window, sampling, source)
        self.keep, self.mask_fn = keep, mask_fn

    def prompt_ids(self, ep: Episode) -> list[int]:
        history = guided_history([(h.action_ids, h.next_obs) for h in ep.history], self.mask_fn, self.keep)
        messages = build_messages(self.instruction, ep.goal, ep.first_obs, history, self.window, prefix=ep.request.prefix)
        return self.policy.renderer.render(messages, add_generation_prompt=True).ids


def guided_samples(renderer: Any, traj: Trajectory, traj_index: int, window: int, max_length: int, keep: int | None,
                   mask_fn: MaskFn, steps: list[int] | None = None) -> list[StepSample]:
    """Training rows whose prompts are rebuilt exactly as the guided actor built them.

    With every guide kept the prompts are prefixes of each other and rows are packed (trajectory_samples);
    otherwise the history changes between steps (guides get cut) and each step is its own row.
    """
    if keep is None:
        return trajectory_samples(renderer, traj, traj_index, window, max_length, steps=steps)
    prefix = str(traj.meta.get("prefix", ""))
    out = []
    for step in traj.steps:
        if steps is not None and step.t not in steps:
            continue
        history = guided_history([(s.action_ids, s.next_obs) for s in traj.steps[: step.t - 1]], mask_fn, keep)
        messages = build_messages(traj.instruction, traj.goal, traj.first_obs, history, window, prefix=prefix)
        prompt = renderer.render(messages, add_generation_prompt=True).ids
        room = max_length - len(step.action_ids)
        if room < 1:
            raise ValueError(f"a reply of {len(step.action_ids)} tokens does not fit optim.max_length={max_length}")
        prompt = prompt[-room:]
        out.append(StepSample(prompt + list(step.action_ids), [(len(prompt), len(prompt) + len(step.action_ids))],
                              traj_index, [step.t], behaviour_logprobs=step.logprobs))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Advantages


def internal_advantages(group_verdicts: Sequence[Sequence[int | None]], gamma_int: float, norm: str,
                        eps: float = 1e-6) -> list[torch.Tensor]:
    """Â_int per trajectory of a group: verdicts -> r_int (shifted to the previous step) -> G_int -> normalised."""
    returns = [discounted_returns(internal_rewards_from_verdicts(v), gamma_int) for v in group_verdicts]
    if norm == "group":
        return group_normalise_steps(returns, eps=eps)
    if norm == "step":
        return normalise_per_step_index(returns, eps=eps)
    return returns


def group_step_advantages(group: Sequence[Trajectory], verdicts: Sequence[Sequence[int | None]], lam: float,
                          g: GRPOConfig, sg: SelfGuideConfig) -> list[tuple[float, list[float], list[float]]] | None:
    """Per trajectory of one group: (A_env, lam x Â_int + invalid-action penalty per step, Â_int per step), or None
    when DAPO drops the group. A_env is group-normalised over R (minus grpo.invalid_penalty x flagged steps in
    penalty_mode 'return'); in penalty_mode 'step' the penalty is added to the flagged step's term instead."""
    a_env = outcome_advantages(group_returns(group, g), g)
    if a_env is None:
        return None
    a_int = internal_advantages(verdicts, sg.gamma_int, sg.int_norm, g.adv_eps)
    out = []
    for traj, a, ai in zip(group, a_env.tolist(), a_int, strict=True):
        terms = [lam * x + pen for x, pen in zip(ai.tolist(), step_penalties(traj, g), strict=True)]
        out.append((a, terms, ai.tolist()))
    return out


def token_advantages(masks: Sequence[Sequence[bool]], a_env: float, step_terms: Sequence[float],
                     guide_adv: str = "env") -> dict[int, list[float]]:
    """t -> advantage of each reply token: A_env + step term on Thought/Action tokens; A_env on guide tokens
    ('env'), or the combined value there too ('combined', the self-reward-hacking ablation)."""
    out = {}
    for t, (mask, term) in enumerate(zip(masks, step_terms, strict=True), start=1):
        combined = a_env + term
        on_guide = a_env if guide_adv == "env" else combined
        out[t] = [on_guide if m else combined for m in mask]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Logging: verdict distribution and calibration


def score_delta(steps: Sequence[Step], t: int) -> float:
    """Score change caused by step t (1-based)."""
    return steps[t - 1].score - (steps[t - 2].score if t >= 2 else 0.0)


def guide_stats(trajs: Sequence[Trajectory], position: str, mask_fn: MaskFn) -> dict[str, float | None]:
    """Verdict distribution (t >= 2), calibration AUCs, guide presence, format errors and length, and how often a
    verdict praises ('good') a step the environment flagged (invalid action, format error, repeat)."""
    verdicts, on_success, progress, on_flagged = [], [], [], []
    n_steps = missing = no_guide = 0
    lengths = []
    for traj in trajs:
        for s in traj.steps:
            n_steps += 1
            text, v = parse_guide(s.action_text, position)
            no_guide += text is None
            missing += v is None
            lengths.append(sum(mask_fn(s.action_ids)))
            if s.t >= 2:  # the verdict at t judges step t−1
                verdicts.append(v)
                on_success.append(traj.success)
                progress.append(score_delta(traj.steps, s.t - 1) > 0)
                if traj.steps[s.t - 2].signal != SIGNAL_NONE:
                    on_flagged.append(v)
    n_v = max(1, len(verdicts))
    phi = [0 if v is None else v for v in verdicts]
    return {
        "verdict_good": sum(v == 1 for v in verdicts) / n_v,
        "verdict_neutral": sum(v == 0 for v in verdicts) / n_v,
        "verdict_bad": sum(v == -1 for v in verdicts) / n_v,
        "verdict_missing": sum(v is None for v in verdicts) / n_v,
        "verdict_auc_success": auc(phi, on_success),
        "verdict_auc_progress": auc(phi, progress),
        "verdict_good_on_flagged": sum(v == 1 for v in on_flagged) / len(on_flagged) if on_flagged else None,
        "flagged_judged": len(on_flagged),
        "guide_missing_rate": no_guide / max(1, n_steps),
        "guide_format_error_rate": missing / max(1, n_steps),
        "guide_tokens": sum(lengths) / max(1, len(lengths)),
    }


def agreement_stats(trajs: Sequence[Trajectory], position: str) -> dict[str, Any]:
    """How often the guide's 'Next: <action>' is the action the same reply takes (diagnostics.guide_agreement)."""
    steps = [s for t in trajs for s in t.steps]
    frac, n = guide_agreement([parse_guide(s.action_text, position)[0] for s in steps],
                              [s.parsed_action for s in steps])
    return {} if frac is None else {"guide_agreement": frac, "guide_steps": n}


def premise_diagnostics(run: Run, label: str, evals: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Before RL: the guided warm start's greedy success and guide/action agreement (logged as diag/selfguide, 0).

    The unguided success comes from a selfguide.guide=none run; within one run it is not measured."""
    split = "test" if "test" in evals else next(iter(evals), None)
    if split is None:
        return {}
    trajs = run.store.load(collection=eval_collection(label, split))
    out = {"guided_success": evals[split]["success_rate"], **agreement_stats(trajs, run.cfg.selfguide.guide_position)}
    run.logger.log("diag/selfguide", 0, out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# 0. Guide-BC warm start (small-scale stand-in)

_DETOUR_STEPS = ("look around", "inventory")
_BAD_SIGNALS = (SIGNAL_FORMAT, SIGNAL_INVALID, SIGNAL_REPEAT)


def detour_flags(task_id: str, seed: int, n_plan: int, p: float, max_steps: int) -> list[bool]:
    """Which demo steps are scripted detours (never two in a row; the gold plan still fits in max_steps)."""
    rng = random.Random(f"{seed}/{task_id}")
    flags: list[bool] = []
    done = 0
    while done < n_plan and len(flags) < max_steps:
        room = max_steps - len(flags) > n_plan - done
        if room and rng.random() < p and not (flags and flags[-1]):
            flags.append(True)
        else:
            flags.append(False)
            done += 1
    return flags


def oracle_verdict(steps: Sequence[Step]) -> int:
    """The verdict on the last step from the environment: score up -> good; down, invalid, repeat, format -> bad."""
    if not steps:
        return 0
    delta = score_delta(steps, len(steps))
    if delta > 0:
        return 1
    if delta < 0 or steps[-1].signal in _BAD_SIGNALS:
        return -1
    return 0


def oracle_agreement(pairs: Sequence[Sequence[int]]) -> dict[str, float | int | None]:
    """How often the model's own verdict equals the environment's, over the (oracle, own) pairs whose oracle verdict
    is not neutral: a score that moves only at the end (a success-only reward) judges no step before the last, and
    counting its 'neutral' against the model's good / bad would read a calibrated judge as always wrong."""
    judged = [(a, b) for a, b in pairs if a != 0]
    return {"self_verdict_oracle_agreement": sum(a == b for a, b in judged) / len(judged) if judged else None,
            "self_verdict_oracle_steps": len(judged)}


def guided_reply(action: str, verdict: int, first: bool, thoughts: str = "template", position: str = "before",
                 with_guide: bool = True) -> str:
    """A demo reply: guide line (judging the previous step, naming the next action) + Thought + Action."""
    if not with_guide:
        return expert_reply(action, thoughts)
    guide = verdict_text(action, verdict, first, thoughts, position)
    return guide if position == "after" else f"{guide}\n{expert_reply(action, thoughts)}"


def verdict_text(action: str, verdict: int, first: bool, thoughts: str, position: str) -> str:
    """A demo reply up to the end of its verdict word (what differs between the three verdicts)."""
    judgement = "Nothing done yet." if first else {
        1: "The last step made progress.", 0: "The last step changed nothing.", -1: "The last step failed."}[verdict]
    if position == "after":
        return f"{expert_reply(action, thoughts)}\nGuide: {judgement} Verdict: {VERDICT_WORDS[verdict]}"
    return f"Guide: {judgement} Next: {action}. Verdict: {VERDICT_WORDS[verdict]}"


class SelfJudge:
    """The demo verdicts of selfguide.demo_verdicts=self: the pretrained model, before any training, scores the reply
    up to each of the three verdict words after the episode so far (past replies without their guides), calibrated
    by its scores when the last observation is replaced by a content-free "N/A" (contextual calibration, Zhao et al.
    2021: an untrained model's prior over the three sentences otherwise decides every verdict); the verdict whose
    score the observation raises most is the step's verdict. The choice is the model's; the wording the template's."""

    content_free = "N/A"

    def __init__(self, policy: Any, instruction: str, window: int, thoughts: str, position: str) -> None:
        self.policy, self.instruction, self.window = policy, instruction, window
        self.thoughts, self.position = thoughts, position

    def prompt_ids(self, ep: Episode, content_free: bool = False) -> list[int]:
        """The prompt the policy would see next (past replies without guides); content_free blanks the last
        observation."""
        renderer = self.policy.renderer
        history = [HistoryTurn(renderer.encode_reply(expert_reply(s.parsed_action or "", self.thoughts)), s.next_obs)
                   for s in ep.steps]
        if content_free and history:
            history[-1] = HistoryTurn(history[-1].action_ids, self.content_free)
        messages = build_messages(self.instruction, ep.goal, ep.first_obs, history, self.window,
                                  prefix=ep.request.prefix)
        return renderer.render(messages, add_generation_prompt=True).ids

    def scores(self, ep: Episode, action: str) -> dict[int, float]:
        """Calibrated score per verdict: log p(line | episode) - log p(line | episode with a content-free last
        observation)."""
        verdicts = (1, 0, -1)
        conts = [self.policy.renderer.encode_reply(verdict_text(action, v, False, self.thoughts, self.position))[:-1]
                 for v in verdicts]
        seen = continuation_logprobs(self.policy, self.prompt_ids(ep), conts)
        blank = continuation_logprobs(self.policy, self.prompt_ids(ep, content_free=True), conts)
        return {v: a - b for v, a, b in zip(verdicts, seen, blank, strict=True)}

    def __call__(self, ep: Episode, action: str) -> int:
        """The verdict (1 good, 0 neutral, -1 bad) on the episode's last step."""
        scores = self.scores(ep, action)
        return max(scores, key=scores.__getitem__)


@torch.no_grad()
def continuation_logprobs(policy: Any, prompt: list[int], conts: Sequence[Sequence[int]]) -> list[float]:
    """Sum of log p(continuation | prompt) for each continuation. The prompt runs once and its KV cache is shared
    by the continuations, which then run as one right-padded batch of their own tokens (a judge's prompt is hundreds
    of tokens, its continuations a sentence). Scored in the model's own precision, outside the run's autocast: the
    judge's verdicts were measured that way (under bf16 autocast SmolLM2 judges 1 of 25 wrong-button steps of the
    guide probe differently; docs/studies/real_model_probes)."""
    model = policy.model
    device = next(model.parameters()).device
    if len(prompt) < 2:  # nothing to cache: one padded batch of prompt + continuation
        n = len(prompt)
        rows = [StepSample([*prompt, *c], [(n, n + len(c))], 0, [1]) for c in conts]
        batch = {k: v.to(device) for k, v in collate(rows, policy.pad_id).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        picked = losses.token_logprobs(logits, batch["input_ids"])  # column j scores token j + 1
        return [float(x) for x in (picked * batch["action_mask"][:, 1:]).sum(dim=1)]
    head = torch.tensor([prompt[:-1]], device=device)
    out = model(input_ids=head, use_cache=True)
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values  # renamed in transformers 5.2x
    cache.batch_repeat_interleave(len(conts))
    # each row: the prompt's last token (its logits score the continuation's first token), then the continuation
    rows = [StepSample([prompt[-1], *c], [(1, 1 + len(c))], 0, [1]) for c in conts]
    batch = {k: v.to(device) for k, v in collate(rows, policy.pad_id).items()}
    width = batch["input_ids"].shape[1]
    mask = torch.cat([torch.ones((len(conts), len(prompt) - 1), dtype=batch["attention_mask"].dtype, device=device),
                      batch["attention_mask"]], dim=1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + width, device=device).expand(len(conts), width)
    # transformers renamed the forward's past_key_values to cache (5.2x); pass whichever this model's forward takes
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions, use_cache=True,
                   **{key: cache}).logits
    picked = losses.token_logprobs(logits, batch["input_ids"])  # column j scores row token j + 1
    return [float(x) for x in (picked * batch["action_mask"][:, 1:]).sum(dim=1)]


class GuidedExpertActor:
    """Gold plan with scripted detours; replies carry oracle guide lines derived from score changes."""

    source = "expert"
    policy_id = "expert-guided"

    def __init__(self, thoughts: str, detour_prob: float, seed: int, with_guide: bool, position: str,
                 judge: Callable[[Episode, str], int] | None = None) -> None:
        self.renderer = _TextOnlyRenderer()
        self.thoughts, self.p, self.seed = thoughts, detour_prob, seed
        self.with_guide, self.position, self.judge = with_guide, position, judge

    def act(self, episodes: list[Episode]) -> list[Generation]:
        gens = []
        for ep in episodes:
            task = ep.request.task
            flags = detour_flags(task.task_id, self.seed, len(ep.plan), self.p, task.max_steps)
            t = len(ep.steps)
            # Recorded in the request's meta, which the engine copies into the stored trajectory: BC skips these.
            ep.request.meta["detours"] = [j + 1 for j, f in enumerate(flags[: t + 1]) if f]
            if t < len(flags) and flags[t]:
                rng = random.Random(f"{self.seed}/{task.task_id}/{t}")
                # A repeated 'take' is a wasted, invalid step in TWX; look/inventory are idle steps.
                takes = [ep.plan[j] for j in range(sum(not f for f in flags[:t])) if ep.plan[j].startswith("take ")]
                # Half of the detours (when something was taken) are the wasted repeat, so 'bad' verdicts occur.
                action = rng.choice(list(_DETOUR_STEPS) + takes[-1:] * 2)
            else:
                n_done = sum(not f for f in flags[:t])
                action = ep.plan[n_done] if n_done < len(ep.plan) else "look around"
            verdict = oracle_verdict(ep.steps)
            if self.judge is not None and self.with_guide and t > 0:
                own = self.judge(ep, action)
                # (oracle, own) per judged step, kept with the trajectory for the agreement diagnostic
                ep.request.meta["verdicts"] = [*ep.request.meta.get("verdicts", [])[: t - 1], [verdict, own]]
                verdict = own
            text = guided_reply(action, verdict, t == 0, self.thoughts, self.position, self.with_guide)
            gens.append(Generation([], [], text))
        return gens

    def needs_plan(self) -> bool:
        return True


def demo_keeps(sg: SelfGuideConfig) -> list[int | None]:
    """History retentions the demos cycle through, so BC sees every prompt shape RL will show."""
    if sg.guide == "none":
        return [None]
    if sg.history_guides == "staged":
        return [0, 1, None]
    return [guides_kept(sg.history_guides, 1)]


GUIDE_WARM_START_PHASES = ("expert-guided", *WARM_START_PHASES[1:])  # the guided demos, then BC's phases


def import_guide_warm_start(run: Run, source: Path) -> dict[str, Any]:
    """bc.warm_start_from for Self-Guide: a finished selfguide run's guided demos and guide-BC (so the arms and seeds
    of a study share one warm start). Its guide switch (none vs. with guides) and the settings that shape the demos
    and prompts must equal this run's."""
    import yaml

    theirs = (yaml.safe_load((source / "config.yaml").read_text()) if (source / "config.yaml").exists() else {}) or {}
    if theirs.get("method") not in (None, "selfguide"):
        raise ConfigError(f"bc.warm_start_from: {str(source)!r} is a {theirs.get('method')} run; Self-Guide needs a "
                          "selfguide run's guided warm start (e.g. one run with selfguide.guide=infer_only)")
    ours_guided = run.cfg.selfguide.guide != "none"
    if (theirs.get("selfguide", {}).get("guide", "train") != "none") != ours_guided:
        raise ConfigError(f"bc.warm_start_from: {str(source)!r} was trained "
                          f"{'without' if ours_guided else 'with'} guide lines; use a warm start with the same "
                          "selfguide.guide = none / with guides")
    keys = ("guide_position", "demo_detour_prob", "history_guides", "guide_max_tokens", "demo_verdicts")
    return import_warm_start(run, source, "expert-guided", GUIDE_WARM_START_PHASES, {"selfguide": keys})


def guide_warm_start(run: Run) -> dict[str, Any]:
    """Guided demos -> initial policy (checkpoints/init) -> eval -> guide-BC on expert steps (checkpoints/bc) -> eval."""
    cfg, sg = run.cfg, run.cfg.selfguide
    with_guide = sg.guide != "none"
    if cfg.bc.warm_start_from:
        run.phase("warm_start_from", lambda: import_guide_warm_start(run, Path(cfg.bc.warm_start_from)))
    keeps = demo_keeps(sg)
    tasks = run.tasks("train", cfg.bc.n_expert)
    actor = GuidedExpertActor(cfg.agent.thoughts, sg.demo_detour_prob, cfg.seed, with_guide, sg.guide_position)
    requests = [EpisodeRequest(t, k, meta={"keep": keeps[k % len(keeps)]}) for k, t in enumerate(tasks)]

    self_judged = sg.demo_verdicts == "self" and with_guide

    def collect() -> dict[str, Any]:
        if self_judged:
            judge_policy = initial_policy(cfg, [])  # the pretrained model as loaded, before any training
            actor.judge = SelfJudge(judge_policy, run.signal_env.instruction(), cfg.agent.history_window,
                                    cfg.agent.thoughts, sg.guide_position)
        trajs = run.collect(actor, requests, "expert-guided", "guided expert demos")
        pairs = [p for t in trajs for p in t.meta.get("verdicts", [])]
        return {"n": len(trajs), "success_rate": sum(t.success for t in trajs) / max(1, len(trajs)),
                "mean_steps": sum(t.length for t in trajs) / max(1, len(trajs)),
                "detours": sum(len(t.meta.get("detours", [])) for t in trajs),
                **(guide_stats(trajs, sg.guide_position, lambda ids: []) if with_guide else {}),
                **({"self_verdicts": len(pairs), **oracle_agreement(pairs)} if self_judged else {})}

    results: dict[str, Any] = {"expert-guided": run.phase("expert-guided", collect)}
    demos = run.store.load(collection="expert-guided")

    def build_init() -> dict[str, Any]:
        policy = initial_policy(cfg, tokenizer_corpus(run.signal_env.instruction(), demos))
        policy.save(run.checkpoint_dir("init"))
        return {"parameters": sum(p.numel() for p in policy.model.parameters()), "vocab": len(policy.tokenizer)}

    results["init"] = run.phase("init", build_init)
    keep0 = guides_kept(sg.history_guides, 1) if with_guide else None
    results["eval/init"] = run.phase("eval/init", lambda: evaluate_guided(run, run.load_policy("init"), "init", keep0))

    def do_bc() -> dict[str, Any]:
        policy = run.load_policy("init")
        mask_fn = make_masker(policy.tokenizer, sg.guide_position, with_guide)
        samples: list[StepSample] = []
        for k, traj in enumerate(demos):
            for step in traj.steps:
                step.action_ids = policy.renderer.encode_reply(step.action_text)
            detours = set(traj.meta.get("detours", []))
            expert_steps = [s.t for s in traj.steps if s.t not in detours]
            samples += guided_samples(policy.renderer, traj, k, cfg.agent.history_window, cfg.optim.max_length,
                                      traj.meta.get("keep"), mask_fn, steps=expert_steps)
        stats = finetune(run, policy, samples, nll_loss, "bc")
        return {**stats, "samples": len(samples)}

    results["bc"] = run.phase("bc", do_bc, all_ranks=True)
    results["eval/bc"] = run.phase("eval/bc", lambda: evaluate_guided(run, run.load_policy("bc"), "bc", keep0))
    return results


def evaluate_guided(run: Run, policy: Any, label: str, keep: int | None, pool: Any = None,
                    extra: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Evaluation (eval.*) with the guided actor (its guides steer its actions) at a given history retention."""
    cfg, sg = run.cfg, run.cfg.selfguide
    with_guide = sg.guide != "none"
    max_new = cfg.agent.max_new_tokens + (sg.guide_max_tokens if with_guide else 0)
    actor = GuidedActor(policy, run.signal_env.instruction(), cfg.agent.history_window, run.eval_sampling(max_new),
                        keep, make_masker(policy.tokenizer, sg.guide_position, with_guide))
    if pool is None:
        with run.pool() as p:
            out = evaluate_with(run, actor, label, p, extra)
    else:
        out = evaluate_with(run, actor, label, pool, extra)
    if with_guide:
        for split in out:
            trajs = run.store.load(collection=eval_collection(label, split))
            out[split].update({f"eval_{k}": v for k, v in guide_stats(trajs, sg.guide_position, actor.mask_fn).items()})
            out[split]["eval_guides_kept"] = -1 if keep is None else keep  # -1 = all past guides
    return out


# ---------------------------------------------------------------------------------------------------------------
# The recipe


def run(run: Run) -> dict[str, Any]:
    """Self-Guide + GRPO (or its switches and ablations); returns evaluations and per-update statistics."""
    cfg, g, sg = run.cfg, run.cfg.grpo, run.cfg.selfguide
    with_guide = sg.guide != "none"
    # 0. Guide-BC warm start: π_0 = π_ref.
    results: dict[str, Any] = dict(guide_warm_start(run))
    if with_guide:
        results["diag/premise"] = run.phase("diag/premise", lambda: premise_diagnostics(run, "bc", results["eval/bc"]))
    if sg.guide == "infer_only":
        return results
    loop, train_tasks = start_update_loop(run, "selfguide/update")
    policy, trainer = loop.policy, loop.trainer
    window, max_len = cfg.agent.history_window, cfg.optim.max_length
    max_new = cfg.agent.max_new_tokens + (sg.guide_max_tokens if with_guide else 0)
    mask_fn = make_masker(policy.tokenizer, sg.guide_position, with_guide)
    K = g.n_updates
    eval_points: list[tuple[str, dict[str, dict[str, Any]]]] = [("bc", results["eval/bc"])]

    def schedule(k: int) -> tuple[int, float, int | None]:
        """Stage, trust weight λ and history guides kept for update k."""
        stage = stage_of(k - 1, K, sg.breakpoints)
        lam = trust_weight(k - 1, K, sg.lambda_max, sg.breakpoints, sg.schedule) if sg.guide == "train" else 0.0
        return stage, lam, guides_kept(sg.history_guides, stage) if with_guide else None

    def rollout_and_label(k: int, pool: Any) -> Labelled:
        # 1. Stage, trust λ(k) and history retention of this update; G guided rollouts per task.
        stage, lam, keep = schedule(k)
        actor = GuidedActor(acting_policy(run, trainer, k), run.signal_env.instruction(), window,
                            Sampling(g.temperature, g.top_p, max_new, seed=rollout_seed(cfg.seed, k)), keep, mask_fn)
        requests = group_requests(update_tasks(train_tasks, k, g.tasks_per_update), g.group_size,
                                  meta={"keep": keep, "stage": stage, "lambda": lam})
        trajs = run.collect(actor, requests, f"update-{k}/collect", f"update {k}: rollouts", pool=pool)
        out = Labelled(trajs, time.perf_counter())
        # 2. A_env per group, Â_int per step, per-token advantages (guide tokens: A_env only).
        groups = split_groups(trajs)
        out.extra.update(group_diagnostics(groups, g))
        if with_guide:
            out.extra.update(agreement_stats(trajs, sg.guide_position))
        int_abs: list[float] = []
        for group in groups:
            verdicts = [[parse_guide(s.action_text, sg.guide_position)[1] for s in t.steps] for t in group]
            per_traj = group_step_advantages(group, verdicts, lam, g, sg)
            if per_traj is None:
                continue
            out.extra["groups_kept"] = out.extra.get("groups_kept", 0) + 1
            for traj, (a, terms, ai) in zip(group, per_traj, strict=True):
                int_abs += [abs(x) for x in ai]
                token_adv = token_advantages([mask_fn(s.action_ids) for s in traj.steps], a, terms,
                                             sg.guide_tokens_adv)
                rows = guided_samples(policy.renderer, traj, len(out.samples), window, max_len,
                                      traj.meta.get("keep"), mask_fn)
                out.samples += [label_sample(r, token_adv) for r in rows]
        # 5. Logs of §3.4.
        out.extra.update({
            **(guide_stats(trajs, sg.guide_position, mask_fn) if with_guide else {}),
            "stage": stage, "lambda": lam, "guides_kept": -1 if keep is None else keep,
            "int_adv_abs_mean": sum(int_abs) / max(1, len(int_abs)), "groups": len(groups),
        })
        return out

    def evaluate(k: int, pool: Any, extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return evaluate_guided(run, policy, f"update-{k}", schedule(k)[2], pool, extra)

    run_updates(run, loop, rollout_and_label, evaluate, results, eval_points)
    plot = plot_success_vs_env_steps(run, eval_points, "success_vs_env_steps")
    results["plots"] = [str(plot)] if plot else []
    return results
