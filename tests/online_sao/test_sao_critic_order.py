"""SAO's step under each critic order, with a real (tiny) critic: which values the advantages use."""

import copy
import json

import pytest
import torch

from online_sao.advantages import length_adaptive_lambda, skip_observation_gae
from online_sao.losses import value_loss
from tests.online_sao.test_sao import make_batch, make_sao


def _adv_mean(critic, batch, cfg):
    """Mean advantage over action tokens from ``critic``'s values, computed here from scratch."""
    with torch.no_grad():
        values = critic(batch.input_ids, batch.attention_mask)
    return _adv_mean_of(values, batch, cfg)


def _adv_mean_of(values, batch, cfg):
    lam = length_adaptive_lambda(batch.action_mask.sum(dim=1), cfg.lambda_alpha)
    advantages, _ = skip_observation_gae(batch.rewards, values, batch.action_mask, cfg.gamma, lam)
    return float(advantages[batch.action_mask].mean())


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _changed(module, before):
    return [n for n, p in module.named_parameters() if not torch.equal(p, before[n])]


def _rewarded_batch(policy):
    return make_batch(policy, rewards=(1.0, 0.5))  # both positive: a value of 0 is far from either


def test_judge_then_fit_judges_with_the_critic_before_its_updates(tiny_qwen):
    algo = make_sao(tiny_qwen, critic_order="judge_then_fit", critic_after_metrics=True)
    batch = _rewarded_batch(tiny_qwen)
    critic_before = copy.deepcopy(algo.critic)
    metrics = algo.step(batch)
    assert metrics["skipped_nonfinite"] == 0.0 and metrics["critic_updates_done"] == 2.0
    assert metrics["adv_mean"] == pytest.approx(_adv_mean(critic_before, batch, algo.cfg), abs=1e-6)
    assert _changed(algo.critic, _params(critic_before))  # the K updates ran, after the judging
    assert metrics["explained_variance_used"] == metrics["explained_variance"]
    assert metrics["value_loss_after"] < metrics["value_loss"]


def test_values_used_are_measured_against_the_batch_targets_once_and_named_twice(tiny_qwen):
    algo = make_sao(tiny_qwen, critic_order="judge_then_fit")
    batch = _rewarded_batch(tiny_qwen)
    with torch.no_grad():
        values = copy.deepcopy(algo.critic)(batch.input_ids, batch.attention_mask)
    _, targets = skip_observation_gae(batch.rewards, values, batch.action_mask, algo.cfg.gamma, algo.cfg.lambda_critic)
    expected, _ = value_loss(values, targets, batch.action_mask, batch.token_normalizer)
    metrics = algo.step(batch)
    assert metrics["value_loss"] == metrics["value_loss_used"] == pytest.approx(float(expected), rel=1e-6)
    assert "value_mean" in metrics and "value_mean_used" not in metrics and "value_loss_after" not in metrics


def test_fit_then_judge_judges_with_the_critic_after_fitting_the_batch(tiny_qwen):
    algo = make_sao(tiny_qwen, critic_order="fit_then_judge")
    batch = _rewarded_batch(tiny_qwen)
    critic_before = copy.deepcopy(algo.critic)
    metrics = algo.step(batch)
    # the policy update leaves the critic alone: the critic now is the one that judged
    assert metrics["adv_mean"] == pytest.approx(_adv_mean(algo.critic, batch, algo.cfg), abs=1e-6)
    # fitting the batch's own returns shrank its advantages (rewards 1 and 0.5, zero-head critic)
    assert metrics["adv_mean"] < _adv_mean(critic_before, batch, algo.cfg)
    assert metrics["value_loss_used"] == metrics["value_loss_after"] < metrics["value_loss"]


