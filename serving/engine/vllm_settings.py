"""What the vLLM engine hands vLLM beside the model: the seeds it can take, the lowest temperature it
samples at, the engine arguments it sets itself, its engine seed, its memory share, and the engine
settings of the CPU build."""

from __future__ import annotations

import logging
import math
import secrets

from serving.engine.base import RequestRefused
from serving.engine.sampling import GREEDY_TEMPERATURE

log = logging.getLogger(__name__)

VLLM_MIN_TEMPERATURE = 1e-2
"""vLLM's lowest sampling temperature: ``vllm.SamplingParams.__post_init__`` raises any temperature in
(0, this) to this (``vllm.sampling_params._MAX_TEMP``, vLLM 0.32) with only a warning, which would sample
from another distribution than the one the record names. Temperatures above ``GREEDY_TEMPERATURE`` and
below this are refused (:func:`check_temperature`); :func:`check_unchanged` also refuses any temperature
vLLM changes anyway."""


def check_temperature(temperature: float) -> None:
    """Refuse (``RequestRefused`` naming it) a temperature above ``GREEDY_TEMPERATURE`` that vLLM
    would sample at another temperature (:data:`VLLM_MIN_TEMPERATURE`)."""
    if temperature < VLLM_MIN_TEMPERATURE:
        raise RequestRefused(f"the vLLM engine cannot sample at temperature {temperature:g}: vLLM samples at "
                             f"{VLLM_MIN_TEMPERATURE:g} or above; at {GREEDY_TEMPERATURE:g} or below it decodes "
                             "greedily", "temperature")


def check_unchanged(params, **asked) -> None:
    """Refuse (``RequestRefused`` naming the first) settings ``params`` (a ``vllm.SamplingParams``) holds
    otherwise than ``asked``: vLLM changed them behind the record's back."""
    changed = [name for name, value in asked.items() if getattr(params, name) != value]
    if changed:
        held = ", ".join(f"{name} {getattr(params, name)!r}" for name in asked)
        raise RequestRefused(f"vLLM would sample with {held}; the engine asks for "
                             + ", ".join(f"{name} {value!r}" for name, value in asked.items()), changed[0])


GENERATOR_SEEDS = 2 ** 64
"""How many generator seeds there are: ``torch.Generator.manual_seed`` (the native engine's) takes any
64-bit integer, signed or not, and seeds with it modulo this."""
VLLM_NO_SEED = -1
"""The seed ``vllm.SamplingParams`` reads as "no seed" (again in every copy it makes of itself)."""


def generator_seed(seed: int | None, signed: bool) -> int | None:
    """The seed vLLM gets for an API seed: its generator seed (the seed modulo :data:`GENERATOR_SEEDS`),
    which torch's generators seed with as the native engine's does. ``signed``: vLLM's V2 model runner
    (its default on GPUs) keeps seeds in an int64 array, where a residue of 2**63 or more overflowed
    and failed the whole step's batch: it gets the signed integer of the same bits, and the one seed
    that is -1 there, which vLLM would take for none, is refused (``RequestRefused``: a 400 naming
    ``seed``). V1's runner (the CPU build's) takes the residue, -1's included. None stays unseeded."""
    if seed is None:
        return None
    residue = seed % GENERATOR_SEEDS
    if not signed or residue < GENERATOR_SEEDS // 2:
        return residue
    if residue - GENERATOR_SEEDS == VLLM_NO_SEED:
        raise RequestRefused("this vLLM engine cannot take the seed -1 (or 2**64 - 1): vLLM reads it as no seed; "
                             "use another seed", "seed")
    return residue - GENERATOR_SEEDS


ENGINE_ARGS_SET = {
    "model": "the engine's model directory",
    "logprobs_mode": "behaviour log-probs after temperature and top-p",
    "max_num_seqs": "serving.max_batch_size",
    "async_scheduling": "off: a step's output could come from weights before a switch",
    "enable_prefix_caching": "off: a new request could reuse KV computed by older weights",
    "load_format": "safetensors only, as in the torch engine",
}
"""The ``vllm.EngineArgs`` keywords the engine sets itself, and why."""
ENGINE_SEEDS = 2 ** 32
"""Engine seeds drawn: vLLM seeds Python's, numpy's and torch's global generators with the engine
seed, and numpy's takes seeds below this."""


def engine_args(own: dict, caller: dict) -> dict:
    """The ``vllm.EngineArgs`` keywords: the caller's, the engine's ``own`` (keys of
    :data:`ENGINE_ARGS_SET`) and an engine seed. A caller's value for a key the engine sets is refused
    (ValueError naming them), unless it is the engine's own value (nothing to do).

    Without a caller's ``seed``, a random one (below :data:`ENGINE_SEEDS`): vLLM's default engine seed
    is 0, and its global generators, which draw every unseeded request, would replay the same draws
    after each restart and on every replica. A seeded request draws from a generator of its own, seeded
    with the request's seed, so it reproduces whatever the engine seed."""
    clashes = {key: value for key, value in caller.items() if key in own and value != own[key]}
    if clashes:
        raise ValueError("the vLLM engine sets " + "; ".join(
            f"{key} itself ({own[key]!r}: {ENGINE_ARGS_SET.get(key, 'the engine needs it')}), {value!r} was given"
            for key, value in sorted(clashes.items())) + ": leave them out of its engine arguments")
    return {"seed": secrets.randbelow(ENGINE_SEEDS), **caller, **own}


