"""The learner loop end to end on the in-process stream backend (one process)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from online_sao.modeling import load_policy
from online_sao.schemas import DeadLetter, Reward, WeightsNotice, decode
from online_sao.weights import FileWeightStore
from streams.memory import InMemoryBackend
from streams.records import publish
from tests.fixtures.models import tiny_config
from tests.trainer.traffic import produce, sample_traffic
from trainer.checkpoint import Checkpointer, flatten_tensors, read_ledger
from trainer.distributed import init_distributed
from trainer.learner import RunUntil, train


def _config(tmp_path, model_dir, **overrides):
    return tiny_config(tmp_path, **{"model.path": str(model_dir), "kafka.partitions": 2,
                                    "trainer.min_rollouts": 4, "trainer.max_rollouts_per_step": 4,
                                    "trainer.poll_timeout_s": 0.05, "algorithm.policy_lr": 1e-3,
                                    "mlflow.register_every": 100, **overrides})


def _messages(backend: InMemoryBackend, topic: str):
    consumer = backend.consumer([topic])
    out = consumer.poll(timeout_s=0.1, max_records=10_000)
    consumer.close()
    return [decode(m.value) for m in out]


def test_trains_publishes_checkpoints_and_resumes(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, tiny_model_dir, **{"trainer.ledger_segment_bytes": 1})  # a segment per checkpoint
    topics = cfg.kafka.topics
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    base = load_policy(tiny_model_dir)
    traffic = sample_traffic(base, 12, prefix="a")
    producer = backend.producer()
    produce(producer, topics, traffic)
    producer.send(topics.interactions, b"{not json", key=b"bad")

    result = train(cfg, backend, init_distributed(), RunUntil(max_steps=3))

    assert result.steps == 3 and result.version == 3
    assert len(Checkpointer(cfg.checkpoint_dir).sealed_segments()) == 2  # steps 1 and 2; step 3's is current
    ledger = read_ledger(cfg.checkpoint_dir)
    assert sorted(iid for _, iid in ledger) == sorted(i.interaction_id for i in traffic)
    assert [step for step, _ in ledger] == [1] * 4 + [2] * 4 + [3] * 4
    store = FileWeightStore(cfg.weight_store_url)
    assert store.versions() == [1, 2, 3]
    notices = [n for n in _messages(backend, topics.weights) if isinstance(n, WeightsNotice)]
    assert [(n.version, n.step, n.action) for n in notices] == [(1, 1, "publish"), (2, 2, "publish"),
                                                                (3, 3, "publish")]
    published = store.load(notices[-1].location, notices[-1].checksum)
    changed = [k for k, v in base.state_dict().items() if not torch.equal(v, published[k])]
    assert changed, "three steps at lr 1e-3 must move the policy"
    (letter,) = _messages(backend, topics.dead_letters)
    assert isinstance(letter, DeadLetter) and letter.source_topic == topics.interactions

    ckpt = Checkpointer(cfg.checkpoint_dir).load_latest()
    assert (ckpt.state.step, ckpt.state.version) == (3, 3)
    assert ckpt.state.counters["dead_letters"] == 1
    end = {tp: backend.end_offset(tp) for tp in ckpt.state.offsets}
    assert ckpt.state.offsets == end and sum(end.values()) == 25
    assert ckpt.state.joiner["ready"] == [] and ckpt.state.joiner["counters"]["joined"] == 12

    # a second life continues the same run: same MLflow run, next step and version, no id twice
    more = sample_traffic(base, 4, prefix="b")
    produce(producer, topics, more)
    again = train(cfg, backend, init_distributed(), RunUntil(max_steps=1))
    assert again.run_id == result.run_id and again.version == 4
    ledger = read_ledger(cfg.checkpoint_dir)
    assert sorted(iid for step, iid in ledger if step == 4) == [i.interaction_id for i in more]
    assert len({iid for _, iid in ledger}) == len(ledger) == 16
    assert store.versions() == [2, 3, 4]


def test_few_ready_rollouts_train_after_max_wait_then_idle_stop(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, tiny_model_dir, **{"trainer.min_rollouts": 4, "trainer.max_wait_s": 0.5})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    base = load_policy(tiny_model_dir)
    traffic = sample_traffic(base, 3, prefix="w")
    producer = backend.producer()
    produce(producer, cfg.kafka.topics, traffic[:2])
    produce(producer, cfg.kafka.topics, traffic[2:], rewarded=False)

    result = train(cfg, backend, init_distributed(), RunUntil(idle_timeout_s=1.0))

    assert result.steps == 1  # 2 rollouts, fewer than min_rollouts, trained once they had waited
    assert sorted(i for _, i in read_ledger(cfg.checkpoint_dir)) == [t.interaction_id
                                                                                    for t in traffic[:2]]
    ckpt = Checkpointer(cfg.checkpoint_dir).load_latest()
    waiting = [e["interaction"]["interaction_id"] for e in ckpt.state.joiner["waiting"]]
    assert waiting == [traffic[2].interaction_id]
    # the checkpoint covers the waiting interaction's offset: it is in the state, not to be re-read
    assert sum(ckpt.state.offsets.values()) == 5


def test_pretrain_critic_fits_on_retained_history_before_the_first_step(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, tiny_model_dir, **{"trainer.min_rollouts": 10, "trainer.max_rollouts_per_step": 10,
                                               "algorithm.critic_warmup_steps": 2})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    produce(backend.producer(), cfg.kafka.topics, sample_traffic(load_policy(tiny_model_dir), 10, prefix="p"))

    result = train(cfg, backend, init_distributed(), RunUntil(max_steps=1), pretrain_critic=True)

    client = MlflowClient(tracking_uri=cfg.mlflow_uri)
    run = client.get_run(result.run_id)
    assert run.data.metrics["pretrain_train_rollouts"] + run.data.metrics["pretrain_held_out_rollouts"] == 10
    assert run.data.metrics["pretrain_epochs"] >= 1
    # the warm-up (2 updates) ran during pre-training: it ended at the configured rate, not half of it
    assert run.data.metrics["pretrain_lr_last"] == cfg.algorithm.critic_lr
    assert [m.step for m in client.get_metric_history(result.run_id, "pretrain_ev_after")] == [0]
    assert [m.step for m in client.get_metric_history(result.run_id, "value_loss")] == [1]


def test_pretrain_critic_on_a_restart_says_it_did_not_pre_train(tmp_path, tiny_model_dir, caplog):
    """The flag stays in an operator's restart script; the resumed learner went straight to its next step
    and said nothing, so the run looked pre-trained."""
    cfg = _config(tmp_path, tiny_model_dir, **{"trainer.min_rollouts": 4, "trainer.max_rollouts_per_step": 4})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    produce(backend.producer(), cfg.kafka.topics, sample_traffic(load_policy(tiny_model_dir), 8, prefix="p"))
    train(cfg, backend, init_distributed(), RunUntil(max_steps=1))

    with caplog.at_level("WARNING", logger="trainer.learner"):
        result = train(cfg, backend, init_distributed(), RunUntil(max_steps=1), pretrain_critic=True)

    assert result.steps == 1
    assert [r.getMessage() for r in caplog.records if "pre-training" in r.getMessage()] == [
        "value pre-training skipped: resuming from step 1; pre-training runs only on a fresh start (no checkpoint)"]
    assert "pretrain_epochs" not in MlflowClient(tracking_uri=cfg.mlflow_uri).get_run(result.run_id).data.metrics


def test_pretrain_critic_leaves_out_a_logged_rollout_past_the_models_vocabulary(tmp_path, tiny_model_dir):
    """One retained answer with a token id past the model's vocabulary (logged under another model):
    the feed leaves such a rollout out, value pre-training fed it to the critic, whose embedding
    raised, and the learner crashed again at every restart (no checkpoint yet: step 0 again)."""
    cfg = _config(tmp_path, tiny_model_dir, **{"trainer.min_rollouts": 10, "trainer.max_rollouts_per_step": 10})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    traffic = sample_traffic(load_policy(tiny_model_dir), 11, prefix="p")
    vocab_size = load_policy(tiny_model_dir).get_input_embeddings().num_embeddings
    traffic[0] = traffic[0].model_copy(update={"response_ids": [*traffic[0].response_ids[:-1], vocab_size + 7]})
    produce(backend.producer(), cfg.kafka.topics, traffic)

    result = train(cfg, backend, init_distributed(), RunUntil(max_steps=1), pretrain_critic=True)

    run = MlflowClient(tracking_uri=cfg.mlflow_uri).get_run(result.run_id)
    assert run.data.metrics["pretrain_train_rollouts"] + run.data.metrics["pretrain_held_out_rollouts"] == 10
    assert result.steps == 1


def _registry_rounds(tmp_path, model_dir, **overrides):
    """One partition, one version per step, the length monitor at 9: four rounds of 4 rewarded
    rollouts on the broker, round k stamped as sampled by version k, round 2's answers twice as long.
    Returns (config, backend)."""
    cfg = _config(tmp_path, model_dir, **{"kafka.partitions": 1, "mlflow.register_every": 1,
                                          "deploy.gate_min_rollouts": 4, "deploy.gate_min_ess": 1.0,
                                          "deploy.monitor_max_mean_length": 9.0, **overrides})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    producer = backend.producer()
    base = load_policy(model_dir)
    for version, length in ((0, 6), (1, 6), (2, 12), (3, 6)):
        for interaction in sample_traffic(base, 4, prefix=f"v{version}", max_new_tokens=length):
            interaction = interaction.model_copy(update={"versions": [version] * len(interaction.versions)})
            publish(producer, cfg.kafka.topics.interactions, interaction)
            publish(producer, cfg.kafka.topics.rewards, Reward(interaction_id=interaction.interaction_id, value=0.5))
    return cfg, backend


def test_a_registry_roll_back_starts_the_drift_detectors_books_again(tmp_path, tiny_model_dir, monkeypatch):
    from trainer.plasticity import DriftResponse

    cfg, backend = _registry_rounds(tmp_path, tiny_model_dir, **{"drift.enabled": True})
    histories = []
    forget = DriftResponse.after_registry_rollback

    def spied(self, republished_as):
        forget(self, republished_as)
        histories.append((republished_as, list(self.detector.history)))

    monkeypatch.setattr(DriftResponse, "after_registry_rollback", spied)
    result = train(cfg, backend, init_distributed(), RunUntil(max_steps=3))
    assert result.version == 4  # v2 rolled back to v1, republished as v4 (as in the test below)
    assert histories == [(4, [])]  # once, and the rejected line's rewards are gone


def test_registry_gate_promotes_then_a_monitor_rolls_back_the_whole_training_state(tmp_path, tiny_model_dir):
    # one partition: records are read in the order they were logged, so each step is one round;
    # round k is stamped as sampled by version k; round 2's answers are twice as long
    cfg, backend = _registry_rounds(tmp_path, tiny_model_dir)
    topics = cfg.kafka.topics

    result = train(cfg, backend, init_distributed(), RunUntil(max_steps=3))

    assert result.version == 4  # the champion's restored weights, published again under the next number
    announced = [n for n in _messages(backend, topics.weights) if isinstance(n, WeightsNotice)]
    notices = [n for n in announced if n.action != "champion"]  # what serving follows
    assert [(n.action, n.version) for n in notices] == [("publish", 1), ("publish", 2), ("publish", 3),
                                                        ("rollback", 1), ("publish", 4)]
    assert [(n.version, n.step) for n in announced if n.action == "champion"] == [(1, 2)]  # v1 promoted at step 2
    store = FileWeightStore(cfg.weight_store_url)
    v1, v4 = (store.load(n.location, n.checksum) for n in (notices[0], notices[-1]))
    assert v1.keys() == v4.keys() and all(torch.equal(v4[k], v) for k, v in v1.items())
    client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)
    model = cfg.mlflow.registered_model
    tags = {int(v.tags["policy_version"]): v.tags for v in client.search_model_versions(f"name = '{model}'")}
    assert tags[1]["decision"] == "promoted" and tags[1]["gate.decision"] == "no_champion"
    # v2 was decided on by the gate (both versions scored on the 4 rollouts stamped v2, the only ones
    # of the 12 trained that v2 was not trained on), then vetoed by a monitor
    assert tags[2]["decision"] == "rolled_back" and tags[2]["monitor.tripped"] == "mean_length"
    assert tags[2]["gate.n"] == "4" and tags[2]["gate.window_versions"] == "2-2"
    assert float(tags[2]["monitor.mean_length"]) == 12.0
    assert {"gate.low", "gate.high", "gate.candidate_ess", "gate.champion_ess"} <= set(tags[2])
    assert client.get_model_version_by_alias(model, "champion").tags["policy_version"] == "1"
    assert client.get_model_version_by_alias(model, "candidate").tags["policy_version"] == "1"
    run = client.get_run(result.run_id)
    assert run.data.metrics["monitor_mean_length"] == pytest.approx((4 * 6 + 4 * 6 + 4 * 12) / 12)

    # the whole state came back from v1's checkpoint (kept although older than the newest two)
    checkpointer = Checkpointer(cfg.checkpoint_dir)
    assert [step for step, _ in checkpointer.checkpoints()] == [1, 2, 3]
    champion_ckpt, latest = checkpointer.checkpoint_of_version(1), checkpointer.load_latest()
    assert champion_ckpt.state.step == 1 and latest.state.step == 3
    for name in ("policy", "critic"):
        assert all(torch.equal(latest.models[name][k], v) for k, v in champion_ckpt.models[name].items()), name
    flat_then, flat_now = {}, {}
    flatten_tensors(champion_ckpt.optimizers, flat_then)
    flatten_tensors(latest.optimizers, flat_now)
    assert flat_then.keys() == flat_now.keys() and all(torch.equal(flat_now[k], v) for k, v in flat_then.items())
    assert latest.state.counters["rollbacks"] == 1

    # the learner goes on from there: the next step trains from the restored state
    again = train(cfg, backend, init_distributed(), RunUntil(max_steps=1))
    assert again.version == 5
    after = Checkpointer(cfg.checkpoint_dir).load_latest()
    assert after.state.step == 4
    assert any(not torch.equal(after.models["policy"][k], v) for k, v in champion_ckpt.models["policy"].items())


def test_after_a_roll_back_the_answers_serving_then_samples_are_not_stale(tmp_path, tiny_model_dir):
    """With ``trainer.max_version_lag`` under the gap between the learner's number and the champion's,
    every answer serving sampled after the roll-back notice was dropped as stale: no step ran again,
    nothing was published, and serving stayed on the champion for good."""
    cfg, backend = _registry_rounds(tmp_path, tiny_model_dir, **{"trainer.max_version_lag": 1})
    topics = cfg.kafka.topics
    assert train(cfg, backend, init_distributed(), RunUntil(max_steps=3)).steps == 3  # rolled back to v1
    following = [n for n in _messages(backend, topics.weights) if isinstance(n, WeightsNotice)][-1].version
    producer = backend.producer()  # serving answers with the version the notices left it on
    for interaction in sample_traffic(load_policy(tiny_model_dir), 4, prefix="after", max_new_tokens=6):
        interaction = interaction.model_copy(update={"versions": [following] * len(interaction.versions)})
        publish(producer, topics.interactions, interaction)
        publish(producer, topics.rewards, Reward(interaction_id=interaction.interaction_id, value=0.5))
    again = train(cfg, backend, init_distributed(), RunUntil(max_steps=2, idle_timeout_s=5.0))
    assert again.steps == 2  # round 3's answers, then serving's since the roll-back
    assert sum(iid.startswith("after") for _, iid in read_ledger(cfg.checkpoint_dir)) == 4


def test_a_token_id_outside_the_vocabulary_is_left_out_and_training_goes_on(tmp_path, tiny_model_dir):
    """The record codec cannot know the model's vocabulary; the learner must not crash on it."""
    cfg = _config(tmp_path, tiny_model_dir, **{"trainer.max_wait_s": 0.2})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    policy = load_policy(tiny_model_dir)
    vocab = policy.get_input_embeddings().num_embeddings
    traffic = sample_traffic(policy, 8, prefix="v")
    bad = traffic[0].model_copy(update={"interaction_id": "v-outside",
                                        "prompt_ids": [vocab] + traffic[0].prompt_ids[1:]})
    producer = backend.producer()
    produce(producer, cfg.kafka.topics, [bad, *traffic])

    train(cfg, backend, init_distributed(), RunUntil(idle_timeout_s=1.0))

    trained = [iid for _, iid in read_ledger(cfg.checkpoint_dir)]
    assert sorted(trained) == sorted(i.interaction_id for i in traffic)
    assert Checkpointer(cfg.checkpoint_dir).load_latest().state.counters["invalid_rollouts"] == 1


