from typing import get_args

import pytest
import torch

from online_sao.algorithms import ALGORITHMS, algorithm_class, build_algorithm, build_critic, build_optimizers
from online_sao.baselines import GRPO, PPO, RunningMean, group_normalized_advantages
from online_sao.batch import Rollout, collate
from online_sao.config import AlgorithmConfig
from online_sao.critic import ValueModel
from online_sao.sao import SAO
from online_sao.train_step import policy_logprobs


def make_batch(policy, rewards, group_ids=None):
    """One on-policy rollout per reward: a 3-token prompt and a 3-token answer."""
    group_ids = group_ids or [-1] * len(rewards)
    rollouts = []
    for i, (reward, group) in enumerate(zip(rewards, group_ids)):
        ids = [1, 2, 3, 10 + i, 11 + i, 12 + i]
        mask = [False, False, False, True, True, True]
        rollouts.append(Rollout(f"r{i}", ids, mask, [0.0] * 6, [0] * 6, {5: reward}, group_id=group))
    batch = collate(rollouts, pad_token_id=0)
    with torch.no_grad():
        batch.rollout_logprobs = policy_logprobs(policy, batch) * batch.action_mask
    return batch


def build(name, policy, **overrides):
    cfg = AlgorithmConfig(name=name, policy_lr=1e-3, critic_lr=5e-3, **overrides)
    critic = build_critic(cfg, policy)
    opt = build_optimizers(cfg, policy, critic)
    return build_algorithm(cfg, policy, critic, opt.policy, opt.critic, opt.critic_scheduler)


def test_group_normalized_advantages_literal():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 9])
    adv, metrics = group_normalized_advantages(rewards, groups)
    # group 7: mean 0.25, deviations [0.75, -0.25, -0.25, -0.25], sample var = (0.5625 + 3 * 0.0625) / 3 = 0.25,
    # std 0.5: A = [1.5, -0.5, -0.5, -0.5]; group 3 has equal rewards: 0 / (0 + eps) = 0; group 9 is alone: 0
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0]), atol=1e-5, rtol=1e-5)
    assert metrics == {"num_groups": 3.0, "singleton_groups": 1.0, "degenerate_group_frac": 0.5}


def test_running_means_adv_mean_is_per_action_token_like_saos(tiny_qwen):
    """It was the mean over rollouts, so the arms' adv_mean curves could not be compared."""
    algo = build("running_mean", tiny_qwen, running_mean_window=3)
    algo.step(make_batch(tiny_qwen, [0.5]))  # window [0.5]: the next baseline is 0.5
    short = Rollout("short", [1, 2, 3, 10], [False, False, False, True], [0.0] * 4, [0] * 4, {3: 1.0})
    long = Rollout("long", [1, 2, 3, *range(20, 29)], [False] * 3 + [True] * 9, [0.0] * 12, [0] * 12, {11: 0.0})
    batch = collate([short, long], pad_token_id=0)
    with torch.no_grad():
        batch.rollout_logprobs = policy_logprobs(tiny_qwen, batch) * batch.action_mask
    metrics = algo.step(batch)
    # advantages +0.5 on 1 token and -0.5 on 9: (0.5 - 4.5) / 10 = -0.4 (per rollout it was 0.0)
    assert metrics["baseline"] == 0.5 and metrics["adv_mean"] == pytest.approx(-0.4)


def test_running_mean_window_excludes_the_current_batch(tiny_qwen):
    algo = build("running_mean", tiny_qwen, running_mean_window=3)
    assert isinstance(algo, RunningMean) and not algo.needs_critic
    # no history: the first batch baselines against its own mean (1 + 3) / 2 = 2
    assert algo.step(make_batch(tiny_qwen, [1.0, 3.0]))["baseline"] == 2.0
    # window [1, 3]: baseline 2, advantage 5 - 2 = 3
    metrics = algo.step(make_batch(tiny_qwen, [5.0]))
    assert metrics["baseline"] == 2.0 and metrics["adv_mean"] == 3.0
    # window [1, 3, 5]: baseline 3; afterwards the window keeps the last W = 3 rewards [5, 0, 10]
    assert algo.step(make_batch(tiny_qwen, [0.0, 10.0]))["baseline"] == 3.0
    assert list(algo.window) == [5.0, 0.0, 10.0]
    state = algo.state_dict()
    restored = build("running_mean", tiny_qwen, running_mean_window=3)
    restored.load_state_dict(state)
    assert restored.baseline(torch.tensor([100.0])) == 5.0


