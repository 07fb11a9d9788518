"""The packing probe: a model whose packed rows' rollouts attend to each other (OPT) is found and run
padded, so its log-ratios on rollouts it sampled are 0 and its critic's values are each rollout's own;
a model that keeps them apart (Qwen2) stays on packed rows. Each model is probed once."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from online_sao.algorithms import build_algorithm, build_optimizers
from online_sao.batch import Rollout, RolloutBatch, collate, pack_layout
from online_sao.config import AlgorithmConfig
from online_sao.critic import ValueModel
from online_sao.train_step import policy_logprobs, policy_packs
from tests.fixtures.models import make_tiny_opt

PROMPT = [5, 17, 9, 30]
RESPONSE_LENGTHS = [24, 3, 5, 4, 6]
"""One long rollout and four short ones: the short ones share packed rows."""
EXACT = 1e-5
"""Float32 rounding of a forward against another of other shapes: about 5e-7 observed."""
LEAK = 1e-3
"""Below what a row whose rollouts see each other gives on these rollouts (about 1e-2 and more)."""


@torch.no_grad()
def sampled_batch(policy: nn.Module, vocab: int = 64) -> RolloutBatch:
    """Rollouts sampled token by token from ``policy`` run on each alone, with each token's log-prob
    as an engine logs it: under the same weights every log-ratio is 0."""
    rollouts = []
    for i, n in enumerate(RESPONSE_LENGTHS):
        generator = torch.Generator().manual_seed(i)
        ids, logprobs = list(PROMPT), [0.0] * len(PROMPT)
        for _ in range(n):
            logp = torch.log_softmax(policy(input_ids=torch.tensor([ids])).logits[0, -1, :vocab].float(), dim=-1)
            token = int(torch.multinomial(logp.exp(), 1, generator=generator))
            ids.append(token)
            logprobs.append(float(logp[token]))
        mask = [False] * len(PROMPT) + [True] * n
        rollouts.append(Rollout(f"r{i}", ids, mask, logprobs, [0] * len(ids), {len(ids) - 1: float(i % 2)}))
    return collate(rollouts, pad_token_id=0)


def opt_policy() -> nn.Module:
    """The tiny OPT, its logits limited to the ids the batch samples (as with tiny_qwen's 64)."""
    return make_tiny_opt(vocab_size=64)


def action_log_ratios(policy: nn.Module, batch: RolloutBatch, packed: bool | None = None) -> torch.Tensor:
    with torch.no_grad():
        return (policy_logprobs(policy, batch, packed=packed) - batch.rollout_logprobs)[batch.action_mask]


def test_a_policy_whose_packed_rollouts_see_each_other_runs_padded_and_says_so(caplog):
    policy = opt_policy()
    batch = sampled_batch(policy)
    assert pack_layout(batch.attention_mask).rows < batch.batch_size  # rollouts share rows
    with caplog.at_level(logging.WARNING, logger="online_sao.modeling"):
        assert action_log_ratios(policy, batch).abs().max() < EXACT
    assert not policy_packs(policy)
    assert "OPTForCausalLM" in caplog.text and "packed row" in caplog.text
    assert action_log_ratios(policy, batch, packed=True).abs().max() > LEAK  # what packing would have given


def test_its_critic_gives_each_rollout_the_values_it_gets_alone():
    policy = opt_policy()
    batch = sampled_batch(policy)
    critic = ValueModel.from_policy(policy, freeze_attention=False)
    nn.init.normal_(critic.head.weight)  # the zero-initialised head would make every value 0
    lengths = batch.attention_mask.sum(dim=1).tolist()
    with torch.no_grad():
        values = critic(batch.input_ids, batch.attention_mask)
        alone = [critic(batch.input_ids[i:i + 1, :n], batch.attention_mask[i:i + 1, :n], packed=False)[0]
                 for i, n in enumerate(lengths)]
        packed = critic(batch.input_ids, batch.attention_mask, packed=True)
    assert not critic.packs()
    assert max(float((values[i, :n] - alone[i]).abs().max()) for i, n in enumerate(lengths)) < EXACT
    assert max(float((packed[i, :n] - alone[i]).abs().max()) for i, n in enumerate(lengths)) > LEAK


def test_an_sao_step_on_it_sees_every_ratio_at_one():
    policy = opt_policy()
    batch = sampled_batch(policy)
    cfg = AlgorithmConfig(freeze_critic_attention=False, eps_low=0.01, eps_high=0.01, critic_warmup_steps=0)
    critic = ValueModel.from_policy(policy, freeze_attention=False)
    optimizers = build_optimizers(cfg, policy, critic)
    algorithm = build_algorithm(cfg, policy, critic, optimizers.policy, optimizers.critic,
                                optimizers.critic_scheduler)
    metrics = algorithm.step(batch)
    assert metrics["kept_frac"] == 1.0
    assert abs(metrics["ratio_mean"] - 1.0) < EXACT and metrics["approx_kl"] < EXACT ** 2


@pytest.mark.parametrize("rule", ["sao", "running_mean"])
def test_a_padded_policys_step_reports_the_padded_share(rule):
    policy = opt_policy()
    batch = sampled_batch(policy)
    cfg = AlgorithmConfig(name=rule, freeze_critic_attention=False)
    critic = ValueModel.from_policy(policy, freeze_attention=False) if rule == "sao" else None
    optimizers = build_optimizers(cfg, policy, critic)
    algorithm = build_algorithm(cfg, policy, critic, optimizers.policy, optimizers.critic,
                                optimizers.critic_scheduler)
    metrics = algorithm.step(batch)
    # rollouts of 28, 7, 9, 8 and 10 tokens (62) run as 5 padded rows of 28, not as 28 | 10 9 8 7
    assert metrics["padding_share"] == pytest.approx(1 - 62 / 140)
    assert metrics["padding_share_unpacked"] == pytest.approx(1 - 62 / 140)
    assert "padding_share_critic" not in metrics  # the critic runs padded too


def test_a_policy_that_keeps_packed_rollouts_apart_stays_packed(tiny_qwen):
    batch = sampled_batch(tiny_qwen)
    critic = ValueModel.from_policy(tiny_qwen)
    assert policy_packs(tiny_qwen) and critic.packs()
    rows = []
    tiny_qwen.base_model.register_forward_pre_hook(lambda _, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                                   with_kwargs=True)
    assert action_log_ratios(tiny_qwen, batch).abs().max() < EXACT
    assert rows == [pack_layout(batch.attention_mask).rows]  # one forward, on the packed rows


def test_each_model_is_probed_once_and_a_copy_keeps_its_verdict():
    policy = opt_policy()
    batch = sampled_batch(policy)
    calls = []
    policy.get_input_embeddings().register_forward_pre_hook(lambda *_: calls.append(1))  # once a forward
    policy_logprobs(policy, batch)
    assert len(calls) == 4  # the probe's three forwards (packed, then each sequence alone), then the batch's
    policy_logprobs(policy, batch)
    assert len(calls) == 5
    copied = copy.deepcopy(policy)  # its body carries the counting hook along; the same architecture
    calls.clear()
    policy_logprobs(copied, batch)
    assert len(calls) == 1


def test_the_probe_leaves_each_parts_mode_and_the_random_state_alone(tiny_qwen):
    critic = ValueModel.from_policy(tiny_qwen.eval())  # the copied body stays in eval, the critic trains
    state = torch.random.get_rng_state()
    critic.packs()
    assert critic.training and not critic.backbone.training
    assert torch.equal(torch.random.get_rng_state(), state)


def test_freezing_a_critics_attention_without_named_feed_forward_blocks_names_the_way_out():
    with pytest.raises(ValueError, match=r"OPTModel.*algorithm\.freeze_critic_attention: false"):
        ValueModel.from_policy(opt_policy())
