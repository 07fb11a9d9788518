"""Atomic learner checkpoints and the ledger of interaction ids trained on.

A checkpoint is one directory ``<root>/step-00000042/``::

    meta.json             LearnerState: step, version, consumer offsets, join buffer,
                          algorithm state, MLflow run id, protected versions, ledger length
    policy.safetensors    full policy state dict
    critic.safetensors    full critic state dict (absent without a critic)
    optim.safetensors     every tensor of the optimiser/scheduler states
    optim.json            the rest of those states, tensors replaced by references

No pickle anywhere: tensors go to safetensors, everything else to JSON.

Commit protocol (crash-safe at every point):
1. the ledger lines of steps trained since the last checkpoint are appended to
   ``<root>/ledger.jsonl`` and fsynced; its new length goes into meta.json;
2. all files are written into ``<root>/.tmp-<random>/`` and fsynced, then the
   directory is fsynced;
3. ``rename`` to ``step-<n>`` (atomic) and the root is fsynced: this is the commit;
4. checkpoints beyond the newest ``keep`` are deleted, except the first checkpoint of
   each pinned version (the registry's candidate and champion, for a whole roll-back).
:meth:`Checkpointer.resume` loads the newest committed checkpoint and truncates
the ledger to the length that checkpoint recorded, so ledger lines of steps the
checkpoint does not cover (a crash between 1 and 3) disappear with the steps
themselves: an id is in the ledger once per time its training is part of the
committed state. A step whose update was refused as non-finite still writes its
line, marked ``"refused": true``: those ids were consumed exactly once too, but
trained nothing (:func:`read_ledger` can tell the two apart).

The ledger's length is what a checkpoint records of it, so lines may not be deleted;
to erase a user's ids, :func:`redact_ledger` overwrites them in place with dashes of
the same length (``online-sao ledger redact``, the learner stopped).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from online_sao.durable import fsync_dir
from streams.base import TopicPartition

CHECKPOINT_DIR = re.compile(r"^step-(\d{8,})$")
LEDGER_FILE = "ledger.jsonl"
SCRATCH_PREFIX = ".tmp-"
"""Names of directories a checkpoint is written in or deleted from; resume removes any left behind."""
_TENSOR_TAG = "__tensor__"
_MAP_TAG = "__map__"


@dataclass
class LearnerState:
    """Everything of the learner that is not a tensor, as JSON."""

    step: int
    version: int
    offsets: dict[TopicPartition, int]
    """Next offset to read per partition: every record before it is inside this state."""
    joiner: dict[str, Any]
    algorithm: dict[str, Any] = field(default_factory=dict)
    mlflow_run_id: str | None = None
    protected_versions: list[int] = field(default_factory=list)
    """The versions the publisher had pinned when it was written (the registry's candidate and
    champion); for reading only: a restart pins what the registry says then."""
    counters: dict[str, float] = field(default_factory=dict)
    """Learner-level counts that must survive restarts (dead letters, invalid rollouts)."""
    candidate: dict[str, Any] = field(default_factory=dict)
    """The registry's evidence: the recent window the gate scores versions on and the read and
    dead-letter counts at the candidate's registration (:class:`trainer.deploy.RecentWindow`)."""
    ledger_bytes: int = 0
    """Length of the ledger file this checkpoint covers (set by :meth:`Checkpointer.stage`)."""

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["offsets"] = [[tp.topic, tp.partition, off] for tp, off in sorted(self.offsets.items())]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LearnerState":
        offsets = {TopicPartition(topic, partition): off for topic, partition, off in data["offsets"]}
        return cls(**{**data, "offsets": offsets})


@dataclass
class Checkpoint:
    state: LearnerState
    models: dict[str, dict[str, torch.Tensor]]
    """"policy" and optionally "critic": full state dicts."""
    optimizers: dict[str, Any]
    """Optimiser and scheduler state dicts by name ("policy", "critic", "critic_scheduler")."""


@dataclass(frozen=True)
class StagedCheckpoint:
    """A checkpoint ready to write (:meth:`Checkpointer.stage`): nothing in it is shared with the
    learner's live state."""

    directory: Path
    """Where the commit renames it to (``<root>/step-<n>``)."""
    ledger: bytes
    """Ledger lines of the steps since the previous checkpoint, newline-terminated."""
    models: dict[str, dict[str, torch.Tensor]]
    optim_tensors: dict[str, torch.Tensor]
    optim_json: str
    meta_json: str
    """meta.json's text; its ``ledger_bytes`` counts :attr:`ledger` in."""
    pinned_versions: frozenset[int]
    """:attr:`Checkpointer.pinned_versions` when it was staged."""


