"""Property tests of the record codec for every record kind (hypothesis).

Valid records of each kind, generated across their whole documented range, round-trip
exactly. Random bytes and structure-aware mutations of valid records (a field replaced by a
hostile value, removed, an unknown field added, the kind swapped, the bytes cut or spliced)
make ``decode`` raise :class:`RecordError` and nothing else. Whatever it accepts is a record
of the expected kind that re-encodes to the same record, and an accepted interaction with an
accepted reward can be trained on: it becomes a rollout and a batch with finite rewards and
temperatures (a record that passes the codec and then crashes or poisons the learner would
be read again after every restart).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from online_sao.batch import collate
from online_sao.schemas import (MAX_ABS_REWARD, MIN_LOGPROB, MIN_TEMPERATURE, DeadLetter, Interaction, RecordError, Reward,
                                SamplingParams, TurnReward, WeightsNotice, decode, encode)
from trainer.rollouts import interaction_to_rollout

KINDS = [Interaction, Reward, WeightsNotice, DeadLetter]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ids = st.text(min_size=1, max_size=40)
finite = st.floats(allow_nan=False, allow_infinity=False)
times = st.floats(min_value=0, max_value=4e9, allow_nan=False)
versions = st.integers(0, 2**63 - 1)
rewards = st.floats(-MAX_ABS_REWARD, MAX_ABS_REWARD, allow_nan=False)


@st.composite
def interactions(draw) -> Interaction:
    n = draw(st.integers(0, 12))
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    actions = sum(mask)
    return Interaction(
        interaction_id=draw(ids), model=draw(ids), created_at=draw(times), completed_at=draw(times),
        deployment_id=draw(st.text(max_size=20)),
        prompt_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12)),
        response_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)), action_mask=mask,
        logprobs=draw(st.lists(st.floats(MIN_LOGPROB, 0.0, allow_nan=False), min_size=actions, max_size=actions)),
        versions=draw(st.lists(versions, min_size=actions, max_size=actions)),
        turn_ends=draw(st.lists(st.integers(0, n - 1), max_size=3, unique=True).map(sorted)) if n else [],
        sampling=SamplingParams(temperature=draw(st.floats(MIN_TEMPERATURE, 10)),
                                top_p=draw(st.floats(0, 1, exclude_min=True)), max_tokens=draw(st.integers(1, 10**6)),
                                seed=draw(st.none() | st.integers()),
                                stop=draw(st.lists(st.text(max_size=5), max_size=3))),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        user_id=draw(st.none() | ids), session_id=draw(st.none() | ids),
        prompt_text=draw(st.none() | st.text(max_size=50)), response_text=draw(st.none() | st.text(max_size=50)))


def reward_records(turns: int = 3):
    return st.builds(Reward, interaction_id=ids, value=rewards, source=st.text(min_size=1, max_size=20),
                     created_at=times, turn_rewards=st.lists(
                         st.builds(TurnReward, turn=st.integers(0, turns - 1), value=rewards), max_size=turns,
                         unique_by=lambda t: t.turn))


notices = st.builds(WeightsNotice, action=st.sampled_from(["publish", "rollback"]), version=versions,
                    location=st.text(min_size=1, max_size=60), checksum=st.text("0123456789abcdef", min_size=64,
                                                                                max_size=64),
                    model=st.text(max_size=20), step=versions, created_at=times,
                    metrics=st.dictionaries(st.text(max_size=10), finite, max_size=4))
dead_letters = st.builds(DeadLetter, raw=st.binary(max_size=300), source_topic=st.text(max_size=30),
                         partition=st.none() | st.integers(0, 1000), offset=st.none() | st.integers(0, 2**62),
                         reason=st.text(max_size=100), created_at=times)
RECORDS = {Interaction: interactions(), Reward: reward_records(), WeightsNotice: notices, DeadLetter: dead_letters}
any_record = st.one_of(*RECORDS.values())

HOSTILE = st.sampled_from([
    None, True, False, 0, -1, 1.5, -0.0, 2**31, 2**63, 2**64, 10**400, 1e308, -1e308, 5e-324, 1e-300, "",
    "x" * 300, "1", "true", "NaN", "\ud800", "\x00", [], {}, [[[[[]]]]], {"a": {"b": {}}}, [None], [True, 1, "1"],
    [2**63], [-1e308], [1e308], {"turn": 0, "value": 1e300},
])
"""Values that break types, bounds, encodings and numerics in JSON."""
EXTREME = st.sampled_from([2**31, 2**63 - 1, 2**63, 10**30, 1e308, -1e308, 1e30, -1e30, 1e-300, 5e-324, -1e-300])
"""Numbers at the edges of int32, int64 and float32/float64, for numeric fields."""


def json_values():
    scalars = st.none() | st.booleans() | st.integers() | finite | st.text(max_size=20)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)


def _paths(obj, prefix=()):
    """Every (container, key) below the record object, nested lists and objects included."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for key, value in items:
        yield prefix + (key,)
        yield from _paths(value, prefix + (key,))


