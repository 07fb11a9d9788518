"""Bad input, auth, rate limits, readiness and metrics: clear OpenAI-style errors, and the server keeps serving."""

from __future__ import annotations

import errno

import pytest

from tests.serving.fakes import FakeProducer
from tests.serving.conftest import wait_until

CHAT = "/v1/chat/completions"
GOOD = {"model": "online-sao", "messages": [{"role": "user", "content": "hi"}]}


def assert_openai_error(response, status: int, *, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize("body, status, param, code", [
    ({**GOOD, "model": "gpt-4"}, 404, "model", "model_not_found"),
    ({**GOOD, "max_tokens": 10_000}, 400, "max_tokens", "max_tokens_too_large"),
    ({**GOOD, "max_completion_tokens": 10_000}, 400, "max_completion_tokens", "max_tokens_too_large"),
    ({**GOOD, "n": 2}, 400, "n", None),
    ({**GOOD, "temperature": 0}, 400, "temperature", None),
    ({**GOOD, "temperature": 50}, 400, "temperature", "invalid_value"),
    ({**GOOD, "top_p": 0}, 400, "top_p", "invalid_value"),
    ({**GOOD, "messages": []}, 400, "messages", "invalid_value"),
    ({**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, 400, None, "invalid_value"),
    ({"messages": GOOD["messages"]}, 400, "model", "invalid_value"),
    ({**GOOD, "messages": [{"role": "user", "content": "word " * 2000}]}, 400, "messages", "prompt_too_long"),
])
def test_bad_chat_requests_get_clear_errors_and_nothing_is_generated(make_harness, body, status, param, code):
    h = make_harness()
    assert_openai_error(h.client.post(CHAT, json=body), status, param=param, code=code)
    assert h.engine.requests == []
    assert h.client.post(CHAT, json=GOOD).status_code == 200  # still serving
    assert len(h.interactions()) == 1


def test_a_body_nested_past_the_parsers_recursion_is_invalid_json(make_harness):
    """It was 500, which clients retry."""
    h = make_harness()
    deep = b'{"model": "online-sao", "messages": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    for route in (CHAT, "/v1/feedback"):
        assert_openai_error(h.client.post(route, content=deep, headers={"content-type": "application/json"}),
                            400, code="invalid_json")
    assert h.engine.requests == []


def test_malformed_json_and_oversize_bodies(make_harness):
    h = make_harness(**{"serving.max_request_bytes": 4096})
    error = assert_openai_error(h.client.post(CHAT, content=b'{"model": "online-sao", "messages": [',
                                              headers={"content-type": "application/json"}), 400, code="invalid_json")
    assert "not valid JSON" in error["message"]
    assert_openai_error(h.client.post(CHAT, content=b"\xff\xfe", headers={"content-type": "application/json"}),
                        400, code="invalid_json")
    assert_openai_error(h.client.post(CHAT, json=[1, 2]), 400)
    big = {**GOOD, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_openai_error(h.client.post(CHAT, json=big), 413, code="request_too_large")

    def chunked():  # no Content-Length: the limit applies while the body is read
        yield b'{"model": "online-sao", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    assert_openai_error(h.client.post(CHAT, content=chunked(), headers={"content-type": "application/json"}),
                        413, code="request_too_large")
    assert h.client.post(CHAT, json=GOOD).status_code == 200


def test_completion_prompt_errors(make_harness):
    h = make_harness()
    assert_openai_error(h.client.post("/v1/completions", json={"model": "online-sao", "prompt": ["a", "b"]}),
                        400, param="prompt")
    assert_openai_error(h.client.post("/v1/completions", json={"model": "online-sao", "prompt": ""}), 400)
    empty = assert_openai_error(h.client.post("/v1/completions", json={"model": "online-sao", "prompt": []}),
                                400, param="prompt")
    assert empty["message"] == "the prompt is empty"  # was "only one prompt per request is supported"
    assert_openai_error(h.client.post("/v1/completions", json={"model": "online-sao", "prompt": [1] * 1100}),
                        400, param="prompt", code="prompt_too_long")
    assert_openai_error(h.client.post("/v1/completions", json={"model": "online-sao", "prompt": [1] * 600}),
                        400, param="prompt", code="context_length_exceeded")  # the (fake) model has 512 positions


def test_prompt_plus_max_tokens_beyond_the_context_is_refused(make_harness):
    h = make_harness(**{"serving.max_prompt_tokens": 500})
    r = h.client.post("/v1/completions", json={"model": "online-sao", "prompt": [5] * 450, "max_tokens": 100})
    assert_openai_error(r, 400, param="max_tokens", code="context_length_exceeded")
    r = h.client.post("/v1/completions", json={"model": "online-sao", "prompt": [5] * 450, "max_tokens": 60})
    assert r.status_code == 200


def test_unknown_routes_and_methods_answer_in_the_same_shape(make_harness):
    h = make_harness()
    assert_openai_error(h.client.get("/v1/nothing"), 404)
    assert_openai_error(h.client.get(CHAT), 405)


def test_engine_failures_are_500_with_a_body_and_the_server_stays_up(make_harness):
    h = make_harness()
    h.engine.fail_with = RuntimeError("CUDA fell over")
    error = assert_openai_error(h.client.post(CHAT, json=GOOD), 500)
    assert "CUDA fell over" in error["message"] and error["type"] == "server_error"
    # before the first token nothing has gone out: a stream gets the same status and body
    error = assert_openai_error(h.client.post(CHAT, json={**GOOD, "stream": True}), 500)
    assert "CUDA fell over" in error["message"] and error["type"] == "server_error"
    h.engine.fail_with = None
    h.engine.fail_after = (2, RuntimeError("CUDA fell over mid-answer"))
    with h.client.stream("POST", CHAT, json={**GOOD, "stream": True}) as r:
        assert r.status_code == 200  # the stream began: the error is its last event
        lines = [line for line in r.iter_lines() if line]
    assert '"error"' in lines[-1] and "CUDA fell over mid-answer" in lines[-1] and "[DONE]" not in lines[-1]
    h.engine.fail_after = None
    assert h.client.post(CHAT, json=GOOD).status_code == 200
    assert len(h.interactions()) == 1  # failed requests logged nothing


def test_api_keys_and_rate_limits(make_harness):
    h = make_harness(**{"serving.api_keys": ["sk-good"], "serving.rate_limit_burst": 3,  # 3 failures from one address
                        "serving.rate_limit_per_minute": 1})
    assert_openai_error(h.client.post(CHAT, json=GOOD), 401, code="missing_api_key")
    assert_openai_error(h.client.post(CHAT, json=GOOD, headers={"Authorization": "Bearer sk-bad"}), 401,
                        code="invalid_api_key")
    assert_openai_error(h.client.get("/v1/models"), 401)
    auth = {"Authorization": "Bearer sk-good"}
    assert h.client.post(CHAT, json=GOOD, headers=auth).status_code == 200
    assert h.client.get("/v1/models", headers=auth).status_code == 200
    assert h.client.get("/v1/models", headers=auth).status_code == 200  # the failures took none of the key's tokens
    r = h.client.post(CHAT, json=GOOD, headers=auth)
    assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert int(r.headers["Retry-After"]) >= 1
    assert h.client.get("/healthz").status_code == 200  # probes need no key


def test_an_unexpected_exception_is_a_500_the_request_counter_counts(make_harness, monkeypatch):
    """Starlette's ServerErrorMiddleware answers it outside every middleware the app adds: the 500
    went out uncounted, and an alert on the 5xx share saw a replica failing every request as idle."""
    from serving.ids import InteractionIdSigner

    h = make_harness()

    def bug(self, interaction_id):
        raise RuntimeError("a bug (test)")

    monkeypatch.setattr(InteractionIdSigner, "verify", bug)
    assert h.client.post("/v1/feedback", json={"interaction_id": "x", "reward": 1.0}).status_code == 500
    assert 'sao_serving_requests_total{route="/v1/feedback",status="500"} 1.0' in h.client.get("/metrics").text


def test_models_readyz_and_metrics(make_harness):
    h = make_harness()
    h.engine.version = 4
    models = h.client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["policy_version"]) for m in models["data"]] == [("online-sao", 4)]
    assert h.client.get("/healthz").json() == {"status": "ok"}
    ready = h.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["policy_version"] == 4
    h.client.post(CHAT, json=GOOD)
    h.client.post(CHAT, json={**GOOD, "model": "nope"})
    assert h.client.get("/v1/models/online-sao").status_code == 200
    assert h.client.get("/v1/models/nope").status_code == 404
    assert h.client.get("/v1/models/Qwen/Qwen2.5-0.5B-Instruct").status_code == 404  # names hold slashes
    assert h.client.get("/v2/models").status_code == 404
    h.interactions()
    text = h.client.get("/metrics").text
    # a model card under its route's template whatever the name (never the name: one series per name sent)
    assert 'sao_serving_requests_total{route="/v1/models/{model}",status="200"} 1.0' in text
    assert 'sao_serving_requests_total{route="/v1/models/{model}",status="404"} 2.0' in text
    assert 'sao_serving_requests_total{route="other",status="404"} 1.0' in text
    assert "nope" not in text and "Qwen" not in text
    assert 'sao_serving_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'sao_serving_requests_total{route="/v1/chat/completions",status="404"} 1.0' in text
    assert f"sao_serving_completion_tokens_total {float(len(h.engine.script))}" in text
    assert "sao_serving_policy_version 4.0" in text
    # the latency metrics label a route by its path, as the request counter does
    assert 'sao_serving_request_latency_seconds_count{route="/v1/chat/completions"} 1.0' in text
    assert 'sao_serving_time_to_first_token_seconds_count{route="/v1/chat/completions"} 1.0' in text
    for gauge in ("sao_serving_log_queue_depth", "sao_serving_spool_bytes", "sao_serving_spool_records"):
        assert f"{gauge} 0.0" in text


