"""The continuously running learner: Kafka in, policy versions out.

:func:`train` is the whole loop, top to bottom:

1. rank 0 polls interactions and rewards (one consumer in group
   ``trainer.consumer_group``), decodes each record or dead-letters it (bad data
   never stops the learner) and feeds the :class:`~trainer.join.RewardJoiner`;
2. as soon as joined rollouts worth ``trainer.token_budget`` action tokens, or
   ``trainer.min_rollouts`` of them, are ready (or fewer have waited
   ``trainer.max_wait_s``; whole groups for grpo, nothing else waits for groups)
   rank 0 takes them, drops any older than ``trainer.max_version_lag`` (counted)
   and broadcasts them;
3. every rank trains on its share: ``Algorithm.step`` (SAO: K critic updates,
   GAE, one DIS policy update). A step whose inputs, loss or gradients are not
   finite is refused by every rank together (the rule's finiteness checks are
   all-reduced, :func:`trainer.distributed.finite_vote`): no weight changes, its
   ids go to the ledger marked refused, ``skipped_nonfinite_steps`` counts it and
   a warning names it;
4. every ``publish_every`` steps the full policy is published (weight store +
   notice) if some step since the last publish changed it (a refused step
   publishes nothing); every ``mlflow.register_every`` versions it is registered as
   candidate and promoted or rolled back;
5. every ``checkpoint_every`` steps a checkpoint is committed, THEN the consumer
   offsets it covers are committed to Kafka; metrics go to MLflow.

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

import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from online_sao.algorithms import build_algorithm, build_optimizers
from online_sao.batch import Rollout, collate
from online_sao.config import Config
from online_sao.critic import ValueModel
from online_sao.modeling import load_policy, load_tokenizer
from online_sao.schemas import Interaction, Reward
from online_sao.weights import open_weight_store
from streams.base import Consumer, StreamBackend, TopicPartition
from streams.records import decode_or_dead_letter
from trainer.broker_wait import until_broker_takes
from trainer.checkpoint import Checkpointer
from trainer.distributed import (DistContext, broadcast_rollouts, finite_vote, global_token_normalizer,
                                 init_distributed, load_full_state_dict, reduce_metrics, shard_model, shard_rollouts,
                                 shutdown_distributed)
from trainer.history import rollouts_from_file, rollouts_from_topics
from trainer.join import JoinedInteraction, RewardJoiner
from trainer.pretrain import pretrain_critic as fit_critic
from trainer.publisher import CandidateWatch, Publisher, publish_policy
from trainer.rollouts import RolloutError
from trainer.distributed import broadcast_json
from trainer.state import Progress, Trainables, restore_training_state, save_training_state
from trainer.tracking import RunTracker

log = logging.getLogger(__name__)

MAX_POLL_RECORDS = 500
"""Records taken per poll; bounds the time between two readiness checks."""
READY_BACKLOG_STEPS = 4
"""Rank 0 stops polling while this many full steps of rollouts are ready: the
join buffer then grows no further than the learner can train (backpressure)."""
CRITIC_RULES = frozenset({"sao", "ppo"})
"""Rules that learn with a critic (build_algorithm refuses them without one)."""
ASSIGNMENT_TIMEOUT_S = 60.0
"""How long the consumer may take to join its group and get partitions (a group
whose previous member was killed waits for that member's session to expire)."""


@dataclass
class RunUntil:
    """When :func:`train` returns (besides a stop signal): any condition met."""

    max_steps: int | None = None
    idle_timeout_s: float | None = None
    stop: threading.Event = field(default_factory=threading.Event)


@dataclass
class LearnerResult:
    steps: int
    """Steps run by this process."""
    version: int
    """Newest published policy version."""
    run_id: str | None


RolloutHook = Callable[[list[Rollout]], list[Rollout]]
"""Fault injection for tests (None in service): rank 0 passes it the rollouts a step
took, before they are broadcast and trained on, and trains on what it returns."""


def train(cfg: Config, backend: StreamBackend, ctx: DistContext, until: RunUntil,
          pretrain_critic: bool = False, before_step: RolloutHook | None = None) -> LearnerResult:
    """Run the learner loop until ``until`` says stop. Every rank calls it;
    ``backend`` and ``before_step`` are used on rank 0 only."""
    tcfg, topics, main = cfg.trainer, cfg.kafka.topics, ctx.is_main
    torch.manual_seed(tcfg.seed)

    # -- models, optimisers, learning rule -------------------------------------------
    policy = load_policy(cfg.model_dir, cfg.model.dtype)
    vocab_size = policy.get_input_embeddings().num_embeddings
    pad_token_id = load_tokenizer(cfg.model_dir).pad_token_id
    critic = (ValueModel.from_policy(policy, cfg.algorithm.freeze_critic_attention)
              if cfg.algorithm.name in CRITIC_RULES else None)
    shard_model(policy, ctx)
    if critic is not None:
        shard_model(critic, ctx)
    opts = build_optimizers(cfg.algorithm, policy, critic)
    algorithm = build_algorithm(cfg.algorithm, policy, critic, opts.policy, opts.critic, opts.critic_scheduler,
                                vote=finite_vote(ctx))
    trainables = Trainables(policy, critic, opts, algorithm)

    # -- resume from the newest checkpoint (or start fresh) ------------------------------
    checkpointer = Checkpointer(cfg.checkpoint_dir) if main else None
    joiner = RewardJoiner(cfg.reward, tcfg.join_max_pending)
    progress = restore_training_state(checkpointer, trainables, joiner, ctx)
    step, version, offsets = progress.step, progress.version, progress.offsets
    counters = {"dead_letters": 0.0, "invalid_rollouts": 0.0, "empty_rollouts": 0.0, "too_few_for_ranks": 0.0,
                "rollbacks": 0.0, "skipped_nonfinite_steps": 0.0, **progress.counters}
    store = open_weight_store(cfg.weight_store_url) if main else None
    if main:  # never reuse a version number: the store may hold versions newer than the checkpoint
        version = max([version, *store.versions()])
    version = broadcast_json(version, ctx)
    tracker = RunTracker(cfg, run_id=progress.mlflow_run_id) if main else None
    producer = backend.producer() if main else None
    publisher = (Publisher(store, producer, topics.weights, cfg.serving.model_name, tcfg.keep_versions,
                           set(progress.protected_versions), stop=until.stop) if main else None)
    watch = CandidateWatch()
    if progress.candidate:
        watch.load_state_dict(progress.candidate)

    if main:
        log.info("learner on %d rank(s) from step %d, policy version %d", ctx.world_size, step, version)

    def checkpoint() -> None:  # collective; then offsets are committed (rank 0)
        here = Progress(step, version, offsets, counters, tracker.run_id, sorted(publisher.protected),
                        watch.state_dict()) if main else None
        save_training_state(checkpointer, trainables, joiner, here, ctx)
        if main:  # dead letters of the covered records are out before their offsets; waits out a broker outage
            until_broker_takes(producer.flush, "flushing dead letters", until.stop)
            until_broker_takes(lambda: consumer.commit(dict(offsets)), "committing offsets", until.stop)

    if pretrain_critic and step == 0 and critic is not None:
        _pretrain(cfg, backend, critic, opts.critic, pad_token_id, version, tracker, ctx)
    consumer = None
    if main:
        backend.ensure_topics()
        consumer = backend.consumer([topics.interactions, topics.rewards], group_id=tcfg.consumer_group,
                                    start="earliest")
        _assign_and_seek(consumer, offsets)

    # -- the loop ---------------------------------------------------------------------
    steps_here, last_checkpoint_step, status = 0, step, "FAILED"
    cycle_start = last_activity = time.monotonic()
    ready_since: float | None = None  # when rollouts became ready and none were taken since
    # whether the policy may differ from the newest published version: not on a fresh start (serving
    # starts on these weights); after a restart the checkpointed weights may never have been published
    changed_since_publish = step > 0
    try:
        while True:
            # 1. ingest (rank 0): decode or dead-letter, join
            stop, rollouts = False, None
            if main:
                if joiner.ready_stats(algorithm.group_size)[0] < READY_BACKLOG_STEPS * tcfg.max_rollouts_per_step:
                    for msg in consumer.poll(timeout_s=tcfg.poll_timeout_s, max_records=MAX_POLL_RECORDS):
                        if msg.offset < offsets.get(msg.tp, 0):
                            continue  # re-delivered after a rebalance: already in the state
                        offsets[msg.tp] = msg.offset + 1
                        last_activity = time.monotonic()
                        kind = Interaction if msg.topic == topics.interactions else Reward
                        record = decode_or_dead_letter(msg, kind, producer, topics.dead_letters)
                        if record is None:
                            counters["dead_letters"] += 1
                        elif isinstance(record, Interaction):
                            joiner.add_interaction(record, msg.timestamp_ms / 1000)
                        else:
                            joiner.add_reward(record, msg.timestamp_ms / 1000)

                # 2. decide (rank 0): stop, or take the ready rollouts for a step
                if tcfg.max_version_lag is not None:
                    joiner.drop_stale(min_version=version - tcfg.max_version_lag)
                ready, ready_tokens = joiner.ready_stats(algorithm.group_size)
                now = time.monotonic()
                ready_since = (ready_since or now) if ready else None
                waited_long = ready_since is not None and tcfg.max_wait_s is not None and (
                    now - ready_since >= tcfg.max_wait_s)
                stop = (until.stop.is_set() or (until.max_steps is not None and steps_here >= until.max_steps)
                        or (until.idle_timeout_s is not None and now - last_activity >= until.idle_timeout_s))
                if not stop and ready >= ctx.world_size and (ready >= tcfg.min_rollouts
                                                             or ready_tokens >= tcfg.token_budget or waited_long):
                    ready_since = None
                    taken = joiner.pop_ready(tcfg.max_rollouts_per_step, tcfg.token_budget, algorithm.group_size)
                    rollouts = _to_rollouts(taken, counters, vocab_size)
                    if before_step is not None:
                        rollouts = before_step(rollouts)
                    if len(rollouts) < ctx.world_size:  # FSDP needs every rank in every step
                        counters["too_few_for_ranks"] += len(rollouts)
                        rollouts = None
            stop, go = broadcast_json([stop, rollouts is not None], ctx)
            if stop:
                break
            if not go:
                continue

            # 3. train: every rank on its share
            step_start = time.monotonic()
            rollouts = broadcast_rollouts(rollouts, ctx)
            batch = collate(shard_rollouts(rollouts, ctx), pad_token_id, policy_version=version)
            batch.token_normalizer = global_token_normalizer(batch, ctx)
            metrics = reduce_metrics(algorithm.step(batch.to(ctx.device)), ctx)
            step, steps_here = step + 1, steps_here + 1
            refused = is_refused(metrics)  # the same on every rank: the rule's checks were voted on
            changed_since_publish = changed_since_publish or not refused
            publish_start = time.monotonic()
            if main:
                checkpointer.record_trained(step, [r.interaction_id for r in rollouts], refused=refused)
                if refused:
                    counters["skipped_nonfinite_steps"] += 1
                    log.warning("step %d refused: non-finite %s; no weight changed, %d interactions not trained on "
                                "(%d refused steps so far)", step,
                                "inputs" if metrics.get("nonfinite_inputs") else "loss or gradients",
                                len(rollouts), counters["skipped_nonfinite_steps"])
                else:  # refused data says nothing about the candidate
                    watch.observe(rollouts)

            # 4. publish; every register_every versions decide on the candidate, register the next
            if step % tcfg.publish_every == 0 and changed_since_publish:
                changed_since_publish = False
                version += 1
                ref = publish_policy(policy, ctx, publisher, version, step,
                                     {"reward_mean": metrics.get("reward_mean", math.nan)})
                rollback_to = None
                if main and version % cfg.mlflow.register_every == 0:
                    decision = tracker.evaluate_candidate(watch.reward) if watch.version is not None else "pending"
                    if decision == "rolled_back":
                        champion_version, champion_ref = tracker.champion()
                        log.warning("candidate v%s (reward %.4f) rolled back to champion v%d",
                                    watch.version, watch.reward, champion_version)
                        publisher.rollback(champion_ref, step)
                        rollback_to = [champion_ref.location, champion_ref.checksum]
                        counters["rollbacks"] += 1
                        watch.start(None)
                    else:
                        tracker.register(ref, watch.reward)
                        publisher.protect(version)
                        watch.start(version)
                rollback_to = broadcast_json(rollback_to, ctx)
                if rollback_to is not None:  # train on from the champion's weights
                    load_full_state_dict(policy, store.load(*rollback_to) if main else None, ctx)

            # 5. checkpoint, then commit the offsets it covers; metrics
            checkpoint_start = time.monotonic()
            if step % tcfg.checkpoint_every == 0:
                checkpoint()
                last_checkpoint_step = step
            if main:  # a cycle: waiting for data since the last one, then training, publishing, checkpointing
                now = time.monotonic()
                cycle_s, wait_s = now - cycle_start, step_start - cycle_start
                tokens = sum(r.num_action_tokens for r in rollouts)
                tracker.log_metrics({
                    **metrics, **joiner.counters.metrics(), **counters,
                    "policy_version": float(version), "step_time_s": publish_start - step_start,
                    "publish_time_s": checkpoint_start - publish_start, "checkpoint_time_s": now - checkpoint_start,
                    "rollouts_per_s": len(rollouts) / cycle_s, "tokens_per_s": tokens / cycle_s,
                    "data_wait_share": wait_s / cycle_s,
                    "join_waiting": float(joiner.num_waiting), "join_ready": float(joiner.ready_stats()[0]),
                }, step=step)
                log.info("step %d -> v%d: %d rollouts, reward %.3f, kept %.2f, value loss %.4f, %.2f s",
                         step, version, len(rollouts), metrics.get("reward_mean", math.nan),
                         metrics.get("kept_frac", math.nan), metrics.get("value_loss", math.nan),
                         publish_start - step_start)
            cycle_start = last_activity = time.monotonic()

        if step > last_checkpoint_step:  # a graceful stop keeps every step it trained
            checkpoint()
        status = "FINISHED"
    finally:
        if main:
            if consumer is not None:
                consumer.close()
            producer.close()
            tracker.close(status)
    return LearnerResult(steps=steps_here, version=version, run_id=tracker.run_id if main else None)


def is_refused(metrics: dict[str, float]) -> bool:
    """Whether a step's (rank-reduced) metrics say its update was refused as non-finite."""
    return metrics.get("skipped_nonfinite", 0.0) > 0


def _to_rollouts(taken: list[JoinedInteraction], counters: dict[str, float], vocab_size: int) -> list[Rollout]:
    """Rollouts of the joined interactions; unusable ones are counted and left out (a token id
    outside the model's vocabulary passes the record codec, which does not know the model)."""
    rollouts = []
    for joined in taken:
        try:
            rollout = joined.to_rollout()
            if max(rollout.token_ids, default=0) >= vocab_size:
                raise RolloutError(f"interaction {rollout.interaction_id}: token id {max(rollout.token_ids)} "
                                   f"outside the model's vocabulary ({vocab_size})")
        except RolloutError as exc:
            counters["invalid_rollouts"] += 1
            log.warning("interaction not trained on: %s", exc)
            continue
        if rollout.num_action_tokens == 0:
            counters["empty_rollouts"] += 1
            continue
        rollouts.append(rollout)
    return rollouts


def _pretrain(cfg: Config, backend: StreamBackend, critic: ValueModel, critic_optimizer: torch.optim.Optimizer,
              pad_token_id: int, version: int, tracker: RunTracker | None, ctx: DistContext) -> None:
    """Value pre-training on logged rollouts of the starting policy (collective; every
    rank fits on all of them, as trainer.pretrain requires)."""
    logged = None
    if ctx.is_main:
        logged = (rollouts_from_file(cfg.trainer.pretrain_file, cfg, version) if cfg.trainer.pretrain_file
                  else rollouts_from_topics(backend, cfg, version))
    logged = broadcast_rollouts(logged, ctx)
    if not logged:
        if ctx.is_main:
            log.warning("value pre-training skipped: %d logged rollouts of version %d", len(logged), version)
        return
    fit = fit_critic(critic, critic_optimizer, logged, cfg.algorithm, pad_token_id)
    if ctx.is_main:
        log.info("value pre-training on %d rollouts: %s", len(logged), fit)
        tracker.log_metrics({f"pretrain_{k}": float(v) for k, v in fit.items()}, step=0)


def _assign_and_seek(consumer: Consumer, offsets: dict[TopicPartition, int]) -> None:
    """Wait for the group to assign partitions, then put every partition where the
    checkpoint says. Records fetched while joining the group are not consumed: a
    partition without a checkpointed offset is put back to the first of them."""
    first_fetched: dict[TopicPartition, int] = {}
    deadline = time.monotonic() + ASSIGNMENT_TIMEOUT_S
    while not consumer.assignment():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no partitions assigned within {ASSIGNMENT_TIMEOUT_S} s")
        for msg in consumer.poll(timeout_s=0.5):
            first_fetched.setdefault(msg.tp, msg.offset)
    for tp in consumer.assignment():
        if tp in offsets:
            consumer.seek(tp, offsets[tp])
        elif tp in first_fetched:
            consumer.seek(tp, first_fetched[tp])


def run_learner(cfg: Config, pretrain_critic: bool = False, before_step: RolloutHook | None = None) -> int:
    """``online-sao learn``: run until SIGTERM/SIGINT (or the configured test limits) on the
    model in ``cfg.model_dir``, which must exist (the CLI builds the default model first).
    ``before_step``: see :data:`RolloutHook` (tests only)."""
    from streams.kafka_backend import KafkaBackend

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)  # kafka-python narrates every connection at INFO
    until = RunUntil(max_steps=cfg.trainer.max_steps, idle_timeout_s=cfg.trainer.idle_timeout_s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: until.stop.set())
    ctx = init_distributed()
    try:
        result = train(cfg, KafkaBackend(cfg.kafka), ctx, until, pretrain_critic=pretrain_critic,
                       before_step=before_step)
    finally:
        shutdown_distributed(ctx)
    if ctx.is_main:
        log.info("learner stopped after %d steps at policy version %d (MLflow run %s)",
                 result.steps, result.version, result.run_id)
    return 0
