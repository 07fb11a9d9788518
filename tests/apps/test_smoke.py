"""The smoke run's verdict: serving must answer with weights trained on this run's feedback; and the
state it runs on, which is its own.

A second ``online-sao smoke`` resumed from the first run's checkpoint (the deployment's, until smoke
got state of its own): serving started at the version the first run reached (30 in the run that
found this), and the learner could first train on interactions the first run left behind. Neither
proves this run's loop works, so the verdict still checks both.
"""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from apps.config import client_api_key, load_app_config
from apps.smoke import SmokeEvidence, _served_version, run_smoke, smoke_verdict

RUN = frozenset({"new-1", "new-2", "new-3"})
"""This run's interaction ids."""


def evidence(start: int, served: int, version_steps: dict[int, int], trained: list[tuple[int, str]]) -> SmokeEvidence:
    return SmokeEvidence(start_version=start, served_version=served, version_steps=version_steps,
                         trained=trained, run_ids=RUN)


def test_a_first_run_passes_once_serving_answers_with_weights_trained_on_its_feedback():
    trained = [(1, "new-1"), (1, "new-2"), (2, "new-3")]
    assert smoke_verdict(evidence(0, 2, {1: 1, 2: 2}, trained)) is None
    assert smoke_verdict(evidence(0, 1, {1: 1, 2: 2}, trained)) is None  # step 1 trained on new-1 already


def test_a_second_run_does_not_pass_on_the_version_it_started_with():
    old = [(step, f"old-{step}") for step in range(1, 31)]
    failure = smoke_verdict(evidence(30, 30, {30: 30}, old))  # what the old check (version > 0) passed
    assert failure is not None and "started with was 30" in failure


def test_a_version_trained_only_on_an_earlier_runs_leftovers_does_not_pass():
    trained = [(step, f"old-{step}") for step in range(1, 32)]  # step 31: interactions of the first run
    failure = smoke_verdict(evidence(30, 31, {30: 30, 31: 31}, trained))
    assert failure is not None and "none of this run's 3 interactions" in failure


def test_a_version_published_before_the_first_step_on_this_runs_feedback_does_not_pass_yet():
    trained = [(31, "old-31"), (32, "new-1")]
    failure = smoke_verdict(evidence(30, 31, {31: 31, 32: 32}, trained))
    assert failure is not None and "before step 32" in failure
    assert smoke_verdict(evidence(30, 32, {31: 31, 32: 32}, trained)) is None


def test_a_served_version_without_its_notice_does_not_pass():
    failure = smoke_verdict(evidence(30, 32, {31: 31}, [(31, "new-1")]))
    assert failure is not None and "no weights notice" in failure


