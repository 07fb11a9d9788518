"""An injected regression at a stable preference, rolled back on the live stack: the real
broker, real MLflow (SQLite), serving's engine following the weights topic, the learner
running :func:`trainer.learner.train` as in test_learner_kafka.py.

The scenario. The preference is stable (the reward pays for even token ids, as in
tests/trainer/traffic.py). From version :data:`INJECT_AT_VERSION` on, a gamed judge pays for
repetition instead: the reward is the share of an answer's tokens equal to its most frequent
token. The learner follows the reward, its answers collapse onto a few tokens and the reward
rises -- the gate alone would promote that. The repetition monitor (``deploy.monitor_max_repetition``)
must roll the candidate back to the champion, and the learner must go on from the champion's
whole training state.

The bound on when (docs/DEPLOY.md, "Rollback within N versions"): with one version per step,
a candidate is registered every ``R = mlflow.register_every`` versions and decided R versions
later on the answers of the versions in between, all of which the window holds when
``deploy.window >= R * rollouts per step``. So once every version from ``v*`` on repeats more
than the threshold, the candidate registered at the first multiple of R at or after ``v*`` is
rolled back when it is decided: at the latest at version ``v* + 2R - 1``.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from online_sao.schemas import Interaction, Reward, WeightsNotice, decode
from serving.engine.torch_engine import TorchEngine
from serving.weights_follower import WeightsFollower
from streams.kafka_backend import KafkaBackend
from streams.records import publish
from tests.fixtures.models import tiny_config
from tests.trainer.test_tracking import empty_store  # noqa: F401  (the module-scoped template store)
from tests.trainer.traffic import PROMPTS, engine_interaction, reward_of
from tests.trainer.live_loop import live_loop
from trainer.checkpoint import Checkpoint, Checkpointer, flatten_tensors

ROLLOUTS_PER_STEP = 8
REGISTER_EVERY = 3
WINDOW = 2 * REGISTER_EVERY * ROLLOUTS_PER_STEP
"""At least R versions' rollouts, so a decision sees every answer of its candidate's versions."""
INJECT_AT_VERSION = 2 * REGISTER_EVERY
"""The first version served under the gamed reward: by then v R was promoted at v 2R (the
first candidate has no champion to compare with), so there is a champion to return to."""
ROLLBACK_WITHIN = 2 * REGISTER_EVERY - 1
"""Versions from the first one whose answers (and every later one's) pass the threshold to the
roll-back (module docstring)."""
MAX_REPETITION = 0.5
"""Monitor threshold: half of an answer's bigrams repeat an earlier one of the same answer. A
sampled answer of a 512-token model repeats a few percent; one phrase over and over, nearly all."""
NGRAM = 2
ANSWER_TOKENS = 16
"""The tiny model never ends an answer early: every answer has 16 tokens, 15 bigrams."""
POLICY_LR = 1e-2
"""High, so the gamed reward collapses the tiny model's answers within :data:`MAX_ROUNDS` (about
30 versions after the injection here); at 3e-2 the stable phase itself degraded and the gate
rolled that candidate back first."""
MAX_ROUNDS = 60
"""Rounds (one step, one version each) the test waits for the roll-back before it fails."""
STEP_TIMEOUT_S = 240.0
"""One round's step, publish, decision and checkpoint; the first also loads the model and joins
the consumer group, on two shared cores."""


def repeated_bigram_share(answers: list[list[int]]) -> float:
    """The test's own count: bigrams that occurred earlier in the same answer, over all bigrams."""
    repeated = total = 0
    for answer in answers:
        grams = list(zip(answer, answer[1:]))
        repeated += sum(g in grams[:i] for i, g in enumerate(grams))
        total += len(grams)
    return repeated / total


def gamed_reward(interaction: Interaction) -> float:
    """The injected regression: pays for the share of the answer's most frequent token."""
    return Counter(interaction.response_ids).most_common(1)[0][1] / len(interaction.response_ids)


class Round:
    """The test plays serving and the judge: sample with the engine, log interactions and rewards."""

    def __init__(self, engine: TorchEngine, backend: KafkaBackend, topics) -> None:
        self.engine = engine
        self.producer = backend.producer()
        self.topics = topics

    def run(self, index: int, gamed: bool) -> list[Interaction]:
        batch = [engine_interaction(self.engine, PROMPTS[i % 2], f"r{index}-{i}", ANSWER_TOKENS,
                                    seed=1000 * index + i) for i in range(ROLLOUTS_PER_STEP)]
        for interaction in batch:
            publish(self.producer, self.topics.interactions, interaction)
            value = gamed_reward(interaction) if gamed else reward_of(interaction)
            publish(self.producer, self.topics.rewards,
                    Reward(interaction_id=interaction.interaction_id, value=value, source="test"))
        self.producer.flush()
        return batch


