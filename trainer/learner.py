"""The continuously running learner: Kafka in, policy versions out.

:func:`train` is the whole loop, top to bottom; each numbered part is one call:

1. rank 0 polls interactions and rewards (one consumer in group
   ``trainer.consumer_group``), decodes each record or dead-letters it (bad data
   never stops the learner) and feeds the :class:`~trainer.join.RewardJoiner`
   (:class:`trainer.feed.Feed`);
2. as soon as joined rollouts worth ``trainer.token_budget`` action tokens, or
   ``trainer.min_rollouts`` of them, are ready (or fewer have waited
   ``trainer.max_wait_s``; whole groups for grpo, nothing else waits for groups)
   rank 0 takes them, drops any older than ``trainer.max_version_lag`` (counted)
   and every rank learns the decision (:func:`next_rollouts`);
3. every rank trains on its share: ``Algorithm.step`` (SAO: K critic updates,
   GAE, one DIS policy update); with ``drift.enabled`` a sustained drop of the
   step rewards restarts the policy's exploration, or with ``drift.rollback_first``
   first rolls it back to its weights before the drop (trainer/plasticity.py). A
   step whose inputs, loss or gradients are not finite is refused by every rank
   together (the rule's finiteness checks are all-reduced,
   :func:`trainer.distributed.finite_vote`): the policy does not change (SAO's
   critic updates before the refusal stay, docs/ALGORITHM.md section 8), its
   ids go to the ledger marked refused, ``skipped_nonfinite_steps`` counts it and
   a warning names it (:func:`learn`);
4. every ``publish_every`` steps the full policy is published (weight store +
   notice) if some step since the last publish changed it (a refused step
   publishes nothing); every ``mlflow.register_every`` versions it is registered as
   candidate (and checkpointed) after the previous candidate was promoted or rolled back
   on the gate's evidence; a roll-back restores the champion's whole training state
   (:func:`publish`, :class:`trainer.releases.Releases`); a drift restart or
   roll-back is published at once and becomes the champion; so is the first step after a
   restart whose weight store holds versions newer than its checkpoint (published, then lost
   in a crash): its version number names weights this policy does not have;
5. every ``checkpoint_every`` steps a checkpoint is committed, THEN the consumer
   offsets it covers are committed to Kafka (:func:`checkpoint`); with
   ``trainer.checkpoint_in_background`` the state is copied and written on a thread
   of its own while the loop goes on, and the offsets follow at the first pass of
   the loop after the write (:class:`trainer.checkpoint_writer.CheckpointWriter`);
   metrics go to MLflow (:meth:`trainer.rank_zero.RankZero.end_cycle`).

Before the loop, :mod:`trainer.startup` builds the models and the rule and
restores the newest checkpoint; :class:`trainer.rank_zero.RankZero` is what only
rank 0 holds (streams, checkpoints, weight store, MLflow run).

Exactly once. The learner's state is (models, optimisers, algorithm state, join
buffer, counters) and the offsets of the next record to read per partition. A
checkpoint holds all of it, taken between two iterations of the loop, when every
record before those offsets has had its whole effect on that state: trained on
(its id is in the ledger lines the same checkpoint commits), held in the join
buffer (waiting for a reward, ready, or as an early reward), or counted as
dropped / late / dead-lettered. Records after the offsets have had no effect on
the checkpointed state. After a crash the learner loads the newest checkpoint,
cuts the ledger back to it, and seeks every partition to its checkpointed
offset: each record then takes effect exactly once in the state that survives.
Kafka's committed offsets only ever trail the checkpoint (they are committed
after it); they matter only when no checkpoint exists. Within one life, a
record re-delivered after a consumer-group rebalance is skipped by offset. What
is not exactly-once: weights and notices published after the last checkpoint
(the restarted learner numbers its next version past everything in the store)
and dead letters (a bad record may be dead-lettered again after a restart).
"""

from __future__ import annotations

import errno
import logging
import math
import signal
import threading
from dataclasses import dataclass, field

import torch

from online_sao.batch import Rollout
from online_sao.config import Config, ConfigError
from online_sao.config.unused import unread_settings
from online_sao.durable import is_disk_full
from online_sao.log_setup import log_to_stderr
from online_sao.weights import WeightsRef
from streams.base import StreamBackend
from trainer.distributed import (DistContext, any_rank, broadcast_json, broadcast_rollouts, local_batch,
                                 reduce_metrics, run_on_ranks)
from trainer.feed import RolloutHook
from trainer.full_state import load_full_state_dict
from trainer.mlflow_store import bound_mlflow_requests
from trainer.plasticity import drift_counter
from trainer.releases import release_policy, republish
from trainer.rank_zero import Laps, RankZero
from trainer.startup import (STARTING_VERSION, LearnerModels, build_models, pretrain_on_logged, pretrain_skipped_because,
                             resume)
