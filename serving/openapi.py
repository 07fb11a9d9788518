"""The OpenAPI document of the serving app (``GET /openapi.json``).

The routes read and validate their bodies themselves (so every error keeps the
OpenAI shape and the body-size limit applies while the body is read), which
hides the request models from FastAPI. This module puts them back: each
operation's request body, its 200 response (JSON, and server-sent events for
the completion routes, with the ``X-Interaction-Id`` header), and every error
status it can answer with the OpenAI-style error body. When API keys are
configured the ``/v1`` operations declare bearer authentication. The document
is what clients and the schema fuzz tests (tests/serving/test_fuzz_api.py) read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from online_sao.schemas import MIN_TEMPERATURE
from serving.answers import ChatCompletionResponse, CompletionResponse
from serving.errors import ErrorResponse
from serving.protocol import ChatCompletionRequest, CompletionRequest
from serving.service_models import FeedbackRequest, FeedbackResponse, ModelCard, ModelList, TurnRewardIn

REF_TEMPLATE = "#/components/schemas/{model}"
SECURITY_SCHEME = "apiKey"
INTERACTION_HEADER = "X-Interaction-Id"

_REASONS = {
    400: "Malformed JSON, an invalid request, or a prompt over the context",
    401: "Missing or wrong API key",
    403: "An interaction id this deployment did not issue",
    404: "Unknown model, or a parent interaction no longer held",
    410: "An interaction id older than the reward window",
    413: "Request body too large",
    422: "An invalid or out-of-range reward",
    429: "Rate limit exceeded (see Retry-After)",
    503: "The server cannot log interactions now (see Retry-After)",
}
"""Error statuses and what they mean; each is answered with the OpenAI-style error body."""

_SAMPLING_ERRORS = (400, 401, 403, 404, 410, 413, 429, 503)
_READY = {"type": "object", "required": ["status", "policy_version", "spooling"],
          "properties": {"status": {"const": "ready"}, "policy_version": {"type": "integer"},
                         "spooling": {"type": "boolean"}}}
_NOT_READY = {"type": "object", "required": ["status", "reason"],
              "properties": {"status": {"const": "unavailable"}, "reason": {"type": "string"}}}
_EVENT = {"type": "object", "required": ["data"],
          "properties": {"data": {"type": "string", "description": "a chunk (JSON), an error body (JSON) or [DONE]"}}}
"""One server-sent event of a streamed completion."""
_HEALTH = {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}}


@dataclass(frozen=True)
class Operation:
    request: type[BaseModel] | None
    """Model of the JSON request body (None: no body)."""
    response: type[BaseModel] | None
    """Model of the 200 JSON body."""
    errors: tuple[int, ...]
    """Error statuses the operation answers with the OpenAI-style error body."""
    streams: bool = False
    """The 200 answer may be server-sent events (``stream: true``), with X-Interaction-Id."""


OPERATIONS: dict[tuple[str, str], Operation] = {
    ("/v1/chat/completions", "post"): Operation(ChatCompletionRequest, ChatCompletionResponse, _SAMPLING_ERRORS,
                                                streams=True),
    ("/v1/completions", "post"): Operation(CompletionRequest, CompletionResponse, _SAMPLING_ERRORS, streams=True),
    ("/v1/feedback", "post"): Operation(FeedbackRequest, FeedbackResponse, (400, 401, 403, 410, 413, 422, 429, 503)),
    ("/v1/models", "get"): Operation(None, ModelList, (401, 413, 429)),
    ("/v1/models/{model_id}", "get"): Operation(None, ModelCard, (401, 404, 413, 429)),
}
"""The documented shape of each JSON operation, by (path, method)."""


def _components() -> tuple[dict[tuple[type[BaseModel], str], dict], dict[str, Any]]:
    models: list[tuple[type[BaseModel], str]] = [(ErrorResponse, "serialization")]
    for op in OPERATIONS.values():
        if op.request is not None:
            models.append((op.request, "validation"))
        if op.response is not None:
            models.append((op.response, "serialization"))
    refs, schema = models_json_schema(models, ref_template=REF_TEMPLATE)
    return refs, schema.get("$defs", {})


@dataclass(frozen=True)
class ApiLimits:
    """What the server accepts beyond the wire models' own bounds (from the configuration)."""

    model_name: str
    max_new_tokens: int
    min_reward: float
    max_reward: float


