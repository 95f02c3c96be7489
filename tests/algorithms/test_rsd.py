"""RSD: teacher cache and loss, context material, precedent ranking, teacher schedule, rule search, writers."""

from __future__ import annotations

import http.server
import json
import math
import random
import threading
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from agentevo.agent.prompt import expert_reply, parse_action
from agentevo.algorithms import losses
from agentevo.algorithms.rsd.config import RSDConfig
from agentevo.algorithms.rsd.context import (
    ContextRule,
    LLMProposer,
    accept_rule,
    assemble_context,
    context_messages,
    context_prompt_ids,
    future_hindsight,
    parse_rule_json,
    random_rule,
    rank_precedents,
)
from agentevo.algorithms.rsd.recipe import (
    TeacherCache,
    TeacherState,
    _rule_step,
    delta_logp,
    detour_rows,
    id_dtype,
    make_distill_loss,
    sample_tasks,
    score_teacher,
    student_pass,
    student_samples,
    teacher_rows,
    topk_divergence,
    update_teacher,
)
from agentevo.algorithms.rsd.writers import LLMWriter, OpenAIChatClient, RuleWriter
from agentevo.data.store import ExperienceStore
from agentevo.data.tensors import collate, trajectory_samples
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.errors import ConfigError

MARKER = "ZEBRA PRIVILEGED MARKER"


def _traj(renderer, actions, goal="g", success=False, signals=None, scores=None, task_id="t0", obs0="You are in the kitchen."):  # noqa: ANN001, ANN202, E501
    task = Task("twx-cookingworld", task_id, "train", "cookingworld", {}, 20)
    steps = []
    for t, action in enumerate(actions, start=1):
        text = expert_reply(action)
        ids = renderer.encode_reply(text) if renderer is not None else []
        steps.append(Step(t, obs0 if t == 1 else f"You did {actions[t - 2]}.", text, ids, None, parse_action(text),
                          f"You did {action}.", 0.0, t == len(actions),
                          score=(scores or [0.0] * len(actions))[t - 1],
                          signal=(signals or ["none"] * len(actions))[t - 1]))
    return Trajectory(task, "self", "p", "Instruction.", steps, steps[-1].score if steps else 0.0, success, goal=goal)


def _rsd(**kw) -> RSDConfig:  # noqa: ANN003
    cfg = RSDConfig(**kw)
    cfg.validate()
    return cfg


# ------------------------------------------------------------------------------------------ teacher cache and loss


def _cache_for(policy, trajs, contexts, k, position="before_history", temp=1.0):  # noqa: ANN001, ANN202
    rows, _ = teacher_rows(policy.renderer, trajs, contexts, position, 20, 4096)
    cache = TeacherCache.empty(trajs, k)
    score_teacher(policy.model, rows, cache, k, temp, policy.pad_id, 4)
    return cache, rows


def test_cached_topk_loss_equals_full_kl_when_k_is_vocab(tiny_policy) -> None:  # noqa: ANN001
    """The RSD loss through the teacher cache with k = |V| equals the full-vocabulary forward KL."""
    r = tiny_policy.renderer
    trajs = [_traj(r, ["take knife", "open fridge"]), _traj(r, ["take cookbook", "read cookbook", "eat meal"])]
    contexts = [[f"{MARKER} step {s.t}" for s in t.steps] for t in trajs]
    vocab = tiny_policy.model.config.vocab_size
    for tail in (False, True):
        cache, rows = _cache_for(tiny_policy, trajs, contexts, vocab, temp=1.5)
        samples = student_samples(r, trajs, cache, 20, 4096)
        batch = collate(samples, tiny_policy.pad_id)
        with torch.no_grad():
            loss, _ = make_distill_loss(cache, tail=tail)(tiny_policy.model, batch)
            # Direct: teacher logits at each reply token (context rows), student logits (plain rows).
            t_logits, s_logits = [], []
            for rs, store in ((rows, t_logits), (samples, s_logits)):
                b = collate(rs, tiny_policy.pad_id)
                z = tiny_policy.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                for i, row in enumerate(rs):
                    for s, e in row.spans:
                        store.append(z[i, s - 1 : e - 1])
            # both lists are in (trajectory, step) order: rows and samples are one per trajectory here
            full = losses.full_forward_kl(torch.cat(s_logits), torch.cat(t_logits), temperature=1.5).mean()
        assert_close(loss, full, atol=1e-5, rtol=1e-5)
        assert loss.item() > 0  # the context changes the teacher


