"""The learner's reward sources end to end on the in-process stream backend: which sources train."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from online_sao.modeling import load_policy
from online_sao.schemas import Reward
from streams.memory import InMemoryBackend
from streams.records import publish
from tests.fixtures.models import tiny_config
from tests.trainer.traffic import sample_traffic
from trainer.distributed import init_distributed
from trainer.learner import RunUntil, train

RATINGS = {"judge": 1.0, "user": 0.0, "scraper": 5.0}
"""What each source says of every answer."""


@pytest.mark.parametrize("settings,trained", [
    ({}, (1.0 + 0.0 + 5.0) / 3),  # all three joined before the step: the mean of every source
    ({"reward.sources": ["judge", "user"], "reward.wait_for_sources": ["judge", "user"]}, 0.5),
])
def test_the_learner_trains_on_the_configured_sources(tmp_path, tiny_model_dir, settings, trained):
    cfg = tiny_config(tmp_path, **{"model.path": str(tiny_model_dir), "kafka.partitions": 1,
                                   "trainer.min_rollouts": 4, "trainer.max_rollouts_per_step": 4,
                                   "trainer.poll_timeout_s": 0.05, "mlflow.register_every": 100,
                                   "reward.aggregation": "mean", **settings})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    producer = backend.producer()
    traffic = sample_traffic(load_policy(tiny_model_dir), 4)
    for interaction in traffic:
        publish(producer, cfg.kafka.topics.interactions, interaction)
    for source, value in RATINGS.items():
        for interaction in traffic:
            publish(producer, cfg.kafka.topics.rewards,
                    Reward(interaction_id=interaction.interaction_id, value=value, source=source))
    producer.flush()
    seen: list[float] = []

    def before_step(rollouts):
        seen.extend(r.rewards[max(r.rewards)] for r in rollouts)
        return rollouts

    result = train(cfg, backend, init_distributed(), RunUntil(max_steps=1), before_step=before_step)

    assert seen == pytest.approx([trained] * 4)
    metrics = MlflowClient(cfg.mlflow_uri).get_run(result.run_id).data.metrics
    assert metrics["join_ignored_rewards"] == (4.0 if settings else 0.0)
    # each source's mean beside the others' (trainer/source_rewards.py), of the sources trained on
    shown = {"judge", "user"} if settings else set(RATINGS)
    assert {key for key in metrics if key.startswith("source.")} \
        == {f"source.{name}.{stat}" for name in shown for stat in ("reward", "count")}
    assert all(metrics[f"source.{name}.reward"] == RATINGS[name] and metrics[f"source.{name}.count"] == 4.0
               for name in shown)
