"""The learner and the gate's scorer on a model directory whose architecture lets the rollouts of a
packed row attend to each other (OPT): the learner probes every model it builds, before sharding,
and the scorer's log-ratios on rollouts the version sampled itself are 0."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from online_sao.batch import collate, pack_layout
from online_sao.modeling import load_policy
from online_sao.train_step import policy_logprobs, policy_packs
from online_sao.weights import FileWeightStore
from tests.fixtures.models import make_tiny_opt, tiny_config
from tests.trainer.traffic import PROMPTS, sample_interaction
from trainer.deploy import StoredPolicyScorer
from trainer.distributed import DistContext
from trainer.rollouts import interaction_to_rollout
from trainer.startup import build_models

RESPONSE_LENGTHS = [24, 3, 5, 4, 6]
"""One long rollout and four short ones: the short ones share packed rows."""


@pytest.fixture(scope="module")
def opt_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A tiny OPT with the tiny default model's tokenizer (same 512 ids)."""
    directory = tmp_path_factory.mktemp("tiny-opt")
    make_tiny_opt(vocab_size=512).save_pretrained(directory)
    for source in tiny_model_dir.iterdir():
        if source.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(source, directory / source.name)
    return directory


def test_the_gates_scorer_gives_zero_log_ratios_for_the_version_that_sampled(tmp_path, opt_model_dir):
    policy = load_policy(opt_model_dir)
    rollouts = [interaction_to_rollout(sample_interaction(policy, PROMPTS[i % 2], f"s{i}", n, seed=i), 0.5)
                for i, n in enumerate(RESPONSE_LENGTHS)]
    store = FileWeightStore(str(tmp_path / "weights"))
    scorer = StoredPolicyScorer(store, opt_model_dir, "float32", pad_token_id=0, chunk=len(rollouts))
    assert scorer.log_ratios(store.save(1, policy.state_dict()), rollouts).abs().max() < 1e-4
    batch = collate(rollouts, pad_token_id=0)  # the scorer's chunk: rollouts share packed rows
    assert pack_layout(batch.attention_mask).rows < len(rollouts)
    with torch.no_grad():  # what a packed run of this model would have given
        leaked = (policy_logprobs(policy, batch, packed=True) - batch.rollout_logprobs)[batch.action_mask]
    assert leaked.abs().max() > 1e-3


def test_the_learner_probes_each_model_it_builds_once(tmp_path, opt_model_dir, caplog):
    cfg = tiny_config(tmp_path, **{"model.path": str(opt_model_dir), "algorithm.freeze_critic_attention": False,
                                   "algorithm.kl_beta": 0.1})
    with caplog.at_level(logging.WARNING, logger="online_sao.modeling"):
        trainables = build_models(cfg, DistContext(rank=0, world_size=1, device=torch.device("cpu"))).trainables
        warned = [r.getMessage() for r in caplog.records]
        assert not policy_packs(trainables.policy) and not trainables.critic.packs()
    # the policy, the critic and the KL reference, each at build; asking again probes nothing
    assert [m.split(" does not")[0] for m in warned] == ["OPTForCausalLM", "the critic's OPTModel",
                                                          "OPTForCausalLM"]
    assert len(caplog.records) == 3
