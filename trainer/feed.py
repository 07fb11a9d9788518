"""Rank 0's feed of the learner: Kafka records in, the rollouts of the next step out.

Every pass of the learner loop, rank 0:

1. polls interactions and rewards (one consumer in group ``trainer.consumer_group``),
   skips records a rebalance re-delivered (their offset is already in the state),
   decodes each record or dead-letters it (bad data never stops the learner), dead-letters a
   reward outside ``reward.min_value``..``max_value`` (:func:`reward_out_of_range`), refuses
   (counted) an interaction that can train nothing (:mod:`trainer.untrainable`) and
   feeds the others to the :class:`~trainer.join.RewardJoiner`. While ``READY_BACKLOG_STEPS`` full
   steps are ready (and a step could start on them: at least ``trainer.min_rollouts``, a
   unit for each rank) it polls with its partitions paused (backpressure): no records
   come, but the consumer stays in its group;
2. drops ready rollouts older than ``trainer.max_version_lag`` (counted);
3. takes the ready rollouts for a step as soon as they are worth
   ``trainer.token_budget`` action tokens, or ``trainer.min_rollouts`` of them are
   ready, or fewer have waited ``trainer.max_wait_s`` (whole groups for grpo;
   nothing else waits for groups), a unit (rollout, grpo group) for each rank.

After a checkpoint, :meth:`Feed.commit` commits the offsets it covers (dead letters
of the covered records are flushed first). The feed does not poll during a step or a
checkpoint; one longer than Kafka's ``max.poll.interval.ms`` (300 s) gets its consumer dropped
from the group, and the commit that follows is refused: the feed then rejoins, puts every
partition back at its own next offset, and commits again.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from online_sao.batch import Rollout
from online_sao.config import TopicsConfig, TrainerConfig
from online_sao.schemas import Interaction, Reward
from streams.base import Consumer, GroupMembershipLost, Producer, StreamBackend, StreamMessage, TopicPartition
from streams.ends import EndWatcher
from streams.outbox import Outbox
from streams.records import decode_or_dead_letter, send_dead_letter
from streams.broker_wait import until_broker_takes
from trainer.distributed import shard_units
from trainer.partitions import ASSIGNMENT_TIMEOUT_S, assign_and_seek, drop_gone_partitions
from trainer.join import RewardJoiner
from trainer.join_clock import JoinClock, max_ahead_s, max_behind_s
from trainer.reward_range import reward_out_of_range
from trainer.rollouts import to_rollouts
from trainer.source_rewards import SourceRewards
from trainer.untrainable import trainable

log = logging.getLogger(__name__)

MAX_POLL_RECORDS = 500
"""Records taken per poll; bounds the time between two readiness checks."""
READY_BACKLOG_STEPS = 4
"""Rank 0 reads no records while this many full steps of rollouts are ready (and a step could
start on them: :meth:`Feed.backlogged`): the join buffer then grows no further than the learner can
train (backpressure). It goes on polling, with its partitions paused: a consumer that stops polling
for Kafka's ``max.poll.interval.ms`` is dropped from its group, and its next commit is refused."""
PAUSED_POLL_S = 0.0
"""How long a poll with every partition paused waits: no record can come, the poll only keeps the
consumer in its group, so the learner's loop does not wait on it."""
REJOIN_POLL_S = 1.0
"""How long the poll that rejoins the group after a refused commit waits (the commit is tried again
after it, and the poll again while the group still refuses it, for ``ASSIGNMENT_TIMEOUT_S``)."""
UNHEARD_HOLD_S = 30.0
"""How long after the feed joins its group a partition not heard from yet holds the join's clock: both
ways of hearing (a parsed fetch, the end watcher's read every ENDS_EVERY_S) take seconds; a partition
offline (its only replica's broker down) is never heard, and held the clock, so no reward window closed."""
UNHEARD_PARTITION = 1 << 62
"""The records left to read of an assigned partition whose end the feed has not heard yet: as many as
can be, so that it holds the join's clock (:meth:`~trainer.join_clock.JoinClock.limit`) until it is
heard. A learner restarted over a backlog read one topic's partition before the other's end was known,
its clock ran 25 minutes on, and the reward windows closed with the rewards unread (620 dropped)."""
ENDS_EVERY_S = 2.0
"""How often the feed's :class:`~streams.ends.EndWatcher` asks the broker where the topics end: the
unread counts lag the traffic by at most this while the feed's partitions are paused (one small
request every two seconds is nothing to a broker)."""


