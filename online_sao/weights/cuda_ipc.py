"""``cuda-ipc://<name>``: published weights stay in the learner's GPU memory; serving maps them.

For learner and serving on one host with GPUs. On save the learner lays the state
dict out as one flat buffer (:mod:`online_sao.weights.layout`), copies it to its
GPU, and exports the buffer with ``torch.UntypedStorage._share_cuda_()``. The
export (IPC handles as base64, sizes, the publisher's pid and GPU uuid) and the
layout table go to a small JSON record in host shared memory,
``/dev/shm/online-sao.<name>.v00000012.cuda-ipc.json``; the notice's location
names it. No pickle anywhere: JSON and raw device memory only.

Lifetime: the learner holds every published buffer until ``delete`` (``prune``)
removes its record and drops it, so the keep-last-N / protected rule of
:meth:`WeightStore.prune` decides what stays mapped. The buffers die with the
learner process; a record left by a dead learner then fails to load with
``FileNotFoundError`` and is pruned by the next learner like any old version.

Serving opens the handle with ``torch.UntypedStorage._new_shared_cuda``, copies
the buffer into its own GPU memory, releases the mapping, and verifies the copy
exactly like the file store: SHA-256 (of the layout table and the data bytes,
computed on the host) and finiteness. The learner's own ``load`` (a rollback)
reads the buffer it holds instead: CUDA cannot map a handle in the process that
exported it.

torch counts consumers of an exported buffer (a counter in shared memory set to
1 by the export, decremented when a consumer's mapping is freed) and parks a
freed buffer whose count is above zero in its "limbo" instead of reusing it.
Here the publisher decides the lifetime, so ``delete`` gives up the export's own
count: the buffer goes back to the allocator at once. A reader still copying a
version while it is pruned may then read reused memory; the checksum refuses it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import socket
import uuid
from pathlib import Path
from typing import Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from online_sao.config.trainer import STORE_NAME_PATTERN, STORE_NAME_RULE
from online_sao.weights.store import CorruptWeights, WeightsRef, WeightStore, verify_state_dict
from online_sao.weights.layout import ALIGN_BYTES, Layout, pack, unpack
from online_sao.weights.shm import DEFAULT_SHM_ROOT

MAX_RECORD_BYTES = 128 * 1024 * 1024
"""Largest record file read (its layout table dominates; see weights_layout.MAX_TABLE_BYTES)."""

_NAME = re.compile(STORE_NAME_PATTERN)
_LOCATION = re.compile(rf"^cuda-ipc://({STORE_NAME_PATTERN})/v(\d{{8,}})$")


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64decode(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise CorruptWeights(f"bad base64 in CUDA IPC record: {exc}") from None


class IpcShare(BaseModel):
    """The export of one CUDA storage (what ``_share_cuda_`` returns), bytes as base64 text."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    device_index: int = Field(ge=0)
    """Index of the GPU in the publisher's process (informational: the uuid decides)."""
    handle: str
    """cudaIpcMemHandle_t of the allocation holding the storage."""
    size_bytes: int = Field(ge=0)
    offset_bytes: int = Field(ge=0)
    """Where the storage starts inside that allocation."""
    ref_counter: str
    """Name of torch's shared-memory file of consumer counters."""
    ref_counter_offset: int = Field(ge=0)
    event_handle: str
    """cudaIpcEventHandle_t a consumer waits on before reading."""
    event_sync_required: bool

    @classmethod
    def from_torch(cls, shared: tuple) -> IpcShare:
        device, handle, size, offset, counter, counter_offset, event, sync = shared
        return cls(device_index=device, handle=b64encode(handle), size_bytes=size, offset_bytes=offset,
                   ref_counter=b64encode(counter), ref_counter_offset=counter_offset,
                   event_handle=b64encode(event), event_sync_required=bool(sync))

    def torch_args(self, device_index: int) -> tuple:
        """The arguments of ``torch.UntypedStorage._new_shared_cuda`` to map it on ``device_index``."""
        return (device_index, b64decode(self.handle), self.size_bytes, self.offset_bytes,
                b64decode(self.ref_counter), self.ref_counter_offset, b64decode(self.event_handle),
                self.event_sync_required)


