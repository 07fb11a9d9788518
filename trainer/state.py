"""Saving and restoring the learner's training state across ranks.

Rank 0 reads and writes checkpoints (:mod:`trainer.checkpoint`); the tensors are
gathered from, and scattered back to, every rank with the collectives of
:mod:`trainer.distributed`, and small JSON values (step, version, algorithm
state) are broadcast with :func:`broadcast_json`. Every function here is
collective: all ranks call it in the same order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from online_sao.algorithm import Algorithm
from online_sao.algorithms import Optimizers
from online_sao.config import ConfigError
from streams.base import TopicPartition
from trainer.checkpoint import Checkpoint, Checkpointer, LearnerState
from trainer.distributed import DistContext, broadcast_json
from trainer.full_state import full_state_dict, load_full_state_dict, load_optimizer_state, optimizer_state
from trainer.join import RewardJoiner

log = logging.getLogger(__name__)

MISMATCHES_NAMED = 3
"""How many mismatching parameters a :class:`CheckpointMismatch` names: enough to tell two
architectures or sizes apart, and the error stays one line."""


class CheckpointMismatch(ConfigError):
    """The checkpoint's policy does not fit the model built from ``model.path`` (another architecture
    or size): ``load_state_dict(strict=True)`` raised a 30-line traceback for it at every start."""


@dataclass
class Trainables:
    """What a learner step changes besides the join buffer."""

    policy: nn.Module
    critic: nn.Module | None
    optimizers: Optimizers
    algorithm: Algorithm
    ema_reference: nn.Module | None = None
    """The KL penalty's reference when it is an EMA of the policy (it changes with training and is
    checkpointed); None when there is none or it is the fixed starting policy."""


@dataclass
class Position:
    """Where the learner loop stands; the same on every rank."""

    step: int
    """Steps trained since the learner first started (a checkpoint carries it)."""
    version: int
    """Newest published policy version."""
    checkpointed_step: int
    """Step of the newest checkpoint."""
    changed_since_publish: bool
    """Whether the policy may differ from the newest published version: not on a fresh start
    (serving starts on these weights); after a restart the checkpointed weights may never
    have been published."""
    steps_here: int = 0
    """Steps trained by this process."""
    publish_due: bool = False
    """Publish after the next step whatever ``trainer.publish_every`` says: the store holds versions
    newer than the checkpoint (published, then lost in a crash), so ``version`` names weights this
    policy does not have, and a checkpoint before the next publish would carry that name."""
    rolled_back_as: int | None = None
    """A roll-back restored the champion and published it again as this version, and no checkpoint
    holds the restored state yet: the registry is told the roll-back is carried out once one does
    (before, the newest checkpoint was still the rejected policy's line)."""


@dataclass
class Progress:
    """Rank 0's bookkeeping that a checkpoint carries besides tensors and the join buffer."""

    step: int = 0
    version: int = 0
    offsets: dict[TopicPartition, int] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    mlflow_run_id: str | None = None
    protected_versions: list[int] = field(default_factory=list)
    candidate: dict[str, Any] = field(default_factory=dict)


def restore_training_state(checkpointer: Checkpointer | None, trainables: Trainables, joiner: RewardJoiner,
                           ctx: DistContext, drift: Any = None) -> Progress:
    """Load the newest checkpoint into models, optimisers, algorithm, the drift detector's books
    (``drift``: the learner's DriftResponse, if any) and (rank 0) the joiner. Returns its
    progress: complete on rank 0, step and version elsewhere; a fresh :class:`Progress` when
    there is no checkpoint."""
    ckpt = checkpointer.resume() if ctx.is_main else None
    shared = _shared(ckpt, ctx)
    if shared is None:
        return Progress()
    if ctx.is_main:  # a model.path changed since is not read: say so, as nothing else would
        log.info("resuming the policy of the checkpoint of step %d (model.path's weights are not used; "
                 "to start from them, point trainer.checkpoint_dir at an empty directory)", shared["step"])
    load_trainables(ckpt, shared, trainables, ctx)
    rescaled = _reward_definition_changed(shared, joiner.cfg.definition(), drift is not None, ctx)
    if rescaled:
        trainables.algorithm.forget()
    if drift is not None and shared.get("drift") and not rescaled:
        drift.load_state_dict(shared["drift"])
    if ckpt is None:
        return Progress(step=shared["step"], version=shared["version"])
    joiner.load_state_dict(ckpt.state.joiner, memory=ckpt.id_memory)
    s = ckpt.state
    return Progress(s.step, s.version, dict(s.offsets), dict(s.counters), s.mlflow_run_id,
                    list(s.protected_versions), dict(s.candidate))


def _reward_definition_changed(shared: dict[str, Any], definition: str, drift: bool, ctx: DistContext) -> bool:
    """Whether the checkpoint's rewards were defined otherwise than today's (``reward.*``: another range,
    sources, aggregation, ``reward.revision``). Its reward statistics are then on another scale: a
    rescaled judge (0..10 to 0..1) made the drift detector see a fall at the first step and reset the
    policy to its start, and the rules' baselines mixed both scales. Decided and said on rank 0 (the
    others may pass any ``definition``). Collective."""
    saved = shared.get("reward_definition", "")
    changed = bool(saved) and saved != definition
    if ctx.is_main and changed:
        log.warning("the checkpoint of step %d learned from rewards of another definition (%s; now %s: the "
                    "reward.* settings or reward.revision changed): the learning rule's reward statistics start "
                    "over%s; the critic keeps its values, on the old scale until it fits the new rewards",
                    shared["step"], saved, definition, ", and so do the drift detector's books" if drift else "")
    return bool(broadcast_json(changed, ctx))


def restore_version(checkpointer: Checkpointer | None, trainables: Trainables, version: int,
                    ctx: DistContext, reward_definition: str = "") -> bool:
    """A whole roll-back: policy, critic, optimisers, scheduler and algorithm state from the
    checkpoint of published ``version`` (rank 0 finds it). The join buffer, offsets, counters
    and ledger stay as they are: the learner goes on reading where it is. A checkpoint learned
    under another ``reward_definition`` than the learner's now (rank 0's) leaves the rule's reward
    statistics empty (:func:`_reward_definition_changed`). Returns False on every rank, changing
    nothing, when no checkpoint of that version is kept."""
    ckpt = checkpointer.checkpoint_of_version(version) if ctx.is_main else None
    shared = _shared(ckpt, ctx)
    if shared is None:
        return False
    load_trainables(ckpt, shared, trainables, ctx)
    if _reward_definition_changed(shared, reward_definition, False, ctx):  # a champion of before the change
        trainables.algorithm.forget()
    return True


def _shared(ckpt: Checkpoint | None, ctx: DistContext) -> dict[str, Any] | None:
    """Rank 0's checkpoint's small JSON values, and the names of its models, on every rank (None: no
    checkpoint)."""
    shared = None
    if ckpt is not None:
        # a checkpoint from before the definition was kept: the gate's window names it too
        definition = ckpt.state.reward_definition or ckpt.state.candidate.get("reward_definition", "")
        shared = {"step": ckpt.state.step, "version": ckpt.state.version, "algorithm": ckpt.state.algorithm,
                  "scheduler": ckpt.optimizers.get("critic_scheduler"), "drift": ckpt.state.drift,
                  "reward_definition": definition,
                  "models": sorted(ckpt.models), "policy_shapes": _shapes(ckpt.models["policy"])}
    return broadcast_json(shared, ctx)


def _shapes(state: dict[str, Any]) -> dict[str, list[int]]:
    """Each tensor's (full: a sharded parameter's global) shape, by name."""
    return {name: list(tensor.shape) for name, tensor in state.items()}


def check_policy_fits(policy: nn.Module, checkpoint_shapes: dict[str, list[int]]) -> None:
    """Raise :class:`CheckpointMismatch` naming the first parameters that differ (missing from the
    checkpoint, not in the model, or of another shape) when the checkpoint's policy is not one of
    ``policy``'s architecture and size. Every rank decides alike: the shapes are rank 0's, broadcast."""
    own = _shapes(policy.state_dict())
    differences = [f"{name} {checkpoint_shapes[name]} in the checkpoint, {shape} in the model"
                   for name, shape in own.items() if name in checkpoint_shapes and checkpoint_shapes[name] != shape]
    differences += [f"{name} only in the model" for name in own if name not in checkpoint_shapes]
    differences += [f"{name} only in the checkpoint" for name in checkpoint_shapes if name not in own]
    if differences:
        more = len(differences) - MISMATCHES_NAMED
        raise CheckpointMismatch("; ".join(differences[:MISMATCHES_NAMED]) + (f" (and {more} more)" if more > 0 else ""))


def load_trainables(ckpt: Checkpoint | None, shared: dict[str, Any], trainables: Trainables,
                    ctx: DistContext) -> None:
    """Models and optimisers from ``ckpt`` (rank 0; None elsewhere), scheduler and algorithm
    state from ``shared`` (:func:`_shared`). Collective: every rank takes the same path, on
    ``shared``. A checkpoint of another configuration (another rule, the KL's reference, which
    critic parameters train) lacks what this one trains: a critic starts fresh, as on a first
    start, and an EMA reference from the restored policy (each said in the log); an optimiser
    whose parameters changed starts empty (:func:`~trainer.full_state.load_optimizer_state`).
    Each was a bare KeyError (or torch's "Missing optimizer state") at every restart."""
    t = trainables
    held = set(shared["models"])
    check_policy_fits(t.policy, shared["policy_shapes"])
    load_full_state_dict(t.policy, ckpt.models["policy"] if ckpt else None, ctx)
    load_optimizer_state(t.policy, t.optimizers.policy, ckpt.optimizers["policy"] if ckpt else None, ctx,
                         name="policy")
    if t.critic is not None and "critic" in held:
        load_full_state_dict(t.critic, ckpt.models["critic"] if ckpt else None, ctx)
        load_optimizer_state(t.critic, t.optimizers.critic, ckpt.optimizers["critic"] if ckpt else None, ctx,
                             name="critic")
    elif t.critic is not None and ctx.is_main:
        log.warning("the checkpoint of step %d has no critic (its rule trained none): the critic is not "
                    "restored (on a restart it starts fresh, as on a first start)", shared["step"])
    if t.ema_reference is not None:
        _load_ema_reference(ckpt, "reference" in held, shared["step"], t.ema_reference, ctx)
    if t.optimizers.critic_scheduler is not None and shared["scheduler"] is not None:
        _load_warmup(t.optimizers.critic_scheduler, shared["scheduler"])
    t.algorithm.load_state_dict(shared["algorithm"])


def _load_ema_reference(ckpt: Checkpoint | None, held: bool, step: int, reference: nn.Module,
                        ctx: DistContext) -> None:
    """The KL's EMA reference from ``ckpt``, or, when it holds none (``held`` False: the KL was off or
    had a fixed reference), from its restored policy: where an EMA of a policy that just started
    from those weights stands. Collective."""
    if held:
        load_full_state_dict(reference, ckpt.models["reference"] if ckpt else None, ctx)
        return
    if ctx.is_main:
        log.warning("the checkpoint of step %d has no EMA reference (algorithm.kl_reference was not ema): "
                    "the reference starts from its policy", step)
    load_full_state_dict(reference, ckpt.models["policy"] if ckpt else None, ctx)


def _load_warmup(scheduler: LambdaLR, state: dict[str, Any]) -> None:
    """The critic's warm-up (:func:`~online_sao.algorithms.linear_warmup`) at the step count of
    ``state``, on the rate it was built on here.

    Its state carries the rate of the run that saved it (``base_lrs``): kept, a restart with a
    changed ``algorithm.critic_lr``, or a roll-back, would go on at the old rate, and one mid
    warm-up would finish the ramp to the old rate."""
    configured = list(scheduler.base_lrs)
    scheduler.load_state_dict(state)
    scheduler.base_lrs = configured
    rates = [base * factor(scheduler.last_epoch) for base, factor in zip(configured, scheduler.lr_lambdas)]
    for group, rate in zip(scheduler.optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates  # what get_last_lr() reports; LambdaLR's step() sets it the same way


def gather_training_state(trainables: Trainables, joiner: RewardJoiner | None, progress: Progress | None,
                          ctx: DistContext, drift: Any = None) -> Checkpoint | None:
    """Gather everything for one checkpoint on rank 0 (collective); the other ranks, which pass
    ``joiner`` and ``progress`` None, get None. Its tensors do not alias the models' or the
    optimisers' (:func:`full_state_dict`, :func:`optimizer_state`); its JSON parts may alias the
    join buffer and the algorithm's state, which :meth:`trainer.checkpoint.Checkpointer.stage`
    renders before the learner trains on; its id memory is a snapshot the join does not change."""
    t = trainables
    models = {"policy": full_state_dict(t.policy, ctx)}
    optimizers: dict[str, Any] = {"policy": optimizer_state(t.policy, t.optimizers.policy, ctx)}
    if t.critic is not None:
        models["critic"] = full_state_dict(t.critic, ctx)
        optimizers["critic"] = optimizer_state(t.critic, t.optimizers.critic, ctx)
    if t.ema_reference is not None:
        models["reference"] = full_state_dict(t.ema_reference, ctx)
    if not ctx.is_main:
        return None
    if t.optimizers.critic_scheduler is not None:
        optimizers["critic_scheduler"] = t.optimizers.critic_scheduler.state_dict()
    p = progress
    # the id memory (up to 100,000 ids) is only copied here; the checkpoint writer encodes it
    state = LearnerState(step=p.step, version=p.version, offsets=dict(p.offsets),
                         joiner=joiner.state_dict(with_memory=False), algorithm=t.algorithm.state_dict(),
                         mlflow_run_id=p.mlflow_run_id, protected_versions=sorted(p.protected_versions),
                         counters=dict(p.counters), candidate=dict(p.candidate),
                         drift=drift.state_dict() if drift is not None else {},
                         reward_definition=joiner.cfg.definition())
    return Checkpoint(state, models, optimizers, joiner.memory.snapshot())
