import errno
import os
import time
import uuid

import pytest
import torch

from online_sao.weights import CorruptWeights, FileWeightStore, InProcessWeightStore, open_weight_store
from online_sao.weights.file import STALE_TEMP_AGE_S
from online_sao.weights.shm import ShmWeightStore


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(4, 3, generator=g), "layer.bias": torch.randn(4, generator=g)}


@pytest.fixture(params=["file", "memory", "shm"])
def store(request, tmp_path):
    """Every store kept by a process honours the same contract (cuda-ipc: test_weights_cuda_ipc.py)."""
    if request.param == "file":
        yield FileWeightStore(str(tmp_path / "weights"))
    elif request.param == "memory":
        yield InProcessWeightStore()
    else:
        shm = ShmWeightStore(f"test-{uuid.uuid4().hex[:12]}")
        yield shm
        for version in shm.versions():
            shm.delete(version)


def test_round_trip_and_checksum(store):
    state = _state()
    ref = store.save(3, state)
    assert ref.version == 3 and len(ref.checksum) == 64
    loaded = store.load(ref.location, ref.checksum)
    assert loaded.keys() == state.keys()
    for k in state:
        torch.testing.assert_close(loaded[k], state[k], rtol=0, atol=0)


def test_wrong_checksum_is_refused(store):
    ref = store.save(1, _state())
    with pytest.raises(CorruptWeights, match="checksum"):
        store.load(ref.location, "0" * 64)


@pytest.mark.parametrize("values", [[float("nan")], [float("inf")], [float("-inf")], [float("inf"), float("-inf")]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_weights_are_never_saved(store, values, dtype):
    bad = {k: v.to(dtype) for k, v in _state().items()}
    bad["layer.bias"][:len(values)] = torch.tensor(values, dtype=dtype)
    with pytest.raises(CorruptWeights, match="layer.bias"):
        store.save(1, bad)
    assert store.versions() == []


def test_large_finite_weights_and_integer_tensors_are_saved(store):
    state = _state()
    state["layer.weight"].fill_(torch.finfo(torch.float32).max)  # 12 of them: their sum overflows float32
    state["huge"] = torch.full((3,), 1e308, dtype=torch.float64)  # finite, but its float64 sum is not
    state["step"] = torch.tensor([7], dtype=torch.int64)
    ref = store.save(1, state)
    loaded = store.load(ref.location, ref.checksum)
    assert loaded["layer.weight"].max() == torch.finfo(torch.float32).max and loaded["huge"][0] == 1e308


def test_missing_location_raises_file_not_found(store):
    ref = store.save(1, _state())
    store.delete(1)
    with pytest.raises(FileNotFoundError):
        store.load(ref.location, ref.checksum)


def test_a_version_another_pruner_deleted_first_deletes_without_error(store):
    # two learners on one store (one shutting down as its successor starts) may both prune it
    store.save(1, _state())
    store.delete(1)
    store.delete(1)
    assert store.versions() == []


def test_prune_keeps_newest_and_protected(store):
    for v in range(1, 7):
        store.save(v, _state(v))
    deleted = store.prune(keep_last=2, protected={2})
    assert deleted == [1, 3, 4]
    assert store.versions() == [2, 5, 6]


def test_corrupted_file_bytes_are_detected(tmp_path):
    store = FileWeightStore(str(tmp_path))
    ref = store.save(5, _state())
    data = bytearray(open(ref.location, "rb").read())
    data[-1] ^= 0xFF
    open(ref.location, "wb").write(bytes(data))
    with pytest.raises(CorruptWeights):
        store.load(ref.location, ref.checksum)
    # a garbage file whose checksum matches is still refused as not safetensors
    from online_sao.weights import sha256_hex

    open(ref.location, "wb").write(b"garbage")
    with pytest.raises(CorruptWeights, match="not a safetensors"):
        store.load(ref.location, sha256_hex(b"garbage"))


def test_no_temporary_files_left(tmp_path):
    store = open_weight_store(str(tmp_path))
    store.save(1, _state())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000001.safetensors"]


def test_a_failed_write_removes_its_temporary_file(tmp_path, monkeypatch):
    store = FileWeightStore(str(tmp_path))
    real_open = store.fs.open

    def open_on_a_full_disk(path, mode="rb", **kwargs):
        handle = real_open(path, mode, **kwargs)
        real_write = handle.write

        def write(data):
            real_write(data[:len(data) // 2])  # part of it lands on disk
            raise OSError(errno.ENOSPC, "No space left on device")

        handle.write = write
        return handle

    monkeypatch.setattr(store.fs, "open", open_on_a_full_disk)
    with pytest.raises(OSError, match="No space left"):
        store.save(1, _state())
    assert list(tmp_path.iterdir()) == []


def test_prune_removes_a_dead_writers_temporary_file_once_it_is_stale(tmp_path):
    """A writer killed between writing and renaming leaves its temporary file; one as recent as a save
    in progress in another process stays, and so do files that are not the store's."""
    store = FileWeightStore(str(tmp_path))
    for version in (1, 2):
        store.save(version, _state(version))
    stale, recent, foreign = (tmp_path / f"v00000003.safetensors.{uuid.uuid4().hex}.tmp",
                              tmp_path / f"v00000004.safetensors.{uuid.uuid4().hex}.tmp", tmp_path / "notes.tmp")
    for path in (stale, recent, foreign):
        path.write_bytes(b"partial")
    long_ago = time.time() - STALE_TEMP_AGE_S - 60
    os.utime(stale, (long_ago, long_ago))
    os.utime(foreign, (long_ago, long_ago))
    assert store.prune(keep_last=1) == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([recent.name, foreign.name, "v00000002.safetensors"])


def test_a_local_save_reaches_the_disk_before_and_after_its_rename(tmp_path, monkeypatch):
    """The temporary file was renamed unflushed: after a power loss the version could be an empty file
    under its final name, which the registry and the weights topic named (the ledger and checkpoints
    fsync theirs)."""
    store = FileWeightStore(str(tmp_path / "w"))
    events = []
    fsync, mv = os.fsync, store.fs.mv

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_mv(src, dst, **kwargs):
        events.append(("mv", src, dst))
        mv(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(store.fs, "mv", recording_mv)
    ref = store.save(3, {"w": torch.ones(2)})
    (_, written), (_, tmp, final), (_, directory) = events
    assert written == tmp and final == ref.location and directory == str(tmp_path / "w")
