"""The record codec: round trips, and rejections that say what is wrong."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from online_sao.schemas import (MAX_RECORD_BYTES, DeadLetter, Interaction, RecordError, Reward, WeightsNotice,
                                decode, encode)


def interaction(**overrides) -> Interaction:
    fields = dict(interaction_id="i-1", model="m", created_at=1.5, completed_at=2.5, prompt_ids=[1, 2],
                  response_ids=[3, 4, 5, 6], action_mask=[True, True, False, True],
                  logprobs=[-0.5, -1.0, -2.0], versions=[1, 1, 2], turn_ends=[1, 3],
                  user_id="user-7", session_id="sess-3", prompt_text="héllo", response_text="wörld")
    fields.update(overrides)
    return Interaction(**fields)


RECORDS = [
    interaction(),
    interaction(interaction_id="i-2", sampling={"temperature": 1.3, "top_p": 0.9},
                turn_origins=[{"interaction_id": "i-1", "temperature": 0.7, "top_p": 0.5},
                              {"interaction_id": "i-2", "temperature": 1.3, "top_p": 0.9}]),
    Reward(interaction_id="i-1", value=-0.5, source="judge", created_at=3.0,
           turn_rewards=[{"turn": 0, "value": 1.0}, {"turn": 1, "value": -1.0}]),
    WeightsNotice(version=4, location="s3://bucket/w/4", checksum="0f" * 32, step=12, created_at=4.0,
                  metrics={"loss": 0.125}),
    WeightsNotice(action="rollback", version=2, location="/w/2", checksum="a" * 64, created_at=5.0),
    DeadLetter(raw=bytes(range(256)), source_topic="sao.rewards", partition=2, offset=41, reason="bad",
               created_at=6.0),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.kind)
def test_round_trip_is_exact_and_compact(record):
    data = encode(record)
    assert decode(data) == record
    assert decode(data, type(record)) == record
    assert b" " not in data and b"\n" not in data  # no whitespace between tokens
    assert encode(decode(data)) == data  # stable: re-encoding gives the same bytes
    assert json.loads(data)["schema_version"] == 1


def test_encoding_is_utf8_json_in_field_order_without_nulls():
    data = encode(Reward(interaction_id="ï", value=2.0, created_at=1.0))
    assert data == '{"schema_version":1,"kind":"reward","interaction_id":"ï","value":2.0,'.encode() + \
        b'"source":"user","created_at":1.0,"turn_rewards":[]}'
    assert b"parent_id" not in encode(interaction())  # None fields are left out


def test_policy_version_is_the_newest_sampling_version():
    assert interaction().policy_version == 2


@pytest.mark.parametrize("overrides, message", [
    (dict(action_mask=[True, True]), "action_mask has 2 entries for 4 response tokens"),
    (dict(logprobs=[-0.5]), "logprobs has 1 entries for 3 action tokens"),
    (dict(versions=[1, 1]), "versions has 2 entries for 3 action tokens"),
    (dict(turn_ends=[4]), "turn_ends points outside response_ids"),
    (dict(logprobs=[-0.5, 0.5, -1.0]), "a log-probability is above 0"),
])
def test_lengths_that_disagree_are_rejected(overrides, message):
    obj = json.loads(encode(interaction()))
    obj.update(overrides)
    with pytest.raises(RecordError, match=message):
        decode(json.dumps(obj).encode())


@pytest.mark.parametrize("turn_ends, message", [
    ([3, 1], "turn 1 ends at 1, not after turn 0's end 3"),
    ([1, 1], "turn 1 ends at 1, not after turn 0's end 1"),
    ([0, 2, 1], "turn 2 ends at 1, not after turn 1's end 2"),
])
def test_turn_ends_out_of_order_or_repeated_are_rejected(turn_ends, message):
    # accepted, the learner credited a turn's reward to another turn's last token and trained a turn on no tokens
    obj = json.loads(encode(interaction()))
    obj["turn_ends"] = turn_ends
    with pytest.raises(RecordError, match=f"turn_ends must increase strictly.*{message}"):
        decode(json.dumps(obj).encode())
    obj["turn_ends"] = sorted(set(turn_ends))
    assert decode(json.dumps(obj).encode()).turn_ends == sorted(set(turn_ends))


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_numbers_are_rejected(literal):
    data = b'{"schema_version":1,"kind":"reward","interaction_id":"x","value":' + literal + b"}"
    with pytest.raises(RecordError, match="non-finite|finite number"):
        decode(data)


def test_non_finite_numbers_cannot_be_built():
    with pytest.raises(ValueError):
        Reward(interaction_id="x", value=float("nan"))
    with pytest.raises(ValueError):
        WeightsNotice(version=1, location="x", checksum="a" * 64, metrics={"loss": float("inf")})


def test_oversize_payloads_are_rejected_both_ways():
    big = DeadLetter(raw=b"x" * MAX_RECORD_BYTES, source_topic="t", reason="r")
    with pytest.raises(RecordError, match=f"exceeds {MAX_RECORD_BYTES}"):
        encode(big)
    with pytest.raises(RecordError, match=f"record of {MAX_RECORD_BYTES + 1} bytes exceeds {MAX_RECORD_BYTES}"):
        decode(b" " * (MAX_RECORD_BYTES + 1))


def test_too_long_trajectories_are_rejected():
    n = 40_000
    with pytest.raises(ValueError, match="tokens exceeds"):
        interaction(prompt_ids=[1] * n)


@pytest.mark.parametrize("version", [0, 2, None, "1", True, 1.0])
def test_unknown_schema_versions_are_rejected(version):
    obj = json.loads(encode(RECORDS[1]))
    if version is None:
        del obj["schema_version"]
    else:
        obj["schema_version"] = version
    with pytest.raises(RecordError, match=r"unknown schema_version .* \(this build reads 1\)"):
        decode(json.dumps(obj).encode())


def test_wrong_kind_is_rejected():
    with pytest.raises(RecordError, match="expected a Reward record, got kind 'interaction'"):
        decode(encode(interaction()), Reward)
    obj = json.loads(encode(RECORDS[1]))
    obj["kind"] = "bogus"
    with pytest.raises(RecordError, match="invalid record"):
        decode(json.dumps(obj).encode())


@pytest.mark.parametrize("data, message", [
    (b"\xff\xfe", "not a JSON record"),
    (b"[1, 2]", "not a JSON object"),
    (b"[" * 100_000, "not a JSON record"),
    (b'{"schema_version":1,"kind":"reward","interaction_id":"x","value":1,"extra":2}', "extra"),
    (b'{"schema_version":1,"kind":"reward","interaction_id":"","value":1}', "interaction_id"),
    (b'{"schema_version":1,"kind":"dead_letter","raw":"%%%","source_topic":"t","reason":"r"}', "raw"),
    (b'{"schema_version":1,"kind":"reward","interaction_id":"x","value":1,'
     b'"turn_rewards":[{"turn":0,"value":1},{"turn":0,"value":-1}]}', "more than once"),  # which would count?
])
def test_malformed_input_is_rejected_with_the_reason(data, message):
    with pytest.raises(RecordError, match=message):
        decode(data)


@pytest.mark.parametrize("codec", ["utf-16", "utf-16-le", "utf-32", "utf-8-sig"])
def test_a_valid_record_in_another_unicode_encoding_is_refused(codec):
    # records are UTF-8 without a byte-order mark (docs/RECORDS.md); json.loads would take these
    text = '{"schema_version":1,"kind":"reward","interaction_id":"x","value":1}'
    assert decode(text.encode("utf-8")).interaction_id == "x"
    with pytest.raises(RecordError, match="not a JSON record") as refused:
        decode(text.encode(codec))
    assert "utf-8-sig" not in str(refused.value)  # not advice to read it another way


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2_000))
def test_random_bytes_raise_only_record_error(data):
    try:
        decode(data)
    except RecordError:
        pass


def _json_values():
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | \
        st.text(max_size=20)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record=st.sampled_from(RECORDS), data=st.data())
def test_mutated_valid_records_raise_only_record_error(record, data):
    obj = json.loads(encode(record))
    field = data.draw(st.sampled_from(sorted(obj)))
    if data.draw(st.booleans()):
        obj[field] = data.draw(_json_values())
    else:
        del obj[field]
    raw = json.dumps(obj).encode()
    if data.draw(st.booleans()):  # and sometimes corrupt the bytes themselves
        i = data.draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + data.draw(st.binary(min_size=1, max_size=3)) + raw[i + 1:]
    try:
        decoded = decode(raw)
    except RecordError:
        return
    assert encode(decoded)  # whatever is accepted is a valid, encodable record


def test_turn_origins_are_left_out_when_every_turn_is_the_records_own():
    single = interaction()
    assert b"turn_origins" not in encode(single)  # encodes as before the field existed
    assert [(o.interaction_id, o.temperature, o.top_p) for o in single.origins()] == [("i-1", 1.0, 1.0)] * 2
    continued = RECORDS[1]
    assert [o.interaction_id for o in continued.origins()] == ["i-1", "i-2"]
    with pytest.raises(RecordError, match="turn_origins has 1 entries for 2 turns"):
        decode(encode(single)[:-1] + b',"turn_origins":[{"interaction_id":"x"}]}')


def test_segment_round_trips_and_older_records_without_it_still_read():
    record = interaction(segment="team-red")
    assert decode(encode(record)) == record and b'"segment":"team-red"' in encode(record)
    older = json.loads(encode(interaction()))
    assert "segment" not in older  # a record without a segment encodes as before the field existed
    assert decode(json.dumps(older).encode()).segment is None


@pytest.mark.parametrize("segment, message", [("", "1 to 256"), ("x" * 257, "at most 256"),
                                              ("tab\there", "printable")])
def test_segment_keys_are_bounded_and_printable(segment, message):
    data = json.loads(encode(interaction()))
    data["segment"] = segment
    with pytest.raises(RecordError, match=message):
        decode(json.dumps(data).encode())


def test_reward_scores_round_trip_and_a_reward_without_them_encodes_as_before():
    scored = Reward(interaction_id="i-1", value=0.4, created_at=1.0, scores={"quality": 0.5, "style": 0.8})
    assert decode(encode(scored)) == scored and b'"scores":{"quality":0.5,"style":0.8}' in encode(scored)
    plain = Reward(interaction_id="i-1", value=0.4, created_at=1.0)
    assert encode(plain) == (b'{"schema_version":1,"kind":"reward","interaction_id":"i-1","value":0.4,'
                             b'"source":"user","created_at":1.0,"turn_rewards":[]}')
    assert decode(encode(plain)).scores is None


@pytest.mark.parametrize("scores, message", [({"Quality": 0.5}, "pattern"), ({"q" * 33: 0.5}, "pattern"),
                                             ({f"s{i}": 0.0 for i in range(17)}, "at most 16"),
                                             ({"quality": 2e6}, "less than or equal to 1000000")])
def test_reward_scores_are_few_named_and_bounded(scores, message):
    data = json.loads(encode(Reward(interaction_id="i-1", value=0.4, created_at=1.0)))
    data["scores"] = scores
    with pytest.raises(RecordError, match=message):
        decode(json.dumps(data).encode())


REWARD_JSON = '{"schema_version":1,"kind":"reward","interaction_id":"i-1","value":0.5,"source":"judge",' \
              '"created_at":3.0,"turn_rewards":[{"turn":0,"value":1.0}]}'
INTERACTION_JSON = '{"schema_version":1,"kind":"interaction","interaction_id":"i-1","created_at":1.5,' \
                   '"completed_at":2.5,"model":"m","prompt_ids":[1,2],"response_ids":[3,4],' \
                   '"action_mask":[true,false],"logprobs":[-0.5],"versions":[1],"turn_ends":[0],' \
                   '"sampling":{"temperature":1.0,"top_p":1.0,"max_tokens":8}}'


@pytest.mark.parametrize("text, old, new, where", [
    (REWARD_JSON, '"value":0.5', '"value":true', "value"),
    (REWARD_JSON, '"value":0.5', '"value":"0.5"', "value"),
    (REWARD_JSON, '"created_at":3.0', '"created_at":"1.0"', "created_at"),
    (REWARD_JSON, '"turn":0', '"turn":"0"', "turn_rewards.0.turn"),
    (REWARD_JSON, '"turn":0', '"turn":0.0', "turn_rewards.0.turn"),
    (REWARD_JSON, '"turn":0', '"turn":false', "turn_rewards.0.turn"),
    (REWARD_JSON, '"value":1.0}', '"value":"1"}', "turn_rewards.0.value"),
    (INTERACTION_JSON, '"versions":[1]', '"versions":[true]', "versions.0"),
    (INTERACTION_JSON, '"versions":[1]', '"versions":[1.0]', "versions.0"),
    (INTERACTION_JSON, '"action_mask":[true,false]', '"action_mask":["true","false"]', "action_mask.0"),
    (INTERACTION_JSON, '"action_mask":[true,false]', '"action_mask":[1,0]', "action_mask.0"),
    (INTERACTION_JSON, '"logprobs":[-0.5]', '"logprobs":["-0.5"]', "logprobs.0"),
    (INTERACTION_JSON, '"prompt_ids":[1,2]', '"prompt_ids":["1",2]', "prompt_ids.0"),
    (INTERACTION_JSON, '"prompt_ids":[1,2]', '"prompt_ids":[1.0,2]', "prompt_ids.0"),
    (INTERACTION_JSON, '"turn_ends":[0]', '"turn_ends":[0.0]', "turn_ends.0"),
    (INTERACTION_JSON, '"max_tokens":8', '"max_tokens":"8"', "sampling.max_tokens"),
    (INTERACTION_JSON, '"completed_at":2.5', '"completed_at":true', "completed_at"),
])
def test_json_of_the_wrong_type_is_refused_not_coerced(text, old, new, where):
    # a judge writing true or "0.5" trained as 1.0 or 0.5, a turn of 1.0 as turn 1: the records say
    # numbers are JSON numbers, and a decoded record must encode to what was written
    assert decode(text.encode()) is not None  # the literal itself is a valid record
    with pytest.raises(RecordError, match=rf"invalid record: {where}: Input should be a valid"):
        decode(text.replace(old, new).encode())


@pytest.mark.parametrize("text, old, new", [
    (REWARD_JSON, '"value":0.5', '"value":1'),
    (REWARD_JSON, '"created_at":3.0', '"created_at":3'),
    (INTERACTION_JSON, '"logprobs":[-0.5]', '"logprobs":[-1]'),
    (INTERACTION_JSON, '"temperature":1.0', '"temperature":1'),
])
def test_a_json_integer_is_a_number_for_a_float_field(text, old, new):
    # the same record as with the float written out, which it then encodes as
    assert decode(text.replace(old, new).encode()) == decode(text.replace(old, new.replace("1", "1.0")
                                                                        .replace("3", "3.0")).encode())


def test_a_record_of_another_kind_is_refused_by_its_kind_not_its_fields():
    # a reward's fields under "kind":"interaction" on the rewards topic: the kind is what is wrong
    wrong = REWARD_JSON.replace('"kind":"reward"', '"kind":"interaction"').encode()
    with pytest.raises(RecordError, match=r"^expected a Reward record, got kind 'interaction'$"):
        decode(wrong, Reward)
    with pytest.raises(RecordError, match=r"^expected a Reward record, got kind None$"):
        decode(REWARD_JSON.replace('"kind":"reward",', "").encode(), Reward)
