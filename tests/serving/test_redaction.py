"""The redaction hook: configured by name, imported once, applied before a record is built."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from online_sao.config import ConfigError, load_config
from online_sao.schemas import decode
from serving.redaction import (EMAIL_MASK, PHONE_MASK, RequestMetadata, Texts, apply_redactor, load_redactor,
                               mask_contacts, mask_text)
from tests.serving.conftest import wait_until
from tests.serving.fakes import FakeProducer

CHAT = "/v1/chat/completions"
SECRET_TEXT = "mail me at jane.doe+sao@example.co.uk or call +44 20 7946 0958 in 2024"


def tag_with_metadata(texts: Texts, metadata: RequestMetadata) -> Texts:
    """Test hook: replaces the texts with what it was told about the request."""
    return Texts(prompt=f"{metadata.route}|{metadata.user}|{metadata.session_id}|{metadata.interaction_id}",
                 response=f"{metadata.model}|{metadata.deployment_id}|{len(texts.response) > 0}")


def drop_everything(texts: Texts, metadata: RequestMetadata) -> None:
    return None


def broken(texts: Texts, metadata: RequestMetadata) -> Texts:
    raise RuntimeError("the hook's own bug")


def wrong_answer(texts: Texts, metadata: RequestMetadata) -> str:
    return "not Texts"


NOT_CALLABLE = 42


def test_mask_text_masks_emails_and_phone_numbers_only():
    masked = mask_text(SECRET_TEXT)
    assert masked == f"mail me at {EMAIL_MASK} or call {PHONE_MASK} in 2024"
    assert mask_text("call 555-0123-4567, room 12, 3.14, 12:30") == f"call {PHONE_MASK}, room 12, 3.14, 12:30"
    assert mask_text("no contact here") == "no contact here"


def test_hooks_are_loaded_by_name_with_clear_errors():
    assert load_redactor("serving.redaction:mask_contacts") is mask_contacts
    for spec, message in [("serving.no_such_module:f", "cannot import module 'serving.no_such_module'"),
                          ("serving.redaction:no_such_function", "has no callable 'no_such_function'"),
                          ("tests.serving.test_redaction:NOT_CALLABLE", "has no callable 'NOT_CALLABLE'"),
                          ("serving.redaction", "not of the form")]:
        with pytest.raises(ConfigError, match=f"serving.redact_hook: .*{message}"):
            load_redactor(spec)
    with pytest.raises(ConfigError, match="serving.redact_hook"):
        load_config(environ={}, overrides={"serving.redact_hook": "not a callable name"})


def test_a_failing_or_misbehaving_hook_logs_no_text():
    meta = RequestMetadata("id", "chat", "m", "d", None, None)
    assert apply_redactor(broken, Texts("a", "b"), meta) is None
    assert apply_redactor(wrong_answer, Texts("a", "b"), meta) is None
    assert apply_redactor(mask_contacts, Texts(SECRET_TEXT, "ok"), meta) == Texts(mask_text(SECRET_TEXT), "ok")


def _spooled_values(spool_dir: Path) -> list[bytes]:
    """The record bytes in the spool's files (JSON lines after a length and checksum, value in base64)."""
    values = []
    for path in sorted(p for p in spool_dir.rglob("*") if p.is_file()):
        for line in path.read_bytes().splitlines():
            if b"{" in line:
                values.append(base64.b64decode(json.loads(line[line.index(b"{"):])["value"]))
    return values


def test_the_built_in_hook_masks_the_logged_texts_but_keeps_the_tokens(make_harness):
    producer = FakeProducer(up=False)  # the broker is down: the record goes to the spool on disk first
    h = make_harness(producer=producer, **{"serving.redact_hook": "serving.redaction:mask_contacts"})
    response = h.client.post(CHAT, json={"model": "online-sao", "messages": [{"role": "user", "content": SECRET_TEXT}]})
    assert response.status_code == 200
    assert wait_until(lambda: len(_spooled_values(h.cfg.spool_dir)) == 1)
    (spooled,) = _spooled_values(h.cfg.spool_dir)
    assert b"jane.doe" not in spooled and b"7946" not in spooled and EMAIL_MASK.encode() in spooled
    producer.come_back()
    assert h.logger.flush(10.0)
    (logged,) = [decode(value) for topic, _, value in producer.delivered if topic == h.cfg.kafka.topics.interactions]
    assert "jane.doe" not in logged.prompt_text and "7946" not in logged.prompt_text
    assert EMAIL_MASK in logged.prompt_text and PHONE_MASK in logged.prompt_text and "2024" in logged.prompt_text
    assert "jane.doe" in h.tokenizer.decode(logged.prompt_ids)  # documented: token ids still hold the text


def test_the_hook_gets_the_request_metadata(make_harness):
    h = make_harness(**{"serving.redact_hook": "tests.serving.test_redaction:tag_with_metadata",
                        "serving.deployment_id": "dep-x"})
    response = h.client.post("/v1/completions", json={"model": "online-sao", "prompt": "hi", "user": "u-1",
                                                      "session_id": "s-9"})
    (logged,) = h.interactions()
    assert logged.prompt_text == f"completions|u-1|s-9|{response.headers['X-Interaction-Id']}"
    assert logged.response_text == "online-sao|dep-x|True"


@pytest.mark.parametrize("hook", ["drop_everything", "broken", "wrong_answer"])
def test_a_hook_that_drops_or_fails_logs_tokens_without_text(make_harness, hook):
    h = make_harness(**{"serving.redact_hook": f"tests.serving.test_redaction:{hook}"})
    response = h.client.post(CHAT, json={"model": "online-sao", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200
    (logged,) = h.interactions()
    assert logged.prompt_text is None and logged.response_text is None and logged.response_ids


def test_redact_text_still_drops_texts_and_the_hook_is_not_needed(make_harness):
    h = make_harness(**{"serving.redact_text": True, "serving.redact_hook": "tests.serving.test_redaction:broken"})
    h.client.post(CHAT, json={"model": "online-sao", "messages": [{"role": "user", "content": SECRET_TEXT}]})
    (logged,) = h.interactions()
    assert logged.prompt_text is None and logged.response_text is None


def test_an_unimportable_hook_stops_the_app_from_being_built(make_harness):
    with pytest.raises(ConfigError, match="serving.redact_hook: cannot import"):
        make_harness(**{"serving.redact_hook": "nowhere.to.be.found:hook"})
