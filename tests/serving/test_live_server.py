"""The real server (uvicorn, TorchEngine on the tiny model, Kafka) driven by the official openai client."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from online_sao.schemas import Interaction, Reward
from serving.ids import InteractionIdSigner

pytestmark = pytest.mark.kafka
MODEL = "online-sao"


def test_openai_client_plain_and_streaming_then_records_on_the_broker(live_server):
    client = live_server.openai()
    messages = [{"role": "user", "content": "Tell me about rivers."}]

    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=12,
                                                           temperature=0.8, top_p=0.95, seed=1)
    chat = raw.parse()
    assert chat.interaction_id == raw.headers["x-interaction-id"] == chat.id
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.policy_version == 0 and chat.policy_versions == [0]
    assert 0 < chat.usage.completion_tokens <= 12

    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0.8,
                                           top_p=0.95, seed=1)
    assert again.choices[0].message.content == chat.choices[0].message.content  # seeded
    assert again.interaction_id != chat.interaction_id

    pieces, stream_ids = [], set()
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, stream=True,
                                                temperature=0.9):
        stream_ids.add(chunk.interaction_id)
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    [streamed_id] = stream_ids

    text = client.completions.create(model=MODEL, prompt="The river", max_tokens=10, temperature=1.0)
    assert text.choices[0].text is not None and text.interaction_id
    completion_pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The sea", max_tokens=10, stream=True) if c.choices]
    assert completion_pieces

    reply = httpx.post(f"{live_server.base_url}/v1/feedback",
                       json={"interaction_id": streamed_id, "reward": 0.5, "source": "test"}, timeout=10)
    assert reply.status_code == 200

    topics = live_server.cfg.kafka.topics
    records = live_server.read(topics.interactions, count=5)
    assert all(isinstance(r, Interaction) for r in records)
    by_id = {r.interaction_id: r for r in records}
    assert len(records) == len(by_id) == 5
    logged = by_id[chat.interaction_id]
    assert len(logged.response_ids) == chat.usage.completion_tokens
    assert logged.prompt_ids and all(logged.action_mask) and logged.turn_ends == [len(logged.response_ids) - 1]
    assert all(lp <= 0 for lp in logged.logprobs) and set(logged.versions) == {0}
    assert logged.sampling.temperature == 0.8 and logged.sampling.seed == 1
    # the stream carries text only: special tokens (which a sampling model may emit mid-reply) and the
    # stop token are logged as ids and in response_text, never streamed as content
    streamed = by_id[streamed_id]
    tokenizer = live_server.stack.tokenizer
    text_ids = [t for t in streamed.response_ids if t not in tokenizer.all_special_ids]
    assert "".join(pieces) == tokenizer.decode(text_ids, clean_up_tokenization_spaces=False)
    assert streamed.response_text == tokenizer.decode(streamed.response_ids, skip_special_tokens=False)
    [reward] = live_server.read(topics.rewards, count=1)
    assert isinstance(reward, Reward) and (reward.interaction_id, reward.value) == (streamed_id, 0.5)


def test_bad_input_gets_openai_style_errors_and_the_server_keeps_serving(live_server):
    client = live_server.openai()
    url = live_server.base_url
    good = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=good)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=good, max_tokens=100_000)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:  # as OpenAI answers a prompt over the context
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w " * 3000}])
    assert err.value.body["code"] in ("prompt_too_long", "context_length_exceeded")
    r = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{url}/v1/chat/completions", content=b"x" * 2_000_000)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    ok = client.chat.completions.create(model=MODEL, messages=good, max_tokens=4)
    secret = live_server.cfg.serving.feedback_secret.get_secret_value().encode()
    window = live_server.cfg.reward.window_s
    expired = InteractionIdSigner(secret, "local", window, clock=lambda: time.time() - window - 1).mint()
    forged = ok.interaction_id[:-4] + ("0000" if not ok.interaction_id.endswith("0000") else "1111")
    for body, status in (({"interaction_id": forged, "reward": 1.0}, 403),
                         ({"interaction_id": expired, "reward": 1.0}, 410),
                         ({"interaction_id": ok.interaction_id, "reward": 99.0}, 422)):
        r = httpx.post(f"{url}/v1/feedback", json=body)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
    accepted = httpx.post(f"{url}/v1/feedback", json={"interaction_id": ok.interaction_id, "reward": 1.0})
    assert accepted.status_code == 200
    after = client.chat.completions.create(model=MODEL, messages=good, max_tokens=4)
    assert after.choices[0].finish_reason in ("stop", "length")
    topics = live_server.cfg.kafka.topics
    assert [r.interaction_id for r in live_server.read(topics.rewards, count=1)] == [ok.interaction_id]
    assert {r.interaction_id for r in live_server.read(topics.interactions, count=2)} == \
           {ok.interaction_id, after.interaction_id}


def test_a_multi_turn_conversation_is_one_trajectory_on_the_broker(live_server):
    client = live_server.openai()
    messages = [{"role": "user", "content": "Name a fruit."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Another one?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                            extra_body={"parent_interaction_id": first.interaction_id})
    records = {r.interaction_id: r for r in live_server.read(live_server.cfg.kafka.topics.interactions, 2)}
    child = records[second.interaction_id]
    parent = records[first.interaction_id]
    assert child.parent_id == first.interaction_id and len(child.turn_ends) == 2
    assert child.response_ids[:len(parent.response_ids)] == parent.response_ids
    observation = child.action_mask[len(parent.response_ids):-second.usage.completion_tokens]
    assert observation and not any(observation)
    assert sum(child.action_mask) == first.usage.completion_tokens + second.usage.completion_tokens


def test_a_published_version_is_served_and_counted(live_server):
    from online_sao.modeling import load_policy
    from online_sao.schemas import WeightsNotice
    from online_sao.weights import open_weight_store
    from streams.kafka_backend import KafkaBackend
    from streams.records import publish

    engine = live_server.stack.engine
    base = load_policy(live_server.model_dir).state_dict()
    state = {k: v + 0.01 if v.is_floating_point() else v for k, v in base.items()}
    ref = open_weight_store(live_server.cfg.weight_store_url).save(1, state)
    producer = KafkaBackend(live_server.cfg.kafka).producer()
    publish(producer, live_server.cfg.kafka.topics.weights,
            WeightsNotice(version=1, location=ref.location, checksum=ref.checksum))
    producer.flush(10)
    producer.close()
    follower = live_server.stack.follower
    assert follower.wait_for(lambda: engine.policy_version == 1, timeout_s=30)
    models = httpx.get(f"{live_server.base_url}/v1/models").json()
    assert models["data"][0]["policy_version"] == 1
    reply = live_server.openai().chat.completions.create(model=MODEL, max_tokens=4,
                                                        messages=[{"role": "user", "content": "hi"}])
    assert reply.policy_versions == [1]
    metrics = httpx.get(f"{live_server.base_url}/metrics").text
    assert 'sao_serving_weight_swaps_total{outcome="applied"} 1.0' in metrics
    assert "sao_serving_policy_version 1.0" in metrics


def test_an_operators_hold_pins_serving_and_its_release_follows_the_learner_again(live_server, capsys):
    from apps import cli
    from online_sao.modeling import load_policy
    from online_sao.schemas import WeightsNotice
    from online_sao.weights import open_weight_store
    from streams.kafka_backend import KafkaBackend
    from streams.records import publish

    cfg, engine, follower = live_server.cfg, live_server.stack.engine, live_server.stack.follower
    store = open_weight_store(cfg.weight_store_url)
    base = load_policy(live_server.model_dir).state_dict()
    producer = KafkaBackend(cfg.kafka).producer()

    def learner_publishes(version: int) -> None:
        state = {k: v + 0.01 * version if v.is_floating_point() else v for k, v in base.items()}
        ref = store.save(version, state)
        publish(producer, cfg.kafka.topics.weights, WeightsNotice(version=version, location=ref.location,
                                                                  checksum=ref.checksum))
        producer.flush(10)

    def operator(*args: str) -> str:
        assert cli.main(["--set", f"paths.data_dir={cfg.paths.data_dir}",
                         "--set", f"kafka.bootstrap_servers={cfg.kafka.bootstrap_servers}",
                         "--set", f"kafka.topics.weights={cfg.kafka.topics.weights}", "weights", *args]) == 0
        return capsys.readouterr().out

    def answered_by() -> list[int]:
        return live_server.openai().chat.completions.create(
            model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}]).policy_versions

    def held_metric() -> str:
        text = httpx.get(f"{live_server.base_url}/metrics").text
        return next(line for line in text.splitlines() if line.startswith("sao_serving_weights_held_version "))

    try:
        learner_publishes(1)
        learner_publishes(2)
        assert follower.wait_for(lambda: engine.policy_version == 2, timeout_s=30)
        assert "held: every replica answers with v1" in operator("hold", "1", "--reason", "v2 answers rudely")
        assert follower.wait_for(lambda: engine.policy_version == 1, timeout_s=30)
        assert answered_by() == [1] and held_metric() == "sao_serving_weights_held_version 1.0"
        read = follower.consumed
        learner_publishes(3)  # the learner goes on; serving does not follow while held
        assert follower.wait_for(lambda: follower.consumed > read, timeout_s=30)
        assert engine.policy_version == 1 and answered_by() == [1]
        status = operator("status")
        assert "newest published: v3" in status and "hold: v1" in status and "v2 answers rudely" in status
        assert "released v1" in operator("release")
        assert follower.wait_for(lambda: engine.policy_version == 3, timeout_s=30)
        assert answered_by() == [3] and held_metric() == "sao_serving_weights_held_version -1.0"
    finally:
        producer.close()


def test_logprobs_from_the_torch_engine_equal_the_logged_behaviour_logprobs(live_server):
    client = live_server.openai()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me about rivers."}],
                                          max_tokens=12, temperature=0.8, top_p=0.9, logprobs=True, top_logprobs=4)
    streamed, ids = [], set()
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi."}],
                                                max_tokens=12, temperature=0.7, logprobs=True, top_logprobs=2,
                                                stream=True):
        ids.add(chunk.interaction_id)
        streamed += [t for c in chunk.choices if c.logprobs for t in c.logprobs.content]
    text = client.completions.create(model=MODEL, prompt="The river", max_tokens=10, top_p=0.8, logprobs=3)

    records = {r.interaction_id: r for r in live_server.read(live_server.cfg.kafka.topics.interactions, count=3)}
    answers = [(chat.interaction_id, chat.choices[0].logprobs.content, 4), (ids.pop(), streamed, 2)]
    for interaction_id, tokens, count in answers:
        assert [t.logprob for t in tokens] == records[interaction_id].logprobs
        for token in tokens:
            alternatives = [a.logprob for a in token.top_logprobs]
            assert 1 <= len(alternatives) <= count and alternatives == sorted(alternatives, reverse=True)
            assert token.logprob <= alternatives[0]  # the most likely token is listed first
    lp = text.choices[0].logprobs
    assert lp.token_logprobs == records[text.interaction_id].logprobs
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)


def test_a_canary_answers_its_share_with_the_champion(tmp_path, tiny_model_dir, kafka_config, one_torch_thread):
    """deploy.canary_share 0.5: after a publish of v2 and a champion notice for v1 on the real
    broker, answers come from both versions, each record says which, and /metrics shows the canary."""
    from online_sao.modeling import load_policy
    from online_sao.schemas import WeightsNotice
    from online_sao.weights import open_weight_store
    from serving.engine.canary import CanaryEngine
    from streams.kafka_backend import KafkaBackend
    from streams.records import publish
    from tests.fixtures.models import tiny_config
    from tests.serving.conftest import start_live_server

    base = tiny_config(tmp_path)
    cfg = base.model_copy(update={"kafka": kafka_config,
                                  "deploy": base.deploy.model_copy(update={"canary_share": 0.5})})
    live = start_live_server(cfg, tiny_model_dir)
    try:
        engine = live.stack.engine
        assert isinstance(engine, CanaryEngine)
        store = open_weight_store(cfg.weight_store_url)
        state = load_policy(tiny_model_dir).state_dict()
        refs = {v: store.save(v, {k: t + 0.01 * v if t.is_floating_point() else t for k, t in state.items()})
                for v in (1, 2)}
        producer = KafkaBackend(cfg.kafka).producer()
        for action, version in (("publish", 2), ("champion", 1)):
            publish(producer, cfg.kafka.topics.weights,
                    WeightsNotice(action=action, version=version, location=refs[version].location,
                                  checksum=refs[version].checksum))
        producer.flush(10)
        producer.close()
        assert live.stack.follower.wait_for(lambda: engine.policy_version == 2 and engine.champion_version == 1,
                                            timeout_s=30)
        client = live.openai()
        hi = [{"role": "user", "content": "hi"}]
        served = [client.chat.completions.create(model=MODEL, max_tokens=3, messages=hi).policy_versions
                  for _ in range(24)]
        assert set(map(tuple, served)) == {(1,), (2,)}  # each answer wholly from one engine
        assert served.count([1]) == engine.routed["champion"]  # 24 draws at one half: both appear (p 1 - 2^-23)
        metrics = httpx.get(f"{live.base_url}/metrics").text
        assert "sao_serving_canary_champion_version 1.0" in metrics and "sao_serving_policy_version 2.0" in metrics
        assert f"sao_serving_canary_requests {float(engine.routed['champion'])}" in metrics
    finally:
        live.stop()
