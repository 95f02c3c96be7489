"""Paired comparison statistics against hand-computed values."""

from __future__ import annotations

import pytest

from agentevo.eval.stats import (
    bootstrap_mean_ci,
    format_p,
    paired_difference,
    permutation_p,
    seed_task_bootstrap_ci,
    sign_test_p,
)


def test_sign_test_p_matches_the_exact_binomial_by_hand() -> None:
    # 5 vs 0 discordant: 2 * (1/2)^5 = 0.0625
    assert sign_test_p(5, 0) == 0.0625
    assert sign_test_p(0, 5) == 0.0625
    # 6 vs 1: 2 * (C(7,0) + C(7,1)) / 2^7 = 2 * 8 / 128 = 0.125
    assert sign_test_p(6, 1) == 0.125
    # 10 vs 2: 2 * (1 + 12 + 66) / 4096 = 158 / 4096
    assert sign_test_p(10, 2) == pytest.approx(158 / 4096, rel=1e-12)
    # balanced: the two tails overlap, p is capped at 1; no discordant outcomes at all: 1
    assert sign_test_p(3, 3) == 1.0
    assert sign_test_p(0, 0) == 1.0
    with pytest.raises(ValueError, match="non-negative"):
        sign_test_p(-1, 2)


def test_bootstrap_of_equal_differences_is_a_zero_width_interval() -> None:
    assert bootstrap_mean_ci([[2.0] * 50, [2.0] * 50]) == (2.0, 2.0, 2.0)
    assert bootstrap_mean_ci([[0.0, 0.0, 0.0]]) == (0.0, 0.0, 0.0)


def test_bootstrap_interval_of_two_tasks_is_their_range() -> None:
    # per-task means 0 and 100: a resample's mean is 0 (p 1/4), 50 (1/2) or 100 (1/4), so the 2.5% and 97.5%
    # quantiles are 0 and 100
    assert bootstrap_mean_ci([[0.0, 100.0]]) == (50.0, 0.0, 100.0)


def test_bootstrap_is_reproducible_and_keeps_the_seed_pairing() -> None:
    diffs = [[0.0, 100.0, 100.0, 0.0], [0.0, 0.0, 0.0, 100.0]]
    first = bootstrap_mean_ci(diffs)
    assert first == bootstrap_mean_ci(diffs)  # fixed RNG seed
    # tasks are resampled as whole columns: per-task means 0, 50, 50, 50 -> a resample's mean is 0 with p 1/256
    # (< 2.5%) and <= 12.5 with p ~5.1% (> 2.5%), so the lower bound is 12.5; all-50 has p ~32%, the upper is 50
    assert first == (37.5, 12.5, 50.0)
    with pytest.raises(ValueError, match="pairs x tasks"):
        bootstrap_mean_ci([])


def test_paired_difference_counts_discordant_cells_over_seed_pairs() -> None:
    arm = [[100, 100, 100, 0], [100, 100, 0, 100]]
    base = [[100, 0, 0, 0], [100, 100, 0, 0]]
    r = paired_difference(arm, base)
    assert (r.mean, r.lo, r.hi) == (37.5, 12.5, 50.0)
    assert (r.n_pairs, r.n_tasks, r.wins, r.losses) == (2, 4, 3, 0)
    assert r.p == 0.25  # 2 * (1/2)^3
    assert r.excludes_zero
    # arms whose per-seed values are a permutation of each other are not "identical" task by task
    r = paired_difference([[100, 0, 0], [0, 100, 0]], [[0, 100, 0], [100, 0, 0]])
    assert (r.mean, r.wins, r.losses, r.p) == (0.0, 2, 2, 1.0)
    assert not r.excludes_zero
    with pytest.raises(ValueError, match="differ in shape"):
        paired_difference([[1, 0]], [[1, 0, 1]])


def test_format_p() -> None:
    assert format_p(0.0625) == "p = 0.062"
    assert format_p(1.0) == "p = 1"
    assert format_p(0.25) == "p = 0.25"
    assert format_p(0.0004) == "p < 0.001"


