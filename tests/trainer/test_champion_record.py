"""The champion's record inside Releases (real MLflow registry, real weight store): a stale
champion no longer stops the gate, a record is refreshed while the champion can be scored, and
a record never rolls a candidate back."""

from __future__ import annotations

import math

import pytest
import torch
from mlflow import MlflowClient

from online_sao.schemas import WeightsNotice, decode
from tests.trainer.test_deploy import (STYLE_A, STYLE_B, MixtureScorer, _registry_parts, _rollout,  # noqa: F401
                                       _stale_champion_scenario, registry_cfg)
from tests.trainer.test_tracking import empty_store  # noqa: F401  (the module-scoped template store)
from trainer.deploy import OffPolicyGate
from trainer.releases import Releases

Z90 = 1.6448536269514722
"""Two-sided 90% normal quantile (the default ``deploy.gate_confidence``)."""


def test_a_stale_champion_is_replaced_on_its_record(registry_cfg):
    """Rewards pay B; v1-5 sample B with probability 0.001, v6-12 with 0.95 (38 of each 40 answers)."""
    champions, notices, by_policy = _stale_champion_scenario(registry_cfg)
    assert champions == [None, None, None, 2, 2, 4, 4, 6, 6, 8, 8, 10]  # every candidate promoted in turn
    first = by_policy[2]  # no champion: promoted, its record measured on v2's and v3's 80 answers (all A)
    assert first["gate.decision"] == "no_champion" and first["record.window_versions"] == "2-3"
    assert (float(first["record.value"]), first["record.n"]) == (0.0, "80")
    # v6 against v4 on v6's and v7's 80 answers: v4's ESS is 4.0 < 8 (test_deploy), so v4's record decides
    switch = by_policy[6]
    assert switch["decision"] == "promoted" and switch["gate.basis"] == "record"
    assert switch["gate.record_window_versions"] == "4-5" and float(switch["gate.champion_value"]) == 0.0
    # the candidate sampled all 80 itself (equal weights): V = 76/80; se = sqrt(76 * 0.05^2 + 4 * 0.95^2) / 80;
    # the record of 80 A answers, all unrewarded, has se 0
    se = math.sqrt(76 * 0.05 ** 2 + 4 * 0.95 ** 2) / 80
    assert float(switch["gate.candidate_value"]) == pytest.approx(0.95)
    assert float(switch["gate.candidate_se"]) == pytest.approx(se)
    assert float(switch["gate.low"]) == pytest.approx(0.95 - Z90 * se)
    # promoted: its own side becomes its record
    assert switch["record.window_versions"] == "6-7" and float(switch["record.value"]) == pytest.approx(0.95)
    assert by_policy[8]["gate.basis"] == "window"  # v8 against v6: both B, scored on the same answers again
    assert not any(n.action == "rollback" for n in notices)


def test_a_record_never_rolls_back(registry_cfg):
    """Rewards pay B; v1-5 sample B with probability 0.95, v6-12 with 0.05: from v6 the candidates are
    worse by the current rewards, and the B champion cannot be scored on their answers: of each
    version's 40 two are B, and the champion's weights put 0.95/0.05 = 19 on each of those and
    0.05/0.95 on the rest, ESS (4 * 19 + 76 / 19)^2 / (4 * 19^2 + 76 / 19^2), about 4.4."""
    prob_b = {v: 0.95 if v <= 5 else 0.05 for v in range(1, 13)}
    champions, notices, by_policy = _stale_champion_scenario(registry_cfg, prob_b)
    assert champions[5:] == [4] * 7  # v4 promoted at v6, never replaced
    for version in (6, 8, 10):
        tags = by_policy[version]
        assert tags["gate.basis"] == "record" and tags["decision"] == "pending"
        assert tags["gate.decision"] == "undecided" and "record cannot roll back" in tags["gate.reason"]
        assert float(tags["gate.high"]) < -registry_cfg.deploy.gate_margin  # the interval is wholly below
        assert float(tags["gate.candidate_value"]) == pytest.approx(0.05)  # 4 of 80 rewarded
        assert float(tags["gate.champion_value"]) == pytest.approx(0.95)  # v4's record, on v4's and v5's answers
    assert all(n.action in ("publish", "champion") for n in notices)


