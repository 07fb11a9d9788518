"""Safetensors files on a local directory or any fsspec URL: the default weight store.

A version is written to ``v00000012.safetensors.<uuid>.tmp`` and renamed into place; on a local
directory the file is flushed to disk before the rename and the directory after it, so a power loss
leaves the whole version or none (unflushed, a renamed file could come back empty under its final
name, the registry and the weights topic naming it). A failed
write removes its temporary file at once (its OS error names that file); one left by a writer
killed before its rename is removed by a later :meth:`FileWeightStore.prune` once it is
:data:`STALE_TEMP_AGE_S` old.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

import fsspec
import torch
from safetensors.torch import load as load_safetensors

from online_sao.durable import fsync_dir, naming_the_file
from online_sao.weights.store import CorruptWeights, WeightsRef, WeightStore, serialise, sha256_hex, verify_state_dict

_VERSION_FILE = re.compile(r"v(\d{8,})\.safetensors$")
_TEMP_FILE = re.compile(r"(^|/)v\d{8,}\.safetensors\.[0-9a-f]{32}\.tmp$")

STALE_TEMP_AGE_S = 3600.0
"""A temporary file untouched this long is a dead writer's: prune removes it. Another process
(a learner still shutting down while its successor starts, another host on a shared URL) may be
saving into the same root, and an fsspec backend offers no lock and no way to see whether the
writer lives, so age decides: a save writes and renames within seconds to minutes, an hour
leaves a wide margin for slow remote writes and modest clock skew between hosts."""


class FileWeightStore(WeightStore):
    """Safetensors files ``v00000012.safetensors`` under a directory or fsspec URL."""

    def __init__(self, url: str):
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.url = url
        self.local = self.fs.protocol in ("file", ("file", "local"))
        """A directory of this host's: its writes are flushed to disk (fsspec's remote stores offer no fsync)."""
        self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, version: int) -> str:
        return f"{self.root.rstrip('/')}/v{version:08d}.safetensors"

    def save(self, version: int, state: dict[str, torch.Tensor]) -> WeightsRef:
        verify_state_dict(state)
        data = serialise(state)
        final = self._path(version)
        tmp = f"{final}.{uuid.uuid4().hex}.tmp"
        try:
            with naming_the_file(tmp):
                with self.fs.open(tmp, "wb") as fh:
                    fh.write(data)
                    if self.local:  # on disk before the rename names it
                        fh.flush()
                        os.fsync(fh.fileno())
            self.fs.mv(tmp, final)  # a reader sees the whole file or none of it
            if self.local:
                with naming_the_file(self.root):
                    fsync_dir(Path(self.root))  # the rename itself survives a power loss
        except BaseException:  # disk full, interrupted: a partial file must not hold the space
            self._discard(tmp)
            raise
        location = final if self.local else self.fs.unstrip_protocol(final)
        return WeightsRef(version, location, sha256_hex(data))

    def load(self, location: str, checksum: str) -> dict[str, torch.Tensor]:
        fs, path = fsspec.core.url_to_fs(location)
        with fs.open(path, "rb") as fh:
            data = fh.read()
        if sha256_hex(data) != checksum:
            raise CorruptWeights(f"{location}: checksum mismatch")
        try:
            state = load_safetensors(data)
        except Exception as exc:  # safetensors raises its own error types for bad headers
            raise CorruptWeights(f"{location}: not a safetensors file: {exc}") from None
        verify_state_dict(state)
        return state

    def versions(self) -> list[int]:
        found = []
        for path in self.fs.ls(self.root, detail=False):
            m = _VERSION_FILE.search(path)
            if m:
                found.append(int(m.group(1)))
        return sorted(found)

    def delete(self, version: int) -> None:
        self._discard(self._path(version))  # another process pruning the same root may have been first

    def prune(self, keep_last: int, protected: set[int] = frozenset()) -> list[int]:
        """Also removes stale temporary files: a writer killed between writing and renaming
        leaves one that no save, delete or listing of versions would ever see."""
        now = time.time()
        for path in self.fs.ls(self.root, detail=False):
            if _TEMP_FILE.search(path) and self._stale(path, now):
                self._discard(path)
        return super().prune(keep_last, protected)

    def _stale(self, path: str, now: float) -> bool:
        """Whether the temporary file ``path`` went unwritten for :data:`STALE_TEMP_AGE_S`. Not
        when it is gone already (its save renamed it since the listing) nor when the backend
        cannot tell its age: that may be a save in progress."""
        try:
            modified = self.fs.modified(path).timestamp()
        except (FileNotFoundError, NotImplementedError):
            return False
        return now - modified >= STALE_TEMP_AGE_S

    def _discard(self, path: str) -> None:
        """Remove ``path`` if it is there (a remote write that failed may have created nothing,
        another pruner may have been first)."""
        try:
            self.fs.rm(path)
        except FileNotFoundError:
            pass
