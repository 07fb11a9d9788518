"""A compiling torch engine's warm-up: requests it serves to itself before traffic, so that the
graphs traffic needs are built while it starts (``ServingConfig.compile``, :mod:`.torch_engine`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from online_sao.schemas import SamplingParams
from serving.engine.base import GenerationRequest, TokenEvent
from serving.engine.kv_batch import MIN_HEADROOM

WARM_UP_PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)
"""Token ids of a compiling engine's warm-up requests (any vocabulary's; their text does not matter)."""
WARM_UP_TOGETHER = 3
"""Warm-up requests run together after one alone: dynamic shapes specialise sizes 0 and 1, so a
batch of one sequence and a batch of several get graphs of their own."""


async def warm_up(generate: Callable[[GenerationRequest], AsyncIterator[TokenEvent]], vocab: int,
                  max_positions: int | None, max_batch_size: int) -> None:
    """Warm-up requests through ``generate``: one alone, then several together."""
    prompt = [t % vocab for t in WARM_UP_PROMPT]
    # enough tokens that the cache outgrows its first buffer: a step that regrows it is a graph of its own
    tokens = MIN_HEADROOM + len(prompt)
    if max_positions is not None:
        tokens = min(tokens, max_positions - len(prompt))

    async def one(i: int) -> None:
        request = GenerationRequest(f"warm-up-{i}", prompt, SamplingParams(max_tokens=tokens, seed=i))
        [_ async for _ in generate(request)]

    await one(0)
    await asyncio.gather(*(one(i) for i in range(1, 1 + min(WARM_UP_TOGETHER, max_batch_size))))
