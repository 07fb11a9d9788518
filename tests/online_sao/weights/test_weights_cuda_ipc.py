"""The cuda-ipc:// store. On CPU: its record encoding and its save/load/prune logic with a fake
IPC layer (CPU buffers stand in for exported GPU memory). With a GPU (``-m gpu``): the real
thing in one process; two processes: test_weights_transport.py."""

from __future__ import annotations

import json
import os
import uuid
import weakref
from pathlib import Path

import pytest
import torch

from online_sao.weights import CorruptWeights
from online_sao.weights.cuda_ipc import (
    CudaIpcWeightStore,
    IpcRecord,
    IpcShare,
    device_index_of,
)
from online_sao.weights.shm import DEFAULT_SHM_ROOT

HANDLE = bytes(range(64))
"""A made-up cudaIpcMemHandle_t: 64 bytes with NULs in them, like real ones."""


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 4, generator=g).bfloat16(), "b": torch.randn(16, generator=g), "n": torch.tensor(seed)}


class FakeIpc:
    """Exports by reference: ``open`` gives the exporter's buffer itself, as long as the exporter
    keeps it (a weak reference, so the store's lifetime rule shows)."""

    def __init__(self) -> None:
        self.exported: dict[bytes, weakref.ref] = {}
        self.released: list[IpcShare] = []

    def device_uuid(self, device: torch.device) -> str:
        return "GPU-fake"

    def share(self, buffer: torch.Tensor) -> IpcShare:
        handle = uuid.uuid4().bytes * 4
        self.exported[handle] = weakref.ref(buffer)
        return IpcShare.from_torch((0, handle, buffer.numel(), 0, b"/torch_1_2", 3, HANDLE, True))

    def open(self, share: IpcShare, device_uuid: str) -> torch.Tensor:
        buffer = self.exported[share.torch_args(0)[1]]()
        if buffer is None:
            raise FileNotFoundError("fake: exporter freed the buffer")
        return buffer

    def release(self, share: IpcShare) -> None:
        self.released.append(share)


@pytest.fixture
def ipc():
    return FakeIpc()


