"""API keys and rate limits per key, or per client address without keys.

Keys are compared with :func:`hmac.compare_digest` against every configured key
(no early exit), so the time taken does not reveal how much of a key matched or
which key it was. Keys are required unless the server is bound to loopback, and there
neither a key nor the feedback secret may be a placeholder (:func:`check_exposure`
refuses to start otherwise).

Without configured keys the limit applies per client address: a caller on a
loopback address (this machine's own processes, which is every direct caller of
a server bound to loopback) is not limited at all; any other address (a reverse
proxy forwarding from elsewhere shows its own address) has its own bucket, an IPv6
address its /64 network's (:func:`client_bucket`); callers whose address is unknown
share one ``anonymous`` bucket.

Failed authentications (a missing or wrong key) are limited per client address too (IPv6 per /64), loopback
included, with the same rate and burst: a refused key takes no token of a key's bucket, and
1000 guesses from one address all got 401. Once an address has spent its failures, a failing
request is answered 429 instead of 401; a request with a valid key is never held back by them.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

from pydantic import SecretStr

from online_sao.config import ConfigError, ServingConfig

ANONYMOUS = "anonymous"
"""The caller without a key whose address is unknown."""
LOOPBACK = "loopback"
"""The caller without a key on a loopback address (not rate limited)."""
PLACEHOLDER_MARK = "change-me"
"""Marks the project's placeholder secrets: the built-in feedback secret and those of the compose
and Kubernetes examples, all public in the repository. On an exposed server anyone could sign
interaction ids with such a secret (and log rewards for them), or call it with such a key."""
FAILED_AUTHENTICATION = "failed authentication from"
"""Names the bucket of one client address's failed authentications, apart from every key's and address's own."""
MAX_TRACKED_CALLERS = 10_000
"""Buckets kept before refilled ones are forgotten: a full bucket is the same as a
new one, so forgetting it changes no decision, and many client addresses cannot
grow the table without bound."""
IPV6_CLIENT_PREFIX = 64
"""IPv6 clients are counted per /64 network: one subscriber is routinely given a whole /64 (2**64
addresses), and a bucket per address let one client spread its requests, and its key guesses, over
as many buckets as it liked."""


class AuthError(Exception):
    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


def retry_after_header_s(wait_s: float) -> int:
    """Whole seconds a rate-limited client is told to wait, in its message and its Retry-After: rounded up
    (a client that waits as long as it is told finds a token; 1.2 s rounded to 1 did not), at least 1 (the
    header takes whole seconds, and the message said "retry in 0.0 s" beside a Retry-After of 1)."""
    return max(1, math.ceil(wait_s))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def client_bucket(client: str) -> str:
    """The name under which ``client``'s requests are counted: an IPv4 address as it is (also when
    written IPv4-mapped, ``::ffff:a.b.c.d``), an IPv6 address as its /64 network
    (:data:`IPV6_CLIENT_PREFIX`), anything else (not an IP address) as given."""
    try:
        address = ipaddress.ip_address(client)
    except ValueError:
        return client
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network((int(address), IPV6_CLIENT_PREFIX), strict=False))
    return str(address)


def check_exposure(cfg: ServingConfig) -> None:
    """Refuse to serve on a non-loopback address without API keys, or with a placeholder
    (:data:`PLACEHOLDER_MARK`) for a key or the feedback secret."""
    if is_loopback(cfg.host):
        return
    keys = [key.get_secret_value() for key in cfg.api_keys]
    if not keys:
        raise ConfigError(f"serving.host is {cfg.host!r} (not loopback) but serving.api_keys is empty: "
                          "configure at least one API key or bind to 127.0.0.1")
    if _placeholder(cfg.feedback_secret.get_secret_value()):
        raise ConfigError(f"serving.host is {cfg.host!r} (not loopback) but serving.feedback_secret is a "
                          "placeholder, public in the repository (anyone could sign interaction ids): set "
                          "your own, e.g. ONLINE_SAO__SERVING__FEEDBACK_SECRET=$(openssl rand -hex 32), "
                          "or bind to 127.0.0.1")
    placeholders = sum(map(_placeholder, keys))
    if placeholders:
        raise ConfigError(f"serving.host is {cfg.host!r} (not loopback) but {placeholders} of serving.api_keys "
                          "is a placeholder, public in the repository: set your own keys or bind to 127.0.0.1")


