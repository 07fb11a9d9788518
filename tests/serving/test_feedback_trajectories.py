"""Feedback validation and multi-turn / agent trajectories logged as one record."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from online_sao.config import ServingConfig
from serving.ids import InteractionIdSigner
from tests.serving.conftest import ANSWER
from tests.serving.test_app_errors import assert_openai_error

CHAT = "/v1/chat/completions"


def ask(h, messages, **extra):
    r = h.client.post(CHAT, json={"model": "online-sao", "messages": messages, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_feedback_is_logged_as_a_reward(make_harness):
    h = make_harness()
    iid = ask(h, [{"role": "user", "content": "hi"}])["interaction_id"]
    r = h.client.post("/v1/feedback", json={"interaction_id": iid, "reward": 0.75, "source": "thumbs",
                                            "turn_rewards": [{"turn": 0, "value": 1.0}]})
    assert r.status_code == 200 and r.json()["status"] == "accepted"
    [reward] = h.rewards()
    assert (reward.interaction_id, reward.value, reward.source) == (iid, 0.75, "thumbs")
    assert [(t.turn, t.value) for t in reward.turn_rewards] == [(0, 1.0)]
    assert reward.scores is None


def test_a_source_outside_the_allowed_ones_is_refused_and_nothing_is_logged(make_harness):
    h = make_harness(**{"serving.feedback_sources": ["user", "thumbs"]})
    iid = ask(h, [{"role": "user", "content": "hi"}])["interaction_id"]
    r = h.client.post("/v1/feedback", json={"interaction_id": iid, "reward": 1.0, "source": "judge"})
    error = assert_openai_error(r, 403, param="source", code="source_not_allowed")
    assert "'judge'" in error["message"] and "user, thumbs" in error["message"]
    assert h.rewards() == []
    for body in ({"reward": 0.5}, {"reward": 0.25, "source": "thumbs"}):  # no source given: "user"
        assert h.client.post("/v1/feedback", json={"interaction_id": iid, **body}).status_code == 200
    assert [(x.source, x.value) for x in h.rewards()] == [("user", 0.5), ("thumbs", 0.25)]


def test_a_source_bound_to_keys_is_refused_to_every_other_key(make_harness):
    h = make_harness(**{"serving.api_keys": ["user-key", "judge-key"],
                        "serving.source_keys": {"judge": ["judge-key"]}})
    as_user, as_judge = ({"Authorization": f"Bearer {key}"} for key in ("user-key", "judge-key"))
    r = h.client.post(CHAT, json={"model": "online-sao", "messages": [{"role": "user", "content": "hi"}]},
                      headers=as_user)
    iid = r.json()["interaction_id"]
    r = h.client.post("/v1/feedback", json={"interaction_id": iid, "reward": 1.0, "source": "judge"}, headers=as_user)
    assert "serving.source_keys" in assert_openai_error(r, 403, param="source", code="source_not_allowed")["message"]
    assert h.rewards() == []
    for body, headers in (({"reward": 0.5, "source": "judge"}, as_judge), ({"reward": 0.25}, as_user),
                          ({"reward": 0.0}, as_judge)):  # a judge's key may claim the open sources too
        assert h.client.post("/v1/feedback", json={"interaction_id": iid, **body}, headers=headers).status_code == 200
    assert [(x.source, x.value) for x in h.rewards()] == [("judge", 0.5), ("user", 0.25), ("user", 0.0)]


@pytest.mark.parametrize("serving, message", [
    ({"source_keys": {"judge": ["judge-key"]}}, "not in serving.api_keys"),
    ({"api_keys": ["judge-key"], "source_keys": {"judge": []}}, "lists no key"),
    ({"api_keys": ["judge-key"], "source_keys": {"judge": ["judge-key"]}, "feedback_sources": ["user"]},
     "refuses anyway"),
])
def test_source_keys_that_cannot_work_are_refused(serving, message):
    with pytest.raises(ValidationError, match=message):
        ServingConfig(**serving)


def test_feedback_scores_go_on_the_reward_record_and_bad_ones_are_refused(make_harness):
    h = make_harness()
    iid = ask(h, [{"role": "user", "content": "hi"}])["interaction_id"]
    for scores, field in [({"Quality": 0.5}, "Quality"), ({f"s{i}": 0.0 for i in range(17)}, "scores"),
                          ({"quality": "high"}, "quality")]:
        r = h.client.post("/v1/feedback", json={"interaction_id": iid, "reward": 0.5, "scores": scores})
        assert_openai_error(r, 422)
        assert field in r.text
    assert h.rewards() == []
    r = h.client.post("/v1/feedback", json={"interaction_id": iid, "reward": 0.5, "scores": {"quality": 0.25}})
    assert r.status_code == 200, r.text
    [reward] = h.rewards()
    assert reward.scores == {"quality": 0.25}


def test_refused_feedback_logs_nothing(make_harness):
    h = make_harness(**{"reward.min_value": -1.0, "reward.max_value": 1.0})
    iid = ask(h, [{"role": "user", "content": "hi"}])["interaction_id"]
    secret = h.cfg.serving.feedback_secret.get_secret_value().encode()
    window = h.cfg.reward.window_s
    old = InteractionIdSigner(secret, "local", window, clock=lambda: time.time() - window - 5).mint()
    foreign = InteractionIdSigner(secret, "another-deployment", window).mint()
    forged = iid[:-4] + ("0000" if not iid.endswith("0000") else "1111")
    cases = [
        ({"interaction_id": forged, "reward": 1.0}, 403, "invalid_interaction_id"),
        ({"interaction_id": foreign, "reward": 1.0}, 403, "invalid_interaction_id"),
        ({"interaction_id": "made-up", "reward": 1.0}, 403, "invalid_interaction_id"),
        ({"interaction_id": old, "reward": 1.0}, 410, "interaction_expired"),
        ({"interaction_id": iid, "reward": 1.5}, 422, "reward_out_of_range"),
        ({"interaction_id": iid, "reward": -1.01}, 422, "reward_out_of_range"),
        ({"interaction_id": iid, "reward": 0.5, "turn_rewards": [{"turn": 0, "value": 3.0}]}, 422,
         "reward_out_of_range"),
        ({"interaction_id": iid, "reward": 0.5, "turn_rewards": [{"turn": 1, "value": 0.1}]}, 422,
         "turn_out_of_range"),
        ({"interaction_id": iid, "reward": 0.5, "turn_rewards": [{"turn": 0, "value": 1.0},
                                                                 {"turn": 0, "value": -1.0}]}, 422, "duplicate_turn"),
        ({"interaction_id": iid}, 422, None),
        ({"interaction_id": iid, "reward": "great"}, 422, None),
    ]
    for body, status, code in cases:
        assert_openai_error(h.client.post("/v1/feedback", json=body), status, code=code)
    for raw in (b'{"interaction_id": "%s", "reward": NaN}' % iid.encode(),
                b'{"interaction_id": "%s", "reward": Infinity}' % iid.encode(),
                b'{"interaction_id": "%s", "reward": 1e999}' % iid.encode()):
        assert_openai_error(h.client.post("/v1/feedback", content=raw), 422)
    assert_openai_error(h.client.post("/v1/feedback", content=b"{oops"), 400, code="invalid_json")
    assert h.rewards() == []
    assert h.client.post("/v1/feedback", json={"interaction_id": iid, "reward": 1.0}).status_code == 200
    assert len(h.rewards()) == 1


def test_a_continued_chat_is_logged_as_one_trajectory_with_its_action_mask(make_harness):
    h = make_harness()
    h.engine.version = 1
    first = ask(h, [{"role": "user", "content": "Plan a trip."}])
    h.engine.version = 2
    messages = [{"role": "user", "content": "Plan a trip."},
                {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "weather: sunny"},  # a tool result answers a call (test_tool_calling.py)
                {"role": "user", "content": "And then?"}]
    second = ask(h, messages, parent_interaction_id=first["interaction_id"])
    parent, child = h.interactions()
    script = h.engine.script
    observation = h.tokenizer("\n<|im_start|>user\nweather: sunny<|im_end|>\n<|im_start|>user\nAnd then?"
                              "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert child.parent_id == parent.interaction_id == first["interaction_id"]
    assert child.prompt_ids == parent.prompt_ids
    assert child.response_ids == script + observation + script
    assert child.action_mask == [True] * len(script) + [False] * len(observation) + [True] * len(script)
    assert child.turn_ends == [len(script) - 1, len(child.response_ids) - 1]
    assert child.versions == [1] * len(script) + [2] * len(script)
    assert child.logprobs == parent.logprobs + [-0.1 * (i + 1) for i in range(len(script))]
    # the engine conditioned on exactly the logged tokens
    assert h.engine.requests[1].prompt_ids == child.prompt_ids + script + observation
    assert second["policy_versions"] == [2] and second["usage"]["prompt_tokens"] == len(h.engine.requests[1].prompt_ids)
    # per-turn rewards may address both turns of the continued interaction
    r = h.client.post("/v1/feedback", json={"interaction_id": second["interaction_id"], "reward": 1.0,
                                            "turn_rewards": [{"turn": 1, "value": 0.5}]})
    assert r.status_code == 200


def test_a_turn_cut_by_max_tokens_is_closed_by_the_template_as_an_observation(make_harness):
    h = make_harness()
    first = ask(h, [{"role": "user", "content": "Go"}], max_tokens=2)
    reply = first["choices"][0]["message"]["content"]
    ask(h, [{"role": "user", "content": "Go"}, {"role": "assistant", "content": reply},
            {"role": "user", "content": "More"}], parent_interaction_id=first["interaction_id"])
    parent, child = h.interactions()
    observation = child.response_ids[len(parent.response_ids):len(child.response_ids) - len(h.engine.script)]
    assert h.tokenizer.decode(observation).startswith("<|im_end|>\n<|im_start|>user\nMore")


def test_continuing_a_continuation_chains_three_turns(make_harness):
    h = make_harness()
    messages = [{"role": "user", "content": "a"}]
    parent = None
    for turn in range(3):
        extra = {} if parent is None else {"parent_interaction_id": parent}
        body = ask(h, messages, **extra)
        parent = body["interaction_id"]
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": f"next {turn}"}]
    last = h.interactions()[-1]
    assert len(last.turn_ends) == 3 and sum(last.action_mask) == 3 * len(h.engine.script)


@pytest.mark.parametrize("change, status, code", [
    (lambda m: m[:1] + [{"role": "assistant", "content": "something else"}] + m[2:], 400, None),
    (lambda m: m[:2], 400, None),
    (lambda m: m + [{"role": "assistant", "content": "pre-filled"}], 400, None),
])
def test_a_continuation_must_extend_the_parent_conversation(make_harness, change, status, code):
    h = make_harness()
    first = ask(h, [{"role": "user", "content": "Q"}])
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ANSWER},
                {"role": "user", "content": "Q2"}]
    r = h.client.post(CHAT, json={"model": "online-sao", "messages": change(messages),
                                  "parent_interaction_id": first["interaction_id"]})
    assert_openai_error(r, status, param="messages")


def test_unknown_forged_and_evicted_parents_are_refused(make_harness):
    h = make_harness(**{"serving.max_trajectories": 2})
    ids = [ask(h, [{"role": "user", "content": f"q{i}"}])["interaction_id"] for i in range(3)]
    follow_up = [{"role": "user", "content": "q0"}, {"role": "assistant", "content": ANSWER},
                 {"role": "user", "content": "more"}]
    r = h.client.post(CHAT, json={"model": "online-sao", "messages": follow_up, "parent_interaction_id": ids[0]})
    error = assert_openai_error(r, 404, param="parent_interaction_id", code="interaction_not_found")
    assert "2 most recent" in error["message"]
    assert "another replica served it" in error["message"] and "X-Session-Id" in error["message"]  # all causes
    r = h.client.post(CHAT, json={"model": "online-sao", "messages": follow_up, "parent_interaction_id": "fake"})
    assert_openai_error(r, 403, param="parent_interaction_id")
    r = h.client.post("/v1/completions", json={"model": "online-sao", "prompt": "x", "parent_interaction_id": ids[2]})
    assert_openai_error(r, 400, param="parent_interaction_id")
    assert len(h.interactions()) == 3


def test_a_continued_text_completion_takes_the_new_text_as_observation(make_harness):
    h = make_harness()
    first = h.client.post("/v1/completions", json={"model": "online-sao", "prompt": "Q:", "max_tokens": 3}).json()
    prompt = "Q:" + first["choices"][0]["text"] + "\nA:"
    h.client.post("/v1/completions", json={"model": "online-sao", "prompt": prompt,
                                           "parent_interaction_id": first["interaction_id"]})
    parent, child = h.interactions()
    observation = h.tokenizer("\nA:", add_special_tokens=False)["input_ids"]
    assert child.response_ids[:len(parent.response_ids) + len(observation)] == parent.response_ids + observation
    ids_prompt = child.prompt_ids + child.response_ids + [7, 8]
    r = h.client.post("/v1/completions", json={"model": "online-sao", "prompt": ids_prompt,
                                               "parent_interaction_id": child.interaction_id})
    assert r.status_code == 200
    r = h.client.post("/v1/completions", json={"model": "online-sao", "prompt": "unrelated text",
                                               "parent_interaction_id": child.interaction_id})
    assert_openai_error(r, 400, param="prompt")
