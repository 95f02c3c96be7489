"""Self-Guide: verdict parsing, guide token spans, internal returns and their alignment, the trust schedule,
history retention, and the per-token advantage tensor (guide tokens get the outcome advantage only)."""

from __future__ import annotations

import pytest
import torch

from agentevo.agent.prompt import HistoryTurn, parse_action
from agentevo.algorithms.advantages import trust_weight
from agentevo.algorithms.grpo.config import GRPOConfig
from agentevo.algorithms.grpo.recipe import label_sample
from agentevo.algorithms.selfguide.config import SelfGuideConfig
from agentevo.algorithms.selfguide.recipe import (
    GuidedActor,
    GuidedExpertActor,
    SelfJudge,
    auc,
    continuation_logprobs,
    detour_flags,
    group_step_advantages,
    guide_stats,
    guide_token_mask,
    guided_history,
    guided_reply,
    guided_samples,
    guides_kept,
    internal_advantages,
    make_masker,
    oracle_agreement,
    oracle_verdict,
    parse_guide,
    stage_of,
    token_advantages,
    verdict_text,
)
from agentevo.data.tensors import collate
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.errors import ConfigError
from agentevo.models.backend import Sampling
from agentevo.rollout.engine import Episode, EpisodeRequest

REPLY = "Guide: The last step made progress. Next: take knife. Verdict: good\nThought: I need the knife.\nAction: take knife"


# ------------------------------------------------------------------------------------------- parsing


def test_parse_guide_and_verdicts() -> None:
    assert parse_guide(REPLY) == ("The last step made progress. Next: take knife.", 1)
    assert parse_guide("Guide: hm Verdict: BAD\nAction: look around") == ("hm", -1)
    assert parse_guide("Guide: hm Verdict: neutral\nThought: x\nAction: y") == ("hm", 0)
    assert parse_guide("Guide: hm Verdict: maybe\nAction: y") == ("hm", None)  # unparseable verdict
    assert parse_guide("Guide: no verdict here\nThought: x\nAction: y") == ("no verdict here", None)
    assert parse_guide("Thought: x\nAction: y") == (None, None)
    # a 'Verdict:' after the guide's end (in the Thought) does not count
    assert parse_guide("Guide: hm\nThought: Verdict: good\nAction: y") == ("hm", None)
    after = "Thought: x\nAction: take knife\nGuide: The last step failed. Verdict: bad"
    assert parse_guide(after, "after") == ("The last step failed.", -1) and parse_action(after) == "take knife"


def test_demo_replies_round_trip() -> None:
    for verdict in (1, 0, -1):
        text = guided_reply("open fridge", verdict, first=False)
        assert parse_guide(text)[1] == verdict and parse_action(text) == "open fridge"
        assert parse_guide(guided_reply("open fridge", verdict, False, position="after"), "after")[1] == verdict
    assert guided_reply("open fridge", 0, True).startswith("Guide: Nothing done yet.")
    assert "Guide" not in guided_reply("open fridge", 1, False, with_guide=False)
    for position in ("before", "after"):  # the judged text is the reply up to its verdict word
        full = guided_reply("open fridge", -1, False, position=position)
        assert full.startswith(verdict_text("open fridge", -1, False, "template", position))
        assert verdict_text("open fridge", -1, False, "template", position).endswith("Verdict: bad")


def test_continuation_logprobs_match_one_sequence_at_a_time(tiny_policy) -> None:  # noqa: ANN001
    """The shared prompt cache and the right padding of the continuations change no continuation's score."""
    prompt = tiny_policy.renderer.encode_reply("You are in the kitchen.")
    conts = [tiny_policy.renderer.encode_reply(t)[:-1] for t in ("open fridge", "go west now please", "x")]
    got = continuation_logprobs(tiny_policy, prompt, conts)
    with torch.no_grad():
        one_by_one = [sum(float(v) for v in torch.log_softmax(
            tiny_policy.model(torch.tensor([prompt[:1] + c])).logits[0].float(), -1)[range(len(c)), c])
            for c in conts[:2]]
    assert continuation_logprobs(tiny_policy, prompt[:1], conts[:2]) == pytest.approx(one_by_one, abs=1e-4)  # no cache
    for c, g in zip(conts, got, strict=True):
        x = torch.tensor([prompt + c])
        with torch.no_grad():
            logp = torch.log_softmax(tiny_policy.model(x).logits[0].float(), -1)
        want = sum(float(logp[len(prompt) - 1 + j, tok]) for j, tok in enumerate(c))
        assert g == pytest.approx(want, abs=1e-4)


