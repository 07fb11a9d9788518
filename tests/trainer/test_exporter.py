"""The learner's Prometheus metrics: the exporter over real HTTP, and the learner loop serving it."""

from __future__ import annotations

import math
import threading
import time
import urllib.request

import pytest
from mlflow import MlflowClient
from prometheus_client.parser import text_string_to_metric_families

from online_sao.config import ConfigError
from online_sao.modeling import load_policy
from streams.memory import InMemoryBackend
from tests.fixtures.models import tiny_config
from tests.trainer.test_learner_memory import _registry_rounds
from tests.trainer.traffic import produce, sample_traffic
from trainer.distributed import init_distributed
from trainer.exporter import LearnerExporter
from trainer.feed import Feed, KeepingUp
from trainer import learner
from trainer.learner import RunUntil, train


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_exporter_serves_the_newest_step_and_decision(free_port):
    exporter = LearnerExporter("127.0.0.1", free_port)
    try:
        assert exporter.port == free_port
        exporter.step(7, 9, 0.25, {"mean_length": 12.5, "kl": math.nan}, {"dead_letters": 3.0, "rollbacks": 1.0})
        exporter.decision({"repetition": 0.6, "score_quality": 0.3}, ["repetition"])
        found = _scrape(free_port)
        assert found[("sao_learner_step", ())] == 7 and found[("sao_learner_policy_version", ())] == 9
        assert found[("sao_learner_reward_mean", ())] == 0.25
        assert found[("sao_learner_monitor", (("monitor", "mean_length"), ("scope", "window")))] == 12.5
        assert ("sao_learner_monitor", (("monitor", "kl"), ("scope", "window"))) not in found  # NaN: not measured
        assert found[("sao_learner_monitor", (("monitor", "repetition"), ("scope", "candidate")))] == 0.6
        assert found[("sao_learner_monitor_tripped", (("monitor", "repetition"),))] == 1.0
        assert found[("sao_learner_monitor_tripped", (("monitor", "score_quality"),))] == 0.0
        assert found[("sao_learner_count", (("name", "dead_letters"),))] == 3.0
        assert not any(name.startswith(("sao_learner_unread", "sao_learner_join", "sao_learner_data_age"))
                       for name, _ in found)  # no step has said yet
        exporter.keeping_up(KeepingUp(unread_interactions=12, unread_rewards=4, waiting=6, ready=2,
                                      data_age_mean_s=1.25, data_age_max_s=math.nan))
        kept = _scrape(free_port)
        assert kept[("sao_learner_unread_records", (("topic", "interactions"),))] == 12
        assert kept[("sao_learner_unread_records", (("topic", "rewards"),))] == 4
        assert kept[("sao_learner_join_records", (("state", "waiting"),))] == 6
        assert kept[("sao_learner_join_records", (("state", "ready"),))] == 2
        assert kept[("sao_learner_data_age_seconds", (("stat", "mean"),))] == 1.25
        assert ("sao_learner_data_age_seconds", (("stat", "max"),)) not in kept  # NaN: not measured
        assert not any(name == "sao_learner_source_reward" for name, _ in kept)
        exporter.sources({"judge": (0.75, 4), 'a "quoted"\nsource': (-1.0, 1), "user": (math.nan, 0)})
        rated = _scrape(free_port)
        assert rated[("sao_learner_source_reward", (("source", "judge"), ("stat", "mean")))] == 0.75
        assert rated[("sao_learner_source_reward", (("source", "judge"), ("stat", "count")))] == 4
        assert rated[("sao_learner_source_reward", (("source", 'a "quoted"\nsource'), ("stat", "mean")))] == -1.0
        assert rated[("sao_learner_source_reward", (("source", "user"), ("stat", "count")))] == 0
        assert ("sao_learner_source_reward", (("source", "user"), ("stat", "mean"))) not in rated  # none yet
        exporter.step(8, 10, math.nan, {"mean_length": 11.0}, {})
        again = _scrape(free_port)
        assert again[("sao_learner_step", ())] == 8 and ("sao_learner_reward_mean", ()) not in again
    finally:
        exporter.close()
    with pytest.raises(OSError):
        _scrape(free_port)  # closed: nothing listens