from trainer.state import Position, gather_training_state, restore_version

log = logging.getLogger(__name__)

__all__ = ["LearnerResult", "RolloutHook", "RunUntil", "is_refused", "run_learner", "train"]


@dataclass
class RunUntil:
    """When :func:`train` returns (besides a stop signal): any condition met."""

    max_steps: int | None = None
    idle_timeout_s: float | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def reached(self, steps_here: int, idle_s: float) -> bool:
        """Whether to stop after ``steps_here`` steps of this process, ``idle_s`` seconds
        after the last record or step."""
        return (self.stop.is_set() or (self.max_steps is not None and steps_here >= self.max_steps)
                or (self.idle_timeout_s is not None and idle_s >= self.idle_timeout_s))


@dataclass
class LearnerResult:
    steps: int
    """Steps run by this process."""
    version: int
    """Newest published policy version."""
    run_id: str | None


@dataclass(frozen=True)
class Taken:
    """Rank 0's decision for one pass of the loop, known to every rank."""

    stop: bool
    go: bool
    """A step trains now."""
    rollouts: list[Rollout] | None
    """Rank 0's rollouts for the step (None on the other ranks: :func:`learn` broadcasts them)."""


def train(cfg: Config, backend: StreamBackend, ctx: DistContext, until: RunUntil,
          pretrain_critic: bool = False, before_step: RolloutHook | None = None) -> LearnerResult:
    """Run the learner loop until ``until`` says stop. Every rank calls it;
    ``backend`` and ``before_step`` are used on rank 0 only."""
    tcfg = cfg.trainer
    torch.manual_seed(tcfg.seed)
    models = build_models(cfg, ctx)                              # policy, critic, optimisers, learning rule
    at, rank0 = resume(cfg, backend, models, ctx, until.stop)    # newest checkpoint; rank 0's outside world
    status, laps = "FAILED", Laps()
    try:  # from here on a failure still ends the MLflow run and frees the consumers and the metrics port
        if (back := rollback_due(rank0, ctx)) is not None:  # stopped inside one: its checkpoint is the rejected line
            log.warning("the registry recorded a roll-back to champion v%d that was not carried out: carried out now",
                        back.version)
            roll_back(models, at, rank0, ctx, back)
        if pretrain_critic and at.step == 0 and at.rolled_back_as is None and models.trainables.critic is not None:
            # no checkpoint: the policy is model_dir's, the version serving starts on, whatever
            # versions a life that died before its first checkpoint published
            pretrain_on_logged(cfg, backend, models, STARTING_VERSION, rank0, ctx)
        elif pretrain_critic and ctx.is_main:  # the flag stays in a restart script: say it did nothing
            log.warning("value pre-training skipped: %s", pretrain_skipped_because(at, models))
        if rank0 is not None:
            rank0.feed.start(backend)                            # join the consumer group at the offsets
        while True:
            if rank0 is not None:
                rank0.writer.poll()                                     # a background checkpoint done: its offsets
            taken = next_rollouts(rank0, at, until, ctx, before_step)   # 1-2: read, join, decide
            if taken.stop:
                break
            if not taken.go:
                continue
            laps.lap("wait")
            metrics = learn(models, taken, at, rank0, ctx)              # 3: every rank on its share
            laps.lap("step")
            restarted = metrics.get("drift_alarm", 0.0) > 0                # out at once, as the new champion
            if (at.step % tcfg.publish_every == 0 and at.changed_since_publish) or restarted or at.publish_due:
                publish(models, at, rank0, metrics, ctx, restarted)     # 4: weights, notice, registry
            laps.lap("publish")
            if at.step % tcfg.checkpoint_every == 0 and at.checkpointed_step < at.step:
                checkpoint(models, at, rank0, ctx)                      # 5: checkpoint, then offsets
            laps.lap("checkpoint")
            if rank0 is not None:
                rank0.end_cycle(at, taken.rollouts, metrics, laps)      # metrics to MLflow
            laps = Laps()
        if at.step > at.checkpointed_step:  # a graceful stop keeps every step it trained
            checkpoint(models, at, rank0, ctx)
        if rank0 is not None:
            rank0.writer.wait()
        status = "FINISHED"
    finally:
        if rank0 is not None:
            rank0.close(status)
    return LearnerResult(steps=at.steps_here, version=at.version, run_id=rank0.tracker.run_id if rank0 else None)


