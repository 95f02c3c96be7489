"""Premise diagnostics: does the assumption each method rests on hold in this run? (issue 19)

Each method silently relies on something that can fail: Q-Evolve on a critic that has actually fitted, GRPO/DAPO
on groups whose rewards differ, RSD on a teacher that does better with the privileged context, Self-Guide on guides
that steer the action, ETO on DPO raising the chosen trajectories; and all of them on a BC start that has learned
the task's actions (read from its held-out evaluation, eval/bc). Recipes log the raw numbers under the metrics
phase `diag/<method>` (fixed names below; step = round / update / iteration, 0 = before training); the report
turns each record into a table row: diagnostic, value, verdict (pass / warn / fail / n/a) and what to change.

The pure functions here compute the numbers from plain arrays; the thresholds are ours [O], chosen so that the
failures seen in the studies (17 critic steps at Polyak 0.005; V spread 0.03; base+ctx below base; guide/action
agreement of 2/3; the demo's 12-epoch BC with half its held-out actions invalid) land on warn or fail.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from agentevo.eval.metrics import auc

PASS, WARN, FAIL, NA = "pass", "warn", "fail", "n/a"
PHASE_PREFIX = "diag/"


@dataclass
class Diagnostic:
    """One report row: what was measured, its value, the verdict and what to change when it is not a pass."""

    name: str
    value: str
    verdict: str
    fix: str = ""


# ---------------------------------------------------------------------------------------------------------------
# Pure numbers


def roc_auc(scores: Sequence[float], positive: Sequence[bool]) -> float | None:
    """ROC AUC of scores for the positive class (ties 1/2); None without both classes."""
    return auc(scores, positive)


def explained_variance(pred: Sequence[float], target: Sequence[float]) -> float | None:
    """1 − Var(target − pred) / Var(target) (population variances); None when target is constant or empty."""
    if len(target) < 2:
        return None
    t = torch.tensor(list(target), dtype=torch.float64)
    p = torch.tensor(list(pred), dtype=torch.float64)
    var = float(t.var(unbiased=False))
    if var <= 0:
        return None
    return 1.0 - float((t - p).var(unbiased=False)) / var


def relative_drift(current: Sequence[Tensor], start: Sequence[Tensor]) -> float:
    """||θ − θ_0|| / ||θ_0|| over a list of tensors (0 when θ_0 is all zeros)."""
    num = sum(float((c.double() - s.double()).pow(2).sum()) for c, s in zip(current, start, strict=True))
    den = sum(float(s.double().pow(2).sum()) for s in start)
    return math.sqrt(num / den) if den > 0 else 0.0


def init_share(polyak: float, steps: int) -> float:
    """Weight the Polyak-averaged target heads still give their initialisation after `steps` updates: (1 − ρ)^n."""
    return (1.0 - polyak) ** steps


def returns_to_go(rewards: Sequence[float], gamma: float) -> list[float]:
    """G_t = Σ_{t'≥t} γ^{t'−t} r_t' for every step of one trajectory."""
    out, acc = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = rewards[t] + gamma * acc
        out[t] = acc
    return out


def std(xs: Sequence[float]) -> float:
    """Population standard deviation (0 for fewer than 2 values)."""
    if len(xs) < 2:
        return 0.0
    return float(torch.tensor(list(xs), dtype=torch.float64).std(unbiased=False))


def _all_equal(rewards: Sequence[float]) -> bool:
    return len(set(rewards)) <= 1


def zero_variance_fraction(groups: Sequence[Sequence[float]]) -> float | None:
    """Fraction of groups whose rewards are all equal (no GRPO signal); None without groups."""
    if not groups:
        return None
    return sum(1 for g in groups if _all_equal(g)) / len(groups)


def all_won_fraction(groups: Sequence[Sequence[float]], won: Sequence[Sequence[bool]]) -> float | None:
    """Fraction of groups whose rewards are all equal because every episode succeeded: tasks the policy has solved,
    which give no signal for a good reason (unlike groups that failed throughout); None without groups."""
    if not groups:
        return None
    if len(won) != len(groups):
        raise ValueError(f"all_won_fraction: {len(groups)} groups of rewards but {len(won)} of outcomes")
    return sum(1 for g, w in zip(groups, won, strict=True) if _all_equal(g) and w and all(w)) / len(groups)


_NEXT_RE = re.compile(r"Next:[ \t]*(.*?)(?:[ \t]*Verdict:|\n|$)")


def _norm_action(text: str) -> str:
    return " ".join(text.strip().rstrip(".").lower().split())


