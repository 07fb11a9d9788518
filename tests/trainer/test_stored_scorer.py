"""The gate's scorer on a real model: log-ratios, the KL from the starting policy, and the
candidate's log-probs kept between the two within a decision."""

from __future__ import annotations

import math

import pytest
import torch

from online_sao.batch import collate
from online_sao.gate import sequence_log_ratio
from online_sao.modeling import load_policy, load_tokenizer
from online_sao.train_step import policy_logprobs
from online_sao.weights import FileWeightStore, WeightsRef
from tests.trainer.traffic import sample_traffic
from trainer.deploy import RecentWindow, StoredPolicyScorer, candidate_kl
from trainer.rollouts import interaction_to_rollout


def test_scorer_gives_zero_log_ratio_for_the_version_that_sampled(tmp_path, tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    store = FileWeightStore(str(tmp_path / "weights"))
    ref = store.save(1, policy.state_dict())
    rollouts = [interaction_to_rollout(i, 0.5, {}, -1) for i in sample_traffic(policy, 5, prefix="s")]
    scorer = StoredPolicyScorer(store, tiny_model_dir, "float32", load_tokenizer(tiny_model_dir).pad_token_id, chunk=2)
    log_ratio = scorer.log_ratios(ref, rollouts)
    assert log_ratio.shape == (5,)
    assert log_ratio.abs().max() < 1e-4
    with torch.no_grad():  # another version is another distribution
        policy.lm_head.weight.mul_(1.5)
    assert scorer.log_ratios(store.save(2, policy.state_dict()), rollouts).abs().max() > 1e-2


def test_scorer_kl_from_the_starting_policy(tmp_path, tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    store = FileWeightStore(str(tmp_path / "weights"))
    rollouts = [interaction_to_rollout(i, 0.5, {}, -1) for i in sample_traffic(policy, 4, prefix="k")]
    scorer = StoredPolicyScorer(store, tiny_model_dir, "float32", load_tokenizer(tiny_model_dir).pad_token_id, chunk=3)
    same, metrics = scorer.reference_kl(store.save(1, policy.state_dict()), rollouts)
    assert abs(same) < 1e-6 and metrics["kl_tokens"] == sum(r.num_action_tokens for r in rollouts)
    with torch.no_grad():
        policy.lm_head.weight.mul_(1.5)
    moved, metrics = scorer.reference_kl(store.save(2, policy.state_dict()), rollouts)
    assert moved > 1e-3 and metrics["kl_tokens"] > 0
    window = RecentWindow(8)
    window.observe(rollouts)  # every rollout sampled by version 0
    assert candidate_kl(scorer, (0, store.save(3, policy.state_dict())), window) == pytest.approx(moved)
    # a candidate (version 1) none of whose answers is in the window: nothing to score
    assert math.isnan(candidate_kl(scorer, (1, WeightsRef(1, "unused", "0" * 64)), window))



def test_scorer_runs_the_candidates_answers_once_per_decision(tmp_path, tiny_model_dir):
    """The KL monitor and then the gate score the candidate on the same answers: the second call
    runs no rollout through the model again, and gives what a plain padded pass gives."""
    policy = load_policy(tiny_model_dir)
    store = FileWeightStore(str(tmp_path / "weights"))
    rollouts = [interaction_to_rollout(i, 0.5, {}, -1) for i in sample_traffic(policy, 5, prefix="c")]
    pad = load_tokenizer(tiny_model_dir).pad_token_id
    with torch.no_grad():
        policy.lm_head.weight.mul_(1.3)
    candidate, champion = store.save(1, policy.state_dict()), store.save(2, load_policy(tiny_model_dir).state_dict())
    scorer = StoredPolicyScorer(store, tiny_model_dir, "float32", pad, chunk=2)
    scorer.reference_kl(candidate, rollouts)
    assert scorer.forwarded == 5
    ratios = scorer.log_ratios(candidate, rollouts)
    assert scorer.forwarded == 5  # nothing new to run
    batch = collate(rollouts, pad)
    with torch.no_grad():
        plain = sequence_log_ratio(policy_logprobs(policy, batch), batch.rollout_logprobs, batch.action_mask)
    assert torch.allclose(ratios, plain, atol=1e-4)
    scorer.log_ratios(champion, rollouts[:3])  # another version: its own pass, the candidate's forgotten
    assert scorer.forwarded == 8
    scorer.log_ratios(candidate, rollouts[:1])
    assert scorer.forwarded == 9
