"""Each reward source's recent mean (trainer/source_rewards.py) on hand-built rewards."""

from __future__ import annotations

import hashlib
import math

import pytest
from mlflow import MlflowClient

from online_sao.config import Config, load_config
from trainer.source_rewards import MAX_SOURCES_SHOWN, SourceRewards
from trainer.tracking import RunTracker

NAMES_MLFLOW_WOULD_REFUSE = ["https://judge.example/v2", "a/./b", "x/../y", "a?b", "a!b"]
"""Names ``/v1/feedback`` takes: MLflow refuses ``//``, ``/./`` and ``/../`` in a key (it would name
another path), and ``?``/``!`` at all; the last two also clean to the same text."""


@pytest.fixture
def tracking_cfg(tmp_path) -> Config:
    """A config on an empty MLflow SQLite store of its own, with a model directory holding a config file."""
    db = tmp_path / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    cfg = load_config(environ={}, overrides={"paths.data_dir": str(tmp_path / "data"),
                                             "mlflow.tracking_uri": f"sqlite:///{db}"})
    cfg.model_dir.mkdir(parents=True)
    (cfg.model_dir / "config.json").write_text('{"model_type": "fake"}')
    return cfg


def test_each_source_keeps_its_newest_rewards():
    sources = SourceRewards(window=3)
    for judge, user in ((1.0, 0.0), (0.5, None), (0.0, 1.0), (1.0, None)):
        sources.observe({"judge": judge} if user is None else {"judge": judge, "user": user})
    # judge: 1.0 fell out of its window of 3 -> 0.5, 0.0, 1.0; user: 0.0, 1.0
    assert sources.stats() == {"judge": (0.5, 3), "user": (0.5, 2)}
    assert sources.metrics() == {"source.judge.reward": 0.5, "source.judge.count": 3.0,
                                 "source.user.reward": 0.5, "source.user.count": 2.0}


def test_sources_past_the_bound_are_folded_into_other():
    sources = SourceRewards(window=10)
    names = [f"s{i}" for i in range(MAX_SOURCES_SHOWN + 2)]
    for value, name in enumerate(names):
        sources.observe({name: float(value)})
    sources.observe({"other": 100.0})  # a source that calls itself other is not a label of its own either
    stats = sources.stats()
    assert set(stats) == set(names[:MAX_SOURCES_SHOWN]) | {"other"}
    assert stats["other"] == ((8.0 + 9.0 + 100.0) / 3, 3)
    sources.observe({"s0": 2.0})  # a source shown stays shown
    assert sources.stats()["s0"] == (1.0, 2)


def test_listed_sources_are_shown_from_the_start_and_only_they():
    sources = SourceRewards(window=4, sources=["judge", "user"])
    stats = sources.stats()
    assert set(stats) == {"judge", "user"} and math.isnan(stats["judge"][0]) and stats["user"][1] == 0
    sources.observe({"judge": 1.0, "scraper": 5.0})  # the join applies no unlisted source; one would be other
    assert sources.stats()["judge"] == (1.0, 1) and set(sources.stats()) == {"judge", "user", "other"}


def test_plain_names_keep_their_keys_and_others_are_cleaned_and_hashed():
    sources = SourceRewards(window=2)
    sources.observe({"judge-v2.1_a": 0.5, "team/a b:c": 1.0, "judge-20240513": 0.0})
    hashed = f"team_a_b_c-h{_sha8('team/a b:c')}"
    assert sources.metrics() == {"source.judge-v2.1_a.reward": 0.5, "source.judge-v2.1_a.count": 1.0,
                                 f"source.{hashed}.reward": 1.0, f"source.{hashed}.count": 1.0,
                                 "source.judge-20240513.reward": 0.0,  # a dated name is no hashed one
                                 "source.judge-20240513.count": 1.0}


def test_a_name_keeps_its_keys_whatever_other_names_come_and_none_shares_a_key():
    """A plain name that spells another's cleaned, hashed text (a client may send one) kept it until the
    other came, which then took its keys: one series carried two sources; a third name could share a key."""
    mimic = f"a_b-h{_sha8('a?b')}"
    sources = SourceRewards(window=2)
    sources.observe({mimic: 0.0})
    before = set(sources.metrics())
    sources.observe({"a?b": 1.0, f"{mimic}-h{_sha8(mimic)}": 0.5})
    after = sources.metrics()
    assert before <= set(after) and after[f"source.{mimic}-h{_sha8(mimic)}.reward"] == 0.0  # the mimic's own
    assert after[f"source.{mimic}.reward"] == 1.0  # a?b's
    assert len(after) == 2 * 3  # three sources, each its own two keys


def test_names_mlflow_would_refuse_are_logged_each_under_its_own_key(tracking_cfg):
    sources = SourceRewards(window=4)
    for value, name in enumerate(NAMES_MLFLOW_WOULD_REFUSE):
        sources.observe({name: float(value)})
    metrics = sources.metrics()
    tracker = RunTracker(tracking_cfg)
    try:
        tracker.log_metrics(metrics, step=1)  # refused keys raised here and ended the learner's loop
        logged = MlflowClient(tracking_uri=tracking_cfg.mlflow_uri).get_run(tracker.run_id).data.metrics
    finally:
        tracker.close()
    assert logged == metrics and len(logged) == 2 * len(NAMES_MLFLOW_WOULD_REFUSE)  # no two share a key
    assert sorted(v for k, v in logged.items() if k.endswith(".reward")) == [0.0, 1.0, 2.0, 3.0, 4.0]


def _sha8(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:8]
