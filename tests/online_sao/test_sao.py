import math

import pytest
import torch

from online_sao.algorithms import build_algorithm, build_optimizers
from online_sao.batch import Rollout, collate
from online_sao.config import AlgorithmConfig
from online_sao.critic import ValueModel
from online_sao.sao import SAO
from online_sao.train_step import guarded_update, policy_logprobs

PROMPT = [1, 2, 3, 4]
GOOD = [10, 11, 12, 13]
BAD = [20, 21, 22, 23]


def make_batch(policy, rewards=(1.0, -1.0), temperature=1.0, versions=(5, 5), policy_version=5):
    """Two on-policy rollouts of one prompt: behaviour log-probs are the policy's own."""
    rollouts = []
    for i, (tokens, reward, version) in enumerate(zip([GOOD, BAD], rewards, versions)):
        ids = PROMPT + tokens
        mask = [False] * len(PROMPT) + [True] * len(tokens)
        rollouts.append(Rollout(f"r{i}", ids, mask, [0.0] * len(ids), [version] * len(ids),
                                {len(ids) - 1: reward}, temperatures=[temperature] * len(ids)))
    batch = collate(rollouts, pad_token_id=0, policy_version=policy_version)
    with torch.no_grad():
        batch.rollout_logprobs = policy_logprobs(policy, batch) * batch.action_mask
    return batch


def make_sao(policy, **overrides):
    cfg = AlgorithmConfig(policy_lr=1e-3, critic_lr=5e-3, critic_warmup_steps=0, **overrides)
    critic = ValueModel.from_policy(policy, freeze_attention=cfg.freeze_critic_attention)
    opt = build_optimizers(cfg, policy, critic)
    return build_algorithm(cfg, policy, critic, opt.policy, opt.critic, opt.critic_scheduler)


def sequence_logprob(policy, batch, row):
    with torch.no_grad():
        return float((policy_logprobs(policy, batch) * batch.action_mask)[row].sum())


def test_one_step_raises_the_probability_of_the_rewarded_continuation(tiny_qwen):
    algo = make_sao(tiny_qwen)
    assert isinstance(algo, SAO)
    batch = make_batch(tiny_qwen)
    good_before, bad_before = sequence_logprob(tiny_qwen, batch, 0), sequence_logprob(tiny_qwen, batch, 1)
    critic_before = {n: p.detach().clone() for n, p in algo.critic.named_parameters()}
    metrics = algo.step(batch)
    assert metrics["skipped_nonfinite"] == 0.0
    assert sequence_logprob(tiny_qwen, batch, 0) > good_before
    assert sequence_logprob(tiny_qwen, batch, 1) < bad_before
    # on-policy batch: every ratio is 1, every token kept
    assert metrics["kept_frac"] == 1.0 and metrics["ratio_mean"] == pytest.approx(1.0)
    # the critic's MLP moved, its attention did not
    changed = {n for n, p in algo.critic.named_parameters() if not torch.equal(p, critic_before[n])}
    assert any(".mlp." in n for n in changed) and "head.weight" in changed
    assert not any("self_attn" in n for n in changed)


def test_step_metrics(tiny_qwen):
    algo = make_sao(tiny_qwen, critic_after_metrics=True)
    batch = make_batch(tiny_qwen, temperature=0.7, versions=(3, 5), policy_version=5)
    metrics = algo.step(batch)
    expected = {"policy_loss", "value_loss", "value_loss_after", "explained_variance", "kept_frac",
                "masked_below_frac", "masked_above_frac", "ratio_mean", "approx_kl", "policy_grad_norm",
                "critic_grad_norm", "version_lag_mean", "version_lag_max", "reward_mean", "adv_mean",
                "num_rollouts", "num_action_tokens", "lambda_mean", "skipped_nonfinite",
                "time_critic_forward_s", "time_policy_backward_s", "time_arithmetic_s"}
    assert expected <= metrics.keys()
    assert all(isinstance(v, float) for v in metrics.values())
    # behaviour log-probs were taken at temperature 0.7: the step must use it too (ratio 1)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    # lags 5 - 3 = 2 on the first rollout's 4 tokens, 0 on the second's
    assert metrics["version_lag_mean"] == 1.0 and metrics["version_lag_max"] == 2.0
    # 4 action tokens each, lambda = 1 - 1/(1.5 * 4) = 5/6
    assert metrics["lambda_mean"] == pytest.approx(5 / 6)
    assert metrics["num_action_tokens"] == 8.0 and metrics["reward_mean"] == 0.0
    # two critic updates toward the same returns: the updated critic fits them better
    assert metrics["value_loss_after"] < metrics["value_loss"]


def test_nan_reward_changes_no_weight(tiny_qwen, snapshot_weights):
    algo = make_sao(tiny_qwen)
    batch = make_batch(tiny_qwen, rewards=(float("nan"), 1.0))
    unchanged = snapshot_weights(tiny_qwen, algo.critic)
    metrics = algo.step(batch)
    assert metrics["skipped_nonfinite"] == 1.0
    unchanged()
    assert not algo.policy_optimizer.state and not algo.critic_optimizer.state


