"""Value pre-training on synthetic rollouts whose reward is decided by their tokens."""

from __future__ import annotations

import dataclasses
import math
import random
import weakref

import pytest
import torch

from online_sao.algorithms import build_optimizers
from online_sao.batch import Rollout, collate
from online_sao.config import AlgorithmConfig
from online_sao.critic import ValueModel
from tests.trainer.fsdp_worker import VOCAB, tiny_policy
from trainer.pretrain import VALIDATION_EVERY, _held_out_fit, pretrain_critic

PAD_ID = 0


def _rollouts(count: int, seed: int = 0) -> list[Rollout]:
    """Every token of a rollout is drawn from the low or from the high half of the
    vocabulary; the final reward is +1 for low rollouts and -1 for high ones, so the
    value of each action token is decided by tokens the critic sees."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        low = i % 2 == 0
        prompt = [rng.randrange(1, VOCAB // 2) if low else rng.randrange(VOCAB // 2, VOCAB) for _ in range(4)]
        response = [rng.randrange(1, VOCAB // 2) if low else rng.randrange(VOCAB // 2, VOCAB)
                    for _ in range(rng.randint(3, 6))]
        tokens = prompt + response
        mask = [False] * len(prompt) + [True] * len(response)
        out.append(Rollout(f"r{i}", tokens, mask, [-1.0 if m else 0.0 for m in mask], [0] * len(tokens),
                           {len(tokens) - 1: 1.0 if low else -1.0}))
    return out


def _critic_and_optimizer(critic_lr: float) -> tuple[ValueModel, torch.optim.Optimizer, AlgorithmConfig]:
    cfg = AlgorithmConfig(critic_lr=critic_lr)
    policy = tiny_policy(0)
    critic = ValueModel.from_policy(policy, freeze_attention=cfg.freeze_critic_attention)
    return critic, build_optimizers(cfg, policy, critic).critic, cfg


def test_pretraining_raises_held_out_explained_variance_and_stops_by_patience():
    torch.manual_seed(0)
    critic, optimizer, cfg = _critic_and_optimizer(critic_lr=3e-2)  # high: few epochs on a tiny model
    rollouts = _rollouts(20)
    metrics = pretrain_critic(critic, optimizer, rollouts, cfg, PAD_ID, max_epochs=30, patience=2, batch_size=8)

    assert metrics["ev_before"] == pytest.approx(0.0, abs=1e-6)  # a zero head predicts 0 everywhere
    assert metrics["ev_after"] > 0.9
    assert metrics["stopped_by_patience"] == 1.0
    assert metrics["epochs"] < 30
    assert metrics["best_epoch"] == metrics["epochs"] - 2
    assert metrics["held_out_rollouts"] == 20 // VALIDATION_EVERY
    assert metrics["skipped_updates"] == 0.0

    # the critic keeps its best epoch's weights: measuring it again gives the reported EV
    held_out = [r for i, r in enumerate(rollouts) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1]
    critic.eval()
    assert _held_out_fit(critic, [collate(held_out, PAD_ID)], cfg)[0] == pytest.approx(
        metrics["ev_after"], abs=1e-5)


def test_no_improvement_stops_after_patience_epochs_and_changes_nothing():
    critic, optimizer, cfg = _critic_and_optimizer(critic_lr=3e-3)
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # a critic that cannot learn: EV stays where it started
    before = {k: v.clone() for k, v in critic.state_dict().items()}
    metrics = pretrain_critic(critic, optimizer, _rollouts(20), cfg, PAD_ID, max_epochs=20, patience=3)
    assert metrics["epochs"] == 3.0 and metrics["best_epoch"] == 0.0
    assert metrics["ev_after"] == metrics["ev_before"]
    assert all(torch.equal(before[k], v) for k, v in critic.state_dict().items())


def test_with_every_answer_rated_alike_the_epochs_are_compared_by_held_out_squared_error():
    """Explained variance is undefined when the targets do not vary: no epoch counted as better, and
    the critic went back to its cold weights after learning the reward's level."""
    critic, optimizer, cfg = _critic_and_optimizer(critic_lr=1e-2)
    rollouts = [dataclasses.replace(r, rewards={position: 1.0 for position in r.rewards}) for r in _rollouts(40)]
    metrics = pretrain_critic(critic, optimizer, rollouts, cfg, PAD_ID, max_epochs=20, patience=2)
    assert math.isnan(metrics["ev_before"]) and metrics["chosen_by_loss"] == 1.0
    assert metrics["held_out_loss_before"] == pytest.approx(1.0)  # a zero head's values against returns of 1
    assert metrics["best_epoch"] >= 1 and metrics["held_out_loss_after"] < 0.1
    held_out = [r for i, r in enumerate(rollouts) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1]
    critic.eval()
    batch = collate(held_out, PAD_ID)
    with torch.no_grad():
        values = critic(batch.input_ids, batch.attention_mask)[batch.action_mask]
    assert float((values - 1.0).square().mean()) == pytest.approx(metrics["held_out_loss_after"], rel=1e-4)