@pytest.fixture
def stores(ipc):
    """(learner's store, serving's store): two store objects, as in two processes."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    learner = CudaIpcWeightStore(name, device="cpu", ops=ipc)
    yield learner, CudaIpcWeightStore(name, device="cpu", ops=ipc)
    for version in learner.versions():
        learner.delete(version)


def _record_path(store: CudaIpcWeightStore, version: int) -> Path:
    return DEFAULT_SHM_ROOT / f"online-sao.{store.name}.v{version:08d}.cuda-ipc.json"


def test_share_tuple_survives_json_with_base64_handles():
    shared = (1, HANDLE, 4096, 512, b"/torch_42_7", 9, bytes(64), False)
    share = IpcShare.from_torch(shared)
    text = share.model_dump_json()
    assert "torch_42" not in text  # bytes only as base64
    back = IpcShare.model_validate_json(text)
    assert back.torch_args(device_index=3) == (3, *shared[1:])
    with pytest.raises(CorruptWeights, match="base64"):
        IpcShare.model_validate_json(text.replace(share.handle, "not*base64")).torch_args(0)


def test_the_gpu_is_found_by_uuid_not_by_index():
    assert device_index_of("GPU-b", ["GPU-a", "GPU-b"]) == 1
    with pytest.raises(OSError, match="not visible"):
        device_index_of("GPU-c", ["GPU-a", "GPU-b"])


def test_a_version_round_trips_through_the_exported_buffer(stores, ipc):
    learner, serving = stores
    state = _state(1)
    ref = learner.save(1, state)
    assert ref.location == f"cuda-ipc://{learner.name}/v00000001"
    record = IpcRecord.model_validate_json(_record_path(learner, 1).read_bytes())
    assert record.pid == os.getpid() and record.device_uuid == "GPU-fake"
    assert [t.name for t in record.layout.tensors] == list(state)
    for store in (serving, learner):  # another process maps; the learner itself reads what it holds
        loaded = store.load(ref.location, ref.checksum)
        for name, tensor in state.items():
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


def test_the_learner_holds_each_buffer_until_it_is_pruned(stores, ipc):
    learner, serving = stores
    refs = {v: learner.save(v, _state(v)) for v in (1, 2, 3)}
    alive = {v: ipc.exported[_handle(learner, v)] for v in refs}
    assert all(ref() is not None for ref in alive.values())  # nobody but the store keeps them
    assert learner.prune(keep_last=1, protected={1}) == [2]
    assert alive[2]() is None and alive[1]() is not None and alive[3]() is not None
    assert [s.ref_counter_offset for s in ipc.released] == [3]  # the export's own count given up once
    with pytest.raises(FileNotFoundError, match=r"no such version .* \(pruned"):
        serving.load(refs[2].location, refs[2].checksum)
    serving.load(refs[1].location, refs[1].checksum)


def _handle(store: CudaIpcWeightStore, version: int) -> bytes:
    record = IpcRecord.model_validate_json(_record_path(store, version).read_bytes())
    return record.share.torch_args(0)[1]


def test_a_record_whose_publisher_is_gone_fails_to_load_clearly(stores, ipc):
    learner, serving = stores
    ref = learner.save(1, _state())
    learner._held.clear()  # what the learner process dying does to its buffers
    with pytest.raises(FileNotFoundError, match=f"publisher pid {os.getpid()}"):
        serving.load(ref.location, ref.checksum)
    assert learner.versions() == [1]  # the stale record is still listed, so the next learner prunes it


def test_corrupt_data_or_record_is_refused(stores, ipc):
    learner, serving = stores
    ref = learner.save(1, _state())
    buffer = ipc.open(IpcRecord.model_validate_json(_record_path(learner, 1).read_bytes()).share, "GPU-fake")
    buffer[0] ^= 0x01
    with pytest.raises(CorruptWeights, match="checksum"):
        serving.load(ref.location, ref.checksum)
    buffer[0] ^= 0x01
    serving.load(ref.location, ref.checksum)

    path = _record_path(learner, 1)
    record = json.loads(path.read_text())
    record["layout"]["tensors"][1]["shape"] = [4, 4]  # same bytes, another shape
    path.write_text(json.dumps(record))
    with pytest.raises(CorruptWeights, match="checksum"):
        serving.load(ref.location, ref.checksum)
    path.write_text("{not json")
    with pytest.raises(CorruptWeights, match="bad CUDA IPC record"):
        serving.load(ref.location, ref.checksum)


def test_a_cuda_error_while_copying_is_an_os_error_the_follower_reports(stores, ipc, monkeypatch):
    learner, serving = stores
    ref = learner.save(1, _state())

    def out_of_memory(share, device_uuid):
        raise RuntimeError("CUDA out of memory (fake)")

    monkeypatch.setattr(ipc, "open", out_of_memory)
    with pytest.raises(OSError, match="out of memory"):
        serving.load(ref.location, ref.checksum)


def test_without_cuda_saving_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    store = CudaIpcWeightStore(f"test-{uuid.uuid4().hex[:12]}")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        store.save(1, _state())
    assert store.versions() == []
    with pytest.raises(ValueError):
        CudaIpcWeightStore("a/b")


@pytest.mark.gpu
def test_real_cuda_export_round_trips_in_the_publishing_process():
    store = CudaIpcWeightStore(f"test-{uuid.uuid4().hex[:12]}")
    try:
        state = _state(3)
        ref = store.save(1, state)
        loaded = store.load(ref.location, ref.checksum)
        assert all(t.is_cuda for t in loaded.values())
        for name, tensor in state.items():
            torch.testing.assert_close(loaded[name].cpu(), tensor, rtol=0, atol=0)
        store.delete(1)
        with pytest.raises(FileNotFoundError):
            store.load(ref.location, ref.checksum)
    finally:
        for version in store.versions():
            store.delete(version)
