"""Restoring the learner's training state (trainer/state.py) from a checkpoint of another
configuration: a restart after switching the KL's reference to an EMA, a rule with a critic after
one without, or which critic parameters train, crashed at every start (a bare KeyError, or torch's
"Missing optimizer state for parameter"). The rates a restore keeps are tested in
test_resume_hyperparameters.py."""

from __future__ import annotations

import logging

import torch
from torch import nn

from online_sao.algorithm import Algorithm
from online_sao.algorithms import build_optimizers
from online_sao.config import RewardConfig
from online_sao.config.algorithm import AlgorithmConfig
from trainer.checkpoint import Checkpointer
from trainer.distributed import DistContext
from trainer.join import RewardJoiner
from trainer.state import Progress, Trainables, gather_training_state, restore_training_state

ONE_PROCESS = DistContext(0, 1, torch.device("cpu"))


class Idle(Algorithm):
    def step(self, batch):
        raise AssertionError("not trained here")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))


def _trainables(seed: int, with_critic: bool = True, ema: bool = False, frozen_first_layer: bool = True) -> Trainables:
    """A policy and (``with_critic``) a critic whose first layer trains unless ``frozen_first_layer``
    (as ``algorithm.freeze_critic_attention`` leaves the critic's attention out of its optimiser)."""
    policy, critic = _model(seed), _model(seed + 1) if with_critic else None
    if critic is not None:
        critic[0].requires_grad_(not frozen_first_layer)
    cfg = AlgorithmConfig(optimizer_kernel="for_loop")
    return Trainables(policy, critic, build_optimizers(cfg, policy, critic), Idle(),
                      _model(seed + 2) if ema else None)


def _train_once(t: Trainables) -> None:
    loss = t.policy(torch.ones(1, 2)).sum()
    if t.critic is not None:
        loss = loss + t.critic(torch.ones(1, 2)).sum()
    loss.backward()
    for optimizer in (t.optimizers.policy, t.optimizers.critic):
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def _checkpointed(tmp_path, t: Trainables) -> Checkpointer:
    _train_once(t)
    Checkpointer(tmp_path).save(gather_training_state(t, RewardJoiner(RewardConfig(), 10), Progress(step=1),
                                                      ONE_PROCESS))
    return Checkpointer(tmp_path)


def _restore(checkpointer: Checkpointer, t: Trainables) -> Progress:
    return restore_training_state(checkpointer, t, RewardJoiner(RewardConfig(), 10), ONE_PROCESS)


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_an_ema_reference_missing_from_the_checkpoint_starts_from_the_restored_policy(tmp_path, caplog):
    """``algorithm.kl_reference: ema`` switched on after a run without it: KeyError('reference')."""
    old = _trainables(seed=0)
    checkpointer = _checkpointed(tmp_path, old)
    new = _trainables(seed=10, ema=True)
    with caplog.at_level(logging.WARNING, logger="trainer.state"):
        assert _restore(checkpointer, new).step == 1
    assert _same_weights(new.policy, old.policy) and _same_weights(new.ema_reference, old.policy)
    assert "has no EMA reference" in caplog.text
    _train_once(new)  # the reference is a model of its own, not the policy's tensors
    assert not _same_weights(new.ema_reference, new.policy)


def test_a_critic_missing_from_the_checkpoint_starts_fresh(tmp_path, caplog):
    """A rule with a critic (sao) after one without (running_mean, grpo): KeyError('critic')."""
    checkpointer = _checkpointed(tmp_path, _trainables(seed=0, with_critic=False))
    new, fresh = _trainables(seed=10), _trainables(seed=10)
    with caplog.at_level(logging.WARNING, logger="trainer.state"):
        _restore(checkpointer, new)
    assert _same_weights(new.critic, fresh.critic) and not new.optimizers.critic.state
    assert "has no critic" in caplog.text
    _train_once(new)  # and it trains


def test_an_optimizer_state_lacking_a_parameter_trained_now_starts_empty(tmp_path, caplog):
    """``algorithm.freeze_critic_attention`` turned off: torch refused the critic's optimizer state
    ("Missing optimizer state for parameter ...") at every restart."""
    old = _trainables(seed=0, frozen_first_layer=True)
    checkpointer = _checkpointed(tmp_path, old)
    new = _trainables(seed=10, frozen_first_layer=False)
    with caplog.at_level(logging.WARNING, logger="trainer.full_state"):
        _restore(checkpointer, new)
    assert _same_weights(new.critic, old.critic) and _same_weights(new.policy, old.policy)
    assert not new.optimizers.critic.state  # started empty
    assert [float(s["step"]) for s in new.optimizers.policy.state.values()] == [1.0] * 4  # restored
    assert "critic optimizer state lacks parameters it trains now" in caplog.text
    _train_once(new)
    assert len(new.optimizers.critic.state) == 4


def test_an_optimizer_state_of_more_parameters_restores_those_trained_now(tmp_path):
    """``algorithm.freeze_critic_attention`` turned on: the moments of the parameters still trained
    are the checkpoint's."""
    old = _trainables(seed=0, frozen_first_layer=False)
    checkpointer = _checkpointed(tmp_path, old)
    new = _trainables(seed=10, frozen_first_layer=True)
    _restore(checkpointer, new)
    restored, saved = new.optimizers.critic.state, old.optimizers.critic.state
    assert set(restored) == {new.critic[1].weight, new.critic[1].bias}
    torch.testing.assert_close(restored[new.critic[1].weight]["exp_avg"], saved[old.critic[1].weight]["exp_avg"])
    _train_once(new)


def _with_a_tied_parameter(t: Trainables) -> Trainables:
    """``t`` whose policy has a third layer whose weight is a parameter of the policy's too, under a
    second name (as a language model's head and embedding share one)."""
    t.policy.append(nn.Linear(1, 1))
    t.policy.register_parameter("tied", t.policy[2].weight)
    t.optimizers = build_optimizers(AlgorithmConfig(optimizer_kernel="for_loop"), t.policy, t.critic)
    return t


def test_an_optimizer_state_of_the_same_parameters_is_restored_without_a_warning(tmp_path, caplog):
    """A tied parameter is named once in the state and twice in the model: still the same parameters."""
    checkpointer = _checkpointed(tmp_path, _with_a_tied_parameter(_trainables(seed=0)))
    new = _with_a_tied_parameter(_trainables(seed=10))
    with caplog.at_level(logging.WARNING, logger="trainer.full_state"):
        _restore(checkpointer, new)
    assert "other parameters" not in caplog.text
    assert len(new.optimizers.policy.state) == 6 and len(new.optimizers.critic.state) == 2
