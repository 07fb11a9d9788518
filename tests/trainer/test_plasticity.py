import pytest
import torch
from torch import nn

from online_sao.algorithm import Algorithm
from online_sao.algorithms import Optimizers
from online_sao.batch import Rollout
from online_sao.config import DriftConfig
from online_sao.config.reward import RewardConfig
from online_sao.schemas import Interaction, Reward
from trainer.rollouts import to_rollouts
from trainer.join import RewardJoiner
from trainer.plasticity import DriftResponse, shrink_towards
from trainer.state import Trainables


class ForgetfulRule(Algorithm):
    """Counts forget() calls; never trained here."""

    needs_critic = True

    def __init__(self) -> None:
        self.forgotten = 0

    def step(self, batch):
        raise AssertionError("not trained in these tests")

    def forget(self) -> None:
        self.forgotten += 1


def constant_linear(value: float) -> nn.Linear:
    layer = nn.Linear(2, 1)
    with torch.no_grad():
        layer.weight.fill_(value)
        layer.bias.fill_(value)
    return layer


def trainables(ema_reference: bool = False) -> Trainables:
    """Policy weights 1, critic -1; with ``ema_reference`` an EMA KL reference starting where the policy does."""
    policy, critic = constant_linear(1.0), constant_linear(-1.0)
    opts = Optimizers(torch.optim.AdamW(policy.parameters(), lr=0.1), torch.optim.AdamW(critic.parameters(), lr=0.1))
    return Trainables(policy, critic, opts, ForgetfulRule(), constant_linear(1.0) if ema_reference else None)


