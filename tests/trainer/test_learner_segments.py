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
    run = client.get_run(result.run_id)
    metrics, tags = run.data.metrics, run.data.tags
    # step 1's rollouts seat red (2) and blue (1, ahead of "none" on sort order) and they keep their slots;
    # top 2 by traffic at the end are red (6) and blue (3) against "none" (3): its rewards are under other
    assert (tags["segment.slot1"], tags["segment.slot2"]) == ("red", "blue")
    assert (tags["segment.slot1.history"], tags["segment.slot2.history"]) == ("1 red", "1 blue")
    red = [r for s, r in zip(segments, rewards) if s == "red"]  # 6 rewards; the window keeps the last 3
    assert metrics["segment.slot1.reward"] == pytest.approx(sum(red[-3:]) / 3)
    assert metrics["segment.slot1.count"] == 3.0
    assert metrics["segment.slot2.reward"] == pytest.approx(sum(r for s, r in zip(segments, rewards)
                                                                if s == "blue") / 3)
    assert metrics["segment.other.reward"] == pytest.approx(sum(r for s, r in zip(segments, rewards)
                                                                if s is None) / 3)
    # the keys are the slots and other, never a label: 2 + 1 groups of reward and count (no scores sent)
    assert {name for name in metrics if name.startswith("segment.")} == {
        f"segment.{slot}.{field}" for slot in ("slot1", "slot2", "other") for field in ("reward", "count")}
    # v1 was decided on at v2 and v2 at v3: the KL of each from the starting policy, on its answers
    kl = [m.value for m in client.get_metric_history(result.run_id, "registry_monitor_kl")]
    assert len(kl) == 2 and all(math.isfinite(v) and v > 0 for v in kl)
    model = cfg.mlflow.registered_model
    tags = {int(v.tags["policy_version"]): v.tags for v in client.search_model_versions(f"name = '{model}'")}
    assert float(tags[1]["monitor.kl"]) == pytest.approx(kl[0]) and tags[1]["monitor.tripped"] == "none"
