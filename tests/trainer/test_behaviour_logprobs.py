"""The learner's log-probabilities are the engine's for every turn of a conversation.

Each turn of a multi-turn record may have been sampled with its own temperature and top-p; the
record goes through the learner's own path (record -> rollout -> batch -> ``policy_logprobs``) with
the serving weights, and every turn's tokens must come back with the engine's log-probs. (One turn
at every setting, against both engines: tests/serving/test_engine_contract.py.)
"""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch

from online_sao.config import ServingConfig
from online_sao.modeling import load_policy
from online_sao.schemas import SamplingParams
from serving.engine.base import GenerationRequest
from serving.engine.torch_engine import TorchEngine
from serving.trajectories import TrajectoryPrefix
from tests.fixtures.engine_reference import collect, learner_logprobs, record_of

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13], [42], [100, 200, 300, 40, 10, 3]]
AGREEMENT_TOL = 1e-4
"""Incremental float32 decoding with a KV cache vs one padded float32 forward: ~1e-6 apart."""


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from threads on a shared machine
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(tiny_model_dir).eval()


def sample(policy, requests: list[GenerationRequest], kv_layout: str):
    engine = TorchEngine(copy.deepcopy(policy), cfg=ServingConfig(max_batch_size=16, kv_layout=kv_layout))

    async def main():
        await engine.start()
        out = await asyncio.gather(*(collect(engine, r) for r in requests))
        await engine.stop()
        return out

    return asyncio.run(main())


@pytest.mark.parametrize("kv_layout", ["padded", "flat"])
def test_each_turn_keeps_the_distribution_it_was_sampled_from(policy, kv_layout):
    first = GenerationRequest("turn-0", PROMPTS[1], SamplingParams(temperature=0.7, top_p=0.5, max_tokens=8, seed=1))
    (events,) = sample(policy, [first], kv_layout)
    parent = record_of(TrajectoryPrefix(list(first.prompt_ids)), first, events)
    prefix = TrajectoryPrefix.continuing(parent, [7, 8, 9])  # user tokens between the turns
    second = GenerationRequest("turn-1", prefix.engine_prompt,
                               SamplingParams(temperature=1.3, top_p=0.9, max_tokens=8, seed=2))
    (events,) = sample(policy, [second], kv_layout)
    record = record_of(prefix, second, events)
    assert [(o.temperature, o.top_p) for o in record.turn_origins] == [(0.7, 0.5), (1.3, 0.9)]
    learned = learner_logprobs(policy, record)
    assert max(abs(a - b) for a, b in zip(learned, record.logprobs, strict=True)) < AGREEMENT_TOL
