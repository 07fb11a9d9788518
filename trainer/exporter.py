"""Rank 0's Prometheus metrics (``trainer.metrics_port``): what only the learner knows.

Serving's ``/metrics`` shows what every replica answers now (length and repetition of its own
recent answers). The registry's monitors that need the learner (the dead-letter share and the
scores that rewards carry over the learner's window; the KL from the reference over a candidate's
answers) and the learner's own counters are served here, on a port of rank 0, for the same Prometheus:

- ``sao_learner_monitor{monitor, scope="window"}``: each monitor over the whole recent window,
  every step (the ``monitor_*`` MLflow metrics; no ``kl``: it is measured at decisions only);
- ``sao_learner_monitor{monitor, scope="candidate"}``: each monitor over the last decided
  candidate's answers, at its decision (``registry_monitor_*``, ``kl`` with ``deploy.monitor_max_kl``),
  and ``sao_learner_monitor_tripped{monitor}`` 1 for those over their threshold then;
- ``sao_learner_step``, ``sao_learner_policy_version``, ``sao_learner_reward_mean`` and
  ``sao_learner_count{name}`` (dead letters, roll-backs, drift restarts, ...: ``COUNTERS``; and
  the reward join's, ``join_*``: rewards read, joined, late, ignored, ...: ``JoinCounters``). The
  step, version and counters are there from the start, as restored (:meth:`LearnerExporter.position`),
  and follow every pass of the loop, not only steps: a learner that never steps still shows a step
  that does not change (the ``LearnerStalled`` alert) and counts what it reads; the reward mean is
  the last step's.
- ``sao_learner_events_total{name}``: the same counters as Prometheus counters, what each grew by
  in this process (:class:`EventCounts`). ``sao_learner_count`` are lifetime totals as the last
  checkpoint had them, so they go *down* at a restart (what was counted after that checkpoint is
  lost, and counted again as the records are read again); ``increase()`` takes a drop for a counter
  reset and adds the whole total before it. These start at 0 in each process: a restart is a reset
  that ``increase()`` and ``rate()`` handle, and alerts and panels read them.
- whether the learner keeps up (:class:`~trainer.feed.KeepingUp`), every pass of the loop from its
  first (:meth:`LearnerExporter.feed`):
  ``sao_learner_unread_records{topic="interactions|rewards"}`` (on Kafka, not read yet; see
  :meth:`trainer.feed.Feed.unread`),
  ``sao_learner_join_records{state="waiting|ready"}`` (read, waiting for a reward or for a step)
  and, every step, ``sao_learner_data_age_seconds{stat="mean|max"}`` (from serving's answer to the
  end of the cycle that trained on it);
- ``sao_learner_source_reward{source, stat="mean|count"}``: each reward source's newest rewards on
  the interactions trained (trainer/source_rewards.py), every step.

A value the learner has not measured yet (NaN) is left out rather than exported as NaN.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import replace

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from online_sao.config import ConfigError
from trainer.feed import ENDS_EVERY_S, KeepingUp


class EventCounts:
    """What each of the learner's totals grew by since this process first reported it: the first
    total reported is the baseline (as restored), so every name starts at 0, and only rises count.
    A total that falls (a counter restored in-process) is not subtracted: a Prometheus counter never
    decreases, and the next rises count from the lower total."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._grown: dict[str, float] = {}

    def observe(self, totals: Mapping[str, float]) -> None:
        for name, total in totals.items():
            last = self._last.get(name)
            if last is None:
                self._grown[name] = 0.0
            elif total > last:
                self._grown[name] += total - last
            self._last[name] = total

    def grown(self) -> dict[str, float]:
        return dict(self._grown)


