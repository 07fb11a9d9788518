"""The weights follower: converge on the newest version, obey rollbacks, survive bad versions."""

from __future__ import annotations

import copy
import logging
import time

import pytest
import torch
from safetensors.torch import save as save_safetensors

from online_sao.config import KafkaConfig
from online_sao.modeling import load_policy
from online_sao.schemas import DeadLetter, WeightsNotice, decode, encode
from online_sao.weights import FileWeightStore, InProcessWeightStore, sha256_hex
from serving.engine.canary import CanaryEngine
from serving import weights_follower
from serving.engine.torch_engine import TorchEngine
from serving.weights_follower import WeightsFollower
from serving.weights_hold import plan
from streams.base import StreamUnavailable
from streams.memory import InMemoryBackend

TOPIC = KafkaConfig().topics.weights
DEAD = KafkaConfig().topics.dead_letters
WAIT_S = 30.0
PROBE = "model.norm.weight"
"""A parameter whose value tells the versions apart (set to the version number)."""


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return load_policy(tiny_model_dir).eval()


def state_for(base_model, version: int) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in base_model.state_dict().items()}
    state[PROBE] = torch.full_like(state[PROBE], float(version))
    return state


def served(engine: TorchEngine) -> float:
    """The probe value of the weights the engine serves (its version, by construction)."""
    return float(engine._model.state_dict()[PROBE][0])


@pytest.fixture
def backend():
    b = InMemoryBackend()
    b.ensure_topics()
    return b


def notice(ref, action="publish") -> WeightsNotice:
    return WeightsNotice(action=action, version=ref.version, location=ref.location, checksum=ref.checksum)


def send(backend, *records) -> None:
    producer = backend.producer()
    for r in records:
        producer.send(TOPIC, r if isinstance(r, bytes) else encode(r), key=b"online-sao")
    producer.flush()


class Following:
    """An engine with a running follower; results collected in order."""

    def __init__(self, backend, store, base_model, **kwargs):
        self.engine = TorchEngine(copy.deepcopy(base_model))
        self.results = []
        self.follower = WeightsFollower(backend, TOPIC, store, self.engine, on_result=self.results.append, **kwargs)
        self.follower.start()

    def caught_up(self, n_records: int) -> None:
        assert self.follower.wait_for(lambda: self.follower.consumed >= n_records, WAIT_S)

    def close(self) -> None:
        self.follower.stop()


def failing_first(call, errors: list[Exception]):
    """``call``, raising (and taking) the last of ``errors`` instead while any are left."""
    def wrapped(*args, **kwargs):
        if errors:
            raise errors.pop()
        return call(*args, **kwargs)
    return wrapped


def test_plan_keeps_only_the_lasting_notice_first():
    def n(v, action="publish"):
        return WeightsNotice(action=action, version=v, location=f"mem://{v}", checksum="0" * 64)

    assert [(x.version, f) for x, f in plan([n(1), n(2), n(3)], current=0)] == [(3, False), (2, False), (1, False)]
    assert plan([n(1), n(2)], current=5) == []
    chain = plan([n(6), n(2, "rollback"), n(4), n(3)], current=5)
    assert [(x.version, f) for x, f in chain] == [(4, True), (2, True), (6, False)]


def test_follows_publishes_and_ignores_older_versions(backend, base_model):
    store = InProcessWeightStore()
    refs = {v: store.save(v, state_for(base_model, v)) for v in (1, 2, 3)}
    f = Following(backend, store, base_model)
    try:
        send(backend, notice(refs[1]))
        f.caught_up(1)
        assert f.engine.policy_version == 1 and served(f.engine) == 1.0
        send(backend, notice(refs[3]), notice(refs[2]))  # 2 arrives after 3: older, ignored
        f.caught_up(3)
        assert f.engine.policy_version == 3 and served(f.engine) == 3.0
        send(backend, notice(refs[2]))
        f.caught_up(4)
        assert f.engine.policy_version == 3 and served(f.engine) == 3.0
        assert [(r.version, r.applied) for r in f.results] == [(1, True), (3, True)]  # 2 never loaded
    finally:
        f.close()


