"""The canary engine: the champion answers its share of trajectories once loaded; everything else goes to the newest."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from online_sao.batch import Rollout
from online_sao.schemas import SamplingParams, decode
from serving.app import build_app
from serving.engine.base import GenerationRequest
from serving.engine.canary import DEFAULT_SEED, CanaryEngine, ChampionServing, canary_draw
from serving.interaction_log import InteractionLogger, LogSettings
from serving.metrics import ServingMetrics
from streams.memory import InMemoryBackend
from tests.serving.conftest import ANSWER, serving_config
from tests.serving.fakes import FakeEngine
from trainer.deploy import RecentWindow


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


SD_4000 = (0.25 * 0.75 / 4000) ** 0.5
"""The binomial standard deviation of the share of 4000 draws at 0.25 (0.0068): the tests below
allow four of them (a chance of 6e-5 of failing for a fair draw; the draws are fixed by the seed)."""


def test_the_champion_answers_the_draws_under_its_share():
    newest, champion = FakeEngine([5, 6]), FakeEngine([5, 6])
    engine = CanaryEngine(newest, champion, share=0.25, seed=7)
    engine.swap_weights(9, {})
    result = engine.swap_champion(4, {})
    assert result.applied and engine.champion_version == 4 and engine.policy_version == 9
    versions = asyncio.run(answer_all(engine, 4000))
    # request i (a trajectory of its own) goes to the champion when the draw of its id is under 0.25
    expected = [4 if canary_draw(f"r{i}", 7) < 0.25 else 9 for i in range(4000)]
    assert versions == expected
    assert engine.routed["champion"] == expected.count(4) == len(champion.requests)
    assert abs(expected.count(4) / 4000 - 0.25) <= 4 * SD_4000  # single-turn traffic: the share, as before


def test_the_draw_is_fixed_by_the_trajectory_and_the_seed():
    ids = [f"sao-{i}" for i in range(2000)]
    assert [canary_draw(t, 3) for t in ids] == [canary_draw(t, 3) for t in ids]  # a restart, another replica
    assert [canary_draw(t) for t in ids] == [canary_draw(t, DEFAULT_SEED) for t in ids]
    assert sum(canary_draw(t, 3) < 0.25 for t in ids) != sum(canary_draw(t, 4) < 0.25 for t in ids)
    assert all(0 <= canary_draw(t, 3) < 1 for t in ids)


async def turn(engine: CanaryEngine, request_id: str, trajectory_id: str | None,
               previous_version: int | None = None) -> list[int]:
    request = GenerationRequest(request_id, [1, 2], SamplingParams(max_tokens=2), trajectory_id=trajectory_id,
                                previous_version=previous_version)
    return [event.version async for event in engine.generate(request)]


def test_every_turn_of_a_trajectory_goes_to_the_engine_of_its_first_turn():
    """4000 two-turn trajectories at 0.25: each answered wholly by one engine, a quarter of them by the
    champion, so the gate counts a quarter as the champion's own (drawn per request: 0.25 ** 2)."""
    engine = CanaryEngine(FakeEngine([5, 6]), FakeEngine([5, 6]), share=0.25, seed=1)
    engine.swap_weights(9, {})
    engine.swap_champion(4, {})
    window = RecentWindow(size=4000)

    async def trajectories() -> list[set[int]]:
        versions_of = []
        for i in range(4000):
            first = await turn(engine, f"t{i}.0", None)
            second = await turn(engine, f"t{i}.1", f"t{i}.0")  # a continuation names its first turn
            versions = [0, 0] + first + [0, 0] + second  # observation tokens between the turns
            window.observe([Rollout(f"t{i}", list(range(len(versions))), [v != 0 for v in versions],
                                    [0.0] * len(versions), versions, {})])
            versions_of.append(set(first + second))
        return versions_of

    versions_of = asyncio.run(trajectories())
    assert all(len(versions) == 1 for versions in versions_of)  # no trajectory mixes the engines
    on_champion = sum(versions == {4} for versions in versions_of) / 4000
    assert abs(on_champion - 0.25) <= 4 * SD_4000
    assert len(window.canary(4)) == on_champion * 4000
    assert engine.routed["champion"] == 2 * on_champion * 4000


def test_a_continuation_follows_its_trajectory_through_a_new_champion_but_not_through_a_hold():
    engine = CanaryEngine(FakeEngine([5]), FakeEngine([5]), share=0.25, seed=2)
    engine.swap_weights(9, {})
    engine.swap_champion(4, {})
    champion_trajectory = next(f"t{i}" for i in range(100) if canary_draw(f"t{i}", 2) < 0.25)
    newest_trajectory = next(f"t{i}" for i in range(100) if canary_draw(f"t{i}", 2) >= 0.25)
    assert asyncio.run(turn(engine, champion_trajectory, None)) == [4]
    assert asyncio.run(turn(engine, newest_trajectory, None)) == [9]
    engine.swap_champion(6, {})  # a promotion between two turns: the champion's engine answers on
    assert asyncio.run(turn(engine, "next-1", champion_trajectory)) == [6]
    assert asyncio.run(turn(engine, "next-2", newest_trajectory)) == [9]
    engine.hold_all_on_newest(True)  # a hold: one version answers everything
    assert asyncio.run(turn(engine, "next-3", champion_trajectory)) == [9]


