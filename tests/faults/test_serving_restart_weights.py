"""Fault: serving restarted after the learner published versions, with the broker up and down.

A restarted replica starts on the weights of ``model.path`` (version 0) and replays the weights
topic. It used to report ready (``/readyz`` 200) at once: with the broker up its first answers came
from version 0, with the broker down every answer of the outage did, although the weight store held
the newest version. Now it is ready once its follower has loaded the version the topic names; with
the broker down, after ``serving.weights_catch_up_s``, on what it has, with a warning, and it moves
to the newest version once the broker is back. ``/healthz`` answers 200 all along.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.faults.harness import LiveStack, Traffic

VERSIONS = 3
"""Versions the learner publishes before the restart."""
PUBLISH_TIMEOUT_S = 180.0
"""Until the learner published ``count`` versions, and until it trained every acknowledged interaction."""
CATCH_UP_S = 6.0
"""``serving.weights_catch_up_s`` of the replica restarted while the broker is down."""
CATCH_UP_MARGIN_S = CATCH_UP_S / 2
"""The test measures the wait from its first catching-up probe, which the app's catch-up clock precedes
by the server's start to listening plus a probe's round trip (two requests on a loaded box: easily more
than the 1 s allowed before). Half the wait still tells "waited weights_catch_up_s" from "ready at once"."""
CONVERGE_S = 60.0
"""The broker back: time for the follower to reconnect (a failed connect takes kafka.client_timeout_s) and load."""
PROBE_S = 0.02
PROBE_TIMEOUT_S = 30.0
"""A probe's wait for an answer: a loaded two-core box may answer late; a late answer is not an outage."""
NO_ANSWER = -1
"""``Probe.ready`` of a probe whose connection was made but got no answer: a timeout after
:data:`PROBE_TIMEOUT_S` (a listening process, late), or a connection the old process dropped as it stopped."""
READY_SEEN_S = 10.0
"""The replica answered the harness ready: time for the probe thread to see that too."""


def publish_versions(stack: LiveStack, count: int) -> int:
    """Traffic until the learner published ``count`` versions, then until it trained every interaction
    acknowledged; returns the newest version then, the last one the learner publishes.

    No later version can come: rewards go out only for acknowledged ids (an interaction answered but
    not acknowledged gets none, and ``reward.on_missing`` "drop" trains nothing on it), every step
    publishes (``trainer.publish_every`` 1) before its checkpoint writes its ids to the ledger, and
    nothing else publishes here (no registry decision, no drift restart). Waiting for "no new version
    for a few seconds" instead lost to a loaded learner that published the leftovers' version later."""
    traffic = Traffic(stack.base_url, workers=1, stream_every=0, pause_s=0.3).start()
    try:
        traffic.wait_for(lambda: len(stack.weight_versions()) >= count, PUBLISH_TIMEOUT_S)
    finally:
        traffic.stop(60)
    assert not traffic.unrewarded, f"{len(traffic.unrewarded)} rewards never got through"
    stack.wait_trained(traffic.acked, PUBLISH_TIMEOUT_S)
    return max(stack.weight_versions())


def served_version(stack: LiveStack) -> int:
    return httpx.get(f"{stack.base_url}/v1/models", timeout=10.0).json()["data"][0]["policy_version"]


def answered_version(stack: LiveStack) -> int:
    answer = stack.client().chat.completions.create(model="online-sao", max_tokens=2,
                                                    messages=[{"role": "user", "content": "hi"}])
    return answer.model_extra["policy_version"]


@dataclass(frozen=True)
class Probe:
    at: float
    ready: int | None
    """``/readyz``'s status (None: refused, the process not listening; :data:`NO_ANSWER`: neither down
    nor ready)."""
    body: dict
    health: int | None