def test_cache_tail_bucket_sums_to_one_and_roundtrips(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    trajs = [_traj(r, ["take knife", "open fridge"])]
    cache, _ = _cache_for(tiny_policy, trajs, [[MARKER] * 2], 20)
    n = sum(len(s.action_ids) for s in trajs[0].steps)
    assert cache.ids.shape == (n, 20) and cache.n_tokens == n
    with_tail = losses.append_tail_bucket(cache.logp)
    assert_close(with_tail.exp().sum(-1), torch.ones(n), atol=1e-5, rtol=0)
    # teacher log-probs are sorted (top-k) and the token's own log-prob is <= the top-1
    assert bool((cache.logp[:, :-1] >= cache.logp[:, 1:]).all())
    assert bool((cache.teacher_token_logp <= cache.logp[:, 0] + 1e-6).all())
    cache.save(tmp_path / "c.pt")
    again = TeacherCache.load(tmp_path / "c.pt")
    assert again.offsets == cache.offsets and torch.equal(again.ids.long(), cache.ids)
    assert cache.nbytes() == n * (20 * (8 + 4) + 8)  # int64 ids + float32 log-probs while scoring
    assert again.nbytes() == n * (20 * (2 + 2) + 8)  # int16 ids + float16 log-probs once saved


def test_id_dtype_is_the_smallest_that_holds_the_vocabulary() -> None:
    assert id_dtype(2048) == torch.int16 and id_dtype(32_767) == torch.int16
    assert id_dtype(32_768) == torch.int32 and id_dtype(151_936) == torch.int32


def test_compact_cache_gives_the_full_precision_divergence(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    """The saved cache holds float16 log-probs and int16 ids (V = 383 here); the divergences computed from it equal
    those from the float32 / int64 cache within fp16 tolerance: fp16 keeps 11 significant bits, so every cached
    log-prob is within 2^-11 (4.9e-4) relative; the divergences (0.15-1.2 here) are asserted equal within
    rtol 5e-4 + atol 1e-5 on the loss of every kind (forward/reverse/jsd, with and without the tail bucket), and within
    1e-3 absolute per token."""
    r = tiny_policy.renderer
    trajs = [_traj(r, ["take knife", "open fridge"]), _traj(r, ["take cookbook", "read cookbook", "eat meal"])]
    contexts = [[f"{MARKER} step {s.t}" for s in t.steps] for t in trajs]
    full, _ = _cache_for(tiny_policy, trajs, contexts, 20, temp=0.2)  # a sharp teacher: KLs well above 0
    assert full.vocab_size == tiny_policy.model.config.vocab_size == 383
    full.save(tmp_path / "c.pt")
    assert full.ids.dtype == torch.long and full.logp.dtype == torch.float32  # saving leaves the object as it is
    small = TeacherCache.load(tmp_path / "c.pt")
    assert small.ids.dtype == torch.int16 and small.logp.dtype == torch.float16
    raw = torch.load(tmp_path / "c.pt", weights_only=True)
    assert raw["ids"].dtype == torch.int16 and raw["logp"].dtype == torch.float16
    ids, lp = small.topk_rows(torch.arange(small.n_tokens))
    assert ids.dtype == torch.long and lp.dtype == torch.float32 and torch.equal(ids, full.ids)
    assert (lp - full.logp).abs().max().item() <= 2**-11 * full.logp.abs().max().item()
    assert not torch.equal(lp, full.logp)  # it was rounded: the comparison below is not trivially exact
    batch = collate(student_samples(r, trajs, full, 20, 4096), tiny_policy.pad_id)
    plain = student_samples(r, trajs, full, 20, 4096)
    rsd = _rsd(topk=20)
    with torch.no_grad():
        for kind in ("forward", "reverse", "jsd"):
            for tail in (False, True):
                a, _ = make_distill_loss(full, kind, tail=tail)(tiny_policy.model, batch)
                b, _ = make_distill_loss(small, kind, tail=tail)(tiny_policy.model, batch)
                assert a.item() > 0.1
                assert_close(b, a, rtol=5e-4, atol=1e-5)  # measured: <= 3.1e-5 at KL ~1
        per_full = student_pass(tiny_policy.model, plain, full, tiny_policy.pad_id, 4, rsd)["divergence"]
        per_small = student_pass(tiny_policy.model, plain, small, tiny_policy.pad_id, 4, rsd)["divergence"]
    # per token (forward KL 0.3-1.5 here) the error does not scale with the KL; measured: <= 5.9e-4
    assert_close(per_small, per_full, rtol=0, atol=1e-3)


def test_teacher_context_never_reaches_the_student(tiny_policy) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    traj = _traj(r, ["take knife", "open fridge", "eat meal"])
    marker_ids = r.tokenizer(MARKER, add_special_tokens=False)["input_ids"]

    def has_marker(ids: list[int]) -> bool:
        return any(ids[i : i + len(marker_ids)] == marker_ids for i in range(len(ids)))

    for position in ("system", "before_history", "before_current_step"):
        contexts = [[f"{MARKER} {s.t}" for s in traj.steps]]
        rows, _ = teacher_rows(r, [traj], contexts, position, 20, 4096)
        assert len(rows) == 3 and all(has_marker(row.input_ids) for row in rows)
        cache = TeacherCache.empty([traj], 5)
        samples = student_samples(r, [traj], cache, 20, 4096)
        plain = trajectory_samples(r, traj, 0, 20, 4096)
        assert [s.input_ids for s in samples] == [s.input_ids for s in plain]
        assert not any(has_marker(s.input_ids) for s in samples)
        assert MARKER not in r.decode(samples[0].input_ids)
        # the teacher scores exactly the student's reply tokens
        for row in rows:
            (a, b), t = row.spans[0], row.steps[0]
            assert row.input_ids[a:b] == traj.steps[t - 1].action_ids
    # the loss reads only the student's batch: a batch without any context gives a finite loss
    cache, _ = _cache_for(tiny_policy, [traj], [[MARKER] * 3], 5)
    batch = collate(student_samples(r, [traj], cache, 20, 4096), tiny_policy.pad_id)
    assert not has_marker(batch["input_ids"][0].tolist())
    loss, stats = make_distill_loss(cache)(tiny_policy.model, batch)
    assert torch.isfinite(loss) and stats["tokens"] == cache.n_tokens


def test_detour_rows_target_the_next_useful_action_with_the_true_history(tiny_policy) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    # steps 2 and 4 are wasted (a look, a repeated take); the useful actions follow them
    twin = _traj(r, ["take knife", "look around", "open fridge", "take knife", "eat meal"])
    contexts = [f"{MARKER} {t}" for t in range(1, 6)]
    rows = detour_rows(r, twin, 7, 20, 4096, contexts, "before_history", [2, 4])
    assert [row.steps for row in rows] == [[2], [4]] and {row.traj_index for row in rows} == {7}
    for row, t in zip(rows, (2, 4), strict=True):
        (a, b) = row.spans[0]
        assert row.input_ids[a:b] == twin.steps[t].action_ids  # the next useful action, not the wasted one
        prompt = r.decode(row.input_ids[:a])
        assert f"{MARKER} {t}" in prompt
    # the row at step 4 shows the wasted look at step 2 in its history (each row keeps the true episode)
    assert "look around" in r.decode(rows[1].input_ids[: rows[1].spans[0][0]])
    assert twin.steps[1].action_text == expert_reply("look around")  # the trajectory itself is untouched


def test_constant_context_packs_teacher_rows(tiny_policy) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    traj = _traj(r, ["take knife", "open fridge", "eat meal"])
    rows, cut = teacher_rows(r, [traj], [[MARKER] * 3], "before_history", 20, 4096)
    assert len(rows) == 1 and rows[0].steps == [1, 2, 3] and cut == 0
    rows, cut = teacher_rows(r, [traj], [[MARKER] * 3], "before_history", 20, 60)
    full = [len(context_prompt_ids(r, traj, s.t, 20, MARKER, "before_history")) + len(s.action_ids) for s in traj.steps]
    assert len(rows) == 3 and cut == sum(n > 60 for n in full) >= 1
    assert [len(row.input_ids) for row in rows] == [min(n, 60) for n in full]


def test_topk_divergences_hand_values() -> None:
    student = torch.log(torch.tensor([0.25, 0.25, 0.5]))
    teacher_lp = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    ids = torch.tensor([0, 1])
    # renormalised over K={0,1}: p_T = (0.625, 0.375), p_S = (0.5, 0.5)
    fwd = 0.625 * math.log(1.25) + 0.375 * math.log(0.75)
    rev = 0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375)
    assert topk_divergence(student, ids, teacher_lp[ids], "forward").item() == pytest.approx(fwd, abs=1e-6)
    assert topk_divergence(student, ids, teacher_lp[ids], "reverse").item() == pytest.approx(rev, abs=1e-6)
    m = (0.5 * 0.625 + 0.5 * 0.5, 0.5 * 0.375 + 0.5 * 0.5)
    jsd = 0.5 * (0.625 * math.log(0.625 / m[0]) + 0.375 * math.log(0.375 / m[1])) + \
        0.5 * (0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1]))
    assert topk_divergence(student, ids, teacher_lp[ids], "jsd", beta=0.5).item() == pytest.approx(jsd, abs=1e-6)
    same = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    for kind in ("forward", "reverse", "jsd"):
        assert topk_divergence(same, ids, same[ids], kind, tail=True).item() == pytest.approx(0.0, abs=1e-6)