def test_pretraining_steps_the_warm_up_so_it_trains_at_the_configured_rate():
    cfg = AlgorithmConfig(critic_lr=1e-3, critic_warmup_steps=4)
    policy = tiny_policy(0)
    critic = ValueModel.from_policy(policy, freeze_attention=cfg.freeze_critic_attention)
    opts = build_optimizers(cfg, policy, critic)
    rates = []
    opts.critic.register_step_pre_hook(lambda opt, args, kwargs: rates.append(opt.param_groups[0]["lr"]))
    metrics = pretrain_critic(critic, opts.critic, _rollouts(20), cfg, PAD_ID, max_epochs=2, patience=2,
                              batch_size=4, scheduler=opts.critic_scheduler)
    # 16 training rollouts in batches of 4: 4 updates per epoch; the warm-up ramps over the first 4
    assert metrics["skipped_updates"] == 0.0 and len(rates) == 4 * metrics["epochs"]
    assert rates[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert rates[4:] == pytest.approx([1e-3] * (len(rates) - 4))
    # the online steps that follow continue at the configured rate
    assert metrics["lr_last"] == opts.critic.param_groups[0]["lr"] == pytest.approx(1e-3)


def test_pretraining_needs_action_tokens():
    critic, optimizer, cfg = _critic_and_optimizer(critic_lr=3e-3)
    no_actions = Rollout("x", [1, 2, 3], [False] * 3, [0.0] * 3, [0] * 3, {2: 1.0})
    with pytest.raises(ValueError, match="action tokens"):
        pretrain_critic(critic, optimizer, [no_actions], cfg, PAD_ID)


def test_pretraining_trains_each_part_in_its_own_mode_and_leaves_them_so():
    """The learner trains a critic whose copied body stays in eval (no dropout where the policy had
    none when it sampled); pre-training must not turn the body's dropout on, during or after."""
    critic, optimizer, cfg = _critic_and_optimizer(critic_lr=1e-2)
    critic.train()
    critic.backbone.eval()
    modes = {name: module.training for name, module in critic.named_modules()}
    seen = []
    critic.backbone.register_forward_pre_hook(lambda module, _: seen.append((critic.training, module.training)))
    pretrain_critic(critic, optimizer, _rollouts(10), cfg, PAD_ID, max_epochs=2, patience=2, batch_size=8)
    assert {name: module.training for name, module in critic.named_modules()} == modes
    assert (True, False) in seen and (True, True) not in seen  # trained with its body in eval


MOST_BATCHES_AT_ONCE = 2
"""Batches a fit may hold collated at once: the one it uses and the one before, whose last reference
(a loop's variable) goes when the next takes its place."""


def test_pretraining_collates_each_batch_when_it_uses_it(monkeypatch):
    """Every training and held-out batch was collated onto the device up front: a long history
    filled the device before the first update. Counted by weak references to each batch's tokens."""
    import trainer.pretrain

    batches: list[weakref.ref] = []
    most = [0]

    def collating(*args, **kwargs):
        most[0] = max(most[0], sum(ref() is not None for ref in batches))
        batch = collate(*args, **kwargs)
        batches.append(weakref.ref(batch.input_ids))
        return batch

    monkeypatch.setattr(trainer.pretrain, "collate", collating)
    critic, optimizer, cfg = _critic_and_optimizer(critic_lr=1e-2)
    metrics = pretrain_critic(critic, optimizer, _rollouts(40), cfg, PAD_ID, max_epochs=2, patience=2, batch_size=4)
    assert most[0] <= MOST_BATCHES_AT_ONCE
    assert metrics["train_rollouts"] == 32 and len(batches) > 10  # 8 training and 2 held-out batches an epoch
