"""The score monitors (``deploy.monitor_min_scores``): the judge's quality, read from the reward
records' named scores, can roll back a candidate whose reward holds."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from mlflow import MlflowClient

from online_sao.config import ConfigError, load_config
from tests.trainer.test_deploy import STYLE_A, ScriptedScorer, _registry_parts, _rollout, registry_cfg  # noqa: F401
from tests.trainer.test_tracking import empty_store  # noqa: F401  (registry_cfg's template store)
from trainer.deploy import OffPolicyGate, RecentWindow, read_monitors
from trainer.releases import Releases


def _scored(iid: str, version: int, reward: float, **scores: float):
    return replace(_rollout(iid, [5, STYLE_A], version, reward, logprob=math.log(0.9) / 2), scores=scores)


def test_score_floors_trip_below_and_every_carried_score_is_shown():
    cfg = load_config(environ={}, overrides={"deploy.monitor_min_scores": {"quality": 0.5, "safety": 0.9}}).deploy
    window = RecentWindow(8)
    window.observe([_scored("old", 1, 1.0, quality=0.0),  # before the candidate: not its answer
                    _scored("a", 3, 1.0, quality=0.5, style=0.25), _scored("b", 3, 1.0, quality=0.25),
                    _scored("c", 4, 1.0)])  # a reward without scores counts for no score
    reading = read_monitors(cfg, window, since_version=3, records_read=0.0, dead_letters=0.0)
    assert reading.values["score_quality"] == 0.375  # (0.5 + 0.25) / 2: "c" carried none
    assert reading.values["score_style"] == 0.25  # shown without a floor
    assert math.isnan(reading.values["score_safety"])  # a floor without readings: no value, no trip
    assert reading.tripped == ["score_quality"]
    assert reading.tags()["monitor.score_quality"] == "0.375"
    at_floor = read_monitors(cfg, window, since_version=4, records_read=0.0, dead_letters=0.0)
    assert math.isnan(at_floor.values["score_quality"]) and at_floor.tripped == []
    window.observe([_scored("d", 5, 0.0, quality=0.5)])
    assert read_monitors(cfg, window, since_version=5, records_read=0.0, dead_letters=0.0).tripped == []


def test_score_names_the_callers_invent_stop_at_the_first_sixteen_and_the_floors_always_show():
    """Each score name a reward carried became a monitor: an MLflow metric, a registry tag and a Prometheus
    series. A feedback caller that sent a new name with every reward grew all three without bound (40 names:
    40 of each)."""
    cfg = load_config(environ={}, overrides={"deploy.monitor_min_scores": {"quality": 0.5}}).deploy
    window = RecentWindow(64)
    window.observe([_scored(f"i{k}", 1, 1.0, **{f"made_up_{k}": 0.5}) for k in range(40)])
    window.observe([_scored("q", 1, 1.0, quality=0.9)])
    reading = read_monitors(cfg, window, since_version=0, records_read=0.0, dead_letters=0.0)
    scored = sorted(name for name in reading.values if name.startswith("score_"))
    assert scored == sorted(["score_quality", *(f"score_made_up_{k}" for k in range(16))])
    assert reading.values["score_quality"] == 0.9  # a floor's name is read whatever came first

    restored = RecentWindow(64)
    restored.load_state_dict(window.state_dict())  # across a restart too
    restored.observe([_scored("new", 2, 1.0, another=0.1)])
    assert restored.score_names == window.score_names and "another" not in restored.score_names


def test_config_refuses_a_score_name_that_cannot_be_a_metric():
    with pytest.raises(ConfigError, match="monitor_min_scores"):
        load_config(environ={}, overrides={"deploy.monitor_min_scores": {"Quality!": 0.5}})


def test_quality_collapse_under_a_steady_reward_is_rolled_back(registry_cfg):  # noqa: F811
    """Every answer earns reward 1, the judge's quality falls from 0.8 to 0.2 with version 4 (a
    reward that stopped paying for quality). Candidates register every 2 versions and are decided
    2 versions later: v2 (decided at v4 on v2's and v3's answers: quality 0.8) is promoted; v4
    (decided at v6 on v4's and v5's: 0.2 < floor 0.5) is rolled back to v2."""
    cfg = registry_cfg.model_copy(update={"deploy": registry_cfg.deploy.model_copy(
        update={"monitor_min_scores": {"quality": 0.5}})})
    backend, publisher, tracker, window = _registry_parts(cfg)
    releases = Releases(publisher, tracker, OffPolicyGate(ScriptedScorer({v: STYLE_A for v in range(1, 7)}),
                                                          cfg.deploy), window, cfg.deploy, 2)
    outcomes = []
    for version in range(1, 7):
        outcomes.append(releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0)))
        quality = 0.8 if version < 4 else 0.2
        window.observe([_scored(f"v{version}-{i}", version, 1.0, quality=quality) for i in range(40)])
    assert [o.rolled_back_to for o in outcomes[:5]] == [None] * 5
    assert outcomes[5].rolled_back_to is not None and outcomes[5].rolled_back_to.version == 2
    client = MlflowClient(tracking_uri=cfg.mlflow_uri)
    history = [(m.step, round(m.value, 6)) for m in client.get_metric_history(tracker.run_id,
                                                                             "registry_monitor_score_quality")]
    assert history == [(4, 0.8), (6, 0.2)]
    by_policy = {int(v.tags["policy_version"]): v.tags
                 for v in client.search_model_versions(f"name = '{cfg.mlflow.registered_model}'")}
    assert by_policy[2]["decision"] == "promoted"
    assert by_policy[4]["decision"] == "rolled_back" and by_policy[4]["monitor.tripped"] == "score_quality"
