"""``shm://<name>``: published weights in host shared memory, no disk and no serialisation step.

Each version is one POSIX shared-memory segment, a file in the tmpfs ``/dev/shm``
named ``online-sao.<name>.v00000012.seg``:

    magic "OSAOSHM1" | table length (u64, little endian) | layout table (JSON) | zero padding | tensor bytes

The table and the tensor bytes follow :mod:`online_sao.weights.layout`. The
notice's checksum is the SHA-256 of the whole segment. The learner writes a
segment under a temporary name and renames it, so a reader sees all of it or
none; space is reserved up front, so a full ``/dev/shm`` fails the save with
``OSError`` instead of crashing the writer. A failed save removes its temporary
segment; the writer holds an exclusive ``flock`` on it until the rename, so the next
:meth:`ShmWeightStore.prune` removes one whose writer was killed (the kernel drops
the lock with the process) and never one still being written. A segment lives until
:meth:`ShmWeightStore.delete` (``prune``) removes it: it outlasts the learner
process, like a file, and a restarted learner prunes what its predecessor left.
Serving maps a segment copy-on-write (``MAP_PRIVATE``: nothing is copied until
written, and writes never reach the segment), checks the checksum over the
mapping, then the layout and finiteness, and returns tensors viewing the mapping;
the engine copies them into its model and the mapping goes with the last of
them. A pruned segment stays readable through a mapping made before the prune.
The learner never writes a published segment again (a re-save renames a new
one over it), so the verified bytes are the ones the engine copies.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import re
import struct
import time
import uuid
from pathlib import Path

import torch

from online_sao.config.trainer import STORE_NAME_PATTERN, STORE_NAME_RULE
from online_sao.weights.store import CorruptWeights, WeightsRef, WeightStore, verify_state_dict
from online_sao.weights.layout import Layout, align, pack, unpack

DEFAULT_SHM_ROOT = Path("/dev/shm")
"""Where Linux keeps POSIX shared memory (a tmpfs; its size bounds ``keep_versions`` x model size)."""

SEGMENT_MAGIC = b"OSAOSHM1"
"""First bytes of every segment; anything else is refused."""

_PREFIX = struct.Struct("<8sQ")
"""Magic and the byte length of the layout table that follows it."""

UNLOCKED_TEMP_GRACE_S = 60.0
"""A save creates its temporary segment and then locks it: an unlocked one younger than this may be
between the two steps, so prune leaves it (the gap is microseconds; a minute is far beyond it)."""

_NAME = re.compile(STORE_NAME_PATTERN)
_LOCATION = re.compile(rf"^shm://({STORE_NAME_PATTERN})/v(\d{{8,}})$")


def segment_header(layout: Layout) -> bytes:
    """The bytes before the tensor data: magic, table length, table, zero padding to alignment."""
    table = layout.to_json()
    head = _PREFIX.pack(SEGMENT_MAGIC, len(table)) + table
    return head + bytes(align(len(head)) - len(head))


def parse_segment(segment: bytearray | mmap.mmap) -> dict[str, torch.Tensor]:
    """Tensors viewing ``segment`` (already checksummed); :class:`CorruptWeights` if malformed."""
    if len(segment) < _PREFIX.size:
        raise CorruptWeights(f"segment of {len(segment)} bytes is too short")
    magic, table_len = _PREFIX.unpack_from(segment)
    if magic != SEGMENT_MAGIC:
        raise CorruptWeights("not an online-sao shared-memory segment (bad magic)")
    if _PREFIX.size + table_len > len(segment):
        raise CorruptWeights(f"table of {table_len} bytes runs past the segment's end")
    data_start = align(_PREFIX.size + table_len)
    layout = Layout.from_json(segment[_PREFIX.size:_PREFIX.size + table_len],
                              data_bytes=max(len(segment) - data_start, 0))
    data = torch.frombuffer(segment, dtype=torch.uint8)[data_start:]
    return unpack(layout, data)


class ShmWeightStore(WeightStore):
    """Versions as shared-memory segments under ``root``; locations are ``shm://<name>/v00000012``."""

    def __init__(self, name: str, root: Path = DEFAULT_SHM_ROOT):
        if not _NAME.fullmatch(name):
            raise ValueError(f"shm store name {name!r}: {STORE_NAME_RULE}")
        if not Path(root).is_dir():
            raise FileNotFoundError(f"{root} does not exist: host shared memory needs Linux's /dev/shm")
        self.name = name
        self.root = Path(root)
        self.url = f"shm://{name}"

    def _path(self, name: str, version: int) -> Path:
        return self.root / f"online-sao.{name}.v{version:08d}.seg"

    def save(self, version: int, state: dict[str, torch.Tensor]) -> WeightsRef:
        verify_state_dict(state)
        layout = Layout.of(state)
        header = segment_header(layout)
        size = len(header) + layout.data_bytes
        final = self._path(self.name, version)
        tmp = self.root / f".{final.name}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held until closed or the process dies: prune leaves it alone
            os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS while writing through the mapping
            mapped = mmap.mmap(fd, size)
            checksum = _fill(mapped, header, state, layout)
            mapped.close()  # not on an error: the traceback may still hold tensors over it (GC unmaps)
            os.replace(tmp, final)  # a reader sees the whole segment or none of it
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return WeightsRef(version, f"{self.url}/v{version:08d}", checksum)

    def load(self, location: str, checksum: str) -> dict[str, torch.Tensor]:
        match = _LOCATION.match(location)
        if match is None:
            raise FileNotFoundError(f"{location}: not a shm://<name>/v<version> location")
        name, version = match.group(1), int(match.group(2))
        path = self._path(name, version)
        try:
            segment = _map(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{location}: version {version} is not in shared memory "
                                    f"(pruned, or never published on this host)") from None
        if hashlib.sha256(segment).hexdigest() != checksum:
            segment.close()
            raise CorruptWeights(f"{location}: checksum mismatch")
        state = parse_segment(segment)
        verify_state_dict(state)
        return state

    def versions(self) -> list[int]:
        pattern = re.compile(rf"^online-sao\.{re.escape(self.name)}\.v(\d{{8,}})\.seg$")
        return sorted(int(m.group(1)) for m in map(pattern.match, os.listdir(self.root)) if m)

    def delete(self, version: int) -> None:
        self._path(self.name, version).unlink(missing_ok=True)

    def prune(self, keep_last: int, protected: set[int] = frozenset()) -> list[int]:
        """Also removes this store's temporary segments whose writer died mid-save: nothing else
        ever would, and each holds a model's worth of RAM."""
        pattern = re.compile(rf"^\.online-sao\.{re.escape(self.name)}\.v\d{{8,}}\.seg\.[0-9a-f]{{32}}\.tmp$")
        now = time.time()
        for name in os.listdir(self.root):
            if pattern.match(name):
                _remove_if_abandoned(self.root / name, now)
        return super().prune(keep_last, protected)


