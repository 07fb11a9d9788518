"""The three critic orders on a hand-built batch, with a critic that memorises what it is fit on.

The memorising critic is the extreme of "K updates on the step's own rollouts": after fitting a
batch it predicts exactly that batch's Monte-Carlo returns, so an order that judges the batch
with values fit on the batch itself gets advantages of exactly 0.
"""

import json

import pytest
import torch

from online_sao.advantages import skip_observation_gae
from online_sao.batch import Rollout, collate
from online_sao.config import AlgorithmConfig
from online_sao.critic_order import FitOutcome, ReplayWindow, order_critic_updates

PRIOR_VALUE = 0.25
"""What the memorising critic predicts for tokens it never fit."""


def _batch(first_token: int, rewards=(1.0, -1.0)):
    """Two rollouts: a 2-token prompt, 2 action tokens, the reward on the last token."""
    rollouts = []
    for i, reward in enumerate(rewards):
        ids = [first_token + 10 * i, 2, 3 + i, 4]
        rollouts.append(Rollout(f"{first_token}-{i}", ids, [False, False, True, True], [0.0, 0.0, -1.0, -1.0],
                                [0] * 4, {3: reward}))
    return collate(rollouts, pad_token_id=0)


def _returns(batch):
    _, returns = skip_observation_gae(batch.rewards, torch.zeros_like(batch.rewards), batch.action_mask, 1.0, 1.0)
    return returns


class MemorisingCritic:
    """``fit`` stores each row's Monte-Carlo returns; ``evaluate`` gives them back for a row it
    fit (matched by tokens) and PRIOR_VALUE on every action token otherwise."""

    def __init__(self, refuse: bool = False) -> None:
        self.memory: dict[tuple[int, ...], torch.Tensor] = {}
        self.fitted: list[list[tuple[int, ...]]] = []
        self.refuse = refuse

    @staticmethod
    def _key(batch, b):
        return tuple(batch.input_ids[b][batch.attention_mask[b]].tolist())

    def fit(self, batch) -> FitOutcome:
        first_values = self.evaluate(batch)  # what the first update's forward sees
        if self.refuse:
            return FitOutcome(stepped=False, updates_done=0, metrics={}, first_values=first_values)
        returns = _returns(batch)
        keys = [self._key(batch, b) for b in range(batch.batch_size)]
        for b, key in enumerate(keys):
            self.memory[key] = returns[b]
        self.fitted.append(keys)
        return FitOutcome(stepped=True, updates_done=2, metrics={}, first_values=first_values)

    def evaluate(self, batch) -> torch.Tensor:
        rows = [self.memory.get(self._key(batch, b), PRIOR_VALUE * batch.action_mask[b].float())
                for b in range(batch.batch_size)]
        return torch.stack(rows)


def _advantages(batch, values):
    advantages, _ = skip_observation_gae(batch.rewards, values, batch.action_mask, 1.0, 1.0)
    return advantages[batch.action_mask]


def test_fit_then_judge_judges_the_batch_with_values_fit_on_it():
    batch, critic = _batch(1), MemorisingCritic()
    result = order_critic_updates("fit_then_judge", batch, critic.fit, critic.evaluate)
    torch.testing.assert_close(result.used, _returns(batch))
    torch.testing.assert_close(_advantages(batch, result.used), torch.zeros(4))
    torch.testing.assert_close(result.before, PRIOR_VALUE * batch.action_mask.float())


def test_judge_then_fit_judges_with_the_critic_as_it_stood():
    batch, critic = _batch(1), MemorisingCritic()
    result = order_critic_updates("judge_then_fit", batch, critic.fit, critic.evaluate)
    # rewards +1 and -1 against a value of 0.25 on every action token
    torch.testing.assert_close(_advantages(batch, result.used),
                               torch.tensor([0.75, 0.75, -1.25, -1.25]))
    assert critic.fitted == [[MemorisingCritic._key(batch, 0), MemorisingCritic._key(batch, 1)]]
    torch.testing.assert_close(result.after, _returns(batch))  # the fit happened, after the judging


