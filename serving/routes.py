"""The app's routes, one router per concern, each over the services it is given.

The routes read and validate their bodies themselves (:func:`parse_body`), so
every error keeps the OpenAI shape and the body-size limit applies while the
body is read; :mod:`serving.openapi` documents the models FastAPI cannot see.
Completion responses carry ``X-Interaction-Id``. ``/readyz`` answers 503 while the
engine is not started, the weights follower catches up with the weights topic (``catching_up_weights``),
the interaction log refuses work or the server shuts down; not while the engine is saturated (see
:func:`status_routes`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from online_sao.json_depth import MAX_JSON_DEPTH, too_deep
from online_sao.schemas import has_lone_surrogate
from serving.auth import ApiKeyAuth, AuthError
from serving.engine.base import InferenceEngine
from serving.feedback import FeedbackService
from serving.interaction_log import InteractionLogger
from serving.metrics import ServingMetrics
from serving.openai_serving import OpenAIServing
from serving.answers import ChatCompletionResponse, CompletionResponse
from serving.errors import APIError
from serving.protocol import ChatCompletionRequest, CompletionRequest
from serving.service_models import FeedbackRequest, ModelCard, ModelList
from serving.streaming import Streamed
from serving.turn import Disconnected, InFlight

INTERACTION_HEADER = "X-Interaction-Id"
CATCHING_UP_WEIGHTS = "catching_up_weights"
"""How ``/readyz``'s reason begins while readiness waits for the weights follower to catch up."""

Authorize = Callable[[Request], str]
"""Raises the 401/429 :class:`APIError` for a request its API key (or rate limit) does not admit;
returns the caller's name (``ApiKeyAuth.check``) for one it admits."""


@dataclass
class ServerStatus:
    model_name: str
    started_at: int = field(default_factory=lambda: int(time.time()))
    ready: bool = False
    """The engine runs: set and cleared by the app's lifespan."""
    awaiting_weights: Callable[[], str] | None = None
    """Set while readiness waits for the weights follower to catch up (see :mod:`serving.app`): what
    it waits for. None: readiness does not wait for it (caught up, timed out, or no follower)."""
    weights_note: Callable[[], str | None] | None = None
    """What the weights follower has to say about the notices it ignored (None: no follower), which a
    ready ``/readyz`` shows as ``weights_note``: a replica whose ``serving.model_name`` is not the
    learner's stays ready on v0, and only its start-up log said why."""


def authorizer(auth: ApiKeyAuth) -> Authorize:
    def authorize(request: Request) -> str:
        try:
            return auth.check(request.headers.get("authorization"), request.client.host if request.client else None)
        except AuthError as exc:
            headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else {}  # whole seconds already
            kind = "rate_limit_error" if exc.status == 429 else "authentication_error"
            raise APIError(exc.status, exc.message, type=kind, code=exc.code, headers=headers) from None

    return authorize


async def parse_body(request: Request, model: type[BaseModel], invalid_status: int) -> BaseModel:
    body = await request.body()
    try:
        # strict UTF-8 (a surrogate encoded in the bytes is not text); ValueError also covers an integer
        # longer than Python converts (4300 digits)
        text = body.decode("utf-8-sig")
        if too_deep(text):  # measured, not parsed: the parser recurses to the interpreter's limit first
            raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
        data = json.loads(text)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body nests deeper than the JSON parser allows", code="invalid_json") from None
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


def answer(result: ChatCompletionResponse | CompletionResponse | Streamed) -> Response:
    if isinstance(result, Streamed):
        return StreamingResponse(result.events, media_type="text/event-stream",
                                 headers={INTERACTION_HEADER: result.interaction_id, "Cache-Control": "no-cache"})
    return JSONResponse(result.model_dump(), headers={INTERACTION_HEADER: result.interaction_id})


def until_disconnected(request: Request) -> Disconnected:
    """What returns once ``request``'s client has closed the connection: with the body read, the
    server's ``receive()`` answers nothing else (it waits until then, or until the response is sent)."""

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


def completion_routes(serving: OpenAIServing, authorize: Authorize) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        body = await parse_body(request, ChatCompletionRequest, 400)
        return answer(await serving.chat(body, until_disconnected(request)))

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        body = await parse_body(request, CompletionRequest, 400)
        return answer(await serving.completion(body, until_disconnected(request)))

    return router


def feedback_routes(feedback: FeedbackService, authorize: Authorize) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/feedback")
    async def post_feedback(request: Request) -> JSONResponse:
        caller = authorize(request)
        result = await feedback.submit(await parse_body(request, FeedbackRequest, 422), caller)
        return JSONResponse(result.model_dump())

    return router


def status_routes(status: ServerStatus, engine: InferenceEngine, logger: InteractionLogger, metrics: ServingMetrics,
                  authorize: Authorize, inflight: InFlight) -> APIRouter:
    """The served model, liveness, readiness and Prometheus metrics.

    Readiness does not follow saturation: under a load spike every replica saturates together, and
    readiness probes that failed on it would take all of them out of the load balancer at once (no
    capacity left at all, and a probe period of delay each way). A saturated replica stays ready and
    refuses only what exceeds ``serving.max_waiting`` (503 ``server_overloaded`` with Retry-After: the
    client's retry may reach a replica with room); ``/readyz`` and ``/metrics`` show how much waits.
    Readiness fails for what affects every request of this replica alone: the engine not started,
    the log refusing work, the shutdown, and, after a start, the weights follower not yet caught up
    with the weights topic (``serving.weights_catch_up_s`` at most): until then the replica would answer
    with older weights than the topic names, those of ``model.path`` after a restart. ``/healthz``
    (liveness) answers 200 all along."""
    router = APIRouter()

    def card() -> ModelCard:
        return ModelCard(id=status.model_name, created=status.started_at, policy_version=engine.policy_version)

    @router.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse(ModelList(data=[card()]).model_dump())

    @router.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        """OpenAI's "retrieve model" (``client.models.retrieve``): the served model's card, else 404."""
        authorize(request)
        if model_id != status.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {status.model_name!r}",
                           param="model", code="model_not_found")
        return JSONResponse(card().model_dump())

    @router.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @router.get("/readyz")
    async def readyz() -> JSONResponse:
        awaiting_weights = status.awaiting_weights  # the lifespan clears it meanwhile
        if inflight.draining:
            reason = "the server is shutting down"
        elif not status.ready:
            reason = "the engine is not started"
        elif awaiting_weights is not None:
            reason = (f"{CATCHING_UP_WEIGHTS}: serving v{engine.policy_version} until the weights follower "
                      f"has read the weights topic and loaded the version in force there ({awaiting_weights()})")
        else:
            reason = logger.refusal()
        if reason is not None:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        note = None if status.weights_note is None else status.weights_note()
        weights = {} if note is None else {"weights_note": note}
        return JSONResponse({"status": "ready", "policy_version": engine.policy_version, **weights,
                             "spooling": logger.spooling, "waiting": inflight.waiting, "running": inflight.running})

    @router.get("/metrics")
    def prometheus() -> Response:
        # a plain def: FastAPI renders it in its threadpool. Rendering waits for the spool's lock
        # (held across a write's fsync and a compaction) and computes the answer monitors over the
        # window: on the event loop, a scrape stalled every request meanwhile
        return Response(metrics.render(), media_type=ServingMetrics.CONTENT_TYPE)

    return router
