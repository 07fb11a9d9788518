"""An in-process weight store (``mem://``) for tests and single-process experiments."""

from __future__ import annotations

import torch
from safetensors.torch import load as load_safetensors

from online_sao.weights.store import CorruptWeights, WeightsRef, WeightStore, serialise, sha256_hex, verify_state_dict


class InProcessWeightStore(WeightStore):
    """Keeps serialised versions in memory; locations are ``mem://<version>``."""

    def __init__(self) -> None:
        self._blobs: dict[int, bytes] = {}

    def save(self, version: int, state: dict[str, torch.Tensor]) -> WeightsRef:
        verify_state_dict(state)
        data = serialise(state)
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
