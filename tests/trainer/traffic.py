"""A test producer: interactions sampled from a real (tiny) policy, so behaviour
log-probs are what an engine would log, and rewards from a simple rule."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from online_sao.schemas import Interaction, Reward, SamplingParams
from streams.base import Producer
from streams.records import publish

PROMPTS = [[1, 290, 202, 273, 314, 82, 2, 202, 1, 291, 202], [1, 290, 202, 310, 269, 72, 2, 202, 1, 291, 202]]
"""Two ChatML prompts in the tiny model's vocabulary (user turn, then an open assistant turn)."""


@torch.no_grad()
def sample_interaction(policy: nn.Module, prompt_ids: list[int], interaction_id: str, max_new_tokens: int = 6,
                       temperature: float = 1.0, version: int = 0, seed: int = 0) -> Interaction:
    """Sample ``max_new_tokens`` tokens and log each one's log-prob under the
    temperature-scaled distribution it was drawn from."""
    generator = torch.Generator().manual_seed(seed)
    ids, logprobs = list(prompt_ids), []
    for _ in range(max_new_tokens):
        logits = policy(input_ids=torch.tensor([ids])).logits[0, -1].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
        ids.append(token)
        logprobs.append(min(float(logp[token]), 0.0))
    response = ids[len(prompt_ids):]
    return Interaction(interaction_id=interaction_id, model="online-sao", prompt_ids=list(prompt_ids),
                       response_ids=response, action_mask=[True] * len(response), logprobs=logprobs,
                       versions=[version] * len(response),
                       sampling=SamplingParams(temperature=temperature, max_tokens=max_new_tokens))


def reward_of(interaction: Interaction) -> float:
    """Share of even token ids in the response: any learnable rule will do."""
    return sum(t % 2 == 0 for t in interaction.response_ids) / max(len(interaction.response_ids), 1)


def sample_traffic(policy: nn.Module, count: int, prefix: str = "i", max_new_tokens: int = 6) -> list[Interaction]:
    return [sample_interaction(policy, PROMPTS[i % len(PROMPTS)], f"{prefix}-{i:05d}", max_new_tokens, seed=i)
            for i in range(count)]


def produce(producer: Producer, topics, interactions: list[Interaction], rewarded: bool = True,
            scores: Callable[[Interaction], dict[str, float]] | None = None) -> None:
    """Log each interaction, then (optionally) its reward, carrying ``scores(interaction)`` when
    given; flush."""
    for interaction in interactions:
        publish(producer, topics.interactions, interaction)
        if rewarded:
            publish(producer, topics.rewards, Reward(interaction_id=interaction.interaction_id,
                                                    value=reward_of(interaction), source="test",
                                                    scores=None if scores is None else scores(interaction)))
    producer.flush()


class FillBefore:
    """A learner's ``before_step`` hook that calls ``fill`` (a disk filling up, say) just before step
    ``step``; ``steps`` counts the steps begun."""

    def __init__(self, step: int, fill: Callable[[], None]):
        self.step, self.fill, self.steps = step, fill, 0

    def __call__(self, rollouts):
        self.steps += 1
        if self.steps == self.step:
            self.fill()
        return rollouts


def engine_interaction(engine, prompt_ids: list[int], interaction_id: str, max_new_tokens: int = 6,
                       seed: int = 0) -> Interaction:
    """An interaction sampled by a running serving engine (``TorchEngine``): tokens,
    behaviour log-probs and versions exactly as the engine reports them."""
    import asyncio

    from serving.engine.base import GenerationRequest

    sampling = SamplingParams(temperature=1.0, max_tokens=max_new_tokens, seed=seed)

    async def collect():
        return [e async for e in engine.generate(GenerationRequest(interaction_id, list(prompt_ids), sampling))]

    events = asyncio.run(collect())
    return Interaction(interaction_id=interaction_id, model="online-sao", prompt_ids=list(prompt_ids),
                       response_ids=[e.token_id for e in events], action_mask=[True] * len(events),
                       logprobs=[min(e.logprob, 0.0) for e in events], versions=[e.version for e in events],
                       sampling=sampling, finish_reason=events[-1].finish_reason)