def test_rollback_forces_an_older_version(backend, base_model):
    store = InProcessWeightStore()
    refs = {v: store.save(v, state_for(base_model, v)) for v in (1, 2)}
    f = Following(backend, store, base_model)
    try:
        send(backend, notice(refs[1]), notice(refs[2]))
        f.caught_up(2)
        assert f.engine.policy_version == 2
        send(backend, notice(refs[1], action="rollback"))
        f.caught_up(3)
        assert f.engine.policy_version == 1 and served(f.engine) == 1.0
    finally:
        f.close()


def test_missing_and_corrupt_files_are_reported_and_following_goes_on(backend, base_model, tmp_path):
    store = FileWeightStore(str(tmp_path / "weights"))
    refs = {v: store.save(v, state_for(base_model, v)) for v in (1, 2, 3, 4, 5)}
    f = Following(backend, store, base_model)
    try:
        send(backend, notice(refs[1]))
        f.caught_up(1)
        store.delete(2)
        send(backend, notice(refs[2]))  # file gone
        f.caught_up(2)
        assert not f.results[-1].applied and "cannot load version 2" in f.results[-1].reason
        with open(refs[3].location, "r+b") as fh:  # flip bytes: checksum mismatch
            fh.seek(100)
            fh.write(b"\x00\x01\x02")
        send(backend, notice(refs[3]))
        f.caught_up(3)
        assert not f.results[-1].applied and "checksum" in f.results[-1].reason
        nan_state = state_for(base_model, 4)
        nan_state[PROBE][0] = float("nan")
        data = save_safetensors(nan_state)  # a well-formed file with the right checksum, but not finite
        with open(refs[4].location, "wb") as fh:
            fh.write(data)
        send(backend, WeightsNotice(version=4, location=refs[4].location, checksum=sha256_hex(data)))
        f.caught_up(4)
        assert not f.results[-1].applied and "non-finite" in f.results[-1].reason
        assert f.engine.policy_version == 1 and served(f.engine) == 1.0  # old weights stayed
        send(backend, notice(refs[5]))
        f.caught_up(5)
        assert f.engine.policy_version == 5 and served(f.engine) == 5.0
    finally:
        f.close()


def test_unreadable_records_are_skipped_or_dead_lettered(backend, base_model):
    store = InProcessWeightStore()
    ref = store.save(1, state_for(base_model, 1))
    producer = backend.producer()
    f = Following(backend, store, base_model, dead_letters=(producer, DEAD))
    try:
        send(backend, b"not json", notice(ref))
        f.caught_up(2)
        assert f.engine.policy_version == 1
        letters = backend.consumer([DEAD]).poll(1.0)
        assert len(letters) == 1
        letter = decode(letters[0].value, DeadLetter)
        assert letter.raw == b"not json" and letter.source_topic == TOPIC
    finally:
        f.close()


def test_restarted_and_parallel_servers_converge_on_the_newest_usable_version(backend, base_model):
    store = InProcessWeightStore()
    refs = {v: store.save(v, state_for(base_model, v)) for v in (1, 2, 3, 4)}
    send(backend, notice(refs[1]), notice(refs[2]), notice(refs[3]), notice(refs[1], action="rollback"),
         notice(refs[4]))
    store.delete(4)  # the newest notice points at a pruned version: the one before it is taken
    servers = [Following(backend, store, base_model) for _ in range(2)]
    try:
        for s in servers:
            s.caught_up(5)
            assert s.engine.policy_version == 1 and served(s.engine) == 1.0
        assert [r.applied for r in servers[0].results] == [False, True]  # 4 failed, rollback to 1 applied
    finally:
        for s in servers:
            s.close()


def test_stop_joins_the_thread(backend, base_model):
    f = Following(backend, InProcessWeightStore(), base_model, poll_timeout_s=0.05)
    thread = f.follower._thread
    f.close()
    assert thread is not None and not thread.is_alive()


