"""What only rank 0 of the learner holds: the streams, the checkpoints, the weight
store and the MLflow run, and the books it keeps about each step.

The other ranks train; rank 0 also reads Kafka (:class:`~trainer.feed.Feed`),
writes the ledger and checkpoints (:class:`~trainer.checkpoint.Checkpointer`),
puts policy versions out and meets the registry (:class:`~trainer.releases.Releases`),
and logs its cycles to MLflow (:class:`~trainer.tracking.RunTracker`, every
``mlflow.log_every_steps`` steps) and to its Prometheus exporter (every step; the
step, the counters and the feed's readings also on every pass of the loop, at most
every :data:`METRICS_REFRESH_S`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from online_sao.batch import Rollout
from online_sao.config import Config, DeployConfig, RewardConfig
from online_sao.dir_lock import DirectoryLock
from online_sao.segments import SegmentRewards
from online_sao.weights import open_weight_store
from streams.base import Producer, StreamBackend
from streams.broker_wait import until_broker_takes
from trainer.checkpoint import Checkpointer
from trainer.checkpoint_writer import CheckpointWriter
from trainer.feed import Feed
from trainer.join import MAX_REWARDS_PER_INTERACTION, RewardJoiner
from trainer.deploy import OffPolicyGate, RecentWindow, StoredPolicyScorer, read_monitors
from trainer.exporter import LearnerExporter
from trainer.publisher import Publisher
from trainer.releases import Releases
from trainer.source_rewards import SourceRewards
from trainer.state import Position, Progress
from trainer.tracking import RunTracker

log = logging.getLogger(__name__)

COUNTERS = ("dead_letters", "invalid_rollouts", "empty_rollouts", "too_few_for_ranks", "rollbacks",
            "skipped_nonfinite_steps", "drift_restarts", "drift_rollbacks", "records_skipped",
            "records_ahead_of_clock", "records_behind_clock", "records_read")
"""The learner's own counts (besides the join's); they survive restarts in the checkpoint."""
METRICS_REFRESH_S = 1.0
"""How often a pass of the loop without a step renews the exporter's step, counters and feed
readings: Prometheus scrapes every 15 s, and a busy feed passes many times a second (each reading
walks the join's ready rollouts)."""


def gate_reward_range(reward: RewardConfig, deploy: DeployConfig) -> tuple[float, float]:
    """The range of a rollout's total reward, which the gate's coverage bound takes (online_sao/gate.py,
    "What the window does not cover"): ``deploy.gate_total_range`` where it is set; else one reward's,
    ``reward.min_value``..``max_value``, when one reward stands for the rest (aggregation ``first``,
    ``last``, ``mean``); with ``sum`` the total adds up to :data:`~trainer.join.MAX_REWARDS_PER_INTERACTION`
    of them (the join applies no more), so anything from the fewest or most of them. Per-turn rewards add
    to a total as well, but the config does not bound how many a rollout gets: the gate decides nothing
    on a range its window's totals break (:func:`online_sao.gate.range_problem`)."""
    if deploy.gate_total_range is not None:
        return deploy.gate_total_range
    low, high = reward.min_value, reward.max_value
    if reward.aggregation != "sum":
        return low, high
    if deploy.gate_coverage_bound:
        log.warning("reward.aggregation sum: the gate bounds a rollout's total by %d rewards (%g..%g), and "
                    "decides seldom on a window that does not cover both versions; set "
                    "deploy.gate_total_range to the totals your sources give", MAX_REWARDS_PER_INTERACTION,
                    min(low, MAX_REWARDS_PER_INTERACTION * low), max(high, MAX_REWARDS_PER_INTERACTION * high))
    most = MAX_REWARDS_PER_INTERACTION
    return min(low, most * low), max(high, most * high)


STEP_READINGS = (("kept", "kept_frac", "%.2f"), ("value loss", "value_loss", "%.4f"),
                 ("critic EV", "explained_variance", "%.2f"))
"""The step's readings its log line shows, when the step has them: running_mean and grpo have no critic,
ppo no DIS mask, and a re-warm step after a drift restart no value loss (each used to print nan)."""


def step_readings(metrics: dict[str, float]) -> str:
    """``kept 0.97, value loss 0.0123, critic EV 0.41, `` for the readings ``metrics`` has."""
    return "".join(f"{label} {form % metrics[key]}, " for label, key, form in STEP_READINGS if key in metrics)


@dataclass
class Laps:
    """Seconds spent in each part of one learner cycle: waiting for data, then training,
    publishing and checkpointing."""

    start: float = field(default_factory=time.monotonic)
    last: float = field(init=False)
    seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.last = self.start

    def lap(self, name: str) -> None:
        """The part ``name`` ended now."""
        now = time.monotonic()
        self.seconds[name] = now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.start


@dataclass
class RankZero:
    """Rank 0's connections and books; built by :meth:`open` after the checkpoint is restored."""

    checkpointer: Checkpointer
    feed: Feed
    releases: Releases
    tracker: RunTracker
    producer: Producer
    counters: dict[str, float]
    """Named by :data:`COUNTERS`; the feed counts into the same dict."""
    segments: SegmentRewards
    """Rewards per segment of the rollouts taken (top ``deploy.segments_top_n`` plus ``other``), in
    MLflow under slot keys named by run tags (:mod:`online_sao.segments`); not checkpointed: a
    restarted learner starts them afresh, and the slots' histories (run tags) go on."""
    writer: CheckpointWriter
    """Commits ``checkpointer``'s checkpoints (in the background with
    ``trainer.checkpoint_in_background``)."""
    exporter: LearnerExporter | None = None
    """Serves the monitors and counters to Prometheus (``trainer.metrics_port``; None: off)."""
    lock: DirectoryLock | None = None
    """This learner's hold on ``trainer.checkpoint_dir`` (trainer/startup.py), released by :meth:`close`."""
    metrics_renewed_at: float = -math.inf
    """``time.monotonic()`` of the exporter's last renewal between steps (:meth:`renew_metrics`)."""

    @classmethod
    def open(cls, cfg: Config, backend: StreamBackend, checkpointer: Checkpointer, joiner: RewardJoiner,
             progress: Progress, vocab_size: int, pad_token_id: int, group_size: int,
             stop: threading.Event) -> RankZero:
        """Connect to the weight store, the broker and MLflow, carrying on from ``progress``."""
        counters = {**{name: 0.0 for name in COUNTERS}, **progress.counters}
        if "records_read" not in progress.counters:  # a checkpoint from before the count: where its marks came from
            counters["records_read"] = float(sum(progress.offsets.values()))
        store = open_weight_store(cfg.weight_store_url)
        tracker = RunTracker(cfg, run_id=progress.mlflow_run_id, stop=stop)  # an MLflow outage: waits, stoppable
        opened: list[tuple[str, Callable[[], None]]] = [("the MLflow run", lambda: tracker.close("FAILED"))]
        try:  # a failure from here on (a port in use, a stop while waiting for Kafka) closes what was opened
            # a broker down at start: wait
            producer = until_broker_takes(backend.producer, "connecting to Kafka", stop)
            opened.append(("the Kafka producer", producer.close))
            publisher = Publisher(store, producer, cfg.kafka.topics.weights, cfg.serving.model_name,
                                  cfg.trainer.keep_versions, stop=stop, dtype=getattr(torch, cfg.model.dtype))
            window = RecentWindow(cfg.deploy.window, cfg.reward.definition())
            window.load_state_dict(progress.candidate)
            feed = Feed(cfg.trainer, cfg.kafka.topics, joiner, producer, progress.offsets, counters, vocab_size,
                        group_size, stop, SourceRewards(cfg.deploy.segments_window, cfg.reward.sources))
            port = cfg.trainer.metrics_port
            exporter = None if port is None else LearnerExporter(cfg.trainer.metrics_host, port)
            if exporter is not None:
                opened.append(("the metrics exporter", exporter.close))
                # before any step: as restored, so that a learner that never steps shows it
                exporter.position(progress.step, progress.version, {**counters, **joiner.counters.metrics()})
                log.info("learner metrics on http://%s:%d/metrics", cfg.trainer.metrics_host, exporter.port)
            scorer = StoredPolicyScorer(store, cfg.model_dir, cfg.model.dtype, pad_token_id, cfg.deploy.gate_chunk)
            gate = OffPolicyGate(scorer, cfg.deploy, gate_reward_range(cfg.reward, cfg.deploy), cfg.reward.definition())
            releases = Releases(publisher, tracker, gate, window, cfg.deploy, cfg.mlflow.register_every,
                                reference=scorer if cfg.deploy.monitor_max_kl is not None else None,
                                on_decision=None if exporter is None else exporter.decision)
            # read from the registry, not the checkpoint: a learner whose checkpoints were lost must not
            # prune the champion's weights; this first read announces the champion again
            # (Releases.announce_champion_again)
            pinned = releases.refresh_pinned(progress.step)
            publisher.pin(pinned)
            checkpointer.pinned_versions = pinned
            segments = SegmentRewards(cfg.deploy.segments_top_n, cfg.deploy.segments_window, tracker.resumed_tags)
            writer = CheckpointWriter(checkpointer, cfg.trainer.checkpoint_in_background)
        except BaseException:
            _close_after_failed_start(opened)
            raise
        return cls(checkpointer, feed, releases, tracker, producer, counters, segments, writer, exporter)

    def progress(self, at: Position) -> Progress:
        """What a checkpoint taken now carries besides tensors and the join buffer."""
        return Progress(at.step, at.version, self.feed.offsets, self.counters, self.tracker.run_id,
                        sorted(self.releases.publisher.protected), self.releases.window.state_dict())

    def reads(self) -> tuple[float, float]:
        """(records read, records dead-lettered) so far: the dead-letter monitor's counts. Read, not the
        sum of the next offsets: a partition first read after a registration (or records retention
        deleted unread) added its whole offset and diluted the share since."""
        return self.counters["records_read"], self.counters["dead_letters"]

    def record_step(self, step: int, rollouts: list[Rollout], metrics: dict[str, float], refused: bool) -> None:
        """The step's ids go to the ledger; a refused step is counted and named, an applied one
        adds its rollouts to the registry's window (the policy did not train on refused data)."""
        self.checkpointer.record_trained(step, [r.interaction_id for r in rollouts], refused=refused,
                                         turns_of=[iid for r in rollouts for iid in r.turns_of])
        for rollout in rollouts:  # what users paid, whether or not the step could train on it
            self.segments.observe(rollout.segment, rollout.total_reward, rollout.scores)
        if not refused:
            self.releases.window.observe(rollouts)
            return
        self.counters["skipped_nonfinite_steps"] += 1
        log.warning("step %d refused: non-finite %s; the policy did not change (critic updates before the refusal "
                    "stay, docs/ALGORITHM.md section 8), %d interactions the policy did not train on "
                    "(%d refused steps so far)", step,
                    "inputs" if metrics.get("nonfinite_inputs") else "loss or gradients",
                    len(rollouts), self.counters["skipped_nonfinite_steps"])

    def counts(self) -> dict[str, float]:
        """The learner's counters and the join's (``join_*``), as exported."""
        return {**self.counters, **self.feed.joiner.counters.metrics()}

    def renew_metrics(self, at: Position) -> None:
        """Between steps (every pass of the loop, at most every :data:`METRICS_REFRESH_S`): the
        exporter's step, version, counters and feed readings as they are now. Without it they stood
        still from one step to the next, and were absent until the first: a learner waiting for
        rewards showed neither its step nor ``waiting`` growing."""
        now = time.monotonic()
        if self.exporter is None or now - self.metrics_renewed_at < METRICS_REFRESH_S:
            return
        self.metrics_renewed_at = now
        self.exporter.position(at.step, at.version, self.counts())
        self.exporter.feed(self.feed.keeping_up([], time.time()))

    def end_cycle(self, at: Position, rollouts: list[Rollout], metrics: dict[str, float], laps: Laps) -> None:
        """Log the cycle (Prometheus, a line, and MLflow's window: :meth:`RunTracker.log_step`); the
        idle timeout counts from now."""
        joiner = self.feed.joiner
        cycle_s = laps.total
        tokens = sum(r.num_action_tokens for r in rollouts)
        monitors = self.monitor_metrics()
        keeping_up = self.feed.keeping_up(rollouts, time.time())
        sources = self.feed.sources.stats() if self.feed.sources is not None else {}
        if self.exporter is not None:
            self.exporter.end_of_step(at.step, at.version, metrics.get("reward_mean", math.nan),
                                      {k.removeprefix("monitor_"): v for k, v in monitors.items()},
                                      self.counts(), keeping_up, sources)
        self.tracker.log_step(at.step, averaged={  # the step's own figures: their mean over the window
            **metrics, "step_time_s": laps.seconds["step"],
            "publish_time_s": laps.seconds["publish"], "checkpoint_time_s": laps.seconds["checkpoint"],
            "checkpoint_write_s": self.writer.write_s, "checkpoint_blocked_s": self.writer.blocked_s,
            "rollouts_per_s": len(rollouts) / cycle_s, "tokens_per_s": tokens / cycle_s,
            "data_wait_share": laps.seconds["wait"] / cycle_s,
        }, latest={  # counts so far and readings at the cycle's end: the newest
            **joiner.counters.metrics(), **self.counters, "policy_version": float(at.version),
            **keeping_up.metrics(), **monitors, **self.segments.metrics(),
            **(self.feed.sources.metrics() if self.feed.sources is not None else {}),
        }, tags=self.segments.slots.tags(at.step))  # which label each segment.slot<k> shows
        log.info("step %d -> v%d: %d rollouts, reward %.3f, %s%.2f s; unread %d interactions %d rewards, data "
                 "%.1f s old; segments %s", at.step, at.version, len(rollouts), metrics.get("reward_mean", math.nan),
                 step_readings(metrics), laps.seconds["step"], keeping_up.unread_interactions,
                 keeping_up.unread_rewards, keeping_up.data_age_mean_s, self.segment_summary())
        self.feed.step_ended()

    def segment_summary(self) -> str:
        """Each segment label's recent mean reward and count, for the log line."""
        stats = self.segments.stats()
        return " ".join(f"{label}={stat.reward:.3f}({stat.count})" for label, stat in stats.items()) or "-"

    def monitor_metrics(self) -> dict[str, float]:
        """The monitors on the whole window (every version in it), as ``monitor_*`` metrics."""
        releases = self.releases
        reading = read_monitors(releases.cfg, releases.window, 0, *self.reads())
        return {f"monitor_{k}": v for k, v in reading.values.items()}

    def close(self, status: Literal["FINISHED", "FAILED", "KILLED"]) -> None:
        """Close every part, each one even when one before it fails: otherwise one failure leaves the
        MLflow run RUNNING, the consumer in its group or the metrics port bound. The first failure is
        raised once all were tried, unless the loop is already failing (``FAILED``, called from its
        ``finally``): then it is logged, so that the error which ended the loop is the one raised."""
        parts = [("the checkpoint writer", self.writer.close)]
        if self.exporter is not None:
            parts.append(("the metrics exporter", self.exporter.close))
        parts += [("the Kafka consumer", self.feed.close), ("the Kafka producer", self.producer.close),
                  ("the MLflow run", lambda: self.tracker.close(status))]
        if self.lock is not None:  # last: a learner waiting for the directory starts once all is closed
            parts.append(("the checkpoint directory's lock", self.lock.release))
        first: Exception | None = None
        for what, close in parts:
            try:
                close()
            except Exception as exc:  # the rest must still be closed
                log.error("closing %s failed: %r", what, exc, exc_info=status == "FAILED")
                first = first or exc
        if first is not None and status != "FAILED":
            raise first


def _close_after_failed_start(opened: list[tuple[str, Callable[[], None]]]) -> None:
    """Close the parts :meth:`RankZero.open` opened before it failed, newest first, each even when one
    before it fails (logged: the error that ended the start is the one raised): the MLflow run marked
    FAILED, not left RUNNING; the producer's connections and the metrics port released."""
    for what, close in reversed(opened):
        try:
            close()
        except Exception as exc:
            log.error("closing %s after a failed start failed: %r", what, exc)
