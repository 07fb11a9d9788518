"""The learner's top-p nucleus inside vLLM's sampler: a vLLM logits processor.

The learner recomputes a behaviour log-probability with :func:`online_sao.sampling.nucleus_logprobs`:
tokens sorted by decreasing probability, ties to the lower token id, kept while the mass before them
is below ``top_p``. vLLM's own top-p filter sorts ascending (not stably) and sums from the tail: on an
exact tie at the cut-off it may keep the higher id, and in float32 it sometimes keeps one token more. Either way it
samples tokens the learner scores ``-inf`` (and renormalises over another set). So the vLLM engine
hands vLLM ``top_p = 1`` and the request's top-p as ``SamplingParams.extra_args[NUCLEUS_ARG]``; this
processor then sets every logit outside the learner's nucleus (:func:`online_sao.sampling.nucleus_mask`
of the logits divided by the request's float32 temperature, as the learner divides them) to ``-inf``
before vLLM applies the temperature and samples. The engine's ``processed_logprobs`` are taken after
that, so the logged log-probabilities are those of the masked, tempered distribution.

vLLM 0.32 has two model runners with two processor interfaces: V1's (the CPU build, and wherever Triton
is missing) and V2's (its default on GPUs). :func:`processor_class` picks the one the engine's
configuration runs. Both see the float32 logits before the temperature (V1: a processor that is not
argmax-invariant runs before it; V2: every custom processor does), so the one :func:`cut_to_nucleus`
serves both. This module imports vLLM: only the vLLM engine imports it, once vLLM imported.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

from online_sao.sampling import nucleus_mask

NUCLEUS_ARG = "online_sao_top_p"
"""The ``SamplingParams.extra_args`` key carrying a request's top-p (only where it is below 1)."""

NO_NUCLEUS = 1.0
"""The top-p of a request without a nucleus: it keeps every token (and is what vLLM's own top-p gets)."""


def nucleus_args(top_p: float) -> dict[str, float] | None:
    """The ``extra_args`` of a sampled request whose nucleus this processor cuts; None without one."""
    return {NUCLEUS_ARG: float(top_p)} if top_p < NO_NUCLEUS else None


def requested_top_p(params: SamplingParams) -> float:
    """The request's top-p as :func:`nucleus_args` passed it; :data:`NO_NUCLEUS` for a greedy request
    (its arg-max is the point mass; the engine lists its alternatives itself) or one without it."""
    if params.temperature <= 0.0 or not params.extra_args:
        return NO_NUCLEUS
    return float(params.extra_args.get(NUCLEUS_ARG, NO_NUCLEUS))


def validate(params: SamplingParams) -> None:
    """Refuse (ValueError, which vLLM turns into a request error) a top-p outside (0, 1]."""
    top_p = requested_top_p(params)
    if not 0.0 < top_p <= NO_NUCLEUS:
        raise ValueError(f"{NUCLEUS_ARG} must be in (0, 1], got {top_p}")


def cut_to_nucleus(logits: torch.Tensor, rows: list[int], temperatures: list[float],
                   top_ps: list[float]) -> torch.Tensor:
    """Set the logits of ``rows`` of ``logits [B, V]`` (float32, before the temperature) outside the
    learner's nucleus to ``-inf``, in place; returns ``logits``.

    The nucleus is the learner's: :func:`nucleus_mask` of ``log_softmax(logits / temperature)`` with
    the temperature and top-p as float32 tensors, as :func:`online_sao.sampling.sampled_logprobs`
    and the native engine compute it.
    """
    if not rows:
        return logits
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    raw = logits.index_select(0, index)
    temperature = torch.tensor(temperatures, dtype=torch.float32, device=logits.device).unsqueeze(-1)
    top_p = torch.tensor(top_ps, dtype=torch.float32, device=logits.device)
    keep = nucleus_mask(torch.log_softmax(raw.float() / temperature, dim=-1), top_p)
    logits.index_copy_(0, index, raw.masked_fill(~keep, float("-inf")))
    return logits


class NucleusV1(V1LogitsProcessor):
    """:func:`cut_to_nucleus` behind vLLM's V1 interface (persistent-batch updates)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self._rows: dict[int, tuple[float, float]] = {}  # batch index -> (temperature, top_p)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        validate(sampling_params)

    def is_argmax_invariant(self) -> bool:
        # It is (the most likely token is always kept), but V1 applies argmax-invariant processors after
        # the temperature: declaring otherwise runs it on the raw logits, which it divides as the learner.
        return False

    def update_state(self, batch_update) -> None:
        def state(params: SamplingParams, _prompt, _output) -> tuple[float, float] | None:
            top_p = requested_top_p(params)
            return (params.temperature, top_p) if top_p < NO_NUCLEUS else None

        process_dict_updates(self._rows, batch_update, state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = sorted(self._rows)
        return cut_to_nucleus(logits, rows, [self._rows[r][0] for r in rows], [self._rows[r][1] for r in rows])


class NucleusV2(V2LogitsProcessor):
    """:func:`cut_to_nucleus` behind vLLM's V2 interface (per-slot state, rows mapped each step)."""

    def __init__(self, vllm_config, req_states):
        self._temperature = np.ones(req_states.max_num_reqs, dtype=np.float64)
        self._top_p = np.full(req_states.max_num_reqs, NO_NUCLEUS, dtype=np.float64)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        validate(sampling_params)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        # a slot is recycled: overwrite its previous occupant's settings
        self._temperature[req_idx] = sampling_params.temperature
        self._top_p[req_idx] = requested_top_p(sampling_params)
        return bool(self._top_p[req_idx] < NO_NUCLEUS)

    def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
        if not np.any(self._top_p[ctx.idx_mapping_np] < NO_NUCLEUS):
            return logits  # no nucleus in this step: no device sync
        # one row per request unless speculative decoding (which refuses custom processors) drafts more
        slots = ctx.idx_mapping_np if logits.shape[0] == len(ctx.idx_mapping_np) \
            else ctx.expanded_idx_mapping.cpu().numpy()
        rows = [row for row, slot in enumerate(slots) if self._top_p[slot] < NO_NUCLEUS]
        return cut_to_nucleus(logits, rows, [float(self._temperature[slots[r]]) for r in rows],
                              [float(self._top_p[slots[r]]) for r in rows])


def processor_class(vllm_config) -> type:
    """The processor for the model runner ``vllm_config`` runs (V2's interface or V1's)."""
    return NucleusV2 if vllm_config.use_v2_model_runner else NucleusV1