def test_ema_reference_and_replay_window_are_checkpointed_and_resumed(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, tiny_model_dir, **{"algorithm.kl_beta": 0.1, "algorithm.kl_reference": "ema",
                                               "algorithm.kl_ema_rate": 0.5,
                                               "algorithm.critic_order": "replay_then_judge"})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    base = load_policy(tiny_model_dir)
    producer = backend.producer()
    produce(producer, cfg.kafka.topics, sample_traffic(base, 8, prefix="e"))

    train(cfg, backend, init_distributed(), RunUntil(max_steps=2))

    ckpt = Checkpointer(cfg.checkpoint_dir).load_latest()
    reference, policy = ckpt.models["reference"], ckpt.models["policy"]
    assert reference.keys() == policy.keys()
    moved = [k for k, v in base.state_dict().items() if not torch.equal(v, reference[k])]
    assert moved and any(not torch.equal(reference[k], policy[k]) for k in moved)  # between start and policy
    assert len(ckpt.state.algorithm["replay_window"]["rows"]) == 8

    produce(producer, cfg.kafka.topics, sample_traffic(base, 4, prefix="f"))
    again = train(cfg, backend, init_distributed(), RunUntil(max_steps=1))
    assert again.steps == 1
    resumed = Checkpointer(cfg.checkpoint_dir).load_latest()
    assert len(resumed.state.algorithm["replay_window"]["rows"]) == 12
    # the resumed reference went on from the checkpointed one: half way to the new policy
    for key in moved:
        torch.testing.assert_close(resumed.models["reference"][key],
                                   0.5 * reference[key] + 0.5 * resumed.models["policy"][key])