class IpcRecord(BaseModel):
    """The JSON record a notice's location points at."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format: Literal["online-sao-cuda-ipc/1"] = "online-sao-cuda-ipc/1"
    version: int = Field(ge=0)
    pid: int
    host: str
    device_uuid: str
    share: IpcShare
    layout: Layout


class IpcOps(Protocol):
    """Exporting and mapping device buffers (CUDA by default; tests pass a fake)."""

    def device_uuid(self, device: torch.device) -> str: ...

    def share(self, buffer: torch.Tensor) -> IpcShare: ...

    def open(self, share: IpcShare, device_uuid: str) -> torch.Tensor:
        """A flat uint8 tensor over the exported buffer; OSError if it cannot be mapped here."""

    def release(self, share: IpcShare) -> None:
        """Give up the export's own consumer count (before dropping the buffer)."""


def device_index_of(uuid_text: str, local_uuids: list[str]) -> int:
    """Index, in this process, of the GPU with ``uuid_text``; OSError if it is not visible."""
    try:
        return local_uuids.index(uuid_text)
    except ValueError:
        raise OSError(f"the publisher's GPU {uuid_text} is not visible to this process "
                      f"(CUDA_VISIBLE_DEVICES?)") from None


class TorchCudaIpc:
    """:class:`IpcOps` with torch's CUDA storage sharing."""

    def device_uuid(self, device: torch.device) -> str:
        return str(torch.cuda.get_device_properties(device).uuid)

    def share(self, buffer: torch.Tensor) -> IpcShare:
        return IpcShare.from_torch(buffer.untyped_storage()._share_cuda_())

    def open(self, share: IpcShare, device_uuid: str) -> torch.Tensor:
        if not torch.cuda.is_available():
            raise OSError("CUDA is not available in this process: cannot map CUDA IPC weights")
        local = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        index = device_index_of(device_uuid, local)
        try:
            storage = torch.UntypedStorage._new_shared_cuda(*share.torch_args(index))
        except RuntimeError as exc:
            raise FileNotFoundError(f"cannot map the CUDA IPC buffer: {exc}") from None
        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage, 0, (share.size_bytes,), (1,))

    def release(self, share: IpcShare) -> None:
        torch.UntypedStorage._release_ipc_counter_cuda(b64decode(share.ref_counter), share.ref_counter_offset)


def digest(layout: Layout, data: torch.Tensor) -> str:
    """SHA-256 of the layout table and the first ``layout.data_bytes`` bytes of ``data`` (a host copy)."""
    h = hashlib.sha256(layout.to_json())
    if layout.data_bytes:
        h.update(memoryview(data[:layout.data_bytes].cpu().numpy()))
    return h.hexdigest()


