"""Checkpoints written while the learner trains on.

Writing a checkpoint (serialising, fsyncing, renaming) took about a third of a second per step
on the default model on 2 CPU cores (benchmarks/results/learner.md), and every reward that
arrived meanwhile waited for it. :class:`CheckpointWriter` stages a checkpoint on the learner's
thread (private copies of every tensor and of the JSON state: cheap) and commits it on a thread
of its own. What must follow the commit -- committing the consumer offsets it covers, on the
learner's thread because a Kafka consumer is not thread-safe -- runs at the next :meth:`poll` or
:meth:`wait` after the write is done.

One write at a time: staging the next checkpoint first waits for the one in flight, so
checkpoints commit in step order and the ledger grows in order. A crash while a write is in
flight leaves the previous checkpoint the newest, its offsets the committed ones, and the write's
ledger lines cut by :meth:`~trainer.checkpoint.Checkpointer.resume`: nothing is lost or trained
twice, exactly as when a crash hits a synchronous write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from trainer.checkpoint import Checkpoint, Checkpointer, StagedCheckpoint

log = logging.getLogger(__name__)

AfterCommit = Callable[[], None]
"""What to run on the learner's thread once a checkpoint is committed."""


class CheckpointWriter:
    """Commits checkpoints on a background thread (``background``) or at once."""

    def __init__(self, checkpointer: Checkpointer, background: bool = True) -> None:
        self.checkpointer = checkpointer
        self.background = background
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight: tuple[Future[Path], AfterCommit] | None = None
        self.write_s = 0.0
        """Seconds the last committed write took (on its own thread in background mode)."""
        self.blocked_s = 0.0
        """Seconds the last :meth:`save` waited for the write before it to finish."""

    @property
    def busy(self) -> bool:
        """A write was started and its commit not yet seen by :meth:`poll` or :meth:`wait`."""
        return self._in_flight is not None

    def save(self, ckpt: Checkpoint, after_commit: AfterCommit) -> None:
        """Stage ``ckpt`` now and commit it; ``after_commit`` runs on this thread once it is
        committed: inside this call in the foreground, at a later :meth:`poll` or :meth:`wait` in
        the background. Waits for a write in flight first."""
        start = time.perf_counter()
        self.wait()
        self.blocked_s = time.perf_counter() - start
        staged = self.checkpointer.stage(ckpt)
        if not self.background:
            self._timed_write(staged)
            after_commit()
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._in_flight = (self._executor.submit(self._timed_write, staged), after_commit)

    def _timed_write(self, staged: StagedCheckpoint) -> Path:
        start = time.perf_counter()
        directory = self.checkpointer.write(staged)
        self.write_s = time.perf_counter() - start
        return directory

    def poll(self) -> None:
        """If the write in flight is done, finish it (its error, if any, is raised here)."""
        if self._in_flight is not None and self._in_flight[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until no write is in flight; run the finished one's ``after_commit``. A failed
        write raises its error here (the checkpoint is not committed; nothing runs after it)."""
        if self._in_flight is None:
            return
        future, after_commit = self._in_flight
        self._in_flight = None
        future.result()
        after_commit()

    def close(self) -> None:
        """Let a write in flight finish (a whole checkpoint is worth keeping) without running its
        ``after_commit``: close is for a learner going down, whose offsets then trail its newest
        checkpoint, which is allowed (they matter only when no checkpoint exists)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        failure = self._in_flight[0].exception() if self._in_flight is not None else None
        if failure is not None:
            log.error("the checkpoint being written when the learner stopped failed: %s", failure)
        self._in_flight = None
