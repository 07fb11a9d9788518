"""OpenAI requests to engine calls, responses (plain, or server-sent events: :mod:`serving.streaming`)
and logged interactions.

Prompts are token ids (:mod:`serving.prompts`): chat messages rendered with the tokenizer's
chat template, a completions prompt's text tokenised (or its ids as sent); a continuation
(``parent_interaction_id``) conditions on the parent's recorded tokens plus the new observation tokens.
Sampled tokens are decoded incrementally; stop tokens are actions but not text,
and ``stop`` strings end the text (and generation) where they first appear.

Admission is bounded (:class:`~serving.turn.InFlight`): with ``serving.max_waiting``
requests queued for a batch slot, or once the server shuts down, a new request
is refused with 503 before its prompt is tokenised. A client that disconnects, a
request the shutdown does not start, an answer the shutdown's grace cuts and a request
not answered by its deadline (``serving.request_timeout_s``: 504) close the engine's
stream, so the sequence leaves the queue or the batch at the engine's next step.

Every admitted request that sampled at least one token is logged as one
:class:`Interaction` through the :class:`InteractionLogger`, also when its client
disconnects, the shutdown cuts it or its deadline passes (``finish_reason="abort"``). The response is
acknowledged only once the record is durable (``serving.log_durability``): a
plain response is returned, and a stream sends its final chunk (the one with
``finish_reason``) and ``[DONE]``, after the logger's receipt says so; if that
does not happen within ``serving.log_ack_timeout_s`` the answer is a 503 (an
error event for a stream) instead. The record's texts are
the decoded token ids (special tokens included) unless ``redact_text``, passed
through ``redact_hook`` (:mod:`serving.redaction`) when one is configured.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

from pydantic import BaseModel

from online_sao.config import ServingConfig
from online_sao.schemas import ABORTED, Interaction, SamplingParams
from serving.detokenize import IncrementalDecoder, StopStrings, decode_after
from serving.engine.base import GenerationRequest, InferenceEngine, RequestRefused
from serving.ids import InteractionIdSigner
from serving.interaction_log import InteractionLogger
from serving.logprobs import TokenTexts
from serving.metrics import ServingMetrics
from serving.monitoring import ServingMonitors, request_segment
from serving.answers import (CHAT_FORMAT, COMPLETION_FORMAT, Answer, AnswerFormat, ChatCompletionResponse,
                             CompletionResponse, Reply)
from serving.errors import REQUEST_TIMEOUT, APIError, generation_failed, logging_unavailable
from serving.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest, message_key
from serving.prompts import PromptBuilder, canonical_tools
from serving.redaction import Redactor, RequestMetadata, Texts, apply_redactor
from serving.request_checks import check_chat, check_completion, check_sampling
from serving.streaming import AnswerStream, Streamed
from serving.tool_calls import TOOL_CALL_PARSERS, ToolCallParser
from serving.trajectories import Trajectory, TrajectoryCache, TrajectoryPrefix
from serving.turn import PROMPT_PARAMS, Disconnected, InFlight, Turn

log = logging.getLogger(__name__)

ENGINE_FIELD_PARAMS = {"top_logprobs": {"chat": "top_logprobs", "completions": "logprobs"}}
"""The request parameter of each route behind an engine's ``RequestRefused.field`` where their names
differ; the prompt's is ``Turn.prompt_param``, and the sampling fields (``temperature``, ``top_p``,
``seed``) have the parameter's name."""


def refused_param(turn: Turn, refusal: ValueError) -> str | None:
    """The request parameter an engine's refusal names: its ``RequestRefused.field`` on the turn's route
    (None: no one parameter); the prompt for a plain ValueError (an engine that names nothing refuses
    the prompt's ids)."""
    if not isinstance(refusal, RequestRefused) or refusal.field == "prompt_ids":
        return turn.prompt_param
    if refusal.field is None:
        return None
    return ENGINE_FIELD_PARAMS.get(refusal.field, {}).get(turn.route, refusal.field)