def test_delta_logp_splits_disfavoured_steps() -> None:
    cache = TeacherCache.empty([], 2)
    cache.offsets = {(0, 1): (0, 2), (0, 2): (2, 1)}
    # step 1: teacher -3 < student -1 (disfavoured); step 2: teacher -0.5 > student -2
    cache.teacher_token_logp = torch.tensor([-1.0, -2.0, -0.5])
    cache.student_token_logp = torch.tensor([-0.5, -0.5, -2.0])
    after = torch.tensor([-1.0, -0.6, -1.0])
    out = delta_logp(cache, after)
    assert out["dlogp_disfavoured"] == pytest.approx(-0.6)
    assert out["dlogp_favoured"] == pytest.approx(1.0)
    assert out["disfavoured_steps"] == 1 and out["favoured_steps"] == 1


def test_student_support_caches_teacher_logprobs_at_student_ids(tiny_policy) -> None:  # noqa: ANN001
    r = tiny_policy.renderer
    traj = _traj(r, ["take knife"])
    cache = TeacherCache.empty([traj], 4)
    plain = student_samples(r, [traj], cache, 20, 4096)
    rsd = _rsd(topk=4, topk_from="student")
    support = student_pass(tiny_policy.model, plain, cache, tiny_policy.pad_id, 4, rsd, topk_ids=True)["support"]
    rows, _ = teacher_rows(r, [traj], [[MARKER]], "before_history", 20, 4096)
    score_teacher(tiny_policy.model, rows, cache, 4, 1.0, tiny_policy.pad_id, 4, support)
    assert torch.equal(cache.ids, support)
    assert bool((cache.logp <= 0).all()) and bool((cache.logp.exp().sum(-1) < 1).all())


