"""Signed interaction ids and API-key auth with rate limits."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from serving import auth as auth_module
from serving.auth import ANONYMOUS, ApiKeyAuth, AuthError, check_exposure, client_bucket, is_loopback
from online_sao.config import ServingConfig
from serving.ids import InteractionIdError, InteractionIdSigner


class Clock:
    def __init__(self, now: float = 1_700_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_minted_ids_verify_and_are_unique():
    clock = Clock()
    signer = InteractionIdSigner(b"secret", "dep-a", window_s=300, clock=clock)
    ids = {signer.mint() for _ in range(50)}
    assert len(ids) == 50
    for i in ids:
        assert signer.verify(i).issued_at == pytest.approx(clock.now, abs=0.001)


def test_an_id_of_another_deployment_or_secret_is_refused_with_403():
    clock = Clock()
    ours = InteractionIdSigner(b"secret", "dep-a", 300, clock)
    other_deployment = InteractionIdSigner(b"secret", "dep-b", 300, clock).mint()
    other_secret = InteractionIdSigner(b"other", "dep-a", 300, clock).mint()
    for foreign in (other_deployment, other_secret):
        with pytest.raises(InteractionIdError) as err:
            ours.verify(foreign)
        assert err.value.status == 403 and "signature" in err.value.message


@pytest.mark.parametrize("tamper", [
    lambda i: i[:-1] + ("0" if i[-1] != "0" else "1"),          # mac changed
    lambda i: i.replace("sao-", "sao-1", 1),                      # issue time changed
    lambda i: "sao-1-" + "0" * 32 + "-" + "0" * 64,               # made up
    lambda i: "chatcmpl-123",                                     # not ours at all
    lambda i: "",
    lambda i: i + "\n",  # read from a file: a reward logged under it would never join (exact ids)
])
def test_forged_ids_are_refused(tamper):
    signer = InteractionIdSigner(b"secret", "dep", 300, Clock())
    with pytest.raises(InteractionIdError) as err:
        signer.verify(tamper(signer.mint()))
    assert err.value.status == 403


def test_an_id_older_than_the_window_is_refused_with_410():
    clock = Clock()
    signer = InteractionIdSigner(b"secret", "dep", window_s=300, clock=clock)
    issued = signer.mint()
    clock.now += 299.0
    signer.verify(issued)
    clock.now += 2.0
    with pytest.raises(InteractionIdError) as err:
        signer.verify(issued)
    assert err.value.status == 410 and "301 s ago" in err.value.message


def test_a_sub_second_window_is_named_as_it_is_set_in_the_410():
    """The ages and the window were rounded to whole seconds: "issued 0 s ago, beyond the reward window of 0 s"."""
    clock = Clock()
    signer = InteractionIdSigner(b"secret", "dep", window_s=0.25, clock=clock)
    issued = signer.mint()
    clock.now += 0.5
    with pytest.raises(InteractionIdError) as err:
        signer.verify(issued)
    assert err.value.status == 410
    assert err.value.message.endswith("issued 0.5 s ago, beyond the reward window of 0.25 s")


def test_an_id_issued_ahead_of_the_clock_by_more_than_the_skew_is_refused_with_403():
    """An id dated in the future used to pass whatever its date, and so never expired (a replica
    with a wrong clock, or ids minted with a leaked secret)."""
    clock = Clock()
    ahead = Clock(clock.now + 300.0)
    issued = InteractionIdSigner(b"secret", "dep", window_s=600, clock=ahead).mint()
    signer = InteractionIdSigner(b"secret", "dep", window_s=600, clock=clock)
    assert signer.verify(issued).issued_at == pytest.approx(clock.now + 300.0)  # within the skew
    ahead.now += 2.0
    with pytest.raises(InteractionIdError) as err:
        signer.verify(InteractionIdSigner(b"secret", "dep", window_s=600, clock=ahead).mint())
    assert err.value.status == 403 and "302 s ahead" in err.value.message


def test_auth_without_keys_admits_everyone_without_a_key():
    auth = ApiKeyAuth([], rate_per_minute=60, burst=5)
    assert not auth.required
    assert auth.check(None, client="10.0.0.1") == auth.check("Bearer whatever", client="10.0.0.1")
    assert auth.check(None) == ANONYMOUS  # the address is unknown


def test_without_keys_each_client_address_has_its_own_bucket_and_loopback_none():
    clock = Clock(0.0)
    auth = ApiKeyAuth([], rate_per_minute=60, burst=3, clock=clock)
    for _ in range(3):
        auth.check(None, client="10.0.0.1")
    with pytest.raises(AuthError) as err:
        auth.check(None, client="10.0.0.1")
    assert err.value.status == 429
    auth.check(None, client="10.0.0.2")  # another address is not slowed down by the first
    for _ in range(100):  # the machine's own processes are not limited
        auth.check(None, client="127.0.0.1")
        auth.check(None, client="::1")
    for _ in range(3):
        auth.check(None)
    with pytest.raises(AuthError):  # callers of unknown address share one bucket
        auth.check(None)


@pytest.mark.parametrize("client, bucket", [
    ("10.0.0.1", "10.0.0.1"),
    ("::ffff:10.0.0.1", "10.0.0.1"),  # the same IPv4 client, written IPv4-mapped by a dual-stack socket
    ("2001:db8:1:2:aaaa:bbbb:cccc:dddd", "2001:db8:1:2::/64"),
    ("2001:db8:1:2::1", "2001:db8:1:2::/64"),
    ("fe80::1%eth0", "fe80::/64"),
    ("testclient", "testclient"),  # not an IP address (Starlette's test client)
])
def test_a_client_is_counted_by_its_ipv4_address_or_its_ipv6_slash_64(client, bucket):
    assert client_bucket(client) == bucket


def test_an_ipv6_client_cannot_escape_its_limits_by_changing_address_within_its_slash_64():
    """One subscriber holds a whole /64: a bucket per address gave it 2**64 of them, for requests without
    keys and for key guesses alike."""
    clock = Clock(0.0)
    open_auth = ApiKeyAuth([], rate_per_minute=60, burst=3, clock=clock)
    keyed_auth = ApiKeyAuth(["sk-real"], rate_per_minute=60, burst=3, clock=clock)
    for k in range(3):
        open_auth.check(None, client=f"2001:db8::{k + 1}")
        with pytest.raises(AuthError) as refused:
            keyed_auth.check("Bearer sk-guess", client=f"2001:db8::{k + 1}")
        assert refused.value.status == 401
    with pytest.raises(AuthError) as limited:
        open_auth.check(None, client="2001:db8::ffff")
    assert limited.value.status == 429
    with pytest.raises(AuthError) as limited:
        keyed_auth.check("Bearer sk-guess", client="2001:db8::ffff")
    assert limited.value.status == 429
    open_auth.check(None, client="2001:db8:0:1::1")  # the next /64 is another client
    assert keyed_auth.check("Bearer sk-real", client="2001:db8::ffff")  # a valid key is never held back


def test_many_client_addresses_do_not_grow_the_buckets_without_bound(monkeypatch):
    monkeypatch.setattr(auth_module, "MAX_TRACKED_CALLERS", 10)
    clock = Clock(0.0)
    auth = ApiKeyAuth([], rate_per_minute=60, burst=2, clock=clock)  # refills one token per second
    for i in range(50):
        auth.check(None, client=f"10.0.0.{i}")
        clock.now += 2.0  # every earlier bucket has refilled: forgetting it changes no decision
    assert len(auth._buckets) <= 10
    auth.check(None, client="10.0.0.49")
    auth.check(None, client="10.0.0.49")  # refilled to 2 since its first request: now empty
    for i in range(20):  # many new addresses at once: an empty bucket is not forgotten
        auth.check(None, client=f"10.1.0.{i}")
    with pytest.raises(AuthError):
        auth.check(None, client="10.0.0.49")


def test_a_script_on_the_same_machine_is_not_rate_limited_without_keys(make_harness):
    h = make_harness(**{"serving.rate_limit_per_minute": 1, "serving.rate_limit_burst": 5})
    local = TestClient(h.client.app, client=("127.0.0.1", 50123))
    statuses = Counter(local.get("/v1/models").status_code for _ in range(100))
    assert statuses == {200: 100}
    remote = TestClient(h.client.app, client=("192.0.2.7", 50124))  # another machine's address has a limit
    assert [remote.get("/v1/models").status_code for _ in range(7)] == [200] * 5 + [429] * 2


def test_auth_with_keys_refuses_missing_and_wrong_keys():
    auth = ApiKeyAuth(["k-one", "k-two"], rate_per_minute=60, burst=5)
    assert auth.check("Bearer k-two") != auth.check("Bearer k-one")
    for header, code in ((None, "missing_api_key"), ("k-one", "missing_api_key"), ("Basic k-one", "missing_api_key"),
                         ("Bearer k-on", "invalid_api_key"), ("Bearer k-one2", "invalid_api_key")):
        with pytest.raises(AuthError) as err:
            auth.check(header)
        assert (err.value.status, err.value.code) == (401, code)


def test_rate_limit_is_a_token_bucket_per_key():
    clock = Clock(0.0)
    auth = ApiKeyAuth(["a", "b"], rate_per_minute=60, burst=3, clock=clock)  # one token per second
    for _ in range(3):
        auth.check("Bearer a")
    with pytest.raises(AuthError) as err:
        auth.check("Bearer a")
    assert err.value.status == 429 and err.value.retry_after_s == pytest.approx(1.0)
    auth.check("Bearer b")  # another key has its own bucket
    clock.now += 1.0
    auth.check("Bearer a")  # refilled one token
    with pytest.raises(AuthError):
        auth.check("Bearer a")


def test_a_rate_limited_client_is_told_the_same_whole_seconds_in_the_message_and_retry_after():
    """The message said "retry in 0.0 s" (a wait under 50 ms) beside a Retry-After of 1."""
    clock = Clock(0.0)
    auth = ApiKeyAuth(["a"], rate_per_minute=60, burst=1, clock=clock)  # one token per second
    auth.check("Bearer a")
    for elapsed, told in ((0.96, 1), (0.0, 1)):
        clock.now += elapsed
        with pytest.raises(AuthError) as err:
            auth.check("Bearer a")
        assert err.value.retry_after_s == told and f"retry in {told} s" in err.value.message
    clock.now += 1.0  # a client that waits as long as it was told finds a token
    auth.check("Bearer a")


def test_retry_after_is_rounded_up_so_a_client_that_waits_that_long_is_admitted():
    """50 a minute: the next token comes 1.2 s after the burst's last; Retry-After said 1."""
    from serving.errors import APIError
    from serving.routes import authorizer

    clock = Clock(0.0)
    authorize = authorizer(ApiKeyAuth(["k"], rate_per_minute=50, burst=1, clock=clock))
    request = SimpleNamespace(headers={"authorization": "Bearer k"}, client=None)
    authorize(request)
    with pytest.raises(APIError) as refused:
        authorize(request)
    assert refused.value.headers["Retry-After"] == "2"
    clock.now += 2.0
    authorize(request)