def test_the_learner_serves_its_monitors_while_it_trains(tmp_path, tiny_model_dir, free_port):
    """The registry scenario of test_learner_memory.py (one version per step, the length monitor at 9):
    while train() runs, /metrics shows the window's monitors each step and the decision's."""
    cfg, backend = _registry_rounds(tmp_path, tiny_model_dir, **{"trainer.metrics_port": free_port})
    scrapes: list[dict] = []
    step2_seen = threading.Event()
    taken = []

    def before_step(rollouts):  # step 3 waits until a scrape has seen the end of step 2
        taken.append(len(rollouts))
        if len(taken) == 3:
            step2_seen.wait(timeout=30)
        return rollouts

    def watch() -> None:
        while not step2_seen.is_set():
            try:
                found = _scrape(free_port)
            except OSError:  # not listening yet
                time.sleep(0.02)
                continue
            scrapes.append(found)
            if found.get(("sao_learner_step", ()), 0) >= 2:
                step2_seen.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = train(cfg, backend, init_distributed(), RunUntil(max_steps=3), before_step=before_step)
    step2_seen.set()
    watcher.join(timeout=10)
    assert result.version == 4  # step 3's v3 rolled back: the champion's weights went out again as v4
    seen = next(s for s in scrapes if s.get(("sao_learner_step", ())) == 2)
    # after step 2 the window holds rounds 0 and 1 (6 tokens each): the whole-window length is 6
    assert seen[("sao_learner_monitor", (("monitor", "mean_length"), ("scope", "window")))] == pytest.approx(6.0)
    assert seen[("sao_learner_policy_version", ())] == 2
    # the first poll read all 16 rounds' records; two steps took 8 of the joined rollouts
    assert seen[("sao_learner_unread_records", (("topic", "interactions"),))] == 0
    assert seen[("sao_learner_join_records", (("state", "ready"),))] == 8
    assert seen[("sao_learner_data_age_seconds", (("stat", "max"),))] > 0
    # v1 was decided at v2's release (no champion): its monitors are the candidate's
    assert ("sao_learner_monitor", (("monitor", "mean_length"), ("scope", "candidate"))) in seen
    assert seen[("sao_learner_count", (("name", "rollbacks"),))] == 0.0
    # the reward join's counters too: the 16 rewards of the four rounds read, none late
    assert seen[("sao_learner_count", (("name", "join_rewards"),))] == 16.0
    assert seen[("sao_learner_count", (("name", "join_late_rewards"),))] == 0.0
    with pytest.raises(OSError):
        _scrape(free_port)  # train() closed it


class ScrapedAtEachRelease:
    """The exporter's lock, with a scrape right after each release by the thread that made it (the
    learner's): what Prometheus sees when it comes between two of the learner's updates."""

    def __init__(self, port: int) -> None:
        self._lock, self._port, self._owner = threading.Lock(), port, threading.get_ident()
        self.scrapes: list[dict] = []

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc) -> None:
        self._lock.release()
        if threading.get_ident() == self._owner:  # the server's own collect() passes through too
            self.scrapes.append(_scrape(self._port))