# ------------------------------------------------------------------------------------------ context material


def _bank(tmp_path):  # noqa: ANN001, ANN202
    store = ExperienceStore(tmp_path / "experience.db")
    specs = [  # (goal, success, task id)
        ("cook the red potato in the oven", True, "a"),
        ("slice the red potato", True, "b"),
        ("wash the dirty dish", True, "c"),
        ("cook the red potato on the stove", False, "d"),  # failed: never a precedent
        ("cook the yellow potato", True, "e"),
        ("roast the red potato", True, "f"),
    ]
    for k, (goal, ok, tid) in enumerate(specs):
        store.add(_traj(None, ["look around"], goal=goal, success=ok, task_id=tid), "round-1/act", k)
    return store


def test_precedent_ranking_on_a_hand_made_store(tmp_path) -> None:  # noqa: ANN001
    store = _bank(tmp_path)
    bank = store.load(prefix="round-")
    ids = {t.task.task_id: t.meta["store_id"] for t in bank}
    query = "cook the red potato with the oven"  # content words: cook red potato oven
    top = rank_precedents(bank, query, 3)
    # a: 4 shared words; e (cook potato) and f/b (red potato) share 2 -> tie -> most recent first (f before e, b)
    assert [t.task.task_id for t in top] == ["a", "f", "e"]
    # the current episode is excluded; failures never appear
    top = rank_precedents(bank, query, 10, exclude=[ids["a"]])
    assert [t.task.task_id for t in top] == ["f", "e", "b", "c"]
    assert rank_precedents(bank, query, 0) == []
    rnd = rank_precedents(bank, query, 2, "random", rng=random.Random(0))
    assert len(rnd) == 2 and all(t.success for t in rnd)
    # fts: the store's full-text order, filtered to completed trajectories
    fts = rank_precedents(bank, query, 2, "fts", fts_ids=store.search_goals(query))
    assert fts[0].task.task_id == "a" and all(t.success for t in fts)
    # goal_and_first_obs matching uses the first observation too
    top = rank_precedents(bank, "wash kitchen", 1, match_on="goal_and_first_obs")
    assert top[0].task.task_id == "c"
    store.close()