def test_a_reward_drop_restarts_the_policy_and_makes_the_restart_champion(tmp_path, tiny_model_dir):
    # one partition, 4 rollouts per step: rewards 1.0 for two steps, then 0.0 for two. With windows of
    # 8 and 4 the test first runs on step 3 (reference 1,...,1 | recent 0,0,0,0: drop 1, se 0 -> alarm)
    cfg = _config(tmp_path, tiny_model_dir, **{"kafka.partitions": 1, "mlflow.register_every": 100,
                                               "drift.enabled": True, "drift.reference": 8, "drift.recent": 4,
                                               "mlflow.log_every_steps": 1})  # each step's alarm is checked
    topics = cfg.kafka.topics
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    producer = backend.producer()
    base = load_policy(tiny_model_dir)
    for i, interaction in enumerate(sample_traffic(base, 16, prefix="d")):
        publish(producer, topics.interactions, interaction)
        publish(producer, topics.rewards, Reward(interaction_id=interaction.interaction_id, value=float(i < 8)))

    result = train(cfg, backend, init_distributed(), RunUntil(max_steps=4))

    # publish_every 1: v1, v2 after steps 1-2, v3 the restart after step 3, v4 after step 4
    announced = [n for n in _messages(backend, topics.weights) if isinstance(n, WeightsNotice)]
    notices = [n for n in announced if n.action != "champion"]  # what serving follows
    assert [(n.action, n.version) for n in notices] == [("publish", v) for v in (1, 2, 3, 4)]
    assert [(n.version, n.step) for n in announced if n.action == "champion"] == [(3, 3)]  # the restart
    store = FileWeightStore(cfg.weight_store_url)
    restart = store.load(notices[2].location, notices[2].checksum)
    assert all(torch.equal(restart[k], v) for k, v in base.state_dict().items())  # the starting weights
    client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)
    champion = client.get_model_version_by_alias(cfg.mlflow.registered_model, "champion")
    assert champion.tags["policy_version"] == "3" and champion.tags["gate.decision"] == "drift_restart"
    assert float(champion.tags["drift.drop"]) == 1.0
    run = client.get_run(result.run_id)
    assert run.data.metrics["drift_alarm"] == 0.0  # the last step's; the restart step logged 1.0
    assert run.data.metrics["drift_restarts"] == 1.0
    history = client.get_metric_history(result.run_id, "drift_alarm")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == [0.0, 0.0, 1.0, 0.0]