def test_self_judged_demo_verdicts_replace_the_oracle_and_are_recorded(tiny_policy) -> None:  # noqa: ANN001
    """demo_verdicts=self: from the second step on, the judge's verdict is written into the guide line and the
    (oracle, own) pair is kept in the request meta; the first step and the action stay the demo's."""
    task = Task("probe-guide", "probe-guide/train/0", "train", "guide", {}, 3)
    ep = Episode(EpisodeRequest(task, 0), 0, first_obs="Light 1 of 3 is blue.", goal="press the lights")
    ep.plan = ["press blue", "press red", "press green"]
    calls = []

    def judge(e: Episode, action: str) -> int:
        calls.append((len(e.steps), action))
        return -1

    actor = GuidedExpertActor("none", 0.0, 0, True, "before", judge=judge)
    first = actor.act([ep])[0].text
    assert calls == [] and "Nothing done yet." in first and parse_action(first) == "press blue"
    ep.steps.append(Step(1, ep.first_obs, first, [], None, "press blue", "Correct. Light 2 of 3 is red.", 0.5,
                         False, 0.5))
    second = actor.act([ep])[0].text
    assert calls == [(1, "press red")] and parse_guide(second)[1] == -1 and parse_action(second) == "press red"
    assert ep.request.meta["verdicts"] == [[1, -1]]  # the oracle said good (score up), the judge bad
    # a judge over a model: the argmax over the verdict lines of log p(line | episode) minus log p(line | the same
    # episode with its last observation replaced by "N/A")
    own = SelfJudge(tiny_policy, "Press the lights.", 2, "none", "before")
    blank = own.prompt_ids(ep, content_free=True)
    assert tiny_policy.renderer.decode(blank).count("N/A") == 1 and "Correct." not in tiny_policy.renderer.decode(blank)
    assert "Correct. Light 2 of 3 is red." in tiny_policy.renderer.decode(own.prompt_ids(ep))
    conts = [tiny_policy.renderer.encode_reply(verdict_text("press red", v, False, "none", "before"))[:-1]
             for v in (1, 0, -1)]
    seen, cf = (continuation_logprobs(tiny_policy, p, conts) for p in (own.prompt_ids(ep), blank))
    want = [a - b for a, b in zip(seen, cf, strict=True)]
    assert list(own.scores(ep, "press red").values()) == pytest.approx(want)
    assert own(ep, "press red") == (1, 0, -1)[max(range(3), key=want.__getitem__)]


# ------------------------------------------------------------------------------------------- token spans