def test_future_hindsight_and_context_assembly() -> None:
    traj = _traj(None, ["take knife", "open fridge", "eat meal"], scores=[0.0, 0.0, 0.5])
    h2 = future_hindsight(traj, 2)
    assert h2.splitlines() == [
        "Observation: You did open fridge.",
        "Thought: The meal is ready.",
        "Action: eat meal",
        "Observation: You did eat meal.",
        "Outcome: failure after 3 steps (score 0.50).",
    ]
    assert future_hindsight(traj, 3).splitlines()[0] == "Observation: You did eat meal."
    assert "(...)" in future_hindsight(traj, 1, max_steps=1)
    full = future_hindsight(traj, 0)
    assert "Action: take knife" in full and full.endswith("(score 0.50).")
    prec = _traj(None, ["take knife", "eat meal"], goal="cook", success=True)
    rule = ContextRule(n_prec=1, use_lessons=False)
    text = assemble_context(rule, [prec, prec], "L", "R", "H").render()
    assert text.splitlines()[1] == "Precedent 1 (solved in 2 steps; task: cook): take knife; eat meal"
    assert "Precedent 2" not in text and "Lessons" not in text and "Reflection: R" in text
    assert assemble_context(ContextRule(use_prec=False, use_lessons=False, use_reflection=False, use_future=False),
                            [prec], "L", "R", "H").render() == ""


def test_context_positions(tiny_policy) -> None:  # noqa: ANN001
    from agentevo.agent.prompt import HistoryTurn, build_messages

    hist = [HistoryTurn([1, 2], "obs2")]
    plain = build_messages("I", "g", "obs1", hist, 5)
    assert context_messages("I", "g", "obs1", hist, 5, "", "system") == plain
    sys_msgs = context_messages("I", "g", "obs1", hist, 5, "C", "system")
    assert sys_msgs[0].role == "system" and sys_msgs[1:] == plain
    before = context_messages("I", "g", "obs1", hist, 5, "C", "before_history")
    # a blank line between the context and the observation (it used to run into it: "I\n\nCobs1")
    assert before[0].text == "I\n\nC\n\nobs1" and before[1:] == plain[1:]
    assert context_messages("I", "g", "obs1", hist, 5, "C\n", "before_history")[0].text == "I\n\nC\n\nobs1"
    first = context_messages("I", "g", "obs1", [], 5, "C", "before_current_step")
    assert [m.text for m in first] == ["I\n\nC\n\nobs1"]
    cur = context_messages("I", "g", "obs1", hist, 5, "C", "before_current_step")
    assert cur[:-1] == plain[:-1] and cur[-1].text == "C\n\nObservation: obs2"


