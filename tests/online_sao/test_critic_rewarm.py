"""SAO's critic re-warm after a restart (``critic_rewarm_rollouts``): the critic fits every rollout
since the restart while a running mean is the policy's baseline, then the critic judges again."""

from __future__ import annotations

import pytest
import torch

import online_sao.sao as sao_module
from online_sao.advantages import length_adaptive_lambda, skip_observation_gae
from online_sao.algorithms import build_algorithm, build_optimizers
from online_sao.batch import Rollout, collate
from online_sao.config import AlgorithmConfig
from online_sao.critic import ValueModel
from online_sao.train_step import policy_logprobs
from tests.online_sao.test_sao import make_batch, make_sao


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _same(before: list[torch.Tensor], module: torch.nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


def test_off_by_default_a_forget_leaves_the_critic_judging(tiny_qwen):
    algo = make_sao(tiny_qwen)
    algo.forget()
    assert algo.rewarm_window is None
    assert "critic_rewarm" not in algo.step(make_batch(tiny_qwen))


def _constant_baseline_adv_mean(algo, batch, level: float) -> float:
    """Mean advantage over action tokens of GAE with every value ``level``, from scratch."""
    lam = length_adaptive_lambda(batch.action_mask.sum(dim=1), algo.cfg.lambda_alpha)
    expected, _ = skip_observation_gae(batch.rewards, torch.full_like(batch.rewards, level), batch.action_mask,
                                       algo.cfg.gamma, lam)
    return float(expected[batch.action_mask].mean())


def test_after_a_forget_a_running_mean_stands_in_for_the_critic_for_that_many_rollouts(tiny_qwen):
    algo = make_sao(tiny_qwen, critic_rewarm_rollouts=3)
    algo.step(make_batch(tiny_qwen))  # before any restart: a normal step
    assert algo.rewarm_left == 0
    algo.forget()
    assert algo.rewarm_left == 3
    # batches of two rollouts: 3 -> 1 -> 0; the first step's level is its own mean (0.5 + 0.0) / 2,
    # the second's the mean of the rollouts before it (the same two rewards)
    for rewards, level, left in (((0.5, 0.0), 0.25, 1), ((1.0, 0.0), 0.25, 0)):
        batch = make_batch(tiny_qwen, rewards=rewards)
        policy, critic = _params(algo.policy), _params(algo.critic)
        metrics = algo.step(batch)
        assert (metrics["critic_rewarm"], metrics["rewarm_left"], metrics["skipped_nonfinite"]) == (1.0, left, 0.0)
        assert metrics["rewarm_level"] == pytest.approx(level)
        assert metrics["adv_mean"] == pytest.approx(_constant_baseline_adv_mean(algo, batch, level), abs=1e-6)
        assert metrics["critic_updates_done"] == 2.0  # K as configured
        assert not _same(policy, algo.policy) and not _same(critic, algo.critic)
    assert len(algo.rewarm_window) == 0  # the re-warm is over: its rollouts are let go
    assert "critic_rewarm" not in algo.step(make_batch(tiny_qwen))


def test_each_rewarm_step_fits_every_rollout_since_the_restart(tiny_qwen):
    algo = make_sao(tiny_qwen, critic_rewarm_rollouts=8)
    algo.forget()
    first, second = make_batch(tiny_qwen, rewards=(1.0, 0.0)), make_batch(tiny_qwen, rewards=(0.2, 0.6))
    algo.step(first)
    with torch.no_grad():  # the critic before the second step, on the four rollouts so far
        errors = [torch.cat([(algo.critic(b.input_ids, b.attention_mask)[i, b.action_mask[i]] - b.rewards[i].sum())
                             .pow(2) for i in range(2)]) for b in (first, second)]
    # gamma = lambda_critic = 1: every action token's target is its rollout's reward; the first
    # update's loss is the token mean over both batches' action tokens
    expected = float(torch.cat(errors).mean())
    metrics = algo.step(second)
    assert abs(metrics["critic_fit_loss"] - expected) < 1e-5
    assert len(algo.rewarm_window) == 4


def _batch_of_rewards(policy, rewards):
    """One on-policy rollout per reward (a 3-token prompt, a 2-token answer, the reward on its last token)."""
    rollouts = [Rollout(f"w{i}", [1, 2, 3, 10 + i, 20 + i], [False] * 3 + [True] * 2, [0.0] * 5, [5] * 5,
                        {4: reward}) for i, reward in enumerate(rewards)]
    batch = collate(rollouts, pad_token_id=0, policy_version=5)
    with torch.no_grad():
        batch.rollout_logprobs = policy_logprobs(policy, batch) * batch.action_mask
    return batch


@pytest.mark.parametrize("earlier", [(), (0.25, 0.75)])
def test_a_rewarm_step_past_the_count_fits_every_rollout_since_the_restart(tiny_qwen, monkeypatch, earlier):
    """N = 4 and a step of 6 rollouts, after 0 or 2 earlier re-warm rollouts: its K updates fit all of
    them (the joined window was capped at N, and the oldest fell out before the fit)."""
    algo = make_sao(tiny_qwen, critic_rewarm_rollouts=4)
    algo.forget()
    if earlier:
        algo.step(_batch_of_rewards(tiny_qwen, earlier))
    fitted: list[list[float]] = []
    fit = algo._fit

    def spy(batch, timer):
        fitted.append(batch.rewards.sum(dim=1).tolist())
        return fit(batch, timer)

    monkeypatch.setattr(algo, "_fit", spy)
    rewards = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    metrics = algo.step(_batch_of_rewards(tiny_qwen, rewards))
    assert fitted == [list(earlier) + list(rewards)]
    assert metrics["critic_rewarm"] == 1.0 and metrics["critic_updates_done"] == 2.0
    assert algo.rewarm_left == 0 and len(algo.rewarm_window) == 0  # the N are done: the window is let go


def test_a_refused_rewarm_step_leaves_its_rollouts_out_of_later_fits_and_levels(tiny_qwen):
    algo = make_sao(tiny_qwen, critic_rewarm_rollouts=16)
    algo.forget()
    algo.step(make_batch(tiny_qwen, rewards=(1.0, 1.0)))
    critic = algo.critic
    algo.critic = lambda ids, mask: critic(ids, mask) * float("inf")  # a transient non-finite critic loss
    refused = algo.step(make_batch(tiny_qwen, rewards=(-1.0, -1.0)))
    algo.critic = critic
    assert refused["skipped_nonfinite"] == 1.0
    assert len(algo.rewarm_window) == 2 and algo.rewarm_left == 14  # as before the refused step
    metrics = algo.step(make_batch(tiny_qwen, rewards=(1.0, 1.0)))
    assert metrics["rewarm_level"] == 1.0  # the first step's 1, 1 only: with the refused -1, -1 it would be 0
    assert len(algo.rewarm_window) == 4


def test_a_rewarm_step_refused_at_its_policy_update_leaves_its_rollouts_out_too(tiny_qwen, monkeypatch):
    """The critic's fit went through but the policy loss was not finite: the learner refuses the step,
    so its rollouts join neither the window nor the count, as at a refused fit."""
    algo = make_sao(tiny_qwen, critic_rewarm_rollouts=16)
    algo.forget()
    algo.step(make_batch(tiny_qwen, rewards=(1.0, 1.0)))
    policy_loss = sao_module.dis_policy_loss

    def not_finite(*args, **kw):
        loss, metrics = policy_loss(*args, **kw)
        return loss * float("nan"), metrics

    monkeypatch.setattr(sao_module, "dis_policy_loss", not_finite)
    refused = algo.step(make_batch(tiny_qwen, rewards=(-1.0, -1.0)))
    monkeypatch.setattr(sao_module, "dis_policy_loss", policy_loss)
    assert refused["skipped_nonfinite"] == 1.0
    assert len(algo.rewarm_window) == 2 and algo.rewarm_left == 14  # as before the refused step
    assert algo.step(make_batch(tiny_qwen, rewards=(1.0, 1.0)))["rewarm_level"] == 1.0  # not (1 + 1 - 1 - 1) / 4


def _beside_a_rank_with_ten_more_window_tokens(values: torch.Tensor) -> torch.Tensor:
    """A SumOverRanks of two ranks: the other holds what this one does, but 10 action tokens more in
    the window a critic fit normalises by (the last-but-one entry of the vectors sao.py sums for it:
    [tokens, ranks] and the re-warm's [reward sum, count, taken, tokens, ranks])."""
    other = values.clone()
    if values.shape in ((2,), (5,)):
        other[-2] += 10.0
    return values + other


@pytest.mark.parametrize("replay", [False, True])
def test_a_fit_on_a_window_is_normalised_over_every_ranks_window(tiny_qwen, monkeypatch, replay):
    """The step's own batch divides by N_global / world_size (FSDP averages the ranks' gradients); a
    fit on the re-warm or replay window divided by its rank's own count, weighing a rank's short
    window as much as another's long one. Two ranks of N and N + 10 window tokens: N + 5 each."""
    cfg = {"critic_order": "replay_then_judge"} if replay else {"critic_rewarm_rollouts": 16}
    policy = tiny_qwen
    critic_cfg = AlgorithmConfig(policy_lr=1e-3, critic_lr=5e-3, critic_warmup_steps=0, **cfg)
    critic = ValueModel.from_policy(policy, freeze_attention=critic_cfg.freeze_critic_attention)
    opt = build_optimizers(critic_cfg, policy, critic)
    algo = build_algorithm(critic_cfg, policy, critic, opt.policy, opt.critic, opt.critic_scheduler,
                           sum_over_ranks=_beside_a_rank_with_ten_more_window_tokens)
    if not replay:
        algo.forget()
    algo.step(make_batch(policy))  # the first step: the replay window is empty until it is applied
    normalizers = []
    value_loss = sao_module.value_loss

    def spy(values, returns, mask, normalizer=None):
        normalizers.append((float(mask.sum()), normalizer))
        return value_loss(values, returns, mask, normalizer)

    monkeypatch.setattr(sao_module, "value_loss", spy)
    algo.step(make_batch(policy))
    window_tokens = 8.0 * (1 if replay else 2)  # two rollouts of 4 action tokens a step; re-warm: both steps
    # the K = 2 critic updates on the window; the step's own batch (one process: no normaliser) as before
    assert [(tokens, n) for tokens, n in normalizers if n is not None] == [(window_tokens, window_tokens + 5)] * 2


def test_a_checkpoint_mid_rewarm_resumes_it(tiny_qwen):
    algo = make_sao(tiny_qwen, critic_rewarm_rollouts=6)
    algo.forget()
    algo.step(make_batch(tiny_qwen))
    state = algo.state_dict()
    resumed = make_sao(tiny_qwen, critic_rewarm_rollouts=6)
    resumed.load_state_dict(state)
    assert resumed.rewarm_left == 4 and len(resumed.rewarm_window) == 2
    assert resumed.state_dict()["rewarm"] == state["rewarm"]