class _PieceTokenizer:
    """Each id decodes to a fixed piece of text; id 0 is a special token that decodes to nothing."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_guide_mask_by_last_character_of_each_token() -> None:
    tok = _PieceTokenizer(["", "Guide: ok", " Verdict: good", ".\n", "\nThought", ": x", "\nAction: go", "Thought"])
    # '.\n' ends inside the guide -> guide; '\nThought' ends in the Thought -> not guide; end token never.
    assert guide_token_mask(tok, [1, 2, 3, 7, 5, 6, 0]) == [True, True, True, False, False, False, False]
    assert guide_token_mask(tok, [1, 2, 4, 5, 6, 0]) == [True, True, False, False, False, False]
    tok2 = _PieceTokenizer(["", "Thought: x", "\nAction: go", "\nGui", "de: bad Verdict: bad"])
    assert guide_token_mask(tok2, [1, 2, 3, 4, 0], "after") == [False, False, True, True, False]
    assert guide_token_mask(tok2, [1, 2, 0]) == [False, False, False]


def test_guide_mask_on_real_tokenizer_ids(tiny_policy) -> None:  # noqa: ANN001
    ids = tiny_policy.renderer.encode_reply(REPLY)  # as generated: reply tokens + end-of-turn
    mask = guide_token_mask(tiny_policy.tokenizer, ids)
    dec = tiny_policy.tokenizer.decode
    guide = dec([i for i, m in zip(ids, mask, strict=True) if m])
    rest = dec([i for i, m in zip(ids, mask, strict=True) if not m], skip_special_tokens=True)
    assert guide.startswith("Guide:") and guide.rstrip().endswith("Verdict: good")
    assert rest.lstrip().startswith("Thought: I need the knife.") and rest.endswith("Action: take knife")
    assert mask[-1] is False and any(mask) and not all(mask)
    assert make_masker(tiny_policy.tokenizer, "before", enabled=False)(ids) == [False] * len(ids)


# ------------------------------------------------------------------------------------------- internal rewards


def test_internal_returns_align_to_previous_step_and_normalise_over_group() -> None:
    # verdicts given at t=1..4; t=1 ignored; verdict at t judges step t-1; r_int = [+1, -1, 0, 0]
    a_int = internal_advantages([[None, 1, -1, 0]], gamma_int=0.5, norm="none")[0]
    # G_4 = 0, G_3 = 0, G_2 = -1, G_1 = 1 + 0.5 * (-1) = 0.5
    assert a_int.tolist() == pytest.approx([0.5, -1.0, 0.0, 0.0])
    # pooled over all steps of the group: values [0.5, -1, 0, 0] + [1, 0] (verdicts [0, 1] -> r_int [1, 0])
    normed = internal_advantages([[None, 1, -1, 0], [0, 1]], gamma_int=0.5, norm="group")
    flat = torch.tensor([0.5, -1.0, 0.0, 0.0, 1.0, 0.0])
    expect = (flat - flat.mean()) / (flat.std() + 1e-6)
    assert torch.cat(normed).tolist() == pytest.approx(expect.tolist(), abs=1e-5)
    # always 'good': r_int = [1, 0] for everyone; the normalised return depends on t only (an action-independent
    # baseline shift, zero in expectation), identical for every member, so no trajectory is favoured.
    same = internal_advantages([[1, 1], [1, 1]], 0.95, "group")
    assert same[0].tolist() == pytest.approx([0.8660, -0.8660], abs=1e-4) and same[0].tolist() == same[1].tolist()



def test_internal_returns_normalised_per_step_index() -> None:
    """int_norm=step: at each t, over the episodes that have a step t. Always 'good' -> 0 everywhere (group norm
    gives +-0.866 by position, above). Verdicts [., 1, -1, 0] and [., 1, 1]: r_int [1, -1, 0, 0] and [1, 1, 0],
    gamma 0.5 -> G [0.5, -1, 0, 0] and [1.5, 1, 0]; at t=1 values 0.5 / 1.5 -> -/+0.7071 (sample std 0.7071), at
    t=2 -1 / 1 -> -/+0.7071, t=3 equal -> 0, t=4 only one episode -> 0."""
    from agentevo.algorithms.advantages import normalise_per_step_index

    assert [x.tolist() for x in internal_advantages([[1, 1, 1], [1, 1, 1]], 0.95, "step")] == [[0.0] * 3] * 2
    a, b = internal_advantages([[None, 1, -1, 0], [0, 1, 1]], 0.5, "step")
    assert a.tolist() == pytest.approx([-0.7071, -0.7071, 0.0, 0.0], abs=1e-4)
    assert b.tolist() == pytest.approx([0.7071, 0.7071, 0.0], abs=1e-4)
    assert normalise_per_step_index([]) == [] and normalise_per_step_index([[2.0, 3.0]])[0].tolist() == [0.0, 0.0]


def test_group_advantages_with_the_invalid_action_penalty() -> None:
    """An all-fail group of two (R = 0, 0): A praises its own invalid step 2, B calls its step 1 bad. int_norm step,
    gamma 0.5: r_int A [1, 1, 0], B [-1, 1, 0] -> G [1.5, 1, 0] and [-0.5, 1, 0] -> per step index +-0.7071 at t=1,
    0 after. lambda 0.5 -> step terms +-0.3536 at t=1. Without a penalty A_env is 0 (equal returns); a return
    penalty of 0.1 makes R [-0.1, 0] -> A_env -/+0.7071, so the failed group carries signal against the invalid
    step; a step penalty puts -0.1 on that step's term only; DAPO drops the group only when the returns tie."""
    def traj(signals: list[str]) -> Trajectory:
        steps = [Step(t, "", "", [], None, "press red", "", 0.0, False, signal=sig) for t, sig in
                 enumerate(signals, start=1)]
        return Trajectory(Task("probe-guide", "t0", "train", "lights"), "self", "p", "", steps, 0.0, False)

    group = [traj(["none", "invalid", "none"]), traj(["none", "none", "none"])]
    verdicts = [[None, 1, 1], [None, -1, 1]]
    sg = SelfGuideConfig(int_norm="step", gamma_int=0.5)
    (a_env, terms, a_int), (b_env, b_terms, b_int) = group_step_advantages(group, verdicts, 0.5, GRPOConfig(), sg)
    assert (a_env, b_env) == (0.0, 0.0)
    assert a_int == pytest.approx([0.7071, 0.0, 0.0], abs=1e-4) and b_int == pytest.approx([-0.7071, 0.0, 0.0], abs=1e-4)
    assert terms == pytest.approx([0.3536, 0.0, 0.0], abs=1e-4) and b_terms == pytest.approx([-0.3536, 0, 0], abs=1e-4)
    ret = group_step_advantages(group, verdicts, 0.5, GRPOConfig(invalid_penalty=0.1), sg)
    assert [r[0] for r in ret] == pytest.approx([-0.7071, 0.7071], abs=1e-4)
    assert ret[0][1] == pytest.approx(terms) and ret[1][1] == pytest.approx(b_terms)
    step = group_step_advantages(group, verdicts, 0.5, GRPOConfig(invalid_penalty=0.1, penalty_mode="step"), sg)
    assert [r[0] for r in step] == [0.0, 0.0]
    assert step[0][1] == pytest.approx([0.3536, -0.1, 0.0], abs=1e-4) and step[1][1] == pytest.approx(b_terms)
    assert group_step_advantages(group, verdicts, 0.5, GRPOConfig(drop_equal_groups=True), sg) is None
    kept = group_step_advantages(group, verdicts, 0.5, GRPOConfig(drop_equal_groups=True, invalid_penalty=0.1), sg)
    assert kept is not None and [r[0] for r in kept] == pytest.approx([-0.7071, 0.7071], abs=1e-4)


