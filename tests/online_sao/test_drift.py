import math

import pytest

from online_sao.drift import DriftSettings, RewardDropDetector, mean_shift


def test_mean_shift_literals():
    # reference [1, 1, 0, 0]: mean 0.5, sample variance 4 * 0.25 / 3 = 1/3; recent [0, 0]: mean 0, variance 0
    # se = sqrt((1/3) / 4) = sqrt(1/12); drop 0.5; z = 0.5 * sqrt(12) = sqrt(3)
    drop, z = mean_shift([1.0, 1.0, 0.0, 0.0], [0.0, 0.0])
    assert drop == pytest.approx(0.5) and z == pytest.approx(math.sqrt(3))
    # means 0.7 and 0.1, each variance 2 * 0.1^2 / 1 = 0.02: se = sqrt(0.01 + 0.01) = 0.141421; z = 0.6 / se
    drop, z = mean_shift([0.8, 0.6], [0.2, 0.0])
    assert drop == pytest.approx(0.6) and z == pytest.approx(4.242641, abs=1e-6)
    # a rise is a negative drop
    assert mean_shift([0.2, 0.0], [0.8, 0.6])[0] == pytest.approx(-0.6)


def test_mean_shift_needs_two_rewards_per_window():
    with pytest.raises(ValueError, match="at least 2"):
        mean_shift([1.0], [0.0, 0.0])


def detector(recent=2, reference=2, min_drop=0.5, z=4.0):
    return RewardDropDetector(DriftSettings(recent=recent, reference=reference, min_drop=min_drop, z_threshold=z))


def test_alarm_clears_history_and_keeps_the_step_rewards_after_the_change():
    d = detector()
    alarm, metrics = d.observe([0.8, 0.6, 0.2, 0.0, 0.3])  # z = 4.24 >= 4 and drop 0.6 >= 0.5 at the 4th reward
    assert alarm and metrics["drift_alarm"] == 1.0
    assert metrics["drift_drop"] == pytest.approx(0.6) and metrics["drift_z"] == pytest.approx(4.242641, abs=1e-6)
    assert list(d.history) == [0.3]
    # the next alarm needs full windows of new rewards: three more are not enough
    alarm, metrics = d.observe([0.3, 0.3])
    assert not alarm and math.isnan(metrics["drift_z"])


def test_an_alarm_counts_the_step_rewards_after_it_even_those_the_history_cannot_hold():
    d = detector()  # the history holds reference + recent = 4 rewards
    alarm, _ = d.observe([1.0, 1.0, 0.0, 0.0] + [0.0] * 6)  # the alarm at the 4th reward, then 6 more
    assert alarm and d.rewards_after_alarm == 6
    assert list(d.history) == [0.0] * 4  # only the newest 4 of the 6 kept
    assert not d.observe([0.0])[0] and d.rewards_after_alarm == 0  # no alarm: none after one


def test_no_alarm_below_either_threshold_or_on_a_rise():
    # z = sqrt(3) < 4 although the drop is 0.5
    assert not detector(recent=2, reference=4).observe([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])[0]
    # constant windows: se 0 -> floor, z huge, but the drop 0.2 < min_drop 0.25
    assert not detector(min_drop=0.25).observe([0.3, 0.3, 0.1, 0.1])[0]
    # the same windows with a drop of 1: alarm (no division by zero)
    assert detector().observe([1.0, 1.0, 0.0, 0.0])[0]
    # a rise never alarms
    assert not detector().observe([0.0, 0.0, 1.0, 1.0])[0]


def test_no_test_before_both_windows_are_full():
    d = detector()
    alarm, metrics = d.observe([1.0, 1.0, 0.0])
    assert not alarm and math.isnan(metrics["drift_drop"])


def test_state_round_trip():
    d = detector()
    d.observe([0.8, 0.6, 0.2])
    restored = detector()
    restored.load_state_dict(d.state_dict())
    assert restored.observe([0.0])[0]
