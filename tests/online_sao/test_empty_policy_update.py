"""A policy update whose loss has no gradient (every action token outside the DIS band) is skipped:
AdamW would still move the weights by its momentum, on data DIS rejected (SAO.md section 1)."""

import math

import pytest
import torch

from online_sao.algorithms import build_algorithm, build_critic, build_optimizers, linear_warmup
from online_sao.batch import Rollout, collate
from online_sao.config import AlgorithmConfig
from online_sao.train_step import guarded_update, policy_logprobs

MASKED = 5.0
"""Behaviour log-probs this many nats above the policy's: ratio e^-5, below the band's 1 - eps_low."""
KEPT = 0.0
"""Behaviour log-probs equal to the policy's: ratio 1, inside the band."""


def batch_of(policy, shifts, group_ids=None, rewards=None):
    """One rollout per shift (a 3-token prompt, a 3-token answer, rewards +1, -1, ... unless
    ``rewards`` are given) whose behaviour log-probs are the policy's own plus that shift."""
    rollouts = []
    for i, shift in enumerate(shifts):
        ids = [1, 2, 3, 10 + i, 11 + i, 12 + i]
        reward = (1.0 if i % 2 == 0 else -1.0) if rewards is None else rewards[i]
        rollouts.append(Rollout(f"r{i}", ids, [False] * 3 + [True] * 3, [0.0] * 6, [0] * 6,
                                {5: reward}, group_id=-1 if group_ids is None else group_ids[i]))
    batch = collate(rollouts, pad_token_id=0)
    row_shifts = torch.tensor(shifts).view(-1, 1)
    with torch.no_grad():
        batch.rollout_logprobs = (policy_logprobs(policy, batch) + row_shifts) * batch.action_mask
    return batch


def build(name, policy, vote=None, **overrides):
    cfg = AlgorithmConfig(**{"name": name, "policy_lr": 1e-3, "critic_lr": 5e-3, "critic_warmup_steps": 0,
                             **overrides})
    critic = build_critic(cfg, policy)
    opt = build_optimizers(cfg, policy, critic)
    voting = {} if vote is None else {"vote": vote}
    return build_algorithm(cfg, policy, critic, opt.policy, opt.critic, opt.critic_scheduler, **voting)


def prompt_only():
    """A batch of one rollout without action tokens: no loss has a gradient."""
    return collate([Rollout("prompt-only", [1, 2, 3], [False] * 3, [0.0] * 3, [0] * 3, {2: 1.0})], pad_token_id=0)


def adam_steps(optimizer):
    return [float(state["step"]) for state in optimizer.state.values()]


def moved(model, before):
    return any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_sao_step_with_every_token_outside_the_band_leaves_the_policy_as_it_was(tiny_qwen, snapshot_weights):
    algo = build("sao", tiny_qwen)
    algo.step(batch_of(tiny_qwen, [KEPT, KEPT]))  # an applied update: AdamW now has momentum
    steps = adam_steps(algo.policy_optimizer)
    unchanged = snapshot_weights(tiny_qwen)
    critic_before = {n: p.detach().clone() for n, p in algo.critic.named_parameters()}
    metrics = algo.step(batch_of(tiny_qwen, [MASKED, MASKED]))
    unchanged()  # before the fix AdamW moved it by 0.67 lr on this step
    assert adam_steps(algo.policy_optimizer) == steps
    assert metrics["kept_frac"] == 0.0 and metrics["policy_grad_norm"] == 0.0
    assert metrics["policy_update_skipped_empty"] == 1.0 and metrics["skipped_nonfinite"] == 0.0
    assert moved(algo.critic, critic_before)  # the critic trains on every action token as ever
    # one rollout inside the band: its tokens have a gradient, the policy steps
    before = {n: p.detach().clone() for n, p in tiny_qwen.named_parameters()}
    metrics = algo.step(batch_of(tiny_qwen, [KEPT, MASKED]))
    assert metrics["kept_frac"] == 0.5 and metrics["policy_update_skipped_empty"] == 0.0
    assert moved(tiny_qwen, before)


def test_a_sao_step_with_no_action_token_leaves_the_policy_as_it_was(tiny_qwen, snapshot_weights):
    algo = build("sao", tiny_qwen)
    algo.step(batch_of(tiny_qwen, [KEPT, KEPT]))
    unchanged = snapshot_weights(tiny_qwen)
    batch = collate([Rollout("prompt-only", [1, 2, 3], [False] * 3, [0.0] * 3, [0] * 3, {2: 1.0})], pad_token_id=0)
    metrics = algo.step(batch)
    unchanged()
    assert metrics["policy_update_skipped_empty"] == 1.0 and metrics["skipped_nonfinite"] == 0.0


