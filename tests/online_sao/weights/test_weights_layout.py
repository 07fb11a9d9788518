"""The JSON-table + raw-buffer layout under the shared-memory transports."""

import json

import pytest
import torch

from online_sao.weights import CorruptWeights
from online_sao.weights.layout import ALIGN_BYTES, DTYPES, MAX_TABLE_BYTES, Layout, pack, unpack


def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, dtype in DTYPES.items():
        if dtype.is_floating_point:
            state[name] = torch.randn(3, 5, generator=g).to(dtype)
        elif dtype == torch.bool:
            state[name] = torch.randint(0, 2, (7,), generator=g).bool()
        else:
            state[name] = torch.randint(-100 if dtype != torch.uint8 else 0, 100, (2, 3), generator=g).to(dtype)
    state["scalar"] = torch.tensor(3.5)
    state["empty"] = torch.zeros(0, 4)
    state["strided"] = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    return state


def _packed(state):
    layout = Layout.of(state)
    buf = torch.full((layout.data_bytes,), 0xAB, dtype=torch.uint8)  # padding must not stay garbage
    pack(state, layout, buf)
    return layout, buf


def test_round_trip_of_every_dtype_and_shape():
    state = _every_dtype()
    layout, buf = _packed(state)
    back = unpack(Layout.from_json(layout.to_json(), data_bytes=buf.numel()), buf)
    assert list(back) == list(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        torch.testing.assert_close(back[name], tensor, rtol=0, atol=0)


def test_offsets_are_aligned_and_padding_is_zeroed():
    state = {"a": torch.ones(3, dtype=torch.float16), "b": torch.ones(1, dtype=torch.int64)}
    layout, buf = _packed(state)
    assert [e.offset for e in layout.tensors] == [0, ALIGN_BYTES]
    assert layout.data_bytes == 2 * ALIGN_BYTES
    assert int(buf[6:ALIGN_BYTES].sum()) == 0 and int(buf[ALIGN_BYTES + 8:].sum()) == 0


def test_table_is_plain_json_with_stable_bytes():
    state = _every_dtype()
    table = json.loads(Layout.of(state).to_json())
    assert table["format"] == "online-sao-layout/1"
    assert table["tensors"][0] == {"name": "float64", "dtype": "float64", "shape": [3, 5], "offset": 0,
                                   "nbytes": 120}
    assert Layout.of(state).to_json() == Layout.of(dict(state)).to_json()


def test_unsupported_dtype_is_refused_when_saving():
    with pytest.raises(ValueError, match="complex64"):
        Layout.of({"z": torch.zeros(2, dtype=torch.complex64)})


def _table(**changes) -> bytes:
    entry = {"name": "w", "dtype": "float32", "shape": [2, 2], "offset": 0, "nbytes": 16}
    entry.update(changes)
    return json.dumps({"format": "online-sao-layout/1", "data_bytes": 64, "tensors": [entry]}).encode()


@pytest.mark.parametrize("table, message", [
    (_table(dtype="complex128"), "unknown dtype"),
    (_table(nbytes=20), "is not 20 bytes"),
    (_table(shape=[-2, -2]), "is not 16 bytes"),
    (_table(offset=8), "misplaced"),
    (_table(offset=64), "misplaced"),
    (_table(extra=1), "bad layout table"),
    (b'{"format": "something-else/9", "data_bytes": 0, "tensors": []}', "bad layout table"),
    (b"[1, 2", "bad layout table"),
])
def test_malformed_tables_are_refused(table, message):
    with pytest.raises(CorruptWeights, match=message):
        Layout.from_json(table, data_bytes=64)


def test_overlapping_duplicate_and_size_mismatched_tables_are_refused():
    a = {"name": "a", "dtype": "float32", "shape": [32], "offset": 0, "nbytes": 128}
    b = dict(a, name="b", offset=64)
    overlap = json.dumps({"data_bytes": 256, "tensors": [a, b]}).encode()
    with pytest.raises(CorruptWeights, match="misplaced"):
        Layout.from_json(overlap)
    twice = json.dumps({"data_bytes": 256, "tensors": [a, dict(a, offset=128)]}).encode()
    with pytest.raises(CorruptWeights, match="twice"):
        Layout.from_json(twice)
    with pytest.raises(CorruptWeights, match="buffer holds 64"):
        Layout.from_json(json.dumps({"data_bytes": 256, "tensors": [a]}).encode(), data_bytes=64)
    with pytest.raises(CorruptWeights, match="exceeds"):
        Layout.from_json(b" " * (MAX_TABLE_BYTES + 1))


def test_unpack_refuses_a_short_buffer():
    layout, buf = _packed({"w": torch.ones(100)})
    with pytest.raises(CorruptWeights, match="shorter"):
        unpack(layout, buf[:100])
