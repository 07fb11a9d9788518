"""Per-segment metrics under slot keys: bounded keys whatever the users do, which label each slot
shows (the slot tags and their history), and what a slot shows when its label has no reward."""

from __future__ import annotations

import math

from online_sao.segments import (OTHER, SCORE_NAMES_TRACKED, SLOT_HISTORY_CHARS, SegmentRewards, SegmentSlots,
                                 slot_tag)


def test_thousands_of_churning_users_give_at_most_top_n_plus_one_groups_of_keys():
    books = SegmentRewards(top_n=3, window=8)
    keys: set[str] = set()
    for i in range(20_000):  # 5000 equally active users, each seen four times: the top 3 churns throughout
        books.observe(f"user-{(i * 7919) % 5000}", 0.5, {"quality": 1.0, "style": 0.0})
        if i % 10 == 0:
            keys |= set(books.metrics())
    fields = ("reward", "count", "score_quality", "score_style")
    assert keys == {f"segment.{slot}.{field}" for slot in ("slot1", "slot2", "slot3", "other") for field in fields}


def test_a_label_keeps_its_slot_while_in_the_top_n_and_an_entrant_takes_the_freed_one():
    books = SegmentRewards(top_n=2, window=10)
    for segment in ["a", "b", "a"]:
        books.observe(segment, 1.0)
    assert books.slots.labels == ["a", "b"]
    for _ in range(3):
        books.observe("c", 0.0)  # c (3) passes b (1), then a (2): it takes b's slot, a keeps slot 1
    assert books.slots.labels == ["a", "c"]
    metrics = books.metrics()
    assert metrics["segment.slot1.reward"] == 1.0 and metrics["segment.slot1.count"] == 2.0
    assert metrics["segment.slot2.reward"] == 0.0 and metrics["segment.slot2.count"] == 2.0
    assert metrics["segment.other.count"] == 1.0  # c's first reward came while it was outside the top 2


def test_tags_name_each_slots_label_and_add_a_history_line_only_when_it_changes():
    slots = SegmentSlots(top_n=2)
    slots.seat(["red", "blue"])
    assert slots.tags(4) == {"segment.slot1": "red", "segment.slot1.history": "4 red",
                             "segment.slot2": "blue", "segment.slot2.history": "4 blue"}
    slots.seat(["blue", "red"])  # the ranks swapped: nothing moves
    assert slots.tags(5)["segment.slot1.history"] == "4 red"
    slots.seat(["blue", "team green"])
    tags = slots.tags(9)
    assert tags["segment.slot1"] == "team green" and tags["segment.slot1.history"] == "4 red\n9 team green"
    assert tags["segment.slot2.history"] == "4 blue"
    slots.seat(["blue", OTHER])  # a key spelled like the bucket stays in it: slot 1 empties
    tags = slots.tags(12)
    assert tags["segment.slot1"] == "" and tags["segment.slot1.history"] == "4 red\n9 team green\n12"


def test_a_slot_whose_label_has_no_reward_in_the_window_shows_nan_not_the_labels_before():
    books = SegmentRewards(top_n=1, window=10)
    books.observe("a", 1.0, {"quality": 0.5})
    books.observe(OTHER, 0.0)
    books.observe(OTHER, 0.0)  # "other" (2) passes a (1): a's slot empties, and a's rewards go
    metrics = books.metrics()
    assert metrics["segment.slot1.count"] == 0.0
    assert math.isnan(metrics["segment.slot1.reward"]) and math.isnan(metrics["segment.slot1.score_quality"])
    assert metrics["segment.other.count"] == 2.0 and math.isnan(metrics["segment.other.score_quality"])


def test_score_names_are_bounded_over_all_segments_together():
    books = SegmentRewards(top_n=2, window=4)
    books.observe("a", 0.0, {f"s{k}": 1.0 for k in range(SCORE_NAMES_TRACKED)})
    books.observe("b", 0.0, {"late": 1.0, "s0": 0.5})  # a name past the limit, from another segment
    metrics = books.metrics()
    assert not any(name.endswith(".score_late") for name in metrics)
    assert metrics["segment.slot2.score_s0"] == 0.5 and math.isnan(metrics["segment.slot2.score_s1"])
    assert len([name for name in metrics if name.startswith("segment.slot1.score_")]) == SCORE_NAMES_TRACKED


def test_a_reopened_runs_history_goes_on_and_keeps_only_its_newest_lines():
    slots = SegmentSlots(top_n=2, resumed={slot_tag(1, "history"): "3 red\n40 blue", "restarts": "1"})
    slots.seat(["blue", "green"])  # after a restart the books fill afresh: blue happens to take slot 1 again
    tags = slots.tags(57)
    assert tags[slot_tag(1, "history")] == "3 red\n40 blue" and tags[slot_tag(2, "history")] == "57 green"
    long = "x" * 250
    for step in range(100, 200):
        slots.seat([f"{long}{step}"])
        history = slots.tags(step)[slot_tag(1, "history")]
        assert len(history) <= SLOT_HISTORY_CHARS
    assert history.splitlines()[-1] == f"199 {long}199" and not history.startswith("3 red")