def test_trust_schedule_and_stages_at_breakpoints() -> None:
    K, bp = 10, (0.2, 0.5)
    lam = [trust_weight(k, K, 0.5, bp, "staged") for k in range(K)]
    assert lam[:3] == [0.0, 0.0, 0.0]  # stage I (k < 2), and the ramp starts at 0 on the breakpoint
    assert lam[3] == pytest.approx(0.5 / 3) and lam[4] == pytest.approx(1.0 / 3)
    assert lam[5:] == [0.5] * 5
    assert [stage_of(k, K, bp) for k in range(K)] == [1, 1, 2, 2, 2, 3, 3, 3, 3, 3]
    assert [guides_kept("staged", s) for s in (1, 2, 3)] == [0, 1, None]
    assert [guides_kept(m, 1) for m in ("none", "last", "all")] == [0, 1, None]
    assert trust_weight(0, K, 0.5, bp, "constant") == 0.5 and trust_weight(9, K, 0.5, bp, "none") == 0.0


def test_auc_and_oracle_verdicts() -> None:
    assert auc([1, 0, -1, 1], [True, False, False, True]) == 1.0
    assert auc([0, 0], [True, False]) == 0.5 and auc([1, 1], [True, True]) is None
    assert auc([1, -1, 0], [False, True, True]) == 0.0

    def st(score: float, signal: str = "none") -> Step:
        return Step(1, "", "", [], None, "a", "", 0.0, False, score=score, signal=signal)

    assert oracle_verdict([]) == 0
    assert oracle_verdict([st(0.0), st(0.25)]) == 1
    assert oracle_verdict([st(0.25), st(0.25)]) == 0
    assert oracle_verdict([st(0.25), st(0.25, "invalid")]) == -1
    assert oracle_verdict([st(0.5), st(0.25)]) == -1


