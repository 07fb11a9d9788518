"""Tool calls parsed from the generated text.

The model writes a tool call as text its chat template taught it; a parser turns
the answer into the visible content and the calls (OpenAI's ``message.tool_calls``).
The record keeps the sampled tokens as they are: the calls are actions like any
other text. Parsers are picked by ``serving.tool_call_parser``.

``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format
Qwen-family (and Hermes) templates teach. A block whose body is not such a JSON
object stays in the content as it was written.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Protocol

from serving.answers import FunctionCall, ToolCall


@dataclass(frozen=True)
class ParsedAnswer:
    content: str
    """The text outside the tool-call blocks (blank when only whitespace is left)."""
    calls: tuple[ToolCall, ...]


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedAnswer:
        """Split a whole answer into content and tool calls."""
        ...

    def held_from(self, text: str) -> int:
        """Where in ``text`` (an answer so far) text starts that may belong to a tool call, so a stream
        holds it back; ``len(text)`` when everything is plain content."""
        ...


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class HermesToolCallParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedAnswer:
        calls, content, last = [], [], 0
        for match in self._BLOCK.finditer(text):
            call = self._call(match.group(1))
            if call is None:
                continue
            content.append(text[last:match.start()])
            calls.append(call)
            last = match.end()
        content.append(text[last:])
        joined = "".join(content)
        return ParsedAnswer(joined if joined.strip() or not calls else "", tuple(calls))

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        try:
            data = json.loads(body)
        except ValueError:
            return None
        if not (isinstance(data, dict) and isinstance(data.get("name"), str)):
            return None
        arguments = data.get("arguments", {})
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return ToolCall(id=new_call_id(), function=FunctionCall(name=data["name"], arguments=text))

    def held_from(self, text: str) -> int:
        start = text.find(self.OPEN)
        if start >= 0:
            return start
        for size in range(min(len(self.OPEN) - 1, len(text)), 0, -1):  # a tail that may begin the tag
            if self.OPEN.startswith(text[-size:]):
                return len(text) - size
        return len(text)


TOOL_CALL_PARSERS: dict[str, type] = {"hermes": HermesToolCallParser}
"""``serving.tool_call_parser`` -> parser class."""