def test_judge_then_fit_needs_no_forward_of_its_own_without_the_after_metrics():
    batch, critic = _batch(1), MemorisingCritic()
    evaluated = []
    evaluate = lambda b: evaluated.append(b) or critic.evaluate(b)  # noqa: E731
    result = order_critic_updates("judge_then_fit", batch, critic.fit, evaluate, measure_after=False)
    assert evaluated == [] and result.after is None
    # the values judged are the fit's first forward's: the critic before its updates
    torch.testing.assert_close(_advantages(batch, result.used), torch.tensor([0.75, 0.75, -1.25, -1.25]))


def test_replay_then_judge_fits_the_window_not_the_batch():
    earlier, batch, critic = _batch(30, rewards=(0.5, 0.0)), _batch(1), MemorisingCritic()
    window = ReplayWindow(capacity=8)
    window.add(earlier)
    result = order_critic_updates("replay_then_judge", batch, critic.fit, critic.evaluate, window.batch())
    torch.testing.assert_close(_advantages(batch, result.used),
                               torch.tensor([0.75, 0.75, -1.25, -1.25]))
    assert critic.fitted == [[MemorisingCritic._key(earlier, 0), MemorisingCritic._key(earlier, 1)]]


def test_replay_then_judge_with_an_empty_window_updates_nothing():
    batch, critic = _batch(1), MemorisingCritic()
    result = order_critic_updates("replay_then_judge", batch, critic.fit, critic.evaluate, None)
    assert result.fit is None and critic.fitted == []
    torch.testing.assert_close(result.used, result.before)


@pytest.mark.parametrize("order", ["fit_then_judge", "judge_then_fit", "replay_then_judge"])
def test_a_refused_fit_leaves_no_values_to_judge_with(order):
    batch, critic = _batch(1), MemorisingCritic(refuse=True)
    window = ReplayWindow(capacity=8)
    window.add(_batch(30))
    result = order_critic_updates(order, batch, critic.fit, critic.evaluate, window.batch())
    assert result.used is None and result.after is None and not result.fit.stepped


def test_unknown_order_is_refused():
    critic = MemorisingCritic()
    with pytest.raises(ValueError, match="critic order"):
        order_critic_updates("judge_twice", _batch(1), critic.fit, critic.evaluate)


def test_replay_window_keeps_the_newest_rows_trimmed_and_round_trips_through_json():
    window = ReplayWindow(capacity=3)
    long = collate([Rollout("long", [5, 6, 7, 8, 9], [False, True, True, True, True], [0.0, -1, -1, -1, -1],
                            [0] * 5, {4: 2.0})], pad_token_id=0)
    window.add(_batch(1))  # rows 1-0, 1-1
    window.add(long)  # full: 1-0, 1-1, long
    window.add(_batch(40, rewards=(-0.5, 0.5)))  # 1-0 and 1-1 fall out: long, 40-0, 40-1
    assert len(window) == 3
    batch = window.batch()
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [40, 2, 3, 4, 0], [50, 2, 4, 4, 0]]
    assert batch.attention_mask.sum(dim=1).tolist() == [5, 4, 4]
    assert batch.rewards[:, -2:].tolist() == [[0.0, 2.0], [-0.5, 0.0], [0.5, 0.0]]
    assert batch.action_mask[1].tolist() == [False, False, True, True, False]
    assert batch.token_normalizer is None

    restored = ReplayWindow(capacity=3)
    restored.load_state_dict(json.loads(json.dumps(window.state_dict())))
    again = restored.batch()
    for name in ("input_ids", "attention_mask", "action_mask", "rewards"):
        assert torch.equal(getattr(again, name), getattr(batch, name)), name


def test_the_default_order_does_not_judge_a_batch_with_values_fit_on_it():
    batch, critic = _batch(1), MemorisingCritic()
    window = ReplayWindow(capacity=8)
    window.add(_batch(30))
    result = order_critic_updates(AlgorithmConfig().critic_order, batch, critic.fit, critic.evaluate, window.batch())
    torch.testing.assert_close(_advantages(batch, result.used), torch.tensor([0.75, 0.75, -1.25, -1.25]))