def test_a_trajectory_begun_before_the_first_champion_or_during_a_hold_stays_on_the_newest_engine():
    engine = CanaryEngine(FakeEngine([5]), FakeEngine([5]), share=0.5, seed=0)
    engine.swap_weights(9, {})
    drawn = [f"t{i}" for i in range(100) if canary_draw(f"t{i}", 0) < 0.5][:3]  # trajectories the champion draws
    before, held, fresh = drawn

    assert asyncio.run(turn(engine, before, None)) == [9]  # no champion yet
    engine.swap_champion(4, {})
    assert asyncio.run(turn(engine, f"{before}.1", before, previous_version=9)) == [9]  # not moved to the champion
    engine.hold_all_on_newest(True)
    assert asyncio.run(turn(engine, held, None)) == [9]
    engine.hold_all_on_newest(False)
    assert asyncio.run(turn(engine, f"{held}.1", held, previous_version=9)) == [9]
    assert asyncio.run(turn(engine, fresh, None)) == [4]  # the canary routes new trajectories as before
    assert asyncio.run(turn(engine, f"{fresh}.1", fresh, previous_version=4)) == [4]
    engine.swap_weights(10, {})  # the newest engine moved on between two turns: the draw decides (docs)
    assert asyncio.run(turn(engine, f"{before}.2", before, previous_version=9)) == [4]
    assert engine.routed == {"newest": 4, "champion": 3}


def test_the_server_routes_a_conversation_by_its_first_turn(tmp_path, chat_tokenizer):
    """Over the real app: each continuation (``parent_interaction_id``) is answered by the engine that
    answered its trajectory's first turn, so every record's turns carry one version."""
    cfg = serving_config(tmp_path, **{"serving.rate_limit_per_minute": 100_000, "serving.rate_limit_burst": 1_000})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    script = list(chat_tokenizer(ANSWER, add_special_tokens=False)["input_ids"]) + [chat_tokenizer.eos_token_id]
    engine = CanaryEngine(FakeEngine(script), FakeEngine(script), share=0.5, seed=5)
    engine.swap_weights(9, {})
    engine.swap_champion(4, {})
    logger = InteractionLogger(backend.producer(), cfg.kafka.topics, cfg.spool_dir,
                               LogSettings.from_config(cfg.serving))
    app = build_app(engine, logger, cfg, chat_tokenizer, ServingMetrics(CollectorRegistry()), max_model_len=512)
    last_turns = []
    with TestClient(app, raise_server_exceptions=False) as client:
        for i in range(24):
            messages, parent = [{"role": "user", "content": f"q{i}"}], {}
            for t in range(3):
                r = client.post("/v1/chat/completions", json={"model": "online-sao", "messages": messages, **parent})
                assert r.status_code == 200, r.text
                parent = {"parent_interaction_id": r.json()["interaction_id"]}
                messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": f"more {t}"}]
            last_turns.append(parent["parent_interaction_id"])
        assert logger.flush(10.0)
    consumer = backend.consumer([cfg.kafka.topics.interactions])
    records = {r.interaction_id: r for r in map(decode, (m.value for m in consumer.poll(0.1, max_records=10_000)))}
    consumer.close()
    versions = [set(records[last].versions) for last in last_turns]
    assert all(len(records[last].turn_ends) == 3 for last in last_turns)
    assert all(len(v) == 1 for v in versions)  # three turns, one engine
    assert {4} in versions and {9} in versions  # 24 trajectories at one half: both engines (p 1 - 2^-23)
    assert engine.routed["champion"] == 3 * versions.count({4})


def test_the_server_keeps_a_conversation_begun_before_the_first_champion_on_the_newest_engine(tmp_path,
                                                                                              chat_tokenizer):
    """Over the real app: a continuation carries the version of its previous turn, so conversations whose
    first turn came before the champion are answered wholly by the newest engine, whatever their draw."""
    cfg = serving_config(tmp_path, **{"serving.rate_limit_per_minute": 100_000, "serving.rate_limit_burst": 1_000})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    script = list(chat_tokenizer(ANSWER, add_special_tokens=False)["input_ids"]) + [chat_tokenizer.eos_token_id]
    engine = CanaryEngine(FakeEngine(script), FakeEngine(script), share=0.5, seed=5)
    engine.swap_weights(9, {})
    logger = InteractionLogger(backend.producer(), cfg.kafka.topics, cfg.spool_dir,
                               LogSettings.from_config(cfg.serving))
    app = build_app(engine, logger, cfg, chat_tokenizer, ServingMetrics(CollectorRegistry()), max_model_len=512)
    second_turns = []
    with TestClient(app, raise_server_exceptions=False) as client:
        firsts = []
        for i in range(24):
            messages = [{"role": "user", "content": f"q{i}"}]
            r = client.post("/v1/chat/completions", json={"model": "online-sao", "messages": messages})
            assert r.status_code == 200, r.text
            firsts.append((messages + [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "more"}],
                           r.json()["interaction_id"]))
        engine.swap_champion(4, {})  # the first champion notice, between the turns
        for messages, parent in firsts:
            r = client.post("/v1/chat/completions", json={"model": "online-sao", "messages": messages,
                                                         "parent_interaction_id": parent})
            assert r.status_code == 200, r.text
            second_turns.append(r.json()["interaction_id"])
        assert logger.flush(10.0)
    consumer = backend.consumer([cfg.kafka.topics.interactions])
    records = {r.interaction_id: r for r in map(decode, (m.value for m in consumer.poll(0.1, max_records=10_000)))}
    consumer.close()
    assert all(len(records[i].turn_ends) == 2 and set(records[i].versions) == {9} for i in second_turns)
    assert engine.routed["champion"] == 0


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