@dataclass
class Probes:
    """``/readyz`` and ``/healthz`` every :data:`PROBE_S` while a replica starts, as an orchestrator's
    probes (often, to see a moment of readiness on the wrong weights)."""

    base_url: str
    seen: list[Probe] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probes", daemon=True)

    def __enter__(self) -> "Probes":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=PROBE_TIMEOUT_S) as http:
            while not self._stop.wait(PROBE_S):
                self.seen.append(self._probe(http))

    @staticmethod
    def _probe(http: httpx.Client) -> Probe:
        """Only a refused connection says the process is down (``after_restart`` cuts there): a timeout
        of the restarted process taken for one hid every probe before it, its catching-up ones too."""
        try:
            ready = http.get("/readyz")
            health = http.get("/healthz").status_code
        except httpx.ConnectError:
            return Probe(time.monotonic(), None, {}, None)
        except httpx.TransportError:  # a timeout (a connect timeout too), or a dropped connection
            return Probe(time.monotonic(), NO_ANSWER, {}, None)
        return Probe(time.monotonic(), ready.status_code, ready.json(), health)

    def wait_ready(self, timeout_s: float = READY_SEEN_S) -> None:
        """Until a probe of the restarted process saw ``/readyz`` 200. ``restart`` returns on the
        harness's own 200; the probe thread may have been mid-request then, its last answer a 503."""
        deadline = time.monotonic() + timeout_s
        while not any(probe.ready == 200 for probe in self.after_restart()):
            assert time.monotonic() < deadline, self.seen[-10:]
            time.sleep(PROBE_S)

    def after_restart(self) -> list[Probe]:
        """The probes from the first one the restarted process answered (the old one's end left out)."""
        down = max((k for k, probe in enumerate(self.seen) if probe.ready is None), default=-1)
        return self.seen[down + 1:]

    def catching_up(self) -> list[Probe]:
        return [probe for probe in self.after_restart()
                if probe.ready == 503 and probe.body["reason"].startswith("catching_up_weights")]


@pytest.mark.kafka
def test_a_restarted_replica_is_ready_only_on_the_newest_published_version(live_stack):
    stack = live_stack().start()
    newest = publish_versions(stack, VERSIONS)
    assert served_version(stack) == newest
    with Probes(stack.base_url) as probes:
        stack.restart("serving")  # returns once /readyz answers 200
        probes.wait_ready()
    first_ready = next(probe for probe in probes.after_restart() if probe.ready == 200)
    # before the fix: ready (and answering) on version 0 until the follower had loaded the newest
    assert first_ready.body["policy_version"] == newest, (first_ready, stack.log_tail("serving"))
    assert answered_version(stack) == newest


@pytest.mark.kafka
def test_a_replica_restarted_while_the_broker_is_down_waits_weights_catch_up_s_then_follows_when_it_is_back(
        live_stack):
    stack = live_stack().start()
    newest = publish_versions(stack, 1)
    stack.stop_broker()
    with Probes(stack.base_url) as probes:
        stack.restart("serving", {"serving.weights_catch_up_s": CATCH_UP_S})
        probes.wait_ready()
    catching_up = probes.catching_up()
    log = stack.log_tail("serving", 300)
    assert catching_up, (probes.seen[-10:], log)  # before the fix: ready at once, on version 0
    assert all(probe.health == 200 for probe in catching_up)  # alive while unready: not restarted
    reason = catching_up[-1].body["reason"]
    assert "connecting to the weights topic" in reason or "unreachable" in reason, reason
    ready_at = next(probe.at for probe in probes.after_restart() if probe.ready == 200)
    assert ready_at - catching_up[0].at >= CATCH_UP_S - CATCH_UP_MARGIN_S
    assert "ready on v0 without the newest published weights" in log and "weights_catch_up_s" in log
    assert answered_version(stack) == 0  # what it has, said by the warning
    stack.start_broker()
    deadline = time.monotonic() + CONVERGE_S
    while served_version(stack) != newest and time.monotonic() < deadline:
        time.sleep(0.5)
    assert served_version(stack) == newest, stack.log_tail("serving")
