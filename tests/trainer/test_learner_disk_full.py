"""The learner when the disk of its weight store, its checkpoints or its ledger fills up mid-run.

Measured on real 8 MiB tmpfs mounts (docs/RELIABILITY.md, "The learner's disk full"); CI cannot
mount, so here the disk fills by other means before step 3 trains: the weight store's file system
refuses the rest of a file as the kernel does (OSError ENOSPC naming no file, part of the file
written), safetensors raises what it raised on the full tmpfs, and the ledger's next segment is a
link to /dev/full (the kernel's own ENOSPC). Each time the learner must stop with an OS error
that names the file it could not write, leave no partial file holding space, announce no weights
it did not write, and, restarted once the space is back, go on from its last checkpoint with every
interaction trained exactly once.
"""

from __future__ import annotations

import errno
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors import SafetensorError

import trainer.checkpoint
import trainer.rank_zero
from apps.config import AppConfig
from online_sao.modeling import load_policy
from online_sao.schemas import WeightsNotice, decode
from online_sao.weights import FileWeightStore
from streams.memory import InMemoryBackend
from tests.trainer.test_learner_memory import _config
from tests.trainer.traffic import FillBefore, produce, sample_traffic
from trainer.checkpoint import Checkpointer, read_ledger
from trainer.distributed import init_distributed
from trainer.learner import LearnerResult, RunUntil, train

INTERACTIONS = 12
PER_STEP = 2
FULL_BEFORE_STEP = 3
"""Steps 1 and 2 publish and checkpoint on a disk with room; the disk is full from step 3 on."""


class Disk:
    """Full or not; the injections below read :attr:`full`."""

    def __init__(self) -> None:
        self.full = False

    def fill(self) -> None:
        self.full = True

    def free(self) -> None:
        self.full = False


@dataclass
class Lives:
    error: OSError
    """What the first life raised."""
    left: list[str]
    """The checkpoint directory's and the weight store's entries once it had stopped."""
    cfg: AppConfig
    backend: InMemoryBackend
    ids: list[str]
    """Every interaction produced (all rewarded)."""
    second: LearnerResult


def _fail_then_restart(tmp_path: Path, model_dir: Path, disk: Disk, **overrides) -> Lives:
    """The first life, whose disk fills before step 3 (it must raise an OS error), then a second
    once there is room again, run until the topics are drained."""
    cfg = _config(tmp_path, model_dir, **{"trainer.min_rollouts": PER_STEP, "trainer.max_rollouts_per_step": PER_STEP,
                                          **overrides})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    traffic = sample_traffic(load_policy(model_dir), INTERACTIONS, prefix="full")
    produce(backend.producer(), cfg.kafka.topics, traffic)
    filling = FillBefore(FULL_BEFORE_STEP, disk.fill)
    with pytest.raises(OSError) as failure:
        train(cfg, backend, init_distributed(), RunUntil(max_steps=INTERACTIONS), before_step=filling)
    assert filling.steps == FULL_BEFORE_STEP  # it stopped at the first write that failed
    left = sorted(p.name for d in (cfg.checkpoint_dir, Path(cfg.weight_store_url)) for p in d.iterdir())
    disk.free()  # the operator freed space; the supervisor restarts the learner
    second = train(cfg, backend, init_distributed(), RunUntil(idle_timeout_s=1.0))
    return Lives(failure.value, left, cfg, backend, [i.interaction_id for i in traffic], second)


def _assert_trained_exactly_once(lives: Lives) -> None:
    """The second life went on from step 2's checkpoint, the last the first life committed."""
    counts = Counter(iid for _, iid in read_ledger(lives.cfg.checkpoint_dir))
    assert sorted(counts) == sorted(lives.ids)
    assert [iid for iid, n in counts.items() if n != 1] == []
    assert Checkpointer(lives.cfg.checkpoint_dir).load_latest().state.step == INTERACTIONS // PER_STEP
    assert lives.second.steps == INTERACTIONS // PER_STEP - (FULL_BEFORE_STEP - 1)


def _notices(backend: InMemoryBackend, cfg) -> list[WeightsNotice]:
    consumer = backend.consumer([cfg.kafka.topics.weights])
    found = [decode(m.value, WeightsNotice) for m in consumer.poll(timeout_s=0.1, max_records=1000)]
    consumer.close()
    return found