def test_oracle_agreement_counts_only_the_steps_the_score_judged() -> None:
    # (oracle, own): a success-only score leaves every step but the last neutral; those do not count against the judge
    pairs = [[0, 1], [0, -1], [1, 1], [-1, 1], [-1, -1]]
    assert oracle_agreement(pairs) == {"self_verdict_oracle_agreement": 2 / 3, "self_verdict_oracle_steps": 3}
    assert oracle_agreement([[0, 1], [0, -1]]) == {"self_verdict_oracle_agreement": None, "self_verdict_oracle_steps": 0}


def test_detour_flags() -> None:
    for seed in range(20):
        flags = detour_flags(f"task{seed}", seed, 12, 0.3, 16)
        assert flags.count(False) == 12 and len(flags) <= 16
        assert not any(a and b for a, b in zip(flags, flags[1:], strict=False))
        assert flags == detour_flags(f"task{seed}", seed, 12, 0.3, 16)
    assert detour_flags("t", 0, 5, 0.0, 20) == [False] * 5
    assert detour_flags("t", 0, 5, 0.9, 5) == [False] * 5  # no room for detours


# ------------------------------------------------------------------------------------------- the advantage tensor


def _guided_traj(policy, n: int = 3, keep: int | None = 0) -> Trajectory:  # noqa: ANN001
    r = policy.renderer
    steps = []
    for t in range(1, n + 1):
        text = guided_reply("take knife", 1 if t % 2 else -1, t == 1)
        ids = r.encode_reply(text)
        steps.append(Step(t, f"obs {t}", text, ids, [-0.5] * len(ids), "take knife", f"obs {t + 1}", 0.0, False))
    return Trajectory(Task("twx-cookingworld", "t0", "train", "cookingworld", {}, 20), "self", "p", "Instruction.",
                      steps, 1.0, True, goal="g", meta={"keep": keep})


@pytest.mark.parametrize("keep", [0, 1, None])
@pytest.mark.parametrize("mode", ["env", "combined"])
def test_guide_tokens_get_only_the_outcome_advantage(tiny_policy, keep, mode) -> None:  # noqa: ANN001
    traj = _guided_traj(tiny_policy, 3, keep)
    mask_fn = make_masker(tiny_policy.tokenizer, "before")
    masks = [mask_fn(s.action_ids) for s in traj.steps]
    a_env, lam, a_int = 0.8, 0.5, [0.4, -1.2, 0.0]
    token_adv = token_advantages(masks, a_env, [lam * x for x in a_int], mode)
    rows = [label_sample(r, token_adv) for r in guided_samples(tiny_policy.renderer, traj, 0, 20, 4096, keep, mask_fn)]
    assert len(rows) == (1 if keep is None else 3)  # cut histories cannot be packed
    batch = collate(rows, tiny_policy.pad_id)
    for row, sample in enumerate(rows):
        for (a, b), t in zip(sample.spans, sample.steps, strict=True):
            adv = batch["adv"][row, a:b]
            guide = torch.tensor(masks[t - 1])
            assert guide.any() and (~guide).any()
            combined = a_env + lam * a_int[t - 1]
            assert torch.allclose(adv[~guide], torch.tensor(combined))
            assert torch.allclose(adv[guide], torch.tensor(a_env if mode == "env" else combined))
            assert batch["input_ids"][row, a:b].tolist() == traj.steps[t - 1].action_ids
        outside = batch["action_mask"][row] == 0
        assert torch.all(batch["adv"][row][outside] == 0)


def test_history_retention_cuts_guides_and_matches_the_actor(tiny_policy) -> None:  # noqa: ANN001
    traj = _guided_traj(tiny_policy, 3)
    mask_fn = make_masker(tiny_policy.tokenizer, "before")
    turns = [(s.action_ids, s.next_obs) for s in traj.steps]
    cut = [[i for i, m in zip(s.action_ids, mask_fn(s.action_ids), strict=True) if not m] for s in traj.steps]
    assert [h.action_ids for h in guided_history(turns, mask_fn, 0)] == cut
    assert [h.action_ids for h in guided_history(turns, mask_fn, 1)] == cut[:2] + [traj.steps[2].action_ids]
    assert [h.action_ids for h in guided_history(turns, mask_fn, None)] == [s.action_ids for s in traj.steps]
    assert "Guide" not in tiny_policy.tokenizer.decode(cut[0])
    # the training row of step 3 is built from exactly the prompt the guided actor showed
    for keep in (0, 1, None):
        actor = GuidedActor(tiny_policy, traj.instruction, 20, Sampling(), keep, mask_fn)
        ep = Episode(EpisodeRequest(traj.task, 0), 0, first_obs=traj.first_obs, goal=traj.goal)
        ep.history = [HistoryTurn(s.action_ids, s.next_obs) for s in traj.steps[:2]]
        rows = guided_samples(tiny_policy.renderer, traj, 0, 20, 4096, keep, mask_fn, steps=[3])
        a = rows[0].spans[-1][0]
        assert rows[0].input_ids[:a] == actor.prompt_ids(ep)


