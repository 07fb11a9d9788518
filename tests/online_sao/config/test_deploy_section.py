"""deploy.* values the gate and the monitors cannot use are refused when the config is read."""

from __future__ import annotations

import math

import pytest

from online_sao.config import ConfigError, load_config


@pytest.mark.parametrize(("key", "value", "named"), [
    ("deploy.gate_margin", math.inf, "finite"),  # promoted [-0.9, -0.8] and could never roll back
    ("deploy.gate_margin", math.nan, "finite"),
    ("deploy.gate_margin", -0.01, "greater than or equal to 0"),
    ("deploy.gate_confidence", 1e-300, "greater than or equal to 0.5"),  # z about 0: every interval a point
    ("deploy.gate_confidence", 0.4999, "greater than or equal to 0.5"),
    ("deploy.gate_confidence", 1.0, "less than 1"),
    ("deploy.monitor_min_scores", {"quality": math.nan}, "finite"),  # x < nan is False: never trips
    ("deploy.monitor_min_scores", {"quality": 0.4, "safety": -math.inf}, "finite"),
    ("deploy.monitor_min_scores", {"quality": math.inf}, "finite"),
])
def test_unusable_gate_and_monitor_values_are_refused(key, value, named):
    with pytest.raises(ConfigError, match=rf"{key}(\.\w+)?: .*{named}"):
        load_config(environ={}, overrides={key: value})


def test_a_nan_floor_in_yaml_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("deploy:\n  monitor_min_scores: {quality: .nan}\n")
    with pytest.raises(ConfigError, match=r"deploy.monitor_min_scores.quality: .*finite"):
        load_config(path, environ={})


def test_usable_edges_are_accepted():
    cfg = load_config(environ={}, overrides={"deploy.gate_margin": 0.0, "deploy.gate_confidence": 0.5,
                                             "deploy.monitor_min_scores": {"quality": -1e6}}).deploy
    assert (cfg.gate_margin, cfg.gate_confidence, cfg.monitor_min_scores) == (0.0, 0.5, {"quality": -1e6})


def test_a_rollback_score_without_rollback_first_is_refused():
    # without rollback_first every alarm restarts: the score would never be tested
    with pytest.raises(ConfigError, match=r"drift: .*rollback_score \('quality'\) needs rollback_first"):
        load_config(environ={}, overrides={"drift.enabled": True, "drift.rollback_score": "quality"})
    cfg = load_config(environ={}, overrides={"drift.rollback_first": True, "drift.rollback_score": "quality"}).drift
    assert (cfg.rollback_first, cfg.rollback_score) == (True, "quality")
