"""Publishing policy versions: weight store + notice on the weights topic + pruning.

Order of a publish (rank 0): the full state dict is written atomically, with its
checksum, to the weight store; then a :class:`~online_sao.schemas.WeightsNotice`
is produced on the weights topic and flushed, so a notice never points at weights
that are not complete; then old versions are pruned, keeping the newest
``keep_versions`` and every protected (registered) version. A rollback announces
an older, already stored version with ``action="rollback"``; serving obeys it
even though the version is older than the one it runs.

Registry cadence (:class:`Releases`): every ``mlflow.register_every``
versions, the candidate registered last time is decided on first, by the reward
of rollouts sampled by it or newer versions (:class:`CandidateWatch`):
promoted, or rolled back (serving and the learner return to the champion).
Unless it was rolled back, the new version is then registered as the next
candidate. A decision stays pending while no rollout of the candidate has been
trained on; a newer candidate then supersedes it.
"""

from __future__ import annotations

import logging
import math
import threading

import torch
from torch import nn

from online_sao.batch import Rollout
from online_sao.schemas import WeightsNotice
from online_sao.weights import WeightsRef, WeightStore
from streams.base import Producer
from streams.records import publish
from trainer.broker_wait import until_broker_takes
from trainer.distributed import DistContext, broadcast_json, full_state_dict, load_full_state_dict
from trainer.tracking import RunTracker

log = logging.getLogger(__name__)


class Publisher:
    """Rank 0's writer of weights and notices."""

    def __init__(self, store: WeightStore, producer: Producer, topic: str, model_name: str,
                 keep_versions: int, protected: set[int] | None = None, stop: threading.Event | None = None) -> None:
        self.stop = stop
        """Set when the learner is asked to stop: an announcement then stops waiting for the broker."""
        self.store = store
        self.producer = producer
        self.topic = topic
        self.model_name = model_name
        self.keep_versions = keep_versions
        self.protected: set[int] = set(protected or ())
        self.refs: dict[int, WeightsRef] = {}
        """What this process published (the notice of a later rollback needs the checksum)."""

    def publish(self, state: dict[str, torch.Tensor], version: int, step: int,
                metrics: dict[str, float] | None = None) -> WeightsRef:
        ref = self.store.save(version, state)
        self.refs[version] = ref
        self._announce(ref, "publish", step, metrics)
        self.store.prune(self.keep_versions, protected=self.protected)
        return ref

    def rollback(self, ref: WeightsRef, step: int) -> None:
        """Tell serving to return to ``ref`` (a stored, older version)."""
        self._announce(ref, "rollback", step, None)

    def protect(self, version: int) -> None:
        """Never prune ``version`` (it is registered in the model registry)."""
        self.protected.add(version)

    def _announce(self, ref: WeightsRef, action: str, step: int, metrics: dict[str, float] | None) -> None:
        finite = {k: float(v) for k, v in (metrics or {}).items() if math.isfinite(v)}
        notice = WeightsNotice(action=action, version=ref.version, location=ref.location, checksum=ref.checksum,
                               model=self.model_name, step=step, metrics=finite)
        def send() -> None:  # repeated while the broker is down: serving ignores a version it already runs
            publish(self.producer, self.topic, notice)
            self.producer.flush()

        until_broker_takes(send, f"announcing v{ref.version}", self.stop)


class Releases:
    """Rank 0's side of a new policy version: :class:`Publisher` puts it out; every
    ``register_every`` versions the registry decides on the candidate first, then
    (unless it rolled back) registers this version as the next candidate."""

    def __init__(self, publisher: Publisher, tracker: RunTracker, watch: CandidateWatch, register_every: int) -> None:
        self.publisher = publisher
        self.tracker = tracker
        self.watch = watch
        self.register_every = register_every

    def release(self, state: dict[str, torch.Tensor], version: int, step: int,
                metrics: dict[str, float]) -> WeightsRef | None:
        """Publish ``state`` as ``version``; the champion's weights when the registry rolled back to them."""
        ref = self.publisher.publish(state, version, step, metrics)
        if version % self.register_every != 0:
            return None
        watch = self.watch
        decision = self.tracker.evaluate_candidate(watch.reward) if watch.version is not None else "pending"
        if decision == "rolled_back":
            champion_version, champion_ref = self.tracker.champion()
            log.warning("candidate v%s (reward %.4f) rolled back to champion v%d",
                        watch.version, watch.reward, champion_version)
            self.publisher.rollback(champion_ref, step)
            watch.start(None)
            return champion_ref
        self.tracker.register(ref, watch.reward)
        self.publisher.protect(version)
        watch.start(version)
        return None


def release_policy(policy: nn.Module, ctx: DistContext, releases: Releases | None, version: int, step: int,
                   metrics: dict[str, float]) -> bool:
    """Gather the full policy on rank 0 and release it there (see :class:`Releases`). Collective:
    every rank calls it; ``releases`` is None on ranks other than 0. After a rollback every rank
    trains on from the champion's weights. Returns whether it rolled back (on every rank)."""
    state = full_state_dict(policy, ctx)
    rollback_to = None
    if ctx.is_main:
        if releases is None:
            raise ValueError("rank 0 needs its releases")
        champion = releases.release(state, version, step, metrics)
        rollback_to = None if champion is None else [champion.location, champion.checksum]
    rollback_to = broadcast_json(rollback_to, ctx)
    if rollback_to is not None:
        load_full_state_dict(policy, releases.publisher.store.load(*rollback_to) if ctx.is_main else None, ctx)
    return rollback_to is not None


class CandidateWatch:
    """The reward of the registered candidate, measured on rollouts it (or a newer
    version) sampled: rollouts of older versions say nothing about it. NaN until
    such a rollout was trained on (the registry then leaves the decision pending)."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.reward_sum = 0.0
        self.count = 0

    def start(self, version: int | None) -> None:
        """Watch a newly registered candidate (None: no candidate awaits a decision)."""
        self.version, self.reward_sum, self.count = version, 0.0, 0

    def observe(self, rollouts: list[Rollout]) -> None:
        if self.version is None:
            return
        for rollout in rollouts:
            if max(rollout.versions, default=0) >= self.version:
                self.reward_sum += rollout.total_reward
                self.count += 1

    @property
    def reward(self) -> float:
        return self.reward_sum / self.count if self.count else math.nan

    def state_dict(self) -> dict[str, float | int | None]:
        return {"version": self.version, "reward_sum": self.reward_sum, "count": self.count}

    def load_state_dict(self, state: dict[str, float | int | None]) -> None:
        self.version, self.reward_sum, self.count = state["version"], state["reward_sum"], state["count"]
