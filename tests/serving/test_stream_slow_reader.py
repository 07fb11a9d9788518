"""A streaming client that reads its headers and then stops reading, keeping its connection open (uvicorn's
``send()`` then waits on the socket): the turn still runs to its end in its own task
(:class:`serving.streaming.TurnDriver`), so its record is logged and it leaves the in-flight counts without
the client reading on, its deadline (``serving.request_timeout_s``) is enforced, and the shutdown's cut
reaches it before the interaction logger closes. Until 2026-12-07 the answer advanced only as the client
read: none of these happened, and a stalled stream's record was lost at shutdown ("the interaction logger is
closed")."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from collections.abc import Iterator

import pytest

from serving.engine.base import GenerationRequest, TokenEvent
from tests.serving.conftest import Served, chat, metric, start_served, wait_until
from tests.serving.fakes import FakeEngine

TOKENS = 20_000
"""The answer's tokens: its events are megabytes, far more than the socket buffers between a server and a
client that reads nothing hold (the old code stalled after about 6000)."""
HOLD_AT = 12_000
"""Where an answer that must outlast a deadline or the shutdown's grace holds: past the buffers too."""
ROUTE = "/v1/chat/completions"


class YieldingEngine(FakeEngine):
    """The FakeEngine's answer, giving the event loop a turn before each token (as a real engine's queue
    does) and holding at ``hold_after`` until released or cancelled."""

    async def generate(self, request: GenerationRequest):
        self.requests.append(request)
        self.open_streams += 1
        try:
            for i, token in enumerate(self.script):
                if i == self.hold_after:
                    await self._hold()
                await asyncio.sleep(0)
                last = i + 1 == request.sampling.max_tokens or i + 1 == len(self.script)
                finish = "stop" if token in request.stop_token_ids else ("length" if last else None)
                yield TokenEvent(token, -0.1, self.version, finish)
                if finish is not None:
                    return
        finally:
            self.open_streams -= 1


@pytest.fixture
def serve_long(tmp_path, chat_tokenizer) -> Iterator:
    """The real app on uvicorn over a :class:`YieldingEngine` answering :data:`TOKENS` tokens."""
    started: list[Served] = []

    def make(hold_after: int | None = None, grace_s: float = 10.0, **overrides) -> Served:
        words = list(chat_tokenizer("Hello world, tea is nice. ", add_special_tokens=False)["input_ids"])
        engine = YieldingEngine((words * TOKENS)[:TOKENS - 1] + [chat_tokenizer.eos_token_id])
        engine.hold_after = hold_after
        started.append(start_served(tmp_path, chat_tokenizer, engine, grace_s, None,
                                    **{"serving.max_new_tokens": TOKENS, **overrides}))
        return started[-1]

    yield make
    for served in started:
        served.engine.release.set()
        served.server.stop()


def stalled_stream(s: Served) -> socket.socket:
    """A stream whose client reads the response's first bytes (the headers went out) and then nothing more,
    with a small receive buffer (set before it connects); the caller resets the connection."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", s.server.port))
    data = json.dumps(chat(stream=True, max_tokens=TOKENS)).encode()
    sock.sendall(f"POST {ROUTE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    assert sock.recv(200).startswith(b"HTTP/1.1 200")
    return sock


def reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def left_the_batch(s: Served) -> bool:
    return (s.inflight.sampling, s.inflight.unstarted, s.engine.open_streams) == (0, 0, 0)


def test_a_stream_whose_client_stops_reading_is_sampled_to_its_end_logged_and_leaves_the_batch(serve_long):
    s = serve_long()
    sock = stalled_stream(s)
    try:
        assert wait_until(lambda: len(s.interactions()) == 1 and left_the_batch(s), timeout_s=20), \
            "the answer waits for its client to read on"
        [record] = s.interactions()
        assert record.finish_reason == "stop" and len(record.response_ids) == TOKENS  # complete: trained
        assert (s.inflight.waiting, s.inflight.running) == (0, 0)
    finally:
        reset(sock)
    assert wait_until(lambda: left_the_batch(s))
    assert [r.finish_reason for r in s.interactions()] == ["stop"]  # the disconnect logs nothing more


def test_the_deadline_cuts_a_stream_whose_client_stops_reading(serve_long):
    s = serve_long(hold_after=HOLD_AT, **{"serving.request_timeout_s": 3.0})
    sock = stalled_stream(s)
    try:
        assert wait_until(lambda: len(s.interactions()) == 1 and left_the_batch(s), timeout_s=15), \
            "the deadline passed without reaching the stream"
        [record] = s.interactions()
        assert record.finish_reason == "abort" and len(record.response_ids) == HOLD_AT
        assert metric(s.url, f'sao_serving_request_timeouts_total{{route="{ROUTE}",stage="running"}}'
                      ).split()[-1] == "1.0"
    finally:
        reset(sock)
    assert wait_until(lambda: left_the_batch(s))
    assert len(s.interactions()) == 1


def test_the_shutdown_cut_logs_a_stream_whose_client_stops_reading_before_the_log_closes(serve_long, caplog):
    s = serve_long(hold_after=HOLD_AT, grace_s=4.0)  # cut at 2 s
    caplog.set_level(logging.ERROR)
    sock = stalled_stream(s)
    try:
        wait_until(lambda: s.engine.holding == 1, timeout_s=5)  # (never, where the stream advances as it is read)
        s.server.stop()  # uvicorn cancels the stalled response at the end of the grace, then the lifespan ends
    finally:
        reset(sock)
    [record] = s.interactions()
    assert record.finish_reason == "abort" and len(record.response_ids) == HOLD_AT
    assert left_the_batch(s)
    lost = [r for r in caplog.records if "logger is closed" in r.getMessage() + str(r.exc_info and r.exc_info[1])]
    assert lost == []
