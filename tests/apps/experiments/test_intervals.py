"""Across-seed intervals on numbers worked out by hand (the exact bootstrap of the mean)."""

from __future__ import annotations

import numpy as np
import pytest

from apps.experiments.intervals import Interval, bootstrap_band, cell, interval


def test_five_seeds_with_one_success():
    # Resampled means of [0, 0, 0, 0, 1]: k successes of 5 draws with p = 1/5.
    # P(0) = 0.8^5 = 0.328 >= 0.025 -> low 0. P(k >= 4) = 5 * 0.2^4 * 0.8 + 0.2^5 = 0.00672 < 0.025 but
    # P(k >= 3) = 0.05792 >= 0.025 -> high 3/5.
    assert interval([0, 0, 0, 0, 1]) == Interval(mean=0.2, low=0.0, high=pytest.approx(0.6), n=5)


def test_small_cases():
    assert interval([0, 1]) == Interval(0.5, 0.0, 1.0, 2)  # means 0, .5, .5, 1
    # [1, 2, 3]: each extreme mean has probability 1/27 = 0.037 >= 0.025, so the interval spans them.
    assert interval([1, 2, 3]) == Interval(2.0, 1.0, 3.0, 3)
    assert interval([0.4]) == Interval(0.4, 0.4, 0.4, 1)
    assert interval([0.3, 0.3, 0.3]) == Interval(pytest.approx(0.3), pytest.approx(0.3), pytest.approx(0.3), 3)


def test_missing_values_are_left_out_and_counted():
    assert interval([None, 2.0, float("nan")]) == Interval(2.0, 2.0, 2.0, 1)
    assert interval([None, None]) is None


def test_a_cell_says_when_fewer_seeds_gave_a_value_than_it_should_cover():
    three = Interval(0.75, 0.7, 0.8, 3)
    assert cell(three, of=4) == "0.750 [0.700, 0.800] (3 of 4 seeds)"
    assert cell(three, of=3) == cell(three) == "0.750 [0.700, 0.800]"
    assert cell(Interval(-0.5, -0.5, -0.5, 1), signed=True, of=2) == "-0.500 (1 of 2 seeds)"


def test_many_seeds_are_drawn_and_stay_inside_the_data():
    values = list(range(8))  # 8^8 resamples: drawn, seeded
    first, again = interval(values), interval(values)
    assert first == again and first.mean == 3.5
    assert 0 < first.low < 3.5 < first.high < 7


def test_pointwise_band_and_apart():
    low, high = bootstrap_band(np.array([[0.0, 1.0], [1.0, 1.0]]))
    assert low.tolist() == [0.0, 1.0] and high.tolist() == [1.0, 1.0]
    assert Interval(0.6, 0.5, 0.7, 5).apart_from(Interval(0.3, 0.2, 0.4, 5))
    assert not Interval(0.6, 0.35, 0.7, 5).apart_from(Interval(0.3, 0.2, 0.4, 5))
    with pytest.raises(ValueError):
        bootstrap_band(np.zeros((0, 3)))


def test_a_long_band_equals_the_plain_enumeration_at_every_point():
    # 3 seeds, 150 points (ten blocks of BAND_COLUMNS): against every one of the 27 resamples' means
    import itertools

    values = np.random.default_rng(1).random((3, 150))
    means = np.array([values[list(r)].mean(axis=0) for r in itertools.product(range(3), repeat=3)])
    ordered = np.sort(means, axis=0)
    # the inverted CDF's 2.5% and 97.5% quantiles of 27 equally likely means: the 1st and the 27th
    low, high = bootstrap_band(values)
    np.testing.assert_array_equal(low, ordered[0])
    np.testing.assert_array_equal(high, ordered[26])
    low, high = bootstrap_band(np.array([[np.inf], [2.0], [3.0]]))  # an infinite value stays one
    assert (low[0], high[0]) == (2.0, np.inf)
