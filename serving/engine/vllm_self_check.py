"""The vLLM engine's check at construction: refuse a model that vLLM serves otherwise than the learner computes it.

The learner recomputes each action's log-prob with the transformers model (:func:`online_sao.modeling.load_policy`)
and divides by the behaviour log-prob the engine logged. vLLM runs its own implementation of each
architecture; where it differs from transformers' (a sliding window applied otherwise, a config field
one side ignores, a weight mapped to the wrong place), every importance ratio is off and the token mask
drops tokens, silently. So, as the torch engine does (:mod:`.self_check`), the engine serves two prompts
of different lengths before its loop runs (one step prefills both, the next ones decode them together)
and compares the sampled tokens' log-probs with a plain forward of the transformers model loaded from
the same directory, on the CPU, in the served dtype (then freed), with the torch engine's tolerances.
A difference above them, or a check that raises, is a :class:`~online_sao.config.ConfigError` naming the
model type, the engine and the difference. ``serving.vllm_self_check`` turns it off.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from online_sao.modeling import DTYPES, load_policy
from serving.engine.base import GenerationRequest, TokenEvent
from serving.engine.self_check import (SELF_CHECK_TOKENS, check_prompts, check_requests, largest_difference,
                                       refusal_of_a_failure, refuse_a_difference)

log = logging.getLogger(__name__)

WHERE = "the vLLM engine"
REFERENCE = "the transformers model the learner loads from the same directory"
REFERENCE_MEMORY_HEADROOM = 1.5
"""The check loads the reference only when the host has this many times its weights' bytes available:
transformers holds a shard being read and the forward's activations beside the weights, and a serving
start killed for memory says nothing, where a skipped check says why in a warning."""
MAX_STEPS = 64
"""Engine steps the check takes at most: one prefill and ``SELF_CHECK_TOKENS`` - 1 decode steps are
enough, a chunked prefill or a preempted request a few more; a scheduler that makes no progress
must fail the start, not hang it."""


def model_name(hf_config: dict) -> str:
    """The model as the messages name it: its architecture and model type (from config.json)."""
    architectures = hf_config.get("architectures") or ["an unnamed architecture"]
    return f"{architectures[0]} (model_type {hf_config.get('model_type')!r})"


def check_vllm_engine(llm, sampling: Callable[[GenerationRequest], object], model_dir: Path, dtype: torch.dtype,
                      vocab: int, hf_config: dict, weight_bytes: int,
                      available_memory: Callable[[], int | None] | None = None) -> float | None:
    """Refuse (ConfigError) a model that ``llm`` (a ``vllm.v1.engine.llm_engine.LLMEngine`` with no request
    in it, whose loop does not run yet) does not serve with the log-probs of the transformers model in
    ``model_dir`` in ``dtype``; ``sampling`` builds a request's ``vllm.SamplingParams`` as the engine does.
    Returns the largest difference (nats), or None when the host's available memory
    (``available_memory``, :func:`available_host_memory` by default) cannot hold the reference's
    ``weight_bytes`` with :data:`REFERENCE_MEMORY_HEADROOM`: then nothing runs and a warning says so."""
    what = model_name(hf_config)
    available = (available_memory or available_host_memory)()
    if available is not None and available < REFERENCE_MEMORY_HEADROOM * weight_bytes:
        log.warning("engine self-check of %s in %s skipped: the transformers reference needs about %.1f GB of "
                    "host memory (%.1fx its weights), %.1f GB are available; its behaviour log-probs are not "
                    "checked against the learner's (serving.vllm_self_check: false silences this)", what, WHERE,
                    REFERENCE_MEMORY_HEADROOM * weight_bytes / 1e9, REFERENCE_MEMORY_HEADROOM, available / 1e9)
        return None
    prompts = check_prompts(vocab)
    started = time.perf_counter()
    try:
        served = _serve(llm, [(request.request_id, request.prompt_ids, sampling(request))
                              for request in check_requests(prompts)])
        reference = load_policy(model_dir, _dtype_name(dtype)).eval()
        try:
            difference = largest_difference(reference, prompts, served)
        finally:
            del reference
            gc.collect()  # a second copy of the weights: give its memory back before serving starts
    except Exception as exc:  # vLLM or transformers cannot run the model: say so instead of at every request
        raise refusal_of_a_failure(what, WHERE, prompts, exc, "The learner recomputes the log-probs with the "
                                   "transformers model of this directory, which must load and run on the CPU "
                                   "(serving.vllm_self_check: false skips the check where the host cannot hold "
                                   "a second copy of the weights)") from exc
    refuse_a_difference(what, WHERE, REFERENCE, difference, dtype,
                        "; serve it with serving.engine: torch, or fix vLLM's implementation of the architecture")
    log.info("engine self-check: %s in %s agrees with the transformers model within %.2g nats (%.1f s)",
             what, WHERE, difference, time.perf_counter() - started)
    return difference


def _serve(llm, requests: list[tuple[str, list[int], object]]) -> list[list[TokenEvent]]:
    """Add ``(request id, prompt, vllm.SamplingParams)`` requests to ``llm`` together and step until every
    one has ended; the tokens each sampled, with the log-probs vLLM reported (``DELTA`` outputs)."""
    events: dict[str, list[TokenEvent]] = {rid: [] for rid, _, _ in requests}
    for rid, prompt, params in requests:
        llm.add_request(rid, {"prompt_token_ids": prompt}, params)
    steps = 0
    while llm.has_unfinished_requests():
        if steps == MAX_STEPS:
            llm.abort_request(list(events))
            raise RuntimeError(f"vLLM had not ended the check's requests after {MAX_STEPS} steps")
        steps += 1
        for out in llm.step():
            completion = out.outputs[0]
            for token, logprobs in zip(completion.token_ids, completion.logprobs or []):
                events[out.request_id].append(TokenEvent(int(token), float(logprobs[token].logprob), 0))
    for rid, sampled in events.items():
        if len(sampled) != SELF_CHECK_TOKENS:
            raise RuntimeError(f"vLLM sampled {len(sampled)} tokens for {rid}, {SELF_CHECK_TOKENS} were asked for")
    return [events[rid] for rid, _, _ in requests]


def _dtype_name(dtype: torch.dtype) -> str:
    """The name :func:`~online_sao.modeling.load_policy` takes for the served ``dtype``."""
    names = {value: name for name, value in DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"the learner loads models in {sorted(DTYPES)}, vLLM serves this one in {dtype}")
    return names[dtype]


def available_host_memory(meminfo: Path = Path("/proc/meminfo"),
                          cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process may still allocate: the kernel's ``MemAvailable``, and below it what a cgroup
    (v2 ``memory.max`` - ``memory.current``, v1 ``memory.limit_in_bytes`` - ``memory.usage_in_bytes``:
    a container's limit, which ``MemAvailable`` does not see) leaves; None where neither can be read."""
    bounds = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                bounds.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit, usage = (cgroup / limit_file).read_text().strip(), (cgroup / usage_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit():  # "max": no limit
            bounds.append(max(int(limit) - int(usage), 0))
    return min(bounds) if bounds else None