def fill(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def move(t: Trainables, to: float) -> None:
    """One optimiser step each (so their moments exist), then every weight set to ``to``."""
    for model, opt in ((t.policy, t.optimizers.policy), (t.critic, t.optimizers.critic)):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(to)


def test_shrink_towards_literal():
    model, start = constant_linear(3.0), [torch.full((1, 2), 1.0), torch.full((1,), 1.0)]
    shrink_towards(model, start, keep=0.25)  # 1 + 0.25 * (3 - 1) = 1.5
    assert torch.equal(model.weight, torch.full((1, 2), 1.5)) and torch.equal(model.bias, torch.full((1,), 1.5))


def settings(**overrides) -> DriftConfig:
    return DriftConfig(enabled=True, recent=2, reference=2, min_drop=0.5, z_threshold=4.0, **overrides)


def test_an_alarm_restarts_policy_critic_optimisers_and_the_rule():
    t = trainables()
    response = DriftResponse(settings(policy_shrink=0.5), t)
    move(t, 5.0)
    assert response.after_step([0.8, 0.6])["drift_alarm"] == 0.0
    assert torch.equal(t.policy.weight, torch.full((1, 2), 5.0))  # no alarm: nothing touched
    metrics = response.after_step([0.2, 0.0])
    assert metrics["drift_alarm"] == 1.0
    assert torch.equal(t.policy.weight, torch.full((1, 2), 3.0))  # 1 + 0.5 * (5 - 1)
    assert torch.equal(t.critic.weight, torch.full((1, 2), -1.0))  # its initial weights
    assert not t.optimizers.policy.state and not t.optimizers.critic.state
    assert t.algorithm.forgotten == 1


def test_critic_and_optimisers_kept_when_configured():
    t = trainables()
    response = DriftResponse(settings(reset_critic=False, reset_optimizers=False), t)
    move(t, 5.0)
    assert response.after_step([1.0, 1.0, 0.0, 0.0])["drift_alarm"] == 1.0
    assert torch.equal(t.policy.weight, torch.full((1, 2), 1.0))  # policy_shrink 0: the start
    assert torch.equal(t.critic.weight, torch.full((1, 2), 5.0))
    assert t.optimizers.policy.state and t.optimizers.critic.state


def test_a_restart_moves_the_ema_reference_as_it_moves_the_policy():
    """The reference is an EMA of the policy from the same start: left where it was, its KL term
    would pull the restarted policy back toward the old preference."""
    t = trainables(ema_reference=True)
    response = DriftResponse(settings(policy_shrink=0.5), t)
    move(t, 5.0)
    fill(t.ema_reference, 3.0)
    assert response.after_step([1.0, 1.0, 0.0, 0.0])["drift_alarm"] == 1.0
    assert torch.equal(t.policy.weight, torch.full((1, 2), 3.0))  # 1 + 0.5 * (5 - 1)
    assert torch.equal(t.ema_reference.weight, torch.full((1, 2), 2.0))  # 1 + 0.5 * (3 - 1)
    assert torch.equal(t.ema_reference.bias, torch.full((1,), 2.0))


def test_rewards_of_answers_sampled_by_a_far_older_version_are_left_out_of_the_test():
    """A replica held on v1 (an operator's hold) while the learner is at v40: its answers' low
    rewards are trained on but say nothing about the learner's policy, so they never alarm."""
    t = trainables()
    response = DriftResponse(settings(max_version_lag=32), t)
    move(t, 5.0)
    assert response.after_step([1.0, 1.0], [39, 40], next_version=41)["drift_stale_rewards"] == 0.0
    for _ in range(3):  # answers of v1 and v8: 40 and 33 versions behind v41
        metrics = response.after_step([0.0, 0.0], [1, 8], next_version=41)
        assert (metrics["drift_alarm"], metrics["drift_stale_rewards"]) == (0.0, 2.0)
    assert torch.equal(t.policy.weight, torch.full((1, 2), 5.0))
    # v9 is 32 behind: counted, with the v40 answer; the test's windows [1, 1] and [0, 0] fall: an alarm
    metrics = response.after_step([0.0, 0.3, 0.0], [9, 1, 40], next_version=41)
    assert (metrics["drift_alarm"], metrics["drift_stale_rewards"]) == (1.0, 1.0)
    assert torch.equal(t.policy.weight, torch.full((1, 2), 1.0))


def test_without_a_lag_bound_every_trained_reward_counts():
    t = trainables()
    response = DriftResponse(settings(max_version_lag=None), t)
    assert response.after_step([1.0, 1.0], [39, 40], next_version=41)["drift_alarm"] == 0.0
    metrics = response.after_step([0.0, 0.0], [1, 8], next_version=41)
    assert (metrics["drift_alarm"], metrics["drift_stale_rewards"]) == (1.0, 0.0)


def test_a_rollback_score_stays_aligned_with_the_rewards_left_in():
    """The score of a left-out answer leaves with it: the windows the score is tested on are those
    of the rewards the detector saw. The held answers (v1) carry quality 0; the learner's own
    (v39-v40) keep quality 1 while their reward falls: a preference change, so a restart."""
    t = trainables()
    response = DriftResponse(settings(rollback_first=True, rollback_score="quality"), t)
    move(t, 3.0)
    response.after_step([1.0, 1.0], [39, 39], next_version=41, scores=[1.0, 1.0])  # a snapshot to roll back to
    response.after_step([1.0, 0.0, 1.0], [39, 1, 39], next_version=41, scores=[1.0, 0.0, 1.0])
    metrics = response.after_step([0.0, 0.0, 0.0], [40, 1, 40], next_version=41, scores=[1.0, 0.0, 1.0])
    assert metrics["drift_alarm"] == 1.0 and metrics["drift_rollback"] == 0.0
    assert metrics["drift_score_drop"] == 0.0  # quality 1 in both windows: the held answers' 0 left out


def rolled_back_after_a_drop() -> tuple[Trainables, DriftResponse, dict[str, float]]:
    """Weights 2 after 2 rewards and 3 after 4 (snapshots at both), then a drop while at 4."""
    t = trainables()
    response = DriftResponse(settings(rollback_first=True), t)
    for weight in (2.0, 3.0):
        move(t, weight)
        assert response.after_step([1.0, 1.0], [1, 1], next_version=2)["drift_alarm"] == 0.0
    move(t, 4.0)
    return t, response, response.after_step([0.0, 0.0], [5, 5], next_version=7)


def test_rollback_first_restores_the_weights_from_before_the_reference_window():
    t, _, metrics = rolled_back_after_a_drop()
    assert metrics["drift_alarm"] == 1.0 and metrics["drift_rollback"] == 1.0
    # the alarm's windows are rewards 3-4 (reference) and 5-6: the snapshot after 2 rewards, not 4
    assert torch.equal(t.policy.weight, torch.full((1, 2), 2.0))
    assert torch.equal(t.critic.weight, torch.full((1, 2), 2.0))
    assert not t.optimizers.policy.state and not t.optimizers.critic.state
    assert t.algorithm.forgotten == 0  # the users did not change: the rule's statistics stay


def test_a_rollback_restores_the_ema_reference_of_its_snapshot():
    t = trainables(ema_reference=True)
    response = DriftResponse(settings(rollback_first=True), t)
    for weight, reference in ((2.0, 20.0), (3.0, 30.0)):  # snapshots after 2 and 4 rewards
        move(t, weight)
        fill(t.ema_reference, reference)
        response.after_step([1.0, 1.0], [1, 1], next_version=2)
    move(t, 4.0)
    fill(t.ema_reference, 40.0)
    assert response.after_step([0.0, 0.0], [5, 5], next_version=7)["drift_rollback"] == 1.0
    assert torch.equal(t.policy.weight, torch.full((1, 2), 2.0))
    assert torch.equal(t.ema_reference.weight, torch.full((1, 2), 20.0))  # the snapshot's, not the fallen 40


def test_an_alarm_early_in_a_long_step_rolls_back_to_the_snapshot_before_its_own_reference_window():
    """Six of the step's rewards follow the alarm, more than the detector's history of 4 holds:
    the alarm is still at reward 6, its reference window rewards 3-4."""
    t = trainables()
    response = DriftResponse(settings(rollback_first=True), t)
    for weight in (2.0, 3.0):  # snapshots after 2 rewards (weights 2) and 4 (weights 3)
        move(t, weight)
        response.after_step([1.0, 1.0], [1, 1], next_version=2)
    move(t, 4.0)
    metrics = response.after_step([0.0] * 8, [5] * 8, next_version=7)
    assert metrics["drift_rollback"] == 1.0
    assert torch.equal(t.policy.weight, torch.full((1, 2), 2.0))  # not 3: taken inside the reference window


def test_an_alarm_early_in_a_long_step_tests_the_score_on_its_own_windows():
    t = trainables()
    response = DriftResponse(settings(rollback_first=True, rollback_score="quality"), t)
    for weight in (2.0, 3.0):
        move(t, weight)
        response.after_step([1.0, 1.0], [1, 1], next_version=2, scores=[1.0, 1.0])
    move(t, 4.0)
    # the alarm at reward 6: score windows rewards 3-4 (quality 1, 1) and 5-6 (0, 0); rewards 7-8,
    # after the alarm, hold quality 0 too: read there, the score would not have fallen
    step = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    metrics = response.after_step(step, [5] * 8, next_version=7, scores=step)
    assert metrics["drift_score_drop"] == 1.0 and metrics["drift_rollback"] == 1.0


def test_a_probation_at_the_reference_level_keeps_the_rolled_back_policy():
    t, response, _ = rolled_back_after_a_drop()
    # the 0.0 was sampled before the restored version 7: not the probation's
    metrics = response.after_step([0.0, 0.9, 1.0], [6, 7, 8], next_version=9)
    assert metrics["drift_alarm"] == 0.0
    assert metrics["drift_probation_drop"] == pytest.approx(1.0 - 0.95)  # reference rewards 1, 1
    assert torch.equal(t.policy.weight, torch.full((1, 2), 2.0)) and t.algorithm.forgotten == 0


def test_a_probation_still_below_the_reference_restarts():
    t, response, _ = rolled_back_after_a_drop()
    metrics = response.after_step([0.0, 0.1], [7, 7], next_version=8)
    assert metrics["drift_alarm"] == 1.0 and metrics["drift_rollback"] == 0.0
    # drop 0.95; Welch se sqrt(0/2 + 0.005/2) = 0.05
    assert metrics["drift_drop"] == pytest.approx(0.95) and metrics["drift_z"] == pytest.approx(19.0)
    assert torch.equal(t.policy.weight, torch.full((1, 2), 1.0))  # the start
    assert torch.equal(t.critic.weight, torch.full((1, 2), -1.0))
    assert t.algorithm.forgotten == 1


def test_after_a_registry_roll_back_the_champions_lower_rewards_are_not_tested_against_the_rejected_line():
    # the registry rejected a candidate that scored higher (a monitor tripped on it) and the learner
    # restored its champion: weights 2, earning 0 where the candidate (weights 3, 4) earned 1
    t = trainables()
    response = DriftResponse(settings(rollback_first=True), t)
    for weight in (3.0, 4.0):
        move(t, weight)
        response.after_step([1.0, 1.0], [1, 1], next_version=2)
    fill(t.policy, 2.0)
    response.after_registry_rollback(republished_as=4)
    # the rejected line's answers still on their way (v2, v3), then the restored weights' own (v4)
    assert response.after_step([1.0, 1.0], [2, 3], next_version=5)["drift_stale_rewards"] == 2.0
    for _ in range(2):  # the detector's two windows, filled by the champion alone
        metrics = response.after_step([0.0, 0.0], [4, 4], next_version=5)
        assert metrics["drift_alarm"] == 0.0
    assert torch.equal(t.policy.weight, torch.full((1, 2), 2.0))  # not restarted, not the rejected weights
    assert t.algorithm.forgotten == 0


def test_a_registry_roll_back_ends_a_drift_probation():
    t, response, _ = rolled_back_after_a_drop()
    response.after_registry_rollback(republished_as=7)
    assert response.probation is None
    metrics = response.after_step([0.0, 0.1], [7, 7], next_version=8)  # a failed probation restarted here
    assert metrics["drift_alarm"] == 0.0 and t.algorithm.forgotten == 0


def test_the_version_floor_of_a_registry_roll_back_is_checkpointed():
    t = trainables()
    response = DriftResponse(settings(), t)
    response.after_registry_rollback(republished_as=9)
    restored = DriftResponse(settings(), t)
    restored.load_state_dict(response.state_dict())
    assert restored.after_step([1.0, 1.0], [8, 9], next_version=10)["drift_stale_rewards"] == 1.0
    older = response.state_dict()
    del older["version_floor"]  # a checkpoint from before the floor
    restored.load_state_dict(older)
    assert restored.version_floor == 0


def test_without_a_snapshot_before_the_reference_window_an_alarm_restarts():
    t = trainables()
    response = DriftResponse(settings(rollback_first=True), t)
    move(t, 5.0)
    metrics = response.after_step([1.0, 1.0, 0.0, 0.0])
    assert metrics["drift_alarm"] == 1.0 and metrics["drift_rollback"] == 0.0
    assert torch.equal(t.policy.weight, torch.full((1, 2), 1.0)) and t.algorithm.forgotten == 1


def alarm_with_scores(step_scores: list[list[float]]) -> tuple[Trainables, dict[str, float]]:
    """rollback_first with a ``quality`` score: steps of rewards 1, 1 | 1, 1 | 0, 0 (alarm at reward
    6: reference window rewards 3-4, the second step; recent 5-6) with these scores."""
    t = trainables()
    response = DriftResponse(settings(rollback_first=True, rollback_score="quality"), t)
    for weight, rewards, scores in zip((2.0, 3.0, 4.0), ([1.0, 1.0], [1.0, 1.0], [0.0, 0.0]), step_scores, strict=True):
        move(t, weight)
        metrics = response.after_step(rewards, [1, 1], next_version=7, scores=scores)
    return t, metrics


def test_an_alarm_whose_score_fell_too_rolls_back():
    # the first step's 0.2s are outside the windows: read there, the score would have risen
    t, metrics = alarm_with_scores([[0.2, 0.2], [0.9, 0.9], [0.3, 0.3]])
    assert metrics["drift_rollback"] == 1.0 and metrics["drift_score_drop"] == pytest.approx(0.6)
    assert torch.equal(t.policy.weight, torch.full((1, 2), 2.0)) and t.algorithm.forgotten == 0


def test_an_alarm_whose_score_held_restarts_at_once():
    t, metrics = alarm_with_scores([[0.9, 0.9], [0.3, 0.3], [0.3, 0.2]])  # drop 0.05 / se 0.05: z 1, under 2
    assert metrics["drift_alarm"] == 1.0 and metrics["drift_rollback"] == 0.0
    assert metrics["drift_score_z"] == pytest.approx(1.0)
    assert torch.equal(t.policy.weight, torch.full((1, 2), 1.0)) and t.algorithm.forgotten == 1


def test_an_alarm_without_scores_to_test_rolls_back():
    nan = float("nan")
    t, metrics = alarm_with_scores([[0.9, 0.9], [0.3, nan], [0.3, 0.2]])  # one score in the reference window
    assert metrics["drift_rollback"] == 1.0 and "drift_score_z" not in metrics


def test_after_rollouts_reads_rewards_sampling_versions_and_the_score_from_rollouts():
    def rollout(reward: float, quality: float, version: int = 1) -> Rollout:
        return Rollout("r", [5, 6], [False, True], [0.0, -1.0], [0, version], {1: reward}, scores={"quality": quality})

    t = trainables()
    response = DriftResponse(settings(rollback_first=True, rollback_score="quality"), t)
    for weight, reward, quality in ((2.0, 1.0, 0.2), (3.0, 1.0, 0.9), (4.0, 0.0, 0.3)):  # as the "fell" test above
        move(t, weight)
        metrics = response.after_rollouts([rollout(reward, quality), rollout(reward, quality)], next_version=7)
    assert metrics["drift_rollback"] == 1.0 and metrics["drift_score_drop"] == pytest.approx(0.6)
    # the probation counts only answers of the restored version 7 or later
    held = response.after_rollouts([rollout(0.0, 0.9, version=6), rollout(1.0, 0.9, version=7),
                                    rollout(1.0, 0.9, version=7)], next_version=8)
    assert held["drift_alarm"] == 0.0 and held["drift_probation_drop"] == 0.0


def outage_steps(joiner: RewardJoiner, rated: int, unrated: int) -> list[list[Rollout]]:
    """Interactions every 0.5 s through the real join and feed: the first ``rated`` get a judge's
    reward of 1 or 0.8 with a ``quality`` of 0.9, then the judge is down for ``unrated`` more and
    the flush that follows; each step takes two ready rollouts (``to_rollouts``, as the learners)."""
    steps, counters, now = [], {"invalid_rollouts": 0.0, "empty_rollouts": 0.0}, 1000.0
    for i in range(rated + unrated + 8):  # the last 8: time for the outage's windows to close
        now += 0.5
        if i < rated + unrated:
            joiner.add_interaction(Interaction(interaction_id=f"i{i}", created_at=now, completed_at=now, model="m",
                                               prompt_ids=[1], response_ids=[2, 3], action_mask=[True, True],
                                               logprobs=[-1.0, -1.0], versions=[1, 1]), now)
        if i < rated:
            joiner.add_reward(Reward(interaction_id=f"i{i}", value=1.0 - 0.2 * (i % 2), source="judge",
                                     created_at=now, scores={"quality": 0.9}), now)
        joiner.advance(now)
        while joiner.ready_stats()[0] >= 2:
            steps.append(to_rollouts(joiner.pop_ready(2, 10**6), counters, 100))
    return steps


@pytest.mark.parametrize("overrides", [{}, {"rollback_first": True, "rollback_score": "quality"}],
                         ids=["restart", "rollback_first"])
def test_a_reward_outage_with_default_rewards_neither_restarts_nor_rolls_back(overrides):
    """reward.on_missing default: while the only source is down every answer gets the default 0 when
    its window closes. Without rewards no step trains, versions stand still, so the defaults passed
    the lag filter: their run read as a preference change and restarted the policy (or rolled it back
    and then failed the probation on more defaults)."""
    joiner = RewardJoiner(RewardConfig(min_value=0.0, max_value=1.0, on_missing="default", default_value=0.0,
                                       window_s=2.0))
    t = trainables()
    response = DriftResponse(settings(**overrides), t)
    move(t, 5.0)  # a trained policy
    steps = outage_steps(joiner, rated=8, unrated=12)
    metrics = [response.after_rollouts(step, next_version=2) for step in steps]
    assert [m["drift_alarm"] for m in metrics] == [0.0] * len(steps)
    assert torch.equal(t.policy.weight, torch.full((1, 2), 5.0)) and torch.equal(t.critic.weight, torch.full((1, 2), 5.0))
    assert t.algorithm.forgotten == 0 and response.probation is None
    assert joiner.counters.defaulted == 12 and sum(m["drift_defaulted_rewards"] for m in metrics) == 12.0
    outage = [r for step in steps for r in step if r.defaulted]
    assert len(outage) == 12 and all(r.total_reward == 0.0 for r in outage)
    assert not any(r.defaulted for step in steps for r in step if r.total_reward > 0)


def test_rated_rewards_after_an_outage_are_still_tested():
    """Leaving the defaults out does not blind the detector: a real fall after the outage alarms."""
    joiner = RewardJoiner(RewardConfig(min_value=0.0, max_value=1.0, on_missing="default", default_value=0.0,
                                       window_s=2.0))
    t = trainables()
    response = DriftResponse(settings(), t)
    steps = outage_steps(joiner, rated=4, unrated=6)
    assert all(response.after_rollouts(step, next_version=2)["drift_alarm"] == 0.0 for step in steps)
    fell = [Rollout(f"f{i}", [5, 6], [False, True], [0.0, -1.0], [0, 1], {1: 0.0}) for i in range(2)]
    assert response.after_rollouts(fell, next_version=2)["drift_alarm"] == 1.0