def test_running_mean_restored_from_another_rules_state_starts_its_window_afresh(tiny_qwen):
    """A checkpoint trained by sao holds no reward window (its state: {} without a replay window):
    a learner switched to running_mean baselines its first batch on its own mean, (1 + 3) / 2."""
    algo = build("running_mean", tiny_qwen, running_mean_window=3)
    algo.load_state_dict(build("sao", tiny_qwen).state_dict())
    assert list(algo.window) == []
    assert algo.step(make_batch(tiny_qwen, [1.0, 3.0]))["baseline"] == 2.0


def test_running_mean_refused_step_keeps_window_and_weights(tiny_qwen, snapshot_weights):
    algo = build("running_mean", tiny_qwen, running_mean_window=4)
    algo.step(make_batch(tiny_qwen, [1.0, 0.0]))
    window = list(algo.window)
    unchanged = snapshot_weights(tiny_qwen)
    # advantages ~1e38 on 3 tokens each: the DIS sum overflows float32, the guard refuses the update
    metrics = algo.step(make_batch(tiny_qwen, [1e38, 1e38]))
    assert metrics["skipped_nonfinite"] == 1.0
    assert list(algo.window) == window
    unchanged()


def test_grpo_step_changes_weights_and_reports_clip_metrics(tiny_qwen):
    algo = build("grpo", tiny_qwen, group_size=2, ppo_epochs=2)
    assert isinstance(algo, GRPO) and algo.group_size == 2 and not algo.needs_critic
    before = {n: p.detach().clone() for n, p in tiny_qwen.named_parameters()}
    metrics = algo.step(make_batch(tiny_qwen, [1.0, 0.0, 0.0, 1.0], group_ids=[0, 0, 1, 1]))
    assert metrics["skipped_nonfinite"] == 0.0 and metrics["policy_updates_done"] == 2.0
    assert {"clip_frac", "kept_frac", "num_groups", "policy_loss"} <= metrics.keys()
    assert any(not torch.equal(p, before[n]) for n, p in tiny_qwen.named_parameters())


def test_grpo_single_epoch_ratio_is_one_against_pi_old_and_dis_is_optional(tiny_qwen):
    algo = build("grpo", tiny_qwen, ppo_epochs=1, use_dis=False)
    metrics = algo.step(make_batch(tiny_qwen, [1.0, 0.0], group_ids=[0, 0]))
    # pi_old is the policy at the step's start: with one update the ratio is exactly 1
    assert metrics["ratio_mean"] == 1.0 and metrics["approx_kl"] == 0.0 and metrics["clip_frac"] == 0.0
    assert "kept_frac" not in metrics


def test_grpo_refuses_ungrouped_rollouts(tiny_qwen):
    algo = build("grpo", tiny_qwen)
    with pytest.raises(ValueError, match="group_id"):
        algo.step(make_batch(tiny_qwen, [1.0, 0.0]))


def test_ppo_step_changes_policy_and_critic(tiny_qwen):
    algo = build("ppo", tiny_qwen, critic_warmup_steps=0)
    assert isinstance(algo, PPO) and algo.needs_critic
    before = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in (tiny_qwen, algo.critic)]
    metrics = algo.step(make_batch(tiny_qwen, [1.0, -1.0]))
    assert metrics["skipped_nonfinite"] == 0.0
    assert {"value_loss", "critic_grad_norm", "explained_variance", "clip_frac"} <= metrics.keys()
    assert "kept_frac" not in metrics  # no DIS in ppo
    for snap, model in zip(before, (tiny_qwen, algo.critic)):
        assert any(not torch.equal(p, snap[n]) for n, p in model.named_parameters())


def test_build_algorithm_and_optimizers(tiny_qwen):
    assert isinstance(build("sao", tiny_qwen), SAO)
    for name, wants_critic in [("sao", True), ("ppo", True), ("grpo", False), ("running_mean", False)]:
        critic = build_critic(AlgorithmConfig(name=name, freeze_critic_attention=False), tiny_qwen)
        assert (critic is not None) == wants_critic
        assert critic is None or all(p.requires_grad for p in critic.parameters())
    cfg = AlgorithmConfig(critic_lr=1e-3, critic_warmup_steps=4)
    critic = ValueModel.from_policy(tiny_qwen)
    opt = build_optimizers(cfg, tiny_qwen, critic)
    critic_params = {id(p) for g in opt.critic.param_groups for p in g["params"]}
    assert critic_params == {id(p) for p in critic.parameters() if p.requires_grad}
    # linear warm-up: 1/4, 2/4, 3/4, then the full rate
    rates = []
    for _ in range(5):
        rates.append(opt.critic.param_groups[0]["lr"])
        opt.critic.step()
        opt.critic_scheduler.step()
    assert rates == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert build_optimizers(cfg, tiny_qwen, None).critic is None
    with pytest.raises(ValueError, match="critic"):
        build_algorithm(cfg, tiny_qwen, None, opt.policy, None)


