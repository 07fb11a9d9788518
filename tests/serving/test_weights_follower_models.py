"""The weights follower and notices for other models: ignored, but said so once per name."""

from __future__ import annotations

import copy
import logging

import pytest

from online_sao.config import KafkaConfig
from online_sao.modeling import load_policy
from online_sao.schemas import WeightsNotice, encode
from online_sao.weights import InProcessWeightStore
from serving.engine.torch_engine import TorchEngine
from serving.weights_follower import WeightsFollower
from streams.memory import InMemoryBackend

TOPIC = KafkaConfig().topics.weights
WAIT_S = 30.0


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return load_policy(tiny_model_dir).eval()


def test_notices_for_another_model_are_warned_about_once_per_name_and_named_in_the_catch_up_state(
        base_model, caplog):
    backend = InMemoryBackend()
    backend.ensure_topics()
    store = InProcessWeightStore()
    producer = backend.producer()
    for version, model in [(1, "old-name"), (2, "old-name"), (3, "other")]:
        ref = store.save(version, {k: v.clone() for k, v in base_model.state_dict().items()})
        notice = WeightsNotice(action="publish", version=ref.version, location=ref.location,
                               checksum=ref.checksum, model=model)
        producer.send(TOPIC, encode(notice), key=b"online-sao")
    producer.flush()
    engine = TorchEngine(copy.deepcopy(base_model))
    follower = WeightsFollower(backend, TOPIC, store, engine, model_name="new-name")
    with caplog.at_level(logging.WARNING, logger="serving.weights_follower"):
        follower.start()
        try:
            assert follower.wait_for(lambda: follower.caught_up, WAIT_S)
        finally:
            follower.stop()
    assert engine.policy_version == 0  # readiness as before: the notices were not this model's
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warnings) == 2, warnings  # once per other name, not once per notice
    assert "'old-name'" in warnings[0] and "'new-name'" in warnings[0] and "serving.model_name" in warnings[0]
    assert follower.other_models == {"old-name", "other"}
    assert follower.catch_up_state.startswith("caught up on v0")
    assert "old-name, other" in follower.catch_up_state and "serving.model_name" in follower.catch_up_state