def test_replay_then_judge_fits_only_earlier_rollouts(tiny_qwen):
    algo = make_sao(tiny_qwen, critic_order="replay_then_judge", critic_replay_rollouts=3)
    first = _rewarded_batch(tiny_qwen)
    critic_start = _params(algo.critic)
    metrics = algo.step(first)
    # nothing earlier to replay: the first step judges with the critic as it is and updates nothing
    assert metrics["critic_updates_done"] == 0.0 and not _changed(algo.critic, critic_start)
    assert metrics["replay_window"] == 2.0

    second = make_batch(tiny_qwen, rewards=(-1.0, 0.25))
    metrics = algo.step(second)
    assert metrics["critic_updates_done"] == 2.0 and _changed(algo.critic, critic_start)
    assert metrics["adv_mean"] == pytest.approx(_adv_mean(algo.critic, second, algo.cfg), abs=1e-6)
    assert metrics["replay_window"] == 3.0  # capacity 3: the oldest of the four rollouts fell out

    restored = make_sao(tiny_qwen, critic_order="replay_then_judge", critic_replay_rollouts=3)
    restored.load_state_dict(json.loads(json.dumps(algo.state_dict())))
    assert torch.equal(restored.window.batch().input_ids, algo.window.batch().input_ids)


def test_a_refused_step_does_not_join_the_replay_window(tiny_qwen):
    algo = make_sao(tiny_qwen, critic_order="replay_then_judge")
    batch = make_batch(tiny_qwen)
    with torch.no_grad():
        tiny_qwen.model.layers[0].mlp.down_proj.weight[0, 0] = float("inf")
    metrics = algo.step(batch)
    assert metrics["skipped_nonfinite"] == 1.0 and len(algo.window) == 0


@pytest.mark.parametrize("order", ["fit_then_judge", "judge_then_fit", "replay_then_judge"])
def test_every_order_reports_the_critic_before_used_and_after(tiny_qwen, order):
    algo = make_sao(tiny_qwen, critic_order=order, critic_after_metrics=True)
    algo.step(_rewarded_batch(tiny_qwen))  # gives replay_then_judge something to replay
    metrics = algo.step(make_batch(tiny_qwen, rewards=(0.5, -0.5)))
    for name in ("value_loss", "value_loss_used", "value_loss_after", "explained_variance",
                 "explained_variance_used", "explained_variance_after", "critic_fit_loss", "critic_grad_norm"):
        assert isinstance(metrics[name], float), name


def _counting_forwards(critic):
    calls = []
    critic.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


@pytest.mark.parametrize(("order", "after_metrics", "forwards"), [
    ("judge_then_fit", False, 2),  # K = 2 updates; the first one's forward gives the values judged
    ("judge_then_fit", True, 3),  # ... and one more for the metrics after the updates
    ("fit_then_judge", False, 3),  # the values used are those after the updates: always measured
])
def test_the_step_runs_the_critic_only_as_often_as_its_order_needs(tiny_qwen, order, after_metrics, forwards):
    algo = make_sao(tiny_qwen, critic_order=order, critic_after_metrics=after_metrics)
    calls = _counting_forwards(algo.critic)
    metrics = algo.step(_rewarded_batch(tiny_qwen))
    assert len(calls) == forwards
    assert ("value_loss_after" in metrics) == (after_metrics or order != "judge_then_fit")


def test_the_values_judged_are_the_critics_before_the_step_without_a_forward_of_their_own(tiny_qwen):
    """judge_then_fit takes the batch's values from the first update's forward: they must be what a
    separate no-grad forward of the critic before the step gives."""
    algo = make_sao(tiny_qwen, critic_order="judge_then_fit")
    batch = _rewarded_batch(tiny_qwen)
    with torch.no_grad():
        before = algo.critic(batch.input_ids, batch.attention_mask)
    mask = batch.action_mask
    _, targets = skip_observation_gae(batch.rewards, before, mask, algo.cfg.gamma, algo.cfg.lambda_critic)
    expected, _ = value_loss(before, targets, mask, batch.token_normalizer)
    metrics = algo.step(batch)
    assert metrics["value_loss"] == pytest.approx(float(expected), rel=1e-6)
    assert metrics["adv_mean"] == pytest.approx(_adv_mean_of(before, batch, algo.cfg), abs=1e-6)
