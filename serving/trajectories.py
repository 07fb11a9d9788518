"""Multi-turn and agent trajectories: one logged record per conversation so far.

A request with ``parent_interaction_id`` continues an earlier interaction. The
engine then conditions on exactly the tokens of that trajectory (the parent's
prompt, its sampled tokens, earlier observations) followed by the new
observation tokens (user turns, tool results; ``action_mask`` False), so the
logged trajectory is what the model really saw. The new record carries the
whole trajectory, ``parent_id`` links it to the previous turn and
``turn_ends`` marks the last token of each assistant turn; a reward for the
conversation should be given to the newest interaction id.

Recent trajectories are held in memory, in a least-recently-used cache of
``ServingConfig.max_trajectories`` entries, per server process: a parent that
was evicted, or served by another process or before a restart, cannot be
continued (404), and one older than the reward window is refused with 410.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from online_sao.schemas import Interaction, SamplingParams, TurnOrigin


@dataclass(frozen=True)
class Trajectory:
    record: Interaction
    template_messages: tuple[dict, ...] | None = None
    """Chat: every message so far as the chat template renders them, the assistant's reply
    (as returned to the client) last."""
    visible_text: str | None = None
    """Completions with a text prompt: the prompt plus the text returned to the client."""
    message_keys: tuple[tuple, ...] | None = None
    """Chat: each message as the client sends it back (``protocol.message_key``); the reply's key
    holds the content and tool calls as returned, while ``template_messages`` holds its text as
    sampled."""
    tools: str | None = None
    """Chat: the tools the template rendered, as canonical JSON (a continuation must send the same)."""

    @property
    def token_ids(self) -> list[int]:
        return self.record.prompt_ids + self.record.response_ids


class TrajectoryCache:
    """Least-recently-used map of interaction id -> :class:`Trajectory` (used from one event loop)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, Trajectory] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, interaction_id: str) -> Trajectory | None:
        item = self._items.get(interaction_id)
        if item is not None:
            self._items.move_to_end(interaction_id)
        return item

    def put(self, interaction_id: str, trajectory: Trajectory) -> None:
        self._items[interaction_id] = trajectory
        self._items.move_to_end(interaction_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


@dataclass
class TrajectoryPrefix:
    """Everything of the record that comes before the tokens sampled by this request."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    action_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    turn_origins: list[TurnOrigin] = field(default_factory=list)
    parent_id: str | None = None
    started_at: float | None = None
    """When the trajectory's first turn was created (None: this request starts it)."""

    @classmethod
    def continuing(cls, parent: Interaction, observation_ids: list[int]) -> "TrajectoryPrefix":
        return cls(prompt_ids=list(parent.prompt_ids),
                   response_ids=list(parent.response_ids) + list(observation_ids),
                   action_mask=list(parent.action_mask) + [False] * len(observation_ids),
                   logprobs=list(parent.logprobs), versions=list(parent.versions),
                   turn_ends=list(parent.turn_ends), turn_origins=parent.origins(),
                   parent_id=parent.interaction_id,
                   started_at=parent.trajectory_started_at if parent.trajectory_started_at is not None
                   else parent.created_at)

    @property
    def engine_prompt(self) -> list[int]:
        """The tokens the engine conditions on."""
        return self.prompt_ids + self.response_ids

    def extended(self, interaction_id: str, sampling: SamplingParams, sampled: list[int], logprobs: list[float],
                 versions: list[int]) -> dict:
        """The trajectory fields of record ``interaction_id`` once ``sampled`` (this turn's
        tokens, drawn with ``sampling``) are appended."""
        response = self.response_ids + sampled
        own = TurnOrigin(interaction_id=interaction_id, temperature=sampling.temperature, top_p=sampling.top_p)
        origins: list[TurnOrigin] | None = self.turn_origins + ([own] if sampled else [])
        if all(origin == own for origin in origins):
            origins = None  # every turn is the record's own: its sampling says it (Interaction.origins)
        return dict(prompt_ids=self.prompt_ids, response_ids=response,
                    action_mask=self.action_mask + [True] * len(sampled),
                    logprobs=self.logprobs + logprobs, versions=self.versions + versions,
                    turn_ends=self.turn_ends + ([len(response) - 1] if sampled else []),
                    turn_origins=origins, parent_id=self.parent_id, trajectory_started_at=self.started_at)


REPLY_MARKER = "SAO-REPLY-MARKER-4b1d"
"""Stands in for the parent's reply when a template changes the reply's text as it renders it."""


def chat_observation_text(render, stored: list[dict], new: list[dict], stop_text: str | None) -> str | None:
    """Text between the parent's last sampled token and the new generation prompt, or None.

    ``render(messages, add_generation_prompt)`` is the tokenizer's chat template. The
    parent's reply is rendered as ``opening + content + closing``; the trajectory already
    holds the reply's sampled tokens, which end with the stop token when the model closed
    the turn itself, so the observation is the rest of ``closing`` followed by the new
    messages and the generation prompt. A template that renders the reply with whitespace
    around it (Llama 2's ``' ' + content.strip() + ' ' + eos_token``) or trimmed
    (``content | trim``) is read with :data:`REPLY_MARKER` in the reply's place: what it puts
    between the generation prompt and the reply may only be whitespace, since the model's own
    tokens stand there in the trajectory; for the same reason whitespace between the reply and
    the stop token the model sampled is left out. None when the template does not render the
    new conversation as an extension of the old one.
    """
    opening = render(stored[:-1], True)
    content = stored[-1]["content"]
    after_reply = render(stored, False)
    full = render(new, True)
    if not full.startswith(after_reply):
        return None
    if after_reply.startswith(opening + content):
        closing = after_reply[len(opening) + len(content):]
    else:
        closing = _closing_around_marker(render, stored, opening)
        if closing is None:
            return None
    if stop_text:
        # The model's stop token ends its sampled reply, so whitespace the template puts before it (Llama 2's
        # ' ' + eos_token) stands where the model's own tokens are, like the whitespace around the reply:
        # left in, the whole closing would follow the model's stop token as a second one. (A stop token
        # that itself starts with whitespace is matched as it is first.)
        trimmed = closing if closing.startswith(stop_text) else closing.lstrip()
        if trimmed.startswith(stop_text):
            closing = trimmed[len(stop_text):]
    return closing + full[len(after_reply):]


def _closing_around_marker(render, stored: list[dict], opening: str) -> str | None:
    if not isinstance(stored[-1].get("content"), str):
        return None
    marked = render(stored[:-1] + [{**stored[-1], "content": REPLY_MARKER}], False)
    at = marked.find(REPLY_MARKER)
    if at < 0 or marked[:at].rstrip() != opening.rstrip():
        return None
    return marked[at + len(REPLY_MARKER):]
