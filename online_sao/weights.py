"""Weight transport: where published policy versions live between learner and serving.

The learner saves a full state dict and announces ``(version, location,
checksum)`` on the weights topic; serving loads it off the request path and
verifies it before switching. Stores implement the seam, chosen by URL in
:func:`open_weight_store`: a directory or any fsspec URL of safetensors files
(the default), an in-process store for tests and single-process experiments
(``mem://``), and two transports that skip the disk when learner and serving
share a host: ``shm://<name>`` (host shared memory, :mod:`online_sao.weights_shm`)
and ``cuda-ipc://<name>`` (the learner's GPU memory mapped by serving,
:mod:`online_sao.weights_cuda_ipc`). No pickle anywhere: safetensors, or JSON
metadata plus raw buffers.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

import fsspec
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors


class CorruptWeights(ValueError):
    """Published weights that fail verification (checksum, format or finiteness)."""


@dataclass(frozen=True)
class WeightsRef:
    version: int
    location: str
    checksum: str


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def verify_state_dict(state: dict[str, torch.Tensor]) -> None:
    """Refuse empty state dicts and any non-finite floating-point tensor."""
    if not state:
        raise CorruptWeights("state dict is empty")
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CorruptWeights(f"tensor {name} has non-finite values")


def _serialise(state: dict[str, torch.Tensor]) -> bytes:
    # safetensors refuses shared storage and non-contiguous tensors: give it plain copies
    plain = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    return save_safetensors(plain)


class WeightStore(ABC):
    @abstractmethod
    def save(self, version: int, state: dict[str, torch.Tensor]) -> WeightsRef:
        """Verify, write atomically, return where it is and its checksum."""

    @abstractmethod
    def load(self, location: str, checksum: str) -> dict[str, torch.Tensor]:
        """Read and verify; raises CorruptWeights or FileNotFoundError."""

    @abstractmethod
    def versions(self) -> list[int]:
        """Stored versions, ascending."""

    @abstractmethod
    def delete(self, version: int) -> None: ...

    def prune(self, keep_last: int, protected: set[int] = frozenset()) -> list[int]:
        """Delete all but the newest ``keep_last`` versions and the protected ones."""
        stored = self.versions()
        doomed = [v for v in stored[:-keep_last] if v not in protected] if keep_last > 0 else []
        for v in doomed:
            self.delete(v)
        return doomed


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
        data = _serialise(state)
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


class InProcessWeightStore(WeightStore):
    """Keeps serialised versions in memory; locations are ``mem://<version>``."""

    def __init__(self) -> None:
        self._blobs: dict[int, bytes] = {}

    def save(self, version: int, state: dict[str, torch.Tensor]) -> WeightsRef:
        verify_state_dict(state)
        data = _serialise(state)
        self._blobs[version] = data
        return WeightsRef(version, f"mem://{version}", sha256_hex(data))

    def load(self, location: str, checksum: str) -> dict[str, torch.Tensor]:
        if not location.startswith("mem://"):
            raise FileNotFoundError(location)
        data = self._blobs.get(int(location[len("mem://"):]))
        if data is None:
            raise FileNotFoundError(location)
        if sha256_hex(data) != checksum:
            raise CorruptWeights(f"{location}: checksum mismatch")
        state = load_safetensors(data)
        verify_state_dict(state)
        return state

    def versions(self) -> list[int]:
        return sorted(self._blobs)

    def delete(self, version: int) -> None:
        self._blobs.pop(version, None)


def open_weight_store(url: str) -> WeightStore:
    """``mem://`` gives a fresh in-process store, ``shm://<name>`` the host shared-memory store,
    ``cuda-ipc://<name>`` the CUDA IPC store; anything else is a file/fsspec store."""
    if url.startswith("mem://"):
        return InProcessWeightStore()
    if url.startswith("shm://"):
        from online_sao.weights_shm import ShmWeightStore  # imports this module

        return ShmWeightStore(url[len("shm://"):])
    if url.startswith("cuda-ipc://"):
        from online_sao.weights_cuda_ipc import CudaIpcWeightStore  # imports this module

        return CudaIpcWeightStore(url[len("cuda-ipc://"):])
    return FileWeightStore(url)