class CudaIpcWeightStore(WeightStore):
    """Versions held in GPU memory by the process that saved them; ``cuda-ipc://<name>/v00000012``."""

    def __init__(self, name: str, root: Path = DEFAULT_SHM_ROOT, device: torch.device | str | None = None,
                 ops: IpcOps | None = None):
        """``device`` holds published buffers (default: the current CUDA device, looked up at the first save)."""
        if not _NAME.fullmatch(name):
            raise ValueError(f"cuda-ipc store name {name!r}: {STORE_NAME_RULE}")
        if not Path(root).is_dir():
            raise FileNotFoundError(f"{root} does not exist: CUDA IPC records live in Linux's /dev/shm")
        self.name, self.root, self.url = name, Path(root), f"cuda-ipc://{name}"
        self.device = torch.device(device) if device is not None else None
        self.ops: IpcOps = ops or TorchCudaIpc()
        self._held: dict[int, tuple[torch.Tensor, IpcShare]] = {}
        """Published buffers of this process and their exports, kept until deleted."""

    def _path(self, name: str, version: int) -> Path:
        return self.root / f"online-sao.{name}.v{version:08d}.cuda-ipc.json"

    def _device(self) -> torch.device:
        if self.device is None:
            if not torch.cuda.is_available():
                raise RuntimeError("a cuda-ipc:// weight store needs a CUDA device (use a file or shm:// store)")
            self.device = torch.device("cuda", torch.cuda.current_device())
        return self.device

    def save(self, version: int, state: dict[str, torch.Tensor]) -> WeightsRef:
        verify_state_dict(state)
        layout = Layout.of(state)
        device = self._device()
        host = torch.empty(max(layout.data_bytes, ALIGN_BYTES), dtype=torch.uint8)
        pack({k: v.detach().to("cpu") for k, v in state.items()}, layout, host)
        checksum = digest(layout, host)
        buffer = host.to(device)  # its own allocation, exported whole
        if buffer.is_cuda:
            torch.cuda.synchronize(device)
        share = self.ops.share(buffer)
        record = IpcRecord(version=version, pid=os.getpid(), host=socket.gethostname(),
                           device_uuid=self.ops.device_uuid(device), share=share, layout=layout)
        self.delete(version)  # a republished version replaces the old buffer
        final = self._path(self.name, version)
        tmp = self.root / f".{final.name}.{uuid.uuid4().hex}.tmp"
        try:
            tmp.write_bytes(record.model_dump_json().encode("utf-8"))
            os.replace(tmp, final)  # readers see a whole record or none
        except BaseException:
            tmp.unlink(missing_ok=True)
            self.ops.release(share)
            raise
        self._held[version] = (buffer, share)
        return WeightsRef(version, f"{self.url}/v{version:08d}", checksum)

    def load(self, location: str, checksum: str) -> dict[str, torch.Tensor]:
        match = _LOCATION.match(location)
        if match is None:
            raise FileNotFoundError(f"{location}: not a cuda-ipc://<name>/v<version> location")
        name, version = match.group(1), int(match.group(2))
        record = self._read_record(location, self._path(name, version))
        layout = record.layout
        if record.version != version or record.share.size_bytes < layout.data_bytes:
            raise CorruptWeights(f"{location}: record does not describe this version's buffer")
        try:
            private = self._private_copy(record, name, version, location)
            matches = digest(layout, private) == checksum  # its .cpu() waits for the copy
        except RuntimeError as exc:  # CUDA errors (out of memory, ...): reported, serving keeps its weights
            raise OSError(f"{location}: copying the CUDA IPC buffer failed: {exc}") from None
        if not matches:
            raise CorruptWeights(f"{location}: checksum mismatch")
        state = unpack(layout, private)
        verify_state_dict(state)
        return state

    def _private_copy(self, record: IpcRecord, name: str, version: int, location: str) -> torch.Tensor:
        """The published bytes copied into memory of this process (the held buffer, or the mapped export)."""
        size = record.layout.data_bytes
        held = self._held.get(version) if (name == self.name and record.pid == os.getpid()) else None
        if held is not None:
            return held[0][:size].clone()
        try:
            mapped = self.ops.open(record.share, record.device_uuid)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{location}: publisher pid {record.pid} on {record.host} no longer "
                                    f"holds version {version}? {exc}") from None
        private = mapped[:size].clone()
        del mapped  # unmaps (and counts this consumer out) once the copy is done
        return private

    def _read_record(self, location: str, path: Path) -> IpcRecord:
        try:
            with open(path, "rb") as fh:
                data = fh.read(MAX_RECORD_BYTES + 1)
        except FileNotFoundError:
            raise FileNotFoundError(f"{location}: no such version in CUDA IPC shared memory "
                                    f"(pruned, or never published on this host)") from None
        if len(data) > MAX_RECORD_BYTES:
            raise CorruptWeights(f"{location}: record exceeds {MAX_RECORD_BYTES} bytes")
        try:
            record = IpcRecord.model_validate_json(data)
        except ValidationError as exc:
            raise CorruptWeights(f"{location}: bad CUDA IPC record: {exc.errors()[0]['msg']}") from None
        record.layout.check()
        return record

    def versions(self) -> list[int]:
        pattern = re.compile(rf"^online-sao\.{re.escape(self.name)}\.v(\d{{8,}})\.cuda-ipc\.json$")
        return sorted(int(m.group(1)) for m in map(pattern.match, os.listdir(self.root)) if m)

    def delete(self, version: int) -> None:
        """Remove the record, then drop the buffer (if this process holds it)."""
        self._path(self.name, version).unlink(missing_ok=True)
        held = self._held.pop(version, None)
        if held is not None:
            self.ops.release(held[1])