def guide_next_action(guide: str | None) -> str | None:
    """The action a guide names after 'Next:' (normalised: lower case, single spaces, no final period)."""
    if not guide:
        return None
    m = _NEXT_RE.search(guide)
    if m is None or not m.group(1).strip():
        return None
    return _norm_action(m.group(1))


def guide_agreement(guides: Sequence[str | None], actions: Sequence[str | None]) -> tuple[float | None, int]:
    """(fraction of steps whose guide's 'Next: <action>' equals the action taken, steps with such a guide)."""
    pairs = [(g, a) for g, a in zip((guide_next_action(x) for x in guides), actions, strict=True) if g is not None]
    if not pairs:
        return None, 0
    return sum(a is not None and g == _norm_action(a) for g, a in pairs) / len(pairs), len(pairs)


# ---------------------------------------------------------------------------------------------------------------
# Verdicts


def grade(value: float | None, good: float, ok: float, higher_is_better: bool = True) -> str:
    """pass when value is at least `good` (at most, when lower is better), warn up to `ok`, else fail."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return NA
    if not higher_is_better:
        value, good, ok = -value, -good, -ok
    return PASS if value >= good else WARN if value >= ok else FAIL


def _fmt(x: Any) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.3e}"
    return str(x)


def _row(name: str, value: Any, verdict: str, fix: str, shown: str | None = None) -> Diagnostic:
    return Diagnostic(name, shown if shown is not None else _fmt(value), verdict, "" if verdict == PASS else fix)


FLAGGED_GAP_IF = "flagged_gap_if_"  # + '<pr>_lam<lam>': the flagged-step gap under another process reward
PROGRESS_AUC_IF = "progress_auc_if_"  # + '<pr>_lam<lam>': the progress AUC under another process reward


def critic_fit(v: dict[str, Any]) -> list[Diagnostic]:
    """Q-Evolve: does the critic separate held-out successes, spread its values and follow its targets?"""
    rows = []
    ran = f"ran {_fmt(v['steps'])}; " if v.get("steps") is not None else ""
    budget = (f"raise qevolve.critic_steps ({ran}500 fits the synthetic check; qevolve.critic_epochs, when set, "
              "replaces it)")
    few = "hold out more tasks (qevolve.critic_holdout) so both outcomes appear among them"
    n_held = v.get("n_holdout")
    # Mann-Whitney null variance (n1 + n2 + 1) / (12 n1 n2): about 1 / (3n) when the outcomes are balanced
    noisy = (f"; with {n_held} held-out episodes the AUC's standard error is ~{1 / (3 * n_held) ** 0.5:.2f}, so also hold "
             "out more (qevolve.critic_holdout)") if n_held and n_held < 100 else ""
    if "auc_v_states" in v:
        # every state of the held-out own episodes; pairs only within a step, so V cannot score by t alone
        verdict = grade(v["auc_v_states"], 0.7, 0.6)
        rows.append(_row("held-out AUC of V(s_t) for the episode's success (own episodes, states at the same step)",
                         v["auc_v_states"], verdict, few if verdict == NA else budget))
    for key, name in (("auc_v1", "held-out AUC of V(s_1) for success"), ("auc_q", "held-out AUC of min Q(s_1,a_1)")):
        if key in v:
            verdict = grade(v[key], 0.7, 0.6)
            # s_1 only shows the task: V(s_1) can rank no better than the tasks' difficulty shows in it
            first = ("; V(s_1) sees only the task, so it ranks episodes no better than task difficulty shows in the "
                     "first observation: read it beside the row above")
            rows.append(_row(name, v[key], verdict, few if verdict == NA else budget + noisy + first))
    if "v_std" in v:
        ratio = v["v_std"] / v["return_std"] if v.get("return_std") else None
        rows.append(_row("V spread (std over states / std of returns-to-go)", ratio, grade(ratio, 0.3, 0.1),
                         budget + "; a V this flat turns GAE into a normalised Monte-Carlo return",
                         f"{_fmt(v['v_std'])} / {_fmt(v.get('return_std'))} = {_fmt(ratio)}"))
    if "ev" in v:
        rows.append(_row("explained variance of returns-to-go by V (held-out)", v["ev"], grade(v["ev"], 0.3, 0.05),
                         budget))
    if "target_drift" in v:
        ratio = v["target_drift"] / v["online_drift"] if v.get("online_drift") else None
        rows.append(_row("target-head drift from init (relative L2; online heads)", ratio, grade(ratio, 0.8, 0.5),
                         "raise qevolve.polyak (0.05) or qevolve.critic_steps: the targets lag the online heads",
                         f"{_fmt(v['target_drift'])} (online {_fmt(v.get('online_drift'))})"))
    if "init_share" in v:
        rows.append(_row("target heads' weight on their init (1-polyak)^steps", v["init_share"],
                         grade(v["init_share"], 0.05, 0.5, higher_is_better=False),
                         "raise qevolve.polyak or qevolve.critic_steps",
                         f"{_fmt(v['init_share'])} after {_fmt(v.get('steps'))} steps"))
    if v.get("progress_auc") is not None:
        base = v.get("progress_auc_outcome")
        better = [f"pr={k[len(PROGRESS_AUC_IF):].rpartition('_lam')[0]} lam={k.rpartition('_lam')[2]} gives "
                  f"{_fmt(x)}" for k, x in v.items()
                  if k.startswith(PROGRESS_AUC_IF) and isinstance(x, (int, float)) and x > v["progress_auc"] + 0.05]
        fix = ("the advantages barely tell the steps that raised the score from the others"
               + (f" (the episode's outcome alone gives {_fmt(base)})" if base is not None else "")
               + ": fit the critic, or lower qevolve.lam so A_t follows V's ranking of the next state"
               + ("; from this round's critic values, " + ", ".join(better) if better else ""))
        rows.append(_row("AUC of A_t for steps that raised the env score (own episodes)", v["progress_auc"],
                         grade(v["progress_auc"], 0.7, 0.6), fix,
                         f"{_fmt(v['progress_auc'])} (outcome-only advantage: {_fmt(base)})"))
    gap = flagged_gap(v)
    if gap is not None:
        rows.append(_row("advantage of rule-flagged steps (invalid / format / repeat) − of the others", gap,
                         grade(gap, -0.1, 0.0, higher_is_better=False),
                         "the process reward credits steps the rules call mistakes (with a weak V, GAE at lam near 1 "
                         "is close to a Monte-Carlo return minus V, which can rate a slip above the average step): "
                         "fit the critic, lower qevolve.lam (0.5), or add the rule reward to GAE (qevolve.pr=gae_aux)",
                         f"{_fmt(v['flagged_adv'])} − {_fmt(v['unflagged_adv'])} = {_fmt(gap)}"))
        passing = []
        for key, g in v.items():
            if key.startswith(FLAGGED_GAP_IF) and isinstance(g, (int, float)) and g <= -0.1:
                pr, _, lam = key[len(FLAGGED_GAP_IF):].rpartition("_lam")
                passing.append(f"pr={pr} lam={lam} gives {_fmt(g)}")
        if passing and rows[-1].fix:
            rows[-1] = dataclasses.replace(rows[-1], fix=rows[-1].fix + "; from this round's critic values, "
                                           + ", ".join(passing) + " (qevolve.pr / qevolve.lam)")
    rows += update_follow_rows(v)
    return rows


def update_follow_rows(v: dict[str, Any]) -> list[Diagnostic]:
    """Q-Evolve's policy step: did log pi of the training actions move with their advantages (update_follow)?"""
    rows = []
    if v.get("follow_auc") is not None:
        rows.append(_row("AUC of the update's change in log pi(a_t|s_t) for A_t > 0 over A_t < 0 (training steps)",
                         v["follow_auc"], grade(v["follow_auc"], 0.7, 0.6),
                         "the update barely moves the actions the way their advantages ask: raise qevolve.policy_lr "
                         "or qevolve.policy_epochs if the changes are tiny; if they are not, the policy cannot tell "
                         "the states apart where the same action is credited and penalised",
                         f"{_fmt(v['follow_auc'])} (mean change {_fmt(v.get('dlogp_pos'))} where A > 0, "
                         f"{_fmt(v.get('dlogp_neg'))} where A < 0)"))
    if v.get("dlogp_flagged") is not None:
        asked = v.get("dlogp_flagged_adv")
        rows.append(_row("change in log pi of the rule-flagged actions (invalid / format / repeat) after the update",
                         v["dlogp_flagged"], grade(v["dlogp_flagged"], 0.0, 0.05, higher_is_better=False),
                         "the update made actions the rules call mistakes more likely"
                         + (" although their mean advantage is negative: the same action credited in states the "
                            "policy does not tell apart from these (an object that is there in some games and not in "
                            "others) outweighs it; give the policy more context (agent.history_window) or capacity, "
                            "and read the held-out invalid-action rate" if asked is not None and asked < 0 else
                            ": their advantage is not negative (see the flagged-step row)"),
                         f"{_fmt(v['dlogp_flagged'])} over {_fmt(v.get('dlogp_flagged_n'))} steps "
                         f"(their mean advantage {_fmt(asked)})"))
    if v.get("kl_ref") is not None:
        rows.append(_row("KL of the updated policy to pi_BC (k3, per token, training steps)", v["kl_ref"],
                         grade(v["kl_ref"], 0.1, 0.5, False),
                         "the update moved the policy far from its start: lower qevolve.policy_lr or "
                         "qevolve.policy_epochs, or raise qevolve.kl_alpha; read the format-error row beside it"))
    rows += _format_drift_rows(v, "round", "pushing down the tokens of negative-advantage actions broke the reply "
                               "format (the invalid-action rate then falls because broken replies are not actions): "
                               "lower qevolve.policy_lr, raise qevolve.kl_alpha, or narrow the low clip "
                               "(qevolve.eps_low)")
    return rows