class LearnerExporter(Collector):
    """The values of the newest step and decision, and of the loop's newest pass, served over HTTP
    until :meth:`close`. Set from the learner's thread, read from the server's: under one lock."""

    def __init__(self, host: str, port: int) -> None:
        self._lock = threading.Lock()
        self._window: dict[str, float] = {}
        self._candidate: dict[str, float] = {}
        self._tripped: dict[str, float] = {}
        self._learner: dict[str, float] = {}
        self._counts: dict[str, float] = {}
        self._events = EventCounts()
        self._keeping_up: KeepingUp | None = None
        self._sources: dict[str, tuple[float, int]] = {}
        registry = CollectorRegistry()
        registry.register(self)
        try:
            self._server, self._thread = start_http_server(port, host, registry)
        except OSError as exc:  # the address in use, or not this machine's: the operator's setting to change
            raise ConfigError(f"trainer.metrics_port {port} on trainer.metrics_host {host} cannot be served: "
                              f"{exc.strerror or exc}") from None

    @property
    def port(self) -> int:
        return self._server.server_port

    def end_of_step(self, step: int, version: int, reward_mean: float, window_monitors: Mapping[str, float],
                    counts: Mapping[str, float], keeping_up: KeepingUp,
                    sources: Mapping[str, tuple[float, int]]) -> None:
        """Every reading of a step's end (:meth:`step`, :meth:`keeping_up`, :meth:`sources`) under one
        lock: set one by one, a scrape between them showed step N with step N-1's feed and sources."""
        with self._lock:
            self._set_step(step, version, reward_mean, window_monitors, counts)
            self._keeping_up = keeping_up
            self._sources = dict(sources)

    def step(self, step: int, version: int, reward_mean: float, window_monitors: Mapping[str, float],
             counts: Mapping[str, float]) -> None:
        """The values at the end of a learner step."""
        with self._lock:
            self._set_step(step, version, reward_mean, window_monitors, counts)

    def _set_step(self, step: int, version: int, reward_mean: float, window_monitors: Mapping[str, float],
                  counts: Mapping[str, float]) -> None:
        """Under the lock: a step's own values."""
        self._learner = {"step": float(step), "policy_version": float(version), "reward_mean": reward_mean}
        self._window = dict(window_monitors)
        self._set_counts(counts)

    def position(self, step: int, version: int, counts: Mapping[str, float]) -> None:
        """The step, version and counters now, between steps (at the start: as restored); the reward
        mean stays the last step's."""
        with self._lock:
            self._learner = {**self._learner, "step": float(step), "policy_version": float(version)}
            self._set_counts(counts)

    def _set_counts(self, counts: Mapping[str, float]) -> None:
        """Under the lock: the totals, and what they grew by since the first."""
        self._counts = dict(counts)
        self._events.observe(counts)

    def keeping_up(self, reading: KeepingUp) -> None:
        """Whether the learner kept up, at the end of a step."""
        with self._lock:
            self._keeping_up = reading

    def feed(self, reading: KeepingUp) -> None:
        """What the learner has not read and what it holds, between steps; the data ages stay the
        last step's (none before the first: ``reading``'s, not measured)."""
        with self._lock:
            last = self._keeping_up
            self._keeping_up = reading if last is None else replace(
                reading, data_age_mean_s=last.data_age_mean_s, data_age_max_s=last.data_age_max_s)

    def sources(self, stats: Mapping[str, tuple[float, int]]) -> None:
        """Each reward source's recent (mean, count) (trainer/source_rewards.py), at the end of a step."""
        with self._lock:
            self._sources = dict(stats)

    def decision(self, monitors: Mapping[str, float], tripped: list[str]) -> None:
        """The monitors read at a registry decision, and those over their thresholds."""
        with self._lock:
            self._candidate = dict(monitors)
            self._tripped = {name: float(name in tripped) for name in monitors}

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            learner, window, candidate = dict(self._learner), dict(self._window), dict(self._candidate)
            tripped, counts, keeping_up = dict(self._tripped), dict(self._counts), self._keeping_up
            sources, events = dict(self._sources), self._events.grown()
        for name, value in learner.items():
            if math.isfinite(value):
                yield GaugeMetricFamily(f"sao_learner_{name}", f"the learner's {name.replace('_', ' ')}",
                                        value=value)
        monitor = GaugeMetricFamily("sao_learner_monitor", "registry monitors (scope: the learner's whole "
                                    "window each step, or the last decided candidate's answers)",
                                    labels=["monitor", "scope"])
        for scope, values in (("window", window), ("candidate", candidate)):
            for name, value in sorted(values.items()):
                if math.isfinite(value):
                    monitor.add_metric([name, scope], value)
        yield monitor
        flags = GaugeMetricFamily("sao_learner_monitor_tripped", "1 if the monitor tripped at the last decision",
                                  labels=["monitor"])
        for name, value in sorted(tripped.items()):
            flags.add_metric([name], value)
        yield flags
        count = GaugeMetricFamily("sao_learner_count", "the learner's counters, lifetime totals as of the last "
                                  "checkpoint (they go down at a restart: use sao_learner_events_total in "
                                  "increase() and rate())", labels=["name"])
        for name, value in sorted(counts.items()):
            count.add_metric([name], value)
        yield count
        event = CounterMetricFamily("sao_learner_events", "what each of the learner's counters grew by in this "
                                    "process (0 at its start)", labels=["name"])
        for name, value in sorted(events.items()):
            event.add_metric([name], value)
        yield event
        if keeping_up is not None:
            yield from keeping_up_families(keeping_up)
        source = GaugeMetricFamily("sao_learner_source_reward", "each reward source's newest rewards on the "
                                   "interactions trained (deploy.segments_window of them): their mean and count",
                                   labels=["source", "stat"])
        for name, (mean, count) in sorted(sources.items()):
            if math.isfinite(mean):
                source.add_metric([name, "mean"], mean)
            source.add_metric([name, "count"], float(count))
        yield source

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def keeping_up_families(reading: KeepingUp) -> Iterator[GaugeMetricFamily]:
    """The families of :class:`KeepingUp` (a data age not measured, NaN, is left out)."""
    unread = GaugeMetricFamily("sao_learner_unread_records", "records on Kafka the learner has not read "
                               f"(ends read at most {ENDS_EVERY_S:g} s before)", labels=["topic"])
    unread.add_metric(["interactions"], reading.unread_interactions)
    unread.add_metric(["rewards"], reading.unread_rewards)
    yield unread
    join = GaugeMetricFamily("sao_learner_join_records", "interactions read and waiting for their reward, "
                             "or joined and waiting for a step", labels=["state"])
    join.add_metric(["waiting"], reading.waiting)
    join.add_metric(["ready"], reading.ready)
    yield join
    age = GaugeMetricFamily("sao_learner_data_age_seconds", "seconds from serving's answer to the end of the "
                            "learner cycle that trained on it, over the last cycle", labels=["stat"])
    for stat, value in (("mean", reading.data_age_mean_s), ("max", reading.data_age_max_s)):
        if math.isfinite(value):
            age.add_metric([stat], value)
    yield age
