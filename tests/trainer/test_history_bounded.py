"""The history read for value pre-training keeps the newest ``trainer.pretrain_max_rollouts`` usable
rollouts and holds no more than those and the join's open windows, however long the history."""

from __future__ import annotations

import math
import random
import weakref

import pytest
import torch

import streams.memory
import trainer.history
from online_sao.algorithms import build_optimizers
from online_sao.config import AlgorithmConfig, load_config
from online_sao.critic import ValueModel
from online_sao.schemas import encode
from streams.memory import InMemoryBackend
from streams.records import publish
from tests.trainer.fsdp_worker import VOCAB, tiny_policy
from tests.trainer.records import make_interaction, make_reward
from trainer.history import rollouts_from_file, rollouts_from_topics
from trainer.pretrain import pretrain_critic

START = 1_700_000_000.0
"""Record time of the first interaction of a history."""
EVERY_S = 30.0
"""Record time between interactions: with a 60 s reward window, two windows are open at a time."""
POLL_RECORDS = 20
"""Records one poll of the topics hands over (the in-memory consumer's default, 500, would hand over a
whole partition at once, which the join's clock waits out: trainer/join_clock.py)."""


def _config(tmp_path, **overrides):
    return load_config(environ={}, overrides={"paths.data_dir": str(tmp_path), "reward.window_s": 60.0,
                                              "reward.on_missing": "drop", "kafka.partitions": 1, **overrides})


def _history(count: int, seed: int = 0) -> list[tuple[float, object]]:
    """(record time, record): ``count`` interactions ``i<k>``, every third sampled by version 1, each
    rewarded 5 s after it with +1 for a low-token answer, -1 for a high one."""
    rng = random.Random(seed)
    records = []
    for k in range(count):
        at, low = START + EVERY_S * k, rng.random() < 0.5
        response = [rng.randrange(1, VOCAB // 2) if low else rng.randrange(VOCAB // 2, VOCAB)
                    for _ in range(rng.randint(2, 6))]
        records.append((at, make_interaction(f"i{k}", prompt=[rng.randrange(1, VOCAB) for _ in range(3)],
                                             response=response, version=1 if k % 3 == 1 else 0, created_at=at)))
        records.append((at + 5.0, make_reward(f"i{k}", 1.0 if low else -1.0).model_copy(
            update={"created_at": at + 5.0})))
    return records


def _file(tmp_path, records) -> object:
    path = tmp_path / "history.jsonl"
    path.write_bytes(b"".join(encode(record) + b"\n" for _, record in records))
    return path


class SmallPolls(InMemoryBackend):
    """Its consumers hand over at most :data:`POLL_RECORDS` records a poll, the partitions in turn,
    as Kafka's fetcher does with a byte limit per partition."""

    def consumer(self, *args, **kwargs):
        consumer = super().consumer(*args, **kwargs)
        poll = consumer.poll
        consumer.poll = lambda timeout_s=1.0, max_records=500: poll(timeout_s, min(max_records, POLL_RECORDS))
        return consumer


def _topics(cfg, records, monkeypatch) -> SmallPolls:
    """The records on the topics, stamped by the broker with their record times."""
    backend = SmallPolls(cfg.kafka)
    backend.ensure_topics()
    producer, topics = backend.producer(), cfg.kafka.topics
    for at, record in records:
        monkeypatch.setattr(streams.memory.time, "time", lambda at=at: at)
        publish(producer, topics.interactions if record.kind == "interaction" else topics.rewards, record)
    monkeypatch.undo()
    return backend


class HeldByTheRead:
    """Weak references to every record the read decodes and every rollout it builds: the most of
    them alive at once, counted at each record decoded, is what the read held."""

    def __init__(self, monkeypatch) -> None:
        self.records: list[weakref.ref] = []
        self.rollouts: list[weakref.ref] = []
        self.most_records = self.most_rollouts = 0
        decode, to_rollouts = trainer.history.decode, trainer.history.to_rollouts

        def decoding(*args, **kwargs):
            record = decode(*args, **kwargs)
            self.records.append(weakref.ref(record))
            self.most_records = max(self.most_records, _alive(self.records))
            self.most_rollouts = max(self.most_rollouts, _alive(self.rollouts))
            return record

        def building(*args, **kwargs):
            rollouts = to_rollouts(*args, **kwargs)
            self.rollouts += [weakref.ref(r) for r in rollouts]
            return rollouts

        monkeypatch.setattr(trainer.history, "decode", decoding)
        monkeypatch.setattr(trainer.history, "to_rollouts", building)


def _alive(refs: list[weakref.ref]) -> int:
    return sum(ref() is not None for ref in refs)


HISTORY = 300
"""Interactions in the long histories: 600 records, 150 times the windows open at a time."""
HELD_RECORDS = 3 * POLL_RECORDS
"""Most records the read may hold at once: the interactions of the open windows (two), and those the
join's clock holds back while the other topic's partition is a poll behind (trainer/join_clock.py)."""


def test_topic_history_read_holds_the_open_windows_not_the_history(tmp_path, monkeypatch):
    """Every rollout stayed in the join until the history was read: the records of all 300
    interactions were alive at the end (a week's retention ran the learner out of memory)."""
    cfg = _config(tmp_path)
    backend = _topics(cfg, _history(HISTORY), monkeypatch)
    held = HeldByTheRead(monkeypatch)
    rollouts = rollouts_from_topics(backend, cfg, version=0)
    assert len(rollouts) == HISTORY - HISTORY // 3
    assert held.most_records <= HELD_RECORDS


def test_file_history_read_holds_the_open_windows_not_the_history(tmp_path, monkeypatch):
    """The file's records were all decoded and held before the join began."""
    cfg = _config(tmp_path)
    records = _history(HISTORY)
    random.Random(1).shuffle(records)  # joined in record time whatever the line order
    path = _file(tmp_path, records)
    held = HeldByTheRead(monkeypatch)
    rollouts = rollouts_from_file(path, cfg, version=0)
    assert len(rollouts) == HISTORY - HISTORY // 3
    assert held.most_records <= HELD_RECORDS


KEEP = 10
"""``trainer.pretrain_max_rollouts`` of the bounded reads."""


def _keeping(cfg, most: int):
    """``cfg`` with ``trainer.pretrain_max_rollouts`` at ``most``."""
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"pretrain_max_rollouts": most})})


