"""The smoke run's verdict: serving must answer with weights trained on this run's feedback.

A second ``online-sao smoke`` resumes from the first run's checkpoint: serving starts at the
version the first run reached (30 in the run that found this), and the learner may first
train on interactions the first run left behind. Neither proves this run's loop works.
"""

from __future__ import annotations

import http.server
import json
import threading

from apps.config import client_api_key, load_app_config
from apps.smoke import SmokeEvidence, _served_version, smoke_verdict

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