def test_overflowing_loss_is_refused_by_the_guard(tiny_qwen, snapshot_weights):
    # finite inputs, but (V - 1e38)^2 overflows float32: the guard, not the input check, refuses it
    algo = make_sao(tiny_qwen)
    batch = make_batch(tiny_qwen, rewards=(1e38, 1e38))
    unchanged = snapshot_weights(tiny_qwen, algo.critic)
    metrics = algo.step(batch)
    assert metrics["skipped_nonfinite"] == 1.0 and "nonfinite_inputs" not in metrics
    unchanged()


def test_nonfinite_policy_gradient_leaves_the_policy_unchanged(tiny_qwen, snapshot_weights):
    algo = make_sao(tiny_qwen)
    batch = make_batch(tiny_qwen)
    with torch.no_grad():
        tiny_qwen.model.layers[0].mlp.down_proj.weight[0, 0] = float("inf")
    unchanged = snapshot_weights(tiny_qwen)
    metrics = algo.step(batch)
    assert metrics["skipped_nonfinite"] == 1.0
    assert not math.isfinite(metrics["policy_grad_norm"])
    unchanged()


def test_guarded_update_refuses_nonfinite_loss_and_gradients():
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.AdamW([param], lr=0.1, weight_decay=0.1)
    result = guarded_update((param * float("nan")).sum(), opt, max_grad_norm=1.0)
    assert not result.stepped and math.isnan(result.grad_norm)
    result = guarded_update((param * torch.tensor([float("inf"), 1.0])).sum(), opt, max_grad_norm=1.0)
    assert not result.stepped and not math.isfinite(result.grad_norm)
    # AdamW with weight decay would move the weights even with zero gradients: no step ran at all
    assert param.tolist() == [1.0, 2.0] and not opt.state and param.grad is None
    result = guarded_update((param * 3.0).sum(), opt, max_grad_norm=1.0)
    # grad (3, 3) has norm 3 sqrt 2, reported before clipping
    assert result.stepped and result.grad_norm == pytest.approx(3 * math.sqrt(2))
    assert param.tolist() != [1.0, 2.0]


def test_a_phase_sync_is_called_around_every_timed_phase(tiny_qwen):
    """A benchmark on a GPU sets ``phase_sync`` (torch.cuda.synchronize) so that each phase's time
    is the device's work: it must bracket every phase the step times, and change nothing else."""
    algo = make_sao(tiny_qwen)
    calls = []
    algo.phase_sync = lambda: calls.append(1)
    metrics = algo.step(make_batch(tiny_qwen))
    phases = [k for k in metrics if k.startswith("time_")]
    assert {"time_critic_forward_s", "time_critic_backward_s", "time_critic_optimizer_s", "time_policy_forward_s",
            "time_policy_backward_s", "time_policy_optimizer_s", "time_arithmetic_s"} <= set(phases)
    assert len(calls) >= 2 * len(phases) and len(calls) % 2 == 0  # before and after each entry of a phase
    algo.phase_sync = None
    calls.clear()
    algo.step(make_batch(tiny_qwen))
    assert calls == []


@pytest.mark.parametrize("order", ["judge_then_fit", "fit_then_judge"])
def test_critic_lr_is_the_mean_rate_the_steps_critic_updates_used(tiny_qwen, order):
    """Warm-up over 10 updates of 1e-3, K = 2: step 1's updates run at 1e-4 and 2e-4, step 2's at 3e-4
    and 4e-4. The metric was read after the updates had stepped the warm-up: 3e-4 at step 1."""
    cfg = AlgorithmConfig(policy_lr=1e-3, critic_lr=1e-3, critic_warmup_steps=10, critic_updates=2,
                          critic_order=order)
    critic = ValueModel.from_policy(tiny_qwen, freeze_attention=cfg.freeze_critic_attention)
    opt = build_optimizers(cfg, tiny_qwen, critic)
    algo = build_algorithm(cfg, tiny_qwen, critic, opt.policy, opt.critic, opt.critic_scheduler)
    first = algo.step(make_batch(tiny_qwen))
    assert first["critic_updates_done"] == 2.0 and first["critic_lr"] == pytest.approx(1.5e-4)
    assert algo.step(make_batch(tiny_qwen))["critic_lr"] == pytest.approx(3.5e-4)


def test_a_step_refused_at_the_policy_update_keeps_its_critic_updates(tiny_qwen, snapshot_weights):
    """What ALGORITHM.md section 8, the learner's warning and the ledger say of a refused step: the
    policy did not change, the K critic updates that ran before the refused policy update stay."""
    algo = make_sao(tiny_qwen)  # the critic is copied from the policy before the policy is broken
    batch = make_batch(tiny_qwen)
    with torch.no_grad():
        tiny_qwen.model.layers[0].mlp.down_proj.weight[0, 0] = float("inf")
    policy_unchanged = snapshot_weights(tiny_qwen)
    critic_before = {n: p.detach().clone() for n, p in algo.critic.named_parameters()}
    metrics = algo.step(batch)
    assert metrics["skipped_nonfinite"] == 1.0 and metrics["critic_updates_done"] == 2.0
    policy_unchanged()
    assert any(not torch.equal(p, critic_before[n]) for n, p in algo.critic.named_parameters())