class Canary:
    """A canary engine (newest and champion TorchEngines) with a running follower."""

    def __init__(self, backend, store, base_model, **kwargs):
        self.engine = CanaryEngine(TorchEngine(copy.deepcopy(base_model)), TorchEngine(copy.deepcopy(base_model)),
                                   share=0.5, seed=0)
        self.follower = WeightsFollower(backend, TOPIC, store, self.engine, **kwargs)
        self.follower.start()

    def caught_up(self, n_records: int) -> None:
        assert self.follower.wait_for(lambda: self.follower.consumed >= n_records, WAIT_S)


def test_champion_notices_load_the_canary_and_move_no_serving_version(backend, base_model):
    store = InProcessWeightStore()
    refs = {v: store.save(v, state_for(base_model, v)) for v in (1, 2, 3, 4)}
    c = Canary(backend, store, base_model)
    try:
        send(backend, notice(refs[2]), notice(refs[1], "champion"), notice(refs[3]))
        c.caught_up(3)
        assert c.engine.policy_version == 3 and served(c.engine.newest) == 3.0
        assert c.engine.champion_version == 1 and served(c.engine.champion) == 1.0
        # the newest champion of a poll wins; a champion newer than the serving version moves nothing else
        send(backend, notice(refs[2], "champion"), notice(refs[4], "champion"))
        c.caught_up(5)
        assert c.engine.champion_version == 4 and served(c.engine.champion) == 4.0
        assert c.engine.policy_version == 3 and served(c.engine.newest) == 3.0
        missing = WeightsNotice(action="champion", version=5, location="mem://999", checksum="0" * 64)
        send(backend, missing)  # cannot be loaded: the canary keeps its champion
        c.caught_up(6)
        assert c.engine.champion_version == 4
        result = c.follower.last_champion_result  # the failure is the newest champion notice's outcome
        assert result.version == 5 and not result.applied and "cannot load champion v5" in result.reason
    finally:
        c.follower.stop()


class FlakyStore:
    """``store`` whose loads of a location fail (a transient error) as often as ``failing`` says."""

    def __init__(self, store):
        self.store = store
        self.failing: dict[str, int] = {}
        self.loads: list[str] = []
        """Every location a load was asked for, in order."""

    def load(self, location, checksum):
        self.loads.append(location)
        if self.failing.get(location, 0) > 0:
            self.failing[location] -= 1
            raise OSError(f"transient error reading {location} (test)")
        return self.store.load(location, checksum)


@pytest.fixture
def quick_champion_retries(monkeypatch):
    monkeypatch.setattr(weights_follower, "CHAMPION_RETRY_S", 0.02, raising=False)
    monkeypatch.setattr(weights_follower, "CHAMPION_RETRY_MAX_S", 0.1, raising=False)


def test_a_champion_whose_load_failed_is_tried_again_until_it_loads(backend, base_model, quick_champion_retries):
    store = FlakyStore(InProcessWeightStore())
    refs = {v: store.store.save(v, state_for(base_model, v)) for v in (1, 2, 3, 4)}
    c = Canary(backend, store, base_model, poll_timeout_s=0.02)
    try:
        send(backend, notice(refs[1]), notice(refs[2]), notice(refs[2], "champion"))
        c.caught_up(3)
        assert c.engine.champion_version == 2
        store.failing[refs[4].location] = 1  # the promotion's load meets a transient store error
        send(backend, notice(refs[3]), notice(refs[4]), notice(refs[4], "champion"))
        c.caught_up(6)
        # no further notice: the pending champion is tried again and loads
        result = lambda: c.follower.last_champion_result  # noqa: E731 (set once the swap is done)
        assert c.follower.wait_for(lambda: result().version == 4 and result().applied, 10.0)
        assert c.engine.champion_version == 4 and served(c.engine.champion) == 4.0 and c.engine.policy_version == 4
        assert store.loads.count(refs[4].location) == 3  # the publish, the failed champion load, its retry
    finally:
        c.follower.stop()


