"""Where the learner's consumer reads from when it joins its group: the checkpoint's offsets,
checked against the partitions the broker has now (:func:`drop_gone_partitions`,
:func:`assign_and_seek`; used by :class:`trainer.feed.Feed` at start and after a rejoin)."""

from __future__ import annotations

import logging
import time

from streams.base import Consumer, TopicPartition

log = logging.getLogger(__name__)

ASSIGNMENT_TIMEOUT_S = 60.0
"""How long the consumer may take to join its group and get partitions (a group
whose previous member was killed waits for that member's session to expire)."""


def drop_gone_partitions(offsets: dict[TopicPartition, int], partitions: dict[str, int]) -> None:
    """Remove from ``offsets`` every partition that does not exist (``partitions``: partition count per
    topic), with an error in the log for each: a checkpoint from before the topics were made again with
    fewer partitions (or under other names) names partitions no consumer is assigned, so
    :func:`assign_and_seek` never sees them; kept, they were checkpointed again and committed, and a
    commit naming a partition that does not exist is refused (ValueError): the learner crashed at every
    checkpoint. Their records are gone with the partition: nothing is left to read there."""
    for tp in sorted(offsets):
        if tp.partition >= partitions.get(tp.topic, 0):
            now = f"the topic has {partitions[tp.topic]} partitions" if tp.topic in partitions else "no such topic"
            log.error("%s[%d]: the checkpoint's offset %d is of a partition that does not exist (%s): the topics "
                      "were made again since; offset dropped", tp.topic, tp.partition, offsets.pop(tp), now)


def assign_and_seek(consumer: Consumer, offsets: dict[TopicPartition, int],
                    fetched: dict[TopicPartition, int] | None = None) -> None:
    """Wait for the group to assign partitions, then put every partition where the
    checkpoint says. Records fetched while joining the group are not consumed: a
    partition without a checkpointed offset is put back to the first of them. A checkpointed
    offset past its partition's end (the topics were deleted and made again, under the same
    names) is read from the partition's start, with an error in the log: Kafka would reset it to
    the start by itself, and the feed then took every record before the old offset for one
    already read and skipped it, uncounted. A partition the checkpoint does not name gets the
    consumer's position in ``offsets`` (a new checkpoint directory beside a group with committed
    offsets: until 2026-12-06 every record from the partition's start counted unread, and the join's
    clock stood still until that partition had a new record). ``fetched``: the first offset of each
    partition a poll before this one fetched (not consumed either)."""
    first_fetched: dict[TopicPartition, int] = dict(fetched or {})
    started = time.monotonic()
    deadline = started + ASSIGNMENT_TIMEOUT_S
    while not consumer.assignment():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no partitions assigned within {ASSIGNMENT_TIMEOUT_S} s")
        for msg in consumer.poll(timeout_s=0.5):
            first_fetched.setdefault(msg.tp, msg.offset)
    ends, starts = consumer.end_offsets(), consumer.beginning_offsets()
    for tp in consumer.assignment():
        if tp in offsets and offsets[tp] > ends.get(tp, offsets[tp]):
            log.error("%s[%d]: the checkpoint's offset %d is past the partition's end %d: the topic was made again "
                      "since; reading it from its start (%d)", tp.topic, tp.partition, offsets[tp], ends[tp],
                      starts.get(tp, 0))
            offsets[tp] = starts.get(tp, 0)
        if tp in offsets:
            consumer.seek(tp, offsets[tp])
        else:
            if tp in first_fetched:
                consumer.seek(tp, first_fetched[tp])
            # where it reads from (its group's committed offset, when nothing was fetched): the unread
            # count, and the join's clock held at the partition read least far, start there, not at 0
            offsets[tp] = consumer.position(tp)
    log.info("consumer holds %d partitions after %.1f s", len(consumer.assignment()), time.monotonic() - started)
