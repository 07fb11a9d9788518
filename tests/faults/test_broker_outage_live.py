"""Fault: the broker stopped for 30 s while traffic flows, then restarted.

Serving keeps answering from its spool (every request 200) and replays it when
the broker is back; the learner waits through the outage and resumes. Every
acknowledged interaction is trained exactly once and every published weight
version is finite.
"""

from __future__ import annotations

import time

import pytest

from tests.faults.harness import POLL_S, Traffic, assert_recovered

pytestmark = pytest.mark.kafka

OUTAGE_S = 30.0
"""How long the broker stays down (issue #7)."""
ACKED_BEFORE = 6
ACKED_AFTER = 3
TRAIN_TIMEOUT_S = 240.0


def test_broker_down_30_s_serving_spools_and_replays_learner_resumes(live_stack):
    stack = live_stack().start()
    traffic = Traffic(stack.base_url).start()
    peak_spooled = 0.0
    try:
        traffic.wait_for(lambda: len(traffic.acked) >= ACKED_BEFORE, 120)
        stack.wait_trained(list(traffic.acked), TRAIN_TIMEOUT_S)  # the learner is up and learning
        stack.stop_broker()
        down_at, acked_at_stop = time.monotonic(), len(traffic.acked)
        while time.monotonic() - down_at < OUTAGE_S:
            peak_spooled = max(peak_spooled, stack.metric("sao_serving_spool_records"))
            time.sleep(POLL_S)
        acked_during = len(traffic.acked) - acked_at_stop
        stack.start_broker()
        up_at = time.monotonic()
        traffic.wait_for(lambda: stack.metric("sao_serving_spool_records") == 0, 120)
        replayed_s = time.monotonic() - up_at
        traffic.wait_for(lambda: len(traffic.acked) >= acked_at_stop + acked_during + ACKED_AFTER, 120)
    finally:
        traffic.stop()
    assert set(traffic.statuses) == {200}, traffic.statuses  # serving never failed a request
    assert acked_during > 0 and peak_spooled > 0
    recovered = assert_recovered(stack, traffic, TRAIN_TIMEOUT_S)
    figures, versions, train_s = recovered.figures, recovered.versions, recovered.train_s
    print(f"\nbroker down {OUTAGE_S:.0f} s: acked {figures.acked} ({acked_during} during the outage), "
          f"peak spool {peak_spooled:.0f} records, spool replayed {replayed_s:.1f} s after the broker was back, "
          f"trained {figures.trained} (unacked but trained {figures.unacked_trained}), duplicates dropped "
          f"{stack.join_counters().get('duplicate_interactions')}, statuses {dict(traffic.statuses)}, "
          f"last acked -> trained {train_s:.1f} s, weight versions checked {versions}")
