"""Eval statistics against hand-computed values."""

import pytest

from epirl.eval.stats import (
    bootstrap_interval,
    mcnemar_exact_p,
    paired_comparison,
    pass_at_k,
    summarize_correctness,
    wilson_interval,
)


def test_wilson_interval_hand_values():
    # p = 0.8, n = 10, z = 1.96: centre 0.99207/1.38415 = 0.71674, half-width 0.31362/1.38415 = 0.22658
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.49016, abs=1e-4) and high == pytest.approx(0.94332, abs=1e-4)
    # zero successes: the lower end is 0, the upper end z²/(n + z²) = 3.8415/13.8415
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(3.841459 / 13.841459, abs=1e-6)
    low, high = wilson_interval(10, 10)
    assert high == pytest.approx(1.0) and low == pytest.approx(10 / 13.841459, abs=1e-6)


def test_wilson_interval_matches_published_values():
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Statistics in Medicine 17,
    # 857-872: the worked examples' score intervals without continuity correction (method 3), to 4 decimals
    published = {(81, 263): (0.2553, 0.3662), (15, 148): (0.0624, 0.1605), (0, 20): (0.0, 0.1611),
                 (1, 29): (0.0061, 0.1718)}
    for (successes, trials), (low, high) in published.items():
        got = wilson_interval(successes, trials)
        assert got == pytest.approx((low, high), abs=5e-5), (successes, trials, got)


def test_wilson_interval_rejects_bad_counts():
    with pytest.raises(ValueError):
        wilson_interval(3, 0)
    with pytest.raises(ValueError):
        wilson_interval(5, 4)


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # fewer wrong samples than k
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # pass@1 = c/n
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_mcnemar_exact_hand_values():
    assert mcnemar_exact_p(1, 7) == pytest.approx(2 * (1 + 8) / 256)  # 0.0703125
    assert mcnemar_exact_p(7, 1) == pytest.approx(2 * (1 + 8) / 256)  # symmetric
    assert mcnemar_exact_p(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_exact_p(3, 3) == 1.0  # 2 * 42/64 > 1, capped
    assert mcnemar_exact_p(0, 0) == 1.0  # no discordant pairs: no evidence


def test_paired_comparison_hand_values():
    a = [1, 1, 0, 0, 1, 0, 1, 0, 1, 1]
    b = [1, 0, 1, 1, 1, 1, 1, 0, 1, 1]
    result = paired_comparison([bool(x) for x in a], [bool(x) for x in b])
    assert (result["both_correct"], result["only_a_correct"], result["only_b_correct"], result["neither_correct"]) == (5, 1, 3, 1)
    assert result["accuracy_a"] == pytest.approx(0.6) and result["accuracy_b"] == pytest.approx(0.8)
    assert result["diff"] == pytest.approx(0.2)
    # Var = ((b + c) - (c - b)^2 / n) / n^2 = (4 - 0.4) / 100 = 0.036
    half_width = 1.959964 * 0.036**0.5
    assert result["diff_ci95_low"] == pytest.approx(0.2 - half_width, abs=1e-5)
    assert result["diff_ci95_high"] == pytest.approx(0.2 + half_width, abs=1e-5)
    assert result["mcnemar_p"] == pytest.approx(10 / 16)  # 2 * (1 + 4) / 16
    with pytest.raises(ValueError):
        paired_comparison([True], [True, False])


def test_summarize_single_sample_uses_wilson():
    correct = [[True]] * 8 + [[False]] * 2
    summary = summarize_correctness(correct)
    assert summary["accuracy"] == pytest.approx(0.8) and summary["samples"] == 1
    assert summary["ci_method"] == "wilson"
    assert summary["ci95_low"] == pytest.approx(0.49016, abs=1e-4)
    assert summary["pass@1"] == pytest.approx(0.8)


def test_summarize_k_samples_avg_and_pass():
    correct = [[True, False], [True, True], [False, False]]
    summary = summarize_correctness(correct)
    assert summary["avg@2"] == pytest.approx(0.5)  # (0.5 + 1 + 0) / 3
    assert summary["pass@2"] == pytest.approx(2 / 3)
    assert summary["ci_method"] == "bootstrap"
    assert 0.0 <= summary["ci95_low"] <= 0.5 <= summary["ci95_high"] <= 1.0
    with pytest.raises(ValueError, match="same number"):
        summarize_correctness([[True], [True, False]])


def test_bootstrap_interval_properties():
    values = [0.0, 0.25, 0.5, 1.0, 1.0, 0.0, 0.75, 0.5]
    low, high = bootstrap_interval(values, seed=3)
    assert (low, high) == bootstrap_interval(values, seed=3)  # seeded
    assert min(values) <= low < sum(values) / len(values) < high <= max(values)
    assert bootstrap_interval([0.5] * 6) == (0.5, 0.5)
    # a larger sample gives a narrower interval around the same mean
    wide = bootstrap_interval([0.0, 1.0] * 5)
    narrow = bootstrap_interval([0.0, 1.0] * 200)
    assert narrow[1] - narrow[0] < wide[1] - wide[0]
