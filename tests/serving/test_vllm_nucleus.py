"""The learner's nucleus inside vLLM's sampler (serving/engine/vllm_nucleus.py), behind both of vLLM's
processor interfaces, without an engine: the CPU build runs V1's model runner only, so the engine
tests (test_engine_contract.py) never reach V2's, the default on GPUs.

Each batch mixes a request with a nucleus, one without, a greedy one and a row whose cut-off falls
between two tied tokens; the expected mask is the learner's own (``online_sao.sampling.nucleus_logprobs``).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from online_sao.sampling import nucleus_logprobs

pytestmark = pytest.mark.vllm

VOCAB = 64
SLOTS = 6
"""Request slots of the processors: more than the batch, so the rows map to slots out of order."""
TIE_ROW, TIE_TEMPERATURE = 0, 0.8


def batch() -> tuple[torch.Tensor, list[tuple[int, float, float]]]:
    """Float32 logits and each row's ``(slot, temperature, top_p)`` (temperature 0: a greedy request,
    vLLM's greedy decoding): a nucleus cut between two tied tokens (``TIE_ROW``: its third most likely
    token tied with the highest id, the top-p the mass of the two above them plus half of one), no
    nucleus, a greedy request, a plain nucleus."""
    logits = 3.0 * torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    order = torch.argsort(logits[TIE_ROW], descending=True, stable=True)
    logits[TIE_ROW, VOCAB - 1] = logits[TIE_ROW, order[2]]
    probs = torch.softmax(logits[TIE_ROW].double() / TIE_TEMPERATURE, dim=-1)
    tie_top_p = float(probs[order[:2]].sum() + probs[order[2]] / 2)
    return logits, [(4, TIE_TEMPERATURE, tie_top_p), (1, 1.0, 1.0), (0, 0.0, 0.5), (3, 1.3, 0.7)]


def learner_keeps(logits: torch.Tensor, rows) -> torch.Tensor:
    """The tokens the learner's sampling distribution of each row gives a finite log-probability
    (a greedy row: every token; vLLM takes its arg-max and the engine lists its alternatives)."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    for row, (_, temperature, top_p) in enumerate(rows):
        if temperature > 0:
            keep[row] = torch.isfinite(nucleus_logprobs(logits[row], temperature, top_p))
    return keep


def params_of(temperature: float, top_p: float):
    from vllm import SamplingParams

    from serving.engine.vllm_nucleus import NO_NUCLEUS, nucleus_args

    return SamplingParams(temperature=temperature, top_p=NO_NUCLEUS, extra_args=nucleus_args(top_p))


def through_v1(logits: torch.Tensor, rows) -> torch.Tensor:
    """``logits`` through NucleusV1, the requests added at their batch rows as V1's persistent batch does."""
    from vllm.v1.sample.logits_processor import BatchUpdate

    from serving.engine.vllm_nucleus import NucleusV1

    processor = NucleusV1(None, torch.device("cpu"), False)
    added = [(row, params_of(t, p), [1], []) for row, (_, t, p) in enumerate(rows)]
    processor.update_state(BatchUpdate(batch_size=len(rows), removed=[], added=added, moved=[]))
    return processor.apply(logits)


def through_v2(logits: torch.Tensor, rows) -> torch.Tensor:
    """``logits`` through NucleusV2, each request in its own slot (rows map to slots out of order), a
    recycled slot's previous occupant (a nucleus) replaced."""
    from serving.engine.vllm_nucleus import NucleusV2

    processor = NucleusV2(None, SimpleNamespace(max_num_reqs=SLOTS))
    processor.add_request(1, params_of(0.7, 0.3))  # the earlier occupant of a slot reused below
    for slot, temperature, top_p in rows:
        processor.add_request(slot, params_of(temperature, top_p))
    slots = np.array([slot for slot, _, _ in rows])
    ctx = SimpleNamespace(idx_mapping_np=slots, expanded_idx_mapping=torch.from_numpy(slots))
    return processor.apply(logits, ctx)


@pytest.mark.parametrize("through", [through_v1, through_v2], ids=["v1", "v2"])
def test_vllm_processors_keep_exactly_the_learners_nucleus(through):
    logits, rows = batch()
    expected = learner_keeps(logits, rows)
    tied = torch.nonzero(logits[TIE_ROW] == logits[TIE_ROW, VOCAB - 1]).flatten().tolist()
    assert len(tied) == 2 and expected[TIE_ROW, tied[0]] and not expected[TIE_ROW, tied[1]]  # the cut is in the tie
    assert not bool(expected[[0, 3]].all(dim=-1).any())  # both nuclei cut something

    out = through(logits.clone(), rows)
    assert torch.equal(torch.isfinite(out), expected)
    assert torch.equal(out[expected], logits[expected])  # kept logits untouched: vLLM applies the temperature


def test_every_api_seed_reaches_vllm_as_its_generator_seed_and_v2_as_an_int64():
    """vLLM's V2 model runner keeps seeds in an int64 array: the residues 2**63 and above (every
    negative seed, handed over as its residue) overflowed it and failed the step's whole batch. V1
    (a torch generator) takes the residue; -1 is what vLLM reads as no seed, so V2 cannot take it."""
    from serving.engine.vllm_settings import generator_seed

    for seed, v1, v2 in ((-5, 2 ** 64 - 5, -5), (2 ** 64 - 5, 2 ** 64 - 5, -5), (2 ** 63, 2 ** 63, -(2 ** 63)),
                         (-(2 ** 63), 2 ** 63, -(2 ** 63)), (2 ** 63 - 1, 2 ** 63 - 1, 2 ** 63 - 1), (0, 0, 0),
                         (-1, 2 ** 64 - 1, None)):
        assert generator_seed(seed, signed=False) == v1
        assert torch.Generator().manual_seed(v1).initial_seed() == seed % 2 ** 64
        if v2 is None:
            with pytest.raises(ValueError, match="cannot take the seed -1"):
                generator_seed(seed, signed=True)
            continue
        assert generator_seed(seed, signed=True) == v2
        np.array([v2], dtype=np.int64)  # fits
        assert torch.Generator().manual_seed(v2).initial_seed() == seed % 2 ** 64
    assert generator_seed(None, signed=True) is None
