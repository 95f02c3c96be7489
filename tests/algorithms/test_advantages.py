"""Hand-computed checks of agentevo.algorithms.advantages (spec §2.3, §3.2, §5, §7)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from agentevo.algorithms.advantages import (
    awr_weights,
    discounted_returns,
    gae,
    group_normalise,
    group_normalise_steps,
    internal_rewards_from_verdicts,
    normalise,
    q_minus_v,
    retrospective_rewards,
    step_weights,
    td_errors,
    trust_weight,
)
from agentevo.envs.base import classify_signal


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ step weights


def test_step_weights_exact_T4() -> None:
    assert_close(step_weights(4, False), t(0.625, 0.75, 0.875, 1.0))
    assert_close(step_weights(4, True), t(1.125, 1.25, 1.375, 1.5))
    assert step_weights(4, True).dtype == torch.float32


@pytest.mark.parametrize("T", [1, 2, 7, 40])
def test_step_weights_ranges(T: int) -> None:
    fail, win = step_weights(T, False), step_weights(T, True)
    assert fail.min() > 0.5 and fail.max() == 1.0
    assert win.min() > 1.0 and win.max() == 1.5
    assert_close(fail[0], torch.tensor(0.5 / T + 0.5))
    assert_close(win - fail, torch.full((T,), 0.5))
    assert bool((fail[1:] > fail[:-1]).all())


def test_step_weights_rejects_empty() -> None:
    with pytest.raises(ValueError):
        step_weights(0, False)


# ------------------------------------------------------------------------------------------------ RR labels


def test_retrospective_rewards_mapping() -> None:
    r = retrospective_rewards(["format", "invalid", "repeat", "none"], r_fmt=-1.0, r_inv=-2.0, r_repeat=-3.0)
    assert_close(r, t(-1.0, -2.0, -3.0, 0.0))
    assert_close(retrospective_rewards(["none", "invalid"]), t(0.0, -0.1))


def test_retrospective_rewards_precedence() -> None:
    steps = [{"invalid", "format"}, {"repeat", "invalid"}, {"repeat", "none"}, {"format", "invalid", "repeat"}, set()]
    r = retrospective_rewards(steps, r_fmt=-1.0, r_inv=-2.0, r_repeat=-3.0)
    assert_close(r, t(-1.0, -2.0, -3.0, -1.0, 0.0))


def test_retrospective_rewards_from_env_classifier() -> None:
    nothing = ("Nothing happens.",)
    signals = [
        classify_signal("You are in a room.", "Nothing happens.", False, nothing),  # format wins over invalid
        classify_signal("You are in a room.", "Nothing happens.", True, nothing),
        classify_signal("Observation: same page", "same page", True, nothing),
        classify_signal("a", "b", True, nothing),
    ]
    assert_close(retrospective_rewards(signals, -1.0, -2.0, -3.0), t(-1.0, -2.0, -3.0, 0.0))


def test_retrospective_rewards_unknown_signal() -> None:
    with pytest.raises(ValueError):
        retrospective_rewards(["fmt"])


# ------------------------------------------------------------------------------------------------ GAE / TD


def test_gae_three_steps_terminal_at_end() -> None:
    # γ=0.9, λ=0.8, V(s_1..s_4) = .5 .6 .7 .8, reward 1 at the terminal step 3:
    # δ1 = 0.9·0.6 − 0.5 = 0.04, δ2 = 0.9·0.7 − 0.6 = 0.03, δ3 = 1 − 0.7 = 0.3 (V(s_4) not bootstrapped)
    # A3 = 0.3, A2 = 0.03 + 0.72·0.3 = 0.246, A1 = 0.04 + 0.72·0.246 = 0.21712
    r, v, d = t(0.0, 0.0, 1.0), t(0.5, 0.6, 0.7, 0.8), [False, False, True]
    assert_close(td_errors(r, v, d, 0.9), t(0.04, 0.03, 0.3))
    assert_close(gae(r, v, d, 0.9, 0.8), t(0.21712, 0.246, 0.3))


def test_gae_done_in_the_middle_stops_recursion_and_bootstrap() -> None:
    # done after step 2: δ2 = 1 − 0.6 = 0.4 (no V(s_3)), A2 = δ2 (no A3 term); δ3 = 0.5 + 0.9·0.8 − 0.7 = 0.52
    # A1 = 0.04 + 0.72·0.4 = 0.328
    r, v, d = t(0.0, 1.0, 0.5), t(0.5, 0.6, 0.7, 0.8), torch.tensor([False, True, False])
    assert_close(td_errors(r, v, d, 0.9), t(0.04, 0.4, 0.52))
    assert_close(gae(r, v, d, 0.9, 0.8), t(0.328, 0.4, 0.52))


def test_gae_lambda_zero_is_td() -> None:
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(6, generator=g), torch.randn(7, generator=g)
    d = torch.tensor([False, False, True, False, False, True])
    assert_close(gae(r, v, d, 0.95, 0.0), td_errors(r, v, d, 0.95))


def test_gae_lambda_one_gamma_one_is_return_minus_value() -> None:
    g = torch.Generator().manual_seed(1)
    r, v = torch.randn(5, generator=g), torch.randn(6, generator=g)
    d = torch.tensor([False, False, False, False, True])
    assert_close(gae(r, v, d, 1.0, 1.0), discounted_returns(r, 1.0) - v[:-1])


def test_gae_batched_rows_match_single_rows() -> None:
    g = torch.Generator().manual_seed(2)
    r, v = torch.randn(3, 4, generator=g), torch.randn(3, 5, generator=g)
    d = torch.zeros(3, 4, dtype=torch.bool)
    d[:, -1] = True
    d[1, 1] = True
    batched = gae(r, v, d, 0.99, 0.95)
    for i in range(3):
        assert_close(batched[i], gae(r[i], v[i], d[i], 0.99, 0.95))


def test_td_errors_need_T_plus_one_values() -> None:
    with pytest.raises(ValueError):
        td_errors(t(0.0, 1.0), t(0.0, 1.0), [False, True], 0.9)


def test_q_minus_v() -> None:
    assert_close(q_minus_v(t(1.0, 2.0), t(0.5, 0.5, 9.0)), t(0.5, 1.5))
    assert_close(q_minus_v(t(1.0, 2.0), t(0.5, 0.25)), t(0.5, 1.75))


# ------------------------------------------------------------------------------------------------ normalisation


def test_normalise_uses_sample_std() -> None:
    # mean 2.5, sample std sqrt(5/3)
    out = normalise(t(1.0, 2.0, 3.0, 4.0))
    assert_close(out, (t(1.0, 2.0, 3.0, 4.0) - 2.5) / math.sqrt(5 / 3))
    assert_close(out.mean(), torch.tensor(0.0))
    assert_close(out.std(), torch.tensor(1.0))


@pytest.mark.parametrize("x", [[3.0], [0.1, 0.1, 0.1], [-7.0, -7.0]])
def test_normalise_constant_or_single_gives_zeros(x: list[float]) -> None:
    out = normalise(x)
    assert not torch.isnan(out).any()
    assert_close(out, torch.zeros(len(x)))


def test_group_normalise_values_and_sample_std() -> None:
    # mean 0.5, sample std sqrt(1/3) -> ±0.5·sqrt(3) (population std would give ±1)
    out = group_normalise(t(1.0, 0.0, 0.0, 1.0))
    h = 0.5 * math.sqrt(3.0)
    assert_close(out, t(h, -h, -h, h), atol=1e-5, rtol=1e-5)


def test_group_normalise_all_equal_and_single() -> None:
    assert_close(group_normalise(t(1.0, 1.0, 1.0)), torch.zeros(3))
    assert_close(group_normalise(t(0.0, 0.0)), torch.zeros(2))
    assert_close(group_normalise(t(0.7)), torch.zeros(1))


def test_group_normalise_rows_are_groups() -> None:
    out = group_normalise(torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    s = 1 / math.sqrt(2.0)  # (1 − 0.5) / sample std 0.7071
    assert_close(out, torch.tensor([[s, -s], [0.0, 0.0]]), atol=1e-5, rtol=1e-5)


def test_group_normalise_steps_pools_all_steps() -> None:
    out = group_normalise_steps([t(1.0, 2.0), t(3.0)])  # pooled mean 2, sample std 1
    assert [o.numel() for o in out] == [2, 1]
    assert_close(out[0], t(-1.0, 0.0), atol=1e-5, rtol=1e-5)
    assert_close(out[1], t(1.0), atol=1e-5, rtol=1e-5)
    const = group_normalise_steps([t(1.0, 1.0), t(1.0)])
    assert all(bool((c == 0).all()) for c in const)
    assert group_normalise_steps([]) == []


# ------------------------------------------------------------------------------------------------ Self-Guide


def test_discounted_returns() -> None:
    # G3 = 2, G2 = 0 + 0.5·2 = 1, G1 = 1 + 0.5·1 = 1.5
    assert_close(discounted_returns(t(1.0, 0.0, 2.0), 0.5), t(1.5, 1.0, 2.0))
    assert discounted_returns(t(), 0.5).numel() == 0


def test_internal_rewards_shift_to_previous_step() -> None:
    # verdict at step 2 (−1) judges a_1, step 3 (None) judges a_2, step 4 (+1) judges a_3; the step-1 verdict is
    # dropped and r_int_T = 0
    assert_close(internal_rewards_from_verdicts([1, -1, None, 1]), t(-1.0, 0.0, 1.0, 0.0))
    assert_close(internal_rewards_from_verdicts([-1]), t(0.0))
    assert internal_rewards_from_verdicts([]).numel() == 0


@pytest.mark.parametrize("bad", [2, True, "good"])
def test_internal_rewards_reject_bad_verdicts(bad: object) -> None:
    with pytest.raises(ValueError):
        internal_rewards_from_verdicts([0, bad])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.0),
        (19, 0.0),
        (20, 0.0),
        (21, 0.5 * 0.01 / 0.3),
        (35, 0.25),
        (49, 0.5 * 29 / 30),
        (50, 0.5),
        (100, 0.5),
        (150, 0.5),
    ],
)
def test_trust_weight_staged_around_breakpoints(step: int, expected: float) -> None:
    assert trust_weight(step, 100, 0.5) == pytest.approx(expected)


def test_trust_weight_other_schedules() -> None:
    assert trust_weight(0, 100, 0.5, schedule="constant") == 0.5
    assert trust_weight(99, 100, 0.5, schedule="none") == 0.0
    # equal breakpoints: a step from 0 to λ_max
    assert trust_weight(29, 100, 0.5, breakpoints=(0.3, 0.3)) == 0.0
    assert trust_weight(30, 100, 0.5, breakpoints=(0.3, 0.3)) == 0.5
    with pytest.raises(ValueError):
        trust_weight(0, 100, 0.5, schedule="linear")
    with pytest.raises(ValueError):
        trust_weight(0, 100, 0.5, breakpoints=(0.6, 0.5))


# ------------------------------------------------------------------------------------------------ AWR


def test_awr_weights_capped() -> None:
    w = awr_weights(t(-1.0, 0.0, 1.0, 2.0, 1000.0), beta=3.0, cap=100.0)
    assert_close(w, t(math.exp(-3.0), 1.0, math.exp(3.0), 100.0, 100.0))
    assert torch.isfinite(w).all() and bool((w <= 100.0).all())
