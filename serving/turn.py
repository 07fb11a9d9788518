"""One admitted completion request while it is served: what it asked for and what was sampled."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from online_sao.schemas import SamplingParams
from serving.answers import UsageInfo
from serving.receipt import Receipt
from serving.tool_calls import ParsedAnswer
from serving.trajectories import TrajectoryPrefix


ROUTE_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
"""The HTTP path of each route a record names: the ``route`` label of serving's latency metrics,
the same values as its request counter's (which counts by path)."""
PROMPT_PARAMS = {"chat": "messages", "completions": "prompt"}
"""The request field that holds each route's prompt (the ``param`` of errors about it)."""


@dataclass
class Turn:
    """One admitted request while it is served."""

    interaction_id: str
    route: str
    prefix: TrajectoryPrefix
    sampling: SamplingParams
    user: str | None
    session_id: str | None
    segment: str | None = None
    """The request's segment key (:func:`serving.monitoring.request_segment`)."""
    template_messages: list[dict] | None = None
    message_keys: list[tuple] | None = None
    tools: list[dict] | None = None
    """Chat: the tools the template rendered; their calls are parsed from the answer."""
    prompt_text: str | None = None
    top_logprobs: int | None = None
    """Alternatives per token when the client asked for log-probs, else None."""
    created_at: float = field(default_factory=time.time)
    started: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    alternatives: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    parsed: ParsedAnswer | None = None
    """Chat with tools: the answer split into content and tool calls, once it ended."""
    receipt: Receipt | None = None
    """Set when the interaction was submitted to the logger."""

    @property
    def path(self) -> str:
        """The HTTP path it was asked on (:data:`ROUTE_PATHS`)."""
        return ROUTE_PATHS[self.route]

    @property
    def prompt_param(self) -> str:
        """The request field that holds its prompt, for errors about it."""
        return PROMPT_PARAMS[self.route]

    @property
    def created(self) -> int:
        """The answer's ``created`` (Unix seconds): one value for every chunk of a stream."""
        return int(self.created_at)

    @property
    def policy_versions(self) -> list[int]:
        return sorted(set(self.versions))

    @property
    def answer_finish_reason(self) -> str | None:
        """The finish reason clients see: ``tool_calls`` when the model ended its turn after calling tools."""
        if self.parsed is not None and self.parsed.calls and self.finish_reason == "stop":
            return "tool_calls"
        return self.finish_reason

    @property
    def content(self) -> str:
        """The text clients see as the answer (without tool-call blocks)."""
        return self.text if self.parsed is None else self.parsed.content

    def usage(self) -> UsageInfo:
        prompt = len(self.prefix.engine_prompt)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=len(self.token_ids),
                         total_tokens=prompt + len(self.token_ids))
