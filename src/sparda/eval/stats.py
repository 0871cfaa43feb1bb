"""Confidence intervals for ``sparda eval`` reports (design §8).

* :func:`wilson_interval`: the score interval of a proportion (Wilson 1927), for every
  accuracy in the reports;
* :func:`bootstrap_mean`: a seeded (optionally stratified) percentile bootstrap of a mean,
  used on paired differences (method A minus method B on the same prompts) and on
  per-window perplexity metrics;
* :func:`bootstrap_ratio`: the same for a ratio of means of paired values (a KV dtype's
  KL over bf16's on the same windows).
"""

from __future__ import annotations

import math

import numpy as np

from sparda.errors import SpardaError

#: the two-sided 95 % standard normal quantile
Z95 = 1.959963984540054
#: bootstrap resamples of the reports
RESAMPLES = 10_000


def wilson_interval(p_hat: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion.

    E. B. Wilson, "Probable inference, the law of succession, and statistical inference",
    J. Amer. Statist. Assoc. 22 (1927) 209-212: the ``p`` with
    ``|p_hat - p| <= z * sqrt(p (1 - p) / n)``, i.e.

        centre = (p_hat + z^2 / (2n)) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p_hat (1 - p_hat) / n + z^2 / (4 n^2))

    Unlike the normal (Wald) interval it stays inside [0, 1] and is not empty at
    ``p_hat`` = 0 or 1. For scores with partial credit (fraction of items found) the mean
    score is treated as the proportion, an approximation that is conservative when the
    per-sample scores are less spread out than 0/1 outcomes.

    Args:
        p_hat: observed proportion (mean score), 0-1.
        n: number of samples (> 0).
        z: standard normal quantile (default: 95 % two-sided).
    Returns:
        ``(low, high)``, both in [0, 1].
    Raises:
        SpardaError: ``n < 1`` or ``p_hat`` outside [0, 1].
    """
    if n < 1:
        raise SpardaError(f"a Wilson interval needs at least one sample, got n={n}")
    if not 0.0 <= p_hat <= 1.0:
        raise SpardaError(f"a Wilson interval needs a proportion in [0, 1], got {p_hat}")
    denom = 1.0 + z * z / n
    centre = (p_hat + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p_hat * (1.0 - p_hat) / n + z * z / (4.0 * n * n))
    # the interval always holds p_hat (exactly 0 / 1 at the ends); clamp away rounding
    return max(0.0, min(centre - half, p_hat)), min(1.0, max(centre + half, p_hat))


def bootstrap_mean(values, strata=None, *, resamples: int = RESAMPLES, seed: int = 0,
                   level: float = 0.95) -> tuple[float, float, float]:
    """Mean of ``values`` with a percentile bootstrap interval (seeded numpy).

    For a paired comparison pass the per-prompt differences ``score_A - score_B``: each
    resample draws prompts (pairs) with replacement, so what both methods share (the
    prompt's difficulty) cancels, which is the paired bootstrap. With ``strata`` (one
    label per value, e.g. ``(task, length)``) each stratum is resampled within itself and
    keeps its size, so the statistic stays the pooled mean over fixed cells.

    Args:
        values: 1-D sequence of floats (n >= 1).
        strata: optional sequence of hashable labels, one per value.
        resamples: bootstrap resamples.
        seed: seed of ``numpy.random.default_rng``.
        level: two-sided coverage of the percentile interval.
    Returns:
        ``(mean, low, high)``.
    Raises:
        SpardaError: no values, or ``strata`` of another length.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise SpardaError("a bootstrap needs a non-empty 1-D list of values")
    labels = [0] * x.size if strata is None else list(strata)
    if len(labels) != x.size:
        raise SpardaError(f"{len(labels)} strata labels for {x.size} values")
    rng = np.random.default_rng(seed)
    totals = np.zeros(resamples)
    groups: dict = {}
    for i, label in enumerate(labels):
        groups.setdefault(label, []).append(i)
    for label in sorted(groups, key=repr):  # a fixed order: the same seed gives the same interval
        cell = x[groups[label]]
        picks = rng.integers(0, cell.size, size=(resamples, cell.size))
        totals += cell[picks].sum(axis=1)
    means = totals / x.size
    tail = (1.0 - level) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(x.mean()), float(low), float(high)


def bootstrap_ratio(numerators, denominators, *, resamples: int = RESAMPLES, seed: int = 0,
                    level: float = 0.95) -> tuple[float, float, float]:
    """``sum(numerators) / sum(denominators)`` (the ratio of the means) of paired values,
    with a percentile bootstrap interval that resamples the pairs (seeded numpy): each
    resample draws ``n`` indices with replacement and takes the ratio of the drawn sums.

    Args:
        numerators, denominators: 1-D sequences of floats, one pair per index (n >= 1),
            e.g. the mean KL of each window under int8 and under bf16.
        resamples, seed, level: as :func:`bootstrap_mean`.
    Returns:
        ``(ratio, low, high)``; a resample whose denominators sum to 0 counts as ``inf``.
    Raises:
        SpardaError: no pairs, sequences of different lengths, or denominators summing to 0.
    """
    a = np.asarray(numerators, dtype=np.float64)
    b = np.asarray(denominators, dtype=np.float64)
    if a.ndim != 1 or a.size == 0 or a.shape != b.shape:
        raise SpardaError(f"a ratio bootstrap needs two non-empty 1-D lists of equal length, got {a.shape} and {b.shape}")
    if b.sum() == 0:
        raise SpardaError("a ratio bootstrap needs denominators that do not sum to 0")
    picks = np.random.default_rng(seed).integers(0, a.size, size=(resamples, a.size))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = a[picks].sum(axis=1) / b[picks].sum(axis=1)
    ratios[~np.isfinite(ratios)] = np.inf
    tail = (1.0 - level) / 2
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return float(a.sum() / b.sum()), float(low), float(high)