def test_the_smoke_client_sends_the_first_configured_key(free_port):
    """With serving.api_keys set, serving asks even loopback callers for a key: the smoke run sent
    "local" and failed on KeyError 'data' (the 401's body), the load run's own stack got 401s."""
    keys = []

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            keys.append(self.headers.get("Authorization"))
            body = json.dumps({"data": [{"id": "m", "policy_version": 7}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", free_port), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = load_app_config(environ={}, overrides={"serving.api_keys": ["first", "second"]})
        assert client_api_key(cfg) == "first" and client_api_key(load_app_config(environ={})) is None
        assert _served_version(f"http://127.0.0.1:{free_port}", "m", {"Authorization": "Bearer first"}) == 7
        assert keys == ["Bearer first"]
    finally:
        server.shutdown()


def test_the_smoke_requests_ask_for_no_more_than_serving_grants():
    """48 was hard-coded: with serving.max_new_tokens below it, serving refused every smoke request."""
    from apps.smoke import SMOKE_MAX_TOKENS, smoke_max_tokens

    assert smoke_max_tokens(load_app_config(environ={}, overrides={"serving.max_new_tokens": 16})) == 16
    assert smoke_max_tokens(load_app_config(environ={})) == SMOKE_MAX_TOKENS


class StopAtBroker(Exception):
    """Ends a smoke run once its stack is made: only the overrides it was made with are looked at."""


def _smoke_stack_overrides(monkeypatch, deployment_settings: dict) -> tuple[dict, Path]:
    """The overrides and run directory of the stack ``online-sao smoke --set <deployment_settings>`` starts."""
    made = []

    class FakeStack:
        def __init__(self, config_path, overrides, run_dir, progress=print):
            made.append((overrides, run_dir))

        def __enter__(self):
            raise StopAtBroker

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr("apps.smoke.Stack", FakeStack)
    with pytest.raises(StopAtBroker):
        run_smoke(load_app_config(environ={}, overrides=deployment_settings), overrides=deployment_settings)
    return made[0]


def test_smoke_runs_on_state_of_its_own_and_leaves_the_deployments_alone(tmp_path, monkeypatch):
    """Smoke overrode the port and two learner settings only: its learner resumed the deployment's
    checkpoint, trained it on made-up rewards, published onto the weights topic every replica follows
    and registered versions into the deployment's registered model (whose aliases the canary and the
    roll-back read), while its serving took the deployment's spool."""
    settings = {"paths.data_dir": str(tmp_path), "kafka.topics.weights": "prod.weights",
                "mlflow.registered_model": "prod-policy", "trainer.metrics_port": 9400}
    deployment = load_app_config(environ={}, overrides=settings)

    overrides, run_dir = _smoke_stack_overrides(monkeypatch, settings)
    run = load_app_config(environ={}, overrides=overrides)

    for role in ("interactions", "rewards", "weights", "dead_letters"):
        assert getattr(run.kafka.topics, role) != getattr(deployment.kafka.topics, role)
        assert getattr(run.kafka.topics, role) == f"{getattr(deployment.kafka.topics, role)}.{run_dir.name}"
    assert run_dir.parent == tmp_path / "runs" and run_dir.name.startswith("smoke-")
    assert run.trainer.consumer_group != deployment.trainer.consumer_group
    assert run.checkpoint_dir == run_dir / "checkpoints" and run.spool_dir == run_dir / "spool"
    assert run.weight_store_url == str(run_dir / "weights")
    assert run.mlflow.registered_model == f"prod-policy.{run_dir.name}"
    assert run.mlflow.experiment == f"{deployment.mlflow.experiment}.{run_dir.name}"
    assert run.mlflow_uri == deployment.mlflow_uri  # the configured tracking server is still exercised
    assert run.trainer.metrics_port == 0  # the deployment's learner may hold 9400


def test_the_smoke_verdict_reads_the_runs_own_weights_topic_and_ledger(tmp_path, monkeypatch):
    """The verdict read the ledger under the deployment's checkpoint directory and the deployment's
    weights topic (on which an operator's hold kept serving at its version: 240 s, then a failure)."""
    read = {}

    class Stack:
        def __init__(self, config_path, overrides, run_dir, progress=print):
            self.cfg = load_app_config(config_path, environ={}, overrides=overrides)
            read["run_dir"] = run_dir

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def start_broker(self):
            pass

        def start(self, name, command):
            pass

        def wait_http(self, *args, **kwargs):
            pass

        def check_alive(self):
            pass

        def stop_components(self):
            read.setdefault("events", []).append("stopped")

    class Notices:
        def consumer(self, topics, group_id, start):
            read["topics"] = topics
            return self

        def close(self):
            pass

    class Reply:
        def __init__(self, n):
            self.model_extra = {"interaction_id": f"i-{n}", "policy_version": 0}
            self.choices = [SimpleNamespace(message=SimpleNamespace(content="Keep it short and clear."))]

    class Client:
        def __init__(self, **kwargs):
            sent = iter(range(1000))
            self.chat = SimpleNamespace(completions=SimpleNamespace(create=lambda **kw: Reply(next(sent))))

    def ledger(checkpoint_dir, refused):
        read["ledger"] = checkpoint_dir
        return [(1, "i-0")]

    versions = iter([0, 1])
    monkeypatch.setattr("apps.smoke.Stack", Stack)
    monkeypatch.setattr("apps.default_model.builder.build_base_model", lambda cfg: "model")
    monkeypatch.setattr("apps.smoke._served_version", lambda *args: next(versions))
    monkeypatch.setattr("apps.smoke.httpx.post", lambda *args, **kwargs: SimpleNamespace(raise_for_status=lambda: None))
    monkeypatch.setattr("openai.OpenAI", Client)
    monkeypatch.setattr("streams.kafka_backend.KafkaBackend", lambda kafka: Notices())
    monkeypatch.setattr("apps.smoke._published_steps", lambda consumer, model: {1: 1})
    monkeypatch.setattr("apps.smoke.read_ledger", ledger)
    from apps.run_state import RunState  # its check: the state named is the run's own, not the deployment's

    monkeypatch.setattr("apps.run_state.remove_run_state_of", lambda cfg, run_dir: read.setdefault(
        "events", []).append(("removed", RunState.of(cfg, run_dir).paths[0].parent)))
    settings = {"paths.data_dir": str(tmp_path)}
    deployment = load_app_config(environ={}, overrides=settings)

    assert run_smoke(deployment, overrides=settings, requests=2) == 0

    run_dir = read["run_dir"]
    assert read["events"] == ["stopped", ("removed", run_dir)]  # the passed run's own state, processes first
    assert read["ledger"] == run_dir / "checkpoints" != deployment.checkpoint_dir
    assert read["topics"] == [f"{deployment.kafka.topics.weights}.{run_dir.name}"] != [deployment.kafka.topics.weights]
