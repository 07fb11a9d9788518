"""Each reward source's recent mean, on the interactions the learner trains.

With several sources (a judge on every answer, users' thumbs on some), an operator wants to see
them side by side: a judge whose mean drifts away from the users' is a judge to fix before the
policy learns its taste. The learner knows each trained interaction's rewards by source (the join
keeps them: :attr:`~trainer.join_state.JoinedInteraction.source_rewards`); this keeps the newest
``window`` of each source's and reports their mean and count, in MLflow (``source.<name>.reward``,
``source.<name>.count``) and Prometheus (``sao_learner_source_reward{source, stat}``).

Sources are named by clients, so their number is bounded: with ``reward.sources`` set, those are
the ones shown (no other is applied); otherwise the first :data:`MAX_SOURCES_SHOWN` seen since the
learner started, and every later one is folded into ``other``.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterable, Mapping

MAX_SOURCES_SHOWN = 8
"""Sources shown by name when ``reward.sources`` does not list them: each is a Prometheus series and
two MLflow metrics, and a client can name as many as it likes."""
OTHER = "other"
"""The label of every source past the bound."""
_NOT_IN_METRIC_NAMES = re.compile(r"[^A-Za-z0-9_\-. :/]")
"""What MLflow refuses in a metric name (it takes letters, digits and ``_-. :/``)."""


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
        """``source.<label>.reward`` and ``source.<label>.count`` (characters MLflow refuses in a
        name become ``_``)."""
        out: dict[str, float] = {}
        for label, (mean, count) in self.stats().items():
            name = _NOT_IN_METRIC_NAMES.sub("_", label)
            out[f"source.{name}.reward"] = mean
            out[f"source.{name}.count"] = float(count)
        return out
