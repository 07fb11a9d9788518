"""Tool calls parsed from the generated text.

The model writes a tool call as text its chat template taught it; a parser turns
the answer into the visible content and the calls (OpenAI's ``message.tool_calls``).
The record keeps the sampled tokens as they are: the calls are actions like any
other text. Parsers are picked by ``serving.tool_call_parser``.

``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format
Qwen-family (and Hermes) templates teach. A block is a call only as OpenAI defines one:
it names a function of the request's ``tools`` and its arguments are a JSON object
(NaN and infinities are not JSON; left out, they are ``{}``), and it holds nothing else.
Any other block stays in the content as it was written: a client would otherwise run a
tool it never offered, fail on the arguments, or run a call whose arguments the model
wrote under another key (``"parameters"``, or beside the name) as a call with none.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Protocol

from online_sao.json_depth import too_deep
from online_sao.schemas import has_lone_surrogate
from serving.answers import FunctionCall, ToolCall


@dataclass(frozen=True)
class ParsedAnswer:
    content: str
    """The text outside the tool-call blocks (blank when only whitespace is left)."""
    calls: tuple[ToolCall, ...]


class ToolCallParser(Protocol):
    def parse(self, text: str, tools: list[dict]) -> ParsedAnswer:
        """Split a whole answer into content and the calls to ``tools`` (the request's, as the chat
        template renders them)."""
        ...

    def held_from(self, text: str) -> int:
        """Where in ``text`` (an answer so far) text starts that may belong to a tool call, so a stream
        holds it back; ``len(text)`` when everything is plain content. Blank text before it is held too:
        beside calls it is no content (:meth:`parse`), so once sent a stream could not take it back."""
        ...


CALL_KEYS = frozenset({"name", "arguments"})
"""The keys a block's JSON object may hold to be a call: a block with others wrote its arguments
somewhere else, and taking it as a call with ``{}`` would run the tool on arguments the model never gave."""


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def declared_names(tools: list[dict]) -> frozenset[str]:
    """The function names a request offers (``tools`` as the chat template renders them)."""
    return frozenset(tool["function"]["name"] for tool in tools)


def arguments_json(arguments: object) -> str | None:
    """The JSON text of a call's arguments, or None when they are not a JSON object. A model may
    write them as an object or as JSON text holding one; NaN and infinities are refused, since
    a client's strict JSON parser would fail on them, and so are lone UTF-16 surrogates (a model
    that escapes an emoji as ``"\\ud83d\\ude00"`` may write half of it), which no UTF-8 answer can
    hold: the answer failed with 500 after it was logged, and each retry of the client logged it again."""
    if isinstance(arguments, str):
        if too_deep(arguments):  # measured, not parsed: the parser recurses to the interpreter's limit first
            return None
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            return None
    if not isinstance(arguments, dict) or has_lone_surrogate(arguments):
        return None
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere inside
        return None


class HermesToolCallParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, tools: list[dict]) -> ParsedAnswer:
        names = declared_names(tools)
        calls, content, last = [], [], 0
        for match in self._BLOCK.finditer(text):
            call = self._call(match.group(1), names)
            if call is None:
                continue
            content.append(text[last:match.start()])
            calls.append(call)
            last = match.end()
        content.append(text[last:])
        joined = "".join(content)
        return ParsedAnswer(joined if joined.strip() or not calls else "", tuple(calls))

    @staticmethod
    def _call(body: str, names: frozenset[str]) -> ToolCall | None:
        """The call a block's body makes, or None when it is not a call to one of ``names`` with
        a JSON object as arguments (absent arguments are an empty object) and no other key."""
        if too_deep(body):  # measured, not parsed (as in arguments_json)
            return None
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            return None
        if not (isinstance(data, dict) and data.keys() <= CALL_KEYS and isinstance(data.get("name"), str)
                and data["name"] in names):
            return None
        arguments = arguments_json(data.get("arguments", {}))
        if arguments is None:
            return None
        return ToolCall(id=new_call_id(), function=FunctionCall(name=data["name"], arguments=arguments))

    def held_from(self, text: str) -> int:
        start = self._tag_from(text)
        # Blank text so far ("\n" before a call) waits for the end of the answer or for text that is not
        # blank: when a call follows, parse() makes the content "" (null in a plain answer), and a client
        # that sent back the "\n" it was streamed did not repeat the reply as logged (400).
        return 0 if text[:start].isspace() else start

    def _tag_from(self, text: str) -> int:
        """Where the first opening tag, or a tail of ``text`` that may begin one, starts (else ``len(text)``)."""
        start = text.find(self.OPEN)
        if start >= 0:
            return start
        for size in range(min(len(self.OPEN) - 1, len(text)), 0, -1):  # a tail that may begin the tag
            if self.OPEN.startswith(text[-size:]):
                return len(text) - size
        return len(text)


TOOL_CALL_PARSERS: dict[str, type] = {"hermes": HermesToolCallParser}
"""``serving.tool_call_parser`` -> parser class."""
