"""OpenAI-style errors: the exception the serving layer raises, the body it answers with
(``{"error": {message, type, param, code}}``), and the errors several modules raise alike."""

from __future__ import annotations

from pydantic import BaseModel


class APIError(Exception):
    """An error answered with an OpenAI-style body ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code if code is not None or status != 400 else "invalid_value"
        """A 400 without a more particular code is an invalid value (docs/SERVING.md, "Errors")."""
        self.headers = headers or {}

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


LOGGING_RETRY_AFTER_S = 5
"""Seconds a client is told to wait (Retry-After) when its record cannot be logged now."""


def logging_unavailable(message: str) -> APIError:
    """503 ``logging_unavailable``: the interaction log cannot take or secure a record now."""
    return APIError(503, message, type="service_unavailable", code="logging_unavailable",
                    headers={"Retry-After": str(LOGGING_RETRY_AFTER_S)})


OVERLOAD_RETRY_AFTER_S = 1
"""Seconds a client refused for overload is told to wait (Retry-After): a refusal costs the server next to
nothing and a batch slot frees whenever any answer ends, so the wait is short; the openai client waits
this long before each of its own retries (it honours Retry-After up to 60 s)."""
SHUTDOWN_RETRY_AFTER_S = 1
"""Seconds a client refused or cut by a shutdown is told to wait: its retry goes through the load
balancer, which has already taken this replica out, to one that answers at once."""
CLIENT_CLOSED_REQUEST = 499
"""The status counted for a request whose client left before its answer (nginx's convention; no client
reads it, it tells the request metrics apart from answered requests)."""


def server_overloaded(waiting: int) -> APIError:
    """503 ``server_overloaded``: ``serving.max_waiting`` requests already wait for the engine."""
    return APIError(503, f"the server is overloaded: {waiting} requests already wait for the engine "
                         "(serving.max_waiting); retry later or elsewhere", type="service_unavailable",
                    code="server_overloaded", headers={"Retry-After": str(OVERLOAD_RETRY_AFTER_S)})


def shutting_down(started: bool) -> APIError:
    """503 ``server_shutting_down``: refused (not ``started``) or cut at the end of the shutdown's grace."""
    message = ("the server is shutting down and cut this answer at the end of its grace period; retry" if started
               else "the server is shutting down and did not start this request; retry")
    return APIError(503, message, type="service_unavailable", code="server_shutting_down",
                    headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)})


REQUEST_TIMEOUT = "request_timeout"
"""The ``code`` of the 504 a request gets when ``serving.request_timeout_s`` passes before its answer."""


def request_timed_out(timeout_s: float, started: bool) -> APIError:
    """504 ``request_timeout``: the request was not answered within ``timeout_s`` of its admission, queued
    for the engine (not ``started``: nothing sampled) or while its answer was sampled or logged."""
    message = (f"the answer was not finished within {timeout_s:g} s (serving.request_timeout_s) and was cut"
               if started else f"the request waited {timeout_s:g} s (serving.request_timeout_s) without the "
                               "engine starting its answer; retry later or elsewhere")
    return APIError(504, message, type="timeout_error", code=REQUEST_TIMEOUT)


def generation_failed(exc: Exception) -> APIError:
    """500 ``generation_failed``: the engine failed while answering (the server goes on serving)."""
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error",
                    code="generation_failed")


def client_disconnected() -> APIError:
    """What a request whose client closed the connection ends with (never read: the client is gone)."""
    return APIError(CLIENT_CLOSED_REQUEST, "the client closed the connection before the answer",
                    code="client_disconnected")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
