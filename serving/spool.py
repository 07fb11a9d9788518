"""The local append-only spool of records the broker has not acknowledged.

With ``serving.log_durability: write_ahead`` (the default) every record passes
through the spool: it is appended and fsynced before the client is answered,
and the sender ships it from here. With ``memory`` only records the broker
could not take in time come here. Either way the format and guarantees below
hold. All methods are thread-safe (one lock): the writer appends while the
sender reads and acknowledges.

Layout under ``directory``:

* ``spool.log``: entries in the order they were appended, framed as
  :mod:`serving.spool_format` describes (length, CRC, payload, newline), so that
  after damaged bytes the next intact entry is found again. Recovery therefore
  loses exactly the damaged bytes:

  - an incomplete last entry (the file ends inside it: a write cut short by a
    crash, never reported written) is cut off;
  - any other damaged stretch is taken out and, unless the next intact entry
    shows it was acknowledged already, replaced by a
    :class:`~online_sao.schemas.DeadLetter` (its raw bytes, byte offset and the
    reason) appended as a new entry for the dead-letter topic, so it reaches
    the broker like any record; the intact entries after it are replayed in
    order. The log is rewritten atomically (write, fsync, rename;
    :mod:`serving.spool_recovery`).

  Each damaged stretch is also copied whole to ``spool.corrupt-<time>-<offset>``
  for inspection. The format is the same as before this recovery existed, so
  older spools are read as they are. A last entry whose length field was
  damaged to a larger value looks like a cut-short write and is cut off (its
  bytes are in the side file).
* ``spool.acked``: the sequence number up to which every entry was acknowledged
  by the broker, replaced atomically (write, fsync, rename, fsync the
  directory). An unreadable one (empty, garbage) counts every entry as pending,
  with a warning, and makes the read back window unknown. Entries at or below
  it are never sent again, also after a restart. When every entry on disk is
  acknowledged the log is emptied; when the acknowledged prefix is at least as
  large as the rest (and worth it, see :data:`COMPACT_MIN_BYTES`) the rest is
  copied to a new log that replaces the old one atomically (compaction), so a
  log that is never fully acknowledged under steady traffic stays small. An
  append that would pass ``max_bytes`` compacts by the same rule only: copying
  a large rest to free a few entries' room, once per append, rewrote the quota
  many times over while a full spool drained.
* ``spool.window``: the most records a process may have had with the producer
  at once (``serving.log_window``) among the entries pending now, the widest of
  every process since the spool was last found empty; written (as ``spool.acked``)
  before the process sends an entry of the spool: when it starts with entries
  pending, else with its first append. A restart reads back that many pending
  entries (:meth:`Spool.readback_window`), also when it runs with a smaller
  window itself.

fsync policy: every :meth:`Spool.append` call (one batch of records: the
logger's group commit) ends with ``fsync`` of the log (and of the directory
when the log was created or replaced by a compaction whose own directory fsync
failed), and every acknowledgement watermark is fsynced before the rename, so
an entry reported written survives a power loss. An append whose directory
fsync fails is taken back (the file truncated to where it began) and reported
failed, so that the retry does not write its entries a second time. An entry that
was acknowledged by the broker but whose watermark was not yet written (a crash
in between) is pending again after a restart; the sender's read back of the
topics (:mod:`serving.spool_readback`) finds it there and does not send it again.

Writes that fail (disk full, quota ``max_bytes`` reached, I/O error) never
raise: the entries are kept in memory, in order, after everything on disk
(:mod:`serving.spool_overflow`), :attr:`Spool.error` says why, and the next
append retries them first. Emptying the log when all of it is acknowledged
never raises either: a log that cannot be truncated stays valid and is
truncated (or compacted) later. A read of the
log that fails (:meth:`Spool.read_pending`) raises, with :attr:`Spool.error`
saying why until a read succeeds; the sender retries it.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from collections import deque
from pathlib import Path

from online_sao.durable import fsync_dir, private_opener, replace_with_text
from serving.spool_format import HEADER_BYTES, SpoolEntry, decode_payload
from serving.spool_overflow import Overflow
from serving.spool_recovery import recover_log

log = logging.getLogger(__name__)

COMPACT_MIN_BYTES = 1 << 20
"""An acknowledged prefix smaller than this (or than a quarter of ``max_bytes``) is
not worth copying the rest of the log for; it goes when the log empties."""


class SpoolFull(OSError):
    """Appending would take the spool beyond its configured size."""


class Spool:
    def __init__(self, directory: Path, max_bytes: int, *, dead_letter_topic: str):
        """``dead_letter_topic`` receives the dead letters of damaged entries found on recovery."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.dead_letter_topic = dead_letter_topic
        self.log_path = self.directory / "spool.log"
        self.acked_path = self.directory / "spool.acked"
        self.window_path = self.directory / "spool.window"
        self.error: str | None = None
        """Why the last append, or the last read of the log, failed (None once one succeeds again)."""
        self._read_error: str | None = None
        """:attr:`error` as the last failed read of the log set it (a read that succeeds clears only that)."""
        self.dropped_corrupt_bytes = 0
        """Bytes of damaged entries taken out of the log by this start's recovery."""
        self.dead_lettered_entries = 0
        """Damaged stretches this start's recovery replaced by a dead letter."""
        self.watermark_error: str | None = None
        self.compactions = 0
        self._lock = threading.RLock()
        self._log_file: io.FileIO | None = None
        """The log, open (unbuffered) for appending between compactions: one open per append
        costs the writer, which runs beside the engine, a noticeable share of its CPU."""
        self._dir_sync_due = False
        """The log's directory entry changed (created, replaced) and its fsync has not succeeded yet:
        the next append fsyncs the directory before it reports its entries written."""
        self._window_due: int | None = None
        """A read back window the next append writes down first (see :meth:`readback_window`)."""
        self._overflow = Overflow()
        self._window_unknown = False
        """``spool.acked`` was unreadable: how many entries an earlier process handed out is not known."""
        self._base = 0
        """Logical offset of the log file's first byte: offsets only grow, so an entry read
        before a compaction or reset never points into the wrong place."""
        self._acked_seq = self._read_watermark()
        self._unacked: deque[tuple[int, int]] = deque()
        """``(sequence number, logical end offset)`` of the entries on disk above the acknowledged
        offset, in order: how many are pending, and what an acknowledgement covers, without reading
        the log again (also for an entry read from memory and written to disk since)."""
        self._acked_offset, self._log_size, self.last_seq = self._recover()

    # ------------------------------------------------------------------ state

    @property
    def pending_records(self) -> int:
        """Entries not yet acknowledged (on disk and held in memory). Read under the lock: an
        acknowledgement of everything empties the list before it truncates the log (a watermark's fsync
        between), and a logger's flush that read none pending then returned with the log still full."""
        with self._lock:
            return len(self._unacked) + len(self._overflow)

    @property
    def held_in_memory(self) -> int:
        """Entries that could not be written and are held in memory (lost if the process exits)."""
        return len(self._overflow)

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._log_size - self._acked_offset + self._overflow.bytes

    @property
    def file_bytes(self) -> int:
        """Size of the log file (acknowledged prefix included), what counts against ``max_bytes``."""
        return self._log_size - self._base

    @property
    def acked_seq(self) -> int:
        return self._acked_seq

    # ------------------------------------------------------------------ recovery

    def _read_watermark(self) -> int:
        try:
            text = self.acked_path.read_text(errors="replace")
        except FileNotFoundError:
            return 0
        try:
            return int(text.split()[0])
        except (ValueError, IndexError):
            # the window written down fits the watermark that was lost: every entry is pending now
            log.warning("unreadable %s (%r): every entry of the log counts as pending, and a restart reads "
                        "all of them back from the topics", self.acked_path, text[:40])
            self._window_unknown = True
            return 0

    def _recover(self) -> tuple[int, int, int]:
        """(acknowledged offset, log size, last sequence number) from the files; fills the
        pending entries' end offsets."""
        found = recover_log(self.log_path, self._acked_seq, self.dead_letter_topic)
        self.dropped_corrupt_bytes = found.dropped_corrupt_bytes
        self.dead_lettered_entries = found.dead_lettered_entries
        entries, size = found.entries, found.size
        acked_offset = max((e.end_offset for e in entries if e.seq <= self._acked_seq), default=0)
        self._unacked.extend((e.seq, e.end_offset) for e in entries if e.end_offset > acked_offset)
        last_seq = max([self._acked_seq] + [e.seq for e in entries])
        return acked_offset, size, last_seq

    # ------------------------------------------------------------------ writing

    def append(self, entries: list[SpoolEntry]) -> bool:
        """Write the held-back entries, then these, in order, with one fsync; False (and
        :attr:`error`) if they stay in memory."""
        with self._lock:
            if entries:
                self.last_seq = max(self.last_seq, entries[-1].seq)
            self._overflow.hold(entries)  # each encoded once: retries and metrics reuse the bytes
            if not self._overflow:
                return True
            if self._window_due is not None:
                self._persist_window(self._window_due)
                self._window_due = None
            try:
                self._make_room(self._overflow.bytes)
                self._write(self._overflow.data())
            except OSError as exc:
                self.error = f"cannot write the spool at {self.log_path}: {exc}"
                return False
            for entry, chunk in self._overflow.take():
                self._log_size += len(chunk)
                self._unacked.append((entry.seq, self._log_size))
            self.error = None
            return True

    def _make_room(self, size: int) -> None:
        """SpoolFull unless ``size`` more bytes fit the quota, compacting first where that pays."""
        if self.file_bytes + size > self.max_bytes and self._compaction_pays():
            self._compact()  # else the entries wait in memory until acknowledgements free enough
        if self.file_bytes + size > self.max_bytes:
            raise SpoolFull(f"spool would grow to {self.file_bytes + size} bytes, "
                            f"beyond serving.spool_max_bytes={self.max_bytes}")

    def _compaction_pays(self) -> bool:
        """The acknowledged prefix is worth copying the rest for: at least as large (so compactions copy
        no more than was appended) and than :data:`COMPACT_MIN_BYTES` or a quarter of the quota."""
        garbage, rest = self._acked_offset - self._base, self._log_size - self._acked_offset
        return garbage > 0 and garbage >= max(rest, min(COMPACT_MIN_BYTES, self.max_bytes // 4))

    def _write(self, data: bytes) -> None:
        if self._log_file is None:
            if not self.log_path.exists():
                self._dir_sync_due = True  # the new file's name must survive a power loss too
            self._log_file = open(self.log_path, "ab", buffering=0, opener=private_opener)
        fh = self._log_file
        start = os.fstat(fh.fileno()).st_size  # not tell(): a reset truncates the file under this handle
        try:
            view = memoryview(data)
            while view:  # unbuffered: nothing of a failed append lingers in a buffer to be written later
                view = view[fh.write(view):]
            os.fsync(fh.fileno())
            if self._dir_sync_due:
                fsync_dir(self.directory)
                self._dir_sync_due = False
        except OSError:
            # never leave an append behind that is reported failed: its entries stay in memory and the
            # retry writes them again (a directory fsync failing after the data's is such a failure too)
            fh.truncate(start)
            raise

    # ------------------------------------------------------------------ replay

    def read_pending(self, limit: int) -> list[SpoolEntry]:
        """Up to ``limit`` unacknowledged entries, oldest first (disk, then memory). Raises the
        OSError of a read of the log that failed (out of file descriptors, an I/O error), after
        setting :attr:`error`: nothing after the entries on disk may be handed out before them."""
        with self._lock:
            try:
                out = self._read_disk(limit)
            except OSError as exc:
                if self._read_error is None:  # once per failing stretch: the sender retries every retry_s
                    log.warning("cannot read the spool at %s (retried): %s", self.log_path, exc)
                self.error = self._read_error = f"cannot read the spool at {self.log_path}: {exc}"
                raise
            if self._read_error is not None:
                log.info("the spool at %s is readable again", self.log_path)
                if self.error == self._read_error:  # an append's error since then stays
                    self.error = None
                self._read_error = None
            return out + self._overflow.oldest(limit - len(out))

    def _read_disk(self, limit: int) -> list[SpoolEntry]:
        """Up to ``limit`` unacknowledged entries of the log file, oldest first (caller holds the lock)."""
        out: list[SpoolEntry] = []
        if self._log_size > self._acked_offset:
            with open(self.log_path, "rb") as fh:
                fh.seek(self._acked_offset - self._base)
                offset = self._acked_offset
                while len(out) < limit and offset < self._log_size:
                    header = fh.read(HEADER_BYTES)
                    length = int(header[0:8], 16)
                    payload = fh.read(length)
                    fh.read(1)
                    offset += HEADER_BYTES + length + 1
                    entry = decode_payload(payload, offset)
                    if entry.seq > self._acked_seq:
                        out.append(entry)
        return out

    def ack_through(self, entry: SpoolEntry) -> None:
        """Every entry up to and including ``entry`` is acknowledged by the broker."""
        with self._lock:
            if entry.seq <= self._acked_seq:
                return
            end_offset = entry.end_offset
            if end_offset is None:  # read from memory; the writer may have put it on disk since
                end_offset = next((end for seq, end in self._unacked if seq == entry.seq), None)
            if end_offset is None:  # still in memory: drop it and everything before it
                self._overflow.drop_through(entry.seq)
                self._acked_offset = self._log_size
                self._unacked.clear()
            else:
                while self._unacked and self._unacked[0][1] <= end_offset:
                    self._unacked.popleft()
                self._acked_offset = end_offset
            self._acked_seq = entry.seq
            if self._log_size == self._acked_offset:  # all of the disk is acknowledged: give it back
                self._reset()
                return
            self._persist_watermark()
            if self._compaction_pays():
                try:
                    self._compact()
                except OSError as exc:  # the old log stays valid: only space is not given back yet
                    log.warning("spool compaction failed (retried later): %s", exc)

    def _compact(self) -> None:
        """Replace the log by its unacknowledged rest (write, fsync, rename, fsync the directory)."""
        tmp = self.log_path.with_name(self.log_path.name + ".compact")
        with open(self.log_path, "rb") as src:
            src.seek(self._acked_offset - self._base)
            rest = src.read(self._log_size - self._acked_offset)
        try:
            with open(tmp, "wb", opener=private_opener) as fh:
                fh.write(rest)
                fh.flush()
                os.fsync(fh.fileno())
            self._close_log()  # its handle would point at the replaced file
            os.replace(tmp, self.log_path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        # the log on disk is the rest now, whatever happens next: offsets must say so at once
        self._base = self._acked_offset
        self.compactions += 1
        try:
            fsync_dir(self.directory)
        except OSError as exc:  # a power loss may bring the old log back: valid, its prefix is acknowledged
            self._dir_sync_due = True  # but entries appended to the new one are not written until it sticks
            log.warning("spool compaction: cannot fsync %s (retried by the next append): %s", self.directory, exc)

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def close(self) -> None:
        """Release the log's file handle (the next append opens it again)."""
        with self._lock:
            self._close_log()

    def _persist_watermark(self) -> None:
        """Best effort: a watermark that cannot be written only means re-sending after a crash."""
        try:
            replace_with_text(self.acked_path, f"{self._acked_seq}\n")
            self.watermark_error = None
        except OSError as exc:
            self.watermark_error = f"cannot write {self.acked_path}: {exc}"
            log.warning("%s; acknowledged entries may be sent again after a restart", self.watermark_error)
            # after a crash, entries the broker acknowledged come back as pending, beyond any window a
            # process had with the producer: without a window written down, the start reads back every
            # pending entry, and finds them on the topics instead of sending them twice
            self.window_path.unlink(missing_ok=True)  # works on a full disk

    def readback_window(self, window: int) -> int:
        """How many of the oldest pending entries the read back after a restart must check: the most
        any process may have handed to the producer among them, ``window`` (this process's) or an
        earlier process's wider one. Written down first, so that the next start checks as many."""
        with self._lock:
            recorded = self._read_window()
            if not self.pending_records:
                # nothing an earlier process handed out is pending: this window counts, written down with
                # the first append (no fsync at a start that finds it written already or never spools)
                self._window_due = None if window == recorded else window
                return window
            # unknown (a version before this file, or its write failed): every pending entry
            widest = max(window, self.pending_records if recorded is None else recorded)
            if widest != recorded:
                self._persist_window(widest)  # before this process sends an entry: it is pending already
            return widest

    def _read_window(self) -> int | None:
        if self._window_unknown:
            return None
        try:
            return int(self.window_path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _persist_window(self, window: int) -> None:
        try:
            replace_with_text(self.window_path, f"{window}\n")
        except OSError as exc:
            log.warning("cannot write %s (%s): after a crash, every pending record is read back", self.window_path, exc)
            try:  # a narrower window left there would be taken for this process's
                self.window_path.unlink(missing_ok=True)
            except OSError as unlink_exc:
                log.warning("cannot remove %s: %s; after a crash, records the broker took may reach their "
                            "topics twice", self.window_path, unlink_exc)

    def _reset(self) -> None:
        """Every entry on disk is acknowledged: empty the log, keep the sequence counter."""
        self._unacked.clear()
        self._persist_watermark()  # first: a crash before the truncate leaves entries known to be acknowledged
        try:
            with open(self.log_path, "wb"):
                pass  # truncating frees space, so it works on a full disk too
        except OSError as exc:
            # the log stays valid (all of it acknowledged, appends go after it); the next reset or
            # compaction gives its space back
            log.warning("cannot empty the spool at %s (retried later): %s", self.log_path, exc)
            return
        self._base = self._acked_offset = self._log_size