# ------------------------------------------------------------------------------------------ schedule and rule search


def test_teacher_freezes_at_the_peak_on_a_scripted_sequence() -> None:
    metrics = [0.70, 0.75, 0.803, 0.394, 0.0, 0.9]  # rounds 1..6 after a base of 0.6 (paper: peak then collapse)
    state = TeacherState("bc", False, 0.6, 0, "bc")
    seen = []
    for r, m in enumerate(metrics, start=1):
        state = update_teacher(state, r, m, f"round-{r}", "follow_freeze")
        seen.append((state.ckpt, state.frozen))
    assert seen == [("round-1", False), ("round-2", False), ("round-3", False), ("round-3", True),
                    ("round-3", True), ("round-3", True)]  # frozen for good, even when a later round beats the peak
    assert (state.best_round, state.best_ckpt, state.best_metric) == (6, "round-6", 0.9)
    # a drop right after the base freezes at the base
    s = update_teacher(TeacherState("bc", False, 0.6, 0, "bc"), 1, 0.5, "round-1", "follow_freeze")
    assert (s.ckpt, s.frozen) == ("bc", True)
    # ties with the peak keep following
    s = update_teacher(TeacherState("bc", False, 0.6, 0, "bc"), 1, 0.6, "round-1", "follow_freeze")
    assert (s.ckpt, s.frozen) == ("round-1", False)
    follow = TeacherState("bc", False, 0.6, 0, "bc")
    fixed = TeacherState("bc", False, 0.6, 0, "bc")
    for r, m in enumerate(metrics, start=1):
        follow = update_teacher(follow, r, m, f"round-{r}", "always_follow")
        fixed = update_teacher(fixed, r, m, f"round-{r}", "fixed_init")
        assert follow.ckpt == f"round-{r}" and fixed.ckpt == "bc"
    assert update_teacher(fixed, 7, 0.1, "round-7", "ema").ckpt == "teacher-7"


def test_rule_acceptance_at_the_half_point_boundary() -> None:
    assert accept_rule(0.595, 0.60)  # exactly best - 0.5 points: kept
    assert not accept_rule(0.5949, 0.60)
    assert accept_rule(0.60, 0.60) and accept_rule(0.9, 0.60)
    assert accept_rule(0.59, 0.60, margin_points=1.0) and not accept_rule(0.589, 0.60, margin_points=1.0)


def _fake_run(**rsd_kw):  # noqa: ANN003, ANN202
    return SimpleNamespace(cfg=SimpleNamespace(rsd=_rsd(**rsd_kw), seed=0))


def test_rule_step_keeps_or_reverts_only_the_rule() -> None:
    cand, old = ContextRule(n_prec=4).to_dict(), ContextRule().to_dict()
    state = {"current": cand, "fallback": old, "candidate": True, "best": 0.60, "history": []}
    kept = _rule_step(_fake_run(rule_search="random", rounds=2), 2, state, 0.595, "rsd", enabled=True)
    assert kept["decision"] == "kept" and kept["current"] == cand and kept["best"] == 0.60
    reverted = _rule_step(_fake_run(rule_search="random", rounds=2), 2, state, 0.5949, "rsd", enabled=True)
    assert reverted["decision"] == "reverted" and reverted["current"] == old and not reverted["candidate"]
    assert reverted["history"][-1] == {"round": 2, "rule": cand, "success": 0.5949}
    # rule search without the probe: the proposal is taken for the next round
    nxt = _rule_step(_fake_run(rule_search="random", rounds=3, probe=False), 1,
                     {"current": old, "fallback": old, "candidate": False, "best": 0.5, "history": []}, 0.7, "rsd",
                     enabled=True)
    assert nxt["decision"] == "fixed" and nxt["candidate"] and nxt["current"] == nxt["proposal"] != old
    assert nxt["fallback"] == old and nxt["best"] == 0.7