def test_a_scrape_between_the_learners_updates_never_shows_a_step_with_the_previous_steps_readings(
        tmp_path, tiny_model_dir, free_port, monkeypatch):
    """The end of a step sets the step and its feed readings (unread, join, data ages) and sources at
    once: set in three lock acquisitions, a scrape between them showed step N with step N-1's."""
    cfg, backend = _registry_rounds(tmp_path, tiny_model_dir, **{"trainer.metrics_port": free_port})
    locks: list[ScrapedAtEachRelease] = []
    readings: list[KeepingUp] = []
    init, keeping_up = LearnerExporter.__init__, Feed.keeping_up

    def instrumented(self, host, port):
        init(self, host, port)
        self._lock = ScrapedAtEachRelease(self.port)
        locks.append(self._lock)

    def recorded(self, trained, now):  # with rollouts: the reading of a step's end
        reading = keeping_up(self, trained, now)
        if trained:
            readings.append(reading)
        return reading

    monkeypatch.setattr(LearnerExporter, "__init__", instrumented)
    monkeypatch.setattr(Feed, "keeping_up", recorded)
    train(cfg, backend, init_distributed(), RunUntil(max_steps=3))
    [lock] = locks
    first_with_step: dict[int, dict] = {}
    for scrape in lock.scrapes:
        first_with_step.setdefault(int(scrape[("sao_learner_step", ())]), scrape)
    assert len(readings) == 3 and sorted(first_with_step) == [0, 1, 2, 3], sorted(first_with_step)
    for step, reading in enumerate(readings, start=1):
        seen = first_with_step[step]
        assert (seen.get(("sao_learner_data_age_seconds", (("stat", "max"),))),
                seen[("sao_learner_join_records", (("state", "ready"),))]) == \
            (reading.data_age_max_s, reading.ready), f"step {step}'s first scrape shows another step's readings"


def test_a_failing_value_pretraining_still_ends_the_run_and_frees_the_port(tmp_path, tiny_model_dir, free_port,
                                                                          monkeypatch):
    """Pre-training runs inside the loop's cleanup: its error propagates, and the MLflow run is marked
    FAILED and the metrics port closed, as for a failure in a step."""
    cfg, backend = _registry_rounds(tmp_path, tiny_model_dir, **{"trainer.metrics_port": free_port})

    def broken(*args, **kwargs):
        _scrape(free_port)  # the exporter is up by now (nothing trained yet)
        raise RuntimeError("logged rollouts unreadable")

    monkeypatch.setattr(learner, "pretrain_on_logged", broken)
    with pytest.raises(RuntimeError, match="unreadable"):
        train(cfg, backend, init_distributed(), RunUntil(max_steps=3), pretrain_critic=True)
    with pytest.raises(OSError):
        _scrape(free_port)
    client = MlflowClient(cfg.mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]


def test_a_metrics_port_in_use_is_a_config_error_naming_the_setting(free_port):
    first = LearnerExporter("127.0.0.1", free_port)
    try:
        with pytest.raises(ConfigError, match=rf"trainer.metrics_port {free_port} on trainer.metrics_host 127.0.0.1 "
                                              r"cannot be served: .*in use"):
            LearnerExporter("127.0.0.1", free_port)
    finally:
        first.close()


def test_between_steps_the_exporter_keeps_the_reward_mean_and_the_data_ages_of_the_last_step(free_port):
    exporter = LearnerExporter("127.0.0.1", free_port)
    try:
        exporter.position(5, 6, {"records_read": 40.0})  # as restored, before any step
        exporter.feed(KeepingUp(unread_interactions=3, unread_rewards=1, waiting=9, ready=0,
                                data_age_mean_s=math.nan, data_age_max_s=math.nan))
        opened = _scrape(free_port)
        assert opened[("sao_learner_step", ())] == 5 and opened[("sao_learner_policy_version", ())] == 6
        assert ("sao_learner_reward_mean", ()) not in opened
        assert opened[("sao_learner_count", (("name", "records_read"),))] == 40.0
        assert opened[("sao_learner_join_records", (("state", "waiting"),))] == 9
        assert not any(name == "sao_learner_data_age_seconds" for name, _ in opened)  # no step yet
        exporter.step(6, 7, 0.5, {}, {"records_read": 44.0})
        exporter.keeping_up(KeepingUp(0, 0, 5, 0, data_age_mean_s=2.0, data_age_max_s=3.0))
        exporter.position(6, 7, {"records_read": 60.0})
        exporter.feed(KeepingUp(2, 0, 21, 1, data_age_mean_s=math.nan, data_age_max_s=math.nan))
        later = _scrape(free_port)
        assert later[("sao_learner_reward_mean", ())] == 0.5  # the last step's
        assert later[("sao_learner_count", (("name", "records_read"),))] == 60.0
        assert later[("sao_learner_join_records", (("state", "waiting"),))] == 21
        assert later[("sao_learner_unread_records", (("topic", "interactions"),))] == 2
        assert later[("sao_learner_data_age_seconds", (("stat", "mean"),))] == 2.0
        assert later[("sao_learner_data_age_seconds", (("stat", "max"),))] == 3.0
    finally:
        exporter.close()


