"""The drift diagnostics' measures on hand-built rollouts and steps."""

from __future__ import annotations

import math

import pytest

from apps.config import ExperimentConfig
from apps.experiments.aggregate import Run
from apps.experiments.results import ArmResults, RewardRow, StepRow
from benchmarks.drift_diagnostics import (_over_seeds, critic_squared_error, detection_delay, phase_windows, report,
                                          restart_context, restarts, rollbacks, running_mean_squared_error, share_of,
                                          step_median)


def _step(rollout: int, **metrics: float) -> StepRow:
    return StepRow(step=rollout + 1, rollout=rollout, version=rollout + 1, metrics=metrics)


def test_share_of_counts_the_style_among_sampled_answers():
    assert share_of(["cute", "formal", None, "cute"], "cute") == 0.5
    assert share_of(["terse"], "cute") == 0.0
    assert share_of([], "cute") is None


def test_windows_of_a_later_phase_start_before_its_switch():
    assert phase_windows(0, 100, first=True) == [("first quarter", 0, 25), ("last quarter", 75, 100)]
    assert phase_windows(150, 300, first=False) == [("50 before", 100, 150), ("first quarter", 150, 187),
                                                    ("last quarter", 263, 300)]


def test_step_median_keeps_the_phase_and_skips_undefined_values():
    # a step's rollout is how many were judged when it ran: phase [10, 20) holds the steps at 11 to 20
    steps = [_step(10, explained_variance=0.9), _step(11, explained_variance=0.1), _step(13, explained_variance=0.3),
             _step(15, explained_variance=math.nan), _step(20, explained_variance=-1.0), _step(21, explained_variance=5.0),
             _step(12, approx_kl=0.2)]
    assert step_median(steps, "explained_variance", 10, 20) == 0.1  # median of 0.1, 0.3, -1.0
    assert step_median(steps, "approx_kl", 0, 10) is None


def test_restarts_and_the_delay_after_each_switch():
    steps = [_step(5, drift_alarm=0.0), _step(118, drift_alarm=1.0), _step(130), _step(170, drift_alarm=1.0)]
    alarms = restarts(steps)
    assert alarms == [118, 170]
    assert detection_delay(alarms, 100, 150) == 18  # the first restart of the phase [100, 150)
    assert detection_delay(alarms, 150, 200) == 20
    assert detection_delay(alarms, 200, 300) is None
    # a restart after exactly 170 rollouts saw none of a phase starting at 170 (it read as a delay of 0),
    # and all of the phase ending there
    assert detection_delay(alarms, 170, 300) is None and detection_delay(alarms, 120, 170) == 50


def test_rollbacks_are_not_restarts_and_each_probation_has_its_outcome():
    nan = math.nan
    steps = [_step(40, drift_alarm=1.0, drift_rollback=1.0), _step(44, drift_probation_z=0.5),      # held
             _step(90, drift_alarm=1.0, drift_rollback=1.0), _step(96, drift_probation_z=nan),
             _step(110, drift_alarm=1.0, drift_probation_z=5.0),                                    # restarted
             _step(200, drift_alarm=1.0, drift_rollback=1.0), _step(204)]                           # open
    assert restarts(steps) == [110]
    assert rollbacks(steps) == [(40, "held"), (90, "restarted"), (200, "open")]


def _reward(rollout: int, reward: float, delivered: bool = True) -> RewardRow:
    return RewardRow(rollout=rollout, t=float(rollout), version=0, reward=reward, quality=0.0, style=0.0,
                     preferred="cute", delivered=delivered)


def test_running_mean_error_uses_the_delivered_rewards_before_each():
    rewards = [_reward(0, 1.0), _reward(1, 0.0), _reward(2, 5.0, delivered=False), _reward(3, 1.0), _reward(4, 0.0)]
    # window 2 over the delivered 1, 0, 1, 0: rollout 1 -> (0 - 1)^2 = 1; 3 -> (1 - 0.5)^2 = 0.25;
    # 4 -> (0 - 0.5)^2 = 0.25 (the mean of 0 and 1); rollout 0 has none before it; 2 was not delivered
    assert running_mean_squared_error(rewards, 0, 5, window=2) == pytest.approx(1.5 / 3)
    assert running_mean_squared_error(rewards, 3, 5, window=2) == pytest.approx(0.25)
    assert running_mean_squared_error(rewards, 3, 4, window=1) == pytest.approx(1.0)  # (1 - 0)^2
    assert running_mean_squared_error(rewards, 0, 1, window=2) is None