def next_rollouts(rank0: RankZero | None, at: Position, until: RunUntil, ctx: DistContext,
                  before_step: RolloutHook | None) -> Taken:
    """Rank 0 reads, joins and decides: stop, wait, or train on these rollouts; a stop signal to any
    rank stops them all, before rank 0 takes rollouts it would not train. Collective."""
    signalled_here, stop, rollouts = until.stop.is_set(), False, None
    if rank0 is not None:
        rank0.feed.poll()
        rank0.feed.drop_stale(at.version)
        stop = until.reached(at.steps_here, rank0.feed.idle_s())
    # a signal to one rank alone (its pod stopped by a node drain or a StatefulSet's update) stopped
    # nothing: that rank went on until its SIGKILL, and the others then failed in a collective,
    # without a checkpoint
    if any_rank(signalled_here, ctx):
        if not signalled_here:
            log.info("stopping: another rank received a stop signal")
        stop = True
    if rank0 is not None:
        rollouts = None if stop else rank0.feed.take(ctx.world_size, before_step)
        rank0.renew_metrics(at)  # between steps too: what it reads and holds while no step comes
    stop, go = broadcast_json([stop, rollouts is not None], ctx)
    return Taken(stop, go, rollouts)


def learn(models: LearnerModels, taken: Taken, at: Position, rank0: RankZero | None,
          ctx: DistContext) -> dict[str, float]:
    """One step of the learning rule on every rank's share of rank 0's rollouts. Collective.
    Returns the step's metrics, reduced over ranks."""
    rollouts = broadcast_rollouts(taken.rollouts, ctx)
    batch = local_batch(rollouts, ctx, models.pad_token_id, at.version)
    with models.computing(ctx.device):
        metrics = models.trainables.algorithm.step(batch.to(ctx.device))
    metrics = reduce_metrics(metrics, ctx)
    at.step, at.steps_here = at.step + 1, at.steps_here + 1
    refused = is_refused(metrics)  # the same on every rank: the rule's checks were voted on
    if models.drift is not None and not refused:  # every rank has the step's rollouts: all agree
        metrics.update(models.drift.after_rollouts(rollouts, at.version + 1))
    at.changed_since_publish = at.changed_since_publish or not refused
    if rank0 is not None:
        rank0.record_step(at.step, rollouts, metrics, refused)
    return metrics


def publish(models: LearnerModels, at: Position, rank0: RankZero | None, metrics: dict[str, float],
            ctx: DistContext, restarted: bool = False) -> None:
    """The policy goes out as the next version (:func:`trainer.releases.release_policy`). A version
    the registry just made its candidate is checkpointed at once (kept while candidate or
    champion); a roll-back restores the champion's whole training state from its checkpoint
    (only its weights, from the store, when none is kept) and publishes it again as the next
    version. ``restarted``: the step restarted (or
    rolled back) the policy after a detected reward drop; the registry makes this version its champion
    (:meth:`trainer.releases.Releases.rebase`). Collective."""
    at.changed_since_publish = at.publish_due = False
    at.version += 1
    drift = {k: v for k, v in metrics.items() if k.startswith("drift_")} if restarted else None
    outcome = release_policy(models.trainables.policy, ctx, rank0.releases if rank0 else None, at.version,
                             at.step, {"reward_mean": metrics.get("reward_mean", math.nan)},
                             rank0.reads() if rank0 else (0.0, 0.0), drift)
    if rank0 is not None:
        rank0.checkpointer.pinned_versions = rank0.releases.pinned_versions()
    if outcome.rolled_back_to is not None:
        roll_back(models, at, rank0, ctx, outcome.rolled_back_to)
    if restarted and rank0 is not None:
        rank0.counters[drift_counter(metrics)] += 1
    if outcome.registered:
        checkpoint(models, at, rank0, ctx)


def roll_back(models: LearnerModels, at: Position, rank0: RankZero | None, ctx: DistContext,
              back: WeightsRef) -> None:
    """Restore champion ``back``'s whole training state from its checkpoint (only its weights, from
    the store, when none is kept: they become the KL's EMA reference too, as at a start from a
    checkpoint without one, and the policy's optimiser starts without moments) and publish it again as the next version; the registry notes the
    roll-back carried out once a checkpoint holds the restored state (:func:`checkpoint`): until
    then the newest checkpoint is the rejected policy's line, and a learner restarted from it must
    roll back again. Collective."""
    if rank0 is not None:  # the champion's checkpoint may be the one being written
        rank0.writer.wait()
    definition = rank0.feed.joiner.cfg.definition() if rank0 is not None else ""
    if not restore_version(rank0.checkpointer if rank0 else None, models.trainables, back.version, ctx, definition):
        if rank0 is not None:
            log.warning("no checkpoint of champion v%d kept: restoring its weights only", back.version)
        store = rank0.releases.publisher.store if rank0 else None
        weights = store.load(back.location, back.checksum) if store else None
        load_full_state_dict(models.trainables.policy, weights, ctx)
        # the rejected line's EMA and Adam moments would pull the restored policy back toward it
        if models.trainables.ema_reference is not None:
            load_full_state_dict(models.trainables.ema_reference, weights, ctx)
        models.trainables.optimizers.policy.state.clear()  # every rank: each holds its shards' moments
    # Serving went back to the champion's old number; the learner's own is past it. Published under
    # the next number at once, the restored weights are what serving samples with, so its answers
    # are not stale: with trainer.max_version_lag under the gap, every answer sampled by the
    # champion was dropped, no step ran, and serving stayed on the champion for good.
    at.version += 1
    if models.drift is not None:  # every rank: they keep the same books
        models.drift.after_registry_rollback(at.version)
    republish(models.trainables.policy, ctx, rank0.releases if rank0 else None, at.version, at.step)
    at.rolled_back_as = at.version
    if rank0 is not None:
        rank0.counters["rollbacks"] += 1