def _until_scraped(port: int, wanted, timeout_s: float = 60.0) -> dict:
    """The first scrape for which ``wanted(scrape)`` holds; the last one seen in the failure."""
    deadline, found = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        try:
            found = _scrape(port)
        except OSError:  # not listening yet
            found = {}
        if found and wanted(found):
            return found
        time.sleep(0.05)
    raise AssertionError(f"no scrape in {timeout_s:g} s showed it; the last: {found}")


def _waiting(found: dict) -> float | None:
    return found.get(("sao_learner_join_records", (("state", "waiting"),)))


def test_a_learner_that_does_not_step_shows_its_step_and_what_it_reads(tmp_path, tiny_model_dir, free_port,
                                                                       monkeypatch):
    """Rewards that do not come: the step stands still and ``waiting`` grows, on /metrics from the first
    pass of the loop (the ``LearnerStalled`` alert needs the step; "waiting growing with no ready" is
    what it tells to look for); a restarted learner shows its restored step before it reads anything."""
    cfg = tiny_config(tmp_path, **{"model.path": str(tiny_model_dir), "kafka.partitions": 2,
                                   "trainer.min_rollouts": 4, "trainer.max_rollouts_per_step": 4,
                                   "trainer.poll_timeout_s": 0.05, "mlflow.register_every": 100,
                                   "trainer.metrics_port": free_port})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    producer, base, topics = backend.producer(), load_policy(tiny_model_dir), cfg.kafka.topics

    def run(until: RunUntil) -> threading.Thread:
        thread = threading.Thread(target=train, args=(cfg, backend, init_distributed(), until), daemon=True)
        thread.start()
        return thread

    produce(producer, topics, sample_traffic(base, 20, prefix="a"), rewarded=False)
    first = RunUntil()
    thread = run(first)
    try:
        waiting = _until_scraped(free_port, lambda f: _waiting(f) == 20)
        assert waiting[("sao_learner_step", ())] == 0
        assert waiting[("sao_learner_count", (("name", "join_interactions"),))] == 20
        produce(producer, topics, sample_traffic(base, 4, prefix="b"), rewarded=True)
        _until_scraped(free_port, lambda f: f.get(("sao_learner_step", ())) == 1)
        produce(producer, topics, sample_traffic(base, 30, prefix="c"), rewarded=False)
        grown = _until_scraped(free_port, lambda f: _waiting(f) == 50)
        assert grown[("sao_learner_step", ())] == 1
        assert grown[("sao_learner_join_records", (("state", "ready"),))] == 0
        assert grown[("sao_learner_count", (("name", "join_interactions"),))] == 54
        version = grown[("sao_learner_policy_version", ())]
    finally:
        first.stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive()

    seen_at_start: list[dict] = []
    start = Feed.start

    def scraped_first(self, backend):  # the exporter is up, the loop not started: what it shows now
        seen_at_start.append(_scrape(free_port))
        start(self, backend)

    monkeypatch.setattr(Feed, "start", scraped_first)
    second = RunUntil(max_steps=1, idle_timeout_s=2.0)
    thread = run(second)
    thread.join(timeout=60)
    assert not thread.is_alive()
    restored = seen_at_start[0]
    assert restored[("sao_learner_step", ())] == 1 and restored[("sao_learner_policy_version", ())] == version
    # the counters of the checkpoint (step 1's): the 30 read after it are read again from its offsets
    assert restored[("sao_learner_count", (("name", "join_interactions"),))] == 24