def _node(obj, path):
    for key in path:
        obj = obj[key]
    return obj


def mutate_record(obj: dict, data) -> bytes:
    paths = list(_paths(obj))
    numbers = [p for p in paths if type(_node(obj, p)) in (int, float)]
    action = data.draw(st.sampled_from(["extreme", "hostile", "random", "delete", "unknown", "kind"]))
    path = data.draw(st.sampled_from(numbers if action == "extreme" and numbers else paths))
    *parents, last = path
    node = _node(obj, parents)
    if action == "extreme":
        node[last] = data.draw(EXTREME)
    elif action == "hostile":
        node[last] = data.draw(HOSTILE)
    elif action == "random":
        node[last] = data.draw(json_values())
    elif action == "delete":
        del node[last]
    elif action == "unknown" and isinstance(node, dict):
        node["unexpected_" + data.draw(st.text(max_size=5))] = 1
    else:
        obj["kind"] = data.draw(st.sampled_from(["interaction", "reward", "weights", "dead_letter", "", "x"]))
    raw = json.dumps(obj).encode()  # ensure_ascii: lone surrogates travel as \ud800 escapes
    if data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(raw)))
        cut = data.draw(st.sampled_from(["truncate", "splice", "duplicate_key"]))
        if cut == "truncate":
            raw = raw[:i]
        elif cut == "splice":
            raw = raw[:i] + data.draw(st.binary(min_size=1, max_size=4)) + raw[i + 1:]
        else:
            raw = b'{"kind":"reward",' + raw[1:]  # JSON keeps the last duplicate
    return raw


def _accepted_record_is_sound(raw: bytes, expected: type | None):
    try:
        record = decode(raw, expected)
    except RecordError as exc:
        assert str(exc)  # the reason is never empty
        return None
    assert expected is None or isinstance(record, expected)
    assert decode(encode(record), type(record)) == record
    return record


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@FUZZ
@given(record=any_record)
def test_valid_records_of_every_kind_round_trip(kind, record):
    data = encode(record)
    assert decode(data) == record
    if isinstance(record, kind):
        assert decode(data, kind) == record
    else:
        with pytest.raises(RecordError, match=f"expected a {kind.__name__} record"):
            decode(data, kind)


@pytest.mark.parametrize("kind", KINDS + [None], ids=lambda k: getattr(k, "__name__", "any"))
@FUZZ
@given(data=st.binary(max_size=2_000) | st.binary(max_size=64).map(lambda b: b'{"schema_version":1,' + b))
def test_random_bytes_raise_only_record_error(kind, data):
    _accepted_record_is_sound(data, kind)


