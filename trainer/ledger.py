"""The ledger of interaction ids trained on: segment files ``<checkpoint_dir>/ledger/<step>.jsonl``.

Each line is one step: ``{"step": 42, "ids": [...]}`` (``"refused": true`` when the step's update
was refused as non-finite). A segment is named by the first step it holds (zero-padded, eight
digits or more). The checkpointer appends to the newest segment and starts a new one, named by the
step of its first line, once the newest holds ``trainer.ledger_segment_bytes`` or more. A
checkpoint records the segment it appended to and that segment's length
(:class:`~trainer.checkpoint.LearnerState`); a resume truncates that segment to the length and
deletes the segments after it. Segments before it are *sealed*: the learner never reads, checks
or changes them again, so an operator may archive or delete them (:meth:`Ledger.sealed`,
``online-sao ledger sealed``).

The layout before segments was one file, ``<checkpoint_dir>/ledger.jsonl``, whose length the
checkpoints recorded: :meth:`Ledger.migrate` makes it the first segment (:data:`LEGACY_SEGMENT`),
the one those checkpoints name.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from online_sao.durable import fsync_dir, private_opener

LEDGER_DIR = "ledger"
"""Directory of the segments, in the checkpoint directory."""
LEDGER_FILE = "ledger.jsonl"
"""The single ledger file of the layout before segments (migrated on the learner's start)."""
LEGACY_SEGMENT = "00000000.jsonl"
"""The segment the single ledger file becomes; checkpoints written before segments name it."""
SEGMENT_NAME = re.compile(r"^(\d{8,})\.jsonl$")
SCRATCH_PREFIX = ".tmp-"


def segment_name(first_step: int) -> str:
    return f"{first_step:08d}.jsonl"


def _first_step(name: str) -> int:
    return int(SEGMENT_NAME.match(name).group(1))


def segments(directory: Path) -> list[Path]:
    """The segment files in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if SEGMENT_NAME.match(p.name) and p.is_file()]
    return sorted(found, key=lambda p: _first_step(p.name))


class Ledger:
    """The segments of one checkpoint directory (``root``)."""

    def __init__(self, root: Path, segment_bytes: int) -> None:
        if segment_bytes < 1:
            raise ValueError("a ledger segment needs at least one byte")
        self.root = Path(root)
        self.directory = self.root / LEDGER_DIR
        self.segment_bytes = segment_bytes

    def segments(self) -> list[Path]:
        return segments(self.directory)

    def plan(self, appended: int, first_step: int) -> tuple[str | None, int]:
        """Where ``appended`` bytes of lines, the first of step ``first_step``, go: (segment name,
        its length with them). The newest segment, or a new one named ``first_step`` when there is
        none or the newest holds ``segment_bytes`` already. Reads the newest segment's size only."""
        found = self.segments()
        current = found[-1] if found else None
        size = current.stat().st_size if current is not None else 0
        if appended == 0:
            return (current.name if current is not None else None), size
        fresh = segment_name(first_step)
        if current is None or (size >= self.segment_bytes and _first_step(fresh) > _first_step(current.name)):
            return fresh, appended
        return current.name, size + appended

    def append(self, segment: str, lines: bytes) -> None:
        """Append ``lines`` to ``segment`` (created if new) and make them durable."""
        if not lines:
            return
        if not self.directory.exists():
            self.directory.mkdir()
            fsync_dir(self.root)
        path = self.directory / segment
        created = not path.exists()
        with open(path, "ab", opener=private_opener) as fh:
            fh.write(lines)
            fh.flush()
            os.fsync(fh.fileno())
        if created:
            fsync_dir(self.directory)

    def cut_back(self, segment: str | None, covered: int) -> None:
        """Make the ledger what a checkpoint recorded: ``segment`` (None: none) truncated to
        ``covered`` bytes, the segments after it deleted. Sealed segments are not looked at."""
        keep_until = -1 if segment is None else _first_step(segment)
        newer = [p for p in self.segments() if _first_step(p.name) > keep_until]
        for path in newer:
            path.unlink()
        if newer:
            fsync_dir(self.directory)
        if segment is None:
            return
        path = self.directory / segment
        size = path.stat().st_size if path.exists() else 0
        if size < covered:
            raise RuntimeError(f"ledger segment {path} holds {size} bytes but the checkpoint covers {covered}: "
                               "the current segment was truncated, replaced or removed outside the learner "
                               "(only the sealed ones, `online-sao ledger sealed`, may be)")
        if size > covered:
            with open(path, "rb+") as fh:
                fh.truncate(covered)
                os.fsync(fh.fileno())

    def sealed(self, current: str | None) -> list[Path]:
        """The segments before ``current`` (the newest checkpoint's): the learner never touches them again."""
        if current is None:
            return []
        return [p for p in self.segments() if _first_step(p.name) < _first_step(current)]

    def migrate(self) -> None:
        """Make the single ledger file of the layout before segments the first segment, once and
        atomically: it is linked (or copied) into a scratch directory that is renamed to
        ``ledger/``, then the old name is removed. A kill at any point leaves either the old
        layout (the scratch directory is removed with the checkpoints' leftovers) or the new one
        with the old name still there, which the next start removes."""
        legacy = self.root / LEDGER_FILE
        if not legacy.exists():
            return
        if not self.directory.exists():
            scratch = self.root / f"{SCRATCH_PREFIX}{uuid.uuid4().hex}"
            scratch.mkdir()
            try:
                os.link(legacy, scratch / LEGACY_SEGMENT)
            except OSError:  # a file system without hard links: a copy, fsynced
                shutil.copyfile(legacy, scratch / LEGACY_SEGMENT)
                with open(scratch / LEGACY_SEGMENT, "rb+") as fh:
                    os.fsync(fh.fileno())
            fsync_dir(scratch)
            os.rename(scratch, self.directory)
            fsync_dir(self.root)
        migrated = self.directory / LEGACY_SEGMENT
        if not (migrated.exists() and filecmp.cmp(legacy, migrated, shallow=False)):
            raise RuntimeError(f"{legacy} (the ledger's layout before segments) and {self.directory} both exist "
                               f"and {legacy} is not {migrated}: move one of them away")
        legacy.unlink()
        fsync_dir(self.root)


def ledger_files(path: Path) -> list[Path]:
    """The files of the ledger at ``path``, oldest first. ``path`` is a checkpoint directory, its
    ``ledger/`` directory, one segment file, or ``<checkpoint_dir>/ledger.jsonl`` (the name of the
    layout before segments: the ledger of that checkpoint directory, migrated or not). The old name
    left beside the first segment by a migration that was stopped before removing it
    (:meth:`Ledger.migrate`) is not one of them: it holds that segment's lines."""
    path = Path(path)
    if path.name == LEDGER_FILE:
        path = path.parent
    elif path.is_file():
        return [path]
    if (path / LEDGER_DIR).is_dir() or (path / LEDGER_FILE).is_file():
        legacy = path / LEDGER_FILE
        unmigrated = legacy.is_file() and _left_by_migration(path) is None
        return ([legacy] if unmigrated else []) + segments(path / LEDGER_DIR)
    return segments(path)


def _left_by_migration(root: Path) -> Path | None:
    """``root``'s ``ledger.jsonl`` where a stopped migration left it: the first segment holds the same
    bytes (a link to it, or its copy), which the learner's next start removes (:meth:`Ledger.migrate`)."""
    if not root.is_dir():
        return None
    legacy, migrated = root / LEDGER_FILE, root / LEDGER_DIR / LEGACY_SEGMENT
    if legacy.is_file() and migrated.is_file() and (
            legacy.samefile(migrated) or filecmp.cmp(legacy, migrated, shallow=False)):
        return legacy
    return None


def _whole_lines(data: bytes, sealed: bool) -> tuple[list[bytes], bytes]:
    """``data``'s newline-terminated lines, and what follows the last of them: the torn line of an
    append the learner was making when it stopped (a full disk, a kill), b"" when there is none. No
    checkpoint covers a torn line (a checkpoint records the length after its whole lines), so the
    learner's next start cuts it (:meth:`Ledger.cut_back`). In a ``sealed`` segment (not the newest
    file) no append was under way: a whole entry without its newline there (edited by hand) is a line."""
    end = data.rfind(b"\n") + 1
    lines, tail = data[:end].splitlines(keepends=True), data[end:]
    if sealed and tail and _is_entry(tail):
        return lines + [tail], b""
    return lines, tail


def _with_sealed(files: list[Path]) -> list[tuple[Path, bool]]:
    """Each of the ledger's ``files`` and whether it is sealed: every one but the newest."""
    return [(file, index < len(files) - 1) for index, file in enumerate(files)]


def _is_entry(line: bytes) -> bool:
    """Whether ``line`` is a whole ledger entry (a JSON object with its ids)."""
    try:
        entry = json.loads(line)
    except ValueError:
        return False
    return isinstance(entry, dict) and "ids" in entry


def torn_files(path: Path) -> list[Path]:
    """The files of the ledger at ``path`` (:func:`ledger_files`) that end in a torn line (:func:`_whole_lines`)."""
    return [file for file, sealed in _with_sealed(ledger_files(path)) if _whole_lines(file.read_bytes(), sealed)[1]]


def read_ledger(path: Path, refused: bool | None = None, turns: bool = False) -> list[tuple[int, str]]:
    """(step, interaction id) of every line of the ledger at ``path`` (:func:`ledger_files`), in
    order: every id a step took (``refused=None``), only those of refused steps (True) or only those
    actually trained on (False). A line's ``ids`` are its rollouts; with ``turns``, also the ids of
    earlier turns that trained inside them (its ``"turns"``: an unrated first turn its continuation
    absorbed), after them. Archived or deleted sealed segments are not there to read, and a torn last
    line (:func:`_whole_lines`) is not read: no checkpoint covers it."""
    out = []
    for file, sealed in _with_sealed(ledger_files(path)):
        for line in _whole_lines(file.read_bytes(), sealed)[0]:
            entry = json.loads(line)
            if refused is None or entry.get("refused", False) == refused:
                out.extend((entry["step"], iid) for iid in entry["ids"] + (entry.get("turns", []) if turns else []))
    return out


REDACTED_CHAR = "-"
"""What a redacted id's characters become: a segment keeps its length (a checkpoint records the current one's)."""


def redact_ledger(path: Path, interaction_ids: set[str]) -> int:
    """Overwrite every occurrence of ``interaction_ids`` in every file of the ledger at ``path``
    (:func:`ledger_files`) with :data:`REDACTED_CHAR` of the same encoded length, so each segment
    keeps its length (the newest checkpoint records the current one's); returns the number of ids
    redacted. Each segment is written to a new file and renamed over the old one: run it with the
    learner stopped (a step appended meanwhile would be lost, and the learner would then refuse to
    start). A torn last line (:func:`_whole_lines`, :func:`torn_files`) is left as it is: it is
    not JSON to read ids from, and the learner's next start cuts it. The old name a stopped
    migration left beside the first segment is redacted too, not counted: it stays that segment's
    copy, which the learner's next start removes (redacted alone, the learner would refuse to
    start, the two differing)."""
    wanted = {json.dumps(iid) for iid in interaction_ids}
    files = ledger_files(path)  # before the old name is rewritten: it is then no longer the segment's link
    left = _left_by_migration(_checkpoint_root(Path(path)))
    if left is not None:
        _redact_file(left, wanted, sealed=False)
    return sum(_redact_file(file, wanted, sealed) for file, sealed in _with_sealed(files))


def _checkpoint_root(path: Path) -> Path:
    """The checkpoint directory of any path :func:`ledger_files` takes: itself, its ``ledger/``,
    ``ledger.jsonl`` or a segment file in ``ledger/``."""
    if path.is_file() and path.parent.name == LEDGER_DIR:
        return path.parent.parent
    return path.parent if path.name in (LEDGER_FILE, LEDGER_DIR) else path


def _redact_file(path: Path, wanted: set[str], sealed: bool) -> int:
    redacted, lines = 0, []
    whole, torn = _whole_lines(path.read_bytes(), sealed)
    for line in whole:
        entry: dict[str, Any] = json.loads(line)
        hits = []
        for key in ("ids", "turns"):  # the rollouts, and the earlier turns that trained inside them
            encoded = [json.dumps(iid) for iid in entry.get(key, [])]
            hits += [e for e in encoded if e in wanted]
            if key in entry:
                entry[key] = [json.loads(e) if e not in wanted else REDACTED_CHAR * (len(e) - 2) for e in encoded]
        if hits:
            newline = b"\n" if line.endswith(b"\n") else b""  # a sealed segment's last line may lack it
            new = json.dumps(entry, separators=(",", ":")).encode() + newline
            if len(new) != len(line):
                raise ValueError(f"redacting {hits} would change a line's length in {path}; nothing was written "
                                 "to it (segments before it in step order were redacted)")
            line, redacted = new, redacted + len(hits)
        lines.append(line)
    if redacted:
        scratch = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        with open(scratch, "wb", opener=private_opener) as fh:
            fh.writelines(lines + [torn])
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(scratch, path)
        fsync_dir(path.parent)
    return redacted