def key_name(key: bytes) -> str:
    """The caller name of an API key (:meth:`ApiKeyAuth.identify`): a hash prefix, not the secret."""
    return hashlib.sha256(key).hexdigest()[:16]


def source_callers(source_keys: dict[str, list[SecretStr]]) -> dict[str, frozenset[str]]:
    """``serving.source_keys`` as source -> the caller names of its keys."""
    return {source: frozenset(key_name(key.get_secret_value().encode("utf-8")) for key in keys)
            for source, keys in source_keys.items()}


def _placeholder(value: str) -> bool:
    """Whether a configured secret is one of the project's placeholders. Checked once at start
    against a constant, never against a caller's input: its timing reveals nothing."""
    return PLACEHOLDER_MARK in value


@dataclass
class TokenBucket:
    """``capacity`` tokens, refilled at ``rate_per_s``; one request takes one token."""

    capacity: float
    rate_per_s: float
    tokens: float
    updated: float

    def take(self, now: float) -> float:
        """0 when a token was taken, else the seconds until one is available."""
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate_per_s)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s


class ApiKeyAuth:
    """Authenticates ``Authorization: Bearer <key>`` and applies the key's rate limit."""

    def __init__(self, api_keys: list[str], rate_per_minute: int, burst: int,
                 clock: Callable[[], float] = time.monotonic):
        self._keys = [k.encode("utf-8") for k in api_keys]
        self._rate_per_s = rate_per_minute / 60.0
        self._burst = float(burst)
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def identify(self, authorization: str | None, client: str | None = None) -> str:
        """A stable, non-secret name of the caller's key (a hash prefix), or AuthError 401.

        Without configured keys the caller is named by ``client``, its network address:
        :data:`LOOPBACK` for a loopback address, :data:`ANONYMOUS` when unknown."""
        if not self._keys:
            if client is None:
                return ANONYMOUS
            return LOOPBACK if is_loopback(client) else f"address {client_bucket(client)}"
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise AuthError(401, "missing_api_key", "missing API key: send 'Authorization: Bearer <key>'")
        candidate = given.strip().encode("utf-8")
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(key, candidate)
        if not matched:
            raise AuthError(401, "invalid_api_key", "invalid API key")
        return key_name(candidate)

    def admit(self, caller: str) -> None:
        """Take one token from the caller's bucket, or AuthError 429 with a retry hint."""
        if caller != LOOPBACK:
            self._take(caller, "rate limit exceeded")

    def _take(self, bucket_name: str, refusal: str) -> None:
        """Take one token from bucket ``bucket_name``, or AuthError 429 saying ``refusal`` and when to retry."""
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get(bucket_name)
            if bucket is None:
                if len(self._buckets) >= MAX_TRACKED_CALLERS:
                    self._forget_refilled(now)
                bucket = self._buckets[bucket_name] = TokenBucket(self._burst, self._rate_per_s, self._burst, now)
            wait_s = bucket.take(now)
        if wait_s > 0:
            retry_s = retry_after_header_s(wait_s)
            raise AuthError(429, "rate_limit_exceeded", f"{refusal}: retry in {retry_s} s", retry_after_s=retry_s)

    def _forget_refilled(self, now: float) -> None:
        full = [caller for caller, b in self._buckets.items()
                if b.tokens + (now - b.updated) * b.rate_per_s >= b.capacity]
        for caller in full:
            del self._buckets[caller]

    def check(self, authorization: str | None, client: str | None = None) -> str:
        """Authenticate and rate-limit one request; ``client`` is its network address. A failed
        authentication takes a token of its address's failures, or is AuthError 429 once they are spent."""
        try:
            caller = self.identify(authorization, client)
        except AuthError:
            self._take(f"{FAILED_AUTHENTICATION} {client_bucket(client) if client else ANONYMOUS}",
                       "too many failed authentications")
            raise
        self.admit(caller)
        return caller