def test_with_rollback_first_a_reward_drop_publishes_the_weights_from_before_it_as_champion(tmp_path, tiny_model_dir):
    # rewards 1.0 for five steps of 4, then 0.0. The test fires at reward 23 (reference rewards
    # 8-15 all 1 | recent 16-23: 1, 0, 0, 0, drop 0.75, z 3.0); its reference window starts after
    # reward 11, and of the copies taken after rewards 4, 8, 12, 16 and 20 the newest before that is v2's
    cfg = _config(tmp_path, tiny_model_dir, **{"kafka.partitions": 1, "mlflow.register_every": 100,
                                               "drift.enabled": True, "drift.reference": 8, "drift.recent": 4,
                                               "drift.rollback_first": True, "trainer.keep_versions": 6})
    topics = cfg.kafka.topics
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    producer = backend.producer()
    for i, interaction in enumerate(sample_traffic(load_policy(tiny_model_dir), 24, prefix="r")):
        publish(producer, topics.interactions, interaction)
        publish(producer, topics.rewards, Reward(interaction_id=interaction.interaction_id, value=float(i < 20)))

    result = train(cfg, backend, init_distributed(), RunUntil(max_steps=6))

    announced = [n for n in _messages(backend, topics.weights) if isinstance(n, WeightsNotice)]
    notices = [n for n in announced if n.action != "champion"]  # what serving follows
    assert [(n.action, n.version) for n in notices] == [("publish", v) for v in range(1, 7)]
    assert [(n.version, n.step) for n in announced if n.action == "champion"] == [(6, 6)]  # the roll-back
    store = FileWeightStore(cfg.weight_store_url)
    versions = [store.load(n.location, n.checksum) for n in notices]
    same = [all(torch.equal(versions[-1][k], v) for k, v in w.items()) for w in versions[:-1]]
    assert same == [False, True, False, False, False]  # v6, the roll-back, is v2
    client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)
    champion = client.get_model_version_by_alias(cfg.mlflow.registered_model, "champion")
    assert champion.tags["policy_version"] == "6" and champion.tags["gate.decision"] == "drift_rollback"
    metrics = client.get_run(result.run_id).data.metrics
    assert metrics["drift_rollbacks"] == 1.0 and metrics["drift_restarts"] == 0.0