def test_the_per_rater_running_mean_uses_only_the_same_raters_rewards():
    rows = [RewardRow(rollout=i, t=float(i), version=0, reward=r * g, rater_scale=g, quality=0.0, style=0.0,
                      preferred="cute") for i, (r, g) in enumerate([(1.0, 1.5), (1.0, 0.5), (1.0, 1.5), (0.0, 0.5)])]
    # rewards 1.5, 0.5, 1.5, 0.0. Per rater: rollout 2 -> (1.5 - 1.5)^2 = 0, rollout 3 -> (0 - 0.5)^2 = 0.25;
    # rollouts 0 and 1 have no earlier reward of their raters.
    assert running_mean_squared_error(rows, 0, 4, by_rater=True) == pytest.approx(0.125)
    # all together: rollout 1 -> (0.5 - 1.5)^2 = 1, 2 -> (1.5 - 1)^2 = 0.25, 3 -> (0 - 3.5 / 3)^2
    assert running_mean_squared_error(rows, 0, 4) == pytest.approx((1 + 0.25 + (3.5 / 3) ** 2) / 3)


def test_the_per_rater_running_mean_tells_shifted_raters_apart():
    rows = [RewardRow(rollout=i, t=float(i), version=0, reward=r + b, rater_offset=b, quality=0.0, style=0.0,
                      preferred="cute") for i, (r, b) in enumerate([(0.5, 0.5), (0.5, -0.5), (0.5, 0.5), (0.5, -0.5)])]
    # every value 0.5: per rater the mean is exact after each group's first reward
    assert running_mean_squared_error(rows, 0, 4, by_rater=True) == pytest.approx(0.0)
    # all together: rollout 1 -> (0 - 1)^2 = 1, 2 -> (1 - 0.5)^2 = 0.25, 3 -> (0 - 2 / 3)^2
    assert running_mean_squared_error(rows, 0, 4) == pytest.approx((1 + 0.25 + (2 / 3) ** 2) / 3)


def test_critic_error_is_the_mean_value_loss_of_the_phase_steps():
    steps = [_step(2, value_loss=0.5), _step(4, value_loss=0.1), _step(6, value_loss=math.nan), _step(9, approx_kl=1.0)]
    assert critic_squared_error(steps, 0, 10) == pytest.approx(0.3)
    assert critic_squared_error(steps, 5, 10) is None


def test_the_adjusted_values_error_is_read_from_its_own_metric():
    steps = [_step(2, value_loss=0.5, value_loss_adjusted=0.2), _step(4, value_loss=0.1, value_loss_adjusted=0.4)]
    assert critic_squared_error(steps, 0, 10, "value_loss_adjusted") == pytest.approx(0.3)
    assert critic_squared_error([_step(2, value_loss=0.5)], 0, 10, "value_loss_adjusted") is None


def test_the_report_adds_the_adjusted_rows_only_for_an_arm_that_has_them(tmp_path):
    schedule = [{"from_rollout": 0, "style": "cute"}, {"from_rollout": 4, "style": "archaic"},
                {"from_rollout": 8, "style": "formal"}]
    scenario = ExperimentConfig(schedule=schedule, rollouts_per_arm=12, arms=[{"name": "plain"}, {"name": "levelled"}])
    rewards = [_reward(k, float(k % 2)) for k in range(12)]
    plain = ArmResults(name="plain", rewards=rewards, evals=[], steps=[_step(3, value_loss=0.2)])
    levelled = ArmResults(name="levelled", rewards=rewards, evals=[],
                          steps=[_step(3, value_loss=0.2, value_loss_adjusted=0.1)])
    text = report([Run(tmp_path, scenario, {"plain": plain, "levelled": levelled})])
    assert "| levelled | adjusted values' squared error |" in text
    assert "| plain | adjusted values' squared error |" not in text
    assert text.count("running-mean squared error") == 2  # once per arm, from the critic's rows


