"""The spool's entry format: framing, decoding and finding intact entries among damaged bytes.

An entry is one line ``<length:8 hex> <crc32:8 hex> <payload>\\n`` where ``payload`` is
compact JSON ``{"seq", "topic", "key", "value"}`` (key and value base64). The length and
CRC tell a reader where an entry ends and whether it is intact. A payload never holds a
space or a newline (compact JSON of integers, base64 and topic names), so after damaged
bytes the next intact entry is found again by its header pattern: the first place where
a header, a payload of the length it names, a matching CRC and a newline line up.
"""

from __future__ import annotations

import base64
import json
import re
import zlib
from dataclasses import dataclass

HEADER_BYTES = 18  # "llllllll cccccccc "
_HEADER = re.compile(rb"[0-9a-f]{8} [0-9a-f]{8} ")


@dataclass(frozen=True)
class SpoolEntry:
    seq: int
    topic: str
    key: bytes | None
    value: bytes
    end_offset: int | None = None
    """Logical log offset just after this entry (stable across compactions and
    resets: see ``Spool._base``); None while it is held in memory only."""

    def encode(self) -> bytes:
        payload = json.dumps({"seq": self.seq, "topic": self.topic,
                              "key": None if self.key is None else base64.b64encode(self.key).decode("ascii"),
                              "value": base64.b64encode(self.value).decode("ascii")},
                             separators=(",", ":")).encode("ascii")
        return f"{len(payload):08x} {zlib.crc32(payload):08x} ".encode("ascii") + payload + b"\n"


def decode_payload(payload: bytes, end_offset: int) -> SpoolEntry:
    obj = json.loads(payload)
    key = obj["key"]
    return SpoolEntry(seq=int(obj["seq"]), topic=str(obj["topic"]),
                      key=None if key is None else base64.b64decode(key), value=base64.b64decode(obj["value"]),
                      end_offset=end_offset)


class Unreadable(ValueError):
    def __init__(self, reason: str, cut_short: bool = False):
        super().__init__(reason)
        self.cut_short = cut_short
        """The log ends inside the entry (what a write interrupted by a crash leaves)."""


def read_entry(data: bytes, offset: int) -> SpoolEntry:
    """The intact entry at ``offset`` of ``data`` (its end offset relative to ``data``), or Unreadable."""
    header = data[offset:offset + HEADER_BYTES]
    if len(header) < HEADER_BYTES:
        raise Unreadable("the log ends inside the entry's header", cut_short=True)
    if not _HEADER.fullmatch(header):
        raise Unreadable("no entry header (8 hex digits, space, 8 hex digits, space)")
    length, crc = int(header[0:8], 16), int(header[9:17], 16)
    end = offset + HEADER_BYTES + length
    if end >= len(data):
        raise Unreadable(f"the log ends inside the entry's {length} payload bytes", cut_short=True)
    if data[end:end + 1] != b"\n":
        raise Unreadable(f"no newline after the {length} payload bytes the header names")
    payload = data[offset + HEADER_BYTES:end]
    if zlib.crc32(payload) != crc:
        raise Unreadable(f"checksum mismatch (header {crc:08x}, payload {zlib.crc32(payload):08x})")
    try:
        return decode_payload(payload, end + 1)
    except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError and binascii.Error are ValueErrors
        raise Unreadable(f"payload not an entry: {exc}") from None


def next_intact(data: bytes, start: int) -> int | None:
    """Offset of the first intact entry at or after ``start``."""
    for match in _HEADER.finditer(data, start):
        try:
            read_entry(data, match.start())
        except Unreadable:
            continue
        return match.start()
    return None


@dataclass(frozen=True)
class Damage:
    start: int
    end: int
    reason: str
    cut_short: bool
    """An incomplete last entry (a write cut short), not damage to a written one."""


def _cut_short(data: bytes, offset: int, exc: Unreadable) -> bool:
    """Whether the log's unreadable last stretch, from ``offset``, is a write cut short: the read ran
    out of bytes, or only zero bytes follow where a write stopped (a power loss can leave the file
    extended by a block of zeros its data never reached)."""
    if exc.cut_short:
        return True
    trimmed = data.rstrip(b"\x00")
    if len(trimmed) == len(data):
        return False
    if len(trimmed) <= offset:
        return True  # nothing but zeros
    try:
        read_entry(trimmed, offset)
    except Unreadable as again:
        return again.cut_short
    return False


def scan_log(data: bytes) -> tuple[list[SpoolEntry], list[tuple[int, int]], list[Damage]]:
    """(intact entries, their byte spans, damaged stretches) of a log, in order."""
    entries: list[SpoolEntry] = []
    spans: list[tuple[int, int]] = []
    damages: list[Damage] = []
    offset = 0
    while offset < len(data):
        try:
            entry = read_entry(data, offset)
        except Unreadable as exc:
            resume = next_intact(data, offset + 1)
            end = len(data) if resume is None else resume
            damages.append(Damage(offset, end, str(exc), cut_short=resume is None and _cut_short(data, offset, exc)))
            offset = end
            continue
        entries.append(entry)
        spans.append((offset, entry.end_offset))
        offset = entry.end_offset
    return entries, spans, damages