def _wait_for_checkpoint(root: Path, step: int, learner: threading.Thread) -> None:
    """The learner checkpoints every step after publishing and deciding: its step is complete."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while not (root / f"step-{step:08d}").is_dir():
        assert learner.is_alive(), "the learner thread died"
        assert time.monotonic() < deadline, f"step {step} not checkpointed within {STEP_TIMEOUT_S} s"
        time.sleep(0.1)


def _rollbacks(root: Path, step: int) -> int:
    """Roll-backs so far by the checkpoint of ``step`` (one notice each besides the step's publishes)."""
    return int(json.loads((root / f"step-{step:08d}" / "meta.json").read_text())["state"]["counters"]["rollbacks"])


def _notices_until(consumer, count: int) -> list[WeightsNotice]:
    """The next ``count`` publish and roll-back notices (they were flushed before the checkpoint). The
    registry's champion notices (since the canary, under a key of their own) are not the learner's
    versions and are left out: this test counted them, and failed at the first promotion."""
    out: list[WeightsNotice] = []
    deadline = time.monotonic() + 30.0
    while len(out) < count and time.monotonic() < deadline:
        read = [decode(m.value, WeightsNotice) for m in consumer.poll(0.5, 100)]
        out += [notice for notice in read if notice.action != "champion"]
    assert len(out) == count, [(n.action, n.version, n.step) for n in out]
    return out


def _wait_for_served(engine: TorchEngine, follower: WeightsFollower, version: int) -> None:
    assert follower.wait_for(lambda: engine.policy_version == version, timeout_s=60.0), \
        f"serving runs v{engine.policy_version}, not the announced v{version}"


def _same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _same_optimizer(a: Checkpoint, b: Checkpoint) -> bool:
    """Optimiser and scheduler states equal: every tensor and every other value."""
    tensors_a: dict[str, torch.Tensor] = {}
    tensors_b: dict[str, torch.Tensor] = {}
    return (flatten_tensors(a.optimizers, tensors_a) == flatten_tensors(b.optimizers, tensors_b)
            and _same_tensors(tensors_a, tensors_b))


def _adam_steps(ckpt: Checkpoint, name: str) -> float:
    steps = {float(slots["step"]) for slots in ckpt.optimizers[name]["state"].values()}
    assert len(steps) == 1, steps
    return steps.pop()


def _by_version(checkpointer: Checkpointer, version: int) -> Checkpoint:
    """The oldest kept checkpoint whose policy is published ``version``."""
    found = checkpointer.checkpoint_of_version(version)
    assert found is not None, f"no checkpoint of v{version} kept"
    return found


@pytest.mark.kafka
@pytest.mark.slow
def test_repetition_regression_is_rolled_back_and_the_learner_goes_on_from_the_champion(
        tmp_path, kafka_config, tiny_model_dir, empty_store):  # noqa: F811
    db = tmp_path / "mlflow.db"
    db.write_bytes(empty_store.read_bytes())
    cfg = tiny_config(tmp_path, **{
        "model.path": str(tiny_model_dir), "kafka": kafka_config.model_dump(),
        "mlflow.tracking_uri": f"sqlite:///{db}", "mlflow.register_every": REGISTER_EVERY,
        "trainer.min_rollouts": ROLLOUTS_PER_STEP, "trainer.max_rollouts_per_step": ROLLOUTS_PER_STEP,
        "trainer.max_wait_s": None, "trainer.poll_timeout_s": 0.1,
        "trainer.consumer_group": f"learner-{tmp_path.name}", "algorithm.policy_lr": POLICY_LR,
        "deploy.window": WINDOW, "deploy.monitor_ngram": NGRAM, "deploy.monitor_max_repetition": MAX_REPETITION,
    })
    topics = cfg.kafka.topics
    backend = KafkaBackend(cfg.kafka)
    notices_in = backend.consumer([topics.weights], group_id=None, start="earliest")
    notices: list[WeightsNotice] = []
    repetition: dict[int, float] = {}
    """The test's own count per version that sampled a round."""
    last_round: list[Interaction] = []
    try:
        with live_loop(cfg, backend, tiny_model_dir) as loop:
            engine = loop.engine
            traffic = Round(engine, backend, topics)
            try:
                for index in range(MAX_ROUNDS):
                    served = engine.policy_version
                    after_rollback = any(n.action == "rollback" for n in notices)
                    batch = traffic.run(index, gamed=index >= INJECT_AT_VERSION)
                    assert {v for i in batch for v in i.versions} == {served}
                    if after_rollback:
                        last_round = batch
                    else:
                        assert served == index  # one round, one step, one version
                        repetition[served] = repeated_bigram_share([i.response_ids for i in batch])
                    _wait_for_checkpoint(cfg.checkpoint_dir, index + 1, loop.learner)
                    # a roll-back adds two notices: the roll-back, and the champion's weights republished
                    # at once under the learner's next number (since 2026-12-06)
                    notices += _notices_until(notices_in,
                                              index + 1 + 2 * _rollbacks(cfg.checkpoint_dir, index + 1) - len(notices))
                    _wait_for_served(engine, loop.follower, notices[-1].version)
                    if after_rollback:  # one round served by the restored policy and trained on: enough
                        break
            finally:
                traffic.producer.close()
    finally:
        notices_in.close()
    store = loop.store

    rollbacks = [(i, n) for i, n in enumerate(notices) if n.action == "rollback"]
    newest = [(n.action, n.version) for n in notices][-4:]
    assert len(rollbacks) == 1, f"expected one roll-back within {MAX_ROUNDS} versions; the newest notices: {newest}"
    at, back = rollbacks[0]
    decided_at = notices[at - 1]
    assert decided_at.action == "publish" and decided_at.step == back.step  # announced at the deciding release
    champion = back.version

    # the evidence in MLflow: the monitor tripped on the candidate, which goes back to the champion
    client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)
    model = cfg.mlflow.registered_model
    tags = {int(v.tags["policy_version"]): v.tags for v in client.search_model_versions(f"name = '{model}'")}
    (candidate,) = [v for v, t in tags.items() if t.get("decision") == "rolled_back"]
    assert candidate == decided_at.version - REGISTER_EVERY
    assert "repetition" in tags[candidate]["monitor.tripped"].split(",")
    assert float(tags[candidate]["monitor.repetition"]) > MAX_REPETITION
    assert all(t.get("decision") != "rolled_back" for v, t in tags.items() if v < INJECT_AT_VERSION)
    assert client.get_model_version_by_alias(model, "champion").tags["policy_version"] == str(champion)
    assert client.get_model_version_by_alias(model, "candidate").tags["policy_version"] == str(champion)

    # within the stated bound of the first version from which every served version repeats
    assert all(repetition[v] <= MAX_REPETITION for v in range(INJECT_AT_VERSION)), repetition
    sampled = [v for v in sorted(repetition) if v < decided_at.version]
    first_over = next((v for v in sampled if all(repetition[u] > MAX_REPETITION for u in sampled if u >= v)), None)
    assert first_over is not None, repetition
    assert decided_at.version <= first_over + ROLLBACK_WITHIN, (decided_at.version, first_over, repetition)

    # serving followed the roll-back: the round after it was sampled by the champion's weights,
    # republished under the learner's next number
    republished = notices[at + 1]
    assert (republished.action, republished.version, republished.step) == ("publish", decided_at.version + 1,
                                                                           decided_at.step)
    assert {v for i in last_round for v in i.versions} == {republished.version}

    # the learner went on from the champion's whole state: the checkpoint taken at the deciding
    # step (of the republished version) holds the champion's policy, critic and optimiser state
    # exactly; the next version is one step on from them
    checkpointer = Checkpointer(cfg.checkpoint_dir)
    kept = _by_version(checkpointer, champion)
    restored = _by_version(checkpointer, republished.version)
    following = _by_version(checkpointer, republished.version + 1)
    assert _same_tensors(store.load(republished.location, republished.checksum), kept.models["policy"])
    assert _same_tensors(restored.models["policy"], kept.models["policy"])
    assert _same_tensors(restored.models["critic"], kept.models["critic"])
    assert _same_optimizer(restored, kept)
    assert _adam_steps(following, "policy") == _adam_steps(kept, "policy") + 1
    assert _adam_steps(following, "critic") == _adam_steps(kept, "critic") + cfg.algorithm.critic_updates
    assert not _same_tensors(following.models["policy"], kept.models["policy"])
    published = store.load(notices[-1].location, notices[-1].checksum)
    assert notices[-1].version == republished.version + 1
    assert _same_tensors(published, following.models["policy"])
    history = client.get_metric_history(
        client.search_runs([client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id])[0].info.run_id,
        "rollbacks")
    assert max(m.value for m in history) == 1.0
    assert math.isfinite(float(tags[candidate]["monitor.mean_length"]))
