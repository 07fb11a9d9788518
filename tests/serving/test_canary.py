"""The canary engine: the champion answers its share once loaded; everything else goes to the newest."""

from __future__ import annotations

import asyncio
import random

import pytest

from online_sao.schemas import SamplingParams
from serving.engine.base import GenerationRequest
from serving.engine.canary import CanaryEngine, ChampionServing
from tests.serving.fakes import FakeEngine


def request(i: int) -> GenerationRequest:
    return GenerationRequest(f"r{i}", [1, 2], SamplingParams(max_tokens=2))


async def answer_all(engine: CanaryEngine, n: int) -> list[int]:
    """The version of each answer's first token."""
    versions = []
    for i in range(n):
        async for event in engine.generate(request(i)):
            versions.append(event.version)
            break
    return versions


def test_every_request_goes_to_the_newest_until_a_champion_is_loaded():
    newest, champion = FakeEngine([5, 6]), FakeEngine([5, 6])
    engine = CanaryEngine(newest, champion, share=0.5, seed=0)
    assert engine.champion_version is None and isinstance(engine, ChampionServing)
    engine.swap_weights(3, {})
    assert engine.policy_version == 3
    assert asyncio.run(answer_all(engine, 20)) == [3] * 20
    assert len(champion.requests) == 0 and engine.routed == {"newest": 20, "champion": 0}


def test_the_champion_answers_the_draws_under_its_share():
    newest, champion = FakeEngine([5, 6]), FakeEngine([5, 6])
    engine = CanaryEngine(newest, champion, share=0.25, seed=7)
    engine.swap_weights(9, {})
    result = engine.swap_champion(4, {})
    assert result.applied and engine.champion_version == 4 and engine.policy_version == 9
    versions = asyncio.run(answer_all(engine, 200))
    draws = random.Random(7)  # the same stream of draws: request i goes to the champion when its draw < 0.25
    expected = [4 if draws.random() < 0.25 else 9 for _ in range(200)]
    assert versions == expected
    assert engine.routed["champion"] == expected.count(4) == len(champion.requests)
    assert 30 <= expected.count(4) <= 70  # a quarter of 200, give or take


def test_a_newer_publish_leaves_the_champion_and_a_champion_may_be_older():
    newest, champion = FakeEngine([5]), FakeEngine([5])
    engine = CanaryEngine(newest, champion, share=0.1)
    engine.swap_champion(8, {})
    assert engine.swap_champion(2, {}).applied and engine.champion_version == 2  # a restart's champion: forced
    assert engine.swap_weights(10, {}).applied and engine.champion_version == 2 and champion.version == 2
    assert not engine.swap_weights(6, {}).applied and engine.policy_version == 10  # older publish: ignored


def test_an_operators_hold_sends_every_request_to_the_held_version_until_released():
    newest, champion = FakeEngine([5]), FakeEngine([5])
    engine = CanaryEngine(newest, champion, share=0.5, seed=3)
    engine.swap_weights(9, {})
    engine.swap_champion(4, {})
    engine.hold_all_on_newest(True)
    assert asyncio.run(answer_all(engine, 40)) == [9] * 40 and len(champion.requests) == 0
    assert engine.swap_champion(6, {}).applied and engine.champion_version == 6  # still follows its notices
    assert asyncio.run(answer_all(engine, 40)) == [9] * 40
    engine.hold_all_on_newest(False)
    versions = asyncio.run(answer_all(engine, 40))
    assert set(versions) == {6, 9} and engine.routed == {"newest": 80 + versions.count(9), "champion": versions.count(6)}


def test_start_and_stop_reach_both_engines():
    newest, champion = FakeEngine([5]), FakeEngine([5])
    engine = CanaryEngine(newest, champion, share=0.1)
    asyncio.run(engine.start())
    assert newest.started and champion.started
    asyncio.run(engine.stop())
    assert not newest.started and not champion.started


@pytest.mark.parametrize("share", [-0.1, 1.0])
def test_a_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ValueError, match="canary share"):
        CanaryEngine(FakeEngine([5]), FakeEngine([5]), share=share)
