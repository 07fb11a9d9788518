"""The registry when a decision is cut short or raced (real MLflow registry, real weight store): a
roll-back stopped half-way is decided again after a restart, a decision lands on the version the
gate scored, a record written in part is read as none."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import requests
import torch
from mlflow.exceptions import MlflowException

import trainer.tracking as tracking

from online_sao.gate_record import ValueRecord
from online_sao.schemas import WeightsNotice, decode
from serving.weights_hold import plan
from tests.trainer.test_deploy import (STYLE_A, FixedKL, ScriptedScorer, _registry_parts, _rollout,  # noqa: F401
                                       registry_cfg)
from tests.trainer.test_tracking import _client, _publish, cfg, empty_store, store  # noqa: F401  (fixtures)
from trainer.deploy import OffPolicyGate
from trainer.mlflow_store import TrackingUnavailable
from trainer.publisher import newest_announced_version
from trainer.releases import ReleaseOutcome, Releases
from trainer.tracking import RunTracker


class Stopped(Exception):
    """The learner's stop request, cutting a wait for the broker or MLflow short."""


def _kl_releases(config, publisher, tracker, window):
    """The KL monitor at 0.5: candidate v2 (KL 0.1) promoted when v4 is published, candidate v4 (KL 0.9)
    rolled back to v2 when v6 is."""
    gate = OffPolicyGate(ScriptedScorer(dict.fromkeys(range(1, 7), STYLE_A)), config.deploy)
    return Releases(publisher, tracker, gate, window, config.deploy, 2, reference=FixedKL({2: 0.1, 4: 0.9}))


def _serving_follows(notices) -> WeightsNotice | None:
    """The notice a replica reading the topic's learner notices one by one ends on."""
    current, followed = 0, None
    for notice in notices:
        if notice.action in ("publish", "rollback") and plan([notice], current):
            current, followed = notice.version, notice
    return followed


@pytest.mark.parametrize("stopped_in", ["recording", "announcing"])
def test_a_rollback_cut_short_is_carried_out_or_decided_again_after_a_restart(registry_cfg, stopped_in, monkeypatch):
    """The learner is stopped inside the v4 roll-back, decided when v6 is published: while recording it
    (MLflow down), or after recording it, while announcing it (broker down). Recorded, the restart
    carries it out before it publishes anything; not recorded, nothing was announced either, and the
    next registration point decides again. Before, the notice went out first: stopped before the
    record, the restart numbered its next version (v7) past the notice, serving followed it back onto
    the rejected policy's line and nothing decided again until v8."""
    config = registry_cfg.model_copy(update={"deploy": registry_cfg.deploy.model_copy(update={"monitor_max_kl": 0.5})})
    backend, publisher, tracker, window = _registry_parts(config)
    releases = _kl_releases(config, publisher, tracker, window)
    client, name = _client(config), config.mlflow.registered_model

    def release(releases, version):
        outcome = releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0))
        window.observe([_rollout(f"v{version}-{i}", [5, STYLE_A], version, 1.0, logprob=math.log(0.9) / 2)
                        for i in range(40)])
        return outcome

    def on_topic():
        return [decode(m.value) for m in backend.consumer([config.kafka.topics.weights]).poll(0.1, 1000)]

    for version in range(1, 6):
        release(releases, version)
    def stop(*args, **kwargs):
        raise Stopped() if stopped_in == "announcing" else TrackingUnavailable("stopped")

    stopped = (publisher, "rollback") if stopped_in == "announcing" else (tracker.registry, "record_decision")
    monkeypatch.setattr(*stopped, stop)
    with pytest.raises(Stopped if stopped_in == "announcing" else TrackingUnavailable):
        release(releases, 6)
    monkeypatch.undo()  # the restarted learner: the broker and MLflow answer again
    assert [n.version for n in on_topic() if n.action == "rollback"] == []  # nothing announced unrecorded

    # the restart, as trainer/startup.py resume() numbers it: past every version stored or announced
    restarted = _kl_releases(config, publisher, RunTracker(config, run_id=tracker.run_id), window)
    following = max([*publisher.store.versions(),
                     newest_announced_version(backend, config.kafka.topics.weights, publisher.model_name)]) + 1
    assert following == 7
    due = restarted.rollback_due()  # what trainer.learner.train carries out before its first publish
    if stopped_in == "recording":
        registry = tracker.registry
        assert due is None and registry.candidate()[0] == 4 and registry.champion()[0] == 2  # nothing moved
        assert "decision" not in client.get_model_version_by_alias(name, "candidate").tags
        assert release(restarted, 7) == ReleaseOutcome()  # not a registration point
        outcome = release(restarted, 8)  # decided again
        assert outcome.rolled_back_to is not None and outcome.rolled_back_to.version == 2
    else:
        assert due is not None and due.version == 2
        champion = publisher.store.load(due.location, due.checksum)
        publisher.publish(champion, following, following)  # trainer.learner.roll_back: the champion again as v7
        restarted.rollback_carried_out(following)
        followed = _serving_follows(on_topic())
        assert followed.version == following and followed.checksum == due.checksum
    assert tracker.registry.candidate()[0] == 2 and tracker.registry.champion()[0] == 2
    by_policy = {int(v.tags["policy_version"]): v.tags for v in client.search_model_versions(f"name = '{name}'")}
    assert by_policy[4]["decision"] == "rolled_back" and by_policy[4]["monitor.tripped"] == "kl"
    assert [n.version for n in on_topic() if n.action == "rollback"] == ([2] if stopped_in == "recording" else [])