class _RefusingFile:
    """A file on a full disk: the first half of a write lands, the rest is refused as FileIO
    refuses it (ENOSPC, no file named)."""

    def __init__(self, fh) -> None:
        self.fh = fh

    def write(self, data: bytes) -> int:
        self.fh.write(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.fh.close()


class _FillingFs:
    """The store's local file system, whose files opened for writing refuse their bytes while
    the disk is full."""

    def __init__(self, fs, disk: Disk) -> None:
        self.fs, self.disk = fs, disk

    def __getattr__(self, name):
        return getattr(self.fs, name)

    def open(self, path, mode="rb", **kwargs):
        fh = self.fs.open(path, mode, **kwargs)
        return _RefusingFile(fh) if self.disk.full and "w" in mode else fh


def test_a_full_weight_store_stops_the_learner_naming_the_file_and_announces_nothing(
        tmp_path, tiny_model_dir, monkeypatch):
    disk = Disk()

    def open_store(url: str) -> FileWeightStore:
        store = FileWeightStore(url)
        store.fs = _FillingFs(store.fs, disk)
        return store

    monkeypatch.setattr(trainer.rank_zero, "open_weight_store", open_store)
    lives = _fail_then_restart(tmp_path, tiny_model_dir, disk)

    weights = Path(lives.cfg.weight_store_url)
    assert lives.error.errno == errno.ENOSPC
    assert Path(lives.error.filename).parent == weights and Path(lives.error.filename).name.startswith("v00000003.")
    assert [name for name in lives.left if name.startswith("v")] == ["v00000001.safetensors", "v00000002.safetensors"]
    notices = _notices(lives.backend, lives.cfg)
    assert [(n.version, n.step) for n in notices][:2] == [(1, 1), (2, 2)]
    assert [n.step for n in notices].count(FULL_BEFORE_STEP) == 1  # the second life's, none for the unwritten v3
    store = FileWeightStore(str(weights))
    kept = [n for n in notices if n.version in store.versions()]
    assert kept
    for notice in kept:  # raises on a partial or missing file
        store.load(notice.location, notice.checksum)
    _assert_trained_exactly_once(lives)


def test_a_full_checkpoint_disk_stops_the_learner_naming_the_file_and_leaves_no_partial_checkpoint(
        tmp_path, tiny_model_dir, monkeypatch):
    disk = Disk()
    save_file = trainer.checkpoint.save_file

    def filling_save_file(tensors, filename):
        if disk.full and filename.endswith("optim.safetensors"):  # the models' files fitted, this one not
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        save_file(tensors, filename)

    monkeypatch.setattr(trainer.checkpoint, "save_file", filling_save_file)
    lives = _fail_then_restart(tmp_path, tiny_model_dir, disk, **{"trainer.checkpoint_in_background": False})

    assert lives.error.errno == errno.ENOSPC and Path(lives.error.filename).name == "optim.safetensors"
    assert Path(lives.error.filename).parent.parent == lives.cfg.checkpoint_dir
    # before the restart (which removes leftovers too): no scratch directory holding the models' files
    assert [name for name in lives.left if name.startswith(".tmp-")] == []
    assert [name for name in lives.left if name.startswith("step-")] == ["step-00000001", "step-00000002"]
    _assert_trained_exactly_once(lives)


class LedgerDisk(Disk):
    """Full while the ledger's next segment is a link to /dev/full, whose writes the kernel refuses
    with ENOSPC (not a file: the ledger does not list it as a segment)."""

    def __init__(self, segment: Path) -> None:
        super().__init__()
        self.segment = segment

    def fill(self) -> None:
        self.segment.symlink_to("/dev/full")

    def free(self) -> None:
        self.segment.unlink()


def test_a_full_ledger_disk_stops_the_learner_naming_the_segment(tmp_path, tiny_model_dir):
    ledger = tmp_path / "checkpoints" / "ledger"
    ledger.mkdir(parents=True)
    segment = ledger / f"{FULL_BEFORE_STEP:08d}.jsonl"  # a segment per checkpoint: step 3's is next
    lives = _fail_then_restart(tmp_path, tiny_model_dir, LedgerDisk(segment),
                               **{"trainer.checkpoint_dir": str(tmp_path / "checkpoints"),
                                  "trainer.ledger_segment_bytes": 1, "trainer.checkpoint_in_background": False})

    assert lives.error.errno == errno.ENOSPC and Path(lives.error.filename) == segment
    _assert_trained_exactly_once(lives)


@pytest.mark.parametrize("code, said", [(errno.ENOSPC, "learner stops: no room to write"),
                                         (errno.EIO, "learner stops: a disk failed a write")])
def test_learn_says_in_its_own_log_that_it_stops_on_a_full_disk(tmp_path, monkeypatch, caplog, code, said):
    """ENOSPC, and EIO: MLflow's SQLite store's "disk I/O error" (a full quota reads so) as the tracker raises it."""
    import logging
    import signal

    import trainer.learner

    full = OSError(code, os.strerror(code), str(tmp_path / "weights" / "v00000003.safetensors"))

    def train_on_a_full_disk(*args, **kwargs):
        raise full

    monkeypatch.setattr(trainer.learner, "train", train_on_a_full_disk)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the test runner keeps its own handlers
    cfg = AppConfig(paths={"data_dir": str(tmp_path)})
    with caplog.at_level(logging.ERROR, logger="trainer.learner"), pytest.raises(OSError) as raised:
        trainer.learner.run_learner(cfg)
    assert raised.value is full  # said, and still raised: the command prints it and exits 1
    lines = [r.getMessage() for r in caplog.records if r.name == "trainer.learner"]
    assert len(lines) == 1 and lines[0].startswith(said) and full.filename in lines[0]