def no_space(fd):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("full", ["quota", "disk"])
@pytest.mark.parametrize("durability", ["write_ahead", "memory"])
def test_a_full_spool_during_an_outage_answers_503_with_the_reason_and_stays_up(make_harness, monkeypatch, full,
                                                                               durability):
    producer = FakeProducer()
    record_bytes = 1600  # one spooled interaction of this app is about this large
    h = make_harness(producer=producer, spool_max_bytes=record_bytes * (2 if durability == "write_ahead" else 1),
                     **{"serving.log_stall_s": 0.1, "serving.log_retry_s": 0.05,
                        "serving.log_durability": durability, "serving.log_ack_timeout_s": 1.0})
    if full == "disk":
        monkeypatch.setattr("serving.spool.os.fsync", no_space)
    producer.go_down()
    statuses = [h.client.post(CHAT, json=GOOD).status_code for _ in range(3)]
    if durability == "memory":  # acknowledged before it is durable: admitted work is answered, never dropped
        expected = [200, 200, 200]
    else:  # acknowledged once on disk: what fits is answered, then 503 (the record stays held for the broker)
        expected = [200, 200, 503] if full == "quota" else [503, 503, 503]
    assert statuses == expected
    assert wait_until(lambda: h.logger.refusal() is not None)
    r = h.client.post(CHAT, json=GOOD)
    error = assert_openai_error(r, 503, code="logging_unavailable")
    assert "spool" in error["message"] and r.headers["Retry-After"]
    ready = h.client.get("/readyz")
    assert ready.status_code == 503 and "spool" in ready.json()["reason"]
    assert h.client.get("/healthz").status_code == 200
    producer.come_back()
    assert h.logger.flush(10.0)
    assert h.client.post(CHAT, json=GOOD).status_code == 200
    assert h.logger.flush(10.0)
    held_then_delivered = 1 if durability == "write_ahead" else 0  # the first 503 of write-ahead
    assert len(producer.delivered) == statuses.count(200) + held_then_delivered + 1


