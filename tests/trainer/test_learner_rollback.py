"""The learner's roll-back to a champion whose checkpoint is no longer kept: its weights come from
the weight store, and the KL's EMA reference starts from them and the policy's optimiser without
moments (both stayed the rejected line's and pulled the restored policy back toward it)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from online_sao.config import RewardConfig
from online_sao.weights import WeightsRef
from tests.trainer.test_plasticity import constant_linear, trainables
from trainer.distributed import DistContext
from trainer.learner import roll_back
from trainer.startup import LearnerModels
from trainer.state import Position


class Publisher:
    def __init__(self, champion: dict[str, torch.Tensor]) -> None:
        self.store = SimpleNamespace(load=lambda location, checksum: champion)
        self.published: list[int] = []

    def publish(self, state, version: int, step: int) -> None:
        self.published.append(version)

    def pin(self, versions) -> None:
        pass


def test_a_roll_back_without_the_champions_checkpoint_restarts_the_ema_reference_and_the_moments():
    t = trainables(ema_reference=True)
    t.policy(torch.ones(1, 2)).sum().backward()
    t.optimizers.policy.step()  # the rejected line's moments
    assert t.optimizers.policy.state
    for model, value in ((t.policy, 5.0), (t.ema_reference, 4.0)):  # the rejected line and its EMA
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
    champion = constant_linear(2.0).state_dict()
    publisher = Publisher(champion)
    rank0 = SimpleNamespace(writer=SimpleNamespace(wait=lambda: None),
                            checkpointer=SimpleNamespace(checkpoint_of_version=lambda version: None),
                            releases=SimpleNamespace(publisher=publisher, pinned_versions=lambda: []),
                            feed=SimpleNamespace(joiner=SimpleNamespace(cfg=RewardConfig())),
                            counters={"rollbacks": 0})
    models = LearnerModels(trainables=t, pad_token_id=0, vocab_size=2)
    at = Position(step=7, version=9, checkpointed_step=7, changed_since_publish=True)
    roll_back(models, at, rank0, DistContext(rank=0, world_size=1, device=torch.device("cpu")),
              WeightsRef(3, "mem://3", "0" * 64))
    for model in (t.policy, t.ema_reference):
        assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in model.parameters())
    assert not t.optimizers.policy.state
    assert publisher.published == [10] and at.rolled_back_as == 10 and rank0.counters["rollbacks"] == 1
