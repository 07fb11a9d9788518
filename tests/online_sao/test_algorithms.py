"""build_optimizers: every AdamW kernel the config offers makes the same, hand-computed update."""

import pytest
import torch
from torch import nn

from online_sao.algorithms import build_optimizers
from online_sao.config import AlgorithmConfig


@pytest.mark.parametrize("kernel", ["fused", "foreach", "for_loop"])
def test_each_optimizer_kernel_makes_the_hand_computed_first_adamw_step(kernel):
    cfg = AlgorithmConfig(optimizer_kernel=kernel, policy_lr=0.1, critic_lr=0.2, weight_decay=0.01,
                          critic_warmup_steps=10)
    policy, critic = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)
    for model in (policy, critic):
        model.weight.data.fill_(1.0)
        model.weight.grad = torch.full((1, 1), 0.5)
    opts = build_optimizers(cfg, policy, critic)
    opts.policy.step()
    opts.critic.step()  # its warm-up scheduler scales the rate by 1/critic_warmup_steps at construction
    # AdamW's first step: decay p by lr * wd, then m_hat / sqrt(v_hat) = g / |g| = 1, so p -= lr
    assert policy.weight.item() == pytest.approx(1.0 - 0.1 * 0.01 - 0.1, abs=1e-6)  # 0.899
    critic_lr = 0.2 / 10
    assert critic.weight.item() == pytest.approx(1.0 - critic_lr * 0.01 - critic_lr, abs=1e-6)  # 0.97998
    expected = {"fused": (True, None), "foreach": (None, True), "for_loop": (None, False)}[kernel]
    assert (opts.policy.defaults["fused"], opts.policy.defaults["foreach"]) == expected
