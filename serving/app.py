"""The HTTP application: routes, request-size limit, auth, errors and lifecycle.

Every error is answered with an OpenAI-style body ``{"error": {message, type,
param, code}}``: malformed JSON 400, invalid fields 400 (422 for feedback), an
oversize body or prompt 413, an unknown model or route 404, a missing or wrong
API key 401, a rate limit 429 (with Retry-After), no way to log 503 (with the
reason). Completion responses carry ``X-Interaction-Id``; a response (or
feedback 200) is sent only once its record is durable (see
:mod:`serving.interaction_log`). The app's lifespan
starts and stops the engine, the interaction logger (a clean shutdown flushes
it) and the weights follower.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from online_sao.config import Config
from online_sao.schemas import has_lone_surrogate
from serving.auth import ApiKeyAuth, AuthError
from serving.engine.base import InferenceEngine
from serving.feedback import FeedbackService
from serving.ids import InteractionIdSigner
from serving.interaction_log import InteractionLogger
from serving.metrics import ServingMetrics
from serving.openai_serving import OpenAIServing, Streamed
from serving.openapi import ApiLimits, install as install_openapi
from serving.protocol import (APIError, ChatCompletionRequest, CompletionRequest, FeedbackRequest, ModelCard,
                              ModelList)
from serving.redaction import load_redactor
from serving.trajectories import TrajectoryCache

log = logging.getLogger(__name__)

INTERACTION_HEADER = "X-Interaction-Id"
_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/feedback", "/v1/models", "/healthz", "/readyz",
           "/metrics"}


class Follower(Protocol):
    """What the app needs of the weights follower: to start and stop it with the server."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


class BodyLimitMiddleware:
    """413 for a body above ``max_bytes``: from Content-Length at once, else while it is read."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body exceeds {self.max_bytes} bytes (serving.max_request_bytes)",
                             code="request_too_large")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_error(too_large, scope, receive, send)
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


async def _send_error(error: APIError, scope, receive, send) -> None:
    response = JSONResponse(error.body(), status_code=error.status, headers=error.headers)
    await response(scope, receive, send)


class RequestMetricsMiddleware:
    """Counts answered requests by route and status."""

    def __init__(self, app, metrics: ServingMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in _ROUTES else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        return await self.app(scope, receive, counting_send)


async def _parse(request: Request, model: type[BaseModel], invalid_status: int) -> BaseModel:
    body = await request.body()
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if b"\\u" in body and has_lone_surrogate(data):  # a "\\ud800" escape is not text: tokenizer and log fail on it
        raise APIError(400, "the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is "
                            "not text", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                             for e in exc.errors()[:5])
        raise APIError(invalid_status, f"invalid request: {problems}", param=where, code="invalid_value") from None


def build_app(engine: InferenceEngine, logger: InteractionLogger, cfg: Config, tokenizer, metrics: ServingMetrics,
              follower: Follower | None = None, *, stop_token_ids: frozenset[int] | None = None,
              max_model_len: int | None = None) -> FastAPI:
    s = cfg.serving
    signer = InteractionIdSigner(s.feedback_secret.get_secret_value().encode("utf-8"), s.deployment_id,
                                 cfg.reward.window_s)
    auth = ApiKeyAuth([k.get_secret_value() for k in s.api_keys], s.rate_limit_per_minute, s.rate_limit_burst)
    trajectories = TrajectoryCache(s.max_trajectories)
    redactor = load_redactor(s.redact_hook) if s.redact_hook and not s.redact_text else None
    serving = OpenAIServing(engine, logger, tokenizer, s, signer, trajectories, metrics,
                            stop_token_ids=stop_token_ids, max_model_len=max_model_len, redactor=redactor)
    feedback = FeedbackService(signer, logger, cfg.reward, trajectories, ack_timeout_s=s.log_ack_timeout_s)
    metrics.watch(queue_depth=lambda: logger.queue_depth, spool_bytes=lambda: logger.spool_bytes,
                  spool_records=lambda: logger.spool_records, policy_version=lambda: engine.policy_version)
    started_at = int(time.time())
    lifecycle = {"ready": False}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        logger.start()
        if follower is not None:
            follower.start()
        lifecycle["ready"] = True
        try:
            yield
        finally:
            lifecycle["ready"] = False
            if follower is not None:
                await asyncio.to_thread(follower.stop)
            await engine.stop()
            report = await asyncio.to_thread(logger.close, s.shutdown_flush_s)
            log.info("interaction log closed: %s", report)

    app = FastAPI(title="online-sao serving", lifespan=lifespan)
    install_openapi(app, ApiLimits(s.model_name, s.max_new_tokens, cfg.reward.min_value, cfg.reward.max_value),
                    auth_required=auth.required)
    app.add_middleware(BodyLimitMiddleware, max_bytes=s.max_request_bytes)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    app.state.serving = serving
    app.state.logger = logger

    def authorize(request: Request) -> None:
        try:
            auth.check(request.headers.get("authorization"), request.client.host if request.client else None)
        except AuthError as exc:
            headers = {"Retry-After": f"{max(1, round(exc.retry_after_s))}"} if exc.retry_after_s else {}
            kind = "rate_limit_error" if exc.status == 429 else "authentication_error"
            raise APIError(exc.status, exc.message, type=kind, code=exc.code, headers=headers) from None

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

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

    async def answer(result) -> Response:
        if isinstance(result, Streamed):
            return StreamingResponse(result.events, media_type="text/event-stream",
                                     headers={INTERACTION_HEADER: result.interaction_id, "Cache-Control": "no-cache"})
        return JSONResponse(result.model_dump(), headers={INTERACTION_HEADER: result.interaction_id})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        return await answer(await serving.chat(await _parse(request, ChatCompletionRequest, 400)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        return await answer(await serving.completion(await _parse(request, CompletionRequest, 400)))

    @app.post("/v1/feedback")
    async def post_feedback(request: Request) -> JSONResponse:
        authorize(request)
        result = await feedback.submit(await _parse(request, FeedbackRequest, 422))
        return JSONResponse(result.model_dump())

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        card = ModelCard(id=s.model_name, created=started_at, policy_version=engine.policy_version)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        reason = "the engine is not started" if not lifecycle["ready"] else logger.refusal()
        if reason is not None:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ready", "policy_version": engine.policy_version,
                             "spooling": logger.spooling})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=ServingMetrics.CONTENT_TYPE)

    return app