@dataclass(frozen=True)
class KeepingUp:
    """Whether the learner keeps up with the traffic, read at the end of a cycle: what it has not
    read, what it read and holds, and how old the data it just trained on was."""

    unread_interactions: int
    """Interaction records on Kafka the learner has not read (see :meth:`Feed.unread`)."""
    unread_rewards: int
    """Reward records on Kafka the learner has not read."""
    waiting: int
    """Interactions read and waiting for their reward."""
    ready: int
    """Interactions joined with their reward and waiting for a step."""
    data_age_mean_s: float
    """Seconds from serving finishing each interaction the cycle trained on to the cycle's end
    (serving's clock against the learner's: their skew adds); NaN without one."""
    data_age_max_s: float
    """The oldest of those."""

    def metrics(self) -> dict[str, float]:
        return {"unread_interactions": float(self.unread_interactions),
                "unread_rewards": float(self.unread_rewards),
                "join_waiting": float(self.waiting), "join_ready": float(self.ready),
                "data_age_mean_s": self.data_age_mean_s, "data_age_max_s": self.data_age_max_s}


RolloutHook = Callable[[list[Rollout]], list[Rollout]]
"""Fault injection for tests (None in service): rank 0 passes it the rollouts a step
took, before they are broadcast and trained on, and trains on what it returns."""


