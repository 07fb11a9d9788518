"""Packed forward passes: the layout, and the same log-probs, values, losses and gradients as the
padded path on a ragged batch, for the policy and the critic."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from online_sao.advantages import length_adaptive_lambda, skip_observation_gae
from online_sao.algorithms import build_algorithm, build_critic, build_optimizers
from online_sao.batch import Rollout, collate, pack_layout, padded_share, row_capacity
from online_sao.config import AlgorithmConfig
from online_sao.critic import ValueModel
from online_sao.losses import dis_policy_loss, value_loss
from online_sao.modeling import PACKING_VERDICT_ATTRIBUTE
from online_sao import train_step
from online_sao.train_step import policy_forward, policy_logprobs

VOCAB = 97
LENGTHS = [5, 2, 3, 7, 1]
ATOL, RTOL = 1e-5, 1e-4
"""Float32: packed and padded runs multiply the same numbers in matrices of other shapes; observed
differences are about 1e-7 (values, log-probs) and 1e-7 relative (gradients)."""


def test_rollouts_are_packed_first_fit_by_decreasing_length():
    mask = torch.tensor([[i < n for i in range(7)] for n in LENGTHS])
    layout = pack_layout(mask)
    # 7 fills row 0; 5 opens row 1; 3 does not fit beside it and opens row 2; 2 joins row 1; 1 joins row 2
    assert layout.rows == 3 and layout.capacity == 7 and layout.real_tokens == 18
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 0, 0, 0, 0]]
    assert layout.padding_share == pytest.approx(3 / 21) and padded_share(mask) == pytest.approx(17 / 35)
    ids = torch.arange(1, 36).view(5, 7) * mask
    packed = layout.pack(ids, fill=-1)
    assert packed.tolist() == [[22, 23, 24, 25, 26, 27, 28], [1, 2, 3, 4, 5, 8, 9], [15, 16, 17, 29, -1, -1, -1]]
    assert torch.equal(layout.unpack(packed), ids)
    features = torch.randn(5, 7, 3) * mask[..., None]
    assert torch.equal(layout.unpack(layout.pack(features)), features)


def test_a_longer_row_is_chosen_where_it_saves_a_row_within_the_attention_budget():
    # rows of 6 (the longest): 6 | 5 | 2 -> 3 rows, 18 slots, attention 3 x 36 = 108;
    # rows of 7: 6 | 5 2 -> 2 rows, 14 slots, attention 2 x 49 = 98 <= 108
    assert row_capacity([2, 5, 6]) == 7
    layout = pack_layout(torch.tensor([[i < n for i in range(6)] for n in (2, 5, 6)]))
    assert (layout.rows, layout.capacity) == (2, 7)
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0], [0, 1, 2, 3, 4, 0, 1]]
    assert layout.padding_share == pytest.approx(1 / 14)
    # 5 3 3 3 3 at 5: every 3 opens a row (5 rows, 25 slots, attention 125); at 6: 5 | 3 3 | 3 3
    # (18 slots, attention 108); two rows need 9 tokens each, over the budget (2 x 81 > 125)
    assert row_capacity([3, 3, 3, 3, 5]) == 6
    # 7 | 1 1 at 7 (14 slots, attention 98); one row of 9 holds all (9 slots, attention 81)
    assert row_capacity([1, 1, 7]) == 9
    # 4 | 3 at 4 (8 slots, attention 32); one row of 7 would be 7 slots but 49 of attention
    assert row_capacity([3, 4]) == 4
    assert row_capacity([4]) == 4


def test_a_batch_that_is_not_right_padded_is_refused():
    with pytest.raises(ValueError, match="right-padded"):
        pack_layout(torch.tensor([[True, False, True], [True, True, True]]))
    with pytest.raises(ValueError, match="right-padded"):
        pack_layout(torch.tensor([[False, True, True]]))


def qwen2(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True))


def llama(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True))


def ragged_batch(policy: torch.nn.Module, lengths: list[int], seed: int = 0, top_ps: tuple[float, ...] = (1.0,)):
    """Rollouts of the given lengths (prompt of 2, then actions; one with an observation between two
    action runs), two temperatures, rewards mid-way and at the end; behaviour log-probs near the policy's."""
    gen = torch.Generator().manual_seed(seed)
    rollouts = []
    for i, n in enumerate(lengths):
        ids = torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        mask = [t >= 2 for t in range(n)]
        if n > 8:
            mask[5] = mask[6] = False  # an observation inside the trajectory
        rewards = {n - 1: float(torch.randn((), generator=gen))}
        if n > 8:
            rewards[6] = 0.5
        temperature = 0.7 if i % 2 else 1.0
        top_p = top_ps[i % len(top_ps)]
        rollouts.append(Rollout(f"r{i}", ids, mask, [0.0] * n, [0] * n, rewards, temperatures=[temperature] * n,
                                top_ps=[top_p] * n))
    batch = collate(rollouts, pad_token_id=0, policy_version=1)
    with torch.no_grad():
        noise = 0.3 * torch.randn(batch.input_ids.shape, generator=gen)
        batch.rollout_logprobs = (policy_logprobs(policy, batch, packed=False) + noise) * batch.action_mask
    return batch


