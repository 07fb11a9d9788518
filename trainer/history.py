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
a record stamped by a slow clock is read as the feed reads it (``JoinClock.floor``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from online_sao.batch import Rollout
from online_sao.config import Config
from online_sao.schemas import Interaction, RecordError, Reward, decode
from streams.base import StreamBackend
from trainer.join import RewardJoiner
from trainer.join_clock import JoinClock, max_behind_s

log = logging.getLogger(__name__)

HISTORY_POLL_S = 1.0
"""Wait of one poll while reading the retained history."""
HISTORY_EMPTY_POLLS = 3
"""The history is read to its end once this many polls in a row return nothing
(the first polls of a fresh consumer may be empty while it fetches metadata)."""


def _joined_rollouts(joiner: RewardJoiner, version: int) -> list[Rollout]:
    joiner.advance(math.inf)  # the end of the history: every window is over
    taken = joiner.pop_ready(max_rollouts=2**62, token_budget=2**62)
    return [j.to_rollout() for j in taken if j.interaction.policy_version == version and j.num_action_tokens]


def record_time(record: Interaction | Reward) -> float:
    """When a record entered the stream, as the broker's timestamp would say: an interaction
    is logged once it completed, a reward when it was created."""
    return record.completed_at if isinstance(record, Interaction) else record.created_at


def rollouts_from_file(path: Path, cfg: Config, version: int) -> list[Rollout]:
    """Rollouts of policy ``version`` in a JSON-lines file of encoded records.

    Records are joined in order of their own times (:func:`record_time`; equal times keep
    the file's order), so the reward window is measured in seconds, as on the topics,
    whatever order the file lists them in. Unreadable lines are skipped and counted in the log."""
    joiner = RewardJoiner(cfg.reward, cfg.trainer.join_max_pending)
    records: list[Interaction | Reward] = []
    bad = 0
    for number, line in enumerate(Path(path).read_bytes().splitlines()):
        if not line.strip():
            continue
        try:
            record = decode(line)
        except RecordError as exc:
            bad += 1
            log.warning("%s:%d skipped: %s", path, number + 1, exc)
            continue
        if isinstance(record, (Interaction, Reward)):
            records.append(record)
    for record in sorted(records, key=record_time):  # sorted() is stable: ties keep the file's order
        if isinstance(record, Interaction):
            joiner.add_interaction(record, record_time(record))
        else:
            joiner.add_reward(record, record_time(record))
    rollouts = _joined_rollouts(joiner, version)
    log.info("pre-training data from %s: %d rollouts of version %d (%d unreadable lines)",
             path, len(rollouts), version, bad)
    return rollouts


def rollouts_from_topics(backend: StreamBackend, cfg: Config, version: int) -> list[Rollout]:
    """Rollouts of policy ``version`` in the retained history of the topics."""
    topics = cfg.kafka.topics
    joiner = RewardJoiner(cfg.reward, cfg.trainer.join_max_pending)
    consumer = backend.consumer([topics.interactions, topics.rewards], group_id=None, start="earliest")
    clock = JoinClock(max_behind_s(cfg.reward.window_s))  # as the feed reads them
    bad = floored = 0
    try:
        ends, next_offsets = consumer.end_offsets(), consumer.beginning_offsets()
        empty = 0
        while empty < HISTORY_EMPTY_POLLS:
            messages = consumer.poll(timeout_s=HISTORY_POLL_S)
            empty = 0 if messages else empty + 1
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
                left = {tp: end - next_offsets.get(tp, 0) for tp, end in ends.items()}
                if isinstance(record, Interaction):
                    joiner.add_interaction(record, ts, clock=clock.limit(left))
                else:
                    joiner.add_reward(record, ts, clock=clock.limit(left))
    finally:
        consumer.close()
    rollouts = _joined_rollouts(joiner, version)
    log.info("pre-training data from the topics: %d rollouts of version %d (%d unreadable records; %d stamped "
             "more than %.0f s behind the records before them, read as that far; join: %s)",
             len(rollouts), version, bad, floored, clock.max_behind_s, joiner.counters)
    return rollouts