def test_a_regularizer_gives_every_action_token_a_gradient_so_the_policy_steps(tiny_qwen):
    algo = build("sao", tiny_qwen, entropy_alpha=0.1)
    before = {n: p.detach().clone() for n, p in tiny_qwen.named_parameters()}
    metrics = algo.step(batch_of(tiny_qwen, [MASKED, MASKED]))
    assert metrics["kept_frac"] == 0.0 and metrics["policy_update_skipped_empty"] == 0.0
    assert moved(tiny_qwen, before)


def test_running_mean_skips_the_update_but_its_window_sees_the_rewards(tiny_qwen, snapshot_weights):
    algo = build("running_mean", tiny_qwen, running_mean_window=8)
    algo.step(batch_of(tiny_qwen, [KEPT, KEPT]))
    unchanged = snapshot_weights(tiny_qwen)
    metrics = algo.step(batch_of(tiny_qwen, [MASKED, MASKED]))
    unchanged()
    assert metrics["policy_update_skipped_empty"] == 1.0 and metrics["skipped_nonfinite"] == 0.0
    assert list(algo.window) == [1.0, -1.0, 1.0, -1.0]  # a step not refused: its rewards count


def test_grpo_with_dis_skips_an_update_without_kept_tokens_and_without_dis_steps(tiny_qwen, snapshot_weights):
    algo = build("grpo", tiny_qwen, group_size=2, ppo_epochs=2)
    algo.step(batch_of(tiny_qwen, [KEPT, KEPT], group_ids=[0, 0]))
    unchanged = snapshot_weights(tiny_qwen)
    metrics = algo.step(batch_of(tiny_qwen, [MASKED, MASKED], group_ids=[0, 0]))
    unchanged()
    assert metrics["policy_update_skipped_empty"] == 1.0 and metrics["policy_updates_done"] == 0.0
    assert metrics["skipped_nonfinite"] == 0.0 and metrics["refused_after_update"] == 0.0
    # without DIS the behaviour log-probs play no part: every action token has a gradient
    plain = build("grpo", tiny_qwen, group_size=2, ppo_epochs=1, use_dis=False)
    before = {n: p.detach().clone() for n, p in tiny_qwen.named_parameters()}
    metrics = plain.step(batch_of(tiny_qwen, [MASKED, MASKED], group_ids=[0, 0]))
    assert metrics["policy_update_skipped_empty"] == 0.0 and metrics["policy_updates_done"] == 1.0
    assert moved(tiny_qwen, before)


def test_ppo_skips_the_policy_update_of_a_step_without_action_tokens(tiny_qwen, snapshot_weights):
    algo = build("ppo", tiny_qwen, ppo_epochs=2)
    algo.step(batch_of(tiny_qwen, [KEPT, KEPT]))
    unchanged = snapshot_weights(tiny_qwen)
    batch = collate([Rollout("prompt-only", [1, 2, 3], [False] * 3, [0.0] * 3, [0] * 3, {2: 1.0})], pad_token_id=0)
    metrics = algo.step(batch)
    unchanged()
    assert metrics["policy_update_skipped_empty"] == 1.0 and metrics["skipped_nonfinite"] == 0.0


@pytest.mark.parametrize(("name", "overrides"), [
    ("sao", {"critic_order": "judge_then_fit"}), ("sao", {"critic_order": "fit_then_judge"}),
    ("sao", {"critic_rewarm_rollouts": 8}), ("ppo", {"ppo_epochs": 2})])
def test_a_step_without_action_tokens_leaves_the_critic_as_it_was(tiny_qwen, snapshot_weights, name, overrides):
    """The value loss covers the action tokens: without one it has no gradient, and AdamW moved the
    critic by its momentum and weight decay alone, and the warm-up counted the update."""
    algo = build(name, tiny_qwen, critic_warmup_steps=10, **overrides)
    if overrides.get("critic_rewarm_rollouts"):
        algo.forget()  # a drift restart: the critic re-warms on every rollout since
    algo.step(batch_of(tiny_qwen, [KEPT, KEPT]))  # applied critic updates: AdamW now has momentum
    if overrides.get("critic_rewarm_rollouts"):
        algo.forget()  # the re-warm's fit then holds the empty step alone
    steps, warmed = adam_steps(algo.critic_optimizer), algo.critic_scheduler.last_epoch
    unchanged = snapshot_weights(algo.critic)
    metrics = algo.step(prompt_only())
    unchanged()
    assert adam_steps(algo.critic_optimizer) == steps and algo.critic_scheduler.last_epoch == warmed
    assert metrics["skipped_nonfinite"] == 0.0 and metrics.get("critic_updates_done", 0.0) == 0.0


