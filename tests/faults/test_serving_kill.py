"""Fault: serving killed with SIGKILL while traffic flows, then restarted.

To be sure the kill lands on interactions that were acknowledged but not yet on
the broker, the broker is paused (SIGSTOP) a moment before the kill and resumed
after it: everything serving acknowledged in between exists only in its spool.
The restarted server reads back what the broker took before the kill and replays
the rest of the spool: every acknowledged interaction and reward must be on its
topic exactly once (0 duplicates for every consumer of the topics, not only the
learner), trained exactly once, and every published weight version must be finite.

A second, fast test checks the learner's side of the at-least-once replay: a
copy of an interaction trained before a learner restart is still dropped.
"""

from __future__ import annotations

import time

import pytest

from online_sao.config import RewardConfig
from online_sao.schemas import Interaction, Reward
from serving.spool import Spool
from tests.faults.harness import Traffic, assert_recovered
from trainer.join import RewardJoiner

ACKED_BEFORE_PAUSE = 6
ACKED_WHILE_PAUSED = 4
"""Interactions acknowledged while the broker hangs: only the spool holds them at the kill."""
ACKED_AFTER_RESTART = 6
TRAIN_TIMEOUT_S = 240.0


@pytest.mark.kafka
def test_serving_sigkill_loses_no_acknowledged_interaction(live_stack):
    stack = live_stack().start()
    traffic = Traffic(stack.base_url).start()
    try:
        traffic.wait_for(lambda: len(traffic.acked) >= ACKED_BEFORE_PAUSE, 120)
        stack.wait_trained(list(traffic.acked), TRAIN_TIMEOUT_S)  # the learner is up and learning
        stack.pause_broker()
        paused_at = len(traffic.acked)
        traffic.wait_for(lambda: len(traffic.acked) >= paused_at + ACKED_WHILE_PAUSED, 60)
        code = stack.kill("serving")
        killed_at, acked_at_kill = time.monotonic(), len(traffic.acked)
        in_spool = Spool(stack.cfg.spool_dir, stack.cfg.serving.spool_max_bytes,
                         dead_letter_topic=stack.cfg.kafka.topics.dead_letters).pending_records
        stack.resume_broker()
        stack.restart("serving")
        traffic.wait_for(lambda: len(traffic.acked) >= acked_at_kill + ACKED_AFTER_RESTART, 120)
    finally:
        traffic.stop()
    assert code == -9
    first_answer = min(t for t, status in traffic.events if status == 200 and t > killed_at)
    assert in_spool >= acked_at_kill - paused_at >= ACKED_WHILE_PAUSED  # the kill hit acknowledged, unsent ones
    recovered = assert_recovered(stack, traffic, TRAIN_TIMEOUT_S)
    figures, versions, train_s = recovered.figures, recovered.versions, recovered.train_s
    copies = stack.copies_on_topics()
    read_back = [line for line in stack.log_tail("serving", 10_000).splitlines() if "spool read back" in line]
    assert set(traffic.acked) <= set(copies.interactions)
    assert copies.duplicates == 0, (f"on the topics twice: {[i for i, n in copies.interactions.items() if n > 1]} "
                                    f"and {sum(n > 1 for n in copies.rewards.values())} rewards")
    print(f"\nserving SIGKILL: acked {figures.acked} (at the kill {acked_at_kill}, {acked_at_kill - paused_at} while "
          f"the broker hung), in the spool at the kill {in_spool}, trained {figures.trained} "
          f"(unacked but trained {figures.unacked_trained}), on the topics {len(copies.interactions)} interactions "
          f"and {len(copies.rewards)} rewards, duplicates on the topics {copies.duplicates}, dropped by the "
          f"learner {stack.join_counters().get('duplicate_interactions')}, statuses {dict(traffic.statuses)}, "
          f"kill -> first 200 {first_answer - killed_at:.1f} s, last acked -> trained {train_s:.1f} s, "
          f"weight versions checked {versions}; {read_back[-1].split('spool read back: ')[-1] if read_back else ''}")


def _interaction(iid: str) -> Interaction:
    return Interaction(interaction_id=iid, model="m", prompt_ids=[1, 2], response_ids=[3], action_mask=[True],
                       logprobs=[-0.5], versions=[0])


def test_a_replayed_copy_is_dropped_after_the_learner_restarts():
    cfg = RewardConfig(window_s=60.0)
    before = RewardJoiner(cfg)
    before.add_interaction(_interaction("a"), ts=100.0)
    before.add_reward(Reward(interaction_id="a", value=1.0), ts=100.5)
    assert [j.interaction.interaction_id for j in before.pop_ready(8, 10_000)] == ["a"]  # trained
    after = RewardJoiner(cfg)
    after.load_state_dict(before.state_dict())  # the checkpoint of that step, loaded by the restarted learner
    after.add_interaction(_interaction("a"), ts=130.0)  # serving replays its spool: the same id again
    after.add_reward(Reward(interaction_id="a", value=1.0), ts=130.5)
    assert after.pop_ready(8, 10_000) == []
    assert after.counters.duplicate_interactions == 1
