"""Event records that cross process boundaries, and their wire codec.

Every record is a pydantic model with a ``kind`` and a ``schema_version``.
Encoding (documented in docs/RECORDS.md): UTF-8 JSON, keys in declaration
order, no whitespace, floats as JSON numbers (finite only). Decoding checks the
size, the JSON, the schema version, the kind and every field, strictly (no type is
coerced: a string or ``true`` is no number, ``1.0`` no integer; a JSON integer is a
float's number), and raises :class:`RecordError` with a message that says what is wrong.
"""

from __future__ import annotations

import base64
import codecs
import json
import re
import time
from typing import Annotated, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, TypeAdapter,
                      ValidationError, field_validator, model_validator)
from pydantic_core import PydanticSerializationError

from online_sao.json_depth import MAX_JSON_DEPTH, too_deep
from online_sao.segments import SEGMENT_MAX_CHARS, segment_problem

SCHEMA_VERSION = 1
MAX_RECORD_BYTES = 1_000_000
"""Largest encoded record: the default ``max.message.bytes`` of a Kafka topic is
1 MiB plus batch overhead, so anything larger would be refused by the broker."""
MAX_TOKENS_PER_RECORD = 32_768
"""Longest trajectory accepted in one record (guards memory of consumers)."""
MIN_TEMPERATURE = 1e-4
"""Smallest sampling temperature a record may carry: below it logits / temperature overflow
float32 in the engine and the learner (1e-300 is 0 in float32) and log-probabilities become NaN;
the engine decodes greedily at this temperature anyway (serving.engine.sampling.GREEDY_TEMPERATURE)."""
MAX_ABS_REWARD = 1e6
"""Largest reward magnitude a record may carry: the critic squares returns in float32 (largest
3.4e38), so rewards near 1e19 and beyond would make its loss infinite; 1e6 leaves room for sums."""


class RecordError(ValueError):
    """A record that cannot be encoded or decoded; the message says why."""


_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(value: object) -> bool:
    """True when a string of parsed JSON ``value`` (keys included) holds a lone UTF-16 surrogate.

    JSON can spell one (``"\\ud800"``) and Python parses it into a str that no UTF-8 text can
    hold: such a string would pass validation and then fail when the record is encoded."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _decode_b64(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return base64.b64decode(value, validate=True)
    raise ValueError("expected base64 text")


Base64Bytes = Annotated[bytes, PlainValidator(_decode_b64),
                        PlainSerializer(lambda b: base64.b64encode(b).decode("ascii"), return_type=str)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
MIN_LOGPROB = -1e6
"""Lowest behaviour log-probability a record may carry. No sampled token is this unlikely (float64's
smallest positive probability is exp(-745)); a value below float32's range (-3.4e38) became -inf when
the learner batched it and refused the whole step, good rollouts with it."""
LogProb = Annotated[float, Field(allow_inf_nan=False, ge=MIN_LOGPROB)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Version = Annotated[int, Field(ge=0, lt=2**63)]
"""A policy version: the learner puts versions into int64 tensors (a larger one would crash it)."""
RewardValue = Annotated[float, Field(allow_inf_nan=False, ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD)]
MAX_SCORES_PER_REWARD = 16
"""Most named scores one reward record may carry: they become per-rollout books, monitor values
and per-segment metrics, so their number must stay small."""
ScoreName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
"""A score's name: lower-case letters, digits and ``_``, at most 32 characters (it becomes part
of metric names such as ``monitor_score_<name>``)."""


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    schema_version: Literal[1] = SCHEMA_VERSION


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(128, ge=1)
    seed: int | None = None
    stop: list[str] = []


class TurnOrigin(BaseModel):
    """Which request sampled one assistant turn, and from which distribution."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    interaction_id: str = Field(min_length=1, max_length=256)
    """The interaction whose request sampled the turn (the record's own id for its newest turn)."""
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, le=10)
    top_p: float = Field(1.0, gt=0, le=1)


ABORTED = "abort"
"""``Interaction.finish_reason`` of an answer cut by something other than the policy: its client
left, or serving's deadline or shutdown ended it (the learner: ``reward.train_aborted``)."""


