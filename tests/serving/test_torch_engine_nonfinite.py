"""The native engine fails a request whose logits are not finite, and in the padded layout that request alone:
its rows never see each other, so the requests batched with it are served as if it were not there."""

from __future__ import annotations

import asyncio

import pytest
import torch

from online_sao.config import ServingConfig
from online_sao.schemas import SamplingParams
from serving.engine.base import GenerationRequest
from serving.engine.sampling import NonFiniteLogits, RowSampling, sample_tokens
from serving.engine.torch_engine import TorchEngine
from tests.fixtures.engine_reference import replay_logprobs

TEMPERATURE, TOP_P, MAX_TOKENS = 0.8, 0.9, 16
LOGPROB_TOL = 1e-4
"""float32 batched vs float64 one-at-a-time arithmetic differ by ~1e-6."""
OVERFLOWING_POSITIONS = (0, 4)
"""Positions whose logits the test's hook makes NaN (an overflow only some sequences' steps meet)."""
ONE_TOKEN = [42]
"""Its prompt's last position is 0: it breaks at its prefill."""
SHORT = [1, 2, 3]
"""Its decode steps feed positions 3, 4, ...: it samples two tokens, then breaks at its second decode step."""
INNOCENT = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [100, 200, 300, 40, 10, 3]]
"""Prompts whose positions start at 8 and 5: they never meet an overflowing one."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a tiny model gains nothing from intra-op threads


def overflowing_at(model: torch.nn.Module, positions: tuple[int, ...]):
    """Make NaN the logits of every row whose last position (the one whose next token is sampled) is one of
    ``positions``; returns the hook's handle."""
    def hook(module, args, kwargs, out):
        hit = torch.isin(kwargs["position_ids"][:, -1], torch.tensor(positions))
        out.logits[hit, -1] = float("nan")

    return model.register_forward_hook(hook, with_kwargs=True)


async def events_and_error(engine, request: GenerationRequest):
    """The events a request streamed, and the exception that ended it (None if it finished)."""
    events = []
    try:
        async for event in engine.generate(request):
            events.append(event)
    except NonFiniteLogits as exc:
        return events, exc
    return events, None


def test_sampling_rows_apart_fails_the_broken_rows_alone():
    logits = torch.full((3, 4), -30.0)
    logits[0, 1] = logits[2, 2] = 0.0  # each other token has probability e^-30 / (1 + 3 e^-30): 9e-14
    logits[1, 3] = float("nan")
    rows = [RowSampling(1.0, 1.0, torch.Generator().manual_seed(0)), RowSampling(1.0, 1.0, torch.Generator()),
            RowSampling(1e-4, 1.0, torch.Generator())]
    first, broken, last = sample_tokens(logits, rows, rows_apart=True)
    assert isinstance(broken, NonFiniteLogits) and "not finite" in str(broken)
    assert first[0] == 1 and first[1] == pytest.approx(0.0, abs=1e-6)
    assert last[:2] == (2, 0.0)  # greedy: the arg-max and the point mass


def test_a_request_with_non_finite_logits_fails_alone_in_the_padded_layout(model):
    engine = TorchEngine(model, cfg=ServingConfig(kv_layout="padded", max_batch_size=8))
    requests = [GenerationRequest(f"r{i}", prompt, SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, seed=i,
                                                                  max_tokens=MAX_TOKENS))
                for i, prompt in enumerate(INNOCENT + [ONE_TOKEN, SHORT])]

    async def main():
        await engine.start()
        out = await asyncio.gather(*(events_and_error(engine, r) for r in requests))
        await engine.stop()
        return out

    handle = overflowing_at(model, OVERFLOWING_POSITIONS)
    try:
        *innocent, one_token, short = asyncio.run(main())
    finally:
        handle.remove()
    assert one_token[0] == [] and isinstance(one_token[1], NonFiniteLogits)  # failed at its prefill
    assert len(short[0]) == 2 and isinstance(short[1], NonFiniteLogits)  # failed at its second decode step
    for req, (events, error) in zip(requests, innocent):
        assert error is None and len(events) == MAX_TOKENS and events[-1].finish_reason == "length"
        reference = replay_logprobs({engine.policy_version: model}, req.prompt_ids, events, TEMPERATURE, TOP_P)
        assert max(abs(e.logprob - x) for e, x in zip(events, reference)) < LOGPROB_TOL