@dataclass
class OpenAIServing:
    engine: InferenceEngine
    logger: InteractionLogger
    tokenizer: object
    cfg: ServingConfig
    signer: InteractionIdSigner
    trajectories: TrajectoryCache
    metrics: ServingMetrics
    stop_token_ids: frozenset[int] | None = None
    """Token ids that end generation; the tokenizer's eos when not given."""
    max_model_len: int | None = None
    redactor: Redactor | None = None
    monitors: ServingMonitors | None = None
    """Books of segments and recent answers for ``/metrics`` (None: not kept)."""
    inflight: InFlight | None = None
    """Admission and interruptions (default: bounded by ``cfg.waiting_bound`` and ``cfg.max_batch_size``)."""

    def __post_init__(self) -> None:
        self.inflight = self.inflight or InFlight(self.cfg.waiting_bound, self.cfg.max_batch_size)
        self.stop_token_ids = self.stop_token_ids or frozenset({self.tokenizer.eos_token_id})
        self.prompts = PromptBuilder(self.tokenizer, self.signer, self.trajectories, self.stop_token_ids,
                                     self.cfg.model_name)
        self.token_texts = TokenTexts(self.tokenizer)
        parser = TOOL_CALL_PARSERS.get(self.cfg.tool_call_parser)
        self.tool_call_parser: ToolCallParser | None = None if parser is None else parser()

    # ------------------------------------------------------------------ admission

    def _admit(self, request: SamplingRequest, route: str, prefix: TrajectoryPrefix, **extra) -> Turn:
        prompt_len = len(prefix.engine_prompt)
        prompt_field = PROMPT_PARAMS[route]
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty", param=prompt_field)
        # 400, as OpenAI answers a prompt over the context: clients catch it as BadRequestError
        if prompt_len > self.cfg.max_prompt_tokens:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this server accepts at most "
                                f"{self.cfg.max_prompt_tokens} (serving.max_prompt_tokens)",
                           param=prompt_field, code="prompt_too_long")
        room = self.cfg.max_new_tokens
        if self.max_model_len is not None:
            if prompt_len >= self.max_model_len:
                raise APIError(400, f"the prompt has {prompt_len} tokens and the model's context is "
                                    f"{self.max_model_len}", param=prompt_field, code="context_length_exceeded")
            room = min(room, self.max_model_len - prompt_len)
        asked, field = request.requested_max_tokens(), request.max_tokens_field()  # None: the client sent none
        if asked is not None and asked > self.cfg.max_new_tokens:
            raise APIError(400, f"{field} is {asked}; this server allows at most {self.cfg.max_new_tokens}",
                           param=field, code="max_tokens_too_large")
        if asked is not None and asked > room:
            raise APIError(400, f"the prompt ({prompt_len} tokens) plus {field} ({asked}) exceeds the "
                                f"model's context of {self.max_model_len} tokens", param=field,
                           code="context_length_exceeded")
        reason = self.logger.refusal()
        if reason is not None:
            raise logging_unavailable(reason)
        sampling = SamplingParams(temperature=1.0 if request.temperature is None else request.temperature,
                                  top_p=1.0 if request.top_p is None else request.top_p,
                                  max_tokens=_max_tokens(asked, request.default_max_tokens(), room),
                                  seed=request.seed, stop=request.stop_list())
        return Turn(self.signer.mint(), route, prefix, sampling, request.user, request.session_id,
                    timeout_s=self.cfg.request_timeout_s, segment=request_segment(request, self.cfg.segment_field),
                    top_logprobs=request.requested_top_logprobs(), **extra)

    def check_request(self, request: SamplingRequest) -> None:
        """Checks that need no tokenizer: the model, then what the service does not do (:mod:`.request_checks`)."""
        if request.model != self.cfg.model_name:
            raise APIError(404, f"the model {request.model!r} does not exist; this server serves "
                                f"{self.cfg.model_name!r}", param="model", code="model_not_found")
        check_sampling(request)
        request_segment(request, self.cfg.segment_field)  # a key the record cannot hold is refused here
        if isinstance(request, ChatCompletionRequest):
            check_chat(request, self.cfg.tool_call_parser)
        elif isinstance(request, CompletionRequest):
            check_completion(request)

    # ------------------------------------------------------------------ generation

    async def _pieces(self, turn: Turn) -> AsyncIterator[str]:
        """Yield the response text as it becomes final; log the interaction when it ends."""
        origins = turn.prefix.turn_origins  # of a continuation's earlier turns; the first is the trajectory's
        request = GenerationRequest(turn.interaction_id, turn.prefix.engine_prompt, turn.sampling,
                                    self.stop_token_ids, top_logprobs=turn.top_logprobs or 0,
                                    trajectory_id=origins[0].interaction_id if origins else None,
                                    previous_version=turn.prefix.versions[-1] if turn.prefix.versions else None)
        decoder = IncrementalDecoder(self.tokenizer, self.stop_token_ids, turn.prefix.engine_prompt)
        stops = StopStrings(turn.sampling.stop)
        stream = self.engine.generate(request)
        self.inflight.entered()
        started = False
        try:
            async for event in stream:
                if not started:
                    self.metrics.first_token_latency.labels(turn.path).observe(time.perf_counter() - turn.started)
                    self.inflight.started()
                    started = True
                turn.token_ids.append(event.token_id)
                turn.logprobs.append(event.logprob)
                turn.versions.append(event.version)
                turn.alternatives.append(event.top_logprobs)
                piece = decoder.push(event.token_id)
                if event.finish_reason is not None:
                    piece += decoder.finish()
                text, stopped = stops.feed(piece)
                if event.finish_reason is not None and not stopped:
                    text += stops.flush()
                if text:
                    turn.text += text
                    yield text
                if stopped or event.finish_reason is not None:
                    turn.finish_reason = "stop" if stopped else event.finish_reason
                    break
        except (asyncio.CancelledError, GeneratorExit):
            turn.finish_reason = ABORTED  # the client went away: what was sampled is still a trajectory
            raise
        except APIError:
            raise
        except Exception as exc:
            if isinstance(exc, ValueError) and not turn.token_ids:
                # engines refuse input they cannot run (ids outside the vocabulary, a temperature vLLM
                # cannot sample) before sampling
                raise APIError(400, f"the engine refused the request: {exc}", param=refused_param(turn, exc)) from exc
            # answered as an APIError: the app's handler sends it (a stream's error event after its first line);
            # any other exception would also be raised through the ASGI server after its 500
            log.error("request %s failed after %d tokens: %s: %s", turn.interaction_id, len(turn.token_ids),
                      type(exc).__name__, exc)
            raise generation_failed(exc) from exc
        finally:
            self.inflight.ended(started)
            await stream.aclose()
            if turn.finish_reason is not None and turn.token_ids:
                self._log(turn)

    def _redacted(self, turn: Turn, texts: dict[str, str]) -> dict[str, str]:
        metadata = RequestMetadata(turn.interaction_id, turn.route, self.cfg.model_name, self.cfg.deployment_id,
                                   turn.user, turn.session_id)
        kept = apply_redactor(self.redactor, Texts(texts["prompt_text"], texts["response_text"]), metadata)
        return {} if kept is None else dict(prompt_text=kept.prompt, response_text=kept.response)

    def _log(self, turn: Turn) -> None:
        fields = turn.prefix.extended(turn.interaction_id, turn.sampling, turn.token_ids, turn.logprobs,
                                      turn.versions)
        texts = {}
        if not self.cfg.redact_text:
            prompt_ids, response_ids = fields["prompt_ids"], fields["response_ids"]
            texts = dict(prompt_text=self.tokenizer.decode(prompt_ids, skip_special_tokens=False),
                         response_text=decode_after(self.tokenizer, prompt_ids, response_ids))
            if self.redactor is not None:  # before the record exists: nothing unredacted is encoded or logged
                texts = self._redacted(turn, texts)
        record = Interaction(interaction_id=turn.interaction_id, created_at=turn.created_at,
                             model=self.cfg.model_name, deployment_id=self.cfg.deployment_id,
                             sampling=turn.sampling, finish_reason=turn.finish_reason, user_id=turn.user,
                             session_id=turn.session_id, segment=turn.segment, **fields, **texts)
        if turn.tools is not None:  # before the record is logged: a failure here must not leave it logged
            turn.parsed = self.tool_call_parser.parse(turn.text, turn.tools)
        turn.receipt = self.logger.submit(record)
        if self.monitors is not None:
            self.monitors.observe(turn.segment, turn.token_ids)
        if turn.template_messages is not None:
            calls = [(c.function.name, c.function.arguments) for c in turn.parsed.calls] if turn.parsed else []
            messages = turn.template_messages + [{"role": "assistant", "content": turn.text}]  # as sampled
            keys = turn.message_keys + [message_key("assistant", turn.content, calls)]  # as returned
            self.trajectories.put(turn.interaction_id, Trajectory(record, template_messages=tuple(messages),
                                                                  message_keys=tuple(keys),
                                                                  tools=canonical_tools(turn.rendered_tools)))
        else:
            visible = None if turn.prompt_text is None else turn.prompt_text + turn.text
            self.trajectories.put(turn.interaction_id, Trajectory(record, visible_text=visible))
        self.metrics.prompt_tokens.inc(len(turn.prefix.engine_prompt))
        self.metrics.completion_tokens.inc(len(turn.token_ids))
        self.metrics.request_latency.labels(turn.path).observe(time.perf_counter() - turn.started)

    async def _acknowledge(self, turn: Turn) -> None:
        """Return once the turn's interaction is durable; 503 when it cannot be made so in time."""
        timeout = self.cfg.log_ack_timeout_s
        if turn.receipt is None or await turn.receipt.wait_async(timeout):
            return
        reason = self.logger.refusal() or "the interaction log is behind"
        raise logging_unavailable(f"the answer was generated but its interaction could not be logged within "
                                  f"{timeout:g} s (serving.log_ack_timeout_s): {reason}")

    # ------------------------------------------------------------------ endpoints

    async def chat(self, request: ChatCompletionRequest,
                   disconnected: Disconnected | None = None) -> ChatCompletionResponse | Streamed:
        """Answer a chat request; ``disconnected`` (returns when the client has gone) lets a client that
        leaves before its answer (before the first token, for a stream) stop its generation."""
        self.check_request(request)
        self.prompts.check_chat()
        self.inflight.admit()  # before the tokenizer: an overloaded server refuses cheaply
        prefix, messages, keys, rendered = self.prompts.chat(request)
        turn = self._admit(request, "chat", prefix, template_messages=messages, message_keys=keys,
                           tools=request.active_tools(), rendered_tools=rendered)
        return await self._serve(request, turn, CHAT_FORMAT, disconnected)

    async def completion(self, request: CompletionRequest,
                         disconnected: Disconnected | None = None) -> CompletionResponse | Streamed:
        """Answer a text completion request; ``disconnected`` as for :meth:`chat`."""
        self.check_request(request)
        self.inflight.admit()
        prefix, text = self.prompts.completion(request)
        turn = self._admit(request, "completions", prefix, prompt_text=text)
        return await self._serve(request, turn, COMPLETION_FORMAT, disconnected)

    def _logprobs(self, turn: Turn, fmt: AnswerFormat, start: int, end: int | None = None) -> BaseModel | None:
        """The endpoint's log-probs of the turn's tokens ``start:end`` when the client asked for them."""
        if turn.top_logprobs is None:
            return None
        tokens = [self.token_texts.sampled(t, lp, alt) for t, lp, alt in
                  zip(turn.token_ids[start:end], turn.logprobs[start:end], turn.alternatives[start:end])]
        return fmt.logprobs(tokens, _text_length(turn, self.token_texts, start))

    @contextmanager
    def _interruptible(self, turn: Turn, disconnected: Disconnected | None = None) -> Iterator[None]:
        """:meth:`InFlight.interruptible`, counting and logging the request when its deadline ends it (which
        ends the request: it happens once)."""
        try:
            with self.inflight.interruptible(turn, disconnected):
                yield
        except APIError as exc:
            if exc.code == REQUEST_TIMEOUT:  # a stream that began reads it as its error event
                self.metrics.observe_timeout(turn.path, started=bool(turn.token_ids))
                log.warning("request %s (%s) passed its deadline of %g s (serving.request_timeout_s) with %d "
                            "tokens sampled: cut, answered 504", turn.interaction_id, turn.path, turn.timeout_s,
                            len(turn.token_ids))
            raise

    async def _serve(self, request: SamplingRequest, turn: Turn, fmt: AnswerFormat,
                     disconnected: Disconnected | None) -> Answer | Streamed:
        # admitted (InFlight.admit) with no await since: the bound held when _pieces counts it in
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            pieces = self._pieces(turn)
            # the engine takes the request (or refuses it: an APIError with its status) before any header
            # goes out; the first piece stays in ``turn.text`` for the stream's first chunk. Until then
            # no response watches the client (it is not sent yet): ``disconnected`` does. The rest of the
            # turn runs in a task of its own (streaming.TurnDriver), so it ends, is logged and leaves the
            # batch, its deadline and the shutdown's cut reaching it, even while the client reads nothing
            with self._interruptible(turn, disconnected):
                await anext(pieces, None)
            stream = AnswerStream(turn, fmt, self.cfg.model_name, include_usage,
                                  self.tool_call_parser if turn.tools is not None else None,
                                  partial(self._logprobs, turn, fmt), partial(self._acknowledge, turn),
                                  partial(self._interruptible, turn))
            return Streamed(turn.interaction_id, stream.events(pieces))
        with self._interruptible(turn, disconnected):
            async for _ in self._pieces(turn):
                pass
            await self._acknowledge(turn)
        reply = Reply(turn.content, turn.answer_finish_reason, self._logprobs(turn, fmt, 0),
                      turn.parsed.calls if turn.parsed else ())
        return fmt.answer(id=turn.interaction_id, created=turn.created, model=self.cfg.model_name, usage=turn.usage(),
                          choices=[fmt.answer_choice(reply)], interaction_id=turn.interaction_id,
                          policy_version=max(turn.versions), policy_versions=turn.policy_versions)


def _max_tokens(asked: int | None, default: int | None, room: int) -> int:
    """The tokens an answer may sample: what the client sent (checked against ``room`` already), else the
    endpoint's default within ``room`` (a default is the service's choice: it never exceeds a limit,
    where checking it as if sent refused a request for a value the client never named)."""
    if asked is not None:
        return asked
    return room if default is None else min(default, room)


def _text_length(turn: Turn, texts: TokenTexts, end: int) -> int:
    """Characters of the texts of the turn's first ``end`` tokens (the completions' ``text_offset``),
    each token's text measured once (``Turn.token_text_ends``)."""
    ends = turn.token_text_ends
    for t in turn.token_ids[len(ends):end]:
        ends.append((ends[-1] if ends else 0) + len(texts.top(t, 0.0).token))
    return ends[end - 1] if end > 0 else 0
