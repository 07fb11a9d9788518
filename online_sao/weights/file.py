"""Safetensors files on a local directory or any fsspec URL: the default weight store."""

from __future__ import annotations

import re
import uuid

import fsspec
import torch
from safetensors.torch import load as load_safetensors

from online_sao.weights.store import CorruptWeights, WeightsRef, WeightStore, serialise, sha256_hex, verify_state_dict

_VERSION_FILE = re.compile(r"v(\d{8,})\.safetensors$")


class FileWeightStore(WeightStore):
    """Safetensors files ``v00000012.safetensors`` under a directory or fsspec URL."""

    def __init__(self, url: str):
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.url = url
        self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, version: int) -> str:
        return f"{self.root.rstrip('/')}/v{version:08d}.safetensors"

    def save(self, version: int, state: dict[str, torch.Tensor]) -> WeightsRef:
        verify_state_dict(state)
        data = serialise(state)
        final = self._path(version)
        tmp = f"{final}.{uuid.uuid4().hex}.tmp"
        with self.fs.open(tmp, "wb") as fh:
            fh.write(data)
        self.fs.mv(tmp, final)  # a reader sees the whole file or none of it
        location = final if self.fs.protocol in ("file", ("file", "local")) else self.fs.unstrip_protocol(final)
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
        self.fs.rm(self._path(version))
