"""Confidence intervals of the ``sparda eval`` reports (design §8, Uncertainty): Wilson score
intervals of accuracies, seeded percentile bootstraps of (paired) means and ratios.
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
    """Wilson score interval of a proportion (Wilson 1927, J. Amer. Statist. Assoc. 22:209-212;
    design §8). A partial-credit mean score is treated as the proportion.

    Args:
        p_hat: observed proportion, 0-1. n: samples (>= 1). z: normal quantile (95 % two-sided).
    Returns:
        ``(low, high)`` in [0, 1].
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
    """Mean with a seeded percentile bootstrap interval; with ``strata`` (one label per value)
    each stratum is resampled within itself (design §8: paired, per task x length cell).

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
    """``sum(numerators) / sum(denominators)`` of paired values with a seeded percentile bootstrap
    over the pairs; a resample whose denominators sum to 0 counts as ``inf``.

    Returns:
        ``(ratio, low, high)``.
    Raises:
        SpardaError: no pairs, unequal lengths, or denominators summing to 0.
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
