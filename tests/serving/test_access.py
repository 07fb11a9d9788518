"""Who may reach what: no interactive API pages, and failed authentications rate limited per address."""

from __future__ import annotations

import pytest

from serving.auth import ApiKeyAuth, AuthError

KEY = "access-key-0123456789"
MODELS = "/v1/models"


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/docs/oauth2-redirect"])
def test_there_are_no_interactive_api_pages(make_harness, path):
    """FastAPI's Swagger UI and ReDoc answered 200 without a key (Swagger loading its scripts from a CDN)."""
    h = make_harness(**{"serving.api_keys": [KEY]})
    assert h.client.get(path).status_code == 404
    assert h.client.get("/openapi.json").status_code == 200  # what clients and the fuzz tests read


def test_wrong_keys_from_one_address_are_refused_with_429_once_its_failures_are_spent(make_harness):
    """A refused key took no token: 1000 wrong-key guesses from one address all got 401."""
    h = make_harness(**{"serving.api_keys": [KEY], "serving.rate_limit_burst": 3,
                        "serving.rate_limit_per_minute": 1})
    wrong = {"Authorization": "Bearer not-the-key"}
    assert [h.client.get(MODELS, headers=wrong).status_code for _ in range(5)] == [401, 401, 401, 429, 429]
    limited = h.client.get(MODELS)  # no key at all counts as a failure too
    assert limited.status_code == 429 and int(limited.headers["Retry-After"]) >= 1
    assert "failed authentications" in limited.json()["error"]["message"]
    assert h.client.get(MODELS, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200  # a key passes


def test_failed_authentications_are_counted_per_address_and_refilled_with_time():
    now = [0.0]
    auth = ApiKeyAuth([KEY], rate_per_minute=60, burst=2, clock=lambda: now[0])

    def status(client: str, key: str = "wrong") -> int:
        try:
            auth.check(f"Bearer {key}", client)
        except AuthError as refused:
            return refused.status
        return 200

    assert [status("10.0.0.1") for _ in range(3)] == [401, 401, 429]
    assert status("10.0.0.2") == 401  # another address has failures of its own
    assert status("127.0.0.1") == 401 and status("127.0.0.1") == 401 and status("127.0.0.1") == 429  # loopback too
    assert status("10.0.0.1", KEY) == 200  # the key's own bucket is untouched by the failures
    now[0] += 1.0  # one failure refilled
    assert status("10.0.0.1") == 401
