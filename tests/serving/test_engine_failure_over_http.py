"""An engine that fails a request, over real HTTP and the official client: the answer is a clean 500
(an error event once a stream began), never an exception raised through the ASGI server."""

from __future__ import annotations

import logging

import openai
import pytest

from tests.serving.conftest import MESSAGES, MODEL


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def uvicorn_errors():
    """What uvicorn logs as errors (its loggers do not propagate to pytest's capture)."""
    handler, logger = Captured(), logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_before_the_first_token_is_a_500_the_client_reads(fake_http_server, uvicorn_errors,
                                                                            stream):
    client = fake_http_server.openai()
    fake_http_server.engine.fail_with = IndexError("list index out of range")
    with pytest.raises(openai.InternalServerError) as failed:  # a status, not a connection error
        client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream)
    error = failed.value.body
    assert error["type"] == "server_error" and error["code"] == "generation_failed"
    assert "IndexError: list index out of range" in error["message"]

    fake_http_server.engine.fail_with = None
    fake_http_server.script("Hello there, my friend.")
    fake_http_server.engine.fail_after = (1, RuntimeError("CUDA fell over mid-answer"))
    with pytest.raises(openai.APIError, match="CUDA fell over mid-answer"):  # the stream's error event
        list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
    fake_http_server.engine.fail_after = None
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].finish_reason == "stop"
    assert not [m for m in uvicorn_errors if "Exception in ASGI application" in m]
