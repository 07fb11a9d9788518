"""Security properties: unforgeable, unreplayable feedback ids; constant-time key checks; no
pickle on the data path; Kafka SASL/TLS settings reach every client; secrets stay masked."""

from __future__ import annotations

import ast
import hmac
import time
from pathlib import Path

import pytest

from online_sao.config import KafkaConfig, dump_config, load_config
from serving import auth as auth_module
from serving import ids as ids_module
from serving.auth import ApiKeyAuth, AuthError
from serving.ids import InteractionIdError, InteractionIdSigner
from streams import kafka_backend
from streams.kafka_backend import KafkaBackend

REPO = Path(__file__).resolve().parents[2]
DATA_PATH_PACKAGES = ("online_sao", "serving", "streams", "trainer")
CHAT = "/v1/chat/completions"
HELLO = {"model": "online-sao", "messages": [{"role": "user", "content": "hi"}]}


def _deployment(make_harness, tmp_path, name: str, **overrides):
    return make_harness(**{"paths.data_dir": str(tmp_path / name), **overrides})


# ----------------------------------------------------------------------------- feedback ids

@pytest.mark.parametrize("other", [
    {"serving.deployment_id": "dep-b", "serving.feedback_secret": "secret-a"},   # same secret
    {"serving.deployment_id": "dep-a", "serving.feedback_secret": "secret-b"},   # same deployment name
])
def test_an_id_issued_by_one_deployment_is_refused_by_another(make_harness, tmp_path, other):
    a = _deployment(make_harness, tmp_path, "a", **{"serving.deployment_id": "dep-a",
                                                   "serving.feedback_secret": "secret-a"})
    b = _deployment(make_harness, tmp_path, "b", **other)
    issued = a.client.post(CHAT, json=HELLO).headers["X-Interaction-Id"]
    refused = b.client.post("/v1/feedback", json={"interaction_id": issued, "reward": 1.0})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "invalid_interaction_id"
    continued = b.client.post(CHAT, json={**HELLO, "parent_interaction_id": issued})
    assert continued.status_code == 403
    assert b.rewards() == []
    assert a.client.post("/v1/feedback", json={"interaction_id": issued, "reward": 1.0}).status_code == 200


def test_an_id_past_the_reward_window_is_refused_with_410(make_harness, tmp_path):
    h = _deployment(make_harness, tmp_path, "a", **{"reward.window_s": 0.05})
    issued = h.client.post(CHAT, json=HELLO).headers["X-Interaction-Id"]
    time.sleep(0.3)  # the id's own issue time says it is older than the window; no server state involved
    expired = h.client.post("/v1/feedback", json={"interaction_id": issued, "reward": 1.0})
    assert expired.status_code == 410 and expired.json()["error"]["code"] == "interaction_expired"
    assert h.rewards() == []


def test_the_issue_time_and_deployment_are_covered_by_the_signature():
    now = [1_700_000_000.0]
    signer = InteractionIdSigner(b"s", "dep", 300, clock=lambda: now[0])
    _, issued_hex, nonce, mac = signer.mint().split("-")
    younger = f"sao-{int(issued_hex, 16) + 200_000:x}-{nonce}-{mac}"  # claims to be issued 200 s later
    now[0] += 400
    with pytest.raises(InteractionIdError) as err:
        signer.verify(younger)
    assert err.value.status == 403


# ----------------------------------------------------------------------------- constant time

def _spy_compare_digest(monkeypatch, module) -> list[tuple[bytes, bytes]]:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(module.hmac, "compare_digest", spy)
    return calls


def test_api_keys_are_compared_in_constant_time_against_every_key(monkeypatch):
    calls = _spy_compare_digest(monkeypatch, auth_module)
    auth = ApiKeyAuth(["first-key", "second-key", "third-key"], rate_per_minute=600, burst=100)
    for header in ("Bearer first-key", "Bearer third-key", "Bearer wrong"):
        calls.clear()
        try:
            auth.identify(header)
        except AuthError:
            pass
        assert len(calls) == 3, "every configured key is compared, with no early exit"


def test_signatures_are_compared_in_constant_time(monkeypatch):
    calls = _spy_compare_digest(monkeypatch, ids_module)
    signer = InteractionIdSigner(b"s", "dep", 300)
    signer.verify(signer.mint())
    minted = signer.mint()
    with pytest.raises(InteractionIdError):  # the last hex digit of the MAC changed (never to itself)
        signer.verify(minted[:-1] + ("1" if minted.endswith("0") else "0"))
    assert len(calls) == 2


SECRET_NAMES = {"key", "keys", "candidate", "given", "mac", "secret", "_secret", "_keys", "authorization"}


@pytest.mark.parametrize("module", [auth_module, ids_module], ids=["auth", "ids"])
def test_no_secret_is_compared_with_an_ordinary_operator(module):
    tree = ast.parse(Path(module.__file__).read_text())
    offenders = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            if names & SECRET_NAMES:
                offenders.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert offenders == []


# ----------------------------------------------------------------------------- no pickle

PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
PICKLING_CALLS = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                  "send_object_list", "recv_object_list", "read_pickle", "unsafe_load", "full_load"}
"""torch.distributed's *_object* collectives pickle; so does pandas' read_pickle; yaml's loaders run code."""
MODEL_CLASSES_SUFFIXES = ("Model", "ForCausalLM", "ModelForCausalLM")


def _keyword(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value.value if isinstance(kw.value, ast.Constant) else kw.value
    return None


def pickle_uses(source: str, filename: str = "<source>") -> list[str]:
    """Every way ``source`` could unpickle (or write pickles for something to unpickle later)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names if a.name.split(".")[0] in PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLING_MODULES:
            found.append(f"{where} imports from {node.module}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, owner = node.func.attr, ast.unparse(node.func.value)
            if name in PICKLING_CALLS:
                found.append(f"{where} calls {owner}.{name}")
            elif owner == "torch" and name == "load" and _keyword(node, "weights_only") is not True:
                found.append(f"{where} calls torch.load without weights_only=True")
            elif owner == "torch" and name == "save":
                found.append(f"{where} calls torch.save (a pickle)")
            elif owner in ("np", "numpy") and name == "load" and _keyword(node, "allow_pickle") is not False \
                    and _keyword(node, "allow_pickle") is not None:
                found.append(f"{where} calls np.load with allow_pickle")
            elif owner == "yaml" and name == "load":
                found.append(f"{where} calls yaml.load (use yaml.safe_load)")
            elif name == "from_pretrained" and owner.endswith(MODEL_CLASSES_SUFFIXES) \
                    and _keyword(node, "use_safetensors") is not True:
                found.append(f"{where} loads {owner} weights without use_safetensors=True")
    return found


def test_the_scanner_finds_every_kind_of_pickle_use():
    bad = "\n".join([
        "import pickle", "from cloudpickle import dumps", "import joblib.numpy_pickle",
        "torch.load(path)", "torch.load(path, weights_only=False)", "torch.save(obj, path)",
        "np.load(path, allow_pickle=True)", "dist.broadcast_object_list(objs)", "yaml.load(text)",
        "AutoModelForCausalLM.from_pretrained(d)",
    ])
    assert len(pickle_uses(bad)) == 10
    good = "\n".join(["torch.load(path, weights_only=True)", "np.load(path)", "yaml.safe_load(text)",
                      "AutoModelForCausalLM.from_pretrained(d, use_safetensors=True)",
                      "AutoTokenizer.from_pretrained(d)", "import json"])
    assert pickle_uses(good) == []


def test_no_module_on_the_data_path_uses_pickle():
    files = sorted(f for package in DATA_PATH_PACKAGES for f in (REPO / package).rglob("*.py"))
    assert len(files) > 40
    found = [use for f in files for use in pickle_uses(f.read_text(), str(f.relative_to(REPO)))]
    assert found == []


# ----------------------------------------------------------------------------- Kafka security

SASL_SSL = dict(bootstrap_servers="broker-1:9093,broker-2:9093", security_protocol="SASL_SSL",
                sasl_mechanism="SCRAM-SHA-512", sasl_username="svc-sao", sasl_password="s3cret-pw",
                ssl_cafile="/etc/kafka/ca.pem")
EXPECTED_OPTIONS = {"bootstrap_servers": ["broker-1:9093", "broker-2:9093"], "security_protocol": "SASL_SSL",
                    "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "svc-sao",
                    "sasl_plain_password": "s3cret-pw", "ssl_cafile": "/etc/kafka/ca.pem"}


class _Recorder:
    """Stands in for a kafka-python client class: records the options it was built with."""

    def __init__(self, built: list[dict], **options):
        built.append(options)

    def partitions_for_topic(self, topic):
        return {0}

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_sasl_ssl_settings_reach_the_producer_consumer_and_admin_client(monkeypatch):
    built: dict[str, list[dict]] = {"producer": [], "consumer": [], "admin": []}
    for name, attr in (("producer", "KafkaProducer"), ("consumer", "KafkaConsumer"), ("admin", "KafkaAdminClient")):
        monkeypatch.setattr(kafka_backend, attr, lambda _built=built[name], **kw: _Recorder(_built, **kw))
    backend = KafkaBackend(KafkaConfig(**SASL_SSL))
    assert {k: backend.client_options()[k] for k in EXPECTED_OPTIONS} == EXPECTED_OPTIONS
    backend.producer()
    backend.consumer(["t"])
    backend.consumer(["t"], group_id="g")
    with backend.admin():
        pass
    for name, options in built.items():
        assert options, f"no {name} was built"
        for o in options:
            assert {k: o[k] for k in EXPECTED_OPTIONS} == EXPECTED_OPTIONS, name


def test_sasl_settings_come_from_the_environment_and_the_password_stays_masked():
    env = {f"ONLINE_SAO__KAFKA__{k.upper()}": v for k, v in SASL_SSL.items()}
    cfg = load_config(environ=env)
    assert KafkaBackend(cfg.kafka).client_options()["sasl_plain_password"] == "s3cret-pw"
    shown = dump_config(cfg)
    assert "s3cret-pw" not in shown and "SCRAM-SHA-512" in shown
    assert "s3cret-pw" not in repr(cfg)