def flatten_tensors(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """A JSON-serialisable copy of ``obj`` with each tensor moved into ``tensors``
    under its path and replaced by ``{"__tensor__": path}``. Dicts with non-string
    keys (optimiser state is keyed by int) become ``{"__map__": [[key, value], ...]}``."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().to("cpu").contiguous().clone()
        return {_TENSOR_TAG: path}
    if isinstance(obj, dict):
        items = [(k, flatten_tensors(v, tensors, f"{path}/{k}")) for k, v in obj.items()]
        if all(isinstance(k, str) for k in obj) and not ({_TENSOR_TAG, _MAP_TAG} & set(obj)):
            return dict(items)
        if not all(isinstance(k, (str, int)) for k in obj):
            raise TypeError(f"{path}: dict keys must be str or int, got {sorted({type(k).__name__ for k in obj})}")
        return {_MAP_TAG: [[k, v] for k, v in items]}
    if isinstance(obj, (list, tuple)):
        return [flatten_tensors(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{path}: cannot checkpoint a {type(obj).__name__}")


def unflatten_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`flatten_tensors` (tuples come back as lists)."""
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR_TAG}:
            return tensors[obj[_TENSOR_TAG]]
        if set(obj) == {_MAP_TAG}:
            return {k: unflatten_tensors(v, tensors) for k, v in obj[_MAP_TAG]}
        return {k: unflatten_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unflatten_tensors(v, tensors) for v in obj]
    return obj


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())




def _plain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors sharing storage (tied embeddings): write copies
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


class Checkpointer:
    """Writes, finds and loads checkpoints under ``root``; owns the ledger."""

    def __init__(self, root: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError("keep at least one checkpoint")
        self.root = Path(root)
        self.keep = keep
        self.pinned_versions: set[int] = set()
        """Policy versions whose first checkpoint is never pruned (the registry's candidate and
        champion: a roll-back restores the whole training state from it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._unsaved_ledger: list[str] = []

    @property
    def ledger_path(self) -> Path:
        return self.root / LEDGER_FILE

    def record_trained(self, step: int, interaction_ids: list[str], refused: bool = False) -> None:
        """Note the ids a step took; they reach the ledger with the next :meth:`save`.
        ``refused``: the step's update was refused as non-finite, so these ids were
        consumed but trained nothing (the line carries ``"refused": true``)."""
        entry: dict[str, Any] = {"step": step, "ids": interaction_ids}
        if refused:
            entry["refused"] = True
        self._unsaved_ledger.append(json.dumps(entry, separators=(",", ":")))

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Committed checkpoints, oldest first."""
        found = []
        for path in self.root.iterdir():
            m = CHECKPOINT_DIR.match(path.name)
            if m and path.is_dir():
                found.append((int(m.group(1)), path))
        return sorted(found)

    def save(self, ckpt: Checkpoint) -> Path:
        """Commit ``ckpt`` now (see the module docstring); returns its directory."""
        return self.write(self.stage(ckpt))

    def stage(self, ckpt: Checkpoint) -> "StagedCheckpoint":
        """Everything :meth:`write` needs, as private copies (tensors cloned, JSON rendered, the
        ledger lines of the steps since the last stage taken over): the learner may train on while
        the copy is written. Call it only when no write of this checkpointer is running (the ledger
        length it records counts on the file staying as it is until this write appends to it)."""
        final = self.root / f"step-{ckpt.state.step:08d}"
        if final.exists():
            raise FileExistsError(f"{final} already exists: steps must increase across checkpoints")
        lines, self._unsaved_ledger = self._unsaved_ledger, []
        appended = b"".join(line.encode() + b"\n" for line in lines)
        size = self.ledger_path.stat().st_size if self.ledger_path.exists() else 0
        ckpt.state.ledger_bytes = size + len(appended)
        optim_tensors: dict[str, torch.Tensor] = {}
        optim_tree = flatten_tensors(ckpt.optimizers, optim_tensors)
        meta = {"state": ckpt.state.to_json(), "models": sorted(ckpt.models)}
        return StagedCheckpoint(final, appended, {name: _plain(state) for name, state in ckpt.models.items()},
                                optim_tensors, json.dumps(optim_tree), json.dumps(meta),
                                frozenset(self.pinned_versions))

    def write(self, staged: "StagedCheckpoint") -> Path:
        """Commit a staged checkpoint (steps 1-4 of the module docstring); returns its directory.
        It reads nothing the learner changes, so it may run on another thread, one write at a time."""
        self._append_ledger(staged.ledger)
        tmp = _scratch(self.root)
        tmp.mkdir()
        written = []
        for name, state in staged.models.items():
            save_file(state, str(tmp / f"{name}.safetensors"))
            written.append(tmp / f"{name}.safetensors")
        save_file(staged.optim_tensors, str(tmp / "optim.safetensors"))
        (tmp / "optim.json").write_text(staged.optim_json)
        (tmp / "meta.json").write_text(staged.meta_json)
        written += [tmp / "optim.safetensors", tmp / "optim.json", tmp / "meta.json"]
        for path in written:
            _fsync_file(path)
        fsync_dir(tmp)
        os.rename(tmp, staged.directory)
        fsync_dir(self.root)
        pinned = set(self._pinned(staged.pinned_versions).values())
        for _, old in self.checkpoints()[:-self.keep]:
            if old not in pinned:
                _remove(old, self.root)
        return staged.directory

    def _pinned(self, versions: frozenset[int]) -> dict[int, Path]:
        """The oldest checkpoint of each of ``versions``: the one taken right after it was published."""
        found: dict[int, Path] = {}
        for _, path in self.checkpoints():
            version = _read_meta(path)["state"]["version"]
            if version in versions and version not in found:
                found[version] = path
        return found

    def checkpoint_of_version(self, version: int) -> Checkpoint | None:
        """The oldest checkpoint whose policy is published ``version`` (None: none kept)."""
        for _, path in self.checkpoints():
            if _read_meta(path)["state"]["version"] == version:
                return self.load(path)
        return None

    def load_latest(self) -> Checkpoint | None:
        """The newest committed checkpoint, or None. Reads only; see :meth:`resume`."""
        found = self.checkpoints()
        if not found:
            return None
        return self.load(found[-1][1])

    def load(self, path: Path) -> Checkpoint:
        """The committed checkpoint in ``path``."""
        meta = _read_meta(path)
        models = {name: load_file(str(path / f"{name}.safetensors")) for name in meta["models"]}
        optim_tensors = load_file(str(path / "optim.safetensors"))
        optimizers = unflatten_tensors(json.loads((path / "optim.json").read_text()), optim_tensors)
        return Checkpoint(LearnerState.from_json(meta["state"]), models, optimizers)

    def resume(self) -> Checkpoint | None:
        """Load the newest checkpoint and make the ledger agree with it: lines written
        after it (by steps it does not cover) are cut off, unfinished temp dirs removed."""
        for path in self.root.glob(f"{SCRATCH_PREFIX}*"):
            shutil.rmtree(path)
        self._unsaved_ledger.clear()
        ckpt = self.load_latest()
        covered = ckpt.state.ledger_bytes if ckpt is not None else 0
        size = self.ledger_path.stat().st_size if self.ledger_path.exists() else 0
        if size < covered:
            raise RuntimeError(f"{self.ledger_path} holds {size} bytes but the checkpoint covers {covered}: "
                               "the ledger was truncated or replaced outside the learner")
        if size > covered:
            with open(self.ledger_path, "rb+") as fh:
                fh.truncate(covered)
                os.fsync(fh.fileno())
        return ckpt

    def _append_ledger(self, lines: bytes) -> None:
        with open(self.ledger_path, "ab") as fh:
            fh.write(lines)
            fh.flush()
            os.fsync(fh.fileno())


def _scratch(root: Path) -> Path:
    return root / f"{SCRATCH_PREFIX}{uuid.uuid4().hex}"


def _remove(checkpoint: Path, root: Path) -> None:
    """Delete a committed checkpoint so that a kill at any moment leaves it whole or gone: renamed
    out of the ``step-*`` names first (atomic), then deleted; :meth:`Checkpointer.resume` removes
    a ``.tmp-*`` directory left behind. Deleting it in place could leave a ``step-*`` directory
    without its meta.json, which the next start would read as a checkpoint."""
    doomed = _scratch(root)
    os.rename(checkpoint, doomed)
    fsync_dir(root)
    shutil.rmtree(doomed)


def _read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / "meta.json").read_text())


