"""``online-sao weights``: the topic read back, a hold's copy out of the learner's pruning, its release
(serving held and released over the real broker: tests/serving/test_live_server.py)."""

from __future__ import annotations

import pytest
import torch

from apps import weights_control
from apps.weights_control import HoldError, hold, read_weights_topic, release, run_weights_cli
from online_sao.config import load_config
from online_sao.schemas import MAX_HOLD_REASON_CHARS, WeightsNotice, decode
from online_sao.weights import FileWeightStore
from streams.base import StreamUnavailable
from streams.memory import InMemoryBackend
from streams.records import publish

MODEL = "online-sao"


@pytest.fixture
def cfg(tmp_path):
    return load_config(environ={}, overrides={"paths.data_dir": str(tmp_path)})


@pytest.fixture
def backend(cfg):
    b = InMemoryBackend(cfg.kafka)
    b.ensure_topics()
    return b


@pytest.fixture
def store(cfg):
    return FileWeightStore(cfg.weight_store_url)


def weights(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), float(version))}


def announce(backend, cfg, ref, action: str = "publish") -> WeightsNotice:
    notice = WeightsNotice(action=action, version=ref.version, location=ref.location, checksum=ref.checksum,
                           model=MODEL)
    producer = backend.producer()
    publish(producer, cfg.kafka.topics.weights, notice)
    producer.flush()
    return notice


def published(backend, cfg, store, *versions: int) -> dict:
    """Save and publish ``versions``; their refs by version."""
    refs = {v: store.save(v, weights(v)) for v in versions}
    for ref in refs.values():
        announce(backend, cfg, ref)
    return refs


def on_topic(backend, cfg) -> list[tuple[bytes, WeightsNotice]]:
    consumer = backend.consumer([cfg.kafka.topics.weights], group_id=None, start="earliest")
    try:
        return [(m.key, decode(m.value)) for m in consumer.poll(timeout_s=0.1, max_records=1000)]
    finally:
        consumer.close()


def test_the_topic_read_back_says_what_a_replica_follows_apart_from_the_newest_publish(backend, cfg, store):
    refs = published(backend, cfg, store, 1, 2, 3)
    announce(backend, cfg, refs[2], "rollback")
    announce(backend, cfg, refs[1], "champion")
    state = read_weights_topic(backend, cfg.kafka.topics.weights, MODEL)
    assert (state.published.version, state.following.version, state.champion.version) == (3, 2, 1)
    assert state.following.action == "rollback" and state.hold is None
    assert sorted(state.by_version) == [1, 2, 3]
    published(backend, cfg, store, 4)
    assert read_weights_topic(backend, cfg.kafka.topics.weights, MODEL).following.version == 4


def test_a_hold_copies_the_version_out_of_the_learners_pruning_and_announces_the_copy(backend, cfg, store):
    published(backend, cfg, store, 1, 2, 3)
    sent = hold(cfg, backend, reason="answers got rude")  # by default: what the replicas follow, v3
    assert (sent.action, sent.version, sent.reason) == ("hold", 3, "answers got rude")
    key, notice = on_topic(backend, cfg)[-1]
    assert key == b"online-sao#hold" and notice == sent
    published(backend, cfg, store, 4, 5)
    store.prune(keep_last=1)  # the learner's pruning (trainer.keep_versions 1)
    assert store.versions() == [5]
    assert torch.equal(FileWeightStore(cfg.weight_store_url).load(sent.location, sent.checksum)["w"],
                       weights(3)["w"])
    state = read_weights_topic(backend, cfg.kafka.topics.weights, MODEL)
    assert state.hold == sent