def test_rule_whitelist_and_json_proposals() -> None:
    rule = parse_rule_json('Sure: {"n_prec": 4, "use_future": false, "position": "system", "teacher_temp": 0.7}')
    assert rule == ContextRule(n_prec=4, use_future=False, position="system", teacher_temp=0.7)
    for bad in ('{"lr": 1e-5}', '{"n_prec": 99}', '{"position": "end"}', '{"use_prec": "yes"}', "no json",
                '{"teacher_temp": 9}'):
        with pytest.raises(ConfigError):
            parse_rule_json(bad)
    rng = random.Random(0)
    for _ in range(20):
        cand = random_rule(ContextRule(), rng)
        assert cand != ContextRule() and ContextRule.from_dict(cand.to_dict()) == cand

    class Scripted:
        def __init__(self, answers: list[str]) -> None:
            self.answers, self.prompts = answers, []

        def chat_many(self, convs, max_tokens):  # noqa: ANN001, ANN202
            self.prompts.append(convs[0])
            return [self.answers.pop(0)]

    client = Scripted(['{"n_prec": 42}', '{"n_prec": 3}'])
    assert LLMProposer(client).propose(ContextRule(), [{"round": 1, "success": 0.5}]) == ContextRule(n_prec=3)
    assert "Invalid" in client.prompts[1][-1]["content"]  # the error is fed back once
    assert LLMProposer(Scripted(["x", "y"])).propose(ContextRule(), []) is None


def test_config_validation_messages() -> None:
    with pytest.raises(ConfigError, match="components"):
        _rsd(components=["prec", "bogus"])
    with pytest.raises(ConfigError, match="writer_url"):
        _rsd(rule_search="frontier")
    with pytest.raises(ConfigError, match="teacher"):
        _rsd(teacher="latest")
    with pytest.raises(ConfigError, match=r"^rsd.bon_with_wins=false .* needs rsd.bon_with_expert=true \(got false\)"):
        _rsd(bon_with_wins=False)
    with pytest.raises(ConfigError, match=r"and rsd.bon_rounds=1 \(got 2\): no round changes the demos$"):
        _rsd(bon_with_wins=False, bon_with_expert=True, bon_rounds=2)
    _rsd(bon_with_wins=False, bon_with_expert=True)  # the continued-BC control


def test_sample_tasks_stratified() -> None:
    tasks = [Task("e", f"{ty}{k}", "train", ty, {}, 5) for ty in ("a", "b") for k in range(5)]
    picked = sample_tasks(tasks, 4, random.Random(0))
    assert sorted(t.task_type for t in picked) == ["a", "a", "b", "b"] and len(set(picked)) == 4
    assert sample_tasks(tasks, 20, random.Random(0)) == tasks


# ------------------------------------------------------------------------------------------ writers


def test_rule_writer_reflection_and_lessons() -> None:
    bad = _traj(None, ["take knife", "fly away", "take knife"], signals=["none", "invalid", "repeat"])
    good = _traj(None, ["take knife", "open fridge", "eat meal"], success=True)
    w = RuleWriter()
    assert w.reflection(bad) == ("Earliest critical mistake: step 2, 'fly away' (the game rejected the command). "
                                 "Better action: a command the game accepts, naming an object or exit from the "
                                 "observation.")
    assert w.reflection(bad, good).endswith("Better action: open fridge.")
    assert w.reflection(good).startswith("No critical mistake")
    stalled = _traj(None, ["take knife", "open fridge", "look"], scores=[0.2, 0.2, 0.2])
    assert w.reflection(stalled).startswith("Earliest critical mistake: step 2, 'open fridge' (no progress")
    lesson = w.lessons("cookingworld", [good], [bad])
    assert "began with: take knife; open fridge; eat meal" in lesson
    assert "'fly away' (1x)" in lesson and "repeated commands without effect 1 times" in lesson
    assert w.lessons("x", [], []) == "No lessons yet."


