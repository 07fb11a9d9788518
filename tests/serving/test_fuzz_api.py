"""Schema-driven fuzzing of the HTTP API (schemathesis) against the real app in-process.

The app is the production wiring (:func:`serving.server.build_stack`) with the real
TorchEngine on the tiny model, logging to an in-memory stream; schemathesis reads its
``/openapi.json`` and calls it over ASGI. Every operation is fuzzed with schema-valid
and schema-invalid data, in three deployments: API keys configured and a valid key sent
(schemathesis also probes the same request without a key and with a wrong one), API keys
configured and no key sent (every ``/v1`` answer must be 401), and no keys (loopback,
anonymous). Checks: no 5xx, documented status codes, content types, headers and bodies,
schema-invalid input rejected with 4xx, authentication enforced where declared.

The operations' hypothesis strategies are driven directly rather than through
``schemathesis.pytest.from_fixture``: schemathesis 4.32 reads pytest's private ``Node._nodeid``,
which pytest 9.2 no longer has. Its pytest plugin ends every ASGI app's lifespan after each test,
so each test builds the apps it fuzzes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.python.asgi import get_client, shutdown_lifespans
from schemathesis.specs.openapi.checks import (content_type_conformance, ignored_auth, negative_data_rejection,
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance, unsupported_method)

from online_sao.schemas import Interaction, decode
from serving.server import ServingStack, build_stack
from streams.memory import InMemoryBackend
from tests.fixtures.models import tiny_config

API_KEY = "fuzz-key-0123456789"
MAX_EXAMPLES = 12
"""Examples per operation and generation mode: the module takes 15-50 s on the shared 2-core box."""
FEEDBACK_EXAMPLES = 25
"""Feedback for a real interaction: the only cases that reach the reward and turn checks."""
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection, unsupported_method]
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
FUZZED = [("POST", "/v1/chat/completions", POSITIVE), ("POST", "/v1/chat/completions", NEGATIVE),
          ("POST", "/v1/completions", POSITIVE), ("POST", "/v1/completions", NEGATIVE),
          ("POST", "/v1/feedback", POSITIVE), ("POST", "/v1/feedback", NEGATIVE),
          ("GET", "/v1/models", POSITIVE), ("GET", "/v1/models/{model_id}", POSITIVE), ("GET", "/healthz", POSITIVE), ("GET", "/readyz", POSITIVE),
          ("GET", "/metrics", POSITIVE)]
"""Every operation with schema-valid data; those with a body also with schema-invalid data."""
SCHEMATHESIS_CONFIG = schemathesis.Config.from_dict({"checks": {"negative_data_rejection": {
    "expected-statuses": ["400", "401", "403", "404", "405", "413", "415", "422", "429"]}}})
"""A schema-violating request may also be refused as too large (413); 5xx is never an answer here."""
FUZZ_SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(HealthCheck))


@dataclass
class Deployment:
    stack: ServingStack
    backend: InMemoryBackend
    topic: str
    """Where interactions are logged."""

    def interactions(self) -> list[Interaction]:
        """Every logged interaction, each decoded with the strict record codec."""
        assert self.stack.logger.flush(30.0), "the interaction logger did not deliver within 30 s"
        consumer = self.backend.consumer([self.topic])
        try:
            return [decode(m.value, Interaction) for m in consumer.poll(timeout_s=0.1, max_records=100_000)]
        finally:
            consumer.close()


def _deploy(tmp_path_factory, model_dir, api_keys: list[str]) -> Deployment:
    data_dir = tmp_path_factory.mktemp("fuzz-api")
    cfg = tiny_config(data_dir, **{
        "model.path": str(model_dir), "serving.api_keys": api_keys, "serving.max_new_tokens": 16,
        "serving.max_prompt_tokens": 64, "serving.max_request_bytes": 16_384,
        "serving.rate_limit_per_minute": 1_000_000, "serving.rate_limit_burst": 1_000_000,
    })
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    return Deployment(build_stack(cfg, model_dir, backend), backend, cfg.kafka.topics.interactions)


@pytest.fixture
def deploy(tmp_path_factory, tiny_model_dir, one_torch_thread) -> Iterator[Callable[[list[str]], Deployment]]:
    """Builds a deployment; schemathesis ends each app's lifespan when the test ends (its
    pytest plugin does, after every test), so each test fuzzes apps of its own."""
    yield lambda api_keys: _deploy(tmp_path_factory, tiny_model_dir, api_keys)
    shutdown_lifespans()


def _fuzz(schema, method: str, path: str, mode: GenerationMode, call: Callable[[Case], None],
          examples: int = MAX_EXAMPLES) -> None:
    """Run ``call`` on ``examples`` cases of one operation generated in ``mode``."""
    strategy = schema[path][method].as_strategy(generation_mode=mode)

    @settings(FUZZ_SETTINGS, max_examples=examples)
    @given(case=strategy)
    def run(case: Case) -> None:
        call(case)

    run()


def _fuzz_all(deployment: Deployment, call: Callable[[Case], None]) -> None:
    """Fuzz every operation of the deployment's schema, then check it still serves and logged
    only valid records."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", deployment.stack.app, config=SCHEMATHESIS_CONFIG)
    documented = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert documented == {(method, path) for method, path, _ in FUZZED}
    for method, path, mode in FUZZED:
        _fuzz(schema, method, path, mode, call)
    with get_client(deployment.stack.app) as client:
        response = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, json={
            "model": "online-sao", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
    assert response.status_code == 200, response.text
    issued = response.headers["X-Interaction-Id"]

    def feedback_for_a_real_interaction(case: Case) -> None:  # past the signature check, into the reward checks
        if isinstance(case.body, dict):
            case.body["interaction_id"] = issued
        call(case)

    _fuzz(schema, "POST", "/v1/feedback", GenerationMode.POSITIVE, feedback_for_a_real_interaction,
          examples=FEEDBACK_EXAMPLES)
    logged = deployment.interactions()  # every one decodes with the strict codec
    assert issued in {i.interaction_id for i in logged}


def test_fuzz_with_a_valid_api_key(deploy):
    def call(case: Case) -> None:
        case.call_and_validate(headers={"Authorization": f"Bearer {API_KEY}"}, checks=CHECKS + [ignored_auth])

    _fuzz_all(deploy([API_KEY]), call)


def test_fuzz_without_an_api_key(deploy):
    def call(case: Case) -> None:
        case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        response = case.call_and_validate(checks=CHECKS)
        if case.path.startswith("/v1/") and response.status_code != 413:  # the body limit comes before auth
            assert response.status_code == 401, response.text

    _fuzz_all(deploy([API_KEY]), call)


def test_fuzz_without_keys_configured(deploy):
    _fuzz_all(deploy([]), lambda case: case.call_and_validate(checks=CHECKS))


def test_the_schema_documents_bodies_and_auth(deploy):
    keyed = deploy([API_KEY]).stack.app.openapi()
    chat = keyed["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    assert chat["security"] == [{"apiKey": []}]
    assert keyed["components"]["securitySchemes"]["apiKey"] == {"type": "http", "scheme": "bearer"}
    assert {"200", "400", "401", "413", "429", "503"} <= set(chat["responses"])
    assert keyed["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]["enum"] == ["online-sao"]
    anonymous = deploy([]).stack.app.openapi()
    assert "security" not in anonymous["paths"]["/v1/chat/completions"]["post"]


# ----------------------------------------------------------------------------- bugs the fuzzing found

def test_a_vanishing_temperature_is_refused_not_answered_with_500(deploy):
    """temperature 1e-300 is 0 in float32: the engine's log-probabilities became NaN, the
    interaction record refused them and the request failed with 500 (found by fuzzing)."""
    deployment = deploy([])
    body = {"model": "online-sao", "prompt": [5, 6, 7], "max_tokens": 3}
    with get_client(deployment.stack.app) as client:
        for temperature in (1e-300, 5e-324, 1e-5):
            response = client.post("/v1/completions", json={**body, "temperature": temperature})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "temperature"
        smallest = client.post("/v1/completions", json={**body, "temperature": 1e-4})
    assert smallest.status_code == 200, smallest.text
    (logged,) = deployment.interactions()
    assert logged.interaction_id == smallest.headers["X-Interaction-Id"] and logged.sampling.temperature == 1e-4


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "max_tokens", True), ("/v1/completions", "n", "1"),
    ("/v1/completions", "stream", "yes"), ("/v1/completions", "seed", "7"),
    ("/v1/chat/completions", "temperature", True), ("/v1/feedback", "reward", True),
])
def test_wrongly_typed_json_values_are_refused(make_harness, path, field, value):
    """Before, pydantic's lax mode took true for 1 and "yes" for true (found by fuzzing)."""
    h = make_harness()
    bodies = {"/v1/completions": {"model": "online-sao", "prompt": "hi"},
              "/v1/chat/completions": {"model": "online-sao", "messages": [{"role": "user", "content": "hi"}]},
              "/v1/feedback": {"interaction_id": "sao-1-2-3", "reward": 1.0}}
    response = h.client.post(path, json={**bodies[path], field: value})
    assert response.status_code in (400, 422), response.text
    assert response.json()["error"]["code"] == "invalid_value" and field in response.json()["error"]["message"]
    assert h.engine.requests == []


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"model": "online-sao", "prompt": "hi \\ud800"}'),
    ("/v1/completions", b'{"model": "online-sao", "prompt": ["\\ud800"]}'),
    ("/v1/completions", b'{"model": "online-sao", "prompt": "hi", "stop": ["\\udfff"]}'),
    ("/v1/chat/completions", b'{"model": "online-sao", "messages": [{"role": "user", "content": "a\\udc00"}]}'),
    ("/v1/chat/completions", b'{"model": "online-sao", "messages": [{"role": "user", "content": "a", "name": "\\ud800"}]}'),
    ("/v1/feedback", b'{"interaction_id": "x", "reward": 1, "\\ud800": 1}'),
])
def test_a_lone_surrogate_escape_is_refused_not_answered_with_500(make_harness, path, body):
    """JSON can spell a lone UTF-16 surrogate ("\\ud800"); the tokenizer raised TypeError on it and the
    record encoder PydanticSerializationError (a stop string), both answered 500 (found by probing
    what the fuzzing suggested)."""
    h = make_harness()
    response = h.client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_json" and "surrogate" in response.json()["error"]["message"]
    assert h.engine.requests == []
    assert h.client.post("/v1/completions", json={"model": "online-sao", "prompt": "hi \U0001f600"}).status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"model": "online-sao", "prompt": "hi \xed\xa0\x80"}'),
    ("/v1/completions", b'{"model": "online-sao", "prompt": "hi", "stop": ["\xed\xa0\x80"]}'),
    ("/v1/chat/completions", b'{"model": "online-sao", "messages": [{"role": "user", "content": "a\xed\xb0\x80"}]}'),
    ("/v1/feedback", b'{"interaction_id": "x", "reward": 1, "source": "s\xed\xa0\x80"}'),
])
def test_a_surrogate_encoded_in_the_raw_bytes_is_invalid_utf8_not_a_500(make_harness, path, body):
    """ED A0 80 is a surrogate encoded as UTF-8, which UTF-8 forbids; json.loads of the bytes let it
    through as "\\ud800" and the escape check never looked (no backslash-u in the body): 500, after
    generating the whole answer when it was a stop string."""
    h = make_harness()
    response = h.client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_json"
    assert h.engine.requests == []


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"model": "online-sao", "prompt": "hi", "seed": 1' + b"1" * 5000 + b"}"),
    ("/v1/feedback", b'{"interaction_id": "x", "reward": 1' + b"0" * 5000 + b"}"),
])
def test_an_integer_longer_than_the_parser_takes_is_invalid_json_not_a_500(make_harness, path, body):
    """Python refuses to convert integers of more than 4300 digits (a ValueError, not a JSONDecodeError)."""
    h = make_harness()
    response = h.client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_json"


def test_a_body_with_a_utf8_byte_order_mark_is_still_read(make_harness):
    h = make_harness()
    body = b'\xef\xbb\xbf{"model": "online-sao", "prompt": "hi"}'
    assert h.client.post("/v1/completions", content=body, headers={"content-type": "application/json"}).status_code == 200


def test_a_body_nested_deeper_than_the_limit_is_refused_by_its_depth(make_harness):
    """Refused before parsing: the parser recursed to the interpreter's limit first (online_sao/json_depth.py)."""
    h = make_harness()
    body = b'{"model": "online-sao", "prompt": "hi", "stop": ' + b"[" * 5000 + b"}"
    response = h.client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {**response.json()["error"], "code": "invalid_json",
                                        "message": "the request body nests deeper than 200 levels"}
    assert h.engine.requests == []