@pytest.mark.parametrize("ids", [[99999], [-1]])
def test_input_the_engine_refuses_is_a_400(make_harness, ids):
    """[-1]: the decoder read the prompt's ids (its context) before the engine refused them, and the
    tokenizer's OverflowError was a 500 (found by fuzzing)."""
    h = make_harness()
    h.engine.fail_with = ValueError(f"token ids {ids} are outside the vocabulary of 400")
    error = assert_openai_error(h.client.post("/v1/completions", json={"model": "online-sao", "prompt": ids}),
                                400)
    assert "outside the vocabulary" in error["message"]


@pytest.mark.parametrize("path, body, field, param", [
    (CHAT, GOOD, "temperature", "temperature"),
    (CHAT, GOOD, "seed", "seed"),
    (CHAT, GOOD, "top_logprobs", "top_logprobs"),
    ("/v1/completions", {"model": "online-sao", "prompt": "hi"}, "top_logprobs", "logprobs"),
    ("/v1/completions", {"model": "online-sao", "prompt": "hi"}, "prompt_ids", "prompt"),
    (CHAT, GOOD, "prompt_ids", "messages"),
    (CHAT, GOOD, None, None),
], ids=["temperature", "seed", "chat-top-logprobs", "completions-logprobs", "completions-prompt", "chat-prompt",
        "no-field"])
def test_an_engine_refusal_names_the_parameter_it_refuses(make_harness, path, body, field, param):
    """The vLLM engine refuses a temperature it cannot sample: the 400 named the prompt."""
    from serving.engine.base import RequestRefused

    h = make_harness()
    h.engine.fail_with = RequestRefused("the engine cannot serve this", field)
    error = assert_openai_error(h.client.post(path, json=body), 400, code="invalid_value")
    assert error["param"] == param and "cannot serve this" in error["message"]
