"""A restart or roll-back from a checkpoint trains on the configured rates and weight decay, not
the checkpoint's: an operator who lowers ``algorithm.policy_lr`` after a collapse and restarts
must get the lower rate. The optimisers' moments and step counts, and the warm-up's step count,
are the checkpoint's."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from online_sao.algorithm import Algorithm
from online_sao.algorithms import build_optimizers
from online_sao.config import RewardConfig
from online_sao.config.algorithm import AlgorithmConfig
from trainer.checkpoint import Checkpointer
from trainer.distributed import DistContext
from trainer.full_state import load_optimizer_state, optimizer_state
from trainer.join import RewardJoiner
from trainer.state import Progress, Trainables, gather_training_state, restore_training_state, restore_version

ONE_PROCESS = DistContext(0, 1, torch.device("cpu"))


class Idle(Algorithm):
    def step(self, batch):
        raise AssertionError("not trained here")


def _trainables(policy_lr: float, critic_lr: float, weight_decay: float) -> Trainables:
    torch.manual_seed(0)
    policy, critic = nn.Linear(2, 1), nn.Linear(2, 1)
    cfg = AlgorithmConfig(policy_lr=policy_lr, critic_lr=critic_lr, weight_decay=weight_decay,
                          critic_warmup_steps=4, optimizer_kernel="for_loop")
    return Trainables(policy, critic, build_optimizers(cfg, policy, critic), Idle())


def _train(t: Trainables, steps: int) -> None:
    for _ in range(steps):
        (t.policy(torch.ones(1, 2)).sum() + t.critic(torch.ones(1, 2)).sum()).backward()
        t.optimizers.policy.step()
        t.optimizers.critic.step()
        t.optimizers.critic_scheduler.step()
        t.policy.zero_grad(set_to_none=True)
        t.critic.zero_grad(set_to_none=True)


def _checkpoint(tmp_path, t: Trainables, version: int) -> None:
    state = gather_training_state(t, RewardJoiner(RewardConfig(), 10), Progress(step=2, version=version), ONE_PROCESS)
    Checkpointer(tmp_path).save(state)


def _moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [optimizer.state[p][slot] for p in optimizer.param_groups[0]["params"] for slot in ("exp_avg", "exp_avg_sq")]


def test_a_restart_trains_on_the_configured_rates_and_keeps_the_checkpoints_moments(tmp_path, caplog):
    old = _trainables(policy_lr=1e-3, critic_lr=5e-3, weight_decay=0.0)
    _train(old, steps=2)  # the warm-up (4 steps) is half way: two of its steps done
    _checkpoint(tmp_path, old, version=1)

    new = _trainables(policy_lr=1e-5, critic_lr=4e-4, weight_decay=0.1)
    with caplog.at_level(logging.INFO, logger="trainer.full_state"):
        restore_training_state(Checkpointer(tmp_path), new, RewardJoiner(RewardConfig(), 10), ONE_PROCESS)
    policy, critic = new.optimizers.policy.param_groups[0], new.optimizers.critic.param_groups[0]
    assert policy["lr"] == 1e-5 and policy["weight_decay"] == 0.1
    assert critic["initial_lr"] == 4e-4 and critic["weight_decay"] == 0.1
    assert policy["betas"] == (0.9, 0.999) and policy["eps"] == 1e-8
    # linear_warmup: rate * min(1, (done + 1) / 4), at the restored done = 2: 4e-4 * 3/4
    scheduler = new.optimizers.critic_scheduler
    assert scheduler.last_epoch == 2 and scheduler.base_lrs == [4e-4]
    assert critic["lr"] == pytest.approx(3e-4) and scheduler.get_last_lr() == [pytest.approx(3e-4)]
    # one line for each changed value; none for the unchanged betas and eps, nor for the critic's lr,
    # which its warm-up sets from initial_lr
    assert [r.getMessage() for r in caplog.records if r.name == "trainer.full_state"] == [
        "policy lr 0.001 in the checkpoint, 1e-05 configured: using 1e-05",
        "policy weight_decay 0.0 in the checkpoint, 0.1 configured: using 0.1",
        "critic initial_lr 0.005 in the checkpoint, 0.0004 configured: using 0.0004",
        "critic weight_decay 0.0 in the checkpoint, 0.1 configured: using 0.1",
    ]

    for restored, saved in ((new.optimizers.policy, old.optimizers.policy), (new.optimizers.critic, old.optimizers.critic)):
        assert all(m.abs().sum() > 0 for m in _moments(restored))
        for got, want in zip(_moments(restored), _moments(saved)):
            torch.testing.assert_close(got, want)
        assert all(float(restored.state[p]["step"]) == 2.0 for p in restored.param_groups[0]["params"])

    _train(new, steps=1)  # the warm-up ends on the configured rate: 4e-4 * min(1, 4 / 4)
    assert new.optimizers.critic.param_groups[0]["lr"] == pytest.approx(4e-4)


def test_a_roll_back_keeps_the_configured_rates(tmp_path):
    old = _trainables(policy_lr=1e-3, critic_lr=5e-3, weight_decay=0.0)
    _train(old, steps=1)
    _checkpoint(tmp_path, old, version=7)

    live = _trainables(policy_lr=2e-5, critic_lr=8e-4, weight_decay=0.05)
    _train(live, steps=3)  # past the restored step count: the roll-back moves the warm-up back
    assert restore_version(Checkpointer(tmp_path), live, 7, ONE_PROCESS)
    policy, critic = live.optimizers.policy.param_groups[0], live.optimizers.critic.param_groups[0]
    assert policy["lr"] == 2e-5 and policy["weight_decay"] == 0.05 and critic["weight_decay"] == 0.05
    # restored done = 1: 8e-4 * 2/4
    assert live.optimizers.critic_scheduler.base_lrs == [8e-4] and critic["lr"] == pytest.approx(4e-4)


def test_a_restored_optimizer_keeps_its_constructed_betas_and_eps():
    model = nn.Linear(2, 1, bias=False)
    first = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.5, 0.6), eps=1e-3)
    model(torch.ones(1, 2)).sum().backward()
    first.step()
    model.zero_grad(set_to_none=True)  # as after a restart: no gradients yet
    restored = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95), eps=1e-6)
    load_optimizer_state(model, restored, optimizer_state(model, first, ONE_PROCESS), ONE_PROCESS)
    group = restored.param_groups[0]
    assert group["lr"] == 0.01 and group["betas"] == (0.8, 0.95) and group["eps"] == 1e-6
    torch.testing.assert_close(restored.state[model.weight]["exp_avg"], first.state[model.weight]["exp_avg"])
