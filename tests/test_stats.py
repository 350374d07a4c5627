"""Intervals for evaluation figures, against values worked out by hand."""

import math

import pytest

from omni_rl.algorithms.stats import above_baseline, binomial_interval, mean_interval, paired_gain


def test_wilson_interval_by_hand():
    # 50 of 200, z = 1.96: centre (0.25 + 3.8416/400) / (1 + 3.8416/200) = 0.254711,
    # half-width 1.96 * sqrt(0.25 * 0.75 / 200 + 3.8416 / 160000) / 1.019208 = 0.059632
    assert binomial_interval(50, 200) == pytest.approx((0.195079, 0.314343), abs=1e-5)
    assert binomial_interval(0, 200)[0] == 0.0 and binomial_interval(200, 200)[1] == 1.0
    assert binomial_interval(0, 200)[1] == pytest.approx(3.8416 / 203.8416, abs=1e-6)  # (z^2/n) / (1 + z^2/n)


def test_paired_gain_is_the_normal_interval_of_the_differences():
    before, after = [0, 0, 1, 1], [1, 1, 1, 0]  # differences 1, 1, 0, -1: mean 0.25
    sd = math.sqrt(((0.75**2) * 2 + 0.25**2 + 1.25**2) / 3)  # sample sd, 0.957
    mean, low, high = paired_gain(before, after)
    assert mean == 0.25
    assert (low, high) == pytest.approx((0.25 - 1.96 * sd / 2, 0.25 + 1.96 * sd / 2))
    # the same items unchanged: no spread, a zero-width interval
    assert paired_gain([1, 0, 1], [1, 0, 1]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired_gain([1], [1, 0])


def test_mean_interval_by_hand():
    # 0.2, 0.4, 0.9: mean 0.5, sample sd sqrt((0.09 + 0.01 + 0.16) / 2) = 0.360555
    low, high = mean_interval([0.2, 0.4, 0.9])
    half = 1.96 * 0.360555 / math.sqrt(3)
    assert (low, high) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-5)
    assert mean_interval([0.3]) == (0.3, 0.3) and mean_interval([]) == (0.0, 0.0)


def test_scores_above_a_baseline_are_zero_at_it_and_one_when_right():
    assert above_baseline(0.25, 0.25) == 0.0 and above_baseline(1.0, 0.25) == 1.0
    assert above_baseline(0.0, 0.5) == -1.0 and above_baseline(0.6, 0.2) == pytest.approx(0.5)
    # a grounding IoU of 0.64 against the best constant span's 0.28: half-way to right
    assert above_baseline(0.64, 0.28) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="baseline must be in \\[0, 1\\)"):
        above_baseline(1.0, 1.0)
