"""Fault: the learner is killed with SIGKILL mid-stream and restarted (issue #7).

The live stack runs (own broker, ``online-sao serve``, ``online-sao learn``) with
traffic flowing. The learner checkpoints every ``CHECKPOINT_EVERY`` steps and
publishes every step, so right after it publishes a version whose step is not a
checkpoint step it holds trained, published, uncommitted work: the test watches
the weight store and sends SIGKILL the moment such a version appears (in
practice before the step's log line is written). The restarted learner
(checkpointing every step from then on, so its ledger is always current) must
resume from the last committed checkpoint, re-read what that checkpoint does not
cover, and go on publishing past the versions of its previous life. Serving
answers throughout. Every acknowledged interaction is trained on exactly once
(the learner's ledger against the ids serving acknowledged) and every published
weight is finite.
"""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.faults.harness import LiveStack, Traffic, assert_exactly_once
from trainer.checkpoint import Checkpointer, read_ledger

CHECKPOINT_EVERY = 3
"""trainer.checkpoint_every of this scenario: two of every three published steps are uncommitted."""
KILL_AFTER_VERSION = 4
"""The first life runs at least this many versions (one checkpoint) before the kill."""
WATCH_S = 0.005
"""Poll interval of the weight store while waiting for the version to kill at."""
VERSION_WAIT_S = 180.0
"""Until the learner (first or second life) publishes the version waited for, on two shared cores."""
TRAIN_WAIT_S = 120.0
"""Until every acknowledged interaction is in the ledger after traffic stops."""
GROUP_WAIT_MAX_S = 10.0
"""Longest the restarted learner may wait for its partitions (the figure its "consumer holds" line
logs: from joining the group to holding them): a static member (trainer.consumer_instance_id)
takes its partitions back at once; a dynamic one waited for the killed member's session to
expire (34 s measured, kafka-python's 45 s default)."""
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", re.MULTILINE)
_HELD_AFTER = re.compile(r"consumer holds \d+ partitions after ([\d.]+) s")


def _versions(store: Path) -> set[int]:
    return {int(e.name[1:9]) for e in os.scandir(store) if e.name.startswith("v") and e.name.endswith(".safetensors")}


def _kill_right_after_an_uncommitted_publish(stack: LiveStack) -> int:
    """SIGKILL the learner as soon as it published a version (= step in its first life)
    at or past KILL_AFTER_VERSION that is not a checkpoint step; returns the newest version
    stored after the kill."""
    store, deadline = Path(stack.cfg.weight_store_url), time.monotonic() + VERSION_WAIT_S
    while time.monotonic() < deadline:
        ready = [v for v in _versions(store) if v >= KILL_AFTER_VERSION and v % CHECKPOINT_EVERY]
        if ready:
            assert stack.kill("learner") == -signal.SIGKILL
            return max(_versions(store))  # normally min(ready): one more only if the kill came late
        stack.component("learner")  # still listed: it has not been killed by anyone else
        time.sleep(WATCH_S)
    raise AssertionError(f"no version >= {KILL_AFTER_VERSION} within {VERSION_WAIT_S:.0f} s\n"
                         f"{stack.log_tail('learner')}")


def _logged_at(log: str, message: str) -> list[tuple[float, str]]:
    """Unix times (the log's local times) and lines of the learner log's lines containing ``message``."""
    return [(datetime.strptime(_LOG_TIME.match(line).group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), line)
            for line in log.splitlines() if message in line and _LOG_TIME.match(line)]


def _first_after(log: str, message: str, since: float) -> tuple[float, str]:
    """The first line with ``message`` logged at or after Unix time ``since`` (the second life's: a
    rejoin of the group logs "consumer holds" again, so there may be more than one)."""
    found = next(((at, line) for at, line in _logged_at(log, message) if at >= since), None)
    assert found is not None, f"no {message!r} line after the kill\n{log[-3000:]}"
    return found


def _wait_version_past(stack: LiveStack, version: int) -> None:
    deadline = time.monotonic() + VERSION_WAIT_S
    while max(stack.weight_versions(), default=0) <= version:
        if time.monotonic() > deadline:
            raise AssertionError(f"no version past {version} after the restart\n{stack.log_tail('learner')}")
        time.sleep(0.2)


@pytest.mark.kafka
def test_learner_sigkill_mid_stream_then_restart_trains_every_acknowledged_interaction_once(live_stack):
    stack = live_stack({"trainer.checkpoint_every": CHECKPOINT_EVERY}).start()
    traffic = Traffic(stack.base_url, workers=2).start()
    try:
        killed_at = _kill_right_after_an_uncommitted_publish(stack)
        kill_time = time.time()
        committed = Checkpointer(stack.cfg.checkpoint_dir).load_latest().state.step
        acked_at_kill = len(traffic.acked)
        stack.restart("learner", {"trainer.checkpoint_every": 1})  # commits every step: the ledger is current
        _wait_version_past(stack, max(stack.weight_versions()))
    finally:
        traffic.stop()

    assert committed < killed_at, "the kill must leave published steps outside the checkpoint"
    assert traffic.statuses.keys() == {200}, traffic.statuses  # serving answered throughout
    stack.wait_trained(traffic.acked, TRAIN_WAIT_S)
    figures = assert_exactly_once(traffic.acked, stack.trained_ids())
    log = (stack.root / "logs" / "learner.log").read_text()
    assert f"from step {committed}, policy version {killed_at}" in log  # resumed; numbers past its old versions
    retrained = [iid for step, iid in read_ledger(stack.ledger_path) if step > committed]
    versions = stack.assert_published_weights_finite()
    # the log's times have milliseconds: the second life's lines come seconds after the kill (a restart)
    (started, _), (holding, held) = (_first_after(log, "rank(s) from step", kill_time),
                                     _first_after(log, "consumer holds", kill_time))
    group_wait_s = float(_HELD_AFTER.search(held).group(1))  # the learner's own figure
    print(f"learner-kill: SIGKILL after v{killed_at} (step {killed_at}), checkpoint at step {committed}, "
          f"{acked_at_kill} acked by then; {len(retrained)} ids trained after step {committed} in the "
          f"second life; {versions} finite versions; {figures}; restart: started {started - kill_time:.1f} s "
          f"after the kill, held its partitions {holding - started:.1f} s later "
          f"({holding - kill_time:.1f} s from the kill; {group_wait_s:.1f} s waiting for the group)")
    assert group_wait_s < GROUP_WAIT_MAX_S, f"the restarted learner waited for the dead member's session: {held}"
