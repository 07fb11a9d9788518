"""Publishing policy versions: weight store + notice on the weights topic + pruning.

Order of a publish (rank 0): the full state dict is written atomically, with its
checksum, to the weight store; then a :class:`~online_sao.schemas.WeightsNotice`
is produced on the weights topic and flushed, so a notice never points at weights
that are not complete; then old versions are pruned, keeping the newest
``keep_versions`` and the pinned ones: the registry's candidate and champion as read at the last
registration point (a publish between asks MLflow nothing), what a decision or a roll-back may
need (older registered versions are in MLflow's artifacts, not the store). A rollback announces
an older, already stored version with ``action="rollback"``; serving obeys it even though the
version is older than the one it runs.

The registry's side of a release (gate, monitors, aliases): :mod:`trainer.releases`.
"""

from __future__ import annotations

import logging
import math
import threading

import torch

from online_sao.schemas import RecordError, WeightsNotice, decode
from online_sao.weights import WeightsRef, WeightStore
from streams.base import Producer, StreamBackend
from streams.broker_wait import until_broker_takes
from streams.records import publish
from streams.tail import iter_records_since

log = logging.getLogger(__name__)


class Publisher:
    """Rank 0's writer of weights and notices."""

    def __init__(self, store: WeightStore, producer: Producer, topic: str, model_name: str,
                 keep_versions: int, protected: set[int] | None = None, stop: threading.Event | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
        """What serving runs (``model.dtype``): the float32 weights the learner trains are published
        cast to it (None: as they are)."""
        self.stop = stop
        """Set when the learner is asked to stop: an announcement then stops waiting for the broker."""
        self.store = store
        self.producer = producer
        self.topic = topic
        self.model_name = model_name
        self.keep_versions = keep_versions
        self.protected: set[int] = set(protected or ())

    def publish(self, state: dict[str, torch.Tensor], version: int, step: int,
                metrics: dict[str, float] | None = None) -> WeightsRef:
        if self.dtype is not None:
            state = {name: tensor.to(self.dtype) if tensor.is_floating_point() else tensor
                     for name, tensor in state.items()}
        ref = self.store.save(version, state)
        self._announce(ref, "publish", step, metrics)
        self.store.prune(self.keep_versions, protected=self.protected)
        return ref

    def rollback(self, ref: WeightsRef, step: int) -> None:
        """Tell serving to return to ``ref`` (a stored, older version)."""
        self._announce(ref, "rollback", step, None)

    def announce_champion(self, ref: WeightsRef, step: int) -> None:
        """Tell serving's canary to answer with ``ref``, the registry's new champion."""
        self._announce(ref, "champion", step, None)

    def pin(self, versions: set[int]) -> None:
        """Keep ``versions`` besides the newest ``keep_versions`` (they replace the earlier pins: the
        registry's candidate and champion) and prune the rest now. Pinning every version ever
        registered grew the store by one model per registration, without end (a copy in GPU memory
        each on ``cuda-ipc://``)."""
        self.protected = set(versions)
        self.store.prune(self.keep_versions, protected=self.protected)

    def _announce(self, ref: WeightsRef, action: str, step: int, metrics: dict[str, float] | None) -> None:
        finite = {k: float(v) for k, v in (metrics or {}).items() if math.isfinite(v)}
        notice = WeightsNotice(action=action, version=ref.version, location=ref.location, checksum=ref.checksum,
                               model=self.model_name, step=step, metrics=finite)
        def send() -> None:  # repeated while the broker is down: serving ignores a version it already runs
            publish(self.producer, self.topic, notice)
            self.producer.flush()

        until_broker_takes(send, f"announcing v{ref.version}", self.stop)


ANNOUNCED_READ_TIMEOUT_S = 30.0
"""Longest wait for the next record while reading the weights topic back at start (it is
compacted: a few records per model)."""


def newest_announced_version(backend: StreamBackend, topic: str, model_name: str) -> int:
    """The highest version the weights topic announced for ``model_name`` (0: none). A learner
    that lost its checkpoints and its weight store numbers its versions past it: reusing a number
    left running replicas on the old weights under the new number's name, and a restarted
    replica on the base model (it skipped the new versions as not newer than the old notices)."""
    newest = 0
    for message in iter_records_since(backend, [topic], 0, ANNOUNCED_READ_TIMEOUT_S):
        try:
            notice = decode(message.value)
        except RecordError:
            continue  # not ours to judge: serving's follower reports it
        if isinstance(notice, WeightsNotice) and notice.model == model_name:
            newest = max(newest, notice.version)
    return newest