def _first_life_with_a_registry(tmp_path, model_dir, **trainer):
    """A learner that trained 4 steps on 16 rollouts, registering every second version; returns its
    config, its backend and a function that sends 16 more rollouts (ids starting with "b")."""
    cfg = _config(tmp_path, model_dir, **{"mlflow.register_every": 2,
                                          **{f"trainer.{k}": v for k, v in trainer.items()}})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    base = load_policy(model_dir)
    producer = backend.producer()
    produce(producer, cfg.kafka.topics, sample_traffic(base, 16, prefix="a"))
    train(cfg, backend, init_distributed(), RunUntil(max_steps=4))
    return cfg, backend, lambda: produce(producer, cfg.kafka.topics, sample_traffic(base, 16, prefix="b"))


def _pinned(client: MlflowClient, name: str) -> set[int]:
    """The policy versions of the registry's candidate and champion."""
    return {int(client.get_model_version_by_alias(name, alias).tags["policy_version"])
            for alias in ("candidate", "champion")}


def test_a_learner_whose_checkpoints_were_lost_prunes_neither_candidate_nor_champion(tmp_path, tiny_model_dir):
    """The registry's candidate and champion are protected from pruning by the registry itself: a
    learner restarted on an empty checkpoint directory reads them from it and keeps them. It starts
    from the base model, at the consumer group's committed offsets."""
    cfg, backend, second_traffic = _first_life_with_a_registry(tmp_path, tiny_model_dir, keep_versions=1)
    client = MlflowClient(cfg.mlflow_uri)
    name = cfg.mlflow.registered_model
    pinned = _pinned(client, name)
    store = FileWeightStore(cfg.weight_store_url)
    assert pinned and pinned <= set(store.versions())

    shutil.rmtree(cfg.checkpoint_dir)
    second_traffic()
    # the second life registers nothing before the store's first prune (register_every 2, versions 5..8)
    again = train(cfg, backend, init_distributed(), RunUntil(max_steps=1))

    assert again.version == 5  # numbered past the store's newest, from the base model
    assert pinned <= set(store.versions()), f"pruned: {sorted(pinned - set(store.versions()))}"
    again = train(cfg, backend, init_distributed(), RunUntil(max_steps=3))
    # it read on from the consumer group's offsets, committed after the first life's checkpoints
    trained = [iid for _, iid in read_ledger(cfg.checkpoint_dir)]
    assert len(trained) == 16 and all(iid.startswith("b") for iid in trained), trained


