"""Recovering the spool's log at a start: its intact entries, damaged stretches taken out.

What recovery promises is described with the log's layout in :mod:`serving.spool`: a torn
tail is cut off; any other damaged stretch is replaced by a dead letter (unless the next intact
entry shows it was acknowledged already) and the log rewritten atomically; every damaged
stretch is copied aside to ``spool.corrupt-<time>-<offset>`` when the disk takes it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from online_sao.durable import fsync_dir, naming_the_file, private_opener
from online_sao.schemas import DeadLetter, encode
from serving.spool_format import Damage, SpoolEntry, scan_log
from streams.records import dead_letter

log = logging.getLogger(__name__)

SPOOL_SOURCE = "serving-spool"
"""``source_topic`` of the dead letter of a damaged spool entry (its own topic is unreadable)."""


@dataclass(frozen=True)
class Recovered:
    entries: list[SpoolEntry]
    """Every intact entry of the log (dead letters of damaged stretches included), in order."""
    size: int
    """The log's size after recovery."""
    dropped_corrupt_bytes: int = 0
    """Bytes of damaged entries taken out of the log."""
    dead_lettered_entries: int = 0
    """Damaged stretches replaced by a dead letter."""


def recover_log(log_path: Path, acked_seq: int, dead_letter_topic: str) -> Recovered:
    """The log at ``log_path`` after taking damaged entries out (``acked_seq``: the watermark)."""
    try:
        data = log_path.read_bytes()
    except FileNotFoundError:
        return Recovered([], 0)
    entries, spans, damages = scan_log(data)
    if not damages:
        return Recovered(entries, len(data))
    stamp = int(time.time() * 1000)
    for damage in damages:
        log.warning("spool %s: bytes %d-%d unreadable (%s)%s", log_path, damage.start, damage.end,
                    damage.reason, "; a write cut short, cut off" if damage.cut_short else "")
        _keep_aside(log_path.with_name(f"spool.corrupt-{stamp}-{damage.start}"), data[damage.start:damage.end])
    dropped = sum(d.end - d.start for d in damages)
    if all(d.cut_short for d in damages):  # only the tail: cut it, nothing was lost
        with open(log_path, "r+b") as fh:
            fh.truncate(damages[0].start)
            os.fsync(fh.fileno())
        return Recovered(entries, damages[0].start, dropped)
    letters = _dead_letters(log_path, data, entries, damages, acked_seq, dead_letter_topic)
    repaired = b"".join(data[start:end] for start, end in spans) + b"".join(letters)
    _replace_log(log_path, repaired)
    return Recovered(scan_log(repaired)[0], len(repaired), dropped, len(letters))


def _keep_aside(path: Path, damaged: bytes) -> None:
    """A copy of damaged bytes for whoever investigates, if the disk takes it. Best effort: a start
    on a full disk (a power loss during an outage that filled it) must still cut a torn tail, which
    frees space, and send what the log holds; a damaged stretch that may hold records goes to the
    dead letters with its bytes anyway (:func:`_dead_letters`). Readable by its owner alone, as the log
    it comes from (whole prompts and answers)."""
    try:
        with open(path, "wb", opener=private_opener) as fh:
            fh.write(damaged)
    except OSError as exc:
        log.warning("spool: could not keep the unreadable bytes aside in %s (%s); going on without the copy",
                    path, exc)
        path.unlink(missing_ok=True)


def _dead_letters(log_path: Path, data: bytes, entries: list[SpoolEntry], damages: list[Damage],
                  acked_seq: int, dead_letter_topic: str) -> list[bytes]:
    """An encoded entry for every damaged stretch that may hold unacknowledged entries, numbered
    after the last sequence number."""
    seq = max([acked_seq] + [e.seq for e in entries])
    letters: list[bytes] = []
    for damage in damages:
        following = next((e for e in entries if e.end_offset > damage.end), None)
        if damage.cut_short or (following is not None and following.seq <= acked_seq):
            continue  # never reported written, or acknowledged by the broker already
        seq += 1
        letter = _dead_letter(log_path, data, damage)
        letters.append(SpoolEntry(seq, dead_letter_topic, None, encode(letter)).encode())
    return letters


def _dead_letter(log_path: Path, data: bytes, damage: Damage) -> DeadLetter:
    return dead_letter(data[damage.start:damage.end],
                       f"spool entry unreadable at bytes {damage.start}-{damage.end} of {log_path}: "
                       f"{damage.reason}", SPOOL_SOURCE, offset=damage.start)


def _replace_log(log_path: Path, repaired: bytes) -> None:
    """Atomically: a crash leaves the old log. The new log is readable by its owner alone, as the old one."""
    tmp = log_path.with_name(log_path.name + ".repair")
    try:
        # a full disk: the error says which file
        with naming_the_file(tmp), open(tmp, "wb", opener=private_opener) as fh:
            fh.write(repaired)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:  # the old log stays whole; a partial copy must not hold the space
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, log_path)
    fsync_dir(log_path.parent)