@pytest.mark.parametrize("name", ["sao", "ppo"])
@pytest.mark.parametrize("normalize", [True, False])
def test_rules_that_whiten_take_the_moments_through_the_sum_over_ranks(tiny_qwen, name, normalize):
    """The learner's collective reaches whitening (once per step), and nothing else calls it."""
    cfg = AlgorithmConfig(name=name, normalize_advantages=normalize)
    critic = build_critic(cfg, tiny_qwen)
    opt = build_optimizers(cfg, tiny_qwen, critic)
    calls = []
    algo = build_algorithm(cfg, tiny_qwen, critic, opt.policy, opt.critic, opt.critic_scheduler,
                           sum_over_ranks=lambda moments: calls.append(moments) or moments)
    assert algo.step(make_batch(tiny_qwen, [1.0, -1.0]))["skipped_nonfinite"] == 0.0
    assert len(calls) == (1 if normalize else 0)


def test_registry_holds_every_configurable_rule_and_nothing_else():
    configurable = set(get_args(AlgorithmConfig.model_fields["name"].annotation))
    assert set(ALGORITHMS) == configurable == {"sao", "running_mean", "grpo", "ppo"}
    assert {name: algorithm_class(name).needs_critic for name in configurable} == {
        "sao": True, "ppo": True, "running_mean": False, "grpo": False}
    with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
        algorithm_class("nope")


def test_running_mean_forget_restarts_the_baseline(tiny_qwen):
    algo = build("running_mean", tiny_qwen, running_mean_window=3)
    algo.step(make_batch(tiny_qwen, [1.0, 1.0]))
    algo.forget()
    # an empty window again: the batch baselines against its own mean (0 + 4) / 2 = 2, not the old 1
    assert algo.step(make_batch(tiny_qwen, [0.0, 4.0]))["baseline"] == 2.0


def test_an_epoch_refused_after_an_applied_one_ends_the_step_as_trained(tiny_qwen):
    """The first epoch's update (lr 1e25) moves the weights to where the second's loss is not finite:
    the policy has moved, so the step is not 'refused' (that says no weight moved)."""
    cfg = AlgorithmConfig(name="grpo", group_size=2, ppo_epochs=2, use_dis=False, policy_lr=1e25)
    algo = build_algorithm(cfg, tiny_qwen, None, build_optimizers(cfg, tiny_qwen, None).policy, None)
    before = {n: p.detach().clone() for n, p in tiny_qwen.named_parameters()}
    metrics = algo.step(make_batch(tiny_qwen, [1.0, 0.0], group_ids=[0, 0]))
    assert any(not torch.equal(p, before[n]) for n, p in tiny_qwen.named_parameters())
    assert metrics["policy_updates_done"] == 1.0
    assert metrics["skipped_nonfinite"] == 0.0 and metrics["refused_after_update"] == 1.0


def test_an_update_refused_at_the_first_epoch_refuses_the_step(tiny_qwen, snapshot_weights):
    algo = build("grpo", tiny_qwen, group_size=2, ppo_epochs=2, use_dis=False)
    batch = make_batch(tiny_qwen, [1.0, 0.0], group_ids=[0, 0])
    with torch.no_grad():
        tiny_qwen.lm_head.weight[10, 0] = float("inf")  # the first epoch's loss is not finite
    unchanged = snapshot_weights(tiny_qwen)
    metrics = algo.step(batch)
    assert metrics["skipped_nonfinite"] == 1.0 and metrics["policy_updates_done"] == 0.0
    unchanged()


def test_ppos_adv_mean_is_after_whitening_like_saos(tiny_qwen):
    algo = build("ppo", tiny_qwen, normalize_advantages=True)
    metrics = algo.step(make_batch(tiny_qwen, [1.0, 3.0, 2.0]))
    assert metrics["adv_mean"] == pytest.approx(0.0, abs=1e-6)  # whitened advantages: mean 0
