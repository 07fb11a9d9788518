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