def test_a_champion_whose_bytes_fail_their_checksum_is_not_read_again(backend, base_model, quick_champion_retries):
    store = FlakyStore(InProcessWeightStore())
    refs = {v: store.store.save(v, state_for(base_model, v)) for v in (1, 2)}
    c = Canary(backend, store, base_model, poll_timeout_s=0.02)
    try:
        send(backend, notice(refs[1], "champion"))
        c.caught_up(1)
        bad = WeightsNotice(action="champion", version=2, location=refs[2].location, checksum="0" * 64)
        send(backend, bad)
        c.caught_up(2)
        assert c.follower.wait_for(lambda: c.follower.last_champion_result.version == 2, 10.0)
        time.sleep(0.5)  # five times the longest retry wait
        assert store.loads.count(refs[2].location) == 1 and c.engine.champion_version == 1
    finally:
        c.follower.stop()


def test_a_pending_champion_gives_way_to_a_later_champion_notice(backend, base_model, quick_champion_retries):
    store = FlakyStore(InProcessWeightStore())
    refs = {v: store.store.save(v, state_for(base_model, v)) for v in (1, 2, 3, 4)}
    c = Canary(backend, store, base_model, poll_timeout_s=0.02)
    never = 10 ** 9
    try:
        send(backend, notice(refs[1], "champion"))
        c.caught_up(1)
        assert c.engine.champion_version == 1
        store.failing[refs[2].location] = never
        send(backend, notice(refs[2], "champion"))
        c.caught_up(2)
        assert c.follower.wait_for(lambda: store.loads.count(refs[2].location) >= 3, 10.0)  # pending: retried
        send(backend, notice(refs[3], "champion"))  # a newer champion replaces the pending one
        c.caught_up(3)
        assert c.engine.champion_version == 3 and served(c.engine.champion) == 3.0
        tried = store.loads.count(refs[2].location)
        store.failing[refs[4].location] = never
        send(backend, notice(refs[4], "champion"))
        c.caught_up(4)
        assert c.follower.wait_for(lambda: store.loads.count(refs[4].location) >= 2, 10.0)
        send(backend, notice(refs[3], "champion"))  # the champion already held (a roll-back): nothing pending
        c.caught_up(5)
        tried_4 = store.loads.count(refs[4].location)
        time.sleep(0.5)  # a dozen polls, several retry periods
        assert store.loads.count(refs[2].location) == tried and store.loads.count(refs[4].location) == tried_4
        assert c.engine.champion_version == 3
    finally:
        c.follower.stop()


def test_a_hold_pauses_the_canary_and_a_release_resumes_it(backend, base_model):
    store = InProcessWeightStore()
    refs = {v: store.save(v, state_for(base_model, v)) for v in (1, 2, 3)}
    c = Canary(backend, store, base_model)
    try:
        send(backend, notice(refs[3]), notice(refs[1], "champion"))
        c.caught_up(2)
        assert not c.engine.held and c.engine.champion_version == 1
        send(backend, notice(refs[2], action="hold"))
        c.caught_up(3)
        assert c.engine.held and c.engine.policy_version == 2 and c.engine.champion_version == 1
        send(backend, notice(refs[2], action="release"))
        c.caught_up(4)
        assert not c.engine.held and c.engine.policy_version == 3
    finally:
        c.follower.stop()


def test_champion_notices_are_ignored_without_a_canary(backend, base_model):
    store = InProcessWeightStore()
    refs = {v: store.save(v, state_for(base_model, v)) for v in (1, 2)}
    f = Following(backend, store, base_model)
    try:
        send(backend, notice(refs[1]), notice(refs[2], "champion"))
        f.caught_up(2)
        assert f.engine.policy_version == 1 and served(f.engine) == 1.0
        assert [(r.version, r.applied) for r in f.results] == [(1, True)]
    finally:
        f.close()


