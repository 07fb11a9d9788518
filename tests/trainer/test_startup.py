"""How the learner builds its models: ``trainer.compile`` compiles every model's body in place; options
that hold in one process only are refused under several ranks."""

from __future__ import annotations

import pytest
import torch

from online_sao.config import AlgorithmConfig, ConfigError
from online_sao.modeling import is_compiled
from tests.fixtures.models import tiny_config
from trainer.distributed import DistContext
from trainer.startup import build_models, check_options_fit_the_ranks


@pytest.mark.parametrize("compile", [False, True])
def test_the_learner_compiles_its_models_bodies_when_configured(tmp_path, tiny_model_dir, compile):
    # the KL penalty to an EMA reference: a third model to build, and to compile
    cfg = tiny_config(tmp_path, **{"model.path": str(tiny_model_dir), "trainer.compile": compile,
                                   "algorithm.kl_beta": 0.1, "algorithm.kl_reference": "ema"})
    models = build_models(cfg, DistContext(rank=0, world_size=1, device=torch.device("cpu")))
    trainables = models.trainables
    assert [is_compiled(m) for m in (trainables.policy, trainables.critic, trainables.ema_reference)] == [compile] * 3
    # in place: the names a checkpoint and the published weights carry stay the eager model's
    assert all("_orig_mod" not in name for name in trainables.policy.state_dict())


@pytest.mark.parametrize("option, value", [("value_shrinkage_window", 8), ("value_level_window", 8),
                                           ("critic_rewarm_rollouts", 16)])
def test_the_one_process_options_are_refused_under_several_ranks(tmp_path, tiny_model_dir, option, value):
    cfg = tiny_config(tmp_path, **{"model.path": str(tiny_model_dir), f"algorithm.{option}": value})
    with pytest.raises(ConfigError, match=rf"algorithm\.{option} run in one process only.*2 times"):
        build_models(cfg, DistContext(rank=1, world_size=2, device=torch.device("cpu")))  # before any collective
    assert build_models(cfg, DistContext(rank=0, world_size=1, device=torch.device("cpu"))).trainables.critic


def test_the_paper_options_pass_the_rank_check():
    check_options_fit_the_ranks(AlgorithmConfig(), world_size=8)