def test_a_decision_lands_on_the_version_decided_not_on_a_later_registration(cfg, store):
    """A second writer on the same registered model (an old pod overlapping a new one) registers while
    the first one's gate is scoring: the verdict goes onto the version that was scored, and the other
    registration stays the undecided candidate, for a promotion and for a roll-back alike."""
    ours, other = RunTracker(cfg), RunTracker(cfg)
    first, second, third = _publish(store, 1), _publish(store, 2), _publish(store, 3)
    ours.registry.register(first, 0.0)
    ours.registry.record_decision("promoted", {}, first)
    scored = ours.registry.register(second, 0.0)
    raced = other.registry.register(_publish(store, 99), 0.0)  # lands while v2 is being scored
    ours.registry.record_decision("promoted", {"gate.window_versions": "2-3"}, second)
    client, name = _client(cfg), cfg.mlflow.registered_model
    assert client.get_model_version(name, scored).tags["gate.window_versions"] == "2-3"
    assert client.get_model_version(name, scored).tags["decision"] == "promoted"
    assert "decision" not in client.get_model_version(name, raced).tags
    assert ours.registry.champion()[0] == 2 and ours.registry.candidate()[0] == 99

    rejected = ours.registry.register(third, 0.0)
    raced_again = other.registry.register(_publish(store, 100), 0.0)
    ours.registry.record_decision("rolled_back", {"gate.decision": "rolled_back"}, third)
    assert client.get_model_version(name, rejected).tags["decision"] == "rolled_back"
    assert "decision" not in client.get_model_version(name, raced_again).tags
    assert ours.registry.champion()[0] == 2 and ours.registry.candidate()[0] == 100  # the newer registration keeps the alias


def test_a_champion_record_written_in_part_reads_as_none(cfg, store, caplog):
    """Older code wrote only the five ``record.*`` tags (one registry call each); stopped after two,
    the learner decides as for a champion without a record instead of raising KeyError."""
    tracker = RunTracker(cfg)
    ref = _publish(store, 1)
    tracker.registry.register(ref, 0.0)
    tracker.registry.record_decision("promoted", {}, ref)
    tags = ValueRecord(0.5, 0.05, 40, 30.0, (1, 2)).tags()
    tracker.registry.tag_champion({key: tags[key] for key in ("record.value", "record.se")})
    with caplog.at_level("WARNING", logger="online_sao.gate_record"):
        assert tracker.registry.champion_record() is None
    assert "missing record.n, record.ess, record.window_versions" in caplog.text
    tracker.registry.tag_champion(tags)  # the next refresh completes it
    assert tracker.registry.champion_record() == ValueRecord(0.5, 0.05, 40, 30.0, (1, 2))


def test_a_refresh_cut_short_leaves_the_old_record_whole(cfg, store):
    """A refresh stopped after its readable ``record.*`` tags, before the ``record`` tag: the
    registry holds the new readable values, and the champion's record is still the old one whole
    (before: a record with the new value and the old standard error)."""
    tracker = RunTracker(cfg)
    ref = _publish(store, 1)
    tracker.registry.register(ref, 0.0)
    tracker.registry.record_decision("promoted", {}, ref)
    old, new = ValueRecord(0.5, 0.05, 40, 30.0, (1, 2)), ValueRecord(0.9, 0.2, 12, 5.0, (3, 4))
    tracker.registry.tag_champion(old.tags())
    tracker.registry.tag_champion({key: value for key, value in new.tags().items() if key != "record"})
    assert tracker.registry.champion_record() == old
    tracker.registry.tag_champion(new.tags())
    assert tracker.registry.champion_record() == new


