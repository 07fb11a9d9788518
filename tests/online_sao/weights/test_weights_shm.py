"""The shm:// store in one process: segment format, refusals, pruning, names. Two processes:
test_weights_transport.py."""

import fcntl
import hashlib
import json
import os
import struct
import time
import uuid
from pathlib import Path

import pytest
import torch

from online_sao.weights import CorruptWeights, open_weight_store
from online_sao.weights.layout import Layout
import online_sao.weights.shm as shm
from online_sao.weights.shm import (DEFAULT_SHM_ROOT, SEGMENT_MAGIC, UNLOCKED_TEMP_GRACE_S, ShmWeightStore,
                                  segment_header)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(8, 3, generator=g), "layer.bias": torch.randn(8, generator=g).half(),
            "steps": torch.tensor(seed)}


@pytest.fixture
def store():
    shm = ShmWeightStore(f"test-{uuid.uuid4().hex[:12]}")
    yield shm
    for version in shm.versions():
        shm.delete(version)


def _segment(store: ShmWeightStore, version: int) -> Path:
    return DEFAULT_SHM_ROOT / f"online-sao.{store.name}.v{version:08d}.seg"


def test_a_segment_is_a_json_table_and_raw_tensor_bytes(store):
    state = _state()
    ref = store.save(7, state)
    assert ref.location == f"shm://{store.name}/v00000007"
    raw = _segment(store, 7).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == ref.checksum
    magic, table_len = struct.unpack_from("<8sQ", raw)
    assert magic == SEGMENT_MAGIC
    table = json.loads(raw[16:16 + table_len])
    data = raw[len(segment_header(Layout.of(state))):]
    for entry in table["tensors"]:
        tensor = state[entry["name"]]
        assert entry["dtype"] == str(tensor.dtype).removeprefix("torch.") and entry["shape"] == list(tensor.shape)
        assert data[entry["offset"]:entry["offset"] + entry["nbytes"]] == tensor.numpy().tobytes()


def test_a_flipped_byte_is_refused(store):
    ref = store.save(1, _state())
    path = _segment(store, 1)
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptWeights, match="checksum"):
        store.load(ref.location, ref.checksum)


@pytest.mark.parametrize("corrupt, message", [
    (lambda raw: b"NOTMAGIC" + raw[8:], "bad magic"),
    (lambda raw: raw[:8] + struct.pack("<Q", 10**9) + raw[16:], "past the segment's end"),
    (lambda raw: raw[:-64], "data bytes"),
    (lambda raw: b"tiny", "too short"),
    (lambda raw: b"", "empty segment"),
])
def test_a_malformed_segment_with_a_matching_checksum_is_refused(store, corrupt, message):
    ref = store.save(1, _state())
    path = _segment(store, 1)
    bad = corrupt(path.read_bytes())
    path.write_bytes(bad)
    with pytest.raises(CorruptWeights, match=message):
        store.load(ref.location, hashlib.sha256(bad).hexdigest())


def test_a_pruned_version_gives_a_clear_error(store):
    refs = [store.save(v, _state(v)) for v in (1, 2, 3)]
    mapped_before = store.load(refs[1].location, refs[1].checksum)
    assert store.prune(keep_last=1, protected={1}) == [2]
    torch.testing.assert_close(mapped_before["layer.weight"], _state(2)["layer.weight"], rtol=0, atol=0)
    assert store.versions() == [1, 3]
    with pytest.raises(FileNotFoundError, match=r"version 2 is not in shared memory \(pruned"):
        store.load(refs[1].location, refs[1].checksum)
    torch.testing.assert_close(store.load(refs[0].location, refs[0].checksum)["layer.weight"],
                               _state(1)["layer.weight"], rtol=0, atol=0)


def test_stores_of_other_names_are_separate_but_any_store_loads_a_location(store):
    other = ShmWeightStore(f"{store.name}-other")
    try:
        other.save(4, _state(4))
        ref = store.save(5, _state(5))
        assert store.versions() == [5] and other.versions() == [4]
        assert other.load(ref.location, ref.checksum).keys() == _state().keys()
    finally:
        other.delete(4)