def test_the_report_sets_the_first_and_last_token_errors_against_the_running_mean(tmp_path):
    schedule = [{"from_rollout": 0, "style": "cute"}, {"from_rollout": 4, "style": "archaic"},
                {"from_rollout": 8, "style": "formal"}]
    scenario = ExperimentConfig(schedule=schedule, rollouts_per_arm=12, arms=[{"name": "sao"}])
    # rewards 0, 1, 0, 1, ... delivered in order: in the second phase (rollouts 4-7) the means before
    # rollouts 4, 5, 6, 7 are 1/2, 2/5, 1/2, 3/7, so the running mean's squared errors are
    # (0 - 1/2)^2, (1 - 2/5)^2, (0 - 1/2)^2, (1 - 3/7)^2 = 1/4, 9/25, 1/4, 16/49
    rewards = [_reward(k, float(k % 2)) for k in range(12)]
    steps = [_step(5, value_loss=0.2, value_loss_first=0.25, value_loss_last=0.05)]
    text = report([Run(tmp_path, scenario, {"sao": ArmResults(name="sao", rewards=rewards, evals=[], steps=steps)})])
    mean_error = (1 / 4 + 9 / 25 + 1 / 4 + 16 / 49) / 4
    last = next(line for line in text.splitlines() if "ratio last token / mean" in line).split("|")
    assert last[4].strip().startswith(f"{0.05 / mean_error:.3f}")  # the archaic phase's cell
    first = next(line for line in text.splitlines() if "critic squared error, first answer token" in line)
    assert first.split("|")[4].strip().startswith("0.250")


def _answer(rollout: int, reward: float, quality: float, sampled: str, delivered: bool = True) -> RewardRow:
    return RewardRow(rollout=rollout, t=float(rollout), version=0, reward=reward, quality=quality, style=0.0,
                     preferred="cute", sampled_style=sampled, delivered=delivered)


def test_restart_context_reads_the_reference_and_recent_windows():
    # a restart after 100 rollouts were judged: reference [36, 84), recent [84, 100); rollout 100 came after it
    rewards = [_answer(40, 0.8, 1.0, "cute"), _answer(60, 0.6, 0.8, "formal"),
               _answer(50, 9.0, 9.0, "cute", delivered=False),  # not delivered: left out
               _answer(35, 9.0, 9.0, "cute"),                    # before the reference window
               _answer(90, 0.1, 0.2, "cute"), _answer(99, 0.3, 0.4, "cute"), _answer(100, 9.0, 9.0, "cute")]
    before, recent = restart_context(rewards, 100)
    assert before == pytest.approx((0.7, 0.9, 0.5))
    assert recent == pytest.approx((0.2, 0.3, 1.0))
    assert restart_context(rewards, 30) is None  # nothing in its recent window [14, 30)


def test_a_restart_inside_a_phase_is_listed_under_its_seed_number(tmp_path):
    schedule = [{"from_rollout": 0, "style": "cute"}, {"from_rollout": 200, "style": "archaic"},
                {"from_rollout": 250, "style": "formal"}]
    # seeds 12 and 15: the table names them, not their places (0 and 1) in the list of runs
    runs = []
    for seed, alarm_at in ((12, 100), (15, 150)):
        scenario = ExperimentConfig(schedule=schedule, rollouts_per_arm=300, arms=[{"name": "sao"}], seed=seed)
        # the alarm came after alarm_at rollouts were judged: the recent window is the 16 before it
        rewards = [_answer(k, 0.8 if k < alarm_at - 16 else 0.2, 0.9, "cute") for k in range(300)]
        steps = [_step(alarm_at, drift_alarm=1.0)]
        runs.append(Run(tmp_path / f"seed-{seed}", scenario,
                        {"sao": ArmResults(name="sao", rewards=rewards, evals=[], steps=steps)}))
    lines = report(runs).splitlines()
    assert "| sao | 12 | 100 | 0.80 -> 0.20 | 0.90 -> 0.90 | 1.00 -> 1.00 |" in lines
    assert "| sao | 15 | 150 | 0.80 -> 0.20 | 0.90 -> 0.90 | 1.00 -> 1.00 |" in lines


def test_a_cell_over_seeds_says_how_many_seeds_gave_a_value():
    """Seeds without a value were dropped from the mean without a word."""
    assert _over_seeds([0.2, None, 0.8]) == "0.500 [0.200, 0.800] (2 of 3 seeds)"
    assert _over_seeds([0.2, 0.8]) == "0.500 [0.200, 0.800]"