class Feed:
    """Rank 0's reading side: consumer, reward join, consumer offsets and the counts of
    records that could not be trained on."""

    def __init__(self, tcfg: TrainerConfig, topics: TopicsConfig, joiner: RewardJoiner, producer: Producer,
                 offsets: dict[TopicPartition, int], counters: dict[str, float], vocab_size: int,
                 group_size: int, stop: threading.Event, sources: SourceRewards | None = None) -> None:
        self.tcfg = tcfg
        self.sources = sources
        """Told each taken interaction's rewards by source (None: not kept)."""
        self.topics = topics
        self.joiner = joiner
        self.dead_letters = Outbox(producer)
        """Dead letters, kept until the broker has them: a refused one is sent again before offsets
        past its record are committed."""
        """Where dead letters go (shared with the publisher; closed by its owner)."""
        self.offsets = offsets
        """Next offset to read per partition: every record before it has had its effect on the state."""
        self.counters = counters
        """The learner's counters; the feed adds dead_letters, invalid_rollouts, empty_rollouts,
        too_few_for_ranks, records_skipped, records_read."""
        self.vocab_size = vocab_size
        self._trainable = partial(trainable, vocab_size=vocab_size, counters=counters)
        """Whether an interaction can train anything (the join refuses, counted, one that cannot)."""
        self.group_size = group_size
        self.stop = stop
        """Set when the learner is asked to stop: a commit then stops waiting for the broker."""
        self.consumer: Consumer | None = None
        self.ends: EndWatcher | None = None
        """Where the topics end, read by a thread of its own (the consumer hears it only while polling)."""
        self.ready_since: float | None = None
        """When rollouts became ready and none were taken since."""
        self.last_activity = time.monotonic()
        """When a record last arrived or a step last ended (the idle timeout counts from it)."""
        self.clock = JoinClock(max_behind_s(joiner.cfg.window_s))
        """Per partition, the newest record time read from it: how far the join's clock may move."""
        self.max_ahead_s = max_ahead_s(joiner.cfg.window_s)
        """How far ahead of this host's clock a record is read (:func:`~trainer.join_clock.max_ahead_s`)."""
        self.held_back = False
        """Whether the last poll had the partitions paused (backpressure)."""
        self.told_short_of_ranks = False
        """Whether the wait for a unit per rank was logged (once per wait)."""
        self.unheard_until = math.inf
        """Until when (monotonic) an assigned partition not heard from yet holds the join's clock
        (:data:`UNHEARD_HOLD_S` after the feed joined its group, or rejoined it)."""
        self.told_unheard = False
        """Whether partitions still not heard from when the hold ended were logged (once per join)."""
        self.step_units = 1
        """Units (rollouts, grpo groups) a step needs, one per rank: as the last :meth:`take` was asked."""

    def start(self, backend: StreamBackend) -> None:
        """Create the topics, forget the offsets of partitions that do not exist
        (:func:`~trainer.partitions.drop_gone_partitions`), join the consumer group and seek to the
        offsets (waiting out a broker that is down)."""
        until_broker_takes(backend.ensure_topics, "creating the topics", self.stop)
        if self.offsets:
            partitions = until_broker_takes(backend.describe_topics, "looking up the topics' partitions", self.stop)
            drop_gone_partitions(self.offsets, partitions)
        self.consumer = until_broker_takes(
            lambda: backend.consumer([self.topics.interactions, self.topics.rewards], group_id=self.tcfg.consumer_group,
                                     start="earliest", instance_id=self.tcfg.consumer_instance_id),
            "joining the consumer group", self.stop)
        assign_and_seek(self.consumer, self.offsets)
        self.ends = EndWatcher(backend, [self.topics.interactions, self.topics.rewards], ENDS_EVERY_S)
        self.last_activity = time.monotonic()
        self.unheard_until, self.told_unheard = self.last_activity + UNHEARD_HOLD_S, False

    def poll(self) -> None:
        """Read one poll's records into the join; while enough steps are ready already, poll with
        every partition paused (:meth:`backlogged`). Paused again before each such poll: a
        rebalance or a rejoin hands partitions back resumed."""
        held_back = self.backlogged()
        if held_back or self.held_back:
            assigned = self.consumer.assignment()
            (self.consumer.pause if held_back else self.consumer.resume)(assigned)
        self.held_back = held_back
        messages = self.consumer.poll(timeout_s=PAUSED_POLL_S if held_back else self.tcfg.poll_timeout_s,
                                      max_records=MAX_POLL_RECORDS)
        self._read(messages)

    def backlogged(self) -> bool:
        """Whether :data:`READY_BACKLOG_STEPS` full steps of rollouts are ready, and a step could start
        on what is ready whatever the clock says: ``trainer.min_rollouts`` of them, in a unit for each
        rank. Short of either, reading on is what lets a step start: paused with fewer than
        ``min_rollouts`` ready (above four steps of ``max_rollouts_per_step``), with ``max_wait_s`` None
        and the token budget out of reach, the learner waited for good, its records unread."""
        units, ready, _ = self.joiner.ready_counts(self.group_size)
        backlog = max(READY_BACKLOG_STEPS * self.tcfg.max_rollouts_per_step, self.tcfg.min_rollouts)
        return ready >= backlog and units >= self.step_units

    def _read(self, messages: list[StreamMessage]) -> None:
        left = self.unread_by_partition()  # these records included: the ends are as the poll heard them
        unheard = self.consumer.assignment() - left.keys()
        if unheard and time.monotonic() < self.unheard_until:
            # not heard from yet (kafka-python knows a partition's end once it parsed a fetch of it, and the
            # end watcher's first read may be still to come): it may hold records older than the clock
            left.update(dict.fromkeys(unheard, UNHEARD_PARTITION))
        elif unheard and not self.told_unheard:
            self.told_unheard = True  # once per join of the group
            log.warning("partitions %s not heard from %.0f s after joining the group (offline? the end watcher "
                        "cannot read their ends): the join's clock no longer waits for them, and records they "
                        "hold older than it may be read late", sorted(unheard), UNHEARD_HOLD_S)
        for msg in messages:
            expected = self.offsets.get(msg.tp)
            if expected is not None and msg.offset < expected:
                continue  # re-delivered after a rebalance or a rejoin: already in the state
            left[msg.tp] = left.get(msg.tp, 1) - 1
            if expected is not None and msg.offset > expected:
                self._skipped(msg.tp, expected, msg.offset)
            self.offsets[msg.tp] = msg.offset + 1
            self.counters["records_read"] += 1
            self.last_activity = time.monotonic()
            kind = Interaction if msg.topic == self.topics.interactions else Reward
            record = decode_or_dead_letter(msg, kind, self.dead_letters, self.topics.dead_letters)
            problem = reward_out_of_range(record, self.joiner.cfg) if isinstance(record, Reward) else None
            if problem is not None:  # valid as a record, but on another scale than the learner trains on
                send_dead_letter(msg, problem, self.dead_letters, self.topics.dead_letters)
                record = None
            ts = self._record_time(msg)
            self.clock.read(msg.tp, ts)
            if record is None:
                self.counters["dead_letters"] += 1
            elif isinstance(record, Interaction):
                self.joiner.add_interaction(record, ts, clock=self.clock.limit(left), admit=self._trainable)
            else:
                self.joiner.add_reward(record, ts, clock=self.clock.limit(left))

    def _record_time(self, msg) -> float:
        """The record's timestamp as the join reads it: at most :func:`~trainer.join_clock.max_ahead_s`
        ahead of this host's clock (counted: ``records_ahead_of_clock``), at most
        :func:`~trainer.join_clock.max_behind_s` behind the join's clock or its partition's newest
        record (counted: ``records_behind_clock``)."""
        stamped = msg.timestamp_ms / 1000
        ts = min(stamped, time.time() + self.max_ahead_s)
        if ts < stamped:
            self._off_clock("records_ahead_of_clock", msg, f"stamped {stamped - time.time():.0f} s ahead of this "
                            f"host's clock: read as {self.max_ahead_s:.0f} s ahead (a producer with a fast clock?)")
        floored = self.clock.floor(msg.tp, ts, self.joiner.watermark)
        behind = self.clock.max_behind_s
        if floored > ts:
            self._off_clock("records_behind_clock", msg, f"stamped {floored - ts + behind:.0f} s behind "
                            f"the records read before it: read as {behind:.0f} s behind (a producer "
                            f"with a slow clock?)")
        return floored

    def _off_clock(self, counter: str, msg, what: str) -> None:
        """Count a record whose timestamp was moved; the first of each kind is logged."""
        self.counters[counter] += 1
        if self.counters[counter] == 1:
            log.warning("%s[%d]@%d is %s; counted in %s", msg.topic, msg.partition, msg.offset, what, counter)

    def _skipped(self, tp: TopicPartition, expected: int, got: int) -> None:
        """Records between the next offset to read and the one that came were gone from the broker
        (retention deleted them before the learner read them, or someone deleted records): the
        consumer moved on to the earliest one kept. Counted, and said, since they are never trained."""
        self.counters["records_skipped"] += got - expected
        log.warning("%s[%d]: offsets %d-%d were gone from the broker before the learner read them "
                    "(retention?): %d records skipped", tp.topic, tp.partition, expected, got - 1, got - expected)

    def drop_stale(self, version: int) -> None:
        """Drop ready rollouts sampled more than ``trainer.max_version_lag`` versions before ``version``."""
        if self.tcfg.max_version_lag is not None:
            self.joiner.drop_stale(min_version=version - self.tcfg.max_version_lag)

    def idle_s(self) -> float:
        """Seconds since a record last arrived or a step last ended."""
        return time.monotonic() - self.last_activity

    def step_ended(self) -> None:
        """A step ended: the idle timeout counts from now."""
        self.last_activity = time.monotonic()

    def take(self, world_size: int, before_step: RolloutHook | None = None) -> list[Rollout] | None:
        """The rollouts of the next step, or None while too few are ready: a unit for every rank (a
        rollout with action tokens, or a grpo group: FSDP needs every rank in every step). Taken ones
        left fewer units than ranks (:func:`to_rollouts` or ``before_step`` left some out, which no record
        the feed read since 2026-12-07 makes it do) are not trained, counted in ``too_few_for_ranks``."""
        tcfg = self.tcfg
        self.step_units = world_size
        units, ready, ready_tokens = self.joiner.ready_counts(self.group_size)
        now = time.monotonic()
        self.ready_since = (self.ready_since or now) if ready else None
        waited_long = self.ready_since is not None and tcfg.max_wait_s is not None and (
            now - self.ready_since >= tcfg.max_wait_s)
        # a unit for every rank, a grpo group counting as one: an incomplete group past its timeout
        # alone is a step in one process, as the in-process driver steps on it (apps/experiments/inprocess.py)
        due = ready >= tcfg.min_rollouts or ready_tokens >= tcfg.token_budget or waited_long
        if due and units < world_size:
            self._say_waiting_for_ranks(units, world_size)
        if units < world_size or not due:
            return None
        self.ready_since, self.told_short_of_ranks = None, False
        taken = self.joiner.pop_ready(tcfg.max_rollouts_per_step, tcfg.token_budget, self.group_size,
                                      min_units=world_size)
        if self.sources is not None:
            for joined in taken:
                self.sources.observe(joined.source_rewards)
        rollouts = to_rollouts(taken, self.counters, self.vocab_size)
        if before_step is not None:
            rollouts = before_step(rollouts)
        if len(shard_units(rollouts)) < world_size:  # a grpo group goes whole to one rank
            # the read refused what trains nothing (trainer/untrainable.py) and the join counts a unit only
            # with action tokens: left for before_step (tests), or a join state checkpointed before that
            self.counters["too_few_for_ranks"] += len(rollouts)
            log.error("%d rollouts taken for a step of %d ranks are not trained: fewer units than ranks are left",
                      len(rollouts), world_size)
            return None
        return rollouts

    def _say_waiting_for_ranks(self, units: int, world_size: int) -> None:
        """Log once per wait that a step is due but the ranks outnumber what is ready: under light traffic
        a lone rewarded answer waited for a second one with no word of why (``trainer.max_wait_s`` said
        it would start a step)."""
        if not self.told_short_of_ranks:
            self.told_short_of_ranks = True
            log.info("a step is due but %d unit(s) of rollouts are ready for %d ranks (each rank needs one): "
                     "waiting for more traffic", units, world_size)

    def unread(self) -> dict[str, int]:
        """Records per topic the learner has not read (:meth:`unread_by_partition`, summed)."""
        unread = {self.topics.interactions: 0, self.topics.rewards: 0}
        for tp, count in self.unread_by_partition().items():
            unread[tp.topic] += count
        return unread

    def unread_by_partition(self) -> dict[TopicPartition, int]:
        """Records per partition the learner has not read: its end less the next offset to read
        there. The end is the newer of what the consumer's last poll heard and what :attr:`ends`
        last read (the feed's partitions are paused while ``READY_BACKLOG_STEPS`` steps are ready, and
        not read during a step), so it lags the traffic by ``ENDS_EVERY_S`` at most and never waits
        on the broker. A partition not heard from yet is left out; one never read from counts from its
        oldest kept record (as the watcher last read it; offset 0 before its first read)."""
        watched, begins = self.ends.ends(), self.ends.begins()
        unread: dict[TopicPartition, int] = {}
        for tp, heard in self.consumer.highwater().items():
            known = [end for end in (heard, watched.get(tp)) if end is not None]
            if known:
                start = begins.get(tp, 0)
                unread[tp] = max(0, max(known) - max(self.offsets.get(tp, start), start))
        return unread

    def keeping_up(self, trained: list[Rollout], now: float) -> KeepingUp:
        """:class:`KeepingUp` after a cycle that trained on ``trained``, at Unix time ``now``."""
        unread = self.unread()
        ages = [now - r.completed_at for r in trained if r.completed_at is not None]
        return KeepingUp(unread[self.topics.interactions], unread[self.topics.rewards],
                         self.joiner.num_waiting, self.joiner.ready_rollouts(),
                         sum(ages) / len(ages) if ages else math.nan, max(ages, default=math.nan))

    def flush_dead_letters(self) -> None:
        """Before a checkpoint: every dead letter of the records read so far on the broker (waits out
        an outage). The checkpoint's offsets are past those records, and a restart reads from them,
        not from Kafka's: a dead letter still unsent when the learner stopped was lost for good."""
        if self.dead_letters.unacknowledged:
            until_broker_takes(self.dead_letters.flush, "flushing dead letters", self.stop)

    def commit(self, offsets: dict[TopicPartition, int]) -> None:
        """After a checkpoint: flush the dead letters of the records it covers, then commit
        ``offsets`` (the ones it holds) to Kafka; both wait out a broker outage. A commit refused
        because the group dropped the consumer (a step or checkpoint longer than the group's poll
        interval) is made again once it rejoined (:meth:`_rejoin`); it crashed the learner before."""
        self.flush_dead_letters()
        until_broker_takes(lambda: self._commit(dict(offsets)), "committing offsets", self.stop)

    def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        deadline = time.monotonic() + ASSIGNMENT_TIMEOUT_S
        while True:
            try:
                self.consumer.commit(offsets)
                return
            except GroupMembershipLost as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("offsets not committed: %s; rejoining the group, then committing again", exc)
                self._rejoin()

    def _rejoin(self) -> None:
        """Poll, which rejoins the group, then put every partition the consumer holds where the feed
        reads next. The rejoin put them at the group's committed offsets, behind the feed's own (those
        are the checkpoint's, which a restart resumes from, or past them), and the poll fetched on from
        there; the records it fetched are not consumed (:func:`~trainer.partitions.assign_and_seek`):
        left where the poll put the partitions, the ones past the feed's offsets were never read."""
        fetched: dict[TopicPartition, int] = {}
        for msg in self.consumer.poll(timeout_s=REJOIN_POLL_S, max_records=MAX_POLL_RECORDS):
            fetched.setdefault(msg.tp, msg.offset)
        assign_and_seek(self.consumer, self.offsets, fetched)
        self.unheard_until, self.told_unheard = time.monotonic() + UNHEARD_HOLD_S, False

    def close(self) -> None:
        if self.ends is not None:
            self.ends.close()
        if self.consumer is not None:
            self.consumer.close()

