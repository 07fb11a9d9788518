"""Signed interaction ids.

An id is ``sao-<issued_ms>-<nonce>-<mac>``: ``issued_ms`` the issue time in
milliseconds (hex), ``nonce`` 16 random bytes (hex) and ``mac`` the
HMAC-SHA256 (hex) under the feedback secret of ``deployment_id | issued_ms |
nonce``. Only this deployment (every process sharing its secret and
deployment id) can mint an id it accepts; the id carries its own age, so an id
older than the reward window, or issued further ahead of this process's clock
than replicas' clocks differ (:data:`MAX_ISSUED_AHEAD_S`), is refused without any
server-side state.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from typing import Callable

_PREFIX = "sao"
_NONCE_BYTES = 16
_ID_PATTERN = re.compile(r"^sao-([0-9a-f]{1,16})-([0-9a-f]{32})-([0-9a-f]{64})$")
MAX_ISSUED_AHEAD_S = 300.0
"""How far an id's issue time may be ahead of the verifying process's clock: replicas' clocks
differ by NTP's error (well under a second) or a stepped clock's correction, not minutes. An id
dated further ahead came from a replica whose clock is wrong or from a leaked secret, and would
never expire: the window counts from its issue time."""


class InteractionIdError(Exception):
    """An id this deployment does not accept; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class VerifiedId:
    interaction_id: str
    issued_at: float
    """Seconds since the epoch."""


class InteractionIdSigner:
    """Mints and verifies the ids of one deployment."""

    def __init__(self, secret: bytes, deployment_id: str, window_s: float,
                 clock: Callable[[], float] = time.time):
        if not secret:
            raise ValueError("the feedback secret is empty")
        self._secret = secret
        self._deployment = deployment_id.encode("utf-8")
        self._window_s = window_s
        self._clock = clock

    def _mac(self, issued_hex: str, nonce_hex: str) -> str:
        message = b"|".join((self._deployment, issued_hex.encode("ascii"), nonce_hex.encode("ascii")))
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def mint(self) -> str:
        issued_hex = format(int(self._clock() * 1000), "x")
        nonce_hex = secrets.token_hex(_NONCE_BYTES)
        return f"{_PREFIX}-{issued_hex}-{nonce_hex}-{self._mac(issued_hex, nonce_hex)}"

    def verify(self, interaction_id: str) -> VerifiedId:
        """The id's issue time, or :class:`InteractionIdError` (403 forged, 410 expired)."""
        match = _ID_PATTERN.fullmatch(interaction_id)  # match() takes a final "\n" as the end
        if match is None:
            raise InteractionIdError(403, "invalid_interaction_id",
                                     "interaction_id is not an id issued by this deployment (malformed)")
        issued_hex, nonce_hex, mac = match.groups()
        if not hmac.compare_digest(self._mac(issued_hex, nonce_hex), mac):
            raise InteractionIdError(403, "invalid_interaction_id",
                                     "interaction_id was not issued by this deployment (signature mismatch)")
        issued_at = int(issued_hex, 16) / 1000.0
        age = self._clock() - issued_at
        if age < -MAX_ISSUED_AHEAD_S:
            raise InteractionIdError(403, "invalid_interaction_id",
                                     f"interaction_id was issued {-age:.0f} s ahead of this server's clock "
                                     f"(at most {MAX_ISSUED_AHEAD_S:.0f} s is accepted)")
        if age > self._window_s:
            raise InteractionIdError(410, "interaction_expired",
                                     f"interaction_id was issued {_seconds(age)} s ago, beyond the reward "
                                     f"window of {_seconds(self._window_s)} s")
        return VerifiedId(interaction_id, issued_at)


def _seconds(value: float) -> str:
    """Whole seconds from 10 s up, three significant digits below: ``:.0f`` read a window under a second
    as "0 s", ``:g`` a fortnight as "1.2096e+06 s"."""
    return f"{value:.0f}" if value >= 10 else f"{value:.3g}"
