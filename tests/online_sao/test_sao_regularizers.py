"""The KL and entropy terms inside the learning rules' steps."""

import pytest
import torch

from online_sao.algorithms import build_algorithm, build_optimizers
from online_sao.config import AlgorithmConfig
from online_sao.critic import ValueModel
from online_sao.losses import action_entropy
from online_sao.regularizers import build_reference
from tests.online_sao.test_sao import make_batch


def _algorithm(policy, **overrides):
    cfg = AlgorithmConfig(policy_lr=1e-3, critic_lr=5e-3, critic_warmup_steps=0, **overrides)
    critic = ValueModel.from_policy(policy) if cfg.name in ("sao", "ppo") else None
    reference = build_reference(cfg, policy)
    opt = build_optimizers(cfg, policy, critic)
    return build_algorithm(cfg, policy, critic, opt.policy, opt.critic, opt.critic_scheduler, reference=reference)


def test_paper_faithful_config_adds_no_term(tiny_qwen):
    cfg = AlgorithmConfig()
    assert cfg.kl_beta == 0.0 and cfg.entropy_alpha == 0.0 and build_reference(cfg, tiny_qwen) is None
    metrics = _algorithm(tiny_qwen).step(make_batch(tiny_qwen))
    assert not {"kl_ref", "kl_loss", "entropy", "entropy_loss"} & metrics.keys()


def test_sao_policy_loss_is_dis_plus_kl_plus_entropy_terms(tiny_qwen):
    algo = _algorithm(tiny_qwen, kl_beta=0.1, entropy_alpha=0.01)
    batch = make_batch(tiny_qwen)
    with torch.no_grad():  # the padded forward, by hand: the step runs the packed one
        logits = tiny_qwen(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits
        entropy = action_entropy(logits, batch.action_mask, batch.temperatures, batch.top_ps)
        expected_entropy = float(entropy[batch.action_mask].mean())
    metrics = algo.step(batch)
    # the policy is still its reference at the first step: k3 = 0 on every token
    assert metrics["kl_ref"] == pytest.approx(0.0, abs=1e-7) and metrics["kl_loss"] == pytest.approx(0.0, abs=1e-8)
    assert metrics["entropy"] == pytest.approx(expected_entropy, rel=1e-5)
    assert metrics["entropy_loss"] == pytest.approx(-0.01 * expected_entropy, rel=1e-5)
    # on-policy batch: every ratio is 1 and kept, so the DIS loss is minus the mean advantage
    assert metrics["policy_loss"] == pytest.approx(-metrics["adv_mean"] + metrics["entropy_loss"], abs=1e-6)
    # after one update the policy has left its reference: the next step measures a positive KL
    assert algo.step(make_batch(tiny_qwen))["kl_ref"] > 0.0


def test_initial_reference_stays_the_starting_policy(tiny_qwen):
    algo = _algorithm(tiny_qwen, kl_beta=0.1)
    start = {n: p.detach().clone() for n, p in tiny_qwen.named_parameters()}
    algo.step(make_batch(tiny_qwen))
    for name, param in algo.regularizer.reference.named_parameters():
        assert torch.equal(param, start[name]), name
    assert not any(p.requires_grad for p in algo.regularizer.reference.parameters())


def test_ema_reference_moves_its_rate_toward_the_policy_after_each_update(tiny_qwen):
    algo = _algorithm(tiny_qwen, kl_beta=0.1, kl_reference="ema", kl_ema_rate=0.25)
    name = "model.layers.0.mlp.down_proj.weight"
    start = dict(tiny_qwen.named_parameters())[name].detach().clone()
    algo.step(make_batch(tiny_qwen))
    policy_now = dict(tiny_qwen.named_parameters())[name]
    reference_now = dict(algo.regularizer.reference.named_parameters())[name]
    assert not torch.equal(policy_now, start)
    torch.testing.assert_close(reference_now, 0.75 * start + 0.25 * policy_now.detach())


def test_ema_reference_moves_toward_the_policy_on_a_critic_rewarm_step_too(tiny_qwen):
    algo = _algorithm(tiny_qwen, kl_beta=0.1, kl_reference="ema", kl_ema_rate=0.25, critic_rewarm_rollouts=4)
    algo.forget()  # as a drift restart does: the next step re-warms the critic
    name = "model.layers.0.mlp.down_proj.weight"
    start = dict(tiny_qwen.named_parameters())[name].detach().clone()
    assert algo.step(make_batch(tiny_qwen))["critic_rewarm"] == 1.0
    policy_now = dict(tiny_qwen.named_parameters())[name]
    reference_now = dict(algo.regularizer.reference.named_parameters())[name]
    assert not torch.equal(policy_now, start)
    torch.testing.assert_close(reference_now, 0.75 * start + 0.25 * policy_now.detach())


@pytest.mark.parametrize("name", ["running_mean", "grpo", "ppo"])
def test_baselines_add_the_same_terms(tiny_qwen, name):
    algo = _algorithm(tiny_qwen, name=name, kl_beta=0.1, entropy_alpha=0.01)
    batch = make_batch(tiny_qwen)
    batch.group_ids = torch.zeros_like(batch.group_ids)  # one group of two, for grpo
    metrics = algo.step(batch)
    assert metrics["skipped_nonfinite"] == 0.0
    assert {"kl_ref", "kl_loss", "entropy", "entropy_loss"} <= metrics.keys()


def test_kl_penalty_without_a_reference_is_refused(tiny_qwen):
    cfg = AlgorithmConfig(kl_beta=0.1)
    critic = ValueModel.from_policy(tiny_qwen)
    opt = build_optimizers(cfg, tiny_qwen, critic)
    with pytest.raises(ValueError, match="reference"):
        build_algorithm(cfg, tiny_qwen, critic, opt.policy, opt.critic, opt.critic_scheduler)


def test_packed_forward_gives_the_padded_forwards_entropy(tiny_qwen):
    from online_sao.batch import Rollout, collate
    from online_sao.train_step import policy_forward

    # (tokens, actions, temperature, top_p): two short ones share a row
    shapes = [(9, 5, 0.7, 1.0), (4, 2, 1.3, 0.9), (5, 3, 1.0, 1.0)]
    rollouts = [Rollout(f"p{i}", [(7 * i + j) % 60 + 1 for j in range(n)], [False] * (n - a) + [True] * a,
                        [0.0] * n, [0] * n, {n - 1: 1.0}, temperatures=[temp] * n, top_ps=[top_p] * n)
                for i, (n, a, temp, top_p) in enumerate(shapes)]
    batch = collate(rollouts, pad_token_id=0)
    with torch.no_grad():
        packed_logprobs, packed = policy_forward(tiny_qwen, batch, packed=True, with_entropy=True)
        padded_logprobs, padded = policy_forward(tiny_qwen, batch, packed=False, with_entropy=True)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-6)
    assert bool((padded[batch.action_mask] > 0).all()) and bool((padded[~batch.action_mask] == 0).all())
    assert policy_forward(tiny_qwen, batch)[1] is None