class Interaction(Record):
    """One completed trajectory sampled by the serving engine.

    ``prompt_ids`` is everything before the first sampled token. ``response_ids``
    is the rest of the trajectory: the model's tokens and, in multi-turn or agent
    use, the user/tool/environment tokens between them. ``action_mask`` has one
    entry per response token (True = sampled by the policy). ``logprobs`` and
    ``versions`` have one entry per action token: the behaviour log-probability
    under the exact sampling distribution and the policy version that sampled it.
    ``turn_ends`` lists, for each assistant turn, the index in ``response_ids`` of
    its last token (per-turn rewards are credited there). ``turn_origins`` has one
    entry per turn: the interaction that sampled it and its temperature and top_p
    (a continuation repeats its parent's turns); it is left out (None) when every turn
    is this record's own, sampled with ``sampling`` (a single-turn record, and every
    record written before the field existed; such a record encodes as before): see
    :meth:`origins`.
    """

    kind: Literal["interaction"] = "interaction"
    interaction_id: str = Field(min_length=1, max_length=256)
    created_at: float = Field(default_factory=time.time, allow_inf_nan=False)
    completed_at: float = Field(default_factory=time.time, allow_inf_nan=False)
    model: str = Field(min_length=1, max_length=256)
    deployment_id: str = "local"
    prompt_ids: list[TokenId] = Field(min_length=1)
    response_ids: list[TokenId]
    action_mask: list[bool]
    logprobs: list[LogProb]
    versions: list[Version]
    turn_ends: list[Annotated[int, Field(ge=0)]] = []
    turn_origins: list[TurnOrigin] | None = None
    sampling: SamplingParams = SamplingParams()
    finish_reason: str = "stop"
    """Why the answer ended: ``stop`` (the policy ended it), ``length`` (max tokens) or :data:`ABORTED`."""
    parent_id: str | None = None
    trajectory_started_at: float | None = Field(None, allow_inf_nan=False)
    """For a continuation: when its trajectory's first turn was created (the first record's
    ``created_at``); None for a first turn and in records written before the field. The learner
    trains no turn it may have forgotten training (trainer/join.py)."""
    user_id: str | None = None
    session_id: str | None = None
    segment: str | None = Field(None, max_length=SEGMENT_MAX_CHARS)
    """The request's segment key (the OpenAI ``user`` or ``serving.segment_field`` of its
    metadata; :mod:`online_sao.segments`); None when it had none, and in records written before
    the field existed."""
    prompt_text: str | None = None
    response_text: str | None = None

    @field_validator("segment")
    @classmethod
    def _segment_is_a_key(cls, value: str | None) -> str | None:
        problem = None if value is None else segment_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _lengths_agree(self) -> "Interaction":
        n = len(self.response_ids)
        if len(self.prompt_ids) + n > MAX_TOKENS_PER_RECORD:
            raise ValueError(f"trajectory of {len(self.prompt_ids) + n} tokens exceeds {MAX_TOKENS_PER_RECORD}")
        if len(self.action_mask) != n:
            raise ValueError(f"action_mask has {len(self.action_mask)} entries for {n} response tokens")
        actions = sum(self.action_mask)
        if len(self.logprobs) != actions:
            raise ValueError(f"logprobs has {len(self.logprobs)} entries for {actions} action tokens")
        if len(self.versions) != actions:
            raise ValueError(f"versions has {len(self.versions)} entries for {actions} action tokens")
        if any(lp > 0 for lp in self.logprobs):
            raise ValueError("a log-probability is above 0")
        if any(not 0 <= e < n for e in self.turn_ends):
            raise ValueError("turn_ends points outside response_ids")
        # each turn ends after the one before (serving adds an end only for a turn that sampled tokens):
        # out of order or repeated, the learner would credit rewards to the wrong turn and train a turn on none
        for turn, (earlier, later) in enumerate(zip(self.turn_ends, self.turn_ends[1:]), start=1):
            if later <= earlier:
                raise ValueError(f"turn_ends must increase strictly (one end per turn, in order): turn {turn} "
                                 f"ends at {later}, not after turn {turn - 1}'s end {earlier}")
        if self.turn_origins is not None and len(self.turn_origins) != len(self.turn_ends):
            raise ValueError(f"turn_origins has {len(self.turn_origins)} entries for {len(self.turn_ends)} turns")
        return self

    def origins(self) -> list[TurnOrigin]:
        """The origin of each assistant turn: ``turn_origins`` or, when left out, this record with
        its ``sampling`` for every turn."""
        if self.turn_origins is not None:
            return list(self.turn_origins)
        own = TurnOrigin(interaction_id=self.interaction_id, temperature=self.sampling.temperature,
                         top_p=self.sampling.top_p)
        return [own] * len(self.turn_ends)

    @property
    def policy_version(self) -> int:
        """The newest version that sampled any token (0 when nothing was sampled)."""
        return max(self.versions, default=0)


