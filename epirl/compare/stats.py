"""Held-out accuracy of a pairing over seeds, and its paired difference to the reference pairing, with intervals.

Data: `correct[s, j]` = 1 when seed s's adapter answered held-out problem j (greedy, one answer per problem). Every
pairing is scored on the same problems, so problems are the unit of resampling: the percentile bootstrap
(epirl.eval.stats.percentile_bootstrap, on scipy.stats.bootstrap) resamples problems and averages over seeds, i.e.
it bootstraps the mean of the per-problem seed averages. The interval says how much the accuracy could move on
another draw of problems from the task with these trained adapters, not how much it could move on another draw of
training seeds.

The seed-to-seed spread (training randomness) is the other source: `seed_difference` compares two pairings' per-seed
accuracies with Welch's t-interval (unequal variances; seeds are the unit, each seed's accuracy already averages
its problems). With three seeds it is wide, and it is the interval to read before calling two pairings different.

The paired difference uses the per-problem difference of the two pairings' seed averages, resampled together
(same problems), which removes the problems' shared difficulty from its variance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from epirl.eval.stats import percentile_bootstrap


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float

    def covers(self, value: float) -> bool:
        return self.low <= value <= self.high

    def as_dict(self) -> dict[str, float]:
        return {"estimate": self.estimate, "ci_low": self.low, "ci_high": self.high}


def seed_averaged(correct_S_M) -> np.ndarray:
    """Per problem, the fraction of seeds whose adapter got it right: [M]."""
    correct = np.asarray(correct_S_M, dtype=float)
    if correct.ndim != 2 or correct.shape[0] < 1 or correct.shape[1] < 1:
        raise ValueError(f"need a [seeds, problems] matrix with at least one of each, got shape {correct.shape}")
    return correct.mean(axis=0)


def bootstrap_mean(values_M, resamples: int = 10_000, confidence: float = 0.95, seed: int = 0) -> Interval:
    """The mean of `values_M` with its percentile-bootstrap interval (problems resampled with replacement)."""
    values = np.asarray(values_M, dtype=float)
    if values.ndim != 1 or values.size == 0:
        raise ValueError("bootstrap_mean needs a non-empty vector")
    low, high = percentile_bootstrap((values,), np.mean, resamples, confidence, seed)
    return Interval(float(values.mean()), low, high)


def accuracy_interval(correct_S_M, resamples: int = 10_000, confidence: float = 0.95, seed: int = 0) -> Interval:
    """Accuracy averaged over seeds and problems, with the bootstrap over problems."""
    return bootstrap_mean(seed_averaged(correct_S_M), resamples, confidence, seed)


def paired_difference(correct_a_S_M, correct_b_S_M, resamples: int = 10_000, confidence: float = 0.95,
                      seed: int = 0) -> Interval:
    """accuracy(a) − accuracy(b) on the same problems (the seed counts may differ), problems resampled together."""
    a, b = seed_averaged(correct_a_S_M), seed_averaged(correct_b_S_M)
    if a.shape != b.shape:
        raise ValueError(f"paired_difference needs the same problems, got {a.size} and {b.size}")
    return bootstrap_mean(a - b, resamples, confidence, seed)


def seed_difference(per_seed_a, per_seed_b, confidence: float = 0.95) -> Interval | None:
    """mean(a) − mean(b) of two pairings' per-seed accuracies with Welch's t-interval; None with fewer than two seeds
    on either side (undefined); a point interval when no seed differs from another on either side."""
    a, b = np.asarray(per_seed_a, dtype=float), np.asarray(per_seed_b, dtype=float)
    if a.size < 2 or b.size < 2:
        return None
    if np.ptp(a) == 0.0 and np.ptp(b) == 0.0:
        return Interval(float(a.mean() - b.mean()), float(a.mean() - b.mean()), float(a.mean() - b.mean()))
    from scipy import stats as scipy_stats  # scipy is a dependency of the bootstrap already

    result = scipy_stats.ttest_ind(a, b, equal_var=False)
    low, high = result.confidence_interval(confidence_level=confidence)
    return Interval(float(a.mean() - b.mean()), float(low), float(high))


# ------------------------------------------------------------------------------------------------ step metrics
def finite(values) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def median_or_none(values) -> float | None:
    kept = finite(values)
    return float(np.median(kept)) if kept else None


def mean_or_none(values) -> float | None:
    kept = finite(values)
    return float(np.mean(kept)) if kept else None


def worst_arrival(betas) -> float | None:
    """The arrival fraction farthest from 1 (the probe accepts 1/2 ≤ β ≤ 3/2 around the ideal 1)."""
    kept = finite(betas)
    return max(kept, key=lambda beta: abs(beta - 1.0)) if kept else None
