"""Intervals for evaluation figures: a success rate's, a mean score's, and a paired
gain's; and scores put on one scale over questions of unlike baselines."""

from __future__ import annotations

import math


def binomial_interval(successes: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """Wilson's score interval for a success rate (95% with z = 1.96): unlike the
    normal approximation it stays inside [0, 1] and holds near 0 and 1."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_gain(before: list[float], after: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """(mean, low, high) of ``after - before`` over the same items (95% with z = 1.96):
    the normal interval of the mean of per-item differences, which, unlike two
    separate intervals, credits that both were measured on the same questions."""
    if len(before) != len(after) or not before:
        raise ValueError(f"need two equal, non-empty lists of scores (got {len(before)} and {len(after)})")
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    return sum(diffs) / len(diffs), *mean_interval(diffs, z)


def mean_interval(scores: list[float], z: float = 1.96) -> tuple[float, float]:
    """The normal interval of the mean of ``scores`` (95% with z = 1.96), for scores
    that are not successes and failures (an IoU, a normalised score)."""
    if not scores:
        return 0.0, 0.0
    n = len(scores)
    mean = sum(scores) / n
    spread = math.sqrt(sum((x - mean) ** 2 for x in scores) / (n - 1)) if n > 1 else 0.0
    return mean - z * spread / math.sqrt(n), mean + z * spread / math.sqrt(n)


def score_interval(scores: list[float]) -> tuple[float, float]:
    """The 95% interval of the mean of ``scores``: Wilson's when every score is a
    success or a failure (0 or 1), else the normal interval of a mean (an IoU, a
    partial credit), whose spread Wilson's p(1 - p) would overstate."""
    if all(x in (0.0, 1.0) for x in scores):
        return binomial_interval(sum(scores), len(scores))
    return mean_interval(scores)


def above_baseline(score: float, baseline: float) -> float:
    """``score`` on a scale where ``baseline`` (what the question scores without its
    media) is 0 and a right answer is 1: (score - baseline) / (1 - baseline); below the
    baseline it goes negative, down to -baseline / (1 - baseline)."""
    if not 0 <= baseline < 1:
        raise ValueError(f"a baseline must be in [0, 1) to normalise by (got {baseline})")
    return (score - baseline) / (1 - baseline)
