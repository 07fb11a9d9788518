"""The learner's per-segment rewards and KL monitor, end to end on the in-process backend."""

from __future__ import annotations

import math

import pytest
from mlflow import MlflowClient

from online_sao.modeling import load_policy
from online_sao.schemas import Reward
from streams.memory import InMemoryBackend
from streams.records import publish
from tests.trainer.test_learner_memory import _config
from tests.trainer.traffic import sample_traffic
from trainer.distributed import init_distributed
from trainer.learner import RunUntil, train


def test_rewards_per_segment_and_the_kl_monitor_reach_mlflow(tmp_path, tiny_model_dir):
    # one partition: records are trained in the order they were logged, four per step
    cfg = _config(tmp_path, tiny_model_dir, **{"kafka.partitions": 1, "mlflow.register_every": 1,
                                               "deploy.segments_top_n": 2, "deploy.segments_window": 3,
                                               "deploy.monitor_max_kl": 10.0})
    topics = cfg.kafka.topics
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    producer = backend.producer()
    segments = ["red", "blue", "red", None] * 3
    rewards = [0.1 * i for i in range(12)]
    for version in range(3):
        for j, interaction in enumerate(sample_traffic(load_policy(tiny_model_dir), 4, prefix=f"v{version}")):
            i = 4 * version + j
            interaction = interaction.model_copy(update={"versions": [version] * len(interaction.versions),
                                                         "segment": segments[i]})
            publish(producer, topics.interactions, interaction)
            publish(producer, topics.rewards, Reward(interaction_id=interaction.interaction_id, value=rewards[i]))

    result = train(cfg, backend, init_distributed(), RunUntil(max_steps=3))

    client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)
    metrics = client.get_run(result.run_id).data.metrics
    red = [r for s, r in zip(segments, rewards) if s == "red"]  # 6 rewards; the window keeps the last 3
    assert metrics["segment.red.reward"] == pytest.approx(sum(red[-3:]) / 3)
    assert metrics["segment.red.count"] == 3.0
    # top 2 by traffic are red (6) and blue (3) against "none" (3): the tie goes to blue (sort order);
    # the rewards without a segment are under other
    assert metrics["segment.blue.reward"] == pytest.approx(sum(r for s, r in zip(segments, rewards)
                                                               if s == "blue") / 3)
    assert metrics["segment.other.reward"] == pytest.approx(sum(r for s, r in zip(segments, rewards)
                                                                if s is None) / 3)
    assert not any(name.startswith("segment.none.") for name in metrics)
    # v1 was decided on at v2 and v2 at v3: the KL of each from the starting policy, on its answers
    kl = [m.value for m in client.get_metric_history(result.run_id, "registry_monitor_kl")]
    assert len(kl) == 2 and all(math.isfinite(v) and v > 0 for v in kl)
    model = cfg.mlflow.registered_model
    tags = {int(v.tags["policy_version"]): v.tags for v in client.search_model_versions(f"name = '{model}'")}
    assert float(tags[1]["monitor.kl"]) == pytest.approx(kl[0]) and tags[1]["monitor.tripped"] == "none"
