"""How the learner builds its models: ``trainer.compile`` compiles every model's body in place."""

from __future__ import annotations

import pytest
import torch

from online_sao.modeling import is_compiled
from tests.fixtures.models import tiny_config
from trainer.distributed import DistContext
from trainer.startup import build_models


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