@pytest.mark.parametrize("kind", KINDS + [None], ids=lambda k: getattr(k, "__name__", "any"))
@settings(FUZZ, max_examples=120)
@given(record=any_record, data=st.data())
def test_mutated_valid_records_raise_only_record_error(kind, record, data):
    _accepted_record_is_sound(mutate_record(json.loads(encode(record)), data), kind)


@settings(FUZZ, max_examples=200)
@given(interaction=interactions(), reward=reward_records(turns=1), data=st.data())
def test_accepted_interactions_and_rewards_can_be_trained_on(interaction, reward, data):
    """Mutated a little, or not at all: whatever the codec accepts becomes a finite batch."""
    raw_i, raw_r = encode(interaction), encode(reward)
    if data.draw(st.booleans()):
        raw_i = mutate_record(json.loads(raw_i), data)
    if data.draw(st.booleans()):
        raw_r = mutate_record(json.loads(raw_r), data)
    accepted_i = _accepted_record_is_sound(raw_i, Interaction)
    accepted_r = _accepted_record_is_sound(raw_r, Reward)
    if accepted_i is None or accepted_r is None:
        return
    turns = {t.turn: t.value for t in accepted_r.turn_rewards if t.turn < len(accepted_i.turn_ends)}
    batch = collate([interaction_to_rollout(accepted_i, accepted_r.value, turns)], pad_token_id=0)
    assert torch.isfinite(batch.rewards).all() and torch.isfinite(batch.rewards.square()).all()
    assert (batch.temperatures > 0).all() and torch.isfinite(batch.temperatures).all()
    assert torch.isfinite(batch.rollout_logprobs).all()  # -1e39 passed the codec and was -inf in float32


@pytest.mark.parametrize("obj, field", [
    ({"versions": [2**63]}, "versions"),
    ({"sampling": {"temperature": 1e-300}}, "temperature"),
    ({"sampling": {"temperature": 5e-5}}, "temperature"),
    ({"logprobs": [-1e39]}, "logprobs"),
])
def test_records_that_would_crash_or_poison_the_learner_are_refused(obj, field):
    """Found by the property above: a version beyond int64 crashed collate; a temperature that is 0
    in float32 gave NaN; a reward of 1e30 made the critic's squared error infinite; a log-probability
    beyond float32 (an audit) became -inf and refused the whole step."""
    base = json.loads(encode(Interaction(interaction_id="i", model="m", prompt_ids=[1], response_ids=[2],
                                         action_mask=[True], logprobs=[-0.1], versions=[3])))
    with pytest.raises(RecordError, match=field):
        decode(json.dumps({**base, **obj}).encode(), Interaction)
    for value in (1e30, -1e7, math.ulp(0.0) + MAX_ABS_REWARD * 2):
        with pytest.raises(RecordError, match="value"):
            decode(json.dumps({**json.loads(encode(Reward(interaction_id="i", value=0.0))), "value": value}).encode())


def test_a_lone_surrogate_escape_is_refused_and_a_pair_is_text():
    """Found by the mutation property: "\\ud800" in an unconstrained string field (finish_reason,
    user_id, texts, stop strings) was accepted and then made encode() raise a serialization error."""
    base = json.loads(encode(Interaction(interaction_id="i", model="m", prompt_ids=[1], response_ids=[2],
                                         action_mask=[True], logprobs=[-0.1], versions=[3])))
    for field in ("finish_reason", "user_id", "prompt_text", "deployment_id"):
        with pytest.raises(RecordError, match="lone UTF-16 surrogate"):
            decode(json.dumps({**base, field: "x\ud800"}).encode(), Interaction)
    with pytest.raises(RecordError, match="lone UTF-16 surrogate"):
        decode(json.dumps({**base, "sampling": {"stop": ["\udfff"]}}).encode())
    paired = decode(json.dumps({**base, "response_text": "ok \U0001f600"}).encode())  # escaped as a valid pair
    assert paired.response_text == "ok \U0001f600" and decode(encode(paired)) == paired
