"""The HTTP application: services, routes, request-size limit, auth, errors and lifecycle.

Every error is answered with an OpenAI-style body ``{"error": {message, type,
param, code}}``: malformed JSON 400, invalid fields and a prompt over the context 400 (422 for
feedback), an oversize body 413, an unknown model or route 404, a missing or wrong
API key 401, a rate limit 429 (with Retry-After), no way to log 503 (with the
reason), an overloaded or shutting-down server 503 (with Retry-After), a request not
answered within ``serving.request_timeout_s`` 504.
Completion responses carry ``X-Interaction-Id``; a response (or
feedback 200) is sent only once its record is durable (see
:mod:`serving.interaction_log`). The app's lifespan
starts and stops the engine, the interaction logger (a clean shutdown flushes
it) and the weights follower, and keeps ``/readyz`` at 503 ``catching_up_weights`` until the
follower has caught up with the weights topic or ``serving.weights_catch_up_s`` passed; the server
tells ``app.state.inflight`` when it begins to shut down (:class:`serving.server.DrainingServer`).

Where things are: the routes in :mod:`serving.routes` (one router per concern),
middleware and error handlers in :mod:`serving.middleware`, what a request does
in :mod:`serving.openai_serving` and :mod:`serving.feedback`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Protocol

from fastapi import FastAPI

from online_sao.config import Config
from serving.auth import ApiKeyAuth, source_callers
from serving.engine.base import InferenceEngine
from serving.engine.canary import CanaryEngine
from serving.feedback import FeedbackService
from serving.ids import InteractionIdSigner
from serving.interaction_log import InteractionLogger
from serving.metrics import ServingMetrics
from serving.monitoring import ServingMonitors
from serving.middleware import BodyLimitMiddleware, RequestMetricsMiddleware, install_error_handlers
from serving.openai_serving import OpenAIServing
from serving.openapi import ApiLimits, install as install_openapi
from serving.redaction import load_redactor
from serving.routes import ServerStatus, authorizer, completion_routes, feedback_routes, status_routes
from serving.trajectories import TrajectoryCache
from serving.turn import InFlight

log = logging.getLogger(__name__)

_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/feedback", "/v1/models", "/v1/models/{model}",
                     "/healthz", "/readyz", "/metrics"})
"""Routes counted by name in the request metrics (serving.middleware.route_label: any other path is ``other``)."""


CATCH_UP_CHECK_S = 0.05
"""How often the app looks whether the weights follower caught up: readiness lags it by this much."""


class Follower(Protocol):
    """What the app needs of the weights follower: to start and stop it with the server, and whether
    it has caught up with the weights topic (:class:`serving.weights_follower.WeightsFollower`)."""

    catch_up_state: str
    """What it waits for while not caught up (the readiness probe's reason)."""
    other_models_note: str | None
    """The other models whose notices it ignored (None: none), which a ready ``/readyz`` shows."""

    @property
    def caught_up(self) -> bool: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


async def _caught_up_within(follower: Follower, limit_s: float | None) -> bool:
    """Wait until ``follower`` caught up (True) or ``limit_s`` passed (False; None: no limit)."""
    deadline = None if limit_s is None else time.monotonic() + limit_s
    while not follower.caught_up:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        await asyncio.sleep(CATCH_UP_CHECK_S)
    return True


async def _ready_once_caught_up(follower: Follower, status: ServerStatus, engine: InferenceEngine,
                                limit_s: float | None) -> None:
    """Readiness waits for the weights follower's first pass, ``limit_s`` at most: a replica that
    answered at once did so with the weights of ``model.path`` (version 0) while the topic named a
    newer version, to users behind the load balancer and to the learner (a lag of every version)."""
    started = time.monotonic()
    if await _caught_up_within(follower, limit_s):
        log.info("ready after %.1f s: the weights follower caught up, serving v%d", time.monotonic() - started,
                 engine.policy_version)
    else:
        log.warning("ready on v%d without the newest published weights: the weights follower did not catch up "
                    "with the weights topic within serving.weights_catch_up_s (%.0f s): %s. It goes on "
                    "following and swaps the newest version in when it loads it", engine.policy_version,
                    limit_s, follower.catch_up_state)
    status.awaiting_weights = None


def _lifespan(engine: InferenceEngine, logger: InteractionLogger, follower: Follower | None, status: ServerStatus,
              shutdown_flush_s: float, inflight: InFlight, weights_catch_up_s: float | None):
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        logger.start()
        catching_up: asyncio.Task | None = None
        if follower is not None:
            follower.start()
            # only while none of its own model's versions is served: a topic may carry several models'
            # notices, and a replica that follows its own has nothing to be told
            status.weights_note = lambda: follower.other_models_note if engine.policy_version == 0 else None
            if weights_catch_up_s != 0:
                status.awaiting_weights = lambda: follower.catch_up_state  # before ready: never ready before it
                catching_up = asyncio.create_task(_ready_once_caught_up(follower, status, engine,
                                                                        weights_catch_up_s))
        status.ready = True
        try:
            yield
        finally:
            status.ready = False
            if catching_up is not None:
                catching_up.cancel()
            # a server that did not announce its shutdown (serving.server.DrainingServer does) admits nothing
            # from here on; requests still running are left to the engine's stop
            inflight.begin_shutdown(None)
            if follower is not None:
                await asyncio.to_thread(follower.stop)
            await engine.stop()
            report = await asyncio.to_thread(logger.close, shutdown_flush_s)
            log.info("interaction log closed: %s", report)

    return lifespan


def build_app(engine: InferenceEngine, logger: InteractionLogger, cfg: Config, tokenizer, metrics: ServingMetrics,
              follower: Follower | None = None, *, stop_token_ids: frozenset[int] | None = None,
              max_model_len: int | None = None) -> FastAPI:
    s = cfg.serving
    signer = InteractionIdSigner(s.feedback_secret.get_secret_value().encode("utf-8"), s.deployment_id,
                                 cfg.reward.window_s)
    auth = ApiKeyAuth([k.get_secret_value() for k in s.api_keys], s.rate_limit_per_minute, s.rate_limit_burst)
    trajectories = TrajectoryCache(s.max_trajectories)
    redactor = load_redactor(s.redact_hook) if s.redact_hook and not s.redact_text else None
    monitors = ServingMonitors(cfg.deploy.segments_top_n, s.monitor_window, cfg.deploy.monitor_ngram)
    inflight = InFlight(s.waiting_bound, s.max_batch_size)
    serving = OpenAIServing(engine, logger, tokenizer, s, signer, trajectories, metrics,
                            stop_token_ids=stop_token_ids, max_model_len=max_model_len, redactor=redactor,
                            monitors=monitors, inflight=inflight)
    feedback = FeedbackService(signer, logger, cfg.reward, trajectories, ack_timeout_s=s.log_ack_timeout_s,
                               allowed_sources=s.feedback_sources, source_callers=source_callers(s.source_keys))
    metrics.watch(queue_depth=lambda: logger.queue_depth, spool_bytes=lambda: logger.spool_bytes,
                  spool_records=lambda: logger.spool_records, policy_version=lambda: engine.policy_version)
    metrics.watch_monitors(monitors)
    metrics.watch_engine(waiting=lambda: inflight.waiting, running=lambda: inflight.running)
    if isinstance(engine, CanaryEngine):
        metrics.watch_canary(lambda: -1 if engine.champion_version is None else engine.champion_version,
                             lambda: engine.routed["champion"])
    status = ServerStatus(s.model_name)

    # no /docs, /redoc (nor /docs/oauth2-redirect): they answered without a key, and Swagger UI loads its
    # scripts from a CDN; /openapi.json stays, read by clients and the fuzz tests (serving/openapi.py)
    app = FastAPI(title="online-sao serving", docs_url=None, redoc_url=None,
                  lifespan=_lifespan(engine, logger, follower, status, s.shutdown_flush_s, inflight,
                                     s.weights_catch_up_s))
    install_openapi(app, ApiLimits(s.model_name, s.max_new_tokens, cfg.reward.min_value, cfg.reward.max_value),
                    auth_required=auth.required)
    app.add_middleware(BodyLimitMiddleware, max_bytes=s.max_request_bytes)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics, routes=_ROUTES)
    app.state.serving = serving
    app.state.inflight = inflight  # its begin_shutdown is what serving.server.DrainingServer calls
    app.state.logger = logger
    install_error_handlers(app)
    authorize = authorizer(auth)
    app.include_router(completion_routes(serving, authorize))
    app.include_router(feedback_routes(feedback, authorize))
    app.include_router(status_routes(status, engine, logger, metrics, authorize, inflight))
    return app