def format_drift(result: dict[str, dict[str, Any]], start: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The record `_format_drift_rows` reads: the held-out format-error rate of an evaluation (its test split, else
    its first) and of the start policy on the same split; empty when the start was not evaluated there."""
    split = "test" if "test" in result else next(iter(result), None)
    if split is None or split not in start:
        return {}
    return {"format_error": result[split]["format_error_rate"],
            "format_error_start": start[split]["format_error_rate"]}


def _format_drift_rows(v: dict[str, Any], step: str, fix: str, extra: str = "") -> list[Diagnostic]:
    """The held-out format-error row (after this round / iteration against its start; fail on a rise of 0.2), or
    none when the record lacks it."""
    if "format_error" not in v or "format_error_start" not in v:
        return []
    rise = v["format_error"] - v["format_error_start"]
    return [_row(f"held-out replies out of the action format, after this {step}", rise,
                 grade(rise, 0.05, 0.2, higher_is_better=False), fix,
                 f"{_fmt(v['format_error'])} (start {_fmt(v['format_error_start'])}){extra}")]


def flagged_advantage(advantages: Sequence[float], flagged: Sequence[bool]) -> dict[str, float | int | None]:
    """Mean advantage of the steps the rules flag and of the others (None where a side has no step)."""
    on = [a for a, f in zip(advantages, flagged, strict=True) if f]
    off = [a for a, f in zip(advantages, flagged, strict=True) if not f]
    return {"flagged_adv": sum(on) / len(on) if on else None, "unflagged_adv": sum(off) / len(off) if off else None,
            "flagged_n": len(on)}


def update_follow(deltas: Sequence[float], advantages: Sequence[float], flagged: Sequence[bool]) -> dict[str, Any]:
    """Did the policy update move each training step's action the way its advantage asked? deltas[i] is
    log pi_new(a_i|s_i) - log pi_old(a_i|s_i) summed over the reply's tokens. Returns the AUC of the deltas for
    A > 0 over A < 0 ('follow_auc'; 0.5 = no relation), the mean delta of positive / negative / rule-flagged steps,
    and the flagged steps' mean advantage (so a flagged delta can be read against what was asked)."""
    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    signed = [(d, a > 0) for d, a in zip(deltas, advantages, strict=True) if a != 0]
    on = [i for i, f in enumerate(flagged) if f]
    return {
        "follow_auc": auc([d for d, _ in signed], [p for _, p in signed]),
        "dlogp_pos": mean([d for d, p in signed if p]),
        "dlogp_neg": mean([d for d, p in signed if not p]),
        "dlogp_flagged": mean([deltas[i] for i in on]),
        "dlogp_flagged_adv": mean([advantages[i] for i in on]),
        "dlogp_flagged_n": len(on),
    }


def flagged_gap(d: dict[str, Any]) -> float | None:
    """flagged_adv − unflagged_adv of a flagged_advantage record (None where a side has no step)."""
    if d.get("flagged_adv") is None or d.get("unflagged_adv") is None:
        return None
    return d["flagged_adv"] - d["unflagged_adv"]


def policy_update(v: dict[str, Any]) -> list[Diagnostic]:
    """GRPO / DAPO (and Self-Guide's updates): reward variance within groups, KL to the reference, clipping."""
    rows = []
    advice = ("pick tasks of mid difficulty, raise grpo.group_size or grpo.temperature: these groups give no "
              "advantage (DAPO drops them)")
    if "zero_var_frac" in v and v.get("zero_var_won_frac") is not None:
        # Groups that all succeeded are solved tasks, not a starved update: grade only the others.
        starved = max(0.0, v["zero_var_frac"] - v["zero_var_won_frac"])
        rows.append(_row("zero-variance groups that did not all succeed (no signal)", starved,
                         grade(starved, 0.5, 0.8, higher_is_better=False), advice,
                         f"{_fmt(starved)} ({_fmt(v['zero_var_frac'])} all equal, {_fmt(v['zero_var_won_frac'])} "
                         "all succeeded: solved)"))
    elif "zero_var_frac" in v:
        rows.append(_row("zero-variance groups (all rewards equal)", v["zero_var_frac"],
                         grade(v["zero_var_frac"], 0.5, 0.8, higher_is_better=False), advice))
    if "kl" in v:
        rows.append(_row("KL to the reference (k3, per token)", v["kl"], grade(v["kl"], 0.1, 0.5, False),
                         "lower grpo.lr or raise grpo.beta_kl"))
    for side in ("low", "high"):
        key = f"clip_frac_{side}"
        if key in v:
            rows.append(_row(f"clip fraction ({side})", v[key], grade(v[key], 0.1, 0.3, False),
                             "lower grpo.lr or grpo.ppo_epochs: the ratio leaves the trust region"))
    return rows


def rsd_premise(v: dict[str, Any]) -> list[Diagnostic]:
    """RSD: is the teacher (with the privileged context) better than the student without it?"""
    rows = []
    stop = "the premise fails: check the context (rsd.ctx_*), use rsd.ctx_warm_start, or do not distil"
    if "success_base_ctx" in v and "success_base" in v:
        gap = v["success_base_ctx"] - v["success_base"]
        rows.append(_row("success with context − without (base model)", gap, grade(gap, 0.0, -0.02), stop,
                         f"{100 * v['success_base_ctx']:.1f}% − {100 * v['success_base']:.1f}% = {100 * gap:+.1f} pt"))
    has_sampled = "teacher_token_logp" in v and "student_token_logp" in v
    sampled = (f"; all sampled tokens {_fmt(v['teacher_token_logp'])} vs {_fmt(v['student_token_logp'])}"
               if has_sampled else "")
    if v.get("separation") is not None:
        # The honest test: relative to the student, the teacher must favour what succeeded over what failed.
        rows.append(_row("teacher − student log-prob per step, successful − failed episodes (separation)",
                         v["separation"], grade(v["separation"], 0.1, 0.01),
                         "the context does not tell the teacher what worked: make it carry the outcome "
                         "(rsd.components with future), teach reading it (rsd.ctx_warm_start, "
                         "rsd.ctx_warm_keep_plain=0 when the model memorises answers instead), or do not distil",
                         f"{_fmt(v.get('success_gap'))} − {_fmt(v.get('failure_gap'))} = {_fmt(v['separation'])} "
                         f"({_fmt(v.get('success_steps'))} / {_fmt(v.get('failure_steps'))} steps)"))
    if v.get("separation") is not None and v.get("separation_round1") is not None and v["separation_round1"] > 0.1:
        kept = v["separation"] / v["separation_round1"]
        rows.append(_row("teacher still reads its context (separation now / in round 1)", kept, grade(kept, 0.5, 0.25),
                         "the student's plain-prompt updates erase the reading of the teacher that follows it: "
                         "freeze the teacher (rsd.teacher=fixed_init) or lower rsd.lr",
                         f"{_fmt(v['separation'])} / {_fmt(v['separation_round1'])} = {_fmt(kept)}"))
    if v.get("success_gap") is not None:
        rows.append(_row("teacher − student log-prob on successful episodes' steps", v["success_gap"],
                         grade(v["success_gap"], -0.1, -0.5),
                         "the teacher with context doubts actions that worked: " + stop,
                         f"{_fmt(v['success_gap'])}{sampled}"))
    elif has_sampled:
        # Records without outcome numbers (older runs, or a round with only one outcome): the mean over the
        # student's own sampled tokens, which a teacher that knows the answer lowers on every wrong sample.
        gap = v["teacher_token_logp"] - v["student_token_logp"]
        rows.append(_row("teacher log-prob of the behaviour tokens, with − without context", gap,
                         grade(gap, 0.0, -0.1), stop + " (a weak student's samples are mostly wrong, so a good "
                         "teacher can read lower here: check the success separation before acting on this)",
                         f"{_fmt(v['teacher_token_logp'])} − {_fmt(v['student_token_logp'])} = {_fmt(gap)}"))
    if "teacher_auc_flagged" in v:
        rows.append(_row("teacher disfavours flagged steps (AUC)", v["teacher_auc_flagged"],
                         grade(v["teacher_auc_flagged"], 0.6, 0.5),
                         "the context does not tell the teacher which steps were mistakes: " + stop))
    return rows


MIN_FLAGGED_JUDGED = 10  # [O] below this many flagged steps the share praised is one or two steps' noise


def selfguide_premise(v: dict[str, Any]) -> list[Diagnostic]:
    """Self-Guide: do guides help, and does the action follow the guide's 'Next:'?"""
    rows = []
    if "guided_success" in v:
        base = v.get("unguided_success")
        ratio = v["guided_success"] / base if base else None
        shown = f"{100 * v['guided_success']:.1f}%" + (f" vs {100 * base:.1f}%" if base is not None else
                                                        " (no unguided run to compare)")
        verdict = grade(ratio, 1.0, 0.8) if base else NA
        rows.append(_row("guided vs unguided success", ratio, verdict,
                         "compare with the selfguide.guide=none run; guided BC that loses success should not be "
                         "the RL start", shown))
    if "guide_agreement" in v:
        rows.append(_row("guide/action agreement ('Next: <action>' = action taken)", v["guide_agreement"],
                         grade(v["guide_agreement"], 0.8, 0.5),
                         "the guide does not steer the action: more guide-BC epochs or demos, or selfguide.guide=none",
                         f"{_fmt(v['guide_agreement'])} of {_fmt(v.get('guide_steps'))} steps"))
    if v.get("verdict_auc_success") is not None:
        # A perfectly judged episode with one wrong step among six scores only ~0.58 here (its other steps are
        # rightly 'good'), so the bar is low; below 0.5 the verdicts favour the steps of failed episodes.
        rows.append(_row("verdict calibration: AUC of the verdict for its step lying on a successful episode",
                         v["verdict_auc_success"], grade(v["verdict_auc_success"], 0.55, 0.5),
                         "the internal reward does not track success: keep it off (selfguide.schedule=none) or "
                         "train the judging with oracle verdicts (selfguide.demo_verdicts=oracle)"))
    if v.get("verdict_good_on_flagged") is not None:
        # The internal reward pays each step by the next verdict: praise for a step the environment rejected pays
        # for invalid actions, and the policy learns them (seen when self-judging drifted under RL).
        n = v.get("flagged_judged")
        few = n is not None and n < MIN_FLAGGED_JUDGED
        rows.append(_row("verdicts that call a step the environment flagged (invalid, format, repeat) 'good'",
                         v["verdict_good_on_flagged"],
                         NA if few else grade(v["verdict_good_on_flagged"], 0.2, 0.5, higher_is_better=False),
                         "the internal reward is paying for actions the environment rejects: keep it off from here "
                         "(selfguide.schedule=none) or lower selfguide.lambda_max, raise grpo.beta_kl, or use the last "
                         "checkpoint whose verdicts on flagged steps held",
                         f"{_fmt(v['verdict_good_on_flagged'])} of {_fmt(n)} flagged steps"
                         + (f" (too few to grade: under {MIN_FLAGGED_JUDGED})" if few else "")))
    if v.get("guide_format_error_rate") is not None:
        rows.append(_row("replies without a parseable guide verdict (guide format lost)", v["guide_format_error_rate"],
                         grade(v["guide_format_error_rate"], 0.05, 0.2, higher_is_better=False),
                         "the guides drift out of format under RL (nothing rewards the format): lower grpo.lr, raise "
                         "grpo.beta_kl, or use the last checkpoint whose guides held"))
    return rows + policy_update(v)


def eto_dpo(v: dict[str, Any]) -> list[Diagnostic]:
    """ETO: does DPO separate the pairs, and does it keep the chosen trajectories likely?"""
    rows = []
    if "reward_margin" in v:
        rows.append(_row("DPO reward margin β·(Δchosen − Δrejected), after training", v["reward_margin"],
                         grade(v["reward_margin"], 1e-6, -1e-6), "the pairs are not learned: raise eto.lr or epochs"))
    if "chosen_logp_drift" in v:
        rows.append(_row("chosen log-prob drift log π − log π_ref (per trajectory)", v["chosen_logp_drift"],
                         grade(v["chosen_logp_drift"], 0.0, -1.0),
                         "DPO lowers the chosen trajectories too (likelihood displacement): lower eto.lr / "
                         "eto.lr_later or fewer epochs"))
    rejected = (f"; rejected log-prob drift {_fmt(v['rejected_logp_drift'])}" if "rejected_logp_drift" in v
                else "")
    rows += _format_drift_rows(v, "iteration", "DPO pushes the rejected trajectories' tokens down until replies "
                               "break: lower eto.lr / eto.lr_later, raise eto.beta, or fewer epochs", rejected)
    return rows


def bon_premise(v: dict[str, Any]) -> list[Diagnostic]:
    """BoN + SFT: are there successes to learn from, do they add tasks the demos lack, and are they clean?"""
    rows = []
    if "pass_at_n" in v:
        rows.append(_row("practice tasks solved at least once (pass@N)", v["pass_at_n"], grade(v["pass_at_n"], 0.2, 0.05),
                         "few successes to learn from: raise rsd.bon_n or rsd.rollout_temperature, or start from a "
                         "stronger BC policy"))
    if "kept_new_task_share" in v:
        rows.append(_row("kept successes on tasks without a demo", v["kept_new_task_share"],
                         grade(v["kept_new_task_share"], 0.3, 0.0),
                         "the kept samples mostly repeat the demos' tasks: practise on more training tasks than "
                         "the BC run saw (env.n_train above bc.n_expert)"))
    if "kept_invalid_rate" in v:
        rows.append(_row("invalid actions among the kept steps", v["kept_invalid_rate"],
                         grade(v["kept_invalid_rate"], 0.05, 0.15, higher_is_better=False),
                         "successes that pass through invalid actions teach them: lower rsd.rollout_temperature"))
    return rows


BC_EPOCHS_FIX = ("BC has not learned which actions are valid here: raise optim.epochs of the BC run and read any "
                 "method's gain over this start with care, since more BC may give it too (CookingWorld, seed 0, "
                 "200 games: 12 -> 30 epochs took invalid actions 52 -> 18% and success 17.5 -> 41.5%)")


BC_CURVE_RISE = 0.05  # [O] dev success gained over the curve's last interval beyond which it is "still rising" (warn)


def bc_start(v: dict[str, Any]) -> list[Diagnostic]:
    """The BC start every method builds on: has imitation taught the action format and which actions are valid?

    Read from the held-out evaluation of the BC checkpoint (eval/bc), so every run that starts from BC shows it.
    An undertrained start confounds a method's gain with more imitation (docs/studies/qevolve_cookingworld_powered).
    """
    rows = []
    if v.get("format_error_rate") is not None:
        rows.append(_row("held-out replies without a parseable action (BC start)", v["format_error_rate"],
                         grade(v["format_error_rate"], 0.02, 0.1, higher_is_better=False),
                         "BC has not learned the reply format: raise optim.epochs or check agent.thoughts and the "
                         "demos' reply text"))
    if v.get("invalid_rate") is not None:
        # no parseable action at all: no action was judged, so 0 invalid says nothing
        mute = (v.get("format_error_rate") or 0.0) >= 1.0
        rows.append(_row("held-out invalid actions (BC start; the expert's are 0)", v["invalid_rate"],
                         NA if mute else grade(v["invalid_rate"], 0.1, 0.25, higher_is_better=False),
                         "no reply held an action (row above)" if mute else BC_EPOCHS_FIX))
    curve = v.get("curve") or []
    if len(curve) >= 2:
        (e0, s0), (e1, s1) = curve[-2], curve[-1]
        rise = s1 - s0
        rows.append(_row(f"dev success still rising at the end of BC (epoch {e0:g} -> {e1:g})", rise,
                         grade(rise, BC_CURVE_RISE, 1.0, higher_is_better=False),
                         f"the last {e1 - e0:g} epochs still gained: raise optim.epochs until the curve levels off",
                         ", ".join(f"{e:g}: {100 * x:.1f}%" for e, x in curve) + f" ({100 * rise:+.1f} pt)"))
    return rows


EVALUATORS: dict[str, Callable[[dict[str, Any]], list[Diagnostic]]] = {
    "qevolve": critic_fit, "grpo": policy_update, "rsd": rsd_premise, "selfguide": selfguide_premise,
    "eto": eto_dpo, "bon_sft": bon_premise,
}
STEP_WORDS = {"qevolve": "round", "grpo": "update", "selfguide": "update", "eto": "iteration", "rsd": "round",
              "bon_sft": "round"}


def diagnose(method: str, values: dict[str, Any]) -> list[Diagnostic]:
    """The diagnostics of one `diag/<method>` record (only those whose numbers it holds)."""
    fn = EVALUATORS.get(method)
    return fn(values) if fn is not None else []


def worst(diags: Sequence[Diagnostic]) -> str:
    """The worst verdict (fail > warn > n/a > pass)."""
    order = {FAIL: 3, WARN: 2, NA: 1, PASS: 0}
    return max((d.verdict for d in diags), key=lambda x: order[x], default=PASS)


def _numeric(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in rec.items() if k not in ("time", "phase", "step")}


def _mean_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    keys = {k for r in records for k, v in _numeric(r).items() if isinstance(v, (int, float)) and v is not None}
    out = {}
    for k in keys:
        xs = [r[k] for r in records if isinstance(r.get(k), (int, float))]
        out[k] = sum(xs) / len(xs)
    return out


def bc_start_record(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The held-out evaluation of the BC checkpoint (phase eval/bc/<split>; test when there, the last record of a
    split wins), with its split under 'split' and BC's dev learning curve [(epoch, success), ...] (bc.eval_epochs)
    under 'curve'; None when the run has no BC evaluation."""
    by_split = {str(r["phase"]).split("/", 2)[2]: r for r in records
                if str(r.get("phase", "")).startswith("eval/bc/") and str(r["phase"]).count("/") == 2}
    if not by_split:
        return None
    split = "test" if "test" in by_split else sorted(by_split)[0]
    curve = {float(m.group(1)): r["success_rate"] for r in records
             if (m := _CURVE_RE.fullmatch(str(r.get("phase", "")))) and r.get("success_rate") is not None}
    return {**_numeric(by_split[split]), "split": split, "curve": sorted(curve.items())}


_CURVE_RE = re.compile(r"eval/bc-epoch-(\d+(?:\.\d+)?)/dev")  # BC's learning curve (bc.eval_epochs)


def diagnostic_tables(records: list[dict[str, Any]], max_rows: int = 4) -> list[tuple[str, list[Diagnostic]]]:
    """(title, rows) per diagnostics table of a run, from its metrics records (phase diag/<method>).

    The BC start's table comes first (from its held-out evaluation, eval/bc/<split>). Records at step 0 (before
    training) are shown as they are; with more than max_rows training records (one per
    GRPO update, say) they are averaged into one table and the last is shown beside it, else one table each.
    """
    by_method: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        if str(rec.get("phase", "")).startswith(PHASE_PREFIX):
            by_method.setdefault(rec["phase"][len(PHASE_PREFIX):], []).append(rec)
    tables: list[tuple[str, list[Diagnostic]]] = []
    start = bc_start_record(records)
    if start is not None:
        tables.append((f"BC start (every method's first policy), held-out {start['split']}", bc_start(start)))
    for method, recs in by_method.items():
        latest: dict[int, dict[str, Any]] = {}
        for rec in recs:  # a resumed run may log a step twice: the last record wins
            latest[int(rec.get("step", 0))] = {**latest.get(int(rec.get("step", 0)), {}), **_numeric(rec)}
        word = STEP_WORDS.get(method, "step")
        if 0 in latest:
            tables.append((f"{method}, before training", diagnose(method, latest.pop(0))))
        steps = sorted(latest)
        if len(steps) > max_rows:
            # The mean, and the last step alone: a premise that erodes late (guides drifting out of format) is what
            # the last checkpoint carries, and a mean over the run dilutes it.
            tables.append((f"{method}, mean over {word}s {steps[0]}-{steps[-1]}",
                           diagnose(method, _mean_record([latest[s] for s in steps]))))
            tables.append((f"{method}, {word} {steps[-1]} (the last)", diagnose(method, latest[steps[-1]])))
        else:
            tables += [(f"{method}, {word} {s}", diagnose(method, latest[s])) for s in steps]
    return [(title, diags) for title, diags in tables if diags]


def not_passing(diags: Sequence[Diagnostic]) -> str:
    """'fail: A, B; warn: C' (the rows whose verdict is not a pass), '-' when all pass."""
    parts = [f"{v}: " + ", ".join(d.name for d in diags if d.verdict == v) for v in (FAIL, WARN)
             if any(d.verdict == v for d in diags)]
    return "; ".join(parts) or "-"


def render_section(records: list[dict[str, Any]], max_rows: int = 4) -> list[str]:
    """The report's 'Diagnostics' section from metrics records (phase diag/<method>); [] when there are none."""
    tables = diagnostic_tables(records, max_rows)
    if not tables:
        return []
    lines = ["", "## Diagnostics", "",
             "Does each method's premise hold in this run? (thresholds [O]; agentevo/eval/diagnostics.py)"]
    for title, diags in tables:
        lines += ["", f"### {title}: {worst(diags)}", "", "| diagnostic | value | verdict | what to change |",
                  "|---|---|---|---|"]
        lines += [f"| {d.name} | {d.value} | {d.verdict} | {d.fix or '-'} |" for d in diags]
    return lines