def test_history_longer_than_the_bound_keeps_its_newest_usable_rollouts(tmp_path, monkeypatch):
    """The newest in the order the join hands them out: the read order (offsets on the one partition;
    record time in the file). Version-1 rollouts and one past the vocabulary (i89, among the newest)
    do not count; fewer rollouts than the bound are the whole history, as before."""
    records = _history(90)
    records[-2] = (records[-2][0], make_interaction("i89", response=(8, VOCAB + 1), created_at=records[-2][0]))
    cfg, whole = _keeping(_config(tmp_path), KEEP), _keeping(_config(tmp_path), 90)
    backend, path = _topics(cfg, records, monkeypatch), _file(tmp_path, records)
    newest = [f"i{k}" for k in range(89) if k % 3 != 1][-KEEP:]
    for read in (lambda c: rollouts_from_topics(backend, c, 0, VOCAB), lambda c: rollouts_from_file(path, c, 0, VOCAB)):
        held = HeldByTheRead(monkeypatch)
        assert [r.interaction_id for r in read(cfg)] == newest
        assert held.most_rollouts <= KEEP
        assert [r.interaction_id for r in read(whole)][-KEEP:] == newest
        monkeypatch.undo()


FIT_AS_BEFORE = {"ev_before": 0.0, "ev_after": 0.816038162474271, "held_out_loss_before": 1.0,
                 "held_out_loss_after": 0.19382503470540322, "epochs": 5.0, "best_epoch": 3.0,
                 "value_loss_last": 0.16545841097831726, "train_rollouts": 32.0, "held_out_rollouts": 8.0}
