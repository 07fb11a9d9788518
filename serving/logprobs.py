"""Sampled tokens and their behaviour log-probabilities in OpenAI's ``logprobs`` shape.

The values are the engine's own: the log-probability of each sampled token under the
distribution it was drawn from (temperature and top-p applied), the one logged for
training, and the most likely tokens under that same distribution. Every sampled token
of the turn is listed, the stop token included (it is an action in the record although
the text leaves it out), so the list lines up with the record's log-probs of this turn.
"""

from __future__ import annotations

import json
import re

from serving.answers import TokenLogprob, TopLogprob


def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of byte-level BPE: printable Latin-1 bytes stand for themselves, every other
    byte for the code point 256 + its rank among those others."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    alphabet.update({chr(256 + rank): b for rank, b in enumerate(others)})
    return alphabet


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.decoder).__name__ == "ByteLevel"


SENTENCEPIECE_SPACE = "\u2581"
"""The "▁" a SentencePiece-style vocabulary writes a word's leading space as."""
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""A byte-fallback token's spelling: the one byte no other token of the vocabulary holds."""


def _decoder_types(tokenizer) -> set[str]:
    """The types of the tokenizer's decoder and of the decoders in it (empty without a fast backend)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    return {decoder.get("type", ""), *(part.get("type", "") for part in decoder.get("decoders", []))}


def _is_sentencepiece_style(tokenizer) -> bool:
    """Llama 2, Mistral, Gemma: "▁" for a space and byte-fallback tokens, undone by the decoder."""
    return bool(_decoder_types(tokenizer) & {"Metaspace", "ByteFallback"})


class TokenTexts:
    """Text and bytes of single token ids (cached), and the OpenAI entries built from them.

    A byte-level token may hold part of a UTF-8 character: its text then decodes with
    U+FFFD, and ``bytes`` (read off the token's byte-level spelling) are exact. So are a
    SentencePiece-style token's: a byte-fallback token ``<0xF0>`` is that byte, and a token's
    "▁" is the space that decoding it alone drops (its text keeps the space too).
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._sentencepiece = not self._byte_level and _is_sentencepiece_style(tokenizer)
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _text_and_bytes(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            spelling = (self._tokenizer.convert_ids_to_tokens(token_id)
                        if self._byte_level or self._sentencepiece else None)
            if self._byte_level and spelling is not None and all(c in BYTE_LEVEL_ALPHABET for c in spelling):
                raw = [BYTE_LEVEL_ALPHABET[c] for c in spelling]
            elif self._sentencepiece and spelling is not None and (byte := BYTE_FALLBACK.fullmatch(spelling)):
                raw = [int(byte.group(1), 16)]  # decoded alone it is U+FFFD: its byte is in its name
            elif self._sentencepiece and spelling is not None and token_id not in self._special:
                text = spelling.replace(SENTENCEPIECE_SPACE, " ")  # with the space a lone decode drops
                raw = list(text.encode("utf-8"))
            else:
                raw = list(text.encode("utf-8"))
            cached = self._cache[token_id] = (text, raw)
        return cached

    def top(self, token_id: int, logprob: float) -> TopLogprob:
        text, raw = self._text_and_bytes(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=raw)

    def sampled(self, token_id: int, logprob: float, alternatives: tuple[tuple[int, float], ...]) -> TokenLogprob:
        text, raw = self._text_and_bytes(token_id)
        return TokenLogprob(token=text, logprob=logprob, bytes=raw,
                            top_logprobs=[self.top(t, lp) for t, lp in alternatives])
