"""The completions' ``text_offset`` of a streamed answer: each chunk asks where its first token's text
starts, and each token's text is measured once over the whole answer (not again at every chunk)."""

from __future__ import annotations

from dataclasses import dataclass

from online_sao.schemas import SamplingParams
from serving.openai_serving import _text_length
from serving.trajectories import TrajectoryPrefix
from serving.turn import Turn


@dataclass
class Entry:
    token: str


class CountingTexts:
    """Token ``t``'s text is ``t`` letters long; counts the texts it was asked for."""

    def __init__(self) -> None:
        self.asked = 0

    def top(self, token_id: int, logprob: float) -> Entry:
        self.asked += 1
        return Entry("x" * token_id)


def test_offsets_chunk_by_chunk_are_the_sums_of_the_earlier_texts_each_measured_once():
    turn = Turn("sao-test", "completions", TrajectoryPrefix([1]), SamplingParams(), user=None, session_id=None)
    texts = CountingTexts()
    offsets = []
    for token in (3, 1, 4, 1, 5):  # a chunk per sampled token, as a stream sends them
        offsets.append(_text_length(turn, texts, len(turn.token_ids)))
        turn.token_ids.append(token)
    assert offsets == [0, 3, 4, 8, 9]
    assert _text_length(turn, texts, 5) == 14 and _text_length(turn, texts, 2) == 4
    assert texts.asked == 5
