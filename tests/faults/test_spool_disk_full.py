"""Fault: the spool's disk fills up while traffic flows.

No small filesystem can be mounted here (no tmpfs, no loop devices), so the
spool's quota ``serving.spool_max_bytes`` stands in for the disk: set to a few
records, it is ample while the broker keeps up (the write-ahead log empties as
the broker acknowledges) and fills once the broker hangs (SIGSTOP: nothing is
acknowledged, connections stay open). Serving must stay up and answer 200 while
it can still log, then 503 for new work, saying why, once it can neither write
the spool nor reach the broker; when the broker is back (SIGCONT) the spool
drains and requests succeed again. Every acknowledged
interaction is trained exactly once; every published weight version is finite.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.faults.harness import Traffic, assert_recovered

pytestmark = pytest.mark.kafka

SPOOL_QUOTA_BYTES = 16 * 1024
"""About ten interactions of the tiny model."""
ACKED_BEFORE = 12
"""More than the quota holds at once: the log must give space back while the broker is up."""
REFUSALS = 5
ACKED_AFTER = 4
TRAIN_TIMEOUT_S = 240.0


def test_spool_disk_full_refuses_new_work_with_the_reason_and_recovers(live_stack):
    stack = live_stack({"serving.spool_max_bytes": SPOOL_QUOTA_BYTES, "serving.log_ack_timeout_s": 3.0}).start()
    traffic = Traffic(stack.base_url).start()
    try:
        traffic.wait_for(lambda: len(traffic.acked) >= ACKED_BEFORE, 120)
        stack.wait_trained(list(traffic.acked), TRAIN_TIMEOUT_S)  # the learner is up and learning
        stack.pause_broker()
        down_at, acked_at_stop = time.monotonic(), len(traffic.acked)
        traffic.wait_for(lambda: traffic.count(503) >= REFUSALS, 120)
        first_503 = min(t for t, status in traffic.events if status == 503)
        acked_until_full = len(traffic.acked) - acked_at_stop
        status, ready = stack.readyz()
        alive = httpx.get(f"{stack.base_url}/healthz", timeout=10).status_code
        stack.resume_broker()
        up_at = time.monotonic()
        traffic.wait_for(lambda: any(s == 200 and t > up_at for t, s in traffic.events), 120)
        first_200 = min(t for t, s in traffic.events if s == 200 and t > up_at)
        acked_at_recovery = len(traffic.acked)
        traffic.wait_for(lambda: len(traffic.acked) >= acked_at_recovery + ACKED_AFTER, 120)
    finally:
        traffic.stop()
    assert alive == 200 and status == 503 and "spool_max_bytes" in ready["reason"]
    assert 0 < acked_until_full and traffic.count(503) >= REFUSALS
    assert all("spool_max_bytes" in message or "could not be logged" in message for message in traffic.refusals)
    assert "broker is unreachable" in traffic.refusals[-1]
    assert set(traffic.statuses) <= {200, 503, "stream_error"}, traffic.statuses  # a stream's 503 is an event
    recovered = assert_recovered(stack, traffic, TRAIN_TIMEOUT_S)
    figures, versions, train_s = recovered.figures, recovered.versions, recovered.train_s
    print(f"\nspool full (quota {SPOOL_QUOTA_BYTES} B): acked {figures.acked} ({acked_until_full} after the broker "
          f"hung, before the spool was full), first 503 {first_503 - down_at:.1f} s after the hang, "
          f"statuses {dict(traffic.statuses)}, broker back -> first 200 {first_200 - up_at:.1f} s, "
          f"trained {figures.trained} (unacked but trained {figures.unacked_trained}), duplicates dropped "
          f"{stack.join_counters().get('duplicate_interactions')}, last acked -> trained {train_s:.1f} s, "
          f"weight versions checked {versions}; reason: {ready['reason']}")