def sao_losses(policy, critic, batch, packed: bool, cfg: AlgorithmConfig):
    """The value and policy losses of one SAO step, as online_sao.sao computes them."""
    mask = batch.action_mask
    values = critic(batch.input_ids, batch.attention_mask, packed=packed)
    _, targets = skip_observation_gae(batch.rewards, values, mask, cfg.gamma, cfg.lambda_critic)
    critic_loss, _ = value_loss(values, targets, mask, None)
    lam = length_adaptive_lambda(mask.sum(dim=1), cfg.lambda_alpha)
    advantages, _ = skip_observation_gae(batch.rewards, values.detach(), mask, cfg.gamma, lam)
    logprobs = policy_logprobs(policy, batch, packed=packed)
    policy_loss, _ = dis_policy_loss(logprobs, batch.rollout_logprobs, advantages, mask, cfg.eps_low, cfg.eps_high,
                                     None)
    return values, logprobs, critic_loss, policy_loss


@pytest.mark.parametrize("lengths", [[3, 17, 6, 11, 4, 9, 2, 15], [12, 10, 4]], ids=["rows-of-longest", "longer-rows"])
@pytest.mark.parametrize("make_policy", [qwen2, llama], ids=["qwen2", "llama"])
def test_packed_and_padded_paths_agree_on_losses_and_gradients(make_policy, lengths):
    cfg = AlgorithmConfig()
    policy = make_policy(0)
    critic = ValueModel.from_policy(policy, freeze_attention=cfg.freeze_critic_attention)
    with torch.no_grad():  # a non-zero head, so values (and their gradients) are not trivially 0
        critic.head.weight.normal_(0, 0.5)
    batch = ragged_batch(policy, lengths)
    layout = pack_layout(batch.attention_mask)
    assert layout.rows < len(lengths)  # several rollouts share a row
    # 12 | 10 | 4 in rows of 12 against 12 | 10 4 in rows of 14: rows longer than the padded batch's
    assert layout.capacity == {17: 17, 12: 14}[max(lengths)]

    results = {}
    for packed in (False, True):
        values, logprobs, critic_loss, policy_loss = sao_losses(policy, critic, batch, packed, cfg)
        critic_grads = torch.autograd.grad(critic_loss, critic.trainable_parameters())
        policy_grads = torch.autograd.grad(policy_loss, list(policy.parameters()))
        results[packed] = (values.detach(), logprobs.detach(), critic_loss.item(), policy_loss.item(),
                           critic_grads, policy_grads)
    padded, packed = results[False], results[True]
    n = torch.tensor(lengths)
    defined = torch.arange(batch.input_ids.shape[1])[None] <= n[:, None]  # values exist for positions 1 .. length
    defined[:, 0] = False
    torch.testing.assert_close(packed[0][defined], padded[0][defined], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(packed[1], padded[1], atol=ATOL, rtol=RTOL)  # both 0 on padding
    assert packed[2] == pytest.approx(padded[2], rel=RTOL) and packed[3] == pytest.approx(padded[3], rel=RTOL)
    for got, want in zip(packed[4] + packed[5], padded[4] + padded[5]):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert any(g.abs().max() > 1e-3 for g in padded[4]) and any(g.abs().max() > 1e-3 for g in padded[5])


def test_the_forward_passes_do_not_see_across_rollouts_in_a_row():
    """Changing one rollout changes no other rollout's log-probs, though they share a packed row."""
    policy = qwen2(1)
    batch = ragged_batch(policy, [6, 2, 3])
    layout = pack_layout(batch.attention_mask)
    # rollout 2 (length 3) starts the second row and rollout 1 (length 2) follows it there
    assert layout.rows == 2 and layout.position_ids[1].tolist() == [0, 1, 2, 0, 1, 0]
    before = policy_logprobs(policy, batch).detach()
    batch.input_ids[2, :3] = torch.tensor([5, 6, 7])
    after = policy_logprobs(policy, batch).detach()
    assert torch.equal(after[1], before[1]) and torch.equal(after[0], before[0])
    assert not torch.equal(after[2], before[2])


def test_a_step_reports_its_padding_share():
    cfg = AlgorithmConfig()
    policy = qwen2(2)
    critic = build_critic(cfg, policy)
    opts = build_optimizers(cfg, policy, critic)
    algorithm = build_algorithm(cfg, policy, critic, opts.policy, opts.critic, opts.critic_scheduler)
    batch = ragged_batch(policy, [3, 17, 6, 11, 4, 9, 2, 15])
    metrics = algorithm.step(batch)
    # 67 tokens: 8 padded rows of 17 (51% padding) against 4 packed rows of 17 (1.5%)
    assert metrics["padding_share_unpacked"] == pytest.approx(1 - 67 / 136)
    assert metrics["padding_share"] == pytest.approx(1 - 67 / 68)
    assert metrics["skipped_nonfinite"] == 0.0


def test_the_padding_share_is_that_of_the_layout_the_forward_passes_run_on():
    batch = ragged_batch(qwen2(0), [3, 17, 6, 11, 4, 9, 2, 15])
    # 67 tokens: packed 17 | 15 2 | 11 6 | 9 4 3 (4 rows of 17), padded 8 rows of 17
    packed = train_step.batch_metrics(batch, policy_packed=True)
    padded = train_step.batch_metrics(batch, policy_packed=False)
    assert packed["padding_share"] == pytest.approx(1 - 67 / 68)
    assert padded["padding_share"] == pytest.approx(1 - 67 / 136)
    assert packed["padding_share_unpacked"] == padded["padding_share_unpacked"] == pytest.approx(1 - 67 / 136)
    assert "padding_share_critic" not in train_step.batch_metrics(batch, policy_packed=True, critic_packed=True)
    mixed = train_step.batch_metrics(batch, policy_packed=True, critic_packed=False)
    assert mixed["padding_share"] == pytest.approx(1 - 67 / 68)
    assert mixed["padding_share_critic"] == pytest.approx(1 - 67 / 136)


@pytest.mark.parametrize("name", ["sao", "ppo"])
def test_a_critic_run_padded_beside_a_packed_policy_reports_its_own_share(name):
    cfg = AlgorithmConfig(name=name)
    policy = qwen2(2)
    critic = build_critic(cfg, policy)
    setattr(critic, PACKING_VERDICT_ATTRIBUTE, False)  # as if its probe had failed: it runs padded
    opts = build_optimizers(cfg, policy, critic)
    algorithm = build_algorithm(cfg, policy, critic, opts.policy, opts.critic, opts.critic_scheduler)
    metrics = algorithm.step(ragged_batch(policy, [3, 17, 6, 11, 4, 9, 2, 15]))
    assert metrics["padding_share"] == pytest.approx(1 - 67 / 68)
    assert metrics["padding_share_critic"] == pytest.approx(1 - 67 / 136)


def test_packed_and_padded_logprobs_agree_under_top_p():
    """Each token keeps its own top-p in packed rows: the nucleus log-probs (and which tokens fall
    outside the nucleus, -inf) are the padded path's."""
    policy = qwen2(0)
    batch = ragged_batch(policy, [3, 17, 6, 11, 4, 9, 2, 15], top_ps=(1.0, 0.9, 0.5))
    with torch.no_grad():
        padded = policy_logprobs(policy, batch, packed=False)
        packed = policy_logprobs(policy, batch, packed=True)
    outside = torch.isneginf(padded)
    assert outside.any() and (~outside & batch.action_mask).any()
    assert torch.equal(torch.isneginf(packed), outside)
    torch.testing.assert_close(packed[~outside], padded[~outside], atol=ATOL, rtol=RTOL)


def test_the_lm_head_runs_only_where_an_action_token_is_predicted(monkeypatch):
    """The plain-head path gives the whole model's log-probs, entropies and gradients, with the head
    run on one position per action token; a family outside PLAIN_HEAD_MODEL_TYPES runs whole."""
    policy = qwen2(3)
    batch = ragged_batch(policy, [3, 17, 6, 11, 4, 9, 2, 15], top_ps=(1.0, 0.8))
    assert train_step.policy_packs(policy)  # the packing probe's forwards (once per model) before counting
    head_rows = []
    policy.get_output_embeddings().register_forward_hook(
        lambda module, args, out: head_rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))

    def run():
        logprobs, entropy = policy_forward(policy, batch, with_entropy=True)
        finite = torch.where(torch.isfinite(logprobs), logprobs, 0.0)
        grads = torch.autograd.grad(finite.sum() + entropy.sum(), list(policy.parameters()))
        return logprobs.detach(), entropy.detach(), grads

    selective = run()
    assert head_rows == [int(batch.action_mask.sum())]
    monkeypatch.setattr(train_step, "PLAIN_HEAD_MODEL_TYPES", frozenset())
    head_rows.clear()
    whole = run()
    layout = pack_layout(batch.attention_mask)
    assert head_rows == [layout.rows * layout.capacity]
    assert torch.equal(torch.isneginf(selective[0]), torch.isneginf(whole[0]))
    assert (selective[0][~batch.action_mask] == 0).all() and (selective[1][~batch.action_mask] == 0).all()
    kept = torch.isfinite(whole[0])
    torch.testing.assert_close(selective[0][kept], whole[0][kept], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(selective[1], whole[1], atol=ATOL, rtol=RTOL)
    for got, want in zip(selective[2], whole[2]):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
