"""Premise diagnostics (issue 19): the numbers against hand-computed values, the verdicts, the report section, the
critic budget that actually fits, and a recipe run whose report carries the Diagnostics section."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from agentevo.agent.prompt import expert_reply, parse_action
from agentevo.algorithms import advantages as adv_math
from agentevo.algorithms.qevolve.config import QEvolveConfig
from agentevo.algorithms.qevolve.recipe import critic_diagnostics
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.errors import AgentevoError
from agentevo.eval import diagnostics as dg
from agentevo.models.critic import Critic, CriticFit, CriticItem, critic_rows, critic_values, fit_critic

# -- the numbers -----------------------------------------------------------------------------------------------------


def test_auc_with_a_tie() -> None:
    # positives {0.8, 0.5}, negatives {0.5, 0.2}: 1 + 1 + 1/2 (tie) + 1 of 4 pairs
    assert dg.roc_auc([0.8, 0.5, 0.5, 0.2], [True, True, False, False]) == pytest.approx(0.875)
    assert dg.roc_auc([0.1, 0.2], [True, True]) is None


def test_explained_variance() -> None:
    # residual [0, 0, 0, 1]: var 0.1875; var(target) 1.25 -> 1 - 0.15
    assert dg.explained_variance([1, 2, 3, 3], [1, 2, 3, 4]) == pytest.approx(0.85)
    assert dg.explained_variance([2.5] * 4, [1, 2, 3, 4]) == pytest.approx(0.0)  # a constant V explains nothing
    assert dg.explained_variance([0, 1], [1, 1]) is None


def test_drift_init_share_and_returns_to_go() -> None:
    start = [torch.tensor([3.0]), torch.tensor([4.0])]  # norm 5
    assert dg.relative_drift([torch.tensor([3.0]), torch.tensor([5.0])], start) == pytest.approx(0.2)
    assert dg.relative_drift(start, start) == 0.0
    assert dg.init_share(0.005, 17) == pytest.approx(0.9183, abs=1e-4)  # the studies' critic: 92% at init
    assert dg.init_share(0.05, 500) < 1e-10
    assert dg.returns_to_go([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert dg.std([1.0, 3.0]) == pytest.approx(1.0)


def test_zero_variance_fraction() -> None:
    assert dg.zero_variance_fraction([[1, 1, 1], [0, 1, 0], [0, 0], [0.5]]) == pytest.approx(0.75)
    assert dg.zero_variance_fraction([]) is None


def test_all_won_fraction_counts_only_equal_groups_that_all_succeeded() -> None:
    rewards = [[1, 1], [0, 0], [1, 0], [0.5, 0.5]]
    won = [[True, True], [False, False], [True, False], [True, False]]  # the last: equal rewards, one episode lost
    assert dg.all_won_fraction(rewards, won) == pytest.approx(0.25)
    assert dg.all_won_fraction([], []) is None
    with pytest.raises(ValueError, match="2 groups of rewards but 1 of outcomes"):
        dg.all_won_fraction([[1], [0]], [[True]])


def test_solved_groups_are_not_graded_as_starved() -> None:
    # the 8-light Self-Guide run at its last update (docs/studies/real_model_probes): 97% of rollouts won, so 7 of 8
    # groups were all equal, all of them wins
    (solved,) = dg.policy_update({"zero_var_frac": 0.875, "zero_var_won_frac": 0.875})
    assert solved.name == "zero-variance groups that did not all succeed (no signal)"
    assert (solved.value, solved.verdict) == ("0 (0.875 all equal, 0.875 all succeeded: solved)", "pass")
    # GRPO without guides at update 1 of the same probe: 7 of 8 groups all failed
    (starved,) = dg.policy_update({"zero_var_frac": 0.875, "zero_var_won_frac": 0.0})
    assert starved.verdict == "fail" and starved.value.startswith("0.875 (0.875 all equal, 0 all succeeded")
    assert dg.policy_update({"zero_var_frac": 0.75, "zero_var_won_frac": 0.125})[0].verdict == "warn"  # 0.625


def test_guide_agreement() -> None:
    guides = ["ok Next: take knife. Verdict: good", "Next: open fridge.", None, "no next here", "Next: Take  Knife"]
    actions = ["take knife", "close fridge", "take knife", "look", "take knife"]
    assert dg.guide_agreement(guides, actions) == (pytest.approx(2 / 3), 3)
    assert dg.guide_agreement([None, "x"], ["a", "b"]) == (None, 0)
    assert dg.guide_next_action("Next: go north.\nThought: ...") == "go north"


# -- verdicts and the report section ---------------------------------------------------------------------------------


def test_critic_verdicts_for_the_studies_critic_and_a_fitted_one() -> None:
    old = {"auc_v1": 0.55, "auc_q": 0.62, "v_std": 0.03, "return_std": 0.4, "ev": 0.01, "target_drift": 0.001,
           "online_drift": 0.01, "init_share": dg.init_share(0.005, 17), "steps": 17}
    rows = dg.critic_fit(old)
    assert [(d.name, d.verdict) for d in rows] == [
        ("held-out AUC of V(s_1) for success", "fail"), ("held-out AUC of min Q(s_1,a_1)", "warn"),
        ("V spread (std over states / std of returns-to-go)", "fail"),
        ("explained variance of returns-to-go by V (held-out)", "fail"),
        ("target-head drift from init (relative L2; online heads)", "fail"),
        ("target heads' weight on their init (1-polyak)^steps", "fail")]
    assert rows[2].value == "0.03 / 0.4 = 0.075"
    assert rows[5].value == "0.918 after 17 steps" and "qevolve.polyak" in rows[5].fix
    assert rows[0].fix.startswith("raise qevolve.critic_steps (ran 17; 500 fits") and "held-out episodes" not in rows[0].fix
    # few held-out episodes: the fix says the AUC itself is noisy (Mann-Whitney SE ~ 1 / sqrt(3 * 45) = 0.086)
    assert rows[0].fix == dg.critic_fit(dict(old, n_holdout=200))[0].fix
    assert ("; with 45 held-out episodes the AUC's standard error is ~0.09, so also hold out more "
            "(qevolve.critic_holdout); V(s_1) sees only the task") in dg.critic_fit(dict(old, n_holdout=45))[0].fix
    # the states' AUC (within a step) comes first; a critic can pass it while V(s_1), which sees only the task, fails
    states = dg.critic_fit(dict(old, auc_v_states=0.78))
    assert [(d.name, d.verdict) for d in states[:2]] == [
        ("held-out AUC of V(s_t) for the episode's success (own episodes, states at the same step)", "pass"),
        ("held-out AUC of V(s_1) for success", "fail")]
    assert states[0].fix == "" and states[1].fix.endswith("read it beside the row above")
    good = dict(old, auc_v1=0.9, auc_q=0.9, v_std=0.3, ev=0.6, target_drift=0.01, init_share=1e-11, steps=500)
    assert {d.verdict for d in dg.critic_fit(good)} == {"pass"} and all(d.fix == "" for d in dg.critic_fit(good))
    assert dg.critic_fit({"auc_v1": None})[0].verdict == "n/a"


def test_flagged_step_advantage_is_measured_and_graded() -> None:
    """Steps the rules flag should get lower advantages than the others; credit on them is a failed premise."""
    got = dg.flagged_advantage([1.0, -0.5, 0.25, 0.75], [True, False, True, False])
    assert got == {"flagged_adv": 0.625, "unflagged_adv": 0.125, "flagged_n": 2}
    assert dg.flagged_advantage([0.5], [False]) == {"flagged_adv": None, "unflagged_adv": 0.5, "flagged_n": 0}
    (row,) = dg.critic_fit(got)
    assert row.verdict == "fail" and row.value == "0.625 − 0.125 = 0.5" and "qevolve.lam" in row.fix
    assert dg.critic_fit({"flagged_adv": -0.05, "unflagged_adv": 0.0})[0].verdict == "warn"
    assert dg.critic_fit({"flagged_adv": -0.8, "unflagged_adv": 0.1})[0].verdict == "pass"
    assert dg.critic_fit({"flagged_adv": None, "unflagged_adv": 0.1}) == []


def test_other_methods_verdicts() -> None:
    rows = dg.policy_update({"zero_var_frac": 0.9, "kl": 0.05, "clip_frac_low": 0.2, "clip_frac_high": 0.0})
    assert [d.verdict for d in rows] == ["fail", "pass", "warn", "pass"]
    rsd = dg.rsd_premise({"success_base": 0.12, "success_base_ctx": 0.02, "teacher_token_logp": -1.2,
                          "student_token_logp": -1.0, "teacher_auc_flagged": 0.7})
    assert [(d.value, d.verdict) for d in rsd] == [("2.0% − 12.0% = -10.0 pt", "fail"), ("-1.2 − -1 = -0.2", "fail"),
                                                   ("0.7", "pass")]
    # a later round's teacher that reads its context far less than round 1's (as measured in docs/studies/real_model_probes)
    later = {d.name.split(" (")[0]: (d.value, d.verdict)
             for d in dg.rsd_premise({"separation": 0.2, "separation_round1": 5.0})}
    assert later["teacher still reads its context"] == ("0.2 / 5 = 0.04", "fail")
    kept = dg.rsd_premise({"separation": 3.0, "separation_round1": 5.0})
    assert [(d.value, d.verdict) for d in kept][1] == ("3 / 5 = 0.6", "pass")
    assert len(dg.rsd_premise({"separation": 0.5, "separation_round1": 0.05})) == 1  # round 1 never read: no ratio
    sg = dg.selfguide_premise({"guided_success": 0.2, "unguided_success": 0.4, "guide_agreement": 2 / 3,
                               "guide_steps": 30})
    assert [(d.verdict, d.value) for d in sg] == [("fail", "20.0% vs 40.0%"), ("warn", "0.667 of 30 steps")]
    assert dg.selfguide_premise({"guided_success": 0.2})[0].verdict == "n/a"
    # the seed-1 random-light run at update 6 (docs/studies/real_model_probes): 100 of 192 replies without a guide
    late = {d.name.split(":")[0].split(" (")[0]: (d.value, d.verdict)
            for d in dg.selfguide_premise({"verdict_auc_success": 0.48, "guide_format_error_rate": 100 / 192})}
    assert late == {"verdict calibration": ("0.48", "fail"),
                    "replies without a parseable guide verdict": ("0.521", "fail")}
    held = [d.verdict for d in dg.selfguide_premise({"verdict_auc_success": 0.58, "guide_format_error_rate": 0.1})]
    assert held == ["pass", "warn"]
    assert [d.verdict for d in dg.selfguide_premise({"verdict_auc_success": 0.52,
                                                     "guide_format_error_rate": 0.0})] == ["warn", "pass"]
    # the EPYC seed-3 internal-reward run at update 2 (docs/studies/real_model_probes): after 50 invalid actions the
    # next guide said 'good' 47 times, and 40% of that update's actions were invalid
    praise = dg.selfguide_premise({"verdict_good_on_flagged": 47 / 50, "flagged_judged": 50})
    assert [(d.value, d.verdict) for d in praise] == [("0.94 of 50 flagged steps", "fail")]
    assert "paying for actions the environment rejects" in praise[0].fix
    assert [d.verdict for d in dg.selfguide_premise({"verdict_good_on_flagged": 0.3})] == ["warn"]
    # 1 of 3 flagged steps praised (the 8-light run's last update) is too few steps to grade
    few = dg.selfguide_premise({"verdict_good_on_flagged": 1 / 3, "flagged_judged": 3})
    assert [(d.value, d.verdict) for d in few] == [("0.333 of 3 flagged steps (too few to grade: under 10)", "n/a")]
    assert dg.selfguide_premise({"verdict_good_on_flagged": 1 / 3, "flagged_judged": 10})[0].verdict == "warn"
    assert [d.verdict for d in dg.selfguide_premise({"verdict_good_on_flagged": 0.0})] == ["pass"]
    eto = dg.eto_dpo({"reward_margin": 0.4, "chosen_logp_drift": -3.0})
    assert [d.verdict for d in eto] == ["pass", "fail"] and "likelihood displacement" in eto[1].fix
    # the qe200 study's ETO at seed 0, iteration 3: 0 -> 47.1% format errors while both rows above pass
    broke = dg.eto_dpo({"reward_margin": 69.5, "chosen_logp_drift": 0.26, "rejected_logp_drift": -138.7,
                        "format_error": 0.471, "format_error_start": 0.0})
    assert [d.verdict for d in broke] == ["pass", "pass", "fail"]
    assert broke[2].value == "0.471 (start 0); rejected log-prob drift -139" and "eto.beta" in broke[2].fix
    assert dg.eto_dpo({"format_error": 0.12, "format_error_start": 0.02})[0].verdict == "warn"  # +0.10
    # the qe200 study's w/o GAE (Q - V) at seed 1: KL 0.368, held-out format errors 1.1% -> 50.6%
    drift = dg.critic_fit({"kl_ref": 0.3677, "format_error": 0.506, "format_error_start": 0.011})
    assert [(d.name.split(" (")[0], d.verdict) for d in drift] == [
        ("KL of the updated policy to pi_BC", "warn"), ("held-out replies out of the action format, after this round",
                                                       "fail")]
    assert drift[1].value == "0.506 (start 0.011)" and "qevolve.kl_alpha" in drift[1].fix
    kept = dg.critic_fit({"kl_ref": 0.02, "format_error": 0.0, "format_error_start": 0.011})  # the full method
    assert [d.verdict for d in kept] == ["pass", "pass"]


def test_format_drift_reads_the_test_split_else_the_first_and_needs_the_start() -> None:
    after = {"seen": {"format_error_rate": 0.3}, "test": {"format_error_rate": 0.506}}
    start = {"seen": {"format_error_rate": 0.0}, "test": {"format_error_rate": 0.011}}
    assert dg.format_drift(after, start) == {"format_error": 0.506, "format_error_start": 0.011}
    assert dg.format_drift({"seen": after["seen"]}, start) == {"format_error": 0.3, "format_error_start": 0.0}
    assert dg.format_drift(after, {"seen": start["seen"]}) == {}  # start not evaluated on the test split
    assert dg.format_drift({}, start) == {}


def test_render_section_tables_means_and_merging() -> None:
    recs = [{"phase": "diag/qevolve", "step": 1, "time": 0, "auc_v1": 0.9},
            {"phase": "diag/rsd", "step": 0, "teacher_token_logp": -1.0, "student_token_logp": -1.5},
            {"phase": "diag/rsd", "step": 0, "success_base": 0.1, "success_base_ctx": 0.2},  # merged with the above
            {"phase": "train/loss", "step": 1, "loss": 1.0}]
    recs += [{"phase": "diag/grpo", "step": k, "zero_var_frac": z} for k, z in enumerate([0.2, 0.4, 0.6, 0.8, 1.0], 1)]
    lines = dg.render_section(recs)
    text = "\n".join(lines)
    assert lines[1] == "## Diagnostics"
    assert "### qevolve, round 1: pass" in text
    assert "| held-out AUC of V(s_1) for success | 0.9 | pass | - |" in text
    assert "### rsd, before training: pass" in text and "10.0% = +10.0 pt" in text
    # five updates are averaged (0.6: warn)
    assert "### grpo, mean over updates 1-5: warn" in text
    assert "| zero-variance groups (all rewards equal) | 0.6 | warn |" in text
    # ... and the last update beside the mean (1.0: fail), after it
    assert "### grpo, update 5 (the last): fail" in text
    assert text.index("mean over updates 1-5") < text.index("update 5 (the last)")
    assert "| zero-variance groups (all rewards equal) | 1 | fail |" in text
    assert dg.render_section([{"phase": "bc/train", "step": 1, "loss": 1.0}]) == []


def test_bc_start_table_reads_the_held_out_evaluation_of_the_bc_checkpoint() -> None:
    """Every run that starts from BC shows how far imitation got: invalid actions and format errors of eval/bc."""
    def rec(split: str, invalid: float, fmt: float = 0.0) -> dict:
        return {"phase": f"eval/bc/{split}", "step": 0, "time": 0, "success_rate": 0.14, "invalid_rate": invalid,
                "format_error_rate": fmt}

    # the demo's 12-epoch BC at seed 0 on the EPYC, 50 games: 53.3% invalid actions -> fail; 30 epochs: 18.2% -> warn
    tables = dg.diagnostic_tables([rec("seen", 0.01), rec("test", 0.9), rec("test", 0.533),
                                   {"phase": "eval/round-1/test", "step": 0, "invalid_rate": 0.0}])
    assert [t for t, _ in tables] == ["BC start (every method's first policy), held-out test"]
    rows = {d.name: d for d in tables[0][1]}
    invalid = rows["held-out invalid actions (BC start; the expert's are 0)"]
    assert (invalid.value, invalid.verdict) == ("0.533", "fail") and "raise optim.epochs" in invalid.fix
    assert rows["held-out replies without a parseable action (BC start)"].verdict == "pass"
    assert dg.diagnostic_tables([rec("test", 0.182)])[0][1][1].verdict == "warn"
    assert dg.diagnostic_tables([rec("test", 0.05, fmt=0.2)])[0][1][0].verdict == "fail"
    untrained = dg.diagnostic_tables([rec("test", 0.0, fmt=1.0)])[0][1]  # no action parsed: nothing to call valid
    assert [(d.verdict, d.fix) for d in untrained][1] == ("n/a", "no reply held an action (row above)")
    assert dg.worst(dg.diagnostic_tables([rec("test", 0.05)])[0][1]) == "pass"
    # no test split: the first other one; no BC evaluation (a run from scratch): no table
    assert dg.diagnostic_tables([rec("seen", 0.3)])[0][0].endswith("held-out seen")
    assert dg.diagnostic_tables([{"phase": "eval/init/test", "step": 0, "invalid_rate": 0.0}]) == []
    # BC's dev learning curve (bc.eval_epochs): +14 points over the last 10 epochs is still rising (warn)
    curve = [{"phase": f"eval/bc-epoch-{e}/dev", "step": 0, "success_rate": x} for e, x in ((30, 0.42), (10, 0.2),
                                                                                           (20, 0.28))]
    rows = dg.diagnostic_tables([rec("test", 0.05), *curve])[0][1]
    assert (rows[-1].name, rows[-1].value, rows[-1].verdict) == (
        "dev success still rising at the end of BC (epoch 20 -> 30)", "10: 20.0%, 20: 28.0%, 30: 42.0% (+14.0 pt)", "warn")
    assert "raise optim.epochs until the curve levels off" in rows[-1].fix
    level = [{"phase": "eval/bc-epoch-12.5/dev", "step": 0, "success_rate": 0.4}, {**curve[0], "success_rate": 0.44}]
    assert dg.diagnostic_tables([rec("test", 0.05), *level])[0][1][-1].verdict == "pass"  # +4 points: level
    assert dg.diagnostic_tables([rec("test", 0.05), *level])[0][1][-1].name.endswith("(epoch 12.5 -> 30)")
    # before the method's own tables
    lines = dg.render_section([rec("test", 0.3), {"phase": "diag/qevolve", "step": 1, "time": 0, "auc_v1": 0.9}])
    text = "\n".join(lines)
    assert text.index("### BC start") < text.index("### qevolve, round 1: pass")


# -- the critic budget -----------------------------------------------------------------------------------------------

_WORDS = "knife fridge kitchen room part cookbook recipe meal table counter".split()


def _two_step(policy, i: int, rng: random.Random) -> Trajectory:  # noqa: ANN001
    """Two identical actions; the first observation says whether the fridge is open, which alone decides success."""
    ok = rng.random() < 0.5
    first = (f"You are in the kitchen. You see {' '.join(rng.choice(_WORDS) for _ in range(4))}. "
             f"The fridge is {'open' if ok else 'closed'}.")
    task = Task("twx-cookingworld", f"t{i}", "train", "cookingworld", {}, 20)
    steps = []
    for t, action in enumerate(["take knife", "open fridge"], start=1):
        text = expert_reply(action)
        steps.append(Step(t, first if t == 1 else f"obs {t}", text, policy.renderer.encode_reply(text), None,
                          parse_action(text), f"obs {t + 1}", 0.0, t == 2))
    return Trajectory(task, "self", "self", "Cook a meal.", steps, float(ok), ok, goal="cook", meta={"store_id": i})


def _fit(policy, trajs, steps: int, polyak: float):  # noqa: ANN001, ANN202
    items = [CriticItem(critic_rows(policy.renderer, t, 4096, 50), [0.0, t.final_reward], [False, True],
                        adv_math.step_weights(2, t.success).tolist(), i) for i, t in enumerate(trajs)]
    held = [i >= 32 for i in range(len(items))]  # the last 16 are never fitted on
    critic = Critic(copy.deepcopy(policy.model), 32, seed=1)
    fit = CriticFit(polyak=polyak, lr=QEvolveConfig().critic_lr, batch_size=4, micro_batch_size=4, steps=steps)
    epochs = fit_critic(critic, [it for it, h in zip(items, held, strict=True) if not h], fit, policy.pad_id, 0)
    assert epochs[-1]["steps"] == steps
    values = critic_values(critic, items, policy.pad_id)
    return critic_diagnostics(items, values, held, [t.success for t in trajs], 0.99, polyak, epochs[-1])


def test_the_default_critic_budget_fits_and_the_old_one_does_not(tiny_policy) -> None:  # noqa: ANN001
    rng = random.Random(0)
    trajs = [_two_step(tiny_policy, i, rng) for i in range(48)]
    assert 4 <= sum(t.success for t in trajs[32:]) <= 12  # both outcomes among the held-out trajectories
    q = QEvolveConfig()
    new = _fit(tiny_policy, trajs, q.critic_steps, q.polyak)
    old = _fit(tiny_policy, trajs, 17, 0.005)
    assert new["auc_v1"] > 0.8 and new["auc_q"] > 0.8 and new["ev"] > 0.3
    assert new["auc_v_states"] > 0.8 and new["n_holdout_own"] == 16  # the open fridge is in both states' prompt
    # 17 steps: V is flat and explains nothing (its AUC rests on a random head's projection, so EV decides too)
    assert old["auc_v1"] < 0.8 and old["ev"] < 0.05
    assert new["v_std"] > 0.3 * new["return_std"] > old["v_std"]
    assert old["init_share"] == pytest.approx(0.995**17) and new["init_share"] < 1e-10
    assert new["target_drift"] > 0.8 * new["online_drift"] and old["target_drift"] < 0.5 * old["online_drift"]
    assert dg.worst(dg.critic_fit(new)) == "pass" and dg.worst(dg.critic_fit(old)) == "fail"


def test_auc_same_step_compares_states_only_within_a_step() -> None:
    from agentevo.eval.metrics import auc, auc_same_step

    # a success of 2 steps and a failure of 4; V = -t ranks every success state above the later failure states
    steps = [0, 1, 0, 1, 2, 3]
    won = [True, True, False, False, False, False]
    minus_t = [-t for t in steps]
    assert auc(minus_t, won) == pytest.approx(6 / 8)  # plain AUC rewards V for falling with t
    assert auc_same_step(minus_t, steps, won) == 0.5  # within a step: all ties
    # by hand: step 0 compares 0.9 vs 0.2 (win), step 1 compares 0.1 vs 0.4 (loss); steps 2-3 have no success
    assert auc_same_step([0.9, 0.1, 0.2, 0.4, 0.0, 0.0], steps, won) == 0.5
    assert auc_same_step([0.9, 0.8, 0.2, 0.4, 0.0, 0.0], steps, won) == 1.0
    assert auc_same_step([1.0, 0.0], [0, 1], [True, False]) is None  # no pair shares a step


def test_progress_agreement_of_the_advantages() -> None:
    """Two own episodes of one task (won: progress at step 1; lost: none) and a demo (ignored). Advantages by hand."""
    from agentevo.algorithms.qevolve.recipe import progress_agreement, step_labels

    def traj(rewards: list[float], final: float, source: str = "self") -> Trajectory:
        steps = [Step(t, "o", "Action: x", [1], None, "x", "o2", r, False) for t, r in enumerate(rewards, start=1)]
        return Trajectory(Task("e", "t0", "train", "k", {}, 9), source, source, "I", steps, final, final >= 1.0,
                          goal="g")

    trajs = [traj([0.5, 0.0], 1.0), traj([0.0, 0.0], 0.0), traj([1.0], 1.0, "expert")]
    q = QEvolveConfig()
    labels = [step_labels(t, q) for t in trajs]
    values = [{"v": [0.0, 0.9, 0.0], "q1": [0, 0], "q2": [0, 0]}, {"v": [0.0, 0.1, 0.0], "q1": [0, 0], "q2": [0, 0]},
              {"v": [0.0, 0.0], "q1": [0], "q2": [0]}]
    # own steps: progress [T, F, F, F]; A = [0.1, 0.5, -0.2, 0.3]: the progress step beats 1 of 3 -> AUC 1/3
    got = progress_agreement(q, trajs, labels, values, [[0.1, 0.5], [-0.2, 0.3], [9.0]])
    assert got["progress_auc"] == pytest.approx(1 / 3) and got["progress_frac"] == 0.25
    # outcome advantage (final - task mean 0.5): [+0.5, +0.5, -0.5, -0.5]: a tie and two wins -> 2.5 / 3
    assert got["progress_auc_outcome"] == pytest.approx(2.5 / 3)
    # one-step TD from V (r_env only at the last step, gamma 0.99): won [0.99*0.9, 1 - 0.9], lost [0.099, -0.1]
    assert got[f"{dg.PROGRESS_AUC_IF}gae_lam0"] == pytest.approx(1.0)
    rows = dg.critic_fit(got)
    (row,) = [d for d in rows if d.name.startswith("AUC of A_t for steps that raised")]
    assert row.verdict == "fail" and row.value == "0.333 (outcome-only advantage: 0.833)"
    assert "(the episode's outcome alone gives 0.833)" in row.fix and "pr=gae lam=0 gives 1" in row.fix
    assert progress_agreement(q, trajs[1:2], labels[1:2], values[1:2], [[0.0, 0.0]]) == {}  # no progress at all


def test_update_follow_by_hand() -> None:
    """Four steps: A = [+1, +0.5, -1, 0 (left out of the AUC)], deltas [0.2, -0.1, 0.3, 9]; flagged: the third.
    Positives {0.2, -0.1} against the negative {0.3}: no win -> AUC 0; the flagged step rose by 0.3 although its
    advantage is -1, so that row fails and names the aliasing fix."""
    from agentevo.algorithms.qevolve.recipe import span_sums

    got = dg.update_follow([0.2, -0.1, 0.3, 9.0], [1.0, 0.5, -1.0, 0.0], [False, False, True, False])
    assert got["follow_auc"] == 0.0 and got["dlogp_pos"] == pytest.approx(0.05) and got["dlogp_neg"] == 0.3
    assert got["dlogp_flagged"] == 0.3 and got["dlogp_flagged_adv"] == -1.0 and got["dlogp_flagged_n"] == 1
    follow, flagged = dg.update_follow_rows(got)
    assert follow.verdict == "fail" and follow.value == "0 (mean change 0.05 where A > 0, 0.3 where A < 0)"
    assert flagged.verdict == "fail" and flagged.value == "0.3 over 1 steps (their mean advantage -1)"
    assert "although their mean advantage is negative" in flagged.fix
    good = dg.update_follow([0.2, -0.4], [1.0, -1.0], [False, True])
    assert good["follow_auc"] == 1.0 and [r.verdict for r in dg.update_follow_rows(good)] == ["pass", "pass"]
    assert dg.update_follow([], [], [])["dlogp_flagged"] is None and dg.update_follow_rows({}) == []
    assert span_sums([(3, 5), (9, 10)], [0.5, 0.25, -1.0]) == [0.75, -1.0]
    with pytest.raises(ValueError, match="spans cover 3 tokens but the row has 4"):
        span_sums([(3, 5), (9, 10)], [0.5, 0.25, -1.0, 2.0])


def test_fit_budget_counts_optimiser_steps_or_legacy_epochs() -> None:
    assert CriticFit(batch_size=4, steps=30).total_steps(10) == 30
    assert CriticFit(batch_size=4, epochs=2).total_steps(10) == 6  # ceil(10/4) per pass
    assert CriticFit(batch_size=4, steps=30).total_steps(0) == 0


# -- wiring ----------------------------------------------------------------------------------------------------------


def test_rsd_premise_stop_and_eto_dpo_numbers() -> None:
    from agentevo.algorithms.eto import PreferencePair, dpo_diagnostics
    from agentevo.algorithms.rsd.recipe import check_premise

    check_premise({"teacher_token_logp": -2.0, "student_token_logp": -1.0}, stop=False)  # warn only
    check_premise({"teacher_token_logp": -0.5, "student_token_logp": -1.0}, stop=True)  # premise holds
    with pytest.raises(AgentevoError, match=r"rsd premise fails: the teacher with context gives the round-1 replies "
                                            r"a lower mean token log-prob \(-2.000\) than the student without it"):
        check_premise({"teacher_token_logp": -2.0, "student_token_logp": -1.0}, stop=True)
    pairs = [PreferencePair("a", [], [], ref_chosen=-10.0, ref_rejected=-12.0),
             PreferencePair("b", [], [], ref_chosen=-5.0, ref_rejected=-5.0)]
    # Δchosen = [-1, +1], Δrejected = [-4, +2]: margins 3 and -1
    d = dpo_diagnostics(pairs, [[-11.0, -16.0], [-4.0, -3.0]], beta=0.1)
    assert d == pytest.approx({"reward_margin": 0.1, "reward_accuracy": 0.5, "chosen_logp_drift": 0.0,
                               "rejected_logp_drift": -1.0})


def test_grpo_run_report_has_the_diagnostics_section(tmp_path) -> None:  # noqa: ANN001
    from agentevo.algorithms.grpo.recipe import run as grpo_run
    from agentevo.config import load_config
    from agentevo.eval.report import write_report
    from agentevo.run import Run

    smoke = [
        "env.n_train=3", "env.n_test=2", "env.params={max_steps: 3}", "model.tiny.hidden_size=32",
        "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.intermediate_size=64",
        "agent.max_new_tokens=12", "agent.history_window=4", "optim.epochs=1", "optim.batch_size=4",
        "optim.micro_batch_size=4", "rollout.n_parallel=2", "rollout.batch_size=4", "grpo.n_updates=1",
        "grpo.tasks_per_update=2", "grpo.group_size=2", "grpo.lr=1.0e-4", "grpo.batch_size=2",
        "grpo.micro_batch_size=2", "model.torch_threads=1",
    ]
    run = Run.create(load_config(None, smoke, method="grpo", name="g", output_dir=str(tmp_path)), quiet=True)
    try:
        grpo_run(run)
        report = write_report(run).read_text()
    finally:
        run.close()
    diag = [json.loads(x) for x in (tmp_path / "g/metrics.jsonl").read_text().splitlines()]
    diag = [r for r in diag if r["phase"] == "diag/grpo"]
    assert [r["step"] for r in diag] == [1]
    assert 0.0 <= diag[0]["zero_var_frac"] <= 1.0 and diag[0]["zero_var_frac"] in (0.0, 0.5, 1.0)  # 2 groups
    assert {"kl", "clip_frac_low", "clip_frac_high"} <= set(diag[0])
    assert "## Diagnostics" in report and "### grpo, update 1: " in report
    assert "| diagnostic | value | verdict | what to change |" in report
    row = next(line for line in report.splitlines() if line.startswith("| zero-variance groups"))
    assert 0.0 <= diag[0]["zero_var_won_frac"] <= diag[0]["zero_var_frac"]
    verdict = dg.grade(diag[0]["zero_var_frac"] - diag[0]["zero_var_won_frac"], 0.5, 0.8, higher_is_better=False)
    assert row.split(" | ")[2] == verdict


def test_bon_premise_numbers_and_verdicts_by_hand() -> None:
    from agentevo.algorithms.rsd.bon_sft import bon_premise_numbers

    def traj(task_id: str, ok: bool, signals: list[str]) -> Trajectory:
        task = Task("twx-cookingworld", task_id, "train", "cookingworld", {}, 20)
        steps = [Step(t, "obs", "Action: look", [1], [-0.1], "look", "obs", 0.0, t == len(signals), signal=sig)
                 for t, sig in enumerate(signals, start=1)]
        return Trajectory(task, "self", "self", "Cook.", steps, float(ok), ok, goal="cook")

    samples = [traj("a", True, ["none", "invalid"]), traj("a", True, ["none"]), traj("b", False, ["invalid"]),
               traj("c", True, ["none", "none", "none"]), traj("d", False, ["none"])]
    numbers = bon_premise_numbers(samples, demo_task_ids={"a", "b"})
    # tasks a and c of a, b, c, d solved; kept: 3 (two on demo task a, one on new task c); 1 invalid of 6 kept steps
    assert numbers == {"pass_at_n": 0.5, "kept": 3, "kept_new_task_share": pytest.approx(1 / 3),
                       "kept_invalid_rate": pytest.approx(1 / 6)}
    rows = {d.name: d for d in dg.diagnose("bon_sft", numbers)}
    assert rows["practice tasks solved at least once (pass@N)"].verdict == dg.PASS
    assert rows["kept successes on tasks without a demo"].verdict == dg.PASS  # 0.33 >= 0.3
    invalid = rows["invalid actions among the kept steps"]
    assert invalid.verdict == dg.FAIL and "rollout_temperature" in invalid.fix  # 0.167 > 0.15
    none_kept = bon_premise_numbers([traj("b", False, ["none"])], {"a"})
    assert none_kept["kept_new_task_share"] is None and none_kept["kept_invalid_rate"] is None
    assert [d.verdict for d in dg.diagnose("bon_sft", none_kept)] == [dg.FAIL, dg.NA, dg.NA]
