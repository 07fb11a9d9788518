"""Experiment metrics on hand-computed series."""

from __future__ import annotations

import math

import pytest

from apps.experiments.metrics import (SwitchMetrics, adaptation_lag, detect_collapse, level_reached,
                                            moving_average, pre_switch_level, switch_metrics)


def test_moving_average_is_trailing_and_partial_at_the_start():
    assert moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    assert moving_average([1, 2, 3], 5) == [1, 1.5, 2]
    assert moving_average([], 3) == []
    with pytest.raises(ValueError):
        moving_average([1.0], 0)


REWARDS = [1, 1, 1, 1, 0, 0, 0.5, 1, 1, 1]


def test_lag_counts_rollouts_until_a_full_post_switch_window_recovers():
    # pre = mean(1, 1) = 1, target 0.9; post-switch windows of 2 end at rollouts 5, 6, 7, 8
    # with means 0, 0.25, 0.75, 1 -> recovered at rollout 8: 8 - 4 + 1 = 5 rollouts.
    assert pre_switch_level(REWARDS, 4, 2) == 1
    assert adaptation_lag(REWARDS, 4, 2) == 5
    assert adaptation_lag(REWARDS, 4, 2, recover=0.7) == 4  # 0.75 >= 0.7 at rollout 7
    assert adaptation_lag(REWARDS, 4, 2, end=8) is None  # the phase ends first
    assert level_reached(REWARDS, 4, 2) == 1
    assert level_reached(REWARDS, 4, 2, end=8) == 0.75
    assert level_reached(REWARDS, 4, 2, end=4) is None


def test_pre_switch_level_uses_what_there_is_and_checks_the_switch():
    assert pre_switch_level([0.2, 0.4, 1.0], 2, 5) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        pre_switch_level([0.2, 0.4], 0, 2)


def test_a_level_of_zero_is_recovered_by_any_full_window():
    assert adaptation_lag([0, 0, 0.1, 0.1], 2, 1) == 1


def test_switch_metrics_end_each_phase_at_the_next_switch():
    rewards = [0.8] * 4 + [0.0, 0.4, 0.8, 0.8] + [0.2] * 4
    # Switch 4: windows 0.2, 0.6, 0.8 -> lag 4, level mean(0.8, 0.8). Switch 8: pre 0.8, never back.
    assert switch_metrics(rewards, [4, 8], 2) == [SwitchMetrics(4, pytest.approx(0.8), 4, pytest.approx(0.8)),
                                                  SwitchMetrics(8, pytest.approx(0.8), None, pytest.approx(0.2))]
    beyond = switch_metrics(rewards, [4, 20], 2)[1]
    assert beyond.lag is None and beyond.level is None and math.isnan(beyond.pre_level)


def test_collapse_when_quality_stays_low_to_the_end():
    quality = [1] * 6 + [0.2] * 4
    # moving (W=2): 1 x6, 0.6, 0.2, 0.2, 0.2; floor 0.5 x 1 -> below from rollout 7, for 3 >= 2 rollouts.
    result = detect_collapse([0.5] * 10, quality, window=2, fraction=0.5)
    assert result.collapsed and result.at_rollout == 7


def test_no_collapse_when_quality_recovers_or_the_dip_is_shorter_than_a_window():
    assert not detect_collapse([0.5] * 10, [1] * 6 + [0.2, 0.2, 1, 1], 2, 0.5).collapsed
    assert not detect_collapse([0.5] * 10, [1] * 8 + [0.2, 0.2], 2, 0.5).collapsed  # only rollout 9 below
    # A reward drop with good answers (a style switch) is not a collapse.
    assert not detect_collapse([1] * 5 + [0] * 5, [1] * 10, 2, 0.5).collapsed


def test_collapse_on_a_non_finite_value_and_too_short_runs():
    result = detect_collapse([0.5, 0.5, 0.5, math.nan, 0.5], [1] * 5, 2, 0.5)
    assert result.collapsed and result.at_rollout == 3
    assert detect_collapse([0.5] * 5, [1, 1, 1, 1, math.inf], 2, 0.5).at_rollout == 4
    short = detect_collapse([0.5] * 3, [0.0] * 3, 2, 0.5)
    assert not short.collapsed and "too short" in short.reason
    with pytest.raises(ValueError):
        detect_collapse([0.5] * 3, [1.0] * 2, 2, 0.5)
