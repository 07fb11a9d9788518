"""Logged rollouts for value pre-training: the topics' retained history, or a file.

``learn --pretrain-critic`` fits the critic on rollouts of the policy it starts
from before any policy update (SAO.md section 3). They come from a JSON-lines
file of encoded interaction and reward records (``trainer.pretrain_file``) or,
by default, from everything the interactions and rewards topics still retain,
read by a group-less consumer that commits nothing (the learner's own consumer
group later trains on the same records as usual). Either way records are joined
with the configured reward window on record time (the broker's timestamps on the
topics, the records' own times in a file); windows still open at the end close as if
the window had passed (default reward or drop, per ``reward.on_missing``). The topics' partitions
are read one after another, so the join's clock is held as the learner's feed holds it
(trainer/join_clock.py) until every partition is read to where it ended when the read began, and
a record stamped by a slow clock is read as the feed reads it (``JoinClock.floor``). The read
ends where the partitions ended when it began: serving may go on logging meanwhile (those records are
the learner's to train on), and a read that waited for the topics to fall quiet never ended while it
did. Rollouts unusable by the model (a token id past its vocabulary: a history logged under another
model, a hand-made file) are counted in the log and left out, as the feed leaves them out
(:func:`trainer.rollouts.to_rollouts`); one crashed the fit, at every restart.

The read keeps the newest ``trainer.pretrain_max_rollouts`` usable rollouts of the version, in the
order the join hands them out (as a learner step takes them: the order their records were read,
offsets within a partition; record time in a file), and holds no more than those and the join's open
windows whatever the topics retain: a rollout is taken from the join as soon as no record read later
can change it (:meth:`HistoryJoiner.pop_settled`). Holding the whole retained history (about 130 kB
a rollout of 1,000 tokens, a week of it at 10 a second) ran the learner out of memory before its
first step.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from pathlib import Path

from online_sao.batch import Rollout
from online_sao.config import Config
from online_sao.schemas import Interaction, RecordError, Reward, decode
from streams.base import Consumer, StreamBackend, TopicPartition
from trainer.rollouts import to_rollouts
from trainer.join import JoinedInteraction, RewardJoiner
from trainer.join_clock import JoinClock, max_behind_s
from trainer.join_state import Entry
from trainer.reward_range import reward_out_of_range

log = logging.getLogger(__name__)

HISTORY_POLL_S = 1.0
"""Wait of one poll while reading the retained history."""
HISTORY_STALLED_POLLS = 3
"""The read also ends once this many polls in a row brought no record before the ends it aims for
(the first polls of a fresh consumer may be empty while it fetches metadata): a partition whose last
offsets hold no record a consumer returns (a transaction's markers, a compacted topic) is never
read to its end."""


class HistoryJoiner(RewardJoiner):
    """The reward join of a history read, which hands out each rollout once it is settled."""

    def pop_settled(self) -> list[JoinedInteraction]:
        """Take the ready rollouts at the head of the ready order (the order :meth:`pop_ready` takes
        them in) that no record read later can change (:meth:`_settled`), and, past ``max_pending``
        ready ones (the join's clock held back while a partition is behind: trainer/join_clock.py),
        the oldest whatever their windows: a reward still to come for one is counted late, as the join
        gives up the oldest waiting interaction past the same bound. Taken one by one in that order,
        they are what one :meth:`pop_ready` of everything at the end would hand out."""
        taken = []
        while self._ready:
            head = next(iter(self._ready.values()))
            if not (self._settled(head) or len(self._ready) > self.max_pending):
                break
            taken.append(self._take(head, -1))
        return taken

    def _settled(self, entry: Entry) -> bool:
        """Whether every reward read from now on is late for ``entry`` and for each pending entry that
        taking ``entry`` changes: an ancestor still ready (taking ``entry`` absorbs it) and a
        continuation holding one of its turns (the claim moves to ``entry`` with its rewards). A reward
        past a pending entry's window is late (:meth:`_past_window`), as is one for an id taken; taken
        before that, an entry would lose a reward that the one take at the end of the read joined."""
        touched = [entry]
        for origin in entry.interaction.origins():
            owner = self._claims.get(origin.interaction_id)
            touched += [e for e in (self._ready.get(origin.interaction_id),
                                    None if owner is None else self._pending(owner)) if e is not None]
        return all(self._past_window(e, -math.inf) for e in touched)

    def close_open_windows(self) -> None:
        """The end of the history: every window still open is over. The clock moves just past the last
        window's end, not to infinity: the id memory forgets what is older than its horizon behind the
        clock, and at infinity it forgot every finished id, so a continuation taken at the end observed
        the turns of an unrated first answer that the same continuation taken mid-read trained."""
        ends = [self._window_end(e) for e in (*self._waiting.values(), *self._ready.values())]
        ends += [c.ts + self.cfg.window_s for held in self._held.values() for c in held]
        if ends:
            self.advance(math.nextafter(max(ends), math.inf))


class NewestRollouts:
    """The newest ``keep`` usable rollouts of policy ``version`` among those the join hands out (with
    ``vocab_size``, those the model can take), in the order it hands them out."""

    def __init__(self, version: int, vocab_size: int | None, keep: int) -> None:
        self.version = version
        self.vocab_size = math.inf if vocab_size is None else vocab_size  # inf: no id past it
        self.kept: deque[Rollout] = deque(maxlen=keep)
        self.usable = 0
        """Usable rollouts of the version handed out, kept or not."""
        self.counts = {"invalid_rollouts": 0, "empty_rollouts": 0}

    def add(self, taken: list[JoinedInteraction]) -> None:
        of_version = [j for j in taken if j.interaction.policy_version == self.version]
        rollouts = to_rollouts(of_version, self.counts, self.vocab_size)
        self.usable += len(rollouts)
        self.kept.extend(rollouts)


def _rollouts_at_end(joiner: HistoryJoiner, newest: NewestRollouts) -> list[Rollout]:
    """``newest`` once the history is read: every window still open is over."""
    joiner.close_open_windows()
    newest.add(joiner.pop_settled())
    if newest.counts["invalid_rollouts"]:
        log.warning("pre-training data: %d rollouts of version %d left out as unusable (see above)",
                    newest.counts["invalid_rollouts"], newest.version)
    if newest.usable > len(newest.kept):
        log.info("pre-training data: the newest %d of %d usable rollouts of version %d kept "
                 "(trainer.pretrain_max_rollouts)", len(newest.kept), newest.usable, newest.version)
    return list(newest.kept)


def record_time(record: Interaction | Reward) -> float:
    """When a record entered the stream, as the broker's timestamp would say: an interaction
    is logged once it completed, a reward when it was created."""
    return record.completed_at if isinstance(record, Interaction) else record.created_at


def rollouts_from_file(path: Path, cfg: Config, version: int, vocab_size: int | None = None) -> list[Rollout]:
    """The newest ``trainer.pretrain_max_rollouts`` rollouts of policy ``version`` in a JSON-lines
    file of encoded records.

    Records are joined in order of their own times (:func:`record_time`; equal times keep
    the file's order), so the reward window is measured in seconds, as on the topics,
    whatever order the file lists them in. Unreadable lines are skipped and counted in the log;
    with ``vocab_size`` (the model's), so are rollouts with a token id at or past it (None: not
    checked, the caller's model takes any). The records are read twice, for their times and then
    one at a time in time order, so what is held is their times, not the records."""
    joiner = HistoryJoiner(cfg.reward, cfg.trainer.join_max_pending)
    newest = NewestRollouts(version, vocab_size, cfg.trainer.pretrain_max_rollouts)
    in_time_order, bad = _times_and_offsets(path)
    out_of_range = 0
    with Path(path).open("rb") as file:
        for _, offset in sorted(in_time_order):  # ties keep the file's order: offsets grow along it
            file.seek(offset)
            record = decode(file.readline())
            if isinstance(record, Interaction):
                joiner.add_interaction(record, record_time(record))
            elif (problem := reward_out_of_range(record, cfg.reward)) is not None:
                out_of_range += 1
                log.warning("%s: a reward left out: %s", path, problem)
            else:
                joiner.add_reward(record, record_time(record))
            newest.add(joiner.pop_settled())
    rollouts = _rollouts_at_end(joiner, newest)
    log.info("pre-training data from %s: %d rollouts of version %d (%d unreadable lines, %d rewards outside "
             "reward.min_value..max_value left out)", path, len(rollouts), version, bad, out_of_range)
    return rollouts


def _times_and_offsets(path: Path) -> tuple[list[tuple[float, int]], int]:
    """The record time and the line's byte offset of each interaction and reward in the file, and
    how many lines could not be read (each logged)."""
    found: list[tuple[float, int]] = []
    bad = offset = 0
    with Path(path).open("rb") as file:
        for number, line in enumerate(file):
            at, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                record = decode(line)
            except RecordError as exc:
                bad += 1
                log.warning("%s:%d skipped: %s", path, number + 1, exc)
                continue
            if isinstance(record, (Interaction, Reward)):
                found.append((record_time(record), at))
    return found, bad


def rollouts_from_topics(backend: StreamBackend, cfg: Config, version: int,
                         vocab_size: int | None = None) -> list[Rollout]:
    """The newest ``trainer.pretrain_max_rollouts`` rollouts of policy ``version`` in the retained
    history of the topics, up to where each partition ended when the read began (``vocab_size`` as
    for :func:`rollouts_from_file`)."""
    topics = cfg.kafka.topics
    joiner = HistoryJoiner(cfg.reward, cfg.trainer.join_max_pending)
    newest = NewestRollouts(version, vocab_size, cfg.trainer.pretrain_max_rollouts)
    consumer = backend.consumer([topics.interactions, topics.rewards], group_id=None, start="earliest")
    clock = JoinClock(max_behind_s(cfg.reward.window_s))  # as the feed reads them
    bad = floored = 0
    try:
        ends, next_offsets = consumer.end_offsets(), consumer.beginning_offsets()
        to_read = _not_read_to(ends, next_offsets, consumer)
        stalled = 0
        while to_read and stalled < HISTORY_STALLED_POLLS:
            messages = [m for m in consumer.poll(timeout_s=HISTORY_POLL_S) if m.offset < ends.get(m.tp, 0)]
            stalled = 0 if messages else stalled + 1  # records logged since the read began do not count
            for msg in messages:
                next_offsets[msg.tp] = msg.offset + 1
                ts = clock.floor(msg.tp, msg.timestamp_ms / 1000, joiner.watermark)
                floored += ts > msg.timestamp_ms / 1000
                clock.read(msg.tp, ts)
                try:  # the learner's own consumer dead-letters bad records; here they are only skipped
                    record = decode(msg.value, Interaction if msg.topic == topics.interactions else Reward)
                except RecordError:
                    bad += 1
                    continue
                if isinstance(record, Reward) and reward_out_of_range(record, cfg.reward) is not None:
                    bad += 1  # the learner's feed dead-letters it: it trains nothing there either
                    continue
                left = {tp: end - next_offsets.get(tp, 0) for tp, end in ends.items()}
                if isinstance(record, Interaction):
                    joiner.add_interaction(record, ts, clock=clock.limit(left))
                else:
                    joiner.add_reward(record, ts, clock=clock.limit(left))
                newest.add(joiner.pop_settled())
            to_read = _not_read_to(ends, next_offsets, consumer, to_read)
        if to_read:
            log.warning("pre-training data: %d partitions not read to where they ended (%d polls in a row brought "
                        "nothing of it): read as far as they came", len(to_read), HISTORY_STALLED_POLLS)
    finally:
        consumer.close()
    rollouts = _rollouts_at_end(joiner, newest)
    log.info("pre-training data from the topics: %d rollouts of version %d (%d unreadable records or rewards outside "
             "reward.min_value..max_value; %d stamped "
             "more than %.0f s behind the records before them, read as that far; join: %s)",
             len(rollouts), version, bad, floored, clock.max_behind_s, joiner.counters)
    return rollouts


def _not_read_to(ends: dict[TopicPartition, int], next_offsets: dict[TopicPartition, int], consumer: Consumer,
                 reading: set[TopicPartition] | None = None) -> set[TopicPartition]:
    """The partitions of ``reading`` (default: all of ``ends``) not yet read to their end; the others
    are paused, so the records logged there since the read began are not fetched for nothing."""
    reading = set(ends) if reading is None else reading
    done = {tp for tp in reading if next_offsets.get(tp, 0) >= ends[tp]}
    if done:
        consumer.pause(done)
    return reading - done