"""What the read and the fit gave before either was bounded (the code of b6127a9), on the history of
:func:`test_small_history_fits_the_critic_as_before`."""
CRITIC_SUM_AS_BEFORE = -5.247203679253289
"""The sum of the fitted critic's trainable weights then."""


def test_small_history_fits_the_critic_as_before(tmp_path):
    """A history shorter than the bound, read from a file and fitted: the rollouts, the metrics and the
    critic's weights are those of the code that held everything and collated every batch up front."""
    cfg = _config(tmp_path)
    rollouts = rollouts_from_file(_file(tmp_path, _history(60, seed=3)), cfg, version=0, vocab_size=VOCAB)
    assert [r.interaction_id for r in rollouts] == [f"i{k}" for k in range(60) if k % 3 != 1]
    torch.manual_seed(0)
    algorithm = AlgorithmConfig(critic_lr=3e-2)
    policy = tiny_policy(0)
    critic = ValueModel.from_policy(policy, freeze_attention=algorithm.freeze_critic_attention)
    optimizer = build_optimizers(algorithm, policy, critic).critic
    fit = pretrain_critic(critic, optimizer, rollouts, algorithm, 0, max_epochs=8, patience=2, batch_size=4)
    assert {k: fit[k] for k in FIT_AS_BEFORE} == pytest.approx(FIT_AS_BEFORE, rel=1e-4, abs=1e-6)
    trained = sum(float(p.detach().double().sum()) for p in critic.parameters() if p.requires_grad)
    assert math.isclose(trained, CRITIC_SUM_AS_BEFORE, rel_tol=1e-4)


def test_ready_rollouts_past_the_joins_bound_are_taken_before_their_windows_end(tmp_path, monkeypatch):
    """With windows longer than the history nothing settles before the end: past
    ``trainer.join_max_pending`` ready rollouts the oldest is taken at once (its reward came already,
    so nothing is lost here), and the read holds no more than that many."""
    bound = 5
    cfg = _config(tmp_path, **{"reward.window_s": 2 * EVERY_S * HISTORY, "trainer.join_max_pending": bound})
    path = _file(tmp_path, _history(HISTORY))
    held = HeldByTheRead(monkeypatch)
    rollouts = rollouts_from_file(path, cfg, version=0)
    assert [r.interaction_id for r in rollouts] == [f"i{k}" for k in range(HISTORY) if k % 3 != 1]
    assert held.most_records <= bound + 2  # and the interaction and the reward just read


@pytest.mark.parametrize("records_after", [False, True])
def test_a_continuation_trains_the_same_turns_at_the_end_of_the_history_as_before_it(tmp_path, records_after):
    """p is answered and never rated (``on_missing: drop``), the user goes on 30 s later (c, rated). The
    read closed the windows still open at its end by moving the join's clock to infinity, which made the
    id memory forget every finished id: c, taken at the end, observed p's turn instead of training it;
    taken earlier (more history after it) it trained it."""
    from tests.trainer.records import conversation

    p, c = conversation(["p", "c"])
    at = lambda record, ts: record.model_copy(update={"created_at": ts, "completed_at": ts})  # noqa: E731
    records = [(START, at(p, START)), (START + 30.0, at(c, START + 30.0)),
               (START + 31.0, make_reward("c", 1.0).model_copy(update={"created_at": START + 31.0}))]
    if records_after:
        records += [(START + 200.0, make_interaction("later", created_at=START + 200.0)),
                    (START + 201.0, make_reward("later", 0.5).model_copy(update={"created_at": START + 201.0}))]
    cfg = _config(tmp_path, **{"reward.window_s": 10.0})
    continued = next(r for r in rollouts_from_file(_file(tmp_path, records), cfg, 0) if r.interaction_id == "c")
    assert int(sum(continued.action_mask)) == 4  # both turns sampled by the policy train: p's and c's
