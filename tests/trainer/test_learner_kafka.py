"""The learner on the real broker with a serving engine in the loop, and MLflow.

The test plays the rest of the service: serving's TorchEngine samples
interactions (so behaviour log-probs and versions are the engine's own), they and
their rewards are logged to Kafka, and serving's WeightsFollower keeps the engine
on the newest published version. The learner runs in a thread. Per round:
4 rollouts -> one step -> one version.
"""

from __future__ import annotations

import threading
import time

import pytest
from mlflow import MlflowClient

from online_sao.schemas import WeightsNotice, decode
from serving.engine.torch_engine import TorchEngine
from serving.weights_follower import WeightsFollower
from streams.kafka_backend import KafkaBackend
from tests.fixtures.kafka import drain
from tests.fixtures.models import tiny_config
from tests.trainer.live_loop import live_loop
from tests.trainer.traffic import PROMPTS, engine_interaction, produce, reward_of

ROUNDS = 4


def judge_scores(interaction) -> dict[str, float]:
    """A judge's named scores on the reward record: a quality that differs between answers."""
    return {"quality": 0.25 + 0.5 * reward_of(interaction)}
NOTICE_TIMEOUT_S = 240.0
"""First notice: the learner loads the model and joins its consumer group on two shared cores."""


def _wait_for_version(engine: TorchEngine, follower: WeightsFollower, version: int,
                      learner: threading.Thread) -> None:
    deadline = time.monotonic() + NOTICE_TIMEOUT_S
    while time.monotonic() < deadline:
        assert learner.is_alive(), "the learner thread died"
        if follower.wait_for(lambda: engine.policy_version >= version, timeout_s=1.0):
            return
    raise AssertionError(f"serving did not reach version {version} within {NOTICE_TIMEOUT_S} s")


@pytest.mark.kafka
@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_learner_trains_publishes_and_serving_follows(tmp_path, kafka_config, tiny_model_dir, compile):
    """``compiled``: the same loop with ``trainer.compile`` (slow: the learner compiles its bodies first)."""
    cfg = tiny_config(tmp_path, **{
        "model.path": str(tiny_model_dir), "kafka": kafka_config.model_dump(), "trainer.compile": compile,
        "trainer.min_rollouts": 4, "trainer.max_rollouts_per_step": 4, "trainer.max_wait_s": None,
        "trainer.poll_timeout_s": 0.1,
        "trainer.consumer_group": f"learner-{tmp_path.name}", "algorithm.policy_lr": 1e-3,
        "mlflow.register_every": 2, "mlflow.log_every_steps": 1,  # each step's metrics are checked
    })
    topics = cfg.kafka.topics
    backend = KafkaBackend(cfg.kafka)
    producer = backend.producer()
    sent = []
    try:
        with live_loop(cfg, backend, tiny_model_dir) as loop:
            engine = loop.engine
            served = [engine.policy_version]
            for round_ in range(ROUNDS):
                batch = [engine_interaction(engine, PROMPTS[i % 2], f"r{round_}-{i}", seed=10 * round_ + i)
                         for i in range(4)]
                assert {v for i in batch for v in i.versions} == {engine.policy_version}
                produce(producer, topics, batch, scores=judge_scores)
                sent += batch
                _wait_for_version(engine, loop.follower, round_ + 1, loop.learner)
                served.append(engine.policy_version)
    finally:
        producer.close()
    store = loop.store

    assert served == [0, 1, 2, 3, 4]
    weights = backend.consumer([topics.weights], group_id=None, start="earliest")
    announced = [decode(m.value, WeightsNotice) for m in drain(weights, 5)]
    weights.close()
    notices = [n for n in announced if n.action != "champion"]  # what serving follows
    assert [(n.version, n.step, n.action) for n in notices] == [(v, v, "publish") for v in range(1, 5)]
    assert [n.version for n in announced if n.action == "champion"] == [2]  # decided (promoted) at v4
    assert 2 in store.versions()  # registered: kept however far pruning goes

    client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id])
    assert run.data.params["trainer.min_rollouts"] == "4"
    assert run.data.params["trainer.compile"] == str(compile)
    for name in ("reward_mean", "value_loss", "explained_variance", "kept_frac", "masked_below_frac",
                 "masked_above_frac", "approx_kl", "version_lag_mean", "rollouts_per_s", "tokens_per_s",
                 "step_time_s", "data_wait_share", "join_joined", "policy_version"):
        history = client.get_metric_history(run.info.run_id, name)
        assert [m.step for m in history] == [1, 2, 3, 4], name
    assert [m.value for m in client.get_metric_history(run.info.run_id, "join_joined")] == [4, 8, 12, 16]
    # each round's records were all read before its step (the next round waits for its version)
    for name in ("unread_interactions", "unread_rewards", "join_waiting", "join_ready"):
        assert [m.value for m in client.get_metric_history(run.info.run_id, name)] == [0, 0, 0, 0], name
    ages = {name: [m.value for m in client.get_metric_history(run.info.run_id, name)]
            for name in ("data_age_mean_s", "data_age_max_s")}
    assert all(0 < mean <= oldest < NOTICE_TIMEOUT_S for mean, oldest in zip(*ages.values())), ages
    # the judge's scores went through the broker and the join to the monitors: every step the
    # quality over the whole window (all rollouts so far), and at the decision on v2 (at v4) over
    # the answers of v2 and v3, the rounds 2 and 3
    quality = [judge_scores(i)["quality"] for i in sent]
    monitor = [m.value for m in client.get_metric_history(run.info.run_id, "monitor_score_quality")]
    assert monitor == pytest.approx([sum(quality[:4 * k]) / (4 * k) for k in range(1, 5)])
    assert client.get_run(run.info.run_id).data.tags["segment.slot1"] == "none"  # no request named a user
    segment = client.get_metric_history(run.info.run_id, "segment.slot1.score_quality")
    assert segment[-1].value == pytest.approx(sum(quality) / len(quality))
    decision = client.get_metric_history(run.info.run_id, "registry_monitor_score_quality")
    assert [(m.step, m.value) for m in decision] == [(4, pytest.approx(sum(quality[8:]) / 8))]
    # v2 was the candidate; with no champion yet it was promoted at v4 (no gate to run)
    model = cfg.mlflow.registered_model
    assert client.get_model_version_by_alias(model, "champion").tags["policy_version"] == "2"
    assert client.get_model_version_by_alias(model, "candidate").tags["policy_version"] == "4"