def _tighten(defs: dict[str, Any], limits: ApiLimits) -> None:
    for op in OPERATIONS.values():
        properties = defs[op.request.__name__].get("properties", {}) if op.request is not None else {}
        if "model" in properties:
            properties["model"] = {"type": "string", "enum": [limits.model_name]}
            properties["n"] = {"anyOf": [{"type": "null"}, {"type": "integer", "enum": [1]}], "default": None}
            for branch in properties["temperature"].get("anyOf", []):
                if branch.get("type") == "number":  # 0 and tiny temperatures are refused
                    branch["minimum"] = MIN_TEMPERATURE
            for name in ("max_tokens", "max_completion_tokens"):
                if name in properties:
                    properties[name] = {"anyOf": [{"type": "null"}, {
                        "type": "integer", "minimum": 1, "maximum": limits.max_new_tokens}]}
    reward = {"type": "number", "minimum": limits.min_reward, "maximum": limits.max_reward}
    defs[FeedbackRequest.__name__]["properties"]["reward"] = reward
    defs[TurnRewardIn.__name__]["properties"]["value"] = reward


def describe(document: dict[str, Any], limits: ApiLimits, auth_required: bool) -> dict[str, Any]:
    """FastAPI's ``document`` with the bodies, responses and security of every operation filled in."""
    refs, defs = _components()
    _tighten(defs, limits)
    error = {"description": "", "content": {"application/json": {"schema": refs[(ErrorResponse, "serialization")]}}}
    components = document.setdefault("components", {})
    components.setdefault("schemas", {}).update(defs)
    if auth_required:
        components["securitySchemes"] = {SECURITY_SCHEME: {"type": "http", "scheme": "bearer"}}
    paths = document.get("paths", {})
    for (path, method), op in OPERATIONS.items():
        entry = paths.get(path, {}).get(method)
        if entry is None:
            continue
        if op.request is not None:
            entry["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": refs[(op.request, "validation")]}}}
        ok: dict[str, Any] = {"description": "Success", "content": {
            "application/json": {"schema": refs[(op.response, "serialization")]}}}
        if op.streams:
            ok["content"]["text/event-stream"] = {"schema": _EVENT}
            ok["headers"] = {INTERACTION_HEADER: {"required": True, "schema": {"type": "string"},
                                                  "description": "Signed id to send feedback for"}}
        entry["responses"] = {"200": ok, **{str(s): {**error, "description": _REASONS[s]} for s in op.errors}}
        if auth_required:
            entry["security"] = [{SECURITY_SCHEME: []}]
    _plain(paths, "/healthz", {"200": {"description": "Alive", "content": {"application/json": {"schema": _HEALTH}}}})
    _plain(paths, "/readyz", {
        "200": {"description": "Ready", "content": {"application/json": {"schema": _READY}}},
        "503": {"description": "Not ready", "content": {"application/json": {"schema": _NOT_READY}}}})
    _plain(paths, "/metrics", {"200": {"description": "Prometheus metrics",
                                       "content": {"text/plain": {"schema": {"type": "string"}}}}})
    return document


def _plain(paths: dict[str, Any], path: str, responses: dict[str, Any]) -> None:
    entry = paths.get(path, {}).get("get")
    if entry is not None:
        entry["responses"] = responses


def install(app: FastAPI, limits: ApiLimits, auth_required: bool) -> None:
    """Serve the described document as the app's OpenAPI schema (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = describe(document, limits, auth_required)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