def test_a_learner_that_lost_checkpoints_and_store_numbers_past_the_weights_topic(tmp_path, tiny_model_dir):
    """With checkpoints and weight store both gone, the weights topic still says which versions were
    announced: the next one is numbered past them (before: v1 again, a number serving already ran)."""
    cfg, backend, second_traffic = _first_life_with_a_registry(tmp_path, tiny_model_dir)
    shutil.rmtree(cfg.checkpoint_dir)
    shutil.rmtree(FileWeightStore(cfg.weight_store_url).root)
    second_traffic()
    again = train(cfg, backend, init_distributed(), RunUntil(max_steps=1))
    assert again.version == 5


def test_the_store_keeps_the_newest_versions_and_the_candidate_and_champion_only(tmp_path, tiny_model_dir):
    """Versions registered earlier and no longer candidate or champion are pruned (each is a model
    directory in MLflow's artifacts): the store holds at most ``keep_versions`` + 2 versions
    however many were registered (before, one more model per registration, without end)."""
    cfg, backend, second_traffic = _first_life_with_a_registry(tmp_path, tiny_model_dir, keep_versions=1)
    second_traffic()
    train(cfg, backend, init_distributed(), RunUntil(max_steps=4))
    client = MlflowClient(cfg.mlflow_uri)
    name = cfg.mlflow.registered_model
    registered = {int(v.tags["policy_version"]) for v in client.search_model_versions(f"name = '{name}'")}
    held = set(FileWeightStore(cfg.weight_store_url).versions())
    assert len(registered) >= 4, registered  # versions 2, 4, 6, 8
    assert held == _pinned(client, name) | {8}, (held, registered)