def test_a_hold_of_what_is_served_lands_on_the_version_the_learner_published_during_the_copy(
        backend, cfg, store, monkeypatch):
    """A learner publishing every few seconds moved serving from v3 to v4 while the hold copied v3 (15-20 s
    on a busy machine), and the hold of "what the replicas follow now" took every replica back to v3."""
    published(backend, cfg, store, 1, 2, 3)
    load = weights_control._load
    copied = []

    def learner_publishes_during_the_copy(store_, target):
        copied.append(target.version)
        if target.version == 3:
            published(backend, cfg, store, 4)
        return load(store_, target)

    monkeypatch.setattr(weights_control, "_load", learner_publishes_during_the_copy)
    sent = hold(cfg, backend)
    assert copied == [3, 4] and sent.version == 4
    assert torch.equal(held_copies(cfg).load(sent.location, sent.checksum)["w"], weights(4)["w"])


def test_a_publish_while_the_held_copy_is_written_moves_the_hold_too(backend, cfg, store, monkeypatch):
    """The topic was read again after loading the version, before writing its copy (the slow part): a publish
    during the write still took replicas back."""
    published(backend, cfg, store, 1, 2)
    save = FileWeightStore.save

    def learner_publishes_during_the_held_write(self, version, tensors):
        ref = save(self, version, tensors)
        if self.root.rstrip("/").endswith("/held") and version == 2:
            published(backend, cfg, store, 3)
        return ref

    monkeypatch.setattr(FileWeightStore, "save", learner_publishes_during_the_held_write)
    sent = hold(cfg, backend)
    assert sent.version == 3 and held_copies(cfg).versions() == [3]  # v2's copy, never held, is gone


def test_a_hold_of_what_is_served_outrun_by_the_learner_holds_the_last_copy_and_says_so(
        backend, cfg, store, monkeypatch, caplog):
    published(backend, cfg, store, 1)
    load = weights_control._load
    copied = []

    def a_publish_during_every_copy(store_, target):
        copied.append(target.version)
        published(backend, cfg, store, target.version + 1)
        return load(store_, target)

    monkeypatch.setattr(weights_control, "_load", a_publish_during_every_copy)
    with caplog.at_level("WARNING", logger="apps.weights_control"):
        sent = hold(cfg, backend)
    assert copied == [1, 2, 3, 4] and sent.version == 4  # HOLD_RETARGETS (3) copies again, then it holds
    assert "moved on to v5 while v4 was copied, 3 times: holding v4 takes them back to it" in caplog.text


def test_a_named_version_is_held_whatever_the_learner_publishes_during_the_copy(backend, cfg, store, monkeypatch):
    published(backend, cfg, store, 1, 2, 3)
    load = weights_control._load

    def learner_publishes_during_the_copy(store_, target):
        published(backend, cfg, store, 4)
        return load(store_, target)

    monkeypatch.setattr(weights_control, "_load", learner_publishes_during_the_copy)
    assert hold(cfg, backend, version=2).version == 2


def test_a_new_hold_replaces_the_earlier_copy_and_a_release_ends_the_hold(backend, cfg, store):
    published(backend, cfg, store, 1, 2)
    first = hold(cfg, backend, version=1)
    second = hold(cfg, backend, version=2)
    held = FileWeightStore(f"{cfg.weight_store_url}/held")
    assert held.versions() == [2] and first.location != second.location
    released = release(cfg, backend, reason="fixed")
    assert (released.action, released.version, released.reason) == ("release", 2, "fixed")
    assert on_topic(backend, cfg)[-1] == (b"online-sao#hold", released)
    assert read_weights_topic(backend, cfg.kafka.topics.weights, MODEL).hold is None
    assert release(cfg, backend) is None  # nothing held any more: nothing sent
    assert len(on_topic(backend, cfg)) == 5


def test_status_says_what_is_followed_held_and_can_be_held(backend, cfg, store, capsys):
    refs = published(backend, cfg, store, 1, 2, 3)
    announce(backend, cfg, refs[2], "rollback")
    store.delete(1)  # pruned by the learner
    assert run_weights_cli(cfg, backend, "status", None, False, None) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines[:3]] == ["newest published: v3", "followed: v2", "champion: none"]
    assert lines[3:] == ["hold: none (replicas follow the learner)",
                         "can be held: v2, v3 (named on the weights topic, weights still in the store)"]
    hold(cfg, backend, version=3, reason="checking")
    assert run_weights_cli(cfg, backend, "status", None, False, None) == 0
    held = [line for line in capsys.readouterr().out.splitlines() if line.startswith("hold:")]
    assert len(held) == 1 and held[0].startswith("hold: v3 (step 0, ")
    assert held[0].endswith(" s ago): checking; `online-sao weights release` ends it")


