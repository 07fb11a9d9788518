"""Prompts of tokenizers other than the default model's (serving/prompts.py), through the official
client: a tokenizer without a chat template serves completions only and says why chat is refused;
a tokenizer that adds a BOS gets it on a fresh completions text prompt, and only there; one whose
post-processor also appends an EOS does not end the prompt with it; Llama 2's chat template continues a
conversation after the model's own stop token."""

from __future__ import annotations

import copy
import logging
from contextlib import ExitStack

import openai
import pytest
from tokenizers.processors import TemplateProcessing
from transformers import LlamaTokenizerFast

from serving.prompts import PromptBuilder
from tests.serving.conftest import FakeHttpServer, MESSAGES, MODEL, running_fake_http_server

BOS = "<|endoftext|>"
"""A special token of the default model's tokenizer, made its BOS below."""


@pytest.fixture
def http_server_with(tmp_path):
    """``make(tokenizer)``: the real app on uvicorn over a FakeEngine (as ``fake_http_server``) with ``tokenizer``."""
    with ExitStack() as servers:
        def make(tokenizer) -> FakeHttpServer:
            served = servers.enter_context(running_fake_http_server(tmp_path, tokenizer))
            served.script("Fine.")
            return served

        yield make


def test_without_a_chat_template_chat_says_so_and_completions_work(chat_tokenizer, http_server_with, caplog):
    base_model_tokenizer = copy.deepcopy(chat_tokenizer)
    base_model_tokenizer.chat_template = None
    with caplog.at_level(logging.WARNING, logger="serving.prompts"):
        server = http_server_with(base_model_tokenizer)
    assert any("no chat template" in r.getMessage() and "/v1/chat/completions" in r.getMessage()
               for r in caplog.records)  # said at start, not first at a request
    client = server.openai()
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as refused:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream)
        error = refused.value.body
        assert error["code"] == "chat_template_missing" and error["param"] == "model"
        assert "has no chat template" in error["message"] and "/v1/completions" in error["message"]
    answer = client.completions.create(model=MODEL, prompt="Tell me about tea.")
    assert answer.choices[0].text == "Fine."
    assert len(server.harness.interactions()) == 1  # the refused chats sampled and logged nothing


def adding_a_bos(tokenizer):
    """A copy of ``tokenizer`` that puts :data:`BOS` before every text it encodes with special tokens."""
    bos_adding = copy.deepcopy(tokenizer)
    bos_id = bos_adding.convert_tokens_to_ids(BOS)
    bos_adding.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return bos_adding


def test_a_fresh_completions_text_prompt_gets_the_tokenizers_bos_and_nothing_else_does(chat_tokenizer,
                                                                                        http_server_with):
    tokenizer = adding_a_bos(chat_tokenizer)
    bos_id = tokenizer.convert_tokens_to_ids(BOS)
    text = "Tell me about tea."
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    server = http_server_with(tokenizer)
    client = server.openai()

    first = client.completions.create(model=MODEL, prompt=text)
    client.completions.create(model=MODEL, prompt=plain)  # token ids: taken as sent
    client.chat.completions.create(model=MODEL, messages=MESSAGES)  # the template writes what it needs
    more = " And coffee?"
    client.completions.create(model=MODEL, prompt=text + first.choices[0].text + more,
                              extra_body={"parent_interaction_id": first.id})
    records = server.harness.interactions()
    fresh, ids, chat, continued = [r.prompt_ids for r in records]

    assert fresh == [bos_id] + plain
    assert ids == plain
    assert chat == tokenizer(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False)["input_ids"]
    # the continuation: the parent's tokens, then the new text's, without a second BOS
    assert continued == fresh
    trajectory = records[3]
    observation = [t for t, action in zip(trajectory.response_ids, trajectory.action_mask) if not action]
    assert observation == tokenizer(more, add_special_tokens=False)["input_ids"]


EOS = "<|im_end|>"
"""The default model's tokenizer's EOS."""


def adding_bos_and_eos(tokenizer):
    """transformers' Llama tokenizer over ``tokenizer``'s vocabulary with ``add_eos_token=True``: its
    post-processor puts :data:`BOS` before every text it encodes with special tokens and :data:`EOS` after."""
    return LlamaTokenizerFast(tokenizer_object=copy.deepcopy(tokenizer.backend_tokenizer), bos_token=BOS,
                              eos_token=EOS, add_bos_token=True, add_eos_token=True)


def test_a_fresh_completions_text_prompt_keeps_the_bos_but_not_an_appended_eos(chat_tokenizer, http_server_with):
    tokenizer = adding_bos_and_eos(chat_tokenizer)
    bos_id, eos_id = tokenizer.convert_tokens_to_ids(BOS), tokenizer.convert_tokens_to_ids(EOS)
    text, spelled = "Tell me about tea.", f"Tell me about tea.{EOS}"
    assert tokenizer(text)["input_ids"][-1] == eos_id  # what the old prompt ended with
    server = http_server_with(tokenizer)
    client = server.openai()
    for prompt in (text, spelled, ""):
        client.completions.create(model=MODEL, prompt=prompt)
    plain, spelled_ids, empty = [r.prompt_ids for r in server.harness.interactions()]
    text_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert plain == [bos_id] + text_ids
    assert spelled_ids == [bos_id] + text_ids + [eos_id]  # the EOS the text spells stays, once
    assert empty == [bos_id]


@pytest.mark.parametrize("special", ["none", "bos"])
def test_a_tokenizer_that_appends_nothing_keeps_its_own_encoding(chat_tokenizer, special):
    tokenizer = chat_tokenizer if special == "none" else adding_a_bos(chat_tokenizer)
    prompts = PromptBuilder(tokenizer, signer=None, trajectories=None, stop_token_ids=frozenset(), model_name=MODEL)
    for text in ("Tell me about tea.", f"Tell me about tea.{EOS}", ""):
        assert prompts.fresh_text_ids(text) == tokenizer(text)["input_ids"]


LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
"""meta-llama/Llama-2-7b-chat-hf's chat template, verbatim: the reply rendered as ``' ' + content.strip() + ' '
+ eos_token``."""


def test_a_llama2_conversation_continues_after_the_models_own_stop_token(chat_tokenizer, http_server_with):
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.bos_token, tokenizer.chat_template = BOS, LLAMA2_CHAT_TEMPLATE
    server = http_server_with(tokenizer)
    client = server.openai()
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert first.choices[0].message.content == "Fine."
    client.chat.completions.create(
        model=MODEL, extra_body={"parent_interaction_id": first.interaction_id},
        messages=MESSAGES + [{"role": "assistant", "content": "Fine."}, {"role": "user", "content": "And coffee?"}])
    # the template's " <|im_end|>" after the reply was observed after the model's own <|im_end|>: a second one
    assert tokenizer.decode(server.engine.requests[1].prompt_ids) == \
        "<|endoftext|>[INST] Tell me about tea. [/INST]Fine.<|im_end|><|endoftext|>[INST] And coffee? [/INST]"
