"""Eval statistics: accuracy, pass@k / avg@k, 95% intervals, paired comparison with McNemar's exact test.

Conventions: ``correct`` is a per-problem list of per-sample verdicts (``correct[i][j]`` = sample j of
problem i is right). avg@k is the mean over all samples, which is also the unbiased pass@1 estimate.
Intervals: Wilson score for one sample per problem (binomial); with k > 1 samples the per-problem
scores are not Bernoulli, so a percentile bootstrap over problems is used instead.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Sequence

import numpy as np
from scipy import stats

Z_95 = float(stats.norm.ppf(0.975))  # standard normal quantile of a two-sided 95% interval


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (stays inside [0, 1], sane at 0 and n)."""
    if trials <= 0:
        raise ValueError("wilson_interval needs trials > 0")
    if not 0 <= successes <= trials:
        raise ValueError(f"wilson_interval: successes={successes} outside [0, {trials}]")
    interval = stats.binomtest(successes, trials).proportion_ci(confidence_level=confidence, method="wilson")
    return float(interval.low), float(interval.high)


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one problem from n samples with c correct (Chen et al. 2021): 1 - C(n-c,k)/C(n,k)."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k}, n={num_samples}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def percentile_bootstrap(samples: Sequence, statistic: Callable, resamples: int = 2000, confidence: float = 0.95,
                         seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of ``statistic(*samples, axis=-1)``, the samples' units (their last axis)
    resampled with replacement and together (paired): scipy.stats.bootstrap, seeded. The same seed and number of
    units draw the same resamples, so intervals of several statistics of the same units come from one set of
    resamples. Resamples where the statistic is undefined (NaN: a ratio whose denominator resampled to 0) are
    left out; both ends are NaN when no resample defines it."""
    arrays = tuple(np.asarray(sample, dtype=float) for sample in samples)
    if not arrays or arrays[0].shape[-1] == 0:
        raise ValueError("percentile_bootstrap needs at least one unit")
    if all(np.all(sample == sample[..., :1]) for sample in arrays):  # every resample equals the data: no rounding
        value = float(statistic(*arrays, axis=-1))
        return value, value
    with warnings.catch_warnings():  # NaN resamples make scipy warn and return NaN ends: handled below
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        result = stats.bootstrap(arrays, statistic, n_resamples=resamples, confidence_level=confidence,
                                 method="percentile", paired=True, vectorized=True, batch=1000,
                                 rng=np.random.default_rng(seed))
    low, high = result.confidence_interval
    if np.isnan(low) or np.isnan(high):
        defined = result.bootstrap_distribution[np.isfinite(result.bootstrap_distribution)]
        if defined.size == 0:
            return math.nan, math.nan
        tail = (1.0 - confidence) / 2
        low, high = np.quantile(defined, [tail, 1.0 - tail])
    return float(low), float(high)


def bootstrap_interval(
    per_problem: Sequence[float], resamples: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``per_problem`` (resampling problems)."""
    if not per_problem:
        raise ValueError("bootstrap_interval needs at least one value")
    return percentile_bootstrap((per_problem,), np.mean, resamples, level, seed)


def summarize_correctness(correct: Sequence[Sequence[bool]], seed: int = 0) -> dict[str, float]:
    """Accuracy metrics of one benchmark (or the pooled set) from per-problem per-sample verdicts."""
    if not correct:
        raise ValueError("summarize_correctness needs at least one problem")
    samples = {len(row) for row in correct}
    if len(samples) != 1 or 0 in samples:
        raise ValueError(f"every problem needs the same number (>= 1) of samples, got {sorted(samples)}")
    k = samples.pop()
    per_problem = [sum(row) / k for row in correct]
    accuracy = sum(per_problem) / len(per_problem)
    if k == 1:
        low, high = wilson_interval(sum(row[0] for row in correct), len(correct))
        method = "wilson"
    else:
        low, high = bootstrap_interval(per_problem, seed=seed)
        method = "bootstrap"
    return {
        "problems": len(correct),
        "samples": k,
        "accuracy": accuracy,  # = avg@k = unbiased pass@1
        f"avg@{k}": accuracy,
        f"pass@{k}": sum(pass_at_k(k, sum(row), k) for row in correct) / len(correct),
        "ci95_low": low,
        "ci95_high": high,
        "ci_method": method,
    }


def mcnemar_exact_p(only_a_correct: int, only_b_correct: int) -> float:
    """Two-sided exact McNemar p-value: the binomial test of the discordant pairs against 1/2.

    p = min(1, 2 · P[X <= min(b, c)]), X ~ Binomial(b + c, 1/2); 1.0 when there are no discordant pairs.
    """
    if only_a_correct < 0 or only_b_correct < 0:
        raise ValueError("discordant counts must be >= 0")
    discordant = only_a_correct + only_b_correct
    if discordant == 0:
        return 1.0
    return float(stats.binomtest(min(only_a_correct, only_b_correct), discordant, 0.5).pvalue)


def paired_comparison(correct_a: Sequence[bool], correct_b: Sequence[bool]) -> dict[str, float]:
    """Paired difference of two adapters on the same problems (one verdict each): the paper's Table 22 form.

    ``diff`` = acc_b - acc_a, its 95% Wald interval for paired proportions, the discordant counts and
    McNemar's exact p-value.
    """
    if len(correct_a) != len(correct_b) or not correct_a:
        raise ValueError(f"paired_comparison needs equal, non-empty lists (got {len(correct_a)} and {len(correct_b)})")
    n = len(correct_a)
    only_a = sum(1 for a, b in zip(correct_a, correct_b) if a and not b)
    only_b = sum(1 for a, b in zip(correct_a, correct_b) if b and not a)
    both = sum(1 for a, b in zip(correct_a, correct_b) if a and b)
    diff = (only_b - only_a) / n
    # Var of the paired difference of proportions: ((b + c) - (b - c)^2 / n) / n^2
    variance = max(0.0, (only_a + only_b) - (only_b - only_a) ** 2 / n) / (n * n)
    half_width = Z_95 * math.sqrt(variance)
    return {
        "problems": n,
        "accuracy_a": (both + only_a) / n,
        "accuracy_b": (both + only_b) / n,
        "diff": diff,
        "diff_ci95_low": diff - half_width,
        "diff_ci95_high": diff + half_width,
        "both_correct": both,
        "only_a_correct": only_a,
        "only_b_correct": only_b,
        "neither_correct": n - both - only_a - only_b,
        "mcnemar_p": mcnemar_exact_p(only_a, only_b),
    }