def test_resaving_a_version_replaces_it_and_leaves_no_temporary_files(store):
    store.save(1, _state(1))
    ref = store.save(1, _state(2))
    loaded = store.load(ref.location, ref.checksum)
    torch.testing.assert_close(loaded["layer.weight"], _state(2)["layer.weight"], rtol=0, atol=0)
    leftovers = [p.name for p in DEFAULT_SHM_ROOT.iterdir() if store.name in p.name]
    assert leftovers == [f"online-sao.{store.name}.v00000001.seg"]


def test_non_finite_or_unsupported_weights_are_never_written(store):
    bad = _state()
    bad["layer.weight"][0, 0] = float("inf")
    with pytest.raises(CorruptWeights, match="layer.weight"):
        store.save(1, bad)
    with pytest.raises(ValueError, match="complex64"):
        store.save(1, {"z": torch.zeros(2, dtype=torch.complex64)})
    assert store.versions() == [] and not [p for p in DEFAULT_SHM_ROOT.iterdir() if store.name in p.name]


def test_names_and_locations_are_checked(store, tmp_path):
    for name in ("", "a/b", "..", "x" * 101, "dots.are.out"):
        with pytest.raises(ValueError):
            ShmWeightStore(name)
    with pytest.raises(FileNotFoundError, match="/dev/shm"):
        ShmWeightStore("x", root=tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="not a shm://"):
        store.load(f"/tmp/{store.name}/v00000001", "0" * 64)


def test_open_weight_store_picks_the_transport_by_url(tmp_path):
    shm = open_weight_store("shm://some-name")
    assert isinstance(shm, ShmWeightStore) and shm.url == "shm://some-name"
    from online_sao.weights import FileWeightStore
    from online_sao.weights.cuda_ipc import CudaIpcWeightStore

    assert isinstance(open_weight_store("cuda-ipc://some-name"), CudaIpcWeightStore)
    assert isinstance(open_weight_store(str(tmp_path)), FileWeightStore)  # still the default


def _temp_segment(root: Path, name: str, version: int, age_s: float) -> Path:
    """A temporary segment as a save leaves it, last written ``age_s`` ago."""
    path = root / f".online-sao.{name}.v{version:08d}.seg.{uuid.uuid4().hex}.tmp"
    path.write_bytes(bytes(64))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_prune_removes_a_temporary_segment_whose_writer_died(tmp_path):
    """The lock of a killed writer went with it: its segment goes. A locked one is a save in progress
    in another process, an unlocked recent one may be about to be locked, another name's is not ours."""
    store = ShmWeightStore("learner", root=tmp_path)
    store.save(1, _state(1))
    old = UNLOCKED_TEMP_GRACE_S + 60
    dead = _temp_segment(tmp_path, "learner", 2, age_s=old)
    recent = _temp_segment(tmp_path, "learner", 3, age_s=0)
    other_name = _temp_segment(tmp_path, "other", 2, age_s=old)
    live = _temp_segment(tmp_path, "learner", 4, age_s=old)
    with open(live, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert store.prune(keep_last=1) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (recent, other_name, live, tmp_path / "online-sao.learner.v00000001.seg"))
    assert not dead.exists()


def test_a_save_holds_its_segment_against_a_concurrent_prune(store, monkeypatch):
    fill = shm._fill

    def fill_then_prune_from_another_store(*args):
        [tmp] = [p for p in DEFAULT_SHM_ROOT.iterdir() if p.name.startswith(f".online-sao.{store.name}.")]
        long_ago = time.time() - UNLOCKED_TEMP_GRACE_S - 60
        os.utime(tmp, (long_ago, long_ago))  # past the grace: only the lock keeps it
        ShmWeightStore(store.name).prune(keep_last=1)
        return fill(*args)

    monkeypatch.setattr(shm, "_fill", fill_then_prune_from_another_store)
    ref = store.save(1, _state(1))
    torch.testing.assert_close(store.load(ref.location, ref.checksum)["layer.weight"], _state(1)["layer.weight"],
                               rtol=0, atol=0)