def test_a_champion_whose_weights_are_gone_is_decided_on_as_none(tmp_path, tiny_model_dir):
    """A weight store that lost the champion's file (restored from an old copy, say) leaves the
    gate nothing to score it with: the learner goes on, its next candidate is decided as without a
    champion, and the decision says which champion's weights were missing."""
    cfg, backend, second_traffic = _first_life_with_a_registry(tmp_path, tiny_model_dir)
    client = MlflowClient(cfg.mlflow_uri)
    name = cfg.mlflow.registered_model
    champion = client.get_model_version_by_alias(name, "champion")
    Path(champion.tags["weights_location"]).unlink()

    second_traffic()
    again = train(cfg, backend, init_distributed(), RunUntil(max_steps=4))

    assert again.steps == 4
    decided = [v for v in client.search_model_versions(f"name = '{name}'")
               if v.tags.get("gate.champion_weights_missing") == f"v{champion.tags['policy_version']}"]
    assert len(decided) == 1 and decided[0].tags["gate.decision"] == "no_champion"
    assert client.get_model_version_by_alias(name, "champion").version == decided[0].version


def test_a_learner_keeps_mlflow_bounded_model_directories_and_metrics_every_n_steps(tmp_path, tiny_model_dir):
    """Seven steps of 4 rollouts (rewards 0.0, 0.1, ..., 2.7 in order), every version registered,
    ``mlflow.keep_registered_artifacts`` 1, ``mlflow.log_every_steps`` 3: the artifacts hold the
    champion's and the newest model directory, the other versions are tagged pruned; the cycles
    are logged at steps 3 and 6 and, at the stop, 7, the step rewards as the window's mean."""
    cfg = _config(tmp_path, tiny_model_dir, **{"kafka.partitions": 1, "mlflow.register_every": 1,
                                               "mlflow.keep_registered_artifacts": 1, "mlflow.log_every_steps": 3})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    producer = backend.producer()
    for i, interaction in enumerate(sample_traffic(load_policy(tiny_model_dir), 28, prefix="w")):
        publish(producer, cfg.kafka.topics.interactions, interaction)
        publish(producer, cfg.kafka.topics.rewards, Reward(interaction_id=interaction.interaction_id, value=i / 10))

    result = train(cfg, backend, init_distributed(), RunUntil(max_steps=7))

    assert result.version == 7
    client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)
    model = cfg.mlflow.registered_model
    assert client.get_model_version_by_alias(model, "champion").tags["policy_version"] == "1"
    assert client.get_model_version_by_alias(model, "candidate").tags["policy_version"] == "7"
    dirs = {d.name for d in (cfg.data_dir / "mlflow-artifacts").glob("*/artifacts/policy/v*")}
    assert dirs == {"v00000001", "v00000007"}
    pruned = {int(v.tags["policy_version"]): v.tags["weights_pruned"]
              for v in client.search_model_versions(f"name = '{model}'")}
    assert pruned == {1: "false", 2: "true", 3: "true", 4: "true", 5: "true", 6: "true", 7: "false"}

    def history(name):
        return [(m.step, m.value) for m in client.get_metric_history(result.run_id, name)]

    # step k trains rewards 4(k-1) .. 4k-1 (tenths): its mean reward is (4k - 2.5) / 10
    assert history("reward_mean") == [(3, pytest.approx(0.55)), (6, pytest.approx(1.75)), (7, pytest.approx(2.55))]
    assert history("policy_version") == [(3, 3.0), (6, 6.0), (7, 7.0)]
    assert [step for step, _ in history("step_time_s")] == [3, 6, 7]
