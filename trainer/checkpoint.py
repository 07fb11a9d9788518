"""Atomic learner checkpoints and the ledger of interaction ids trained on.

A checkpoint is one directory ``<root>/step-00000042/``::

    meta.json             LearnerState: step, version, consumer offsets, join buffer (without
                          the id memory), algorithm state, MLflow run id, protected versions,
                          ledger segment and length
    index.json            step, policy version and ledger position alone: what retention and
                          roll-back read of every kept checkpoint (meta.json may hold megabytes)
    id_memory.bin         the join's id memory (:func:`trainer.id_memory.encode_snapshot`)
    policy.safetensors    full policy state dict
    critic.safetensors    full critic state dict (absent without a critic)
    optim.safetensors     every tensor of the optimiser/scheduler states
    optim.json            the rest of those states, tensors replaced by references

No pickle anywhere: tensors go to safetensors, the id memory to its own compact layout, everything
else to JSON. Checkpoints written before index.json and id_memory.bin existed load as before (the
version from meta.json, the id memory from the join buffer's JSON).

The ledger (:mod:`trainer.ledger`) is segment files ``<root>/ledger/<first step>.jsonl``.
Commit protocol (crash-safe at every point):
1. the ledger lines of steps trained since the last checkpoint are appended to the newest
   segment (a new one once it holds ``ledger_segment_bytes``) and fsynced; the segment's name
   and new length go into meta.json;
2. all files are written into ``<root>/.tmp-<random>/`` and fsynced, then the
   directory is fsynced (a write that fails, e.g. on a full disk, removes it at once and
   its error names the file);
3. ``rename`` to ``step-<n>`` (atomic) and the root is fsynced: this is the commit;
4. checkpoints beyond the newest ``keep`` are deleted, except the first checkpoint of
   each pinned version (the registry's candidate and champion, for a whole roll-back).
:meth:`Checkpointer.resume` loads the newest committed checkpoint, truncates the
segment it names to the length it recorded and deletes segments started after it, so ledger
lines of steps the checkpoint does not cover (a crash between 1 and 3) disappear with the steps
themselves: an id is in the ledger once per time its training is part of the
committed state. A step whose update was refused as non-finite still writes its
line, marked ``"refused": true``: those ids were consumed exactly once too, but the
policy did not train on them (SAO's critic updates before the refusal stay,
docs/ALGORITHM.md section 8; :func:`read_ledger` can tell the two apart).

The current segment's length is what a checkpoint records of it, so its lines may not be
deleted; to erase a user's ids, :func:`~trainer.ledger.redact_ledger` overwrites them in place
with dashes of the same length (``online-sao ledger redact``, the learner stopped). Sealed
segments (before the newest checkpoint's) are the operator's to archive or delete.
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

from online_sao.durable import fsync_dir, naming_the_file, private_opener
from streams.base import TopicPartition
from trainer.id_memory import MemorySnapshot, decode_snapshot, encode_snapshot
from trainer.ledger import (LEDGER_DIR, LEDGER_FILE, LEGACY_SEGMENT, SCRATCH_PREFIX, Ledger, read_ledger,
                            redact_ledger)

__all__ = ["Checkpoint", "Checkpointer", "LearnerState", "StagedCheckpoint", "LEDGER_DIR", "LEDGER_FILE",
           "read_ledger", "redact_ledger", "flatten_tensors", "unflatten_tensors"]

CHECKPOINT_DIR = re.compile(r"^step-(\d{8,})$")
DEFAULT_LEDGER_SEGMENT_BYTES = 64 * 2**20
"""``trainer.ledger_segment_bytes``' default, for a Checkpointer built without the config."""
INDEX_FILE = "index.json"
MEMORY_FILE = "id_memory.bin"
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
    ledger_segment: str | None = None
    """The ledger segment this checkpoint appended to (None: no ledger yet; set by
    :meth:`Checkpointer.stage`). Checkpoints from before segments name :data:`LEGACY_SEGMENT`."""
    ledger_bytes: int = 0
    """Length of :attr:`ledger_segment` this checkpoint covers (set by :meth:`Checkpointer.stage`)."""
    drift: dict[str, Any] = field(default_factory=dict)
    """The reward-drift detector's books (:meth:`trainer.plasticity.DriftResponse.state_dict`); empty
    without ``drift.enabled`` and in checkpoints from before they were kept."""
    reward_definition: str = ""
    """:meth:`~online_sao.config.RewardConfig.definition` of the rewards the state was learned from
    (empty in checkpoints from before it was kept): a restart under another one does not restore
    the reward statistics (:func:`trainer.state.restore_training_state`)."""

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["offsets"] = [[tp.topic, tp.partition, off] for tp, off in sorted(self.offsets.items())]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LearnerState":
        offsets = {TopicPartition(topic, partition): off for topic, partition, off in data["offsets"]}
        return cls(**{"ledger_segment": LEGACY_SEGMENT, **data, "offsets": offsets})