def test_a_rank_without_action_tokens_fits_the_critic_with_a_peer_that_has_some(tiny_qwen):
    """The skip is agreed across ranks, and every rank votes as often: a rank with no action token
    steps its critic with a peer that has some (FSDP's shards would diverge otherwise), through the
    same K updates. The votes of a sao step (critic_updates 2): the inputs', then loss, gradient norm
    and emptiness of each critic update and of the policy update."""
    peer_says = [True, True, True, False, True, True, False, True, True, False]  # False: "I have tokens"
    asked: list[bool] = []

    def vote(mine: bool) -> bool:
        asked.append(mine)
        return mine and peer_says[len(asked) - 1]

    algo = build("sao", tiny_qwen, vote=vote, critic_updates=2)
    metrics = algo.step(prompt_only())
    assert len(asked) == len(peer_says)  # as many votes as the peer with tokens casts
    assert metrics["critic_updates_done"] == 2.0  # its zero gradient joined the peer's two steps
    assert set(adam_steps(algo.critic_optimizer)) == {2.0}


def _momentum_optimizer():
    """A parameter, its AdamW after one applied update (momentum and a step count), and a warm-up."""
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    scheduler = linear_warmup(optimizer, warmup_steps=10)
    assert guarded_update((param * 3.0).sum(), optimizer, max_grad_norm=1.0, scheduler=scheduler).stepped
    return param, optimizer, scheduler


def test_guarded_update_skips_an_update_no_token_gives_a_gradient():
    param, optimizer, scheduler = _momentum_optimizer()
    weights, lr = param.tolist(), optimizer.param_groups[0]["lr"]
    result = guarded_update((param * 0.0).sum(), optimizer, 1.0, scheduler, signal_tokens=0)
    assert result.empty and not result.stepped and not result.refused and result.grad_norm == 0.0
    # no AdamW step (its momentum alone would have moved the weight), and the warm-up is not spent on it
    assert param.tolist() == weights and adam_steps(optimizer) == [1.0]
    assert optimizer.param_groups[0]["lr"] == lr and param.grad is None
    result = guarded_update((param * 3.0).sum(), optimizer, 1.0, scheduler, signal_tokens=2)
    assert result.stepped and not result.empty and param.tolist() != weights


def test_guarded_update_steps_when_another_rank_has_a_token_with_a_gradient():
    """The skip is agreed across ranks: a rank with no kept token steps with its peers (its zero
    gradient joins theirs), else FSDP's shards would diverge."""
    param, optimizer, _ = _momentum_optimizer()
    weights = param.tolist()
    # the peer's loss is finite, its gradient is finite, it has tokens with a gradient (not empty)
    peer = iter([True, True, False])

    def vote(mine: bool) -> bool:
        theirs = next(peer)
        return mine and theirs

    result = guarded_update((param * 0.0).sum(), optimizer, 1.0, vote=vote, signal_tokens=0)
    assert result.stepped and not result.empty and param.tolist() != weights
    assert next(peer, None) is None  # every check voted on


def test_guarded_update_skips_an_update_whose_gradient_is_exactly_zero_though_tokens_count():
    """Tokens inside the DIS band whose gradient is 0 all the same (advantage 0, greedy): AdamW's
    momentum and weight decay would still move the weights."""
    param, optimizer, scheduler = _momentum_optimizer()
    weights, lr = param.tolist(), optimizer.param_groups[0]["lr"]
    result = guarded_update((param * 0.0).sum(), optimizer, 1.0, scheduler, signal_tokens=3)
    assert result.empty and not result.stepped and not result.refused and result.grad_norm == 0.0
    assert param.tolist() == weights and adam_steps(optimizer) == [1.0] and optimizer.param_groups[0]["lr"] == lr
    # not asked (signal_tokens None, the critic's pre-training): it steps as before
    assert guarded_update((param * 0.0).sum(), optimizer, 1.0, scheduler).stepped


