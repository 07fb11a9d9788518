"""The app's ASGI middleware (body-size limit, request counts) and its error handlers.

Every error is answered with an OpenAI-style body ``{"error": {message, type,
param, code}}``: an :class:`~serving.errors.APIError` as it says, an unknown
route or method as FastAPI's status (404 ``not_found_error``, else
``invalid_request_error``), anything unexpected as 500 ``server_error``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.metrics import ServingMetrics
from serving.errors import APIError

log = logging.getLogger(__name__)


class HttpOnlyMiddleware:
    """ASGI middleware that acts on HTTP requests; lifespan and websocket messages pass through."""

    app: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        return await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


@dataclass
class BodyLimitMiddleware(HttpOnlyMiddleware):
    """413 for a body above ``max_bytes``: from Content-Length at once, else while it is read."""

    app: ASGIApp
    max_bytes: int

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        too_large = APIError(413, f"the request body exceeds {self.max_bytes} bytes (serving.max_request_bytes)",
                             code="request_too_large")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await error_response(too_large)(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise too_large
            return message

        return await self.app(scope, limited_receive, send)


def route_label(path: str, routes: frozenset[str]) -> str:
    """The ``route`` label of a request to ``path``: the path itself when ``routes`` names it; for a
    template ending in a parameter (``/v1/models/{model}``, a path parameter: model names hold slashes,
    ``Qwen/Qwen2.5-0.5B-Instruct``), the template for any path below its fixed part; else ``other``
    (never the raw path: every unknown path or model name would be a series of its own)."""
    if path in routes:
        return path
    for template in routes:
        fixed, brace, _ = template.partition("/{")
        if brace and template.endswith("}") and path.startswith(f"{fixed}/") and len(path) > len(fixed) + 1:
            return template
    return "other"


@dataclass
class RequestMetricsMiddleware(HttpOnlyMiddleware):
    """Counts answered requests by route (:func:`route_label`) and status."""

    app: ASGIApp
    metrics: ServingMetrics
    routes: frozenset[str]

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = route_label(scope["path"], self.routes)
        answered = False

        async def counting_send(message):
            nonlocal answered
            if message["type"] == "http.response.start":
                answered = True
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        try:
            return await self.app(scope, receive, counting_send)
        except Exception:
            # Starlette's ServerErrorMiddleware, always outside this one, sends the 500 of an exception
            # no handler took, past counting_send: counted here, or ServingErrors never sees it
            if not answered:
                self.metrics.requests.labels(route, "500").inc()
            raise


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), type=kind).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").body(),
                            status_code=500)