class TurnReward(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    turn: int = Field(ge=0)
    value: RewardValue


class Reward(Record):
    """A reward for an interaction: user feedback, a judge, an environment."""

    kind: Literal["reward"] = "reward"
    interaction_id: str = Field(min_length=1, max_length=256)
    value: RewardValue
    source: str = Field("user", min_length=1, max_length=128)
    created_at: float = Field(default_factory=time.time, allow_inf_nan=False)
    turn_rewards: list[TurnReward] = []
    """Rewards of single assistant turns, each turn at most once."""
    scores: dict[ScoreName, RewardValue] | None = Field(None, max_length=MAX_SCORES_PER_REWARD)
    """Named measurements behind the reward, where its source gives them (a judge's ``quality``
    and ``style``, say): books for the monitors and per-segment metrics (docs/DEPLOY.md,
    "Monitors"), never a training input. None (left out of the encoding) when there are none,
    and in records written before the field existed."""

    @field_validator("turn_rewards")
    @classmethod
    def _one_reward_per_turn(cls, turn_rewards: list[TurnReward]) -> list[TurnReward]:
        # two for one turn: which counted was the order the join happened to build its dict in
        turns = [t.turn for t in turn_rewards]
        if len(set(turns)) != len(turns):
            raise ValueError(f"a turn is named more than once: {turns}")
        return turn_rewards


MAX_HOLD_REASON_CHARS = 500
"""Longest reason an operator's hold or release carries (a sentence for the log, not a document)."""


class WeightsNotice(Record):
    """A new policy version in the weight store, a rollback to an older one, the registry's new
    champion (``champion``: what serving's canary answers with; it moves no serving version), or an
    operator's ``hold`` on one version and its ``release`` (serving/weights_hold.py)."""

    kind: Literal["weights"] = "weights"
    action: Literal["publish", "rollback", "champion", "hold", "release"] = "publish"
    version: Version
    location: str = Field(min_length=1)
    checksum: str = Field(pattern=r"^[0-9a-f]{64}$")
    model: str = "online-sao"
    step: Version = 0
    created_at: float = Field(default_factory=time.time, allow_inf_nan=False)
    metrics: dict[str, FiniteFloat] = {}
    reason: str | None = Field(None, max_length=MAX_HOLD_REASON_CHARS)
    """Why an operator held or released (``online-sao weights hold --reason``); None (left out of
    the encoding) on the learner's notices."""


class DeadLetter(Record):
    """A record that failed validation, kept with its raw bytes and the reason."""

    kind: Literal["dead_letter"] = "dead_letter"
    raw: Base64Bytes
    source_topic: str
    partition: int | None = None
    offset: int | None = None
    reason: str
    created_at: float = Field(default_factory=time.time, allow_inf_nan=False)


AnyRecord = Union[Interaction, Reward, WeightsNotice, DeadLetter]
_ANY = TypeAdapter(Annotated[AnyRecord, Field(discriminator="kind")])


def encode(record: Record) -> bytes:
    """Compact UTF-8 JSON of a record; refuses records over MAX_RECORD_BYTES, and one pydantic cannot
    serialize (text with a lone surrogate: a non-UTF-8 file name as Python decodes it) as a RecordError
    too, not a pydantic error that callers catching RecordError let through."""
    try:
        data = record.model_dump_json(exclude_none=True).encode("utf-8")
    except PydanticSerializationError as exc:
        raise RecordError(f"{type(record).__name__} cannot be encoded: {exc}") from exc
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"{type(record).__name__} of {len(data)} bytes exceeds {MAX_RECORD_BYTES}")
    return data


def decode(data: bytes, expected: type[Record] | None = None) -> AnyRecord:
    """Parse and validate one record; ``expected`` restricts its kind."""
    if not isinstance(data, (bytes, bytearray)):  # Kafka hands a tombstone (null value) over as None
        raise RecordError("record has no value (a tombstone)" if data is None
                          else f"record value is {type(data).__name__}, not bytes")
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}")
    if data.startswith(codecs.BOM_UTF8):  # json's own message would advise decoding with utf-8-sig
        raise RecordError("not a JSON record: it starts with a byte-order mark (records are UTF-8 without one)")
    try:
        # decoded here, not by json.loads: given bytes, it takes UTF-16 and UTF-32 too (and a BOM)
        text = bytes(data).decode("utf-8")
        if too_deep(text):  # measured, not parsed: the parser recurses to the interpreter's limit first
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        obj = json.loads(text, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise RecordError(f"not a JSON record: {exc}") from None
    except RecursionError:  # only past the depth check with a recursion limit set far below Python's default
        raise RecordError("not a JSON record: nested too deeply") from None
    if not isinstance(obj, dict):
        raise RecordError("record is not a JSON object")
    if b"\\u" in data and has_lone_surrogate(obj):  # only an escape can spell a lone surrogate
        raise RecordError("not a JSON record: a string holds a lone UTF-16 surrogate escape, which is not text")
    version = obj.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:  # true and 1.0 equal 1 in Python
        raise RecordError(f"unknown schema_version {version!r} (this build reads {SCHEMA_VERSION})")
    kind = None if expected is None else _kind_of(expected)
    if kind is not None and obj.get("kind") != kind:  # before the fields: which ones a record has depends on it
        raise RecordError(f"expected a {expected.__name__} record, got kind {obj.get('kind')!r}")
    try:
        # strict: JSON types as written, no coercion (true or "0.5" is no reward, 1.0 no token id; a JSON
        # integer is still a number for a float field); what the codec wrote is always of the right types
        record = _ANY.validate_python(obj, strict=True)
    except ValidationError as exc:
        raise RecordError(_describe(exc)) from None
    if expected is not None and not isinstance(record, expected):
        raise RecordError(f"expected a {expected.__name__} record, got kind {obj.get('kind')!r}")
    return record


def _kind_of(model: type[Record]) -> str | None:
    """The ``kind`` a record model's records carry (None for one without: :class:`Record` itself)."""
    field = model.model_fields.get("kind")
    return None if field is None else field.default


def _refuse_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name}")


def _describe(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:5]:
        loc = ".".join(str(p) for p in e["loc"][1:] or e["loc"])  # drop the union tag
        parts.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    return "invalid record: " + "; ".join(parts)