def test_guide_stats_distribution_and_calibration(tiny_policy) -> None:  # noqa: ANN001
    win = _guided_traj(tiny_policy, 3)  # verdicts +1 (t1, ignored), -1, +1
    lose = _guided_traj(tiny_policy, 2)
    lose.success = False
    for traj in (win, lose):
        for s, score in zip(traj.steps, [0.5, 0.5, 1.0], strict=False):
            s.score = score
    stats = guide_stats([win, lose], "before", make_masker(tiny_policy.tokenizer, "before"))
    # verdicts judged (t>=2): win: -1 (t2), +1 (t3); lose: -1 (t2)
    assert stats["verdict_bad"] == pytest.approx(2 / 3) and stats["verdict_good"] == pytest.approx(1 / 3)
    assert stats["verdict_missing"] == 0 and stats["guide_format_error_rate"] == 0
    # success labels [T, T, F] with scores [-1, +1, -1]: pairs (−1 vs −1) tie, (+1 vs −1) win -> 0.75
    assert stats["verdict_auc_success"] == pytest.approx(0.75)
    # progress of the judged step: step1 +0.5 (judged at t2, verdict -1), step2 0 (judged at t3, +1), lose step1 +0.5
    assert stats["verdict_auc_progress"] == pytest.approx(0.0)
    assert stats["guide_tokens"] > 3
    assert stats["verdict_good_on_flagged"] is None and stats["flagged_judged"] == 0  # no step was flagged
    # the environment rejected win's step 2 (judged 'good' at t3) and lose's step 1 (judged 'bad' at t2)
    win.steps[1].signal, lose.steps[0].signal = "invalid", "format"
    flagged = guide_stats([win, lose], "before", make_masker(tiny_policy.tokenizer, "before"))
    assert flagged["verdict_good_on_flagged"] == pytest.approx(1 / 2) and flagged["flagged_judged"] == 2