def test_holds_that_cannot_be_made_say_why_and_send_nothing(backend, cfg, store, capsys):
    with pytest.raises(HoldError, match="nothing is published yet"):
        hold(cfg, backend)
    with pytest.raises(HoldError, match="names no champion"):
        hold(cfg, backend, champion=True)
    published(backend, cfg, store, 1, 2)
    with pytest.raises(HoldError, match=r"^v7 was never published \(newest v2\); versions that can be held: v1, v2$"):
        hold(cfg, backend, version=7)
    store.delete(1)
    with pytest.raises(HoldError, match="v1's weights cannot be loaded .*trainer.keep_versions"):
        hold(cfg, backend, version=1)
    in_memory = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"weight_store": "mem://"})})
    with pytest.raises(HoldError, match="needs the file weight store"):
        hold(in_memory, backend, version=2)
    assert [n.action for _, n in on_topic(backend, cfg)] == ["publish", "publish"]
    assert run_weights_cli(cfg, backend, "hold", 7, False, None) == 1
    assert "online-sao weights hold: v7 was never published (newest v2)" in capsys.readouterr().err


def test_a_reason_too_long_is_refused_before_anything_is_copied_deleted_or_sent(backend, cfg, store):
    """The hold deleted the copy of the hold in force, then failed to build its notice (replicas held
    at a version whose copy was gone); the release was sent unvalidated, and every replica refused it."""
    published(backend, cfg, store, 1, 2)
    first = hold(cfg, backend, version=1)
    too_long = "x" * (MAX_HOLD_REASON_CHARS + 1)
    with pytest.raises(HoldError, match="reason"):
        hold(cfg, backend, version=2, reason=too_long)
    with pytest.raises(HoldError, match="reason"):
        release(cfg, backend, reason=too_long)
    assert FileWeightStore(f"{cfg.weight_store_url}/held").versions() == [1]
    assert on_topic(backend, cfg)[-1] == (b"online-sao#hold", first)
    assert run_weights_cli(cfg, backend, "release", None, False, too_long) == 1


def test_the_earlier_copy_is_deleted_only_once_the_new_hold_is_sent(backend, cfg, store, monkeypatch):
    published(backend, cfg, store, 1, 2)
    hold(cfg, backend, version=1)

    def broker_down(*_):
        raise StreamUnavailable("broker down")

    monkeypatch.setattr(weights_control, "_send", broker_down)
    with pytest.raises(StreamUnavailable):
        hold(cfg, backend, version=2)
    assert 1 in FileWeightStore(f"{cfg.weight_store_url}/held").versions()  # what the replicas still load


def test_a_hold_without_a_version_during_a_hold_keeps_the_held_version(backend, cfg, store, capsys):
    """It moved every replica from the held version to the learner's newest (what they would follow)."""
    published(backend, cfg, store, 1)
    first = hold(cfg, backend, reason="v1 rude?")
    published(backend, cfg, store, 2, 3)
    again = hold(cfg, backend, reason="still looking")
    assert (again.version, again.location, again.reason) == (1, first.location, "still looking")
    assert read_weights_topic(backend, cfg.kafka.topics.weights, MODEL).hold == again
    assert run_weights_cli(cfg, backend, "status", None, False, None) == 0
    assert "followed once released: v3" in capsys.readouterr().out


