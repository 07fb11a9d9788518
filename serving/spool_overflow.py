"""The entries the spool could not write, held in memory in order, each with its encoded bytes.

With the spool's quota reached (or its disk full) as many as ``serving.log_queue_size`` records
wait here, and every append retries them, the sender reads them and every metrics scrape counts
their bytes, all with the spool's lock held. Each entry is therefore encoded once, when it is first
held, and the total size kept as entries come and go: re-encoding all of them on each of these
calls cost about a second per call at 10,000 held 20 KB records, taken from the engine and the
event loop exactly while logging was degraded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from itertools import islice

from serving.spool_format import SpoolEntry


class Overflow:
    """Entries held in memory, oldest first, with their encoded bytes; not thread-safe (the spool's lock)."""

    def __init__(self) -> None:
        self._held: deque[tuple[SpoolEntry, bytes]] = deque()
        self.bytes = 0
        """Size of the held entries as the log would hold them."""

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, entries: Iterable[SpoolEntry]) -> None:
        """Keep ``entries`` after the held ones, encoded (all of them before any is kept)."""
        encoded = [(entry, entry.encode()) for entry in entries]
        self._held.extend(encoded)
        self.bytes += sum(len(chunk) for _, chunk in encoded)

    def oldest(self, limit: int) -> list[SpoolEntry]:
        return [entry for entry, _ in islice(self._held, limit)]

    def data(self) -> bytes:
        """The held entries as the log would hold them, in order."""
        return b"".join(chunk for _, chunk in self._held)

    def take(self) -> list[tuple[SpoolEntry, bytes]]:
        """Every held entry with its bytes, oldest first, no longer held (they were written)."""
        taken = list(self._held)
        self._held.clear()
        self.bytes = 0
        return taken

    def drop_through(self, seq: int) -> None:
        """The broker acknowledged every entry up to ``seq``: they are held no longer."""
        while self._held and self._held[0][0].seq <= seq:
            _, chunk = self._held.popleft()
            self.bytes -= len(chunk)