def _unanswered_once(monkeypatch, client, method: str) -> None:
    """``client.<method>`` does its work, then the answer is lost once (the server went away)."""
    real, lost = getattr(client, method), [True]

    def answer_lost(*args, **kwargs):
        result = real(*args, **kwargs)
        if lost and lost.pop():
            try:
                raise requests.exceptions.ConnectionError("the server went away")
            except requests.exceptions.ConnectionError:
                raise MlflowException("connection refused") from None
        return result
    monkeypatch.setattr(client, method, answer_lost)


@pytest.mark.parametrize("lost", ["create_model_version", "set_registered_model_alias"])
def test_a_registration_retried_after_an_unanswered_call_registers_the_policy_once(cfg, store, monkeypatch, lost):
    """The server made the version (and perhaps its alias) and its answer was lost: the retry
    registered the policy a second time on the same model directory, and retention, pruning the
    older of the two, deleted the directory the champion's version points at."""
    monkeypatch.setattr(tracking, "TRACKING_RETRY_S", 0.01)
    cfg = cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(update={"keep_registered_artifacts": 1})})
    tracker = RunTracker(cfg, stop=threading.Event())  # waits out an unanswered call
    _unanswered_once(monkeypatch, tracker.client, lost)
    first = _publish(store, 1)
    assert tracker.registry.register(first, 0.0) == "1"
    tracker.registry.record_decision("promoted", {}, first)
    client, name = _client(cfg), cfg.mlflow.registered_model
    assert [str(v.version) for v in client.search_model_versions(f"name = '{name}'")] == ["1"]
    for version in (2, 3):
        tracker.registry.register(_publish(store, version), 0.0)
    champion = client.get_model_version_by_alias(name, "champion")
    assert Path(champion.source.removeprefix("file://")).is_dir()
    assert champion.tags["weights_pruned"] == "false"


def test_retention_keeps_a_directory_a_kept_version_shares(cfg, store):
    """Two registry versions on one model directory (written by a learner from before the fix above):
    pruning the older one leaves the directory the aliased one points at."""
    cfg = cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(update={"keep_registered_artifacts": 1})})
    tracker = RunTracker(cfg)
    ref = _publish(store, 1)
    tracker.registry.register(ref, 0.0)
    client, name = _client(cfg), cfg.mlflow.registered_model
    first = client.get_model_version(name, "1")
    duplicate = client.create_model_version(name, first.source, run_id=tracker.run_id, tags=first.tags).version
    client.set_registered_model_alias(name, "champion", duplicate)
    for version in (2, 3):
        tracker.registry.register(_publish(store, version), 0.0)
    assert Path(first.source.removeprefix("file://")).is_dir()


def test_a_promotion_whose_notice_was_lost_is_announced_when_the_learner_starts_again(registry_cfg, monkeypatch):
    """The learner stops after the registry recorded the v2 promotion, before its champion notice
    reached the broker: the restart finds candidate and champion one version and decides nothing,
    so without an announcement at start serving's canary never learned its champion."""
    config = registry_cfg.model_copy(update={"deploy": registry_cfg.deploy.model_copy(update={"canary_share": 0.25})})
    backend, publisher, tracker, window = _registry_parts(config)
    scorer = ScriptedScorer(dict.fromkeys(range(1, 10), STYLE_A))

    def release(releases, version):
        releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0))
        window.observe([_rollout(f"v{version}-{i}", [5, STYLE_A], version, 1.0, logprob=math.log(0.9) / 2)
                        for i in range(40)])

    releases = Releases(publisher, tracker, OffPolicyGate(scorer, config.deploy), window, config.deploy, 2)
    for version in range(1, 4):
        release(releases, version)
    monkeypatch.setattr(publisher, "announce_champion", lambda *args: (_ for _ in ()).throw(Stopped()))
    with pytest.raises(Stopped):
        release(releases, 4)  # v2 promoted in the registry; its notice never sent
    monkeypatch.undo()
    assert tracker.registry.champion()[0] == 2 and tracker.registry.candidate()[0] == 2

    restarted = Releases(publisher, RunTracker(config, run_id=tracker.run_id), OffPolicyGate(scorer, config.deploy),
                         window, config.deploy, 2)
    restarted.announce_champion_again(step=4)
    notices = [decode(m.value) for m in backend.consumer([config.kafka.topics.weights]).poll(0.1, 1000)]
    assert [n.version for n in notices if n.action == "champion"] == [2]


