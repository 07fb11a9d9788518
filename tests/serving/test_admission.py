"""Admission, disconnects and shutdown over real HTTP (uvicorn, a FakeEngine with batch slots): the
waiting bound refuses with 503, a client that leaves stops its generation, a shutdown refuses what has not
started and cuts what runs with an answer."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import openai
import pytest

from online_sao.config import load_config
from serving.errors import APIError
from serving.turn import InFlight
from tests.serving.conftest import ANSWER, HELD_AFTER, MESSAGES, MODEL, chat, metric, raw_post, wait_until


def test_a_request_beyond_max_waiting_is_refused_503_with_retry_after_and_nothing_logged(serve):
    s = serve(slots=1, **{"serving.max_batch_size": 1, "serving.max_waiting": 2})
    client = s.openai()
    with ThreadPoolExecutor(3) as pool:
        admitted = [pool.submit(client.chat.completions.create, model=MODEL, messages=MESSAGES) for _ in range(3)]
        assert wait_until(lambda: s.engine.holding == 1 and s.engine.queued == 2)
        assert (s.inflight.running, s.inflight.waiting) == (1, 2)
        for stream in (False, True):  # a stream is refused by create(), before any event
            with pytest.raises(openai.InternalServerError) as refused:
                client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream)
            assert refused.value.status_code == 503 and refused.value.body["code"] == "server_overloaded"
            assert refused.value.response.headers["Retry-After"] == "1"
        assert len(s.engine.requests) == 3  # the refused never reached the engine
        assert metric(s.url, "sao_serving_engine_waiting ") == "sao_serving_engine_waiting 2.0"
        assert metric(s.url, "sao_serving_engine_running ") == "sao_serving_engine_running 1.0"
        ready = httpx.get(f"{s.url}/readyz")  # saturated, still ready: see serving.routes.status_routes
        assert ready.status_code == 200 and (ready.json()["waiting"], ready.json()["running"]) == (2, 1)
        s.engine.release.set()
        assert all(f.result().choices[0].message.content == ANSWER for f in admitted)
    assert 'status="503"} 2.0' in metric(s.url, 'sao_serving_requests_total{route="/v1/chat/completions",status="503"')
    assert len(s.interactions()) == 3
    assert (s.inflight.running, s.inflight.waiting) == (0, 0)


def _admit(inflight: InFlight, count: int) -> None:
    """``count`` requests admitted and handed to the engine, none sampling yet."""
    for _ in range(count):
        inflight.admit()
        inflight.entered()


def _assert_overloaded(inflight: InFlight) -> None:
    with pytest.raises(APIError) as refused:
        inflight.admit()
    assert refused.value.status == 503 and refused.value.code == "server_overloaded"


def test_the_bound_counts_what_queues_beyond_the_batch_not_what_fills_it():
    inflight = InFlight(max_waiting=1, slots=2)
    _admit(inflight, 3)  # a burst at an idle server: two take the free slots (prefill), one queues
    assert (inflight.running, inflight.waiting) == (2, 1)
    _assert_overloaded(inflight)
    inflight.started()
    inflight.started()
    inflight.ended(started=True)  # an answer ends: the queued request takes its slot
    assert (inflight.running, inflight.waiting) == (2, 0)
    inflight.admit()
    assert load_config(environ={}, overrides={"serving.max_batch_size": 8}).serving.waiting_bound == 32


def test_a_bound_of_zero_admits_into_free_slots_and_refuses_what_would_queue():
    """``max_waiting: 0`` refused every request, an idle server's too (0 waiting >= 0)."""
    inflight = InFlight(max_waiting=0, slots=2)
    _admit(inflight, 2)
    assert (inflight.running, inflight.waiting) == (2, 0)
    _assert_overloaded(inflight)


def test_a_plain_client_that_disconnects_stops_its_generation_and_is_logged_as_abort(serve):
    s = serve(slots=1)
    sock = raw_post(s.url, chat())
    assert wait_until(lambda: s.engine.holding == 1)
    sock.close()
    assert wait_until(lambda: s.engine.open_streams == 0), "the engine still samples for a client that left"
    [record] = s.interactions()
    assert record.finish_reason == "abort" and len(record.response_ids) == HELD_AFTER
    assert (s.inflight.running, s.inflight.waiting) == (0, 0)
    assert 'status="499"} 1.0' in metric(s.url, 'sao_serving_requests_total{route="/v1/chat/completions",status="499"')


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_queued_request_whose_client_disconnects_leaves_the_queue(serve, stream):
    s = serve(slots=1)
    running = raw_post(s.url, chat())
    assert wait_until(lambda: s.engine.holding == 1)
    queued = raw_post(s.url, chat(stream=stream))
    assert wait_until(lambda: s.engine.queued == 1)
    queued.close()
    assert wait_until(lambda: s.engine.queued == 0), "a request whose client left still waits for the engine"
    assert s.inflight.waiting == 0 and s.engine.holding == 1
    running.close()
    assert wait_until(lambda: s.engine.open_streams == 0)
    assert [r.finish_reason for r in s.interactions()] == ["abort"]  # the queued one sampled nothing


def test_shutdown_refuses_what_has_not_started_and_cuts_what_runs_at_the_end_of_its_grace(serve):
    grace_s = 8.0  # the app cuts 2 s before it: 6 s after the refusals, whatever the machine's speed
    s = serve(slots=2, grace_s=grace_s)
    client = s.openai()

    def stream_events() -> list:
        return list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))

    with ThreadPoolExecutor(4) as pool:
        running_stream: Future = pool.submit(stream_events)
        running_plain: Future = pool.submit(client.chat.completions.create, model=MODEL, messages=MESSAGES)
        assert wait_until(lambda: s.engine.holding == 2)
        queued_plain: Future = pool.submit(client.chat.completions.create, model=MODEL, messages=MESSAGES)
        queued_stream: Future = pool.submit(stream_events)
        assert wait_until(lambda: s.engine.queued == 2)
        stopping = threading.Thread(target=s.server.stop)
        stopping.start()
        for queued in (queued_plain, queued_stream):
            with pytest.raises(openai.InternalServerError) as refused:
                queued.result(timeout=30)
            assert refused.value.status_code == 503 and refused.value.body["code"] == "server_shutting_down"
            assert refused.value.response.headers["Retry-After"] == "1"
        assert not running_stream.done() and not running_plain.done()  # they may go on until the cut
        with pytest.raises(openai.APIError) as cut:  # an error event in the stream, not a dropped connection
            running_stream.result(timeout=60)
        assert cut.value.body["code"] == "server_shutting_down"
        with pytest.raises(openai.InternalServerError) as cut_plain:
            running_plain.result(timeout=60)
        assert cut_plain.value.status_code == 503 and cut_plain.value.body["code"] == "server_shutting_down"
        stopping.join(60)
    records = s.interactions()
    assert sorted((r.finish_reason, len(r.response_ids)) for r in records) == [("abort", HELD_AFTER)] * 2
    assert len(s.engine.requests) == 4 and s.engine.open_streams == 0