def greedy_batch(policy, rewards):
    """Rollouts whose answer is the policy's own greedy continuation, sampled at temperature 1e-4:
    each token's log-prob is the point mass's constant 0, ratio 1 (kept), gradient 0."""
    rollouts = []
    for i, reward in enumerate(rewards):
        ids = [1, 2, 3 + i]
        with torch.no_grad():
            for _ in range(3):
                ids.append(int(policy(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        rollouts.append(Rollout(f"g{i}", ids, [False] * 3 + [True] * 3, [0.0] * 6, [0] * 6, {5: reward},
                                temperatures=[1e-4] * 6))
    batch = collate(rollouts, pad_token_id=0)
    with torch.no_grad():
        batch.rollout_logprobs = policy_logprobs(policy, batch) * batch.action_mask
    return batch


def test_a_sao_step_of_greedy_answers_leaves_the_policy_as_it_was(tiny_qwen, snapshot_weights):
    algo = build("sao", tiny_qwen)
    algo.step(batch_of(tiny_qwen, [KEPT, KEPT]))  # an applied update: AdamW now has momentum
    steps = adam_steps(algo.policy_optimizer)
    unchanged = snapshot_weights(tiny_qwen)
    metrics = algo.step(greedy_batch(tiny_qwen, [1.0, -1.0]))
    unchanged()  # before the fix AdamW's momentum moved most weights
    assert metrics["kept_frac"] == 1.0 and metrics["adv_mean"] != 0.0 and metrics["policy_grad_norm"] == 0.0
    assert metrics["policy_update_skipped_empty"] == 1.0 and metrics["skipped_nonfinite"] == 0.0
    assert adam_steps(algo.policy_optimizer) == steps


def test_running_mean_skips_a_step_whose_rewards_equal_the_baseline(tiny_qwen, snapshot_weights):
    algo = build("running_mean", tiny_qwen, running_mean_window=8)
    algo.step(batch_of(tiny_qwen, [KEPT, KEPT], rewards=[1.0, 0.0]))  # applied; the baseline is now 0.5
    unchanged = snapshot_weights(tiny_qwen)
    metrics = algo.step(batch_of(tiny_qwen, [KEPT, KEPT], rewards=[0.5, 0.5]))  # every advantage 0
    unchanged()
    assert metrics["kept_frac"] == 1.0 and metrics["baseline"] == 0.5 and metrics["policy_grad_norm"] == 0.0
    assert metrics["policy_update_skipped_empty"] == 1.0 and metrics["skipped_nonfinite"] == 0.0
    assert list(algo.window) == [1.0, 0.0, 0.5, 0.5]  # not refused: its rewards count
    # rewards off the baseline: a gradient, the policy steps
    before = {n: p.detach().clone() for n, p in tiny_qwen.named_parameters()}
    metrics = algo.step(batch_of(tiny_qwen, [KEPT, KEPT], rewards=[1.0, 0.0]))
    assert metrics["policy_update_skipped_empty"] == 0.0 and moved(tiny_qwen, before)


def test_grpo_skips_a_group_of_equal_rewards(tiny_qwen, snapshot_weights):
    algo = build("grpo", tiny_qwen, group_size=2, ppo_epochs=2)
    algo.step(batch_of(tiny_qwen, [KEPT, KEPT], group_ids=[0, 0]))
    unchanged = snapshot_weights(tiny_qwen)
    metrics = algo.step(batch_of(tiny_qwen, [KEPT, KEPT], group_ids=[0, 0], rewards=[1.0, 1.0]))
    unchanged()
    assert metrics["kept_frac"] == 1.0 and metrics["degenerate_group_frac"] == 1.0
    assert metrics["policy_update_skipped_empty"] == 1.0 and metrics["policy_updates_done"] == 0.0
    assert metrics["skipped_nonfinite"] == 0.0


def test_a_nonfinite_loss_is_refused_not_skipped_as_empty():
    param, optimizer, _ = _momentum_optimizer()
    result = guarded_update((param * math.inf).sum(), optimizer, 1.0, signal_tokens=0)
    assert result.refused and not result.empty and math.isnan(result.grad_norm)


@pytest.mark.parametrize("name", ["sao", "running_mean", "grpo", "ppo"])
def test_every_rule_reports_the_flag(tiny_qwen, name):
    algo = build(name, tiny_qwen, group_size=2)
    metrics = algo.step(batch_of(tiny_qwen, [KEPT, KEPT], group_ids=[0, 0] if name == "grpo" else None))
    assert metrics["policy_update_skipped_empty"] == 0.0
