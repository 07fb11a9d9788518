"""Value pre-training (SAO.md section 3): fit the critic on logged rollouts of the
starting policy before any policy update, so the first advantages do not come
from a cold critic.

The rollouts are split deterministically into a training part and a held-out
part (every VALIDATION_EVERY-th rollout). Each epoch is one pass of value-loss
updates over the training part in minibatches; after it the explained variance
of the critic's values against the targets is measured on the held-out part.
Training stops when that has not improved for ``patience`` epochs (or after
``max_epochs``), and the critic is put back to its best epoch's weights. When the held-out
targets do not vary (every logged answer rated alike), explained variance is undefined and the
epochs are compared by held-out squared error: the level is then all there is to learn (compared
by explained variance, every epoch was rejected and the critic went back to its cold weights).

Each batch is collated onto the device when it is used, training and held-out ones alike, so the
device holds one batch of rollouts at a time: collated up front, a long history filled it before the
first update.

In a multi-rank learner every rank must pass the same (unsharded) rollouts
(checked; ValueError otherwise): the work is replicated, FSDP's average of
identical gradients is the single-process gradient, and every rank takes the
same early-stopping decision.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from online_sao.advantages import skip_observation_gae
from online_sao.batch import Rollout, RolloutBatch, collate
from online_sao.config import AlgorithmConfig
from online_sao.losses import explained_variance, value_loss
from online_sao.train_step import guarded_update

VALIDATION_EVERY = 5
"""Every 5th rollout is held out: explained variance on rollouts the critic has
not fitted is what says whether it generalises, not whether it memorised."""
MIN_VALIDATION_ROLLOUTS = 2
"""With fewer held-out rollouts than this the training rollouts are measured
instead (reported as ``ev_on_training_data = 1``)."""
MIN_EV_IMPROVEMENT = 1e-4
"""An epoch counts as an improvement only when explained variance rises by more
than this: rounding-level gains must not keep a converged fit running."""
MIN_LOSS_IMPROVEMENT = 1e-4
"""When the held-out targets do not vary (every logged answer rated alike: a constant judge, or
every reward defaulted), explained variance is undefined and epochs are compared by held-out
squared error instead; one counts as an improvement only when it falls by more than this share."""
DEFAULT_BATCH_SIZE = 16
"""Rollouts per critic update."""


def _chunks(rollouts: list[Rollout], batch_size: int) -> list[list[Rollout]]:
    """The rollouts of each batch, not collated yet (:func:`_on_device` does it when the batch is used)."""
    return [rollouts[i:i + batch_size] for i in range(0, len(rollouts), batch_size)]


def _on_device(chunk: list[Rollout], pad_token_id: int, device: torch.device) -> RolloutBatch:
    return collate(chunk, pad_token_id).to(device)


def _each_on_device(chunks: list[list[Rollout]], pad_token_id: int, device: torch.device) -> Iterator[RolloutBatch]:
    """The batches one after another, each collated when the one before is done with."""
    return (_on_device(chunk, pad_token_id, device) for chunk in chunks)


def _targets(batch: RolloutBatch, values: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
    """Critic targets of the learner (lambda_critic; Monte-Carlo returns when it is 1)."""
    _, returns = skip_observation_gae(batch.rewards, values, batch.action_mask, cfg.gamma, cfg.lambda_critic)
    return returns


@torch.no_grad()
def _held_out_fit(critic: nn.Module, batches: Iterable[RolloutBatch], cfg: AlgorithmConfig) -> tuple[float, float]:
    """Explained variance (NaN when undefined) and mean squared error of the values against their
    targets, over the action tokens of all batches pooled."""
    values, targets = [], []
    for batch in batches:
        v = critic(batch.input_ids, batch.attention_mask)
        g = _targets(batch, v, cfg)
        values.append(v[batch.action_mask].double())
        targets.append(g[batch.action_mask].double())
    v, g = torch.cat(values).view(1, -1), torch.cat(targets).view(1, -1)
    return explained_variance(v, g, torch.ones_like(v, dtype=torch.bool)), float((g - v).square().mean())


def _require_same_rollouts_on_every_rank(rollouts: list[Rollout], device: torch.device) -> None:
    """Ranks with different rollouts would run different numbers of FSDP collectives
    and stop at different epochs, which hangs the group: refuse instead."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    digest = float(zlib.crc32("\n".join(r.interaction_id for r in rollouts).encode()))
    bounds = torch.tensor([digest, -digest], dtype=torch.float64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    if bounds[0].item() != -bounds[1].item():
        raise ValueError("value pre-training needs the same rollouts on every rank (pass them unsharded)")


def _trainable_state(critic: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters that train (frozen ones never change and are not copied).

    Read through ``state_dict()``: after a forward, FSDP2 leaves the root module's
    parameters unsharded and ``named_parameters`` would hand out those full
    tensors, while ``state_dict()`` always gives this rank's DTensor shards, the
    form ``load_state_dict`` accepts."""
    trainable = {name for name, p in critic.named_parameters() if p.requires_grad}
    return {name: t.detach().clone() for name, t in critic.state_dict().items() if name in trainable}


def _improves(ev: float, best: float) -> bool:
    return not math.isnan(ev) and (math.isnan(best) or ev > best + MIN_EV_IMPROVEMENT)


def _lowers(loss: float, best: float) -> bool:
    return math.isfinite(loss) and (not math.isfinite(best) or loss < best * (1 - MIN_LOSS_IMPROVEMENT))


def pretrain_critic(
    critic: nn.Module,
    critic_optimizer: torch.optim.Optimizer,
    rollouts: Iterable[Rollout],
    cfg: AlgorithmConfig,
    pad_token_id: int,
    max_epochs: int = 20,
    patience: int = 2,
    batch_size: int = DEFAULT_BATCH_SIZE,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> dict[str, float]:
    """Fit ``critic`` (a :class:`~online_sao.critic.ValueModel`) to the value targets
    of ``rollouts`` until held-out explained variance stops improving (held-out squared error
    when the held-out targets do not vary at first: :data:`MIN_LOSS_IMPROVEMENT`).

    Updates use the value loss with ``cfg.max_grad_norm`` clipping; a non-finite
    update is refused and counted. ``scheduler`` is the critic's learning-rate schedule
    (its warm-up): stepped after every applied update, so pre-training runs at the
    configured rate once the warm-up is done, and the online steps continue the schedule
    where pre-training left it. (Without it the optimiser keeps whatever rate it has: a
    warm-up scheduler that is never stepped holds it at 1/warm-up of the configured rate.)
    Returns metrics (the caller prefixes them): explained
    variance before and after (the best epoch, whose weights the critic keeps),
    epochs run, best epoch, whether patience stopped it, the last training value
    loss, skipped updates and the rollout counts.
    """
    if max_epochs < 1 or patience < 1 or batch_size < 1:
        raise ValueError("max_epochs, patience and batch_size must be at least 1")
    data = [r for r in rollouts if r.num_action_tokens > 0]
    if not data:
        raise ValueError("value pre-training needs rollouts with action tokens")
    held_out = [r for i, r in enumerate(data) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1]
    training = [r for i, r in enumerate(data) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1]
    on_training_data = len(held_out) < MIN_VALIDATION_ROLLOUTS
    if on_training_data:
        held_out, training = data, data

    device = next(critic.parameters()).device
    _require_same_rollouts_on_every_rank(data, device)
    train_chunks, eval_chunks = _chunks(training, batch_size), _chunks(held_out, batch_size)
    generator = torch.Generator().manual_seed(0)  # a fixed shuffle keeps pre-training reproducible

    # each part's own mode, as the learner trains it (a critic's copied body stays in eval: no dropout
    # where the policy had none when it sampled); critic.train() would turn the body's dropout on
    modes = [(module, module.training) for module in critic.modules()]
    critic.eval()  # no dropout in evaluation
    ev_before, loss_before = _held_out_fit(critic, _each_on_device(eval_chunks, pad_token_id, device), cfg)
    by_loss = math.isnan(ev_before)  # targets without variance: nothing to explain, a level to learn
    best, best_loss = ev_before, loss_before
    best_state = _trainable_state(critic)
    best_epoch, since_best, epochs, skipped, last_loss = 0, 0, 0, 0, math.nan
    for epoch in range(1, max_epochs + 1):
        _restore_modes(modes)
        for index in torch.randperm(len(train_chunks), generator=generator).tolist():
            batch = _on_device(train_chunks[index], pad_token_id, device)
            values = critic(batch.input_ids, batch.attention_mask)
            loss, _ = value_loss(values, _targets(batch, values, cfg), batch.action_mask)
            result = guarded_update(loss, critic_optimizer, cfg.max_grad_norm, scheduler)
            skipped += not result.stepped
            last_loss = float(loss.detach())
        critic.eval()
        epochs = epoch
        ev, loss = _held_out_fit(critic, _each_on_device(eval_chunks, pad_token_id, device), cfg)
        if _lowers(loss, best_loss) if by_loss else _improves(ev, best):
            best, best_loss, best_epoch, since_best = ev, loss, epoch, 0
            best_state = _trainable_state(critic)
        else:
            since_best += 1
            if since_best >= patience:
                break
    restored = critic.load_state_dict(best_state, strict=False)
    if restored.unexpected_keys:
        raise RuntimeError(f"restoring the best critic: unexpected keys {restored.unexpected_keys}")
    _restore_modes(modes)
    return {
        "ev_before": ev_before,
        "ev_after": best,
        "held_out_loss_before": loss_before,
        "held_out_loss_after": best_loss,
        "chosen_by_loss": float(by_loss),
        "epochs": float(epochs),
        "best_epoch": float(best_epoch),
        "stopped_by_patience": float(since_best >= patience),
        "value_loss_last": last_loss,
        "skipped_updates": float(skipped),
        "train_rollouts": float(len(training)),
        "held_out_rollouts": float(len(held_out)),
        "ev_on_training_data": float(on_training_data),
        "lr_last": float(critic_optimizer.param_groups[0]["lr"]),
    }


def _restore_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    for module, training in modes:
        module.training = training