def test_a_champion_scored_on_the_window_gets_its_record_refreshed(registry_cfg):
    """Champion v2 samples B with probability 0.5, every later version with 0.4; a B answer is
    rewarded three times in four, an A answer once: the candidates are a little worse, within the
    margin's reach, so each decision is undecided and the champion, scored on every window, keeps
    its record current."""
    cfg = registry_cfg
    prob_b = {v: 0.5 if v <= 3 else 0.4 for v in range(1, 13)}
    backend, publisher, tracker, window = _registry_parts(cfg)
    releases = Releases(publisher, tracker, OffPolicyGate(MixtureScorer(prob_b), cfg.deploy), window, cfg.deploy,
                        register_every=2)
    for version in range(1, 13):
        assert releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0)) \
            .rolled_back_to is None
        for i in range(40):
            style = STYLE_B if (i + 0.5) / 40 < prob_b[version] else STYLE_A
            p = prob_b[version] if style == STYLE_B else 1 - prob_b[version]
            paid = i % 4 != 0 if style == STYLE_B else i % 4 == 0
            window.observe([_rollout(f"v{version}-{i}", [5, style], version, float(paid), logprob=math.log(p) / 2)])
    assert tracker.registry.champion()[0] == 2
    by_policy = {int(v.tags["policy_version"]): v.tags for v in
                 MlflowClient(tracking_uri=cfg.mlflow_uri).search_model_versions(
                     f"name = '{cfg.mlflow.registered_model}'")}
    assert [by_policy[v]["gate.decision"] for v in (4, 6, 8, 10)] == ["undecided"] * 4
    assert all(by_policy[v]["gate.basis"] == "window" for v in (4, 6, 8, 10))
    last, record = by_policy[10], by_policy[2]  # decided at v12 on v10's and v11's answers
    assert record["record.window_versions"] == last["gate.window_versions"] == "10-11"
    assert float(record["record.value"]) == pytest.approx(float(last["gate.champion_value"]))
    assert float(record["record.se"]) == pytest.approx(float(last["gate.champion_se"]))
    notices = [decode(m.value) for m in backend.consumer([cfg.kafka.topics.weights]).poll(0.1, 1000)]
    assert all(n.action in ("publish", "champion") for n in notices if isinstance(n, WeightsNotice))


def test_a_champion_the_window_cannot_cover_is_judged_on_its_record(registry_cfg):
    """Rewards pay B, nine B answers in ten; v1-5 sample B with probability 0.001 (all 40 answers A),
    v6-12 with 0.999 (all B). On v6's and v7's answers the A champion v4's weights are small but even
    (ESS 80, at the floor) and cover 0.001 of it: the window could not judge it, yet its ESS kept its
    record from being asked for, every candidate stayed undecided for good, and the record (0 on 80
    answers, coverage 1) was overwritten by that window's 0.9 at coverage 0.001."""
    cfg = registry_cfg
    prob_b = {v: 0.001 if v <= 5 else 0.999 for v in range(1, 13)}
    backend, publisher, tracker, window = _registry_parts(cfg)
    releases = Releases(publisher, tracker, OffPolicyGate(MixtureScorer(prob_b), cfg.deploy, reward_range=(0.0, 1.0)),
                        window, cfg.deploy, register_every=2)
    champions = []
    for version in range(1, 13):
        releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0))
        champions.append(tracker.registry.champion()[0] if tracker.registry.champion() else None)
        for i in range(40):
            style = STYLE_B if (i + 0.5) / 40 < prob_b[version] else STYLE_A
            p = prob_b[version] if style == STYLE_B else 1 - prob_b[version]
            paid = style == STYLE_B and i % 10 != 0
            window.observe([_rollout(f"v{version}-{i}", [5, style], version, float(paid), logprob=math.log(p) / 2)])
    assert champions == [None, None, None, 2, 2, 4, 4, 6, 6, 8, 8, 10]
    by_policy = {int(v.tags["policy_version"]): v.tags for v in
                 MlflowClient(tracking_uri=cfg.mlflow_uri).search_model_versions(
                     f"name = '{cfg.mlflow.registered_model}'")}
    switch = by_policy[6]  # 36 of 80 answers paid by v6 and v7 alike, against v4's record of 0 on 80
    assert switch["decision"] == "promoted" and switch["gate.basis"] == "record"
    assert float(switch["gate.candidate_value"]) == pytest.approx(0.9) and float(switch["gate.champion_value"]) == 0.0
    assert by_policy[4]["record.window_versions"] == "4-5"  # v4's record kept: not refreshed on that window


