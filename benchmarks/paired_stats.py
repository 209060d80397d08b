"""Ratios from paired measurements, with confidence intervals (the benchmarks' A/B figures).

A pair is the same work done by both sides back to back (`bench_overlap`: one request on an
engine with kvtier and on one without). Two estimates of the ratio:

- `paired_ratio`: the geometric mean of the per-pair ratios, with Student's t interval on the
  per-pair log-ratios, exp(mean ± t(1 - (1 - level)/2, n-1)·sd/√n);
- `median_ratio`: the median per-pair ratio, with its distribution-free interval (the sorted
  ratios at ranks n/2 ∓ z·√n/2): another process's burst that slows one side of a pair 2-5x on
  a shared machine moves it by one rank at most, while it widens the t interval most.

No numpy or scipy: the t quantile is the normal one, Cornish-Fisher corrected.
"""

from __future__ import annotations

import math
import statistics
from typing import NamedTuple

__all__ = ["RatioCI", "median_ratio", "paired_ratio", "t_quantile"]


class RatioCI(NamedTuple):
    """A ratio from paired measurements, and its confidence interval."""

    ratio: float
    low: float
    high: float
    num_pairs: int


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile: the normal one, Cornish-Fisher corrected (within 0.2 % for df >= 4)."""
    z = statistics.NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def paired_ratio(numer: list[float], denom: list[float], level: float = 0.95) -> RatioCI:
    """Geometric mean of numer[k] / denom[k], with the t interval of the mean log-ratio.

    With fewer than two pairs the bounds are NaN.
    """
    logs = [math.log(a / b) for a, b in zip(numer, denom, strict=True)]
    n = len(logs)
    mean = statistics.fmean(logs)
    if n < 2:
        return RatioCI(math.exp(mean), math.nan, math.nan, n)
    half = t_quantile(0.5 + level / 2, n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return RatioCI(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n)


def median_ratio(numer: list[float], denom: list[float], level: float = 0.95) -> RatioCI:
    """Median of numer[k] / denom[k], with its distribution-free interval (order statistics).

    The bounds are the per-pair ratios at ranks n/2 -+ z·√n/2 (the sign test's normal
    approximation): one pair slowed by another process's burst moves them by one rank at most.
    """
    ratios = sorted(a / b for a, b in zip(numer, denom, strict=True))
    n = len(ratios)
    spread = statistics.NormalDist().inv_cdf(0.5 + level / 2) * math.sqrt(n) / 2
    low = max(0, math.floor(n / 2 - spread))
    high = min(n - 1, math.ceil(n / 2 + spread) - 1)
    return RatioCI(statistics.median(ratios), ratios[low], ratios[high], n)
