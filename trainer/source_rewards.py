"""Each reward source's recent mean, on the interactions the learner trains.

With several sources (a judge on every answer, users' thumbs on some), an operator wants to see
them side by side: a judge whose mean drifts away from the users' is a judge to fix before the
policy learns its taste. The learner knows each trained interaction's rewards by source (the join
keeps them: :attr:`~trainer.join_state.JoinedInteraction.source_rewards`); this keeps the newest
``window`` of each source's and reports their mean and count, in MLflow (``source.<name>.reward``,
``source.<name>.count``) and Prometheus (``sao_learner_source_reward{source, stat}``).

MLflow refuses a metric key with characters outside its set, or one that names another path once
read as a file path (``judge//v2``, ``a/./b``, ``x/../y``), and ``/v1/feedback`` takes any source
name up to 128 characters: a refused key would end the learner's loop, and the source would stay
in the window to refuse it again. A name of letters, digits and ``_-.`` is the metric's ``<name>``
as it is (unless it ends as a hashed name does, below); any other has every other character (``/`` too) written ``_`` and the first 8 hex digits
of its SHA-256 appended after ``-h`` (``https://judge.example/v2`` -> ``https___judge.example_v2-h<hash>``), so
two names that clean to the same text keep their own keys. The Prometheus label is the name itself.

Sources are named by clients, so their number is bounded: with ``reward.sources`` set, those are
the ones shown (no other is applied); otherwise the first :data:`MAX_SOURCES_SHOWN` seen since the
learner started, and every later one is folded into ``other``.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import deque
from collections.abc import Iterable, Mapping

MAX_SOURCES_SHOWN = 8
"""Sources shown by name when ``reward.sources`` does not list them: each is a Prometheus series and
two MLflow metrics, and a client can name as many as it likes."""
OTHER = "other"
"""The label of every source past the bound."""
_NOT_PLAIN = re.compile(r"[^A-Za-z0-9_.-]")
"""What a source name shown as it is may not hold: MLflow takes ``/`` too, but reads a key as a
file path and refuses one that resolves to another (module docstring); a space and ``:`` it
refuses on Windows."""
HASH_HEX_DIGITS = 8
"""Hex digits of the SHA-256 of a name that is not plain, appended to its cleaned text: tells
apart the few names shown (at most :data:`MAX_SOURCES_SHOWN` and ``other``) that clean alike."""
_LOOKS_HASHED = re.compile(rf"-h[0-9a-f]{{{HASH_HEX_DIGITS}}}$")
"""The end of a hashed name: a plain label ending so is hashed too (a client may send one to take
another source's key)."""


class SourceRewards:
    """The newest ``window`` rewards of each source shown (module docstring)."""

    def __init__(self, window: int, sources: Iterable[str] | None = None) -> None:
        """``sources``: the sources to show (``reward.sources``); None: the first ``MAX_SOURCES_SHOWN`` seen."""
        self.window = window
        self.fixed = sources is not None
        self.rewards: dict[str, deque[float]] = {source: deque(maxlen=window) for source in sources or ()}

    def observe(self, source_rewards: Mapping[str, float]) -> None:
        """One trained interaction's rewards, one per source that rated it."""
        for source, value in source_rewards.items():
            self._label(source).append(float(value))

    def _label(self, source: str) -> deque[float]:
        if source in self.rewards:
            return self.rewards[source]
        named = len(self.rewards) - (OTHER in self.rewards)
        label = source if not self.fixed and named < MAX_SOURCES_SHOWN and source != OTHER else OTHER
        return self.rewards.setdefault(label, deque(maxlen=self.window))

    def stats(self) -> dict[str, tuple[float, int]]:
        """Per label: (mean of its newest rewards, NaN without any; how many)."""
        return {label: (sum(values) / len(values) if values else math.nan, len(values))
                for label, values in sorted(self.rewards.items())}

    def metrics(self) -> dict[str, float]:
        """``source.<name>.reward`` and ``source.<name>.count``, ``<name>`` as
        :func:`metric_names` gives it."""
        stats = self.stats()
        names = metric_names(stats)
        out: dict[str, float] = {}
        for label, (mean, count) in stats.items():
            out[f"source.{names[label]}.reward"] = mean
            out[f"source.{names[label]}.count"] = float(count)
        return out


def metric_names(labels: Iterable[str]) -> dict[str, str]:
    """Each label's ``<name>`` in its metric keys (module docstring): a plain label as it is, any other
    cleaned and hashed, and so is a plain label that ends like a hashed name (``-h`` and 8 hex digits),
    so that no label can take another's key. Each name depends on its label alone: a source's keys stay
    the same whatever other sources come and go."""
    return {label: label if _is_plain(label) and not _LOOKS_HASHED.search(label) else _hashed(label)
            for label in labels}


def _is_plain(label: str) -> bool:
    return _NOT_PLAIN.search(label) is None


def _hashed(label: str) -> str:
    digest = hashlib.sha256(label.encode()).hexdigest()[:HASH_HEX_DIGITS]
    return f"{_NOT_PLAIN.sub('_', label)}-h{digest}"  # "-h": a dated name (judge-20240513) is no hashed one
