"""The join buffer in a checkpoint (trainer/join_checkpoint.py) read back by a learner whose record
checks are stricter than the version that wrote it."""

from __future__ import annotations

import json
import logging

from online_sao.config import RewardConfig
from tests.trainer.records import make_interaction, make_reward
from trainer.join import RewardJoiner
from trainer.join_checkpoint import joiner_state, load_joiner_state


def test_an_entry_the_record_checks_now_refuse_is_left_out_and_named_not_a_learner_that_cannot_start(caplog):
    """turn_ends out of order were accepted before 2026-12-07; such an interaction in a checkpoint's join
    buffer made restoring it raise, and the learner could not start at all."""
    joiner = RewardJoiner(RewardConfig(window_s=60.0), max_pending=100)
    for iid in ("good", "bad", "rated"):
        joiner.add_interaction(make_interaction(iid, response=[5, 6, 7]), ts=1.0)
    joiner.add_reward(make_reward("rated", 1.0), ts=2.0)
    state = json.loads(json.dumps(joiner_state(joiner)))
    (bad,) = [e for e in state["waiting"] if e["interaction"]["interaction_id"] == "bad"]
    bad["interaction"]["turn_ends"] = [2, 2]  # repeated: refused since

    restored = RewardJoiner(RewardConfig(window_s=60.0), max_pending=100)
    with caplog.at_level(logging.ERROR, logger="trainer.join_checkpoint"):
        load_joiner_state(restored, state)
    assert set(restored._waiting) == {"good"} and list(restored._ready) == ["rated"]
    assert any("bad" in r.getMessage() and "left out" in r.getMessage() for r in caplog.records)


def test_a_left_out_continuation_leaves_its_earlier_turns_finished_not_waiting_for_ever():
    """The continuation held its first turn p (and p's reward): left out alone, p was nowhere, and a
    later reward for it waited as an early reward that could never join."""
    from tests.trainer.records import conversation

    p, c = conversation(["p", "c"])
    joiner = RewardJoiner(RewardConfig(window_s=60.0), max_pending=100)
    joiner.add_interaction(p, ts=1.0)
    joiner.add_interaction(c, ts=2.0)  # c holds the waiting p
    state = json.loads(json.dumps(joiner_state(joiner)))
    (entry,) = state["waiting"]
    entry["interaction"]["turn_ends"] = [entry["interaction"]["turn_ends"][0]] * 2  # refused since

    restored = RewardJoiner(RewardConfig(window_s=60.0), max_pending=100)
    load_joiner_state(restored, state)
    restored.add_reward(make_reward("p", 1.0), ts=3.0)
    assert not restored._held and restored.counters.early_rewards == 0
    assert "p" in restored.memory and "c" in restored.memory


def test_rewards_held_in_the_buffer_are_checked_against_todays_range_and_sources_on_a_restart(caplog):
    """A learner restarted with a narrowed reward range (or a rater removed from reward.sources) trained
    the rewards its checkpoint's join buffer held under the old settings: serving refused the same value
    with 422 by then."""
    wide = RewardConfig(window_s=60.0, min_value=-10.0, max_value=10.0)
    joiner = RewardJoiner(wide, max_pending=100)
    for iid in ("in-range", "too-high", "rater", "waits"):
        joiner.add_interaction(make_interaction(iid, response=[5, 6, 7]), ts=1.0)
    joiner.add_reward(make_reward("in-range", 0.5), ts=2.0)
    joiner.add_reward(make_reward("too-high", 8.0), ts=2.0)
    joiner.add_reward(make_reward("rater", -0.9, source="spammy_judge"), ts=2.0)
    joiner.add_reward(make_reward("early", 9.0), ts=2.0)  # held: its interaction comes later
    state = json.loads(json.dumps(joiner_state(joiner)))
    assert state["counters"]["joined"] == 3

    narrowed = RewardConfig(window_s=60.0, min_value=-1.0, max_value=1.0, sources=["user"])
    restored = RewardJoiner(narrowed, max_pending=100)
    with caplog.at_level(logging.WARNING, logger="trainer.join_checkpoint"):
        load_joiner_state(restored, state)

    assert list(restored._ready) == ["in-range"]
    assert set(restored._waiting) == {"too-high", "rater", "waits"}  # their windows close them as settings say
    assert not restored._held
    assert restored.counters.refused_on_resume == 3 and restored.counters.joined == 1
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("checkpoint: 3 rewards of the join buffer are not applied")
    assert "1 from a source reward.sources leaves out" in line and "2 outside reward.min_value..max_value" in line
    restored.add_interaction(make_interaction("early", response=[5, 6, 7]), ts=3.0)
    restored.advance(100.0)  # every window closed: nothing refused trains, the rest is dropped unrewarded
    assert [j.interaction.interaction_id for j in restored.pop_ready(10, 10_000)] == ["in-range"]
    assert restored.counters.dropped_no_reward == 4


def test_a_ready_interaction_no_longer_rated_by_every_source_it_waits_for_waits_again():
    """It was ready because the judge and the user had both rated it; the user's reward, outside the
    narrowed range, is not applied, and it trained at once, mid-window, with a valid reward still to come."""
    both = dict(window_s=60.0, wait_for_sources=["judge", "user"])
    joiner = RewardJoiner(RewardConfig(**both), max_pending=100)
    joiner.add_interaction(make_interaction("a", response=[5, 6, 7]), ts=1.0)
    joiner.add_reward(make_reward("a", 0.5, source="judge"), ts=2.0)
    joiner.add_reward(make_reward("a", 5.0, source="user"), ts=2.0)
    state = json.loads(json.dumps(joiner_state(joiner)))
    assert [e["interaction"]["interaction_id"] for e in state["ready"]] == ["a"]

    restored = RewardJoiner(RewardConfig(**both, min_value=-1.0, max_value=1.0), max_pending=100)
    load_joiner_state(restored, state)
    assert not restored._ready and set(restored._waiting) == {"a"} and restored.counters.joined == 0
    restored.add_reward(make_reward("a", 0.9, source="user"), ts=3.0)  # in time, in range
    [taken] = restored.pop_ready(10, 10_000)
    assert taken.interaction.interaction_id == "a" and restored.counters.late_rewards == 0


def test_rewards_of_a_checkpoint_from_before_sources_were_kept_are_not_refused_by_reward_sources():
    joiner = RewardJoiner(RewardConfig(window_s=60.0), max_pending=100)
    joiner.add_interaction(make_interaction("a", response=[5, 6, 7]), ts=1.0)
    joiner.add_reward(make_reward("a", 0.5), ts=2.0)
    state = json.loads(json.dumps(joiner_state(joiner)))
    for contribution in state["ready"][0]["contributions"]:
        del contribution["source"]  # written before rewards carried their source

    restored = RewardJoiner(RewardConfig(window_s=60.0, sources=["user"]), max_pending=100)
    load_joiner_state(restored, state)
    assert list(restored._ready) == ["a"] and restored.counters.refused_on_resume == 0
