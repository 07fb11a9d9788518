"""Sampled token ids to streamed text: incremental decoding and stop strings."""

from __future__ import annotations

from typing import Protocol

CONTEXT_TOKENS = 5
"""Prompt tokens the decoder starts from (as read): SentencePiece-style decoders (Llama 2, Mistral,
Gemma) drop the word-initial space of the first token they decode, so the first answer token's
space was lost (``"Paris"`` after ``"The capital of France is"``). A few tokens of context are
enough for any decoder to know a token is not the first; vLLM's detokenizer keeps five."""
REPLACEMENT_CHAR = "\ufffd"
"""What a byte-level tokenizer decodes an incomplete UTF-8 sequence to: text ending in it is
not final yet (the next token may complete the character)."""


class Decodes(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ..., **kwargs) -> str: ...


def decode_after(tokenizer: Decodes, prompt: list[int], ids: list[int]) -> str:
    """``ids`` decoded as they read after ``prompt``, special tokens kept (a record's
    ``response_text``): after the prompt's last :data:`CONTEXT_TOKENS` as context, as
    :class:`IncrementalDecoder` streams them, so a SentencePiece-style decoder keeps the first
    token's word-initial space that decoding ``ids`` alone drops. Where the context's text is not
    a prefix of the whole's (a decoder that rewrites across the boundary), ``ids`` alone."""
    def decode(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=False)

    context = list(prompt[-CONTEXT_TOKENS:])
    while context and decode(context).endswith(REPLACEMENT_CHAR):
        context.pop()  # a prompt cut inside a character: left out, as the stream leaves it out
    head, whole = decode(context), decode(context + list(ids))
    return whole[len(head):] if context and whole.startswith(head) else decode(list(ids))


class IncrementalDecoder:
    """Decodes a growing list of token ids, returning only text that later tokens cannot change.

    It decodes a short window: ids from ``_start`` (where the last stable text began) to
    the end, and compares with the window up to ``_read`` (ids already turned into text),
    so each step costs a few tokens, not the whole response. Special tokens and the
    ``hidden`` ids (stop tokens, which are actions but not text) produce no text. ``prompt``:
    the ids before the answer; its last :data:`CONTEXT_TOKENS` are the context the first answer
    token is decoded after (their own text is never returned), less those that end inside a
    character: the answer's bytes that finish it would otherwise count as the prompt's.
    """

    def __init__(self, tokenizer: Decodes, hidden: frozenset[int] = frozenset(), prompt: list[int] = ()):
        self._tokenizer = tokenizer
        self._hidden = hidden
        self._context: list[int] | None = list(prompt[-CONTEXT_TOKENS:]) if prompt else None
        """Read at the first answer token: the engine has accepted the prompt's ids by then."""
        self._ids: list[int] = []
        self._start = 0
        self._read = 0

    def _start_after_the_prompt(self) -> None:
        context, self._context = self._context or [], None
        while context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context.pop()  # a prompt cut inside a character: the answer's first bytes finish it, as text
        self._ids, self._read = context, len(context)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        if self._context is not None:
            self._start_after_the_prompt()
        if token_id in self._hidden:
            return ""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._start:self._read])
        now = self._decode(self._ids[self._start:])
        if len(now) <= len(before) or now.endswith(REPLACEMENT_CHAR):
            return ""
        self._start, self._read = self._read, len(self._ids)
        return now[len(before):]

    def finish(self) -> str:
        """Text still held back at the end (an incomplete character decodes as U+FFFD)."""
        before = self._decode(self._ids[self._start:self._read])
        now = self._decode(self._ids[self._start:])
        self._start = self._read = len(self._ids)
        return now[len(before):] if len(now) > len(before) else ""


class StopStrings:
    """Cuts the text at the first stop string, holding back any tail that may begin one."""

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop string ended the text."""
        if not self._stops:
            return piece, False
        self._pending += piece
        hits = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            out, self._pending = self._pending[:min(hits)], ""
            return out, True
        keep = min(self._hold, len(self._pending))
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """The held-back tail, once no more text will come."""
        out, self._pending = self._pending, ""
        return out
