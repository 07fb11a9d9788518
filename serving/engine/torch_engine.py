"""The native PyTorch engine: continuous batching over any Hugging Face causal LM.

One background thread owns the model and runs the loop (model calls never run
on the asyncio event loop):

1. apply a pending weight switch (between two steps, nowhere else);
2. admit waiting requests while fewer than ``max_batch_size`` run: those admitted
   in one round are prefilled together (one forward, prompts left-padded, up to
   ``max_prefill_tokens`` padded positions: :mod:`.prefill_layout`), each samples its
   first token and joins the running batch;
3. one decode step for every running sequence (see :mod:`.kv_batch` for the
   left-padded batched cache); finished and cancelled sequences leave.

With ``ServingConfig.kv_layout = "flat"`` steps 2 and 3 are one forward: the admitted
prompts ride in the running batch's decode step, every sequence's cache in one row
(:mod:`.flat_kv`). The engine then switches its model from transformers' ``sdpa``
attention to :mod:`.grouped_attention`'s (the same arithmetic, without copying grouped
key/value heads), on the model object it is given.

Every sampled token carries its behaviour log-probability under the exact
sampling distribution (:mod:`.sampling`, drawn for the whole batch at once) and
the version of the weights whose forward pass produced its logits; a sequence whose
logits are not finite fails (``NonFiniteLogits``), alone in the padded layout, with its
step in the flat one (:meth:`TorchEngine._flat_step` says why). The events of one round
go to each consumer's event loop in one hand-over (one wake-up of that loop per round,
not one per token; :mod:`.outbox`).

Hot-swap: :meth:`TorchEngine.swap_weights` checks the state dict, loads it into a
spare copy of the model (made once with ``copy.deepcopy``) on the caller's
thread while decoding goes on, then hands the loop a pointer switch that it
runs between two steps. Sequences in flight keep their KV cache (computed by the
old weights) and their later tokens carry the new version: the logged
log-probability is the one the engine actually sampled from. With
``ServingConfig.swap_in_place`` there is no spare copy: the checked weights are
copied into the serving model between two steps (half the memory, a longer
stall).

With ``ServingConfig.compile`` the engine compiles the body of the model it is given
(in place) and of its spare copy (a deep copy of a compiled module runs eagerly);
:meth:`TorchEngine.start` runs warm-up requests (:mod:`.warm_up`) so that the compilation
happens before traffic. Both copies share the compiled graphs.

The engine refuses at construction (``ConfigError``) a model it would not serve with the model's
own distribution (:mod:`.self_check`): windowed attention in the flat layout, or two prompts served
through its loop whose log-probs differ from a plain forward (or that fail, as a Mamba model does).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Literal

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from online_sao.config import ServingConfig
from online_sao.modeling import compile_body, is_compiled, load_policy, load_tokenizer
from serving.engine.base import (EngineLoop, EngineStopped, GenerationRequest, LoopJob, SwapResult, TokenEvent,
                                 check_prompt, relay_events)
from serving.engine.flat_kv import FlatKVBatch
from serving.engine.grouped_attention import use_grouped_sdpa
from serving.engine.kv_batch import RaggedKVBatch
from serving.engine.outbox import EngineSequence, Outbox
from serving.engine.prefill_layout import left_padded, prefill_groups
from serving.engine.sampling import NonFiniteLogits, RowSampling, Sampled, sample_tokens
from serving.engine.self_check import check_engine, served_context_length
from serving.engine.warm_up import warm_up
from serving.engine.weights_check import complete_state_dict

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    """One unit of the loop's work, for metrics and benchmarks."""

    kind: Literal["prefill", "decode", "switch"]
    batch_size: int
    seconds: float
    ended_at: float
    """``time.perf_counter()`` when it ended."""


