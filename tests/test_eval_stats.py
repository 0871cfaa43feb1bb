"""Intervals of the eval reports: Wilson (1927) against hand-computed values and scipy,
the bootstrap against an exact enumeration of every resample."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from sparda.errors import SpardaError
from sparda.eval.stats import bootstrap_mean, bootstrap_ratio, wilson_interval


@pytest.mark.parametrize("k, n, low, high", [
    # by hand from the closed form, z = 1.959964 (also the textbook values)
    (0, 10, 0.0, 0.27753),
    (5, 10, 0.23659, 0.76341),
    (10, 10, 0.72247, 1.0),
    (1, 3, 0.06149, 0.79234),
    (27, 30, 0.74379, 0.96540),
])
def test_wilson_known_values(k, n, low, high):
    got = wilson_interval(k / n, n)
    assert got == pytest.approx((low, high), abs=5e-5)


def test_wilson_against_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng()
    for _ in range(20):
        n = int(rng.integers(1, 200))
        k = int(rng.integers(0, n + 1))
        ci = scipy_stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert wilson_interval(k / n, n) == pytest.approx((ci.low, ci.high), abs=1e-9), (k, n)


def test_wilson_contains_estimate_and_narrows():
    for n in (1, 4, 30, 300):
        for p in (0.0, 0.3, 1.0):
            low, high = wilson_interval(p, n)
            assert 0.0 <= low <= p <= high <= 1.0
    assert wilson_interval(0.5, 300)[1] - wilson_interval(0.5, 300)[0] < wilson_interval(0.5, 30)[1] - wilson_interval(0.5, 30)[0]
    with pytest.raises(SpardaError, match="at least one sample"):
        wilson_interval(0.5, 0)
    with pytest.raises(SpardaError, match="proportion"):
        wilson_interval(1.5, 3)


def _exact_quantiles(cells, level=0.95):
    """Exact bootstrap distribution of the pooled mean: every resample of every cell,
    enumerated, each equally likely; its percentile interval (numpy's interpolation)."""
    total = sum(len(c) for c in cells)
    per_cell = [[sum(pick) for pick in itertools.product(c, repeat=len(c))] for c in cells]
    means = np.array([sum(parts) / total for parts in itertools.product(*per_cell)])
    tail = (1 - level) / 2
    return np.quantile(means, [tail, 1 - tail])


def test_bootstrap_matches_exact_enumeration():
    rng = np.random.default_rng(int(np.random.randint(2**31)))
    values = rng.normal(size=6)
    mean, low, high = bootstrap_mean(values, resamples=200_000, seed=1)
    exact = _exact_quantiles([list(values)])
    spread = values.max() - values.min()
    assert mean == pytest.approx(values.mean(), abs=1e-12)
    assert (low, high) == pytest.approx(tuple(exact), abs=0.02 * spread)


def test_stratified_bootstrap_matches_exact_enumeration():
    rng = np.random.default_rng(int(np.random.randint(2**31)))
    a, b = rng.normal(0, 1, size=3), rng.normal(3, 0.2, size=4)
    values = np.concatenate([a, b])
    strata = ["a"] * 3 + ["b"] * 4
    mean, low, high = bootstrap_mean(values, strata, resamples=200_000, seed=2)
    exact = _exact_quantiles([list(a), list(b)])
    assert (low, high) == pytest.approx(tuple(exact), abs=0.02 * (values.max() - values.min()))
    # stratified: cell sizes fixed, so narrower than pooled resampling of two far-apart groups
    _, plow, phigh = bootstrap_mean(values, resamples=20_000, seed=2)
    assert high - low < phigh - plow


def test_paired_bootstrap_is_seeded_and_sees_pairing():
    rng = np.random.default_rng(int(np.random.randint(2**31)))
    difficulty = rng.uniform(0, 1, size=40)  # shared by both methods on each prompt
    a = difficulty + rng.normal(0, 0.01, size=40) + 0.05
    b = difficulty + rng.normal(0, 0.01, size=40)
    paired = bootstrap_mean(a - b, seed=3)
    assert paired == bootstrap_mean(a - b, seed=3)
    assert paired[1] > 0  # the paired interval excludes 0 ...
    half_unpaired = 1.959963984540054 * math.sqrt(a.var(ddof=1) / 40 + b.var(ddof=1) / 40)
    assert half_unpaired > 0.05  # ... which an unpaired normal interval would not
    with pytest.raises(SpardaError, match="non-empty"):
        bootstrap_mean([])
    with pytest.raises(SpardaError, match="strata"):
        bootstrap_mean([1.0, 2.0], ["a"])


def test_ratio_bootstrap_matches_exact_enumeration_and_sees_pairing():
    """bootstrap_ratio: the ratio of sums, its interval against every one of the 5^5 equally
    likely resamples of 5 pairs (the exact distribution's CDF at the interval's ends), and a
    paired ratio whose interval is narrow although the denominators spread over two orders of
    magnitude (an unpaired resampling's interval is more than 10x as wide)."""
    rng = np.random.default_rng(int(np.random.randint(2**31)))
    a, b = rng.uniform(0.5, 2.0, size=5), rng.uniform(0.5, 2.0, size=5)
    ratio, low, high = bootstrap_ratio(a, b, resamples=200_000, seed=1)
    assert ratio == pytest.approx(a.sum() / b.sum(), rel=1e-12)
    draws = np.array(list(itertools.product(range(5), repeat=5)))
    exact = a[draws].sum(1) / b[draws].sum(1)
    # one multiset of 5 indices can carry up to 5!/5^5 = 3.8 % of the mass, so the exact
    # distribution has atoms larger than the tails: compare through its CDF (the definition
    # of a quantile), with room for the 200,000 resamples' error (sd 0.00035)
    for end, tail in ((low, 0.025), (high, 0.975)):
        tol = 1e-9 * abs(end)
        assert np.mean(exact < end - tol) <= tail + 0.003 and np.mean(exact <= end + tol) >= tail - 0.003
    assert bootstrap_ratio(a, b, seed=4) == bootstrap_ratio(a, b, seed=4)
    base = rng.uniform(0.01, 1.0, size=16)  # e.g. per-window KL under bf16
    noise = rng.normal(0, 0.005, size=16)
    noise -= base * (base @ noise) / (base @ base)  # sum(base * noise) == 0: the ratio is 1.1 exactly
    paired = bootstrap_ratio(1.1 * base * (1 + noise), base, seed=5)
    assert paired[0] == pytest.approx(1.1, rel=1e-12)
    assert paired[1] < 1.1 < paired[2] and paired[2] - paired[1] < 0.02
    # unpaired (each side resampled on its own), the spread of the denominators shows
    picks = np.random.default_rng(6).integers(0, 16, size=(20_000, 2, 16))
    unpaired = (1.1 * base * (1 + noise))[picks[:, 0]].sum(1) / base[picks[:, 1]].sum(1)
    assert np.subtract(*np.quantile(unpaired, [0.975, 0.025])) > 10 * (paired[2] - paired[1])
    with pytest.raises(SpardaError, match="equal length"):
        bootstrap_ratio([1.0, 2.0], [1.0])
    with pytest.raises(SpardaError, match="sum to 0"):
        bootstrap_ratio([1.0], [0.0])