def test_a_notice_the_store_cannot_parse_or_the_engine_fails_on_is_reported_and_following_goes_on(
        backend, base_model, tmp_path):
    store = FileWeightStore(str(tmp_path / "weights"))
    refs = {v: store.save(v, state_for(base_model, v)) for v in (2, 3)}
    f = Following(backend, store, base_model)
    try:
        send(backend, WeightsNotice(version=1, location="nosuchproto://bucket/v00000001.safetensors",
                                    checksum="0" * 64))
        f.caught_up(1)
        assert not f.results[-1].applied and "cannot load version 1" in f.results[-1].reason
        f.engine.swap_weights = failing_first(f.engine.swap_weights, [RuntimeError("the engine failed (test)")])
        send(backend, notice(refs[2]))
        f.caught_up(2)
        assert not f.results[-1].applied and "the engine failed (test)" in f.results[-1].reason
        send(backend, notice(refs[3]))
        f.caught_up(3)
        assert f.follower._thread.is_alive()
        assert f.engine.policy_version == 3 and served(f.engine) == 3.0
    finally:
        f.close()


@pytest.mark.parametrize("location", ["tar://v00000001.safetensors::file://{not_a_tar}", "reference://x"])
def test_a_location_fsspec_fails_on_with_its_own_error_is_reported_and_following_goes_on(
        backend, base_model, tmp_path, location, caplog):
    # tarfile.ReadError and TypeError: neither an OSError nor a ValueError
    not_a_tar = tmp_path / "plain.txt"
    not_a_tar.write_text("not a tar archive")
    store = FileWeightStore(str(tmp_path / "weights"))
    ref = store.save(2, state_for(base_model, 2))
    f = Following(backend, store, base_model)
    try:
        with caplog.at_level(logging.ERROR, logger="serving.weights_follower"):
            send(backend, WeightsNotice(version=1, location=location.format(not_a_tar=not_a_tar), checksum="0" * 64))
            f.caught_up(1)
        assert not f.results[-1].applied and "cannot load version 1" in f.results[-1].reason
        [logged] = [r for r in caplog.records if "cannot load version 1" in r.getMessage()]
        assert logged.exc_info is not None  # an error no store expects: its traceback is in the log
        send(backend, notice(ref))
        f.caught_up(2)
        assert f.follower._thread.is_alive()
        assert f.engine.policy_version == 2 and served(f.engine) == 2.0
    finally:
        f.close()


def test_a_following_engine_is_held_and_released_and_a_restarted_one_replays_the_hold(backend, base_model):
    store = InProcessWeightStore()
    refs = {v: store.save(v, state_for(base_model, v)) for v in (1, 2, 3)}
    first = Following(backend, store, base_model)
    try:
        send(backend, notice(refs[1]), notice(refs[2]))
        first.caught_up(2)
        assert served(first.engine) == 2.0
        send(backend, notice(refs[1], action="hold"), notice(refs[3]))
        first.caught_up(4)
        assert (first.engine.policy_version, served(first.engine)) == (1, 1.0)
        assert first.follower.holds.held_version == 1
        restarted = Following(backend, store, copy.deepcopy(base_model))  # reads the topic from its start
        try:
            restarted.caught_up(4)
            assert (restarted.engine.policy_version, served(restarted.engine)) == (1, 1.0)
            send(backend, notice(refs[1], action="release"))
            first.caught_up(5)
            restarted.caught_up(5)
            for following in (first, restarted):
                assert (following.engine.policy_version, served(following.engine)) == (3, 3.0)
                assert following.follower.holds.held_version == -1
        finally:
            restarted.close()
    finally:
        first.close()