def test_without_a_canary_the_champion_is_announced_again_at_start_too(registry_cfg):
    """Replicas without a canary ignore the notice; ``online-sao weights hold --champion`` reads it."""
    backend, publisher, tracker, window = _registry_parts(registry_cfg)
    releases = Releases(publisher, tracker, OffPolicyGate(ScriptedScorer({}), registry_cfg.deploy), window,
                        registry_cfg.deploy, 2)
    ref = publisher.store.save(1, {"w": torch.ones(2)})
    tracker.registry.register(ref, 0.0)
    tracker.registry.record_decision("promoted", {}, ref)
    releases.announce_champion_again(step=1)
    notices = [decode(m.value) for m in backend.consumer([registry_cfg.kafka.topics.weights]).poll(0.1, 1000)]
    assert [(n.action, n.version) for n in notices] == [("champion", 1)]


class LoadingScorer(ScriptedScorer):
    """Scores as ScriptedScorer after loading the version's published weights, as StoredPolicyScorer does."""

    def __init__(self, store, style_of):
        super().__init__(style_of)
        self.store = store

    def log_ratios(self, ref, window):
        self.store.load(ref.location, ref.checksum)
        return super().log_ratios(ref, window)


def _loading_releases(registry_cfg):
    """(publisher, tracker, release): ``release(v)`` publishes version ``v`` through a gate whose scorer
    loads each version's weights, then observes 40 rollouts of it (every other one registers)."""
    backend, publisher, tracker, window = _registry_parts(registry_cfg)
    scorer = LoadingScorer(publisher.store, dict.fromkeys(range(1, 10), STYLE_A))
    releases = Releases(publisher, tracker, OffPolicyGate(scorer, registry_cfg.deploy), window, registry_cfg.deploy, 2)

    def release(version):
        releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0))
        window.observe([_rollout(f"v{version}-{i}", [5, STYLE_A], version, 1.0, logprob=math.log(0.9) / 2)
                        for i in range(40)])

    return publisher, tracker, release


def test_a_torn_candidate_is_left_pending_and_a_torn_champion_counts_as_none(registry_cfg):
    """A weights file that is there but torn (a power loss after an unflushed rename, before the store
    fsynced): the gate's load raised CorruptWeights out of the decision, at every restart. A torn
    candidate is left pending as a missing one is; a torn champion counts as none, as a missing one does."""
    publisher, tracker, release = _loading_releases(registry_cfg)
    for version in range(1, 6):
        release(version)
    assert tracker.registry.champion()[0] == 2 and tracker.registry.candidate()[0] == 4
    open(tracker.registry.candidate()[1].location, "wb").close()  # renamed into place, its data never on disk
    release(6)  # v4 decided
    client, name = _client(registry_cfg), registry_cfg.mlflow.registered_model
    tags = {int(v.tags["policy_version"]): v.tags for v in client.search_model_versions(f"name = '{name}'")}
    assert tags[4]["decision"] == "pending" and tags[4]["gate.decision"] == "candidate_weights_corrupt"
    assert tracker.registry.champion()[0] == 2 and tracker.registry.candidate()[0] == 6
    open(tracker.registry.champion()[1].location, "wb").close()
    release(7)
    release(8)  # v6 decided: the champion's weights are torn, so as without one
    assert tracker.registry.champion()[0] == 6
    assert client.get_model_version_by_alias(name, "champion").tags["gate.champion_weights_corrupt"] == "v2"


def test_a_lost_store_leaves_the_candidate_pending_and_the_next_one_is_promoted(registry_cfg):
    """The weight store lost every file (a new volume): the candidate's weights are gone with the
    champion's. Deciding on it loaded them and raised, at every restart; it is now left pending, and
    the next registration, published after the loss, is promoted as without a champion."""
    publisher, tracker, release = _loading_releases(registry_cfg)
    for version in range(1, 6):
        release(version)
    assert tracker.registry.champion()[0] == 2 and tracker.registry.candidate()[0] == 4
    for version in publisher.store.versions():
        publisher.store.delete(version)
    release(6)  # v4 decided: its weights are gone
    client, name = _client(registry_cfg), registry_cfg.mlflow.registered_model
    tags = {int(v.tags["policy_version"]): v.tags for v in client.search_model_versions(f"name = '{name}'")}
    assert tags[4]["decision"] == "pending" and tags[4]["gate.decision"] == "candidate_weights_missing"
    assert tracker.registry.champion()[0] == 2 and tracker.registry.candidate()[0] == 6
    release(7)
    release(8)  # v6 decided: the champion's weights are gone, so as without one
    assert tracker.registry.champion()[0] == 6
    assert client.get_model_version_by_alias(name, "champion").tags["gate.champion_weights_missing"] == "v2"