def test_openai_client_and_llm_writer_against_a_local_stub() -> None:
    seen: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
            reply = json.dumps({"choices": [{"message": {"content": " Earliest critical mistake: step 1 "}}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(reply.encode())

        def log_message(self, *args) -> None:  # noqa: ANN002
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = OpenAIChatClient(f"http://127.0.0.1:{server.server_port}/v1/", "m", api_key="k")
        writer = LLMWriter(client, max_tokens=32)
        traj = _traj(None, ["take knife"])
        assert writer.reflections([traj]) == ["Earliest critical mistake: step 1"]
        assert writer.lessons("cookingworld", [], [traj]) == "Earliest critical mistake: step 1"
    finally:
        server.shutdown()
    assert seen[0]["path"] == "/v1/chat/completions" and seen[0]["auth"] == "Bearer k"
    assert seen[0]["model"] == "m" and seen[0]["max_tokens"] == 32
    assert "Step 1: Action: take knife" in seen[0]["messages"][0]["content"]
    assert "Failed episode 1" in seen[1]["messages"][0]["content"]


def test_flagged_step_auc_on_a_hand_made_cache() -> None:
    from agentevo.algorithms.rsd.recipe import flagged_step_auc

    # two episodes, 3 + 2 steps, replies of 1-2 tokens; steps 2 of each are flagged by the environment
    a = _traj(None, ["take knife", "take knife", "eat meal"], signals=["none", "repeat", "none"])
    b = _traj(None, ["open fridge", "eat fridge"], signals=["none", "invalid"])
    for traj, lens in ((a, (1, 2, 1)), (b, (2, 1))):
        for s, n in zip(traj.steps, lens, strict=True):
            s.action_ids = [5] * n
    cache = TeacherCache.empty([a, b], 2)
    # disfavour (student minus teacher log-prob, summed over the reply) per step: a: 0.1, 2.0, 0.5; b: -0.2, 0.3
    cache.student_token_logp = torch.tensor([-1.0, -0.5, -0.5, -1.0, -1.0, -1.0, -1.0])
    cache.teacher_token_logp = torch.tensor([-1.1, -1.5, -1.5, -1.5, -0.9, -0.9, -1.3])
    out = flagged_step_auc(cache, [a, b])
    # flagged {2.0, 0.3} vs others {0.1, 0.5, -0.2}: 2.0 beats all 3, 0.3 beats 2 of 3 -> 5/6
    assert out["flagged_steps"] == 2 and out["teacher_auc_flagged"] == pytest.approx(5 / 6)


def test_outcome_separation_on_a_hand_made_cache() -> None:
    from agentevo.algorithms.rsd.recipe import check_premise, outcome_separation
    from agentevo.errors import AgentevoError

    win = _traj(None, ["take knife", "eat meal"])
    lose = _traj(None, ["open fridge"])
    win.success, lose.success = True, False
    for traj, lens in ((win, (1, 2)), (lose, (2,))):
        for s, n in zip(traj.steps, lens, strict=True):
            s.action_ids = [5] * n
    cache = TeacherCache.empty([win, lose], 2)
    # teacher - student per step (summed over its tokens): win 0.5 and 1.5 (mean 1.0), lose -0.25 - 0.25 = -0.5
    cache.teacher_token_logp = torch.tensor([-0.5, -0.25, -0.25, -1.25, -1.25])
    cache.student_token_logp = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0])
    out = outcome_separation(cache, [win, lose])
    assert out == pytest.approx({"success_gap": 1.0, "failure_gap": -0.5, "separation": 1.5, "success_steps": 2,
                                 "failure_steps": 1})
    check_premise(out, stop=True)  # the teacher favours what worked: the premise holds
    with pytest.raises(AgentevoError, match=r"does not favour the round-1 steps of successful episodes .*"
                                            r"separation -1.500 nats per step"):
        check_premise({**out, "separation": -1.5}, stop=True)
    # one outcome only: no separation, and the premise falls back to the mean sampled-token log-prob
    only = outcome_separation(TeacherCache.empty([win], 2), [win])
    assert only["separation"] is None and only["failure_gap"] is None
