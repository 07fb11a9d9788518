"""An operator moving the registry's aliases by hand (the MLflow client) while the gate scores a
candidate: the verdict, reached against the champion of before, must not undo the move (real
MLflow registry, real weight store; the move is made inside the gate's scoring)."""

from __future__ import annotations

import logging
import math

import torch
from mlflow import MlflowClient

from online_sao.schemas import decode
from tests.trainer.test_deploy import STYLE_A, STYLE_B, ScriptedScorer, _registry_parts, _rollout
from tests.trainer.test_deploy import registry_cfg  # noqa: F401  (the fixture)
from tests.trainer.test_tracking import empty_store  # noqa: F401
from trainer.deploy import OffPolicyGate
from trainer.releases import Releases


class MovingScorer(ScriptedScorer):
    """Scores as :class:`ScriptedScorer`; the first time it scores after ``move`` is set, it runs it."""

    move = None

    def log_ratios(self, ref, window):
        move, self.move = self.move, None
        if move is not None:
            move()
        return super().log_ratios(ref, window)


class Deployment:
    """Versions 1-4 sample style A, later ones style B; the traffic pays A."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.backend, publisher, self.tracker, self.window = _registry_parts(cfg)
        publisher.keep_versions = 20
        self.scorer = MovingScorer({v: STYLE_A if v <= 4 else STYLE_B for v in range(1, 20)})
        self.releases = Releases(publisher, self.tracker, OffPolicyGate(self.scorer, cfg.deploy), self.window,
                                 cfg.deploy, register_every=2)
        self.client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)
        self.name = cfg.mlflow.registered_model

    def release(self, version: int):
        outcome = self.releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0))
        style = STYLE_A if version <= 4 else STYLE_B
        self.window.observe([_rollout(f"v{version}-{i}", [5, style if i % 10 else STYLE_A + STYLE_B - style],
                                      version, float((style if i % 10 else STYLE_A + STYLE_B - style) == STYLE_A),
                                      logprob=math.log(0.9 if i % 10 else 0.1) / 2) for i in range(40)])
        return outcome

    def registered(self, policy: int):
        (found,) = [v for v in self.client.search_model_versions(f"name = '{self.name}'")
                    if v.tags.get("policy_version") == str(policy)]
        return found

    def alias(self, name: str) -> int | None:
        aliases = self.client.get_registered_model(self.name).aliases
        return int(self.client.get_model_version(self.name, aliases[name]).tags["policy_version"]) \
            if name in aliases else None

    def announced(self) -> list[tuple[str, int]]:
        return [(n.action, n.version) for n in
                (decode(m.value) for m in self.backend.consumer([self.cfg.kafka.topics.weights]).poll(0.1, 1000))]


def test_without_a_move_the_worse_candidate_is_rolled_back(registry_cfg):
    """The scenario the tests below disturb: candidate v6 (style B) against champion v4 (A)."""
    d = Deployment(registry_cfg)
    for version in range(1, 9):
        outcome = d.release(version)
    assert outcome.rolled_back_to is not None and outcome.rolled_back_to.version == 4
    assert d.registered(6).tags["decision"] == "rolled_back" and d.alias("champion") == 4


def test_an_operators_promotion_during_the_decision_is_not_undone_by_a_roll_back(registry_cfg, caplog):
    d = Deployment(registry_cfg)
    for version in range(1, 8):
        d.release(version)
    d.scorer.move = lambda: d.client.set_registered_model_alias(d.name, "champion", d.registered(6).version)
    with caplog.at_level(logging.WARNING, logger="trainer.registry"):
        outcome = d.release(8)

    assert outcome.rolled_back_to is None and ("rollback", 4) not in d.announced()
    assert d.alias("champion") == 6  # the operator's
    # no roll-back left "not carried out": the next start rolled back to the operator's champion
    assert d.releases.rollback_due() is None and "rollback_carried_out" not in d.registered(6).tags
    tags = d.registered(6).tags
    assert tags["decision"] == "pending" and "it was policy v4, it is policy v6" in tags["gate.set_aside"]
    assert any("candidate v6 rolled_back set aside" in r.getMessage() for r in caplog.records)


def test_an_operators_roll_back_during_the_decision_keeps_the_champion_they_chose(registry_cfg):
    d = Deployment(registry_cfg)
    for version in range(1, 8):
        d.release(version)
    records = {k: v for k, v in d.registered(2).tags.items() if k.startswith("record")}
    d.scorer.move = lambda: d.client.set_registered_model_alias(d.name, "champion", d.registered(2).version)
    outcome = d.release(8)

    assert outcome.rolled_back_to is None and d.alias("champion") == 2
    assert d.registered(6).tags["decision"] == "pending"
    # v4's record, measured on this window, was written onto v2
    assert {k: v for k, v in d.registered(2).tags.items() if k.startswith("record")} == records


def test_the_champion_alias_or_the_candidate_deleted_during_the_decision_leaves_it_pending(registry_cfg):
    """Each stopped the learner: 'no champion to tag', 'policy version 6 ... is not registered'."""
    d = Deployment(registry_cfg)
    for version in range(1, 8):
        d.release(version)
    d.scorer.move = lambda: d.client.delete_registered_model_alias(d.name, "champion")
    assert d.release(8).rolled_back_to is None
    assert d.alias("champion") is None and d.registered(6).tags["decision"] == "pending"

    d.client.set_registered_model_alias(d.name, "champion", d.registered(4).version)
    candidate = d.alias("candidate")
    d.scorer.move = lambda: d.client.delete_model_version(d.name, d.registered(candidate).version)
    for version in (9, 10):
        assert d.release(version).rolled_back_to is None
    assert d.alias("champion") == 4


def test_a_rejected_version_an_operator_made_champion_raises_no_warning_of_a_stopped_learner(registry_cfg, caplog):
    """The candidate alias on the champion's version tagged rolled_back read as a roll-back a stopped
    learner left half done: a warning at every decision, about a crash that never happened."""
    d = Deployment(registry_cfg)
    for version in range(1, 9):
        d.release(version)  # v6 rolled back
    for alias in ("champion", "candidate"):
        d.client.set_registered_model_alias(d.name, alias, d.registered(6).version)
    with caplog.at_level(logging.WARNING, logger="trainer.registry"):
        assert d.tracker.registry.candidate()[0] == 6
    assert not [r for r in caplog.records if "stopped before moving it" in r.getMessage()]


def test_a_promotion_retried_after_its_alias_move_went_through_stands(registry_cfg):
    """An MLflow reply lost after the champion alias moved: the retry read the learner's own move as an
    operator's, tagged the new champion pending and set aside, and skipped announcing it."""
    d = Deployment(registry_cfg)
    for version in range(1, 6):
        d.release(version)  # champion v2 or v4, candidate v4
    candidate = d.tracker.registry.candidate()[1]
    before = d.tracker.registry.champion()[1]
    assert d.tracker.registry.record_decision("promoted", {}, candidate, against=before)
    assert d.tracker.registry.record_decision("promoted", {}, candidate, against=before)  # the retry
    tags = d.registered(candidate.version).tags
    assert tags["decision"] == "promoted" and "gate.set_aside" not in tags
