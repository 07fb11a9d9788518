"""The learner's segment slots across a restart: the same keys, and each slot's history (a run tag)
goes on in the reopened run."""

from __future__ import annotations

from mlflow import MlflowClient

from online_sao.modeling import load_policy
from streams.memory import InMemoryBackend
from tests.trainer.test_learner_memory import _config
from tests.trainer.traffic import produce, sample_traffic
from trainer.distributed import init_distributed
from trainer.learner import RunUntil, train


def test_a_restarted_learner_keeps_the_slot_keys_and_goes_on_with_the_slots_history(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, tiny_model_dir, **{"kafka.partitions": 1, "deploy.segments_top_n": 1,
                                               "trainer.checkpoint_in_background": False})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    producer = backend.producer()
    policy = load_policy(tiny_model_dir)
    produce(producer, cfg.kafka.topics, [i.model_copy(update={"segment": "red"})
                                         for i in sample_traffic(policy, 8, prefix="a")])
    first = train(cfg, backend, init_distributed(), RunUntil(max_steps=2))
    produce(producer, cfg.kafka.topics, [i.model_copy(update={"segment": "blue"})
                                         for i in sample_traffic(policy, 4, prefix="b")])
    again = train(cfg, backend, init_distributed(), RunUntil(max_steps=1))  # its books start afresh

    assert again.run_id == first.run_id
    run = MlflowClient(tracking_uri=cfg.mlflow_uri).get_run(again.run_id)
    assert run.data.tags["segment.slot1"] == "blue"
    assert run.data.tags["segment.slot1.history"] == "1 red\n3 blue"  # a figure at step 1 or 2 is red's
    assert {name for name in run.data.metrics if name.startswith("segment.")} == {"segment.slot1.reward",
                                                                                 "segment.slot1.count"}