def read_ledger(path: Path, refused: bool | None = None) -> list[tuple[int, str]]:
    """(step, interaction id) of every line of a ledger, in order: every id a step
    took (``refused=None``), only those of refused steps (True) or only those
    actually trained on (False)."""
    out = []
    if not Path(path).exists():
        return out
    for line in Path(path).read_text().splitlines():
        entry = json.loads(line)
        if refused is None or entry.get("refused", False) == refused:
            out.extend((entry["step"], iid) for iid in entry["ids"])
    return out


REDACTED_CHAR = "-"
"""What a redacted id's characters become: the ledger keeps its length (the checkpoints record it)."""


def redact_ledger(path: Path, interaction_ids: set[str]) -> int:
    """Overwrite every occurrence of ``interaction_ids`` in the ledger at ``path`` with
    :data:`REDACTED_CHAR` of the same encoded length, so the ledger's length, which each
    checkpoint records, is unchanged; returns the number of ids redacted. Written to a new file
    and renamed over the ledger: run it with the learner stopped (a step appended meanwhile would
    be lost, and the learner would then refuse to start)."""
    path = Path(path)
    wanted = {json.dumps(iid) for iid in interaction_ids}
    redacted, lines = 0, []
    for line in path.read_bytes().splitlines(keepends=True):
        entry = json.loads(line)
        ids = [json.dumps(iid) for iid in entry["ids"]]
        hits = [encoded for encoded in ids if encoded in wanted]
        if hits:
            entry["ids"] = [json.loads(encoded) if encoded not in wanted else
                            REDACTED_CHAR * (len(encoded) - 2)
                            for encoded in ids]
            new = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
            if len(new) != len(line):
                raise ValueError(f"redacting {hits} would change a ledger line's length; nothing was written")
            line, redacted = new, redacted + len(hits)
        lines.append(line)
    if redacted:
        scratch = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        with open(scratch, "wb") as fh:
            fh.writelines(lines)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(scratch, path)
        fsync_dir(path.parent)
    return redacted
