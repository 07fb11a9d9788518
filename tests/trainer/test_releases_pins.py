"""Releases between registrations and around them (real MLflow registry, real weight store): a publish
between registrations asks the registry nothing (an MLflow outage must not stop training), a
champion moved by hand is announced to serving at the learner's next decision, and the gate's
window versions name the candidate's side only."""

from __future__ import annotations

import math

import torch

from online_sao.schemas import decode
from online_sao.weights import WeightsRef
from tests.trainer.test_deploy import (STYLE_A, STYLE_B, MixtureScorer, ScriptedScorer, _registry_parts,  # noqa: F401
                                       _rollout, registry_cfg)
from tests.trainer.test_tracking import _client, empty_store  # noqa: F401  (fixtures)
from trainer.deploy import OffPolicyGate, RecentWindow
from trainer.mlflow_store import TrackingUnavailable
from trainer.releases import ReleaseOutcome, Releases


class DownRegistry:
    """MLflow gone away: every registry call fails at once and is noted (a learner's would wait for
    the server to answer, training stopped meanwhile)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            self.calls.append(name)
            raise TrackingUnavailable(f"{name}: MLflow does not answer")
        return call


def _releases(cfg, register_every: int = 2):
    """(backend, publisher, tracker, releases, release): ``release(v)`` publishes version ``v`` as the
    learner does (then reads the pinned versions, as trainer.learner.publish does after every publish)
    and observes 40 rollouts of it."""
    backend, publisher, tracker, window = _registry_parts(cfg)
    gate = OffPolicyGate(ScriptedScorer(dict.fromkeys(range(1, 20), STYLE_A)), cfg.deploy)
    releases = Releases(publisher, tracker, gate, window, cfg.deploy, register_every)

    def release(version: int) -> tuple[ReleaseOutcome, set[int]]:
        outcome = releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0))
        pinned = releases.pinned_versions()  # trainer.learner.publish: rank0.checkpointer.pinned_versions
        window.observe([_rollout(f"v{version}-{i}", [5, STYLE_A], version, 1.0, logprob=math.log(0.9) / 2)
                        for i in range(40)])
        return outcome, pinned

    return backend, publisher, tracker, releases, release


def test_a_publish_between_registrations_asks_the_registry_nothing(registry_cfg):
    """MLflow goes away after the v4 registration: publishing v5 (not a registration point) must not
    read the aliases, or the learner waits there for the server and stops training one step after
    it went away, whatever ``mlflow.register_every`` is."""
    _, publisher, _, releases, release = _releases(registry_cfg)
    for version in range(1, 5):
        release(version)
    assert releases.pinned_versions() == {2, 4}  # v2 promoted at v4 (no champion yet), v4 the candidate
    releases.registry = down = DownRegistry()
    outcome, pinned = release(5)
    assert outcome == ReleaseOutcome() and pinned == {2, 4} and down.calls == []
    assert {2, 4, 5} <= set(publisher.store.versions())  # what the aliases name stays pinned


def test_a_champion_moved_by_hand_is_announced_at_the_next_decision(registry_cfg, caplog):
    """An operator points ``champion`` at the candidate v6 by hand (champion v4, promoted by the
    learner, before): the gate and pinning follow the registry, so serving's canary must answer with
    v6 too. Before, nothing announced it: serving kept v4, whose weights pinning then pruned."""
    cfg = registry_cfg.model_copy(update={"deploy": registry_cfg.deploy.model_copy(update={"canary_share": 0.25})})
    backend, publisher, tracker, releases, release = _releases(cfg)
    for version in range(1, 7):
        release(version)
    assert tracker.registry.champion()[0] == 4 and tracker.registry.candidate()[0] == 6
    client, name = _client(cfg), cfg.mlflow.registered_model
    client.set_registered_model_alias(name, "champion", client.get_model_version_by_alias(name, "candidate").version)
    release(7)  # not a decision: nothing read, nothing announced
    with caplog.at_level("WARNING", logger="trainer.publisher"):
        _, pinned = release(8)
    notices = [decode(m.value) for m in backend.consumer([cfg.kafka.topics.weights]).poll(0.1, 1000)]
    assert [(n.version, n.step) for n in notices if n.action == "champion"] == [(2, 4), (4, 6), (6, 8)]
    assert "champion alias was moved outside the learner from v4 to v6" in caplog.text
    assert pinned == {6, 8} and 4 not in publisher.store.versions()
    release(9)
    release(10)  # v8 promoted by the learner: announced once, v6 not again
    notices = [decode(m.value) for m in backend.consumer([cfg.kafka.topics.weights]).poll(0.1, 1000)]
    assert [n.version for n in notices if n.action == "champion"] == [2, 4, 6, 8]


def test_the_first_read_announces_the_champion_without_calling_it_moved(registry_cfg, caplog):
    """A learner's start (trainer/rank_zero.py): its first registry read announces the champion again
    (a promotion's notice may have been lost) and reads the pins; nothing was moved by hand."""
    backend, publisher, tracker, releases, release = _releases(registry_cfg)
    for version in range(1, 5):
        release(version)
    restarted = Releases(publisher, tracker, releases.gate, releases.window, registry_cfg.deploy, 2)
    with caplog.at_level("WARNING", logger="trainer.publisher"):
        assert restarted.refresh_pinned(step=4) == {2, 4} == restarted.pinned_versions()
    notices = [decode(m.value) for m in backend.consumer([registry_cfg.kafka.topics.weights]).poll(0.1, 1000)]
    assert [n.version for n in notices if n.action == "champion"] == [2, 2]
    assert "moved outside the learner" not in caplog.text


def test_with_a_canary_the_window_versions_are_the_candidates_side(registry_cfg):
    """Candidate v3's 6 answers and 6 canary answers of champion v1: ``gate.window_versions`` spans the
    candidate's side (3-3), so an oldest version above the candidate still says the window lost its
    answers; ``gate.canary_n`` counts the champion's. Before, the tag read 1-3 (the champion's)."""
    prob_b = {1: 0.2, 3: 0.8}
    window = RecentWindow(64)
    window.mark_registration((0.0, 0.0))
    for source, version in (("canary", 1), ("serving", 3)):
        for i, style in enumerate([STYLE_B, STYLE_A] * 3):
            p = prob_b[version] if style == STYLE_B else 1 - prob_b[version]
            window.observe([_rollout(f"{source}-{i}", [5, style], version, float(style == STYLE_B),
                                     logprob=math.log(p))])
    deploy = registry_cfg.deploy.model_copy(update={"canary_share": 0.2, "gate_min_rollouts": 4, "gate_min_ess": 1.0})
    evidence = OffPolicyGate(MixtureScorer(prob_b), deploy).compare(WeightsRef(3, "c", "x"), WeightsRef(1, "h", "x"),
                                                                    window)
    assert (evidence.n, evidence.canary_n) == (12, 6)
    assert evidence.tags()["gate.window_versions"] == "3-3"