def test_a_release_sent_for_an_earlier_hold_leaves_the_hold_that_replaced_it(backend, cfg, store, capsys, caplog):
    """Operator A's release of v1 (the topic read while v1 was held) landed after operator B's hold of
    v2: `status` said nothing was held, as every replica then did."""
    published(backend, cfg, store, 1, 2, 3)
    first = hold(cfg, backend, version=1, reason="A: incident")
    stale = read_weights_topic(backend, cfg.kafka.topics.weights, MODEL).hold  # what A's release reads ...
    second = hold(cfg, backend, version=2, reason="B: pin v2")  # ... before B's hold lands
    assert stale == first
    weights_control._send(backend, cfg.kafka.topics.weights,
                          weights_control._notice(stale, action="release", reason="A done"))  # as release() sends it
    assert on_topic(backend, cfg)[-1][1].action == "release"
    assert read_weights_topic(backend, cfg.kafka.topics.weights, MODEL).hold == second
    assert "a release of v1 ignored: the hold in force is v2's" in caplog.text
    assert run_weights_cli(cfg, backend, "status", None, False, None) == 0
    assert any(line.startswith("hold: v2 (") for line in capsys.readouterr().out.splitlines())
    released = release(cfg, backend, reason="B done")  # the hold in force's release ends it
    assert (released.action, released.version) == ("release", 2)
    assert read_weights_topic(backend, cfg.kafka.topics.weights, MODEL).hold is None


def test_a_release_that_another_hold_overtook_sends_that_hold_again_and_says_so(backend, cfg, store, monkeypatch):
    """Operator B's hold of v2 lands between operator A's read and A's release of v1: replicas ignore
    the release, but it was the newest record under the hold key, which compaction would keep alone,
    so a replica starting later would not be held. The hold in force goes out again and A is told."""
    published(backend, cfg, store, 1, 2, 3)
    hold(cfg, backend, version=1, reason="A: incident")
    read = weights_control.read_weights_topic
    calls = []

    def b_holds_after_as_read(*args):
        state = read(*args)
        if not calls:  # A's first read: B's hold lands right after it
            calls.append("B")
            hold(cfg, backend, version=2, reason="B: pin v2")
        return state

    monkeypatch.setattr(weights_control, "read_weights_topic", b_holds_after_as_read)
    assert run_weights_cli(cfg, backend, "release", None, False, "A done") == 1
    monkeypatch.undo()
    last = on_topic(backend, cfg)[-1][1]
    assert (last.action, last.version) == ("hold", 2)  # the newest record under the hold key again
    assert read_weights_topic(backend, cfg.kafka.topics.weights, MODEL).hold.version == 2


def test_a_release_of_the_hold_in_force_ends_it(backend, cfg, store):
    published(backend, cfg, store, 1, 2)
    hold(cfg, backend, version=1)
    assert release(cfg, backend).version == 1
    assert read_weights_topic(backend, cfg.kafka.topics.weights, MODEL).hold is None


def held_copies(cfg) -> FileWeightStore:
    return FileWeightStore(f"{cfg.weight_store_url}/held")


def test_a_hold_that_lands_during_another_holds_clean_up_keeps_its_copy(backend, cfg, store, monkeypatch):
    """Operator B's whole hold of v3 ran between operator A's send of a hold of v1 and A's clean-up of
    held/: A deleted every copy but v1's, so the hold in force (v3) had none, and a replica starting
    during the hold could not load it."""
    published(backend, cfg, store, 1, 2, 3)
    send = weights_control._send

    def b_holds_after_as_send(backend_, topic, notice):
        send(backend_, topic, notice)
        if notice.reason == "A":
            hold(cfg, backend, version=3, reason="B")

    monkeypatch.setattr(weights_control, "_send", b_holds_after_as_send)
    hold(cfg, backend, version=1, reason="A")
    in_force = read_weights_topic(backend, cfg.kafka.topics.weights, MODEL).hold
    assert (in_force.version, in_force.reason) == (3, "B")
    assert held_copies(cfg).versions() == [3]
    assert torch.equal(held_copies(cfg).load(in_force.location, in_force.checksum)["w"], weights(3)["w"])


