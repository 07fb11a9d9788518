"""The learner stopped or killed at awkward moments (in memory): inside a registry roll-back, with a
dead letter the broker has not taken, before its first checkpoint, inside the drift detector's
windows. A restart must carry on as a learner that never stopped would."""

from __future__ import annotations

import pytest
import torch
from mlflow import MlflowClient

import trainer.learner as learner_module
from online_sao.modeling import load_policy
from online_sao.schemas import DeadLetter, Reward, WeightsNotice
from online_sao.weights import FileWeightStore
from streams.base import StreamUnavailable
from streams.memory import InMemoryBackend, InMemoryProducer
from streams.records import publish
from tests.trainer.test_learner_memory import _config, _messages, _registry_rounds
from tests.trainer.traffic import produce, sample_traffic
from trainer.checkpoint import Checkpointer
from trainer.distributed import init_distributed
from trainer.learner import RunUntil, train


class Stopped(Exception):
    """A stop request (or a kill) in the middle of what the learner does."""


def _stopped(*args, **kwargs):
    raise Stopped()


def _stopped_in_the_roll_back(tmp_path, model_dir, monkeypatch, name: str, replacement):
    """``_registry_rounds``' learner, its ``trainer.learner.<name>`` replaced by ``replacement``
    (which stops it inside the v2 roll-back) for three steps; (config, backend, a reader of the
    rejected v2's registry tags), the roll-back recorded and not yet carried out."""
    cfg, backend = _registry_rounds(tmp_path, model_dir)
    monkeypatch.setattr(learner_module, name, replacement)
    with pytest.raises(Stopped):
        train(cfg, backend, init_distributed(), RunUntil(max_steps=3))
    monkeypatch.undo()
    client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)

    def rejected() -> dict[str, str]:
        return client.get_model_version(cfg.mlflow.registered_model, "2").tags

    assert rejected()["decision"] == "rolled_back" and rejected()["rollback_carried_out"] == "false"
    return cfg, backend, rejected


def _champion_published_again(cfg, backend) -> int:
    """The newest publish of ``_registry_rounds``' champion v1's weights after its v2 was rolled back
    (the notices up to the roll-back as they must be); its version."""
    notices = [n for n in _messages(backend, cfg.kafka.topics.weights)
               if isinstance(n, WeightsNotice) and n.action != "champion"]  # what serving follows
    assert [(n.action, n.version) for n in notices[:5]] == [("publish", 1), ("publish", 2), ("publish", 3),
                                                            ("rollback", 1), ("publish", 4)]
    store = FileWeightStore(cfg.weight_store_url)
    v1 = store.load(notices[0].location, notices[0].checksum)
    again = [n for n in notices[4:] if n.action == "publish"
             and all(torch.equal(store.load(n.location, n.checksum)[k], v) for k, v in v1.items())]
    assert again, "v1's weights were not published again"
    return again[-1].version


def test_a_roll_back_stopped_after_the_registry_recorded_it_is_carried_out_when_the_learner_starts(
        tmp_path, tiny_model_dir, monkeypatch):
    """The learner stops after recording v2's roll-back, before the champion's weights go out again
    (the broker down, then a stop request). Restarted, it found candidate and champion one version
    and nothing to decide, resumed from its checkpoint of the rejected line and published that as v4,
    which serving followed over the roll-back. It now carries the roll-back out first."""
    cfg, backend, rejected = _stopped_in_the_roll_back(tmp_path, tiny_model_dir, monkeypatch, "republish", _stopped)
    train(cfg, backend, init_distributed(), RunUntil(max_steps=1))
    assert _champion_published_again(cfg, backend) == 4  # the champion's weights, not the rejected line's
    assert rejected()["rollback_carried_out"] == "v4"


def test_a_roll_back_whose_state_no_checkpoint_holds_yet_is_carried_out_again_after_a_crash(
        tmp_path, tiny_model_dir, monkeypatch):
    """The learner rolls v2 back to v1 and publishes v1's weights again as v4, then dies before the
    step's checkpoint commits: the newest checkpoint is still the rejected line's. The registry said
    the roll-back was carried out, so the restarted learner trained that line and published it as
    v5. It is now told so only once a checkpoint holds the restored state."""
    real_checkpoint = learner_module.checkpoint

    def killed_after_the_roll_back(models, at, rank0, ctx):
        if rank0 is not None and rank0.counters["rollbacks"] >= 1:
            raise Stopped()
        real_checkpoint(models, at, rank0, ctx)
    cfg, backend, rejected = _stopped_in_the_roll_back(tmp_path, tiny_model_dir, monkeypatch, "checkpoint",
                                                       killed_after_the_roll_back)
    train(cfg, backend, init_distributed(), RunUntil(max_steps=1))
    assert _champion_published_again(cfg, backend) == 5  # v4 went out before the crash; v5 at the restart
    assert rejected()["rollback_carried_out"] == "v5"


