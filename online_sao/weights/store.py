"""The weight-store seam: what a published policy version is and what every transport does.

The learner saves a full state dict and announces ``(version, location, checksum)`` on the
weights topic; serving loads it off the request path and verifies it before switching.
Backends: :mod:`.file` (safetensors files on a directory or any fsspec URL, the default),
:mod:`.memory` (in-process, tests and single-process runs), :mod:`.shm` (host shared memory)
and :mod:`.cuda_ipc` (the learner's GPU memory mapped by serving). No pickle anywhere:
safetensors, or JSON metadata plus raw buffers.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
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


def serialise(state: dict[str, torch.Tensor]) -> bytes:
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