def _remove_if_abandoned(tmp: Path, now: float) -> None:
    """Unlink the temporary segment ``tmp`` unless a live save holds its lock. Other processes may
    save under the same name (a learner still shutting down while its successor starts); a lock
    tells a dead writer from a live one where a pid cannot (pid namespaces, pid reuse)."""
    try:
        fd = os.open(tmp, os.O_RDONLY)
    except FileNotFoundError:  # its save renamed or removed it since the listing
        return
    try:
        if now - os.fstat(fd).st_mtime < UNLOCKED_TEMP_GRACE_S:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its writer is alive
            return
        tmp.unlink(missing_ok=True)  # missing: its save finished between our open and our lock
    finally:
        os.close(fd)


def _fill(mapped: mmap.mmap, header: bytes, state: dict[str, torch.Tensor], layout: Layout) -> str:
    """Write header and tensors into the mapping; returns the segment's SHA-256."""
    mapped[:len(header)] = header
    if layout.data_bytes:
        data = torch.frombuffer(mapped, dtype=torch.uint8, offset=len(header), count=layout.data_bytes)
        pack({k: v.detach().to("cpu") for k, v in state.items()}, layout, data)
        del data  # the mapping cannot close while a tensor still exports it
    return hashlib.sha256(mapped).hexdigest()


def _map(path: Path) -> mmap.mmap:
    """A private copy-on-write mapping of the whole segment."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise CorruptWeights(f"{path}: empty segment")
        return mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