def memory_args(share: float | None, engines: int) -> dict:
    """The ``vllm.EngineArgs`` keywords of the memory of one of ``engines`` vLLM engines in this process
    (two behind a canary), ``share`` being ``serving.vllm_memory_share``: each engine gets its part of
    it as ``gpu_memory_utilization`` (on GPUs a share of the GPU's memory; on vLLM's CPU build a share
    of the host's memory, which must be available at start). None: vLLM's default share, split in the
    same way (one engine: nothing passed)."""
    if share is None:
        if engines == 1:
            return {}
        from vllm import EngineArgs

        share = EngineArgs.gpu_memory_utilization
    return {"gpu_memory_utilization": share / engines}


GIB = 1 << 30


def check_host_memory_share(share: float, total_bytes: int, available_bytes: int | None) -> None:
    """On vLLM's CPU build, refuse before vLLM starts when one engine's ``share`` (its
    ``gpu_memory_utilization``: :func:`memory_args`) of the host's ``total_bytes`` is more than is
    available now. vLLM's worker process raised it, and ``serve`` died on a 95-line traceback whose
    advice named vLLM's own ``--gpu-memory-utilization``, not the setting to change. ``available_bytes``
    None (not readable): nothing to check."""
    from online_sao.config import ConfigError

    wanted = share * total_bytes
    if available_bytes is None or wanted <= available_bytes:
        return
    fits = math.floor(available_bytes / total_bytes * 100) / 100
    raise ConfigError(
        f"serving.vllm_memory_share: the vLLM engine on CPU takes {share:.2f} of the host's {total_bytes / GIB:.1f} "
        f"GiB ({wanted / GIB:.1f} GiB) at start, and {available_bytes / GIB:.1f} GiB is available: set it so that "
        f"each engine's part is at most {fits:.2f} (the whole share with one engine, half of it for each of the "
        "two behind a canary; less leaves room for the rest of the process)")


VLLM_PARAMETER_FIELDS = {"temperature": "temperature", "top_p": "top_p", "extra_args": "top_p",
                         "max_tokens": "max_tokens", "seed": "seed", "logprobs": "top_logprobs"}
"""The request field behind each ``vllm.SamplingParams`` parameter a ``VLLMValidationError`` may name
that the engine fills from a request (``extra_args`` carries the request's top-p: :mod:`.vllm_nucleus`)."""


def refused_field(parameter: str | None) -> str | None:
    """The request field (``RequestRefused.field``) behind the vLLM parameter a refusal names; None for
    one the engine does not fill from a request field, or none."""
    return VLLM_PARAMETER_FIELDS.get(parameter or "")


def whole_prefills(kwargs: dict) -> dict:
    """``vllm.EngineArgs`` keywords for the CPU build, where vLLM must prefill every prompt in one step.

    With chunked prefill on, vLLM prefills a prompt longer than the step's token budget
    (``max_num_batched_tokens``; by default min(2048, max_num_seqs x max_model_len)), or longer than what
    the step's other requests leave of it, over several steps, and for a seeded request the V1 model
    runner then rewinds its generator after each partial step (``gen.set_offset``, vLLM 0.32's
    ``gpu_model_runner``). A CPU ``torch.Generator`` has no offset and raises, which fails the whole step,
    every request in it included. So on CPU chunked prefill is off (the scheduler then waits until a
    prompt fits the step's budget whole), ``long_prefill_token_threshold`` (which would cut a prefill
    anyway) is 0, and the budget is at least ``max_model_len``, so that every prompt the engine admits
    fits one step (vLLM would refuse a smaller budget without chunking). Settings the caller gave
    otherwise are overridden with a warning. GPUs are left as vLLM configures them: their generators
    have offsets."""
    kwargs = dict(kwargs)
    if kwargs.get("enable_chunked_prefill"):
        log.warning("vLLM engine on CPU: chunked prefill turned off (a seeded request's partial prefill "
                    "fails the step there)")
    kwargs["enable_chunked_prefill"] = False
    if kwargs.get("long_prefill_token_threshold"):
        log.warning("vLLM engine on CPU: long_prefill_token_threshold %s turned off (it would cut prefills)",
                    kwargs["long_prefill_token_threshold"])
    kwargs["long_prefill_token_threshold"] = 0
    budget = kwargs.get("max_num_batched_tokens")
    if budget is not None:  # vLLM's own default is at least max_model_len once chunked prefill is off
        from vllm import EngineArgs

        max_len = EngineArgs(**kwargs).create_model_config().max_model_len
        if budget < max_len:
            log.warning("vLLM engine on CPU: max_num_batched_tokens raised from %d to max_model_len %d, "
                        "so that every prompt is prefilled in one step", budget, max_len)
            kwargs["max_num_batched_tokens"] = max_len
    return kwargs
