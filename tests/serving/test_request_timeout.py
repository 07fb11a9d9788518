"""Request deadlines (``serving.request_timeout_s``) over real HTTP (uvicorn, a FakeEngine with batch slots,
the official openai client): a request queued or sampling past its deadline is cut in the engine, answered
504 ``request_timeout`` (a stream that began: an error event), logged as ``abort`` when it sampled anything,
and counted; a request answered in time is not touched."""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai
import pytest

from online_sao.schemas import SamplingParams
from serving.answers import CHAT_FORMAT
from serving.errors import request_timed_out
from serving.streaming import DONE, AnswerStream
from serving.trajectories import TrajectoryPrefix
from serving.turn import Turn
from tests.serving.conftest import ANSWER, HELD_AFTER, MESSAGES, MODEL, Served, metric, wait_until

ROUTE = "/v1/chat/completions"
CLIENT_TIMEOUT_S = 30.0
"""The client's own timeout: far beyond every deadline here, so that only the server's ends a request."""


def deadline(seconds: float) -> dict:
    return {"serving.request_timeout_s": seconds}


def timeouts(s: Served, stage: str) -> str:
    return metric(s.url, f'sao_serving_request_timeouts_total{{route="{ROUTE}",stage="{stage}"}}').split()[-1]


def client(s: Served) -> openai.OpenAI:
    return s.openai().with_options(timeout=CLIENT_TIMEOUT_S)


def assert_timed_out(error: openai.APIStatusError) -> None:
    assert error.status_code == 504
    assert error.body["code"] == "request_timeout" and error.body["type"] == "timeout_error"


def test_queued_requests_past_their_deadline_get_504_leave_the_queue_and_never_run(serve, caplog):
    s = serve(slots=0, **{"serving.max_batch_size": 1, **deadline(1.0)})  # a batch that never frees a slot
    caplog.set_level(logging.WARNING, logger="serving.openai_serving")
    c = client(s)
    with ThreadPoolExecutor(2) as pool:  # one holds the batch's slot in the server's count, one waits beyond it
        asked = [pool.submit(c.chat.completions.create, model=MODEL, messages=MESSAGES, stream=stream)
                 for stream in (False, True)]
        for future in asked:  # a stream too: it is refused by create(), before any event
            with pytest.raises(openai.InternalServerError) as cut:
                future.result()
            assert_timed_out(cut.value)
            assert "without the engine starting its answer" in cut.value.body["message"]
    assert wait_until(lambda: s.engine.queued == 0 and s.engine.open_streams == 0), "a request still waits"
    assert (s.inflight.waiting, s.inflight.running) == (0, 0)
    assert s.interactions() == []  # nothing sampled, nothing logged
    assert timeouts(s, "queued") == "2.0" and timeouts(s, "running") == "0.0"
    assert 'status="504"} 2.0' in metric(s.url, f'sao_serving_requests_total{{route="{ROUTE}",status="504"')
    warned = [r.getMessage() for r in caplog.records if "serving.request_timeout_s" in r.getMessage()]
    assert len(warned) == 2 and all("with 0 tokens sampled" in line for line in warned)


def test_a_sampling_request_past_its_deadline_is_cut_504_and_logged_as_abort(serve):
    s = serve(slots=1, **deadline(1.0))
    with pytest.raises(openai.InternalServerError) as cut:
        client(s).chat.completions.create(model=MODEL, messages=MESSAGES)  # holds after HELD_AFTER tokens
    assert_timed_out(cut.value)
    assert "was cut" in cut.value.body["message"]
    assert wait_until(lambda: s.engine.open_streams == 0), "the engine still samples a request past its deadline"
    [record] = s.interactions()
    assert record.finish_reason == "abort" and len(record.response_ids) == HELD_AFTER
    assert timeouts(s, "running") == "1.0" and timeouts(s, "queued") == "0.0"
    assert (s.inflight.waiting, s.inflight.running) == (0, 0)


def test_a_stream_past_its_deadline_ends_with_an_error_event(serve):
    s = serve(slots=1, **deadline(2.0))
    stream = client(s).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
    text = ""
    with pytest.raises(openai.APIError) as cut:  # an error event after the chunks, not a dropped connection
        for chunk in stream:
            text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
    assert cut.value.body["code"] == "request_timeout"
    assert text and ANSWER.startswith(text)  # what was sampled before the deadline went out
    assert wait_until(lambda: s.engine.open_streams == 0)
    [record] = s.interactions()
    assert record.finish_reason == "abort" and len(record.response_ids) == HELD_AFTER
    assert timeouts(s, "running") == "1.0"


def test_a_stream_that_keeps_sampling_is_cut_at_its_deadline_counted_from_admission(serve):
    """Every line of the stream comes well within the deadline; their sum does not."""
    s = serve(slots=1, **deadline(1.5))
    s.engine.release.set()  # no hold: the answer progresses, one token every delay_s
    s.engine.script = s.engine.script[:-1] * 20 + s.engine.script[-1:]
    s.engine.delay_s = 0.1
    with pytest.raises(openai.APIError) as cut:
        for _ in client(s).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, max_tokens=256):
            pass
    assert cut.value.body["code"] == "request_timeout"
    assert wait_until(lambda: s.engine.open_streams == 0)
    [record] = s.interactions()
    assert record.finish_reason == "abort" and 0 < len(record.response_ids) < len(s.engine.script)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_request_answered_within_its_deadline_is_untouched(serve, stream):
    s = serve(slots=1, **deadline(30.0))
    s.engine.release.set()
    answer = client(s).chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream)
    text = (answer.choices[0].message.content if not stream
            else "".join(c.choices[0].delta.content or "" for c in answer if c.choices))
    assert text == ANSWER
    [record] = s.interactions()
    assert record.finish_reason == "stop"
    assert timeouts(s, "queued") == timeouts(s, "running") == "0.0"


def test_nothing_interrupts_a_stream_after_its_done_line():
    """A deadline (or the shutdown's cut) that passes while ``[DONE]`` is sent follows a complete answer: the
    stream ends there, without an error event behind it."""
    turn = Turn("sao-test", "chat", TrajectoryPrefix([1, 2]), SamplingParams(), user=None, session_id=None)
    sent: list[str] = []

    async def pieces():
        for token, text in ((5, "Hel"), (6, "lo")):
            turn.token_ids.append(token)
            turn.versions.append(0)
            turn.text += text
            yield text
        turn.finish_reason = "stop"

    @contextmanager
    def interruptible():
        if sent and sent[-1] == DONE:
            raise request_timed_out(1.0, started=True)
        yield

    async def acknowledged() -> None:
        return None

    async def run() -> None:
        stream = AnswerStream(turn, CHAT_FORMAT, MODEL, False, None, lambda start: None, acknowledged, interruptible)
        async for line in stream.events(pieces()):
            sent.append(line)

    asyncio.run(run())
    assert sent[-1] == DONE and not any('"error"' in line for line in sent)
    assert "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in sent[:-1]) == "Hello"