@dataclass
class Checkpoint:
    state: LearnerState
    models: dict[str, dict[str, torch.Tensor]]
    """"policy" and optionally "critic": full state dicts."""
    optimizers: dict[str, Any]
    """Optimiser and scheduler state dicts by name ("policy", "critic", "critic_scheduler")."""
    id_memory: MemorySnapshot | None = None
    """The join's id memory (None: it is in ``state.joiner``, or there is none)."""


@dataclass(frozen=True)
class StagedCheckpoint:
    """A checkpoint ready to write (:meth:`Checkpointer.stage`): nothing in it is shared with the
    learner's live state."""

    directory: Path
    """Where the commit renames it to (``<root>/step-<n>``)."""
    ledger: bytes
    """Ledger lines of the steps since the previous checkpoint, newline-terminated."""
    ledger_segment: str | None
    """The segment :attr:`ledger` goes to."""
    models: dict[str, dict[str, torch.Tensor]]
    optim_tensors: dict[str, torch.Tensor]
    optim_json: str
    meta_json: str
    """meta.json's text; its ``ledger_bytes`` counts :attr:`ledger` in."""
    index_json: str
    pinned_versions: frozenset[int]
    """:attr:`Checkpointer.pinned_versions` when it was staged."""
    id_memory: MemorySnapshot | None = None
    """Encoded into its own file by :meth:`Checkpointer.write` (on the writer's thread)."""


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

    def __init__(self, root: Path, keep: int = 2, ledger_segment_bytes: int = DEFAULT_LEDGER_SEGMENT_BYTES) -> None:
        if keep < 1:
            raise ValueError("keep at least one checkpoint")
        self.root = Path(root)
        self.keep = keep
        self.pinned_versions: set[int] = set()
        """Policy versions whose first checkpoint is never pruned (the registry's candidate and
        champion: a roll-back restores the whole training state from it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.ledger = Ledger(self.root, ledger_segment_bytes)
        self._unsaved_ledger: list[tuple[int, str]] = []
        self._versions: dict[str, int] = {}  # checkpoint directory name -> policy version (they never change)

    @property
    def ledger_path(self) -> Path:
        """The ledger's directory of segments (:func:`read_ledger` reads it)."""
        return self.ledger.directory

    def record_trained(self, step: int, interaction_ids: list[str], refused: bool = False,
                       turns_of: list[str] | None = None) -> None:
        """Note the ids a step took; they reach the ledger with the next :meth:`save`.
        ``refused``: the step's update was refused as non-finite, so these ids were
        consumed but the policy did not train on them (SAO's critic updates before the
        refusal stay, docs/ALGORITHM.md section 8; the line carries ``"refused": true``).
        ``turns_of``: ids of earlier turns that trained inside those rollouts (:attr:`Rollout.turns_of`;
        the line's ``"turns"``)."""
        entry: dict[str, Any] = {"step": step, "ids": interaction_ids}
        if turns_of:
            entry["turns"] = turns_of
        if refused:
            entry["refused"] = True
        self._unsaved_ledger.append((step, json.dumps(entry, separators=(",", ":"))))

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
        appended = b"".join(line.encode() + b"\n" for _, line in lines)
        s = ckpt.state
        s.ledger_segment, s.ledger_bytes = self.ledger.plan(len(appended), lines[0][0] if lines else s.step)
        optim_tensors: dict[str, torch.Tensor] = {}
        optim_tree = flatten_tensors(ckpt.optimizers, optim_tensors)
        meta = {"state": s.to_json(), "models": sorted(ckpt.models)}
        index = {"step": s.step, "version": s.version, "ledger_segment": s.ledger_segment,
                 "ledger_bytes": s.ledger_bytes}
        return StagedCheckpoint(final, appended, s.ledger_segment,
                                {name: _plain(state) for name, state in ckpt.models.items()},
                                optim_tensors, json.dumps(optim_tree), json.dumps(meta), json.dumps(index),
                                frozenset(self.pinned_versions), ckpt.id_memory)

    def write(self, staged: "StagedCheckpoint") -> Path:
        """Commit a staged checkpoint (steps 1-4 of the module docstring); returns its directory.
        It reads nothing the learner changes, so it may run on another thread, one write at a time."""
        if staged.ledger:
            with naming_the_file(self.ledger.directory / staged.ledger_segment):
                self.ledger.append(staged.ledger_segment, staged.ledger)
        tmp = _scratch(self.root)
        tmp.mkdir()
        try:
            _write_files(tmp, staged)
        except BaseException:  # a full disk: what was written must not hold the space until the next start
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        os.rename(tmp, staged.directory)
        fsync_dir(self.root)
        pinned = set(self._pinned(staged.pinned_versions).values())
        for _, old in self.checkpoints()[:-self.keep]:
            if old not in pinned:
                _remove(old, self.root)
        kept = {path.name for _, path in self.checkpoints()}
        self._versions = {name: version for name, version in self._versions.items() if name in kept}
        return staged.directory

    def _pinned(self, versions: frozenset[int]) -> dict[int, Path]:
        """The oldest checkpoint of each of ``versions``: the one taken right after it was published."""
        found: dict[int, Path] = {}
        for _, path in self.checkpoints():
            version = self._version_of(path)
            if version in versions and version not in found:
                found[version] = path
        return found

    def _version_of(self, path: Path) -> int:
        """The policy version of a committed checkpoint: from its index.json, or once from the
        meta.json of a checkpoint written before index files (remembered: it never changes)."""
        if path.name not in self._versions:
            self._versions[path.name] = _read_index(path)["version"]
        return self._versions[path.name]

    def checkpoint_of_version(self, version: int) -> Checkpoint | None:
        """The oldest checkpoint whose policy is published ``version`` (None: none kept)."""
        for _, path in self.checkpoints():
            if self._version_of(path) == version:
                return self.load(path)
        return None

    def sealed_segments(self) -> list[Path]:
        """Ledger segments before the one the newest checkpoint appends to: the learner never reads
        or changes them again; the operator may archive or delete them (while it runs, too)."""
        found = self.checkpoints()
        if not found:
            return []
        return self.ledger.sealed(_read_index(found[-1][1]).get("ledger_segment", LEGACY_SEGMENT))

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
        memory = path / MEMORY_FILE
        id_memory = decode_snapshot(memory.read_bytes()) if memory.exists() else None
        return Checkpoint(LearnerState.from_json(meta["state"]), models, optimizers, id_memory)

    def resume(self) -> Checkpoint | None:
        """Load the newest checkpoint and make the ledger agree with it: lines written
        after it (by steps it does not cover) are cut off, segments started after it deleted,
        unfinished temp dirs removed; a ledger of the layout before segments becomes the first
        segment (:meth:`trainer.ledger.Ledger.migrate`)."""
        for path in self.root.glob(f"{SCRATCH_PREFIX}*"):
            shutil.rmtree(path)
        self._unsaved_ledger.clear()
        self.ledger.migrate()
        ckpt = self.load_latest()
        if ckpt is None:
            self.ledger.cut_back(None, 0)
        else:
            self.ledger.cut_back(ckpt.state.ledger_segment, ckpt.state.ledger_bytes)
        return ckpt


