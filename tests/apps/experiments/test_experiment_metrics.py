"""Experiment metrics on hand-computed series."""

from __future__ import annotations

import math

import pytest

from apps.experiments.metrics import (PhaseMetrics, detect_collapse, moving_average, phase_area, phase_bounds,
                                      phase_level, phase_metrics, post_switch_mean, realign_lag, style_shares)


def test_moving_average_is_trailing_and_partial_at_the_start():
    assert moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    assert moving_average([1, 2, 3], 5) == [1, 1.5, 2]
    assert moving_average([], 3) == []
    with pytest.raises(ValueError):
        moving_average([1.0], 0)


def test_phase_bounds_cut_at_the_next_phase_and_the_end():
    assert phase_bounds([0, 4, 8], 12) == [(0, 4), (4, 8), (8, 12)]
    assert phase_bounds([0, 4, 8], 6) == [(0, 4), (4, 6), (6, 6)]
    with pytest.raises(ValueError):
        phase_bounds([1, 4], 10)


def test_level_is_the_mean_of_the_phases_last_quarter():
    rewards = [0.0] * 6 + [0.2, 0.4] + [1.0] * 4
    assert phase_level(rewards, 0, 8) == pytest.approx(0.3)  # last 2 of 8: 0.2, 0.4
    assert phase_level(rewards, 8, 12) == 1.0  # last 1 of 4
    assert phase_level(rewards, 0, 3) == 0.0  # at least one rollout
    assert phase_level(rewards, 3, 8) == pytest.approx(0.3)  # a quarter of 5 rounds up to 2: 0.2, 0.4
    assert phase_level(rewards, 12, 20) is None


def test_realign_lag_counts_to_an_absolute_threshold_with_in_phase_windows():
    # phase [4, 10); windows of 2 end at 5..9 with means 0.1, 0.3, 0.45, 0.6, 0.9 -> 0.5 first at rollout 8.
    rewards = [0.9] * 4 + [0.0, 0.2, 0.4, 0.5, 0.7, 1.0]
    assert realign_lag(rewards, 4, 10, window=2, threshold=0.5) == 5  # 8 - 4 + 1
    assert realign_lag(rewards, 4, 10, window=2, threshold=0.95) is None
    assert realign_lag(rewards, 4, 8, window=2, threshold=0.5) is None  # the phase ends first
    # The pre-switch rollouts (0.9) never count: the first window is all inside the phase.
    assert realign_lag(rewards, 4, 10, window=1, threshold=0.15) == 2


def test_an_arm_that_never_learned_does_not_realign_by_default():
    """The old lag compared with the arm's own pre-switch level; a flat low arm "recovered" at once."""
    flat = [0.1] * 20
    assert realign_lag(flat, 10, 20, window=4, threshold=0.5) is None


def test_area_is_the_phases_mean_reward_and_post_switch_mean_starts_at_the_first_switch():
    rewards = [0.0, 1.0, 0.5, 0.5, 1.0, 1.0]
    assert phase_area(rewards, 0, 2) == 0.5 and phase_area(rewards, 2, 6) == 0.75
    assert phase_area(rewards, 6, 9) is None
    assert post_switch_mean(rewards, 2) == 0.75 and post_switch_mean(rewards, 6) is None


def test_phase_metrics_of_every_phase():
    rewards = [0.0, 0.0, 1.0, 1.0] + [0.0, 0.0, 0.0, 0.0] + [1.0, 1.0]
    assert phase_metrics(rewards, [0, 4, 8], ["cute", "archaic", "formal"], 2, 0.5) == [
        PhaseMetrics(0, 4, "cute", 1.0, 3, 0.5), PhaseMetrics(4, 8, "archaic", 0.0, None, 0.0),
        PhaseMetrics(8, 10, "formal", 1.0, 2, 1.0)]
    with pytest.raises(ValueError):
        phase_metrics(rewards, [0, 4], ["cute"], 2, 0.5)


def test_style_shares_per_block():
    sampled = ["cute", "cute", "formal", None, "cute"]
    assert style_shares(sampled, ["cute", "formal"], 2) == [{"cute": 1.0, "formal": 0.0},
                                                            {"cute": 0.0, "formal": 0.5},
                                                            {"cute": 1.0, "formal": 0.0}]
    with pytest.raises(ValueError):
        style_shares(sampled, ["cute"], 0)


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