def _serving(host: str, keys: list[str], secret: str = "a-secret-of-our-own") -> ServingConfig:
    return ServingConfig(host=host, api_keys=keys, feedback_secret=secret)


def test_keys_are_required_unless_bound_to_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    check_exposure(_serving("127.0.0.1", []))
    check_exposure(_serving("0.0.0.0", ["key"]))
    with pytest.raises(ValueError, match="api_keys is empty"):
        check_exposure(_serving("0.0.0.0", []))


def test_an_exposed_server_refuses_the_placeholder_secret_and_keys():
    """The built-in feedback secret and the examples' placeholders are public: exposed with one,
    anyone with a key could sign interaction ids that verify (and log rewards for them)."""
    default_secret = ServingConfig().feedback_secret.get_secret_value()
    with pytest.raises(ValueError, match="feedback_secret is a placeholder"):
        check_exposure(_serving("0.0.0.0", ["key"], default_secret))
    with pytest.raises(ValueError, match="feedback_secret is a placeholder"):
        check_exposure(_serving("10.1.2.3", ["key"], "change-me-k8s-feedback-secret"))
    with pytest.raises(ValueError, match="1 of serving.api_keys is a placeholder"):
        check_exposure(_serving("0.0.0.0", ["key", "sk-compose-change-me"]))
    check_exposure(_serving("127.0.0.1", [], default_secret))  # on loopback the default is fine


def test_a_long_window_is_named_in_whole_seconds_in_the_410():
    """``:g`` read a fortnight as "1.2096e+06 s"."""
    clock = Clock()
    signer = InteractionIdSigner(b"secret", "dep", window_s=14 * 86_400, clock=clock)
    issued = signer.mint()
    clock.now += 14 * 86_400 + 100
    with pytest.raises(InteractionIdError) as err:
        signer.verify(issued)
    assert err.value.message.endswith("issued 1209700 s ago, beyond the reward window of 1209600 s")