def test_a_champion_swap_that_raises_is_reported_and_following_goes_on(backend, base_model):
    store = InProcessWeightStore()
    refs = {v: store.save(v, state_for(base_model, v)) for v in (1, 2, 3)}
    c = Canary(backend, store, base_model)
    c.engine.swap_champion = failing_first(c.engine.swap_champion,
                                           [torch.OutOfMemoryError("no room for the champion's spare (test)")])
    try:
        send(backend, notice(refs[1], "champion"))
        c.caught_up(1)
        result = c.follower.last_champion_result
        assert (result.version, result.applied) == (1, False) and "no room" in result.reason
        assert c.engine.champion_version is None
        send(backend, notice(refs[3]), notice(refs[2], "champion"))
        c.caught_up(3)
        assert c.follower._thread.is_alive()
        assert c.engine.policy_version == 3 and served(c.engine.newest) == 3.0
        assert c.engine.champion_version == 2 and served(c.engine.champion) == 2.0
    finally:
        c.follower.stop()


def test_a_dead_letter_the_broker_refuses_is_retried_and_following_goes_on(backend, base_model):
    store = InProcessWeightStore()
    ref = store.save(1, state_for(base_model, 1))
    producer = backend.producer()
    refusals = [StreamUnavailable("broker unreachable (test)")] * 2
    producer.send = failing_first(producer.send, refusals)
    f = Following(backend, store, base_model, dead_letters=(producer, DEAD))
    try:
        send(backend, b"not json", notice(ref))
        f.caught_up(2)
        assert f.follower._thread.is_alive() and not refusals
        assert f.engine.policy_version == 1
        letters = backend.consumer([DEAD]).poll(1.0)
        assert [decode(m.value, DeadLetter).raw for m in letters] == [b"not json"]
    finally:
        f.close()


def test_a_restarted_replica_logs_the_hold_its_replay_ends_in_once_and_live_changes_as_they_come(
        backend, base_model, caplog):
    """A replica replaying the topic logged every hold and release ever made, each as if made now."""
    store = InProcessWeightStore()
    refs = {v: store.save(v, state_for(base_model, v)) for v in (1, 2, 3)}

    def hold(version: int, action: str, reason: str) -> WeightsNotice:
        return notice(refs[version], action=action).model_copy(update={"reason": reason})

    send(backend, notice(refs[1]), hold(1, "hold", "walk test"), hold(1, "release", "done"), notice(refs[2]),
         hold(3, "hold", "restart test"))
    caplog.set_level(logging.WARNING, logger="serving.weights_hold")
    f = Following(backend, store, base_model)
    try:
        assert f.follower.wait_for(lambda: f.follower.caught_up, WAIT_S)
        assert (f.engine.policy_version, served(f.engine)) == (3, 3.0)
        lines = [r.getMessage() for r in caplog.records if r.name == "serving.weights_hold"]
        assert lines == ["weights held at v3 by an operator (restart test); the learner's versions are not "
                         "followed until a release"]
        send(backend, hold(3, "release", "over"))  # news: said as it comes
        f.caught_up(6)
        lines = [r.getMessage() for r in caplog.records if r.name == "serving.weights_hold"]
        assert lines[1:] == ["weights hold released; following the learner's versions again"]
    finally:
        f.close()


def test_an_unreachable_weights_topic_is_warned_about_once_a_minute_not_on_every_retry(
        backend, base_model, monkeypatch, caplog):
    """A replica started before its cluster had the weights topic logged a warning every 2 s for as
    long as the topic was missing; it says so once, then once a minute, and the retries go on."""
    monkeypatch.setattr(weights_follower, "RETRY_S", 0.005)
    refusals = [StreamUnavailable("topic 'sao.weights' does not exist (test)")] * 40
    backend.consumer = failing_first(backend.consumer, refusals)
    caplog.set_level(logging.WARNING, logger="serving.weights_follower")
    store = InProcessWeightStore()
    send(backend, notice(store.save(1, state_for(base_model, 1))))
    f = Following(backend, store, base_model)
    try:
        f.caught_up(1)
        assert not refusals and f.engine.policy_version == 1
        lines = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(lines) == 1 and "does not exist (test)" in lines[0]
    finally:
        f.close()
