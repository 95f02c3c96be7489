"""Paired comparison statistics: bootstrap over tasks with seed pairs kept, the same over seeds and tasks, and the
exact sign (McNemar) test.

Outcomes come as a matrix `diffs[pair][task]`: one row per seed pair (arm seed s vs baseline seed s), one column per
task of the shared task list, each cell arm outcome minus baseline outcome (in points: success x 100, or final
reward x 100). Pure functions, no I/O, so the numbers can be checked by hand.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PairedResult:
    """Arm minus baseline over paired seeds and tasks."""

    mean: float  # mean difference, points
    lo: float  # 95% bootstrap interval over tasks
    hi: float
    n_pairs: int  # seed pairs
    n_tasks: int
    wins: int  # (pair, task) cells where the arm did better
    losses: int  # ... and where it did worse
    p: float  # two-sided exact sign test on wins vs losses (McNemar exact for success)
    per_pair: tuple[float, ...] = ()  # mean difference of each seed pair, in row order
    seeds_lo: float | None = None  # 95% interval resampling seed pairs as well as tasks; None for one pair
    seeds_hi: float | None = None

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval lies entirely on one side of zero."""
        return self.lo > 0 or self.hi < 0

    @property
    def seeds_exclude_zero(self) -> bool | None:
        """Whether the interval over seeds and tasks lies on one side of zero; None with a single seed pair."""
        if self.seeds_lo is None or self.seeds_hi is None:
            return None
        return self.seeds_lo > 0 or self.seeds_hi < 0


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact binomial p of `wins` vs `losses` discordant outcomes under p = 1/2 (ties dropped).

    McNemar's exact test is this test on the discordant pairs; 1.0 when there are none.
    """
    if wins < 0 or losses < 0:
        raise ValueError("discordant counts must be non-negative")
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1))
    # exact integer arithmetic: 2 * tail / 2^n, capped at 1 (the two tails overlap when wins == losses)
    return min(1.0, 2 * tail / 2**n)


def permutation_p(arm: Sequence[float], noise: Sequence[float], max_splits: int = 200_000,
                  seed: int = 0) -> tuple[float, float]:
    """Permutation p of mean(arm) - mean(noise): the pooled values relabelled every way (exact while the splits
    number at most `max_splits`, else that many seeded random splits). Returns (one-sided, in the observed
    difference's direction; two-sided). `noise` holds differences a run shows when nothing that matters changed
    (the same method, another minibatch order): is the arm's difference outside that spread?"""
    if not arm or len(noise) < 2:
        raise ValueError("permutation_p needs at least one arm value and two noise values")
    pooled = np.asarray([*arm, *noise], dtype=float)
    k, total = len(arm), pooled.sum()
    observed = float(np.mean(arm) - np.mean(noise))
    n_splits = math.comb(len(pooled), k)
    if n_splits <= max_splits:
        picks = np.asarray(list(itertools.combinations(range(len(pooled)), k)), dtype=int)
    else:
        # each row's k smallest of n uniform keys: a uniform random k-subset, drawn for all rows at once
        picks = np.argsort(np.random.default_rng(seed).random((max_splits, len(pooled))), axis=1)[:, :k]
    sums = pooled[picks].sum(axis=1)
    diffs = sums / k - (total - sums) / (len(pooled) - k)
    tol = 1e-9 * max(1.0, abs(observed))
    one = np.mean(diffs >= observed - tol) if observed >= 0 else np.mean(diffs <= observed + tol)
    return float(one), float(np.mean(np.abs(diffs) >= abs(observed) - tol))


def _diff_matrix(diffs: Sequence[Sequence[float]]) -> np.ndarray:
    d = np.asarray(diffs, dtype=np.float64)
    if d.ndim != 2 or d.shape[0] == 0 or d.shape[1] == 0:
        raise ValueError("diffs must be a non-empty pairs x tasks matrix")
    return d


def bootstrap_mean_ci(diffs: Sequence[Sequence[float]], n_boot: int = 10_000, seed: int = 0,
                      level: float = 0.95) -> tuple[float, float, float]:
    """Mean of a pairs x tasks difference matrix and its percentile bootstrap interval, resampling tasks.

    The same resampled tasks are used for every seed pair, so a task's pairing across seeds is kept; the fixed RNG
    seed makes the interval reproducible.
    """
    d = _diff_matrix(diffs)
    per_task = d.mean(axis=0)  # every pair covers every task, so the mean over tasks of these is the grand mean
    mean = float(per_task.mean())
    if np.all(per_task == per_task[0]):
        return mean, mean, mean  # every resample gives the same mean; skip float noise from summing
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, per_task.size, size=(n_boot, per_task.size))
    boot = per_task[idx].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(boot, [alpha, 1 - alpha])
    return mean, float(lo), float(hi)


def seed_task_bootstrap_ci(diffs: Sequence[Sequence[float]], n_boot: int = 10_000, seed: int = 0,
                           level: float = 0.95) -> tuple[float, float] | None:
    """Percentile interval of the mean of a pairs x tasks difference matrix, resampling seed pairs (rows) and tasks
    (columns) independently (a two-way bootstrap for a crossed design: every seed pair plays every task).

    The task-only interval of `bootstrap_mean_ci` holds the seeds fixed: it says how sure we are about *these*
    trained policies on more tasks. This one also asks whether another training seed would agree, so a difference
    carried by one seed out of two gets a wide interval. None with fewer than two pairs (nothing to resample).
    """
    d = _diff_matrix(diffs)
    n_pairs, n_tasks = d.shape
    if n_pairs < 2:
        return None
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, n_pairs, size=(n_boot, n_pairs))
    cols = rng.integers(0, n_tasks, size=(n_boot, n_tasks))
    # how often each row / column is drawn per resample; the resample's mean is row_counts @ d @ col_counts / (P * T)
    row_counts, col_counts = np.zeros((n_boot, n_pairs)), np.zeros((n_boot, n_tasks))
    np.add.at(row_counts, (np.arange(n_boot)[:, None], rows), 1.0)
    np.add.at(col_counts, (np.arange(n_boot)[:, None], cols), 1.0)
    boot = ((row_counts @ d) * col_counts).sum(axis=1) / (n_pairs * n_tasks)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(boot, [alpha, 1 - alpha])
    return float(lo), float(hi)


def paired_difference(arm: Sequence[Sequence[float]], base: Sequence[Sequence[float]], n_boot: int = 10_000,
                      seed: int = 0) -> PairedResult:
    """Compare pairs x tasks outcome matrices (same shape, rows = seed pairs, columns = the same tasks)."""
    a, b = np.asarray(arm, dtype=np.float64), np.asarray(base, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"arm and baseline outcomes differ in shape: {a.shape} vs {b.shape}")
    d = a - b
    mean, lo, hi = bootstrap_mean_ci(d, n_boot, seed)
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    seeds = seed_task_bootstrap_ci(d, n_boot, seed)
    return PairedResult(mean, lo, hi, d.shape[0], d.shape[1], wins, losses, sign_test_p(wins, losses),
                        tuple(float(x) for x in d.mean(axis=1)), *(seeds or (None, None)))


def format_p(p: float) -> str:
    """A p-value for prose: two significant digits, 'p < 0.001' below that."""
    if p < 0.001:
        return "p < 0.001"
    return f"p = {float(f'{p:.2g}'):g}"
