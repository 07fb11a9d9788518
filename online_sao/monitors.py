"""Monitors of a policy's recent answers that do not trust the reward: length, repetition,
and the share of records the learner could not use. Pure functions over token lists; the
registry's rollback rule and thresholds live in trainer.deploy (``deploy.monitor_*``)."""

from __future__ import annotations

import math


def mean_answer_length(answers: list[list[int]]) -> float:
    """Mean number of sampled (action) tokens per answer; NaN without answers."""
    return sum(len(a) for a in answers) / len(answers) if answers else math.nan


def repeated_ngram_share(answers: list[list[int]], n: int) -> float:
    """Share of the answers' ``n``-grams that already occurred earlier in the same answer,
    pooled over answers (0: no repetition; close to 1: one phrase over and over). NaN when no
    answer has an ``n``-gram."""
    total = repeated = 0
    for answer in answers:
        seen: set[tuple[int, ...]] = set()
        for start in range(len(answer) - n + 1):
            gram = tuple(answer[start:start + n])
            repeated += gram in seen
            seen.add(gram)
            total += 1
    return repeated / total if total else math.nan


def dead_letter_share(dead_letters: float, records_read: float) -> float:
    """Dead-lettered records per record read over the same stretch; NaN when none was read."""
    return dead_letters / records_read if records_read > 0 else math.nan
