"""What the vLLM engine hands vLLM beside the model: the seeds it can take, the lowest temperature it
samples at, and the engine settings of the CPU build."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

VLLM_MIN_TEMPERATURE = 1e-2
"""vLLM's lowest sampling temperature: ``vllm.SamplingParams.__post_init__`` raises any temperature in
(0, this) to this (``vllm.sampling_params._MAX_TEMP``, vLLM 0.32) with only a warning, which would sample
from another distribution than the one the record names. Temperatures above ``GREEDY_TEMPERATURE`` and
below this are refused; :meth:`~serving.engine.vllm_engine.VLLMEngine._sampling` also refuses any temperature vLLM changes anyway."""


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
    that is -1 there, which vLLM would take for none, is refused (ValueError: a 400). V1's runner
    (the CPU build's) takes the residue, -1's included. None stays unseeded."""
    if seed is None:
        return None
    residue = seed % GENERATOR_SEEDS
    if not signed or residue < GENERATOR_SEEDS // 2:
        return residue
    if residue - GENERATOR_SEEDS == VLLM_NO_SEED:
        raise ValueError("this vLLM engine cannot take the seed -1 (or 2**64 - 1): vLLM reads it as no seed; "
                         "use another seed")
    return residue - GENERATOR_SEEDS


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