def _write_files(tmp: Path, staged: StagedCheckpoint) -> None:
    """Every file of ``staged`` into the directory ``tmp``, fsynced, then the directory."""
    tensors = {**{f"{name}.safetensors": state for name, state in staged.models.items()},
               "optim.safetensors": staged.optim_tensors}
    texts = {"optim.json": staged.optim_json, "meta.json": staged.meta_json, INDEX_FILE: staged.index_json}
    for name, state in tensors.items():
        with naming_the_file(tmp / name):
            save_file(state, str(tmp / name))
    for name, text in texts.items():  # meta.json holds the join's waiting interactions: users' data
        with naming_the_file(tmp / name), open(tmp / name, "w", opener=private_opener) as fh:
            fh.write(text)
    written = [*tensors, *texts]
    if staged.id_memory is not None:
        with naming_the_file(tmp / MEMORY_FILE):
            with open(tmp / MEMORY_FILE, "wb", opener=private_opener) as fh:  # interaction ids: users' data
                fh.write(encode_snapshot(staged.id_memory))
        written.append(MEMORY_FILE)
    for name in written:
        with naming_the_file(tmp / name):
            _fsync_file(tmp / name)
    fsync_dir(tmp)


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


def _read_index(path: Path) -> dict[str, Any]:
    """A committed checkpoint's index.json; for one written before index files, its meta.json's state."""
    index = path / INDEX_FILE
    return json.loads(index.read_text()) if index.exists() else _read_meta(path)["state"]
