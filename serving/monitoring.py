"""What serving watches in its own traffic: requests per segment (bounded labels) and the
length and repetition of its recent answers (docs/DEPLOY.md, "Segments" and "Monitors in
/metrics"). The books are pure (:mod:`online_sao.segments`, :mod:`online_sao.monitors`);
this module derives a request's segment key and keeps the books behind a lock, because
answers are logged on the event loop while ``/metrics`` is read from a worker thread (its route
runs in FastAPI's threadpool). The monitors copy the window under the lock and compute outside
it: computed under it, a scrape over long answers held the event loop's next ``observe``."""

from __future__ import annotations

import threading
from collections import deque

from online_sao.monitors import mean_answer_length, repeated_ngram_share
from online_sao.segments import SegmentCounter, segment_problem
from serving.errors import APIError
from serving.protocol import SamplingRequest


def request_segment(request: SamplingRequest, segment_field: str | None) -> str | None:
    """The segment key of ``request``: its ``user`` (``segment_field`` None) or that key of its
    ``metadata``; None when absent or empty. A key that cannot be logged is a 400 naming the field."""
    if segment_field is None:
        value, param = request.user, "user"
    else:
        value, param = (request.metadata or {}).get(segment_field), f"metadata.{segment_field}"
    if not value:
        return None
    problem = segment_problem(value)
    if problem is not None:
        raise APIError(400, f"{param} is this request's segment key and {problem}", param=param,
                       code="invalid_segment")
    return value


class ServingMonitors:
    """Requests per segment label, and the newest ``window`` answers' action tokens."""

    def __init__(self, top_n: int, window: int, ngram: int) -> None:
        self._segments = SegmentCounter(top_n)
        self._answers: deque[list[int]] = deque(maxlen=window)
        self.ngram = ngram
        self._lock = threading.Lock()

    def observe(self, segment: str | None, answer: list[int]) -> None:
        """One logged interaction: its segment and the tokens this request sampled."""
        with self._lock:
            self._segments.observe(segment)
            self._answers.append(list(answer))

    def segment_requests(self) -> dict[str, int]:
        """Logged interactions per label: the top ``top_n`` segments and ``other``."""
        with self._lock:
            return self._segments.labelled_counts()

    def mean_length(self) -> float:
        """Mean sampled tokens per recent answer (NaN before the first)."""
        return mean_answer_length(self._recent_answers())

    def repetition(self) -> float:
        """Share of repeated ``ngram``-grams in the recent answers (NaN without any)."""
        return repeated_ngram_share(self._recent_answers(), self.ngram)

    def _recent_answers(self) -> list[list[int]]:
        """The window's answers now; each is a copy made by :meth:`observe` that nobody changes."""
        with self._lock:
            return list(self._answers)
