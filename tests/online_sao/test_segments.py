"""Per-segment books: bounded labels, the top-N choice, rewards per segment (the metric slots:
test_segment_slots.py)."""

from __future__ import annotations

import pytest

from online_sao.segments import (NO_SEGMENT, OTHER, SCORE_NAMES_TRACKED, SEGMENT_MAX_CHARS, SegmentCounter,
                                 SegmentRewards, segment_problem)


def test_many_distinct_users_give_at_most_n_plus_one_labels_and_bounded_memory():
    counter = SegmentCounter(top_n=3)
    for i in range(5000):
        counter.observe(f"user-{i}")
        assert len(counter.labelled_counts()) <= 4
    assert len(counter.counts) <= counter.capacity == 12  # never more keys held than the sketch's capacity
    counts = counter.labelled_counts()
    named = [v for k, v in counts.items() if k != OTHER]
    assert len(named) == 3 and sum(counts.values()) == 5000  # the rest is folded into other, none lost
    # every user was seen once: a held count overestimates by at most total / capacity
    assert max(named) <= 5000 // counter.capacity + 1


def test_heavy_segments_are_the_named_ones_among_many_rare_ones():
    counter = SegmentCounter(top_n=2)
    for i in range(3000):
        counter.observe(f"rare-{i}")  # each seen once
        if i % 3 == 0:
            counter.observe("alice")  # 1000 times
        if i % 5 == 0:
            counter.observe("bob")  # 600 times
        if i % 50 == 0:
            counter.observe("carol")  # 60 times: more than a rare user, far less than bob
    assert counter.top() == ["alice", "bob"]
    counts = counter.labelled_counts()
    assert set(counts) == {"alice", "bob", OTHER}
    # the sketch overestimates a held key by at most the smallest held count when it entered
    total = 3000 + 1000 + 600 + 60
    assert 1000 <= counts["alice"] <= 1000 + total // counter.capacity
    assert 600 <= counts["bob"] <= 600 + total // counter.capacity
    assert counts[OTHER] == 3000 + 1000 + 600 + 60 - counts["alice"] - counts["bob"]
    assert counter.label("carol") == OTHER and counter.label("alice") == "alice"


def test_exact_counts_while_few_segments_and_requests_without_one():
    counter = SegmentCounter(top_n=2)
    for key in ["a", "a", "b", None, None, None, "c"]:
        counter.observe(key)
    assert counter.labelled_counts() == {NO_SEGMENT: 3, "a": 2, OTHER: 2}  # b and c folded
    assert counter.label(None) == NO_SEGMENT


def test_a_key_spelled_like_the_bucket_shares_it_and_nothing_is_lost():
    counter = SegmentCounter(top_n=1)
    for key in ["other", "other", "x"]:
        counter.observe(key)
    assert counter.labelled_counts() == {OTHER: 3}


def test_reward_per_segment_is_the_mean_over_its_window():
    books = SegmentRewards(top_n=2, window=3)
    for segment, reward in [("a", 1.0), ("a", 0.0), ("b", -1.0), ("a", 0.5), ("a", 0.25), ("b", -0.5)]:
        books.observe(segment, reward)
    stats = books.stats()
    assert stats["a"].reward == pytest.approx((0.0 + 0.5 + 0.25) / 3) and stats["a"].count == 3  # window of 3
    assert stats["b"].reward == -0.75 and stats["b"].count == 2
    assert OTHER not in stats  # no reward outside the top 2 yet
    books.observe("c", 2.0)  # c ties nobody: one request, below a and b
    assert books.stats()[OTHER].reward == 2.0
    metrics = books.metrics()
    assert books.slots.labels == ["a", "b"]
    assert metrics["segment.slot1.count"] == 3.0 and metrics["segment.slot2.reward"] == -0.75
    assert metrics["segment.other.reward"] == 2.0


def test_a_segment_that_leaves_the_top_loses_its_label_and_rewards():
    books = SegmentRewards(top_n=1, window=10)
    books.observe("a", 1.0)
    books.observe("b", 0.5)  # a tie keeps a (first in sort order): b's reward goes to other
    assert {k: v.reward for k, v in books.stats().items()} == {"a": 1.0, OTHER: 0.5}
    books.observe("b", 0.0)  # b overtakes a
    assert {k: v.reward for k, v in books.stats().items()} == {"b": 0.0, OTHER: 0.5}  # a's reward went with it
    books.observe("a", 1.0)  # 2 each: the tie puts a back on top, with only its new reward
    assert {k: (v.reward, v.count) for k, v in books.stats().items()} == {"a": (1.0, 1), OTHER: (0.5, 1)}


def test_scores_per_segment_are_means_over_the_window_and_their_names_are_bounded():
    books = SegmentRewards(top_n=2, window=2)
    books.observe("a", 1.0, {"quality": 0.25})
    books.observe("a", 0.0, {"quality": 0.5, "style": 1.0})
    books.observe("a", 0.0, {"quality": 1.0})  # the window of 2 drops the first reading
    books.observe("b", 0.5)  # a reward without scores
    stats = books.stats()
    assert stats["a"].scores == {"quality": 0.75, "style": 1.0} and stats["b"].scores == {}
    metrics = books.metrics()
    assert books.slots.labels == ["a", "b"]
    assert metrics["segment.slot1.score_quality"] == 0.75 and metrics["segment.slot1.score_style"] == 1.0
    for k in range(SCORE_NAMES_TRACKED + 5):  # a source that names a new score every time
        books.observe("a", 0.0, {f"s{k}": 1.0})
    assert len(books.stats()["a"].scores) == SCORE_NAMES_TRACKED


@pytest.mark.parametrize("key, ok", [("alice", True), ("ü 1@x", True), ("", False), ("a\nb", False),
                                     ("x" * SEGMENT_MAX_CHARS, True), ("x" * (SEGMENT_MAX_CHARS + 1), False)])
def test_segment_keys_are_bounded_printable_text(key, ok):
    assert (segment_problem(key) is None) == ok
