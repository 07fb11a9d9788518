"""Chat and text completions through the real app over a fake engine: answers, streams, records."""

from __future__ import annotations

import json

import pytest

from tests.serving.conftest import ANSWER

CHAT = "/v1/chat/completions"


def chat_body(**extra) -> dict:
    return {"model": "online-sao", "messages": [{"role": "user", "content": "Tell me about tea."}], **extra}


def sse_payloads(response) -> list:
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    return [line[len("data: "):] for line in lines]


def test_chat_answers_with_id_header_versions_and_usage(make_harness):
    h = make_harness()
    h.engine.version = 7
    r = h.client.post(CHAT, json=chat_body(temperature=0.7, top_p=0.9, seed=3, user="u-1"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["interaction_id"] == r.headers["X-Interaction-Id"] == body["id"]
    assert (body["policy_version"], body["policy_versions"]) == (7, [7])
    prompt = h.engine.requests[0].prompt_ids
    assert h.tokenizer.decode(prompt) == "<|im_start|>user\nTell me about tea.<|im_end|>\n<|im_start|>assistant\n"
    sampled = len(h.engine.script)
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": sampled,
                             "total_tokens": len(prompt) + sampled}
    sampling = h.engine.requests[0].sampling
    assert (sampling.temperature, sampling.top_p, sampling.seed) == (0.7, 0.9, 3)


def test_the_interaction_record_holds_the_exact_trajectory(make_harness):
    h = make_harness()
    r = h.client.post(CHAT, json=chat_body(temperature=0.5, user="u-9", session_id="s-1"))
    [record] = h.interactions()
    n = len(h.engine.script)
    assert record.interaction_id == r.json()["interaction_id"]
    assert record.prompt_ids == h.engine.requests[0].prompt_ids
    assert record.response_ids == h.engine.script  # the stop token is an action too
    assert record.action_mask == [True] * n and record.turn_ends == [n - 1]
    assert record.logprobs == [-0.1 * (i + 1) for i in range(n)]
    assert record.versions == [0] * n
    assert record.sampling.temperature == 0.5 and record.finish_reason == "stop"
    assert (record.user_id, record.session_id, record.parent_id) == ("u-9", "s-1", None)
    assert record.response_text == ANSWER + "<|im_end|>"
    assert record.prompt_text.startswith("<|im_start|>user\nTell me about tea.")


def test_redaction_drops_texts_but_keeps_tokens(make_harness):
    h = make_harness(**{"serving.redact_text": True})
    h.client.post(CHAT, json=chat_body())
    [record] = h.interactions()
    assert record.prompt_text is None and record.response_text is None and record.response_ids


def test_streamed_chat_adds_up_to_the_answer_and_ends_with_done(make_harness):
    h = make_harness()
    h.engine.version = 2
    with h.client.stream("POST", CHAT, json=chat_body(stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(r)
        header_id = r.headers["X-Interaction-Id"]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == ANSWER
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) > 2
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "stop"
    assert (final[0]["policy_version"], final[0]["policy_versions"]) == (2, [2])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(h.engine.script)
    assert {c["interaction_id"] for c in chunks} == {header_id}
    [record] = h.interactions()
    assert record.interaction_id == header_id


def test_stop_strings_cut_text_and_generation(make_harness):
    h = make_harness(script_text="one two three four five six")
    r = h.client.post(CHAT, json=chat_body(stop=[" four", "zzz"]))
    assert r.json()["choices"][0]["message"]["content"] == "one two three"
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    [record] = h.interactions()
    assert len(record.response_ids) < len(h.engine.script)  # generation stopped early
    assert h.tokenizer.decode(record.response_ids).startswith("one two three four")
    with h.client.stream("POST", CHAT, json=chat_body(stop=" four", stream=True)) as r:
        chunks = [json.loads(p) for p in sse_payloads(r)[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "one two three"


def test_max_tokens_ends_with_length(make_harness):
    h = make_harness()
    r = h.client.post(CHAT, json=chat_body(max_tokens=3))
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 3
    assert h.engine.requests[0].sampling.max_tokens == 3


@pytest.mark.parametrize("fields", [{}, {"max_tokens": None}], ids=["absent", "null"])
def test_text_completions_default_to_16_tokens_absent_or_null(make_harness, fields):
    """null took the server's own limit (serving.max_new_tokens) instead of OpenAI's default."""
    h = make_harness()
    r = h.client.post("/v1/completions", json={"model": "online-sao", "prompt": "Once upon", **fields})
    assert r.status_code == 200 and h.engine.requests[0].sampling.max_tokens == 16


def test_the_completions_default_stays_within_the_servers_limit_and_the_context(make_harness):
    """The default of 16 was checked as if the client had sent it: below it, serving.max_new_tokens or the room
    the context leaves refused a request without max_tokens, naming a max_tokens of 16 it never sent."""
    h = make_harness(**{"serving.max_new_tokens": 8})
    r = h.client.post("/v1/completions", json={"model": "online-sao", "prompt": "Once upon"})
    assert r.status_code == 200, r.text
    assert h.engine.requests[-1].sampling.max_tokens == 8
    r = h.client.post("/v1/completions", json={"model": "online-sao", "prompt": "Once upon", "max_tokens": 16})
    assert r.status_code == 400 and r.json()["error"]["code"] == "max_tokens_too_large"  # as sent: checked
    h = make_harness()
    r = h.client.post("/v1/completions", json={"model": "online-sao", "prompt": [5] * 505})  # 7 of 512 left
    assert r.status_code == 200, r.text
    assert h.engine.requests[-1].sampling.max_tokens == 7


def test_text_completions_plain_streamed_and_from_token_ids(make_harness):
    h = make_harness()
    r = h.client.post("/v1/completions", json={"model": "online-sao", "prompt": "Once upon", "max_tokens": 50})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == ANSWER and body["interaction_id"] == r.headers["X-Interaction-Id"]
    assert h.engine.requests[0].prompt_ids == h.tokenizer("Once upon", add_special_tokens=False)["input_ids"]
    with h.client.stream("POST", "/v1/completions",
                         json={"model": "online-sao", "prompt": ["Once upon"], "stream": True}) as r:
        payloads = sse_payloads(r)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed and ANSWER.startswith(streamed)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # default max_tokens is 16
    r = h.client.post("/v1/completions", json={"model": "online-sao", "prompt": [5, 6, 7]})
    assert r.status_code == 200 and h.engine.requests[-1].prompt_ids == [5, 6, 7]
    assert len(h.interactions()) == 3


def test_a_client_that_disconnects_mid_stream_still_gets_its_tokens_logged(make_harness):
    h = make_harness(delay_s=0.01)
    with h.client.stream("POST", CHAT, json=chat_body(stream=True)) as r:
        lines = r.iter_lines()
        for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                break  # leave after the first piece of text
    records = h.interactions()
    assert len(records) == 1
    assert records[0].finish_reason == "abort"
    assert 0 < len(records[0].response_ids) < len(h.engine.script)
    assert h.engine.open_streams == 0  # the engine was told to stop


def test_concurrent_streams_each_get_their_own_id_and_record(make_harness):
    from concurrent.futures import ThreadPoolExecutor

    h = make_harness(delay_s=0.002)

    def one(i: int) -> tuple[str, str]:
        with h.client.stream("POST", CHAT, json=chat_body(stream=True, seed=i)) as r:
            chunks = [json.loads(p) for p in sse_payloads(r)[:-1]]
            return r.headers["X-Interaction-Id"], "".join(c["choices"][0]["delta"].get("content") or ""
                                                         for c in chunks)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(16)))
    assert all(text == ANSWER for _, text in answers)
    ids = [i for i, _ in answers]
    assert len(set(ids)) == 16
    assert sorted(r.interaction_id for r in h.interactions()) == sorted(ids)