def test_a_drift_restart_is_judged_on_the_traffic_since_it(registry_cfg):
    """A-concentrated versions 1-8 (B with probability 0.01); B pays from v7's traffic on; the
    restart v9 samples B with probability 0.2 (8 of its 40 answers), v10-12 with 0.95 (38 of 40).
    At v12 candidate v10 is scored on v10's and v11's 80 answers, where the restart's weights are
    0.2/0.95 on a B answer and 0.8/0.05 = 16 on an A one: ESS (76 * 0.2/0.95 + 4 * 16)^2 /
    (76 * (0.2/0.95)^2 + 4 * 16^2), about 6.2 < 8. So the restart gets its record from the window's
    120 answers since it: its own 40 (weight 1 each) and those 80."""
    cfg = registry_cfg
    prob_b = {v: 0.01 for v in range(1, 9)} | {9: 0.2} | {v: 0.95 for v in range(10, 13)}
    backend, publisher, tracker, window = _registry_parts(cfg)
    releases = Releases(publisher, tracker, OffPolicyGate(MixtureScorer(prob_b), cfg.deploy), window, cfg.deploy,
                        register_every=2)
    for version in range(1, 13):
        drift = {"drift_alarm": 1.0, "drift_drop": 0.6, "drift_z": 4.0} if version == 9 else None
        assert releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0),
                                drift).rolled_back_to is None
        for i in range(40):
            style = STYLE_B if (i + 0.5) / 40 < prob_b[version] else STYLE_A
            p = prob_b[version] if style == STYLE_B else 1 - prob_b[version]
            paid = style == (STYLE_B if version >= 7 else STYLE_A)
            window.observe([_rollout(f"v{version}-{i}", [5, style], version, float(paid), logprob=math.log(p) / 2)])
    by_policy = {int(v.tags["policy_version"]): v.tags for v in
                 MlflowClient(tracking_uri=cfg.mlflow_uri).search_model_versions(
                     f"name = '{cfg.mlflow.registered_model}'")}
    b, a = 0.2 / 0.95, 0.8 / 0.05  # the restart's weights on the successors' B and A answers
    total = 40 + 76 * b + 4 * a
    value = (8 + 76 * b) / total  # its own 8 B answers and the successors' 76, all paid
    se = math.sqrt(8 * (1 - value) ** 2 + 32 * value ** 2 + 76 * (b * (1 - value)) ** 2 + 4 * (a * value) ** 2) / total
    restart = by_policy[9]
    assert restart["gate.decision"] == "drift_restart" and restart["record.window_versions"] == "9-11"
    assert float(restart["record.value"]) == pytest.approx(value)  # 0.2
    assert float(restart["record.se"]) == pytest.approx(se)
    assert float(restart["record.ess"]) == pytest.approx(total ** 2 / (40 + 76 * b ** 2 + 4 * a ** 2))
    first = by_policy[10]
    assert first["decision"] == "promoted" and first["gate.basis"] == "record"
    assert first["gate.record_window_versions"] == "9-11" and float(first["gate.champion_value"]) == pytest.approx(0.2)
    assert tracker.registry.champion()[0] == 10


def test_a_record_measured_under_other_rewards_is_set_aside(registry_cfg, caplog):
    """The stale-champion scenario (rewards pay B; v1-5 sample B with probability 0.001, v6-12 with
    0.95), with the learner restarted before v8 under other reward settings (definition b for a).
    Champion v4's record (0.0, on v4's and v5's answers) was measured under a: at v8 it is set aside,
    and v4 gets a record measured anew on the window's 120 answers since it (v5's 40 A, v6's and
    v7's 76 B and 4 A): weights 1 on v5's, 0.001/0.95 on a B answer and 0.999/0.05 on an A one, ESS
    (40 + 76 * 0.00105 + 4 * 19.98)^2 / (40 + 76 * 0.00105^2 + 4 * 19.98^2), about 8.8 >= 8."""
    cfg = registry_cfg
    prob_b = {v: 0.001 if v <= 5 else 0.95 for v in range(1, 13)}
    backend, publisher, tracker, window = _registry_parts(cfg)
    gate = {"a" * 16: OffPolicyGate(MixtureScorer(prob_b), cfg.deploy, reward_definition="a" * 16),
            "b" * 16: OffPolicyGate(MixtureScorer(prob_b), cfg.deploy, reward_definition="b" * 16)}
    releases = Releases(publisher, tracker, gate["a" * 16], window, cfg.deploy, register_every=2)
    for version in range(1, 13):
        if version == 8:  # the restart: the same registry, store and window, other reward settings
            releases = Releases(publisher, tracker, gate["b" * 16], window, cfg.deploy, register_every=2)
        with caplog.at_level("WARNING", logger="trainer.publisher"):
            releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0))
        for i in range(40):
            style = STYLE_B if (i + 0.5) / 40 < prob_b[version] else STYLE_A
            p = prob_b[version] if style == STYLE_B else 1 - prob_b[version]
            window.observe([_rollout(f"v{version}-{i}", [5, style], version, float(style == STYLE_B),
                                     logprob=math.log(p) / 2)])
    by_policy = {int(v.tags["policy_version"]): v.tags for v in
                 MlflowClient(tracking_uri=cfg.mlflow_uri).search_model_versions(
                     f"name = '{cfg.mlflow.registered_model}'")}
    assert by_policy[4]["gate.decision"] == "promoted" and "gate.record_set_aside" not in by_policy[4]
    decided = by_policy[6]  # at v8, under b
    assert decided["gate.record_set_aside"] == "reward definition " + "a" * 16
    assert "champion v4's record was measured under other rewards" in caplog.text
    assert decided["gate.basis"] == "record" and decided["gate.record_window_versions"] == "5-7"
    a, b = 0.999 / 0.05, 0.001 / 0.95
    total = 40 + 76 * b + 4 * a
    assert float(decided["gate.champion_value"]) == pytest.approx(76 * b / total)  # only B answers are paid
    assert decided["decision"] == "promoted"
    assert by_policy[4]["record.window_versions"] == "5-7" and by_policy[4]["record.reward_definition"] == "b" * 16
    assert by_policy[6]["record.reward_definition"] == "b" * 16  # promoted under b: its own side, under b
    assert "gate.record_set_aside" not in by_policy[8]  # v6's record is under b: comparable