class TorchEngine:
    """Continuous-batching engine over a causal LM (implements ``InferenceEngine``)."""

    def __init__(self, model: nn.Module, tokenizer=None, cfg: ServingConfig | None = None,
                 initial_version: int = 0, on_step: Callable[[StepStats], None] | None = None):
        self.tokenizer = tokenizer
        self.cfg = cfg or ServingConfig()
        self._model = model.eval()
        self._spare: nn.Module | None = None
        self._spare_lock = threading.Lock()  # a start with compile and a swap replaying the topic may both make it
        self._loop: EngineLoop[EngineSequence] = EngineLoop(initial_version)
        self._on_step: Callable[[StepStats], None] | None = None
        self._on_step_failed: set[str] = set()  # kinds of step after which on_step raised (each logged once)
        self._device = next(model.parameters()).device
        self._vocab = model.get_input_embeddings().num_embeddings
        self._max_positions = served_context_length(model.config)
        params = inspect.signature(model.forward).parameters
        self._keep_last_logits = "logits_to_keep" in params
        # transformers renamed ``past_key_values`` to ``cache``; the cache object is
        # updated in place either way, so only the argument name differs.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._step_lock = threading.Lock()  # model use when no loop thread runs
        self._rows: list[EngineSequence] = []  # owned by the loop thread
        self._outbox = Outbox()  # owned by the loop thread
        self._flat = self.cfg.kv_layout == "flat"
        if self._flat:  # its masked multi-token queries would copy grouped key/value heads in sdpa
            use_grouped_sdpa(model)
        self._dtype = next(model.parameters()).dtype
        self._batch = self._new_batch()
        self._checking = True  # a failing step is the check's to report, in one line
        check_engine(model, self.cfg.kv_layout, self._first_round)  # eager: compiling is not what it checks
        self._checking = False
        self._on_step = on_step  # after the check: its steps are no one's
        if self.cfg.compile:
            compile_body(model)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, cfg: ServingConfig | None = None, dtype: str = "float32",
                        initial_version: int = 0) -> "TorchEngine":
        return cls(load_policy(model_dir, dtype), load_tokenizer(model_dir), cfg, initial_version)

    @property
    def policy_version(self) -> int:
        return self._loop.version

    @property
    def compiled(self) -> bool:
        """Whether every copy of the model the engine holds (serving, spare) runs compiled."""
        return all(is_compiled(m) for m in (self._model, self._spare) if m is not None)

    @property
    def running(self) -> int:
        """Sequences in the running batch."""
        return len(self._rows)

    @property
    def waiting(self) -> int:
        """Requests queued for a free batch slot."""
        return len(self._loop.waiting)

    @property
    def switch_pending(self) -> bool:
        """A swap has loaded its weights and waits for the loop to switch between two steps."""
        return self._loop.switch_pending()

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the loop; with ``compile``, warm it up and make the spare copy before returning."""
        self.start_thread()
        if self.cfg.compile:
            # the first swap then builds nothing: its calls reuse the graphs (keyed by code, not by module)
            await warm_up(self.generate, self._vocab, self._max_positions, self.cfg.max_batch_size)
            if not self.cfg.swap_in_place:
                await asyncio.to_thread(self._make_spare)

    def _make_spare(self) -> None:
        """The hot-swap's second copy of the model, compiled like the first when ``compile``."""
        with self._spare_lock:
            if self._spare is None:
                spare = copy.deepcopy(self._model)
                if self.cfg.compile:
                    compile_body(spare)
                self._spare = spare  # only once compiled: a swap must not load into a half-made copy

    async def stop(self) -> None:
        await asyncio.to_thread(self.stop_thread)

    def start_thread(self) -> None:
        if self._loop.started:
            return
        if self.cfg.torch_threads is not None:
            torch.set_num_threads(self.cfg.torch_threads)
        self._loop.start(self._run, "torch-engine")

    def stop_thread(self) -> None:
        """Stop the loop; unfinished requests end with :class:`EngineStopped`."""
        self._loop.stop()

    # ---- requests --------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream the sampled tokens of one request; the last event has a finish_reason."""
        seq = self._admissible(request)
        seq.loop, seq.events = asyncio.get_running_loop(), asyncio.Queue()
        self._loop.submit(seq)
        async for event in relay_events(seq.events, seq.cancelled):
            yield event

    async def _first_round(self, requests: list[GenerationRequest]) -> list[list[TokenEvent]]:
        """(construction: :func:`.self_check.check_engine`) The events of ``requests``, admitted together by
        the loop's first round; the loop stops after."""
        seqs = [self._admissible(request) for request in requests]
        for seq in seqs:
            seq.loop, seq.events = asyncio.get_running_loop(), asyncio.Queue()
        self._loop.waiting.extend(seqs)  # queued before the loop starts: its first round takes them together
        self.start_thread()
        try:
            return [[event async for event in relay_events(seq.events, seq.cancelled)] for seq in seqs]
        finally:
            self.stop_thread()

    def _admissible(self, request: GenerationRequest) -> EngineSequence:
        prompt = request.prompt_ids
        check_prompt(prompt, self._vocab, self._max_positions)
        room = request.sampling.max_tokens
        if self._max_positions is not None:
            room = min(room, self._max_positions - len(prompt))
        generator = torch.Generator(device=self._device)
        if request.sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(request.sampling.seed)
        sampling = RowSampling(request.sampling.temperature, request.sampling.top_p, generator, request.top_logprobs)
        return EngineSequence(request, sampling, max_new=room)

    # ---- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                jobs, admitted = self._loop.next_round(busy=bool(self._rows),
                                                       room=self.cfg.max_batch_size - len(self._rows),
                                                       gone=lambda seq: seq.cancelled.is_set())
                for job in jobs:
                    self._run_switch(job)
                if not self._loop.alive:
                    break
                with self._step_lock:
                    try:
                        self._round(admitted)
                    except Exception as exc:
                        self._fail_the_batch(admitted, exc)
                self._outbox.flush()
        stopped = EngineStopped("the engine stopped")
        for seq in self._loop.take_waiting() + self._rows:
            self._outbox.put(seq, stopped)
        self._outbox.flush()
        self._rows, self._batch = [], self._new_batch()

    def _round(self, admitted: list[EngineSequence]) -> None:
        """The model work of one round: drop cancelled rows, prefill ``admitted``, one decode step."""
        self._drop_cancelled()
        if self._flat:
            for group in prefill_groups(admitted, self.cfg.max_prefill_tokens, self._flat) or [[]]:
                if group or self._rows:
                    self._guarded(self._flat_step, list(self._rows) + group, group)
        else:
            for group in prefill_groups(admitted, self.cfg.max_prefill_tokens, self._flat):
                self._guarded(self._prefill, group, group)
            if self._rows:
                self._guarded(self._decode_step, list(self._rows))

    def _fail_the_batch(self, admitted: list[EngineSequence], exc: Exception) -> None:
        """A failure outside :meth:`_guarded`'s model calls (selecting the cache's rows, as dropping cancelled
        rows or a failed step's rows does: out of memory on a large batch) leaves the cache and the rows out of
        step: every running request and those admitted this round fail, and the loop goes on with an empty
        batch. A loop thread that died instead left every request waiting for its deadline and every swap
        blocked, with nothing to say the engine was gone."""
        failing = list({id(seq): seq for seq in self._rows + admitted}.values())
        (log.debug if self._checking else log.exception)(  # the self-check's refusal says what failed
            "engine round failed outside a model call; failing %d request(s)", len(failing), exc_info=True)
        for seq in failing:  # one that already finished never reads this (its stream ended at its last token)
            self._outbox.put(seq, exc)
        self._rows, self._batch = [], self._new_batch()

    def _new_batch(self) -> RaggedKVBatch | FlatKVBatch:
        return FlatKVBatch() if self._flat else RaggedKVBatch()

    def _guarded(self, work: Callable, affected: list[EngineSequence], *args) -> None:
        """Run one model call; if it raises, the sequences it served fail and the engine goes on."""
        try:
            work(*args)
        except Exception as exc:
            # during the construction's self-check the refusal names the failure: a traceback before it
            # read as a crash
            (log.debug if self._checking else log.exception)("engine step failed; failing %d request(s)",
                                                             len(affected), exc_info=True)
            for seq in affected:
                self._outbox.put(seq, exc)
            failed = {id(s) for s in affected}
            keep = [i for i, s in enumerate(self._rows) if id(s) not in failed]
            self._batch.select(keep)
            self._rows = [self._rows[i] for i in keep]

    def _run_switch(self, job: LoopJob) -> None:
        job.run()
        self._report("switch", len(self._rows), job.seconds)

    def _report(self, kind: str, batch_size: int, seconds: float) -> None:
        """Tell ``on_step`` about a step. A callback that raises is logged, once per kind of step, and the
        loop goes on: raised after a weight switch, it killed the loop thread (later switches never ran,
        their swaps blocked, no request was served again); after a model step, it failed the step's
        requests as if the model had."""
        if self._on_step is None:
            return
        try:
            self._on_step(StepStats(kind, batch_size, seconds, time.perf_counter()))
        except Exception:
            if kind not in self._on_step_failed:
                self._on_step_failed.add(kind)
                log.exception("the engine's on_step callback failed after a %s step; the loop goes on "
                              "(logged once per kind of step)", kind)

    def _drop_cancelled(self) -> None:
        keep = [i for i, s in enumerate(self._rows) if not s.cancelled.is_set()]
        if len(keep) < len(self._rows):
            self._batch.select(keep)
            self._rows = [self._rows[i] for i in keep]

    def _prefill(self, admitted: list[EngineSequence]) -> None:
        """One forward over a group of this round's admitted prompts (:func:`.prefill_groups`), left-padded
        to the longest: each samples its first token, and those not finished by it join the running batch."""
        seqs = [seq for seq in admitted if not seq.cancelled.is_set()]
        if not seqs:
            return
        start = time.perf_counter()
        model, version = self._model, self._loop.version
        ids, mask = left_padded([seq.request.prompt_ids for seq in seqs], self._device)
        cache = DynamicCache()
        extra = {"logits_to_keep": 1} if self._keep_last_logits else {}
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0),
                    use_cache=True, **{self._cache_arg: cache}, **extra)
        sampled = sample_tokens(out.logits[:, -1], [seq.sampling for seq in seqs], rows_apart=True)
        finished = [self._advance(seq, draw, version) for seq, draw in zip(seqs, sampled)]
        self._batch.append(cache, mask)
        self._rows.extend(seqs)
        if any(finished):  # ended at their first token: they leave at once
            joined = len(self._rows) - len(seqs)
            keep = list(range(joined)) + [joined + i for i, done in enumerate(finished) if not done]
            self._batch.select(keep)
            self._rows = [self._rows[i] for i in keep]
        self._report("prefill", len(seqs), time.perf_counter() - start)

    def _decode_step(self) -> None:
        start = time.perf_counter()
        model, version = self._model, self._loop.version
        rows = self._rows
        ids = torch.tensor([[s.last_token] for s in rows], dtype=torch.long, device=self._device)
        mask = self._batch.step_mask()
        out = model(input_ids=ids, attention_mask=mask, position_ids=self._batch.positions(),
                    use_cache=True, **{self._cache_arg: self._batch.cache})
        self._batch.commit_step(mask)
        sampled = sample_tokens(out.logits[:, -1], [seq.sampling for seq in rows], rows_apart=True)
        keep = [i for i, (seq, draw) in enumerate(zip(rows, sampled)) if not self._advance(seq, draw, version)]
        if len(keep) < len(rows):
            self._batch.select(keep)
            self._rows = [rows[i] for i in keep]
        self._report("decode", len(rows), time.perf_counter() - start)

    def _flat_step(self, admitted: list[EngineSequence]) -> None:
        """(flat layout) One forward for the round: every running row's next token and the prompts of
        ``admitted``, each of which samples its first token and joins the batch (:mod:`.flat_kv`)."""
        start = time.perf_counter()
        model, version = self._model, self._loop.version
        seqs = [seq for seq in admitted if not seq.cancelled.is_set()]
        rows = self._rows
        if not rows and not seqs:  # every admitted request was cancelled and nothing else runs
            return
        batch = self._batch
        step = batch.step([s.last_token for s in rows], [s.request.prompt_ids for s in seqs], self._dtype, self._device)
        cache = batch.cache if batch.cache is not None else DynamicCache()
        extra = {"logits_to_keep": step.last} if self._keep_last_logits else {}
        try:
            out = model(input_ids=step.input_ids, attention_mask=step.mask, position_ids=step.position_ids,
                        use_cache=True, **{self._cache_arg: cache}, **extra)
        except Exception:
            batch.discard()
            raise
        batch.commit(step, cache)
        everyone = rows + seqs
        self._rows = everyone
        logits = out.logits[0] if self._keep_last_logits else out.logits[0, step.last]
        # not rows_apart: the whole step fails if one sequence's logits are not finite, its keys and values
        # being in every sequence's attention (masked, weight 0, but 0 x inf is NaN): the others' are NaN too
        sampled = sample_tokens(logits, [seq.sampling for seq in everyone])
        keep = [i for i, (seq, draw) in enumerate(zip(everyone, sampled)) if not self._advance(seq, draw, version)]
        if len(keep) < len(everyone):
            batch.select(keep)
            self._rows = [everyone[i] for i in keep]
        # a round with running rows is a decode step (new prompts ride in it); one without, a prefill
        self._report("decode" if rows else "prefill", len(everyone), time.perf_counter() - start)

    def _advance(self, seq: EngineSequence, sampled: Sampled | NonFiniteLogits, version: int) -> bool:
        """Record and emit the token drawn for ``seq``; True when the sequence is finished (or its
        consumer went away, or its logits were not finite: it fails)."""
        if isinstance(sampled, NonFiniteLogits):
            log.error("request %s failed: %s", seq.request.request_id, sampled)
            self._outbox.put(seq, sampled)
            return True
        token, logprob, alternatives = sampled
        seq.generated += 1
        seq.last_token = token
        finish = None
        if token in seq.request.stop_token_ids:
            finish = "stop"
        elif seq.generated >= seq.max_new:
            finish = "length"
        self._outbox.put(seq, TokenEvent(token, logprob, version, finish, alternatives))
        return finish is not None or seq.cancelled.is_set()

    # ---- hot-swap --------------------------------------------------------------------------

    def swap_weights(self, version: int, state_dict: dict[str, torch.Tensor], force: bool = False) -> SwapResult:
        """Check, load off the request path, switch between two decode steps (blocking, thread-safe).

        A version not newer than the serving one is ignored unless ``force``
        (rollback); refused weights leave the serving model untouched.
        """
        def prepare() -> Callable[[], None]:
            full = complete_state_dict(self._model, state_dict)
            if self.cfg.swap_in_place:
                return lambda: self._model.load_state_dict(full, strict=True)
            self._make_spare()
            self._spare.load_state_dict(full, strict=True)
            spare = self._spare

            def switch() -> None:
                self._spare, self._model = self._model, spare

            return switch

        def run_here(job: LoopJob) -> None:
            with self._step_lock:
                job.run()

        return self._loop.swap(version, force, prepare, run_here)
