"""The spool against a model of its promises (hypothesis, stateful): any sequence of appends,
reads, acknowledgements and restarts, under a quota small enough that appends fail, entries wait
in memory and the log is compacted.

The model is the list of pending entries in the order they were appended, each marked on disk or
in memory. The spool must hand them out in that order, never one acknowledged, and a restart must
bring back exactly those on disk (one held in memory was never reported written: it is lost with
the process, by design). The log never outgrows its quota.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from serving.spool import Spool, SpoolEntry

DLQ = "dead-letters"


class SpoolModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="spool-model-"))
        self.spool: Spool | None = None
        self.max_bytes = 0
        self.pending: list[tuple[SpoolEntry, bool]] = []
        """(entry, on disk) for every entry appended and not acknowledged, in order."""
        self.last_read: list[SpoolEntry] = []
        self.next_seq = 1

    @initialize(quota=st.integers(150, 900))
    def open(self, quota: int) -> None:
        self.max_bytes = quota
        self.spool = Spool(self.directory, quota, dead_letter_topic=DLQ)

    @rule(sizes=st.lists(st.integers(1, 60), max_size=4))
    def append(self, sizes: list[int]) -> None:
        batch = [SpoolEntry(self.next_seq + i, "t", f"k{self.next_seq + i}".encode(),
                            bytes([65 + (self.next_seq + i) % 26]) * size) for i, size in enumerate(sizes)]
        self.next_seq += len(batch)
        written = self.spool.append(batch)
        entries = [entry for entry, _ in self.pending] + batch
        held = self.spool.held_in_memory
        assert written == (held == 0)
        self.pending = [(entry, k < len(entries) - held) for k, entry in enumerate(entries)]

    @rule(limit=st.integers(1, 12))
    def read(self, limit: int) -> None:
        got = self.spool.read_pending(limit)
        expected = [entry for entry, _ in self.pending[:limit]]
        assert [(e.seq, e.key, e.value) for e in got] == [(e.seq, e.key, e.value) for e in expected]
        self.last_read = got

    @precondition(lambda self: self.last_read)
    @rule(data=st.data())
    def acknowledge(self, data) -> None:
        entry = data.draw(st.sampled_from(self.last_read))
        self.spool.ack_through(entry)
        self.pending = [(e, on_disk) for e, on_disk in self.pending if e.seq > entry.seq]

    @rule()
    def restart(self) -> None:
        self.spool.close()
        self.spool = Spool(self.directory, self.max_bytes, dead_letter_topic=DLQ)
        self.pending = [(entry, True) for entry, on_disk in self.pending if on_disk]
        self.last_read = []  # a sender never keeps entries read by the process before
        assert self.spool.last_seq >= max((e.seq for e, _ in self.pending), default=0)
        self.next_seq = self.spool.last_seq + 1  # as the interaction log goes on numbering
        assert self.spool.dead_lettered_entries == 0 and self.spool.dropped_corrupt_bytes == 0

    @invariant()
    def counts_and_quota(self) -> None:
        if self.spool is None:
            return
        assert self.spool.pending_records == len(self.pending)
        assert self.spool.held_in_memory == sum(1 for _, on_disk in self.pending if not on_disk)
        assert self.spool.file_bytes <= self.max_bytes

    def teardown(self) -> None:
        if self.spool is not None:
            self.spool.close()
        shutil.rmtree(self.directory, ignore_errors=True)


SpoolModel.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_the_spool_keeps_its_promises_under_any_sequence = SpoolModel.TestCase