def rollback_due(rank0: RankZero | None, ctx: DistContext) -> WeightsRef | None:
    """The champion of a roll-back the registry recorded and the learner never carried out (it
    stopped in between: :meth:`trainer.releases.Releases.rollback_due`), on every rank."""
    due = rank0.releases.rollback_due() if rank0 is not None else None
    shared = broadcast_json(None if due is None else [due.version, due.location, due.checksum], ctx)
    return None if shared is None else WeightsRef(*shared)


def checkpoint(models: LearnerModels, at: Position, rank0: RankZero | None, ctx: DistContext) -> None:
    """Take a checkpoint of the state as it is now and commit it, then (rank 0) the consumer
    offsets it covers; in the background with ``trainer.checkpoint_in_background``. Collective."""
    if rank0 is not None:  # the checkpoint's offsets are past the refused records: their letters first
        rank0.feed.flush_dead_letters()
    ckpt = gather_training_state(models.trainables, rank0.feed.joiner if rank0 else None,
                                 rank0.progress(at) if rank0 else None, ctx, models.drift)
    if rank0 is not None:
        feed, offsets, releases, rolled_back_as = rank0.feed, dict(ckpt.state.offsets), rank0.releases, at.rolled_back_as

        def after_commit() -> None:
            if rolled_back_as is not None:  # this checkpoint holds the roll-back's restored state
                releases.rollback_carried_out(rolled_back_as)
            feed.commit(offsets)
        rank0.writer.save(ckpt, after_commit=after_commit)
    at.checkpointed_step, at.rolled_back_as = at.step, None


def is_refused(metrics: dict[str, float]) -> bool:
    """Whether a step's (rank-reduced) metrics say its update was refused as non-finite."""
    return metrics.get("skipped_nonfinite", 0.0) > 0


def run_learner(cfg: Config, pretrain_critic: bool = False, before_step: RolloutHook | None = None) -> int:
    """``online-sao learn``: run until SIGTERM/SIGINT (or the configured test limits) on the
    model in ``cfg.model_dir``, which must exist (the CLI builds the default model first).
    ``before_step``: see :data:`RolloutHook` (tests only)."""
    from streams.kafka_backend import KafkaBackend

    pretrain_file = cfg.trainer.pretrain_file
    if pretrain_critic and pretrain_file is not None and not pretrain_file.is_file():
        raise ConfigError(f"trainer.pretrain_file {pretrain_file} is not a file: learn --pretrain-critic reads "
                          "its logged rollouts there (unset it to read the topics' retained history)")
    log_to_stderr(logging.INFO)
    bound_mlflow_requests()  # an MLflow server that stops answering costs seconds per request, not minutes
    until = RunUntil(max_steps=cfg.trainer.max_steps, idle_timeout_s=cfg.trainer.idle_timeout_s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: until.stop.set())
    def work(ctx: DistContext) -> LearnerResult:
        unread = unread_settings(cfg.algorithm, cfg.drift)
        if ctx.is_main and unread:
            log.warning("settings that change nothing here, though MLflow records them: %s (algorithm.name is %s, "
                        "drift.enabled %s)", ", ".join(unread), cfg.algorithm.name, cfg.drift.enabled)
        try:
            result = train(cfg, KafkaBackend(cfg.kafka), ctx, until, pretrain_critic=pretrain_critic,
                           before_step=before_step)
        except OSError as exc:
            if is_disk_full(exc):  # the error names the file; the log says what happens next
                log.error("learner stops: no room to write: %s; once there is room, a restart goes on from its "
                          "newest checkpoint", exc)
            elif exc.errno == errno.EIO:  # MLflow's SQLite store says so for a full quota too (trainer/mlflow_store.py)
                log.error("learner stops: a disk failed a write: %s; once it has room or is replaced, a restart goes "
                          "on from its newest checkpoint", exc)
            raise
        if ctx.is_main:
            log.info("learner stopped after %d steps at policy version %d (MLflow run %s)",
                     result.steps, result.version, result.run_id)
        return result

    run_on_ranks(work, cfg.trainer.collective_timeout_s)
    return 0