def test_seed_and_task_bootstrap_by_hand() -> None:
    # one seed pair gains everywhere, the other nowhere: every task's mean is 50 (task interval [50, 50]), but a
    # resample of the two seeds draws the null one twice with p 1/4 (mean 0), once with p 1/2 (50), never with p 1/4
    # (100): the 2.5% / 97.5% quantiles are 0 and 100
    split = [[0.0] * 4, [100.0] * 4]
    assert bootstrap_mean_ci(split) == (50.0, 50.0, 50.0)
    assert seed_task_bootstrap_ci(split) == (0.0, 100.0)
    # identical seed pairs: resampling them changes nothing, and the interval is the task interval of one row
    assert seed_task_bootstrap_ci([[0.0, 100.0], [0.0, 100.0]]) == (0.0, 100.0)
    # three seeds at 40 / 50 / 60 on every task: the resampled mean stays within [40, 60] and reaches both ends
    # (each with p 1/27 > 2.5%)
    assert seed_task_bootstrap_ci([[50.0] * 32, [40.0] * 32, [60.0] * 32]) == (40.0, 60.0)
    assert seed_task_bootstrap_ci([[1.0, 0.0]]) is None  # one pair: nothing to resample
    r = paired_difference([[100.0] * 4, [100.0] * 4], [[100.0] * 4, [0.0] * 4])
    assert r.per_pair == (0.0, 100.0) and (r.seeds_lo, r.seeds_hi) == (0.0, 100.0) and r.seeds_exclude_zero is False
    assert paired_difference([[100.0, 0.0]], [[0.0, 0.0]]).seeds_exclude_zero is None
    with pytest.raises(ValueError, match="pairs x tasks"):
        seed_task_bootstrap_ci([[]])


def test_permutation_p_counts_every_split_by_hand() -> None:
    # the qe200 study's w/o W-IQL vs Q-Evolve (+2.5 / +3.0 / +4.5) against four minibatch-order draws: pooled
    # [-4.0, 0.5, 1.5, 2.5, 3.0, 4.5, 4.5] (total 12.5); a triple of sum S differs from the other four by
    # S / 3 - (12.5 - S) / 4 = (7 S - 37.5) / 12, so the observed +2.71 needs S >= 10: 4.5 + 4.5 + (3.0, 2.5 or 1.5)
    # and 3.0 + 2.5 + either 4.5, 5 of the C(7, 3) = 35 triples; the mirror (S <= 0.71) is -4.0 with a pair of 0.5,
    # 1.5, 2.5, 3.0 summing to <= 4.71: 5 more
    assert permutation_p([2.5, 3.0, 4.5], [-4.0, 4.5, 1.5, 0.5]) == (pytest.approx(5 / 35), pytest.approx(10 / 35))
    assert permutation_p([-2.5, -3.0, -4.5], [4.0, -4.5, -1.5, -0.5]) == (pytest.approx(5 / 35),
                                                                         pytest.approx(10 / 35))  # mirrored
    assert permutation_p([1.0], [1.0, 1.0]) == (1.0, 1.0)  # nothing to tell apart
    # past max_splits the splits are a seeded sample: reproducible, and near the exact count (C(20, 5) = 15,504)
    arm, noise = [3.0, 2.5, 4.0, 1.0, 3.5], [float(x) for x in (-3, 2, 0.5, 1, -1, 4, -2, 0, 1.5, -0.5, 2, -4, 1, 0, 3)]
    exact = permutation_p(arm, noise)
    sampled = permutation_p(arm, noise, max_splits=10_000)
    assert sampled == permutation_p(arm, noise, max_splits=10_000) != permutation_p(arm, noise, 10_000, seed=1)
    assert 0.01 < exact[1] < 0.2 and sampled == (pytest.approx(exact[0], abs=0.01), pytest.approx(exact[1], abs=0.01))
    with pytest.raises(ValueError, match="at least one arm value and two noise values"):
        permutation_p([1.0], [0.0])
