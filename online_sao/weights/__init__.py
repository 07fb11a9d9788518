"""Weight transport between learner and serving: the store protocol and its backends.

Chosen by URL in :func:`open_weight_store`. See :mod:`online_sao.weights.store` for the seam.
"""

from __future__ import annotations

from online_sao.weights.cuda_ipc import CudaIpcWeightStore
from online_sao.weights.file import FileWeightStore
from online_sao.weights.memory import InProcessWeightStore
from online_sao.weights.shm import ShmWeightStore
from online_sao.weights.store import CorruptWeights, WeightsRef, WeightStore, sha256_hex, verify_state_dict

__all__ = [
    "CorruptWeights", "CudaIpcWeightStore", "FileWeightStore", "InProcessWeightStore", "ShmWeightStore",
    "WeightStore", "WeightsRef", "open_weight_store", "sha256_hex", "verify_state_dict",
]


def open_weight_store(url: str) -> WeightStore:
    """``mem://`` gives a fresh in-process store, ``shm://<name>`` the host shared-memory store,
    ``cuda-ipc://<name>`` the CUDA IPC store; anything else is a file/fsspec store."""
    if url.startswith("mem://"):
        return InProcessWeightStore()
    if url.startswith("shm://"):
        return ShmWeightStore(url[len("shm://"):])
    if url.startswith("cuda-ipc://"):
        return CudaIpcWeightStore(url[len("cuda-ipc://"):])
    return FileWeightStore(url)