def test_selfguide_recipe_one_update_end_to_end(tmp_path, capsys) -> None:  # noqa: ANN001
    import json

    from agentevo.algorithms.selfguide.recipe import run as selfguide_run
    from agentevo.config import load_config
    from agentevo.run import Run
    smoke = [
        "env.n_train=3", "env.n_test=2", "env.params={max_steps: 4}", "model.tiny.hidden_size=64",
        "model.tiny.num_layers=2", "model.tiny.num_heads=2", "model.tiny.intermediate_size=128",
        "agent.max_new_tokens=16", "agent.history_window=4", "optim.epochs=1", "optim.batch_size=4",
        "optim.micro_batch_size=4", "rollout.n_parallel=2", "rollout.batch_size=4", "grpo.n_updates=1",
        "grpo.tasks_per_update=1", "grpo.group_size=2", "grpo.lr=1.0e-4", "grpo.batch_size=2",
        "grpo.micro_batch_size=2", "model.torch_threads=1",
    ]
    cfg = load_config(None, smoke + ["selfguide.guide_max_tokens=24", "selfguide.schedule=constant",
                                     "selfguide.demo_detour_prob=0.3"], method="selfguide", name="s",
                      output_dir=str(tmp_path))
    r = Run.create(cfg, quiet=True)
    try:
        results = selfguide_run(r)
        demos = r.store.load(collection="expert-guided")
    finally:
        r.close()
    assert results["expert-guided"]["n"] == 3 and all(parse_guide(s.action_text)[0] for t in demos for s in t.steps)
    assert [t.meta["keep"] for t in demos] == [0, 1, None]  # demos cycle through the history retentions
    update = results["update-1"]
    assert update["lambda"] == 0.5 and update["stage"] == 1 and update["guides_kept"] == 0
    for key in ("verdict_good", "verdict_auc_success", "guide_tokens", "guide_format_error_rate", "entropy", "kl",
                "clip_frac_low", "clip_frac_high"):
        assert key in update
    assert results["eval/update-1"]["test"]["train_env_steps"] == update["train_env_steps"]
    assert json.loads((tmp_path / "s/checkpoints/latest/state.json").read_text())["update"] == 1

    # A second seed starts from this run's guided demos and guide-BC (bc.warm_start_from) and trains on from there.
    shared = load_config(None, smoke + ["selfguide.guide_max_tokens=24", "selfguide.schedule=constant",
                                        "selfguide.demo_detour_prob=0.3", "seed=1", f"bc.warm_start_from={tmp_path / 's'}"],
                         method="selfguide", name="s1", output_dir=str(tmp_path))
    r = Run.create(shared, quiet=True)
    try:
        selfguide_run(r)
        assert len(r.store.load(collection="expert-guided")) == 3
    finally:
        r.close()
    state = json.loads((tmp_path / "s1/state.json").read_text())
    assert state["warm_start_from"]["expert"] == 3 and state["eval/bc"] == results["eval/bc"]
    assert (tmp_path / "s1/checkpoints/bc/model.safetensors").read_bytes() == \
        (tmp_path / "s/checkpoints/bc/model.safetensors").read_bytes()
    assert "update-1" in state
    for wrong, message in (("selfguide.guide=none", "was trained with guide lines"),
                           ("selfguide.guide_position=after", "selfguide.guide_position is 'after' here but 'before'")):
        bad = load_config(None, smoke + ["selfguide.guide_max_tokens=24", "selfguide.demo_detour_prob=0.3", wrong,
                                         f"bc.warm_start_from={tmp_path / 's'}"],
                          method="selfguide", name=f"bad-{wrong[-5:]}", output_dir=str(tmp_path))
        r = Run.create(bad, quiet=True)
        try:
            with pytest.raises(ConfigError, match=message):
                selfguide_run(r)
        finally:
            r.close()

    # `agentevo eval --guide` evaluates the same checkpoint with its guides at a chosen history retention.
    from agentevo.cli import main

    sets = [x for s in smoke + ["selfguide.guide_max_tokens=24"] for x in ("--set", s)]
    ckpt = str(tmp_path / "s/checkpoints/update-1")
    assert main(["eval", "--model", ckpt, "--guide", "--guide-history", "none", "--name", "ev", "--quiet",
                 "--output-dir", str(tmp_path), *sets]) == 0
    def eval_result(folder: str) -> dict:
        # eval keys carry a hash of what determines the result (checkpoint, env, split, n, guide settings)
        state = json.loads((tmp_path / folder / "state.json").read_text())
        (key,) = [k for k in state if k.startswith("eval/update-1-")]
        return state[key]["test"]

    guided = eval_result("ev")
    assert guided["n"] == 2 and guided["eval_guides_kept"] == 0 and "eval_verdict_good" in guided
    assert main(["eval", "--model", ckpt, "--name", "ev-plain", "--quiet", "--output-dir", str(tmp_path), *sets]) == 0
    plain = eval_result("ev-plain")
    assert "eval_guides_kept" not in plain
    capsys.readouterr()
    assert main(["eval", "--model", ckpt, "--guide-history", "all", "--name", "ev-bad", "--output-dir", str(tmp_path),
                 *sets]) == 2
    assert "--guide-history only applies to a guided evaluation: add --guide" in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path / "s/checkpoints/latest"), "--name", "ev-bad", "--output-dir",
                 str(tmp_path), *sets]) == 2
    assert "is not a model checkpoint (no config.json); the model inside it is" in capsys.readouterr().err


def test_self_judged_verdicts_need_a_pretrained_model() -> None:
    from agentevo.config import load_config

    with pytest.raises(ConfigError, match=r"selfguide.demo_verdicts=self needs a pretrained model \(set model.path\)"):
        load_config(None, ["selfguide.demo_verdicts=self"], method="selfguide")
    with pytest.raises(ConfigError, match="selfguide.demo_verdicts"):
        load_config(None, ["selfguide.demo_verdicts=model"], method="selfguide")