def test_a_hold_whose_copy_another_holds_clean_up_deleted_before_it_was_sent_writes_it_again(
        backend, cfg, store, monkeypatch):
    """Operator A's whole hold of v1 ran between operator B's copy of v2 and B's send: A's clean-up,
    reading v1 in force, deleted B's copy, and B's hold went out naming a file that was gone."""
    published(backend, cfg, store, 1, 2)
    send = weights_control._send

    def a_holds_before_bs_send(backend_, topic, notice):
        if notice.reason == "B":
            hold(cfg, backend, version=1, reason="A")
        send(backend_, topic, notice)

    monkeypatch.setattr(weights_control, "_send", a_holds_before_bs_send)
    hold(cfg, backend, version=2, reason="B")
    in_force = read_weights_topic(backend, cfg.kafka.topics.weights, MODEL).hold
    assert (in_force.version, in_force.reason) == (2, "B")
    assert held_copies(cfg).versions() == [2]
    held_copies(cfg).load(in_force.location, in_force.checksum)


def test_holding_the_held_version_again_copies_it_again_when_its_copy_is_gone(backend, cfg, store):
    """A held version whose copy is gone (deleted by hand, or by an older `weights hold` racing another):
    holding it again only sent the notice again, naming the missing file."""
    published(backend, cfg, store, 1, 2)
    first = hold(cfg, backend, version=1, reason="incident")
    held_copies(cfg).delete(1)
    for version, reason in ((1, "repair"), (None, "repair, no version")):
        again = hold(cfg, backend, version=version, reason=reason)
        assert again.version == 1 and again.location == first.location
        assert torch.equal(held_copies(cfg).load(again.location, again.checksum)["w"], weights(1)["w"])
        held_copies(cfg).delete(1)
    assert read_weights_topic(backend, cfg.kafka.topics.weights, MODEL).hold.reason == "repair, no version"


def test_holding_the_held_version_again_when_its_copy_and_its_notices_are_gone_says_so(backend, cfg, store):
    """Compaction kept the hold alone, and its copy is gone: nothing to copy from, said instead of
    sending the hold again naming the missing file."""
    store.save(1, weights(1))  # the learner's store still has it, but no notice on the topic names it
    held = held_copies(cfg).save(1, weights(1))
    announce(backend, cfg, held, action="hold")  # the topic after compaction: the hold, no learner notice of v1
    held_copies(cfg).delete(1)
    with pytest.raises(HoldError, match="copy is gone"):
        hold(cfg, backend, version=None, reason="repair")


def test_a_version_the_topic_does_not_name_is_said_never_published_or_compacted_with_what_can_be_held(
        backend, cfg, store, capsys):
    """`weights hold 999` (above anything published) and `weights hold -5` both said the topic "no longer
    names" them, listing every version the topic names where `weights status` lists fewer as holdable."""
    refs = {v: store.save(v, weights(v)) for v in (1, 2, 3, 4)}
    for v in (1, 3, 4):  # v2's notice compacted away (its file kept)
        announce(backend, cfg, refs[v])
    store.delete(1)  # pruned by the learner: named on the topic, but not holdable
    assert run_weights_cli(cfg, backend, "status", None, False, None) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("can be held: v3, v4 (")
    with pytest.raises(HoldError) as never:
        hold(cfg, backend, version=999)
    assert str(never.value) == "v999 was never published (newest v4); versions that can be held: v3, v4"
    with pytest.raises(HoldError) as compacted:
        hold(cfg, backend, version=2)
    assert str(compacted.value) == ("the weights topic no longer names v2 (compaction keeps the newest notice and "
                                    "the champion's); versions that can be held: v3, v4")
    with pytest.raises(HoldError, match="^versions are numbered from 0, got -5$"):
        hold(cfg, backend, version=-5)
    with pytest.raises(HoldError) as base:  # said "no longer names v0 (compaction ...)"
        hold(cfg, backend, version=0)
    assert str(base.value) == ("v0 is the base model (model.path), which the learner never publishes: it cannot be "
                               "held; versions that can be held: v3, v4")
    assert [n.action for _, n in on_topic(backend, cfg)] == ["publish"] * 3  # nothing sent