def test_a_dead_letter_the_broker_never_took_is_written_after_a_restart(tmp_path, tiny_model_dir):
    """The dead-letter topic refuses every send and the learner is stopped while it waits: the
    checkpoint was committed first, with offsets past the bad record, so the restart never read
    it again and its dead letter was lost. The checkpoint now waits for the dead letters."""
    cfg = _config(tmp_path, tiny_model_dir, **{"kafka.partitions": 1})
    until = RunUntil(max_steps=1)
    refused = []

    class Backend(InMemoryBackend):
        def producer(self):
            backend = self

            class Producer(InMemoryProducer):
                def send(self, topic, value, key=None, on_delivery=None):
                    if until is not None and topic == backend.cfg.topics.dead_letters:
                        refused.append(value)
                        if len(refused) > 1:  # sent again: the learner waits for it; SIGTERM now
                            until.stop.set()
                        raise StreamUnavailable("the dead-letter topic has no leader")
                    return super().send(topic, value, key, on_delivery)
            return Producer(self)

    backend = Backend(cfg.kafka)
    backend.ensure_topics()
    producer = InMemoryBackend.producer(backend)
    producer.send(cfg.kafka.topics.interactions, b"{not json", key=b"bad")
    produce(producer, cfg.kafka.topics, sample_traffic(load_policy(tiny_model_dir), 4, prefix="a"))
    with pytest.raises(StreamUnavailable):
        train(cfg, backend, init_distributed(), until)
    until = None  # the topic has a leader again
    produce(producer, cfg.kafka.topics, sample_traffic(load_policy(tiny_model_dir), 4, prefix="b"))
    train(cfg, backend, init_distributed(), RunUntil(max_steps=1))
    assert len([m for m in _messages(backend, cfg.kafka.topics.dead_letters) if isinstance(m, DeadLetter)]) == 1


def test_a_learner_that_died_before_its_first_checkpoint_pre_trains_again_on_the_starting_policy(
        tmp_path, tiny_model_dir, monkeypatch):
    """The first life published v1 and died before step 1's checkpoint: the restart holds model_dir's
    weights (version 0) but asked for logged rollouts of v1, found none and skipped pre-training."""
    cfg = _config(tmp_path, tiny_model_dir, **{"trainer.min_rollouts": 10, "trainer.max_rollouts_per_step": 10})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    produce(backend.producer(), cfg.kafka.topics, sample_traffic(load_policy(tiny_model_dir), 10, prefix="p"))
    monkeypatch.setattr(learner_module, "checkpoint", _stopped)
    with pytest.raises(Stopped):
        train(cfg, backend, init_distributed(), RunUntil(max_steps=1), pretrain_critic=True)
    monkeypatch.undo()
    assert FileWeightStore(cfg.weight_store_url).versions() == [1]
    again = train(cfg, backend, init_distributed(), RunUntil(max_steps=1), pretrain_critic=True)
    metrics = MlflowClient(tracking_uri=cfg.mlflow_uri).get_run(again.run_id).data.metrics
    assert metrics["pretrain_train_rollouts"] + metrics["pretrain_held_out_rollouts"] == 10


def test_a_learner_stopped_inside_the_detectors_window_raises_the_same_alarm_after_its_restart(
        tmp_path, tiny_model_dir):
    """The scenario above, stopped after step 2 and restarted: the detector's history was not
    checkpointed, so the restarted learner saw four rewards of 0.0 and no reference, and never
    restarted the policy that the uninterrupted learner restarts at step 3."""
    cfg = _config(tmp_path, tiny_model_dir, **{"kafka.partitions": 1, "mlflow.register_every": 100,
                                               "drift.enabled": True, "drift.reference": 8, "drift.recent": 4})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    producer = backend.producer()
    for i, interaction in enumerate(sample_traffic(load_policy(tiny_model_dir), 16, prefix="d")):
        publish(producer, cfg.kafka.topics.interactions, interaction)
        publish(producer, cfg.kafka.topics.rewards, Reward(interaction_id=interaction.interaction_id, value=float(i < 8)))
    train(cfg, backend, init_distributed(), RunUntil(max_steps=2))
    assert len(Checkpointer(cfg.checkpoint_dir).load_latest().state.drift["detector"]["history"]) == 8
    again = train(cfg, backend, init_distributed(), RunUntil(max_steps=2))
    assert MlflowClient(tracking_uri=cfg.mlflow_uri).get_run(again.run_id).data.metrics["drift_restarts"] == 1.0
    champion = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri).get_model_version_by_alias(
        cfg.mlflow.registered_model, "champion")
    assert champion.tags["gate.decision"] == "drift_restart" and champion.tags["policy_version"] == "3"


def test_a_stop_signal_to_a_rank_other_than_rank_0_stops_the_loop():
    """Only rank 0's stop signal counted: a rank whose pod alone was stopped (a node drain, a
    StatefulSet's rolling update) went on until its SIGKILL. Rank 1's view, on one process: its
    own signal is its stop vote (trainer.distributed.any_rank carries it to the other ranks)."""
    from trainer.distributed import DistContext

    rank1 = DistContext(rank=1, world_size=1, device=torch.device("cpu"))  # not distributed: its own vote back
    until = RunUntil()
    assert learner_module.next_rollouts(None, None, until, rank1, None).stop is False
    until.stop.set()  # its SIGTERM handler
    assert learner_module.next_rollouts(None, None, until, rank1, None).stop is True


def test_a_second_learner_on_one_checkpoint_directory_is_refused_until_the_first_stops(tmp_path, tiny_model_dir):
    """A replacement started before the learner it replaces stopped: both resumed the same checkpoint,
    published one version number with different weights, and then both stopped (the old one fenced
    out of its group, the new one refusing a checkpoint step the old one had written)."""
    from online_sao.config import ConfigError
    from trainer.startup import hold_checkpoint_dir

    cfg = _config(tmp_path, tiny_model_dir)
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    with hold_checkpoint_dir(cfg.checkpoint_dir):  # the first learner, running
        with pytest.raises(ConfigError, match=r"checkpoint_dir .* is in use by another learner \(pid \d+\)"):
            train(cfg, backend, init_distributed(), RunUntil(max_steps=1, idle_timeout_s=1))
    produce(backend.producer(), cfg.kafka.topics, sample_traffic(load_policy(tiny_model_dir), 4, prefix="a"))
    assert train(cfg, backend, init_distributed(), RunUntil(max_steps=1)).steps == 1  # once it has stopped
    assert train(cfg, backend, init_distributed(), RunUntil(max_steps=1, idle_timeout_s=1)).steps == 0  # released
