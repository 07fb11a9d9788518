"""Redaction of prompt and response texts before an interaction is logged.

``serving.redact_hook`` names a callable as ``package.module:function``. It is imported once
when the app is built (:func:`load_redactor`; a name that does not import or is not callable
stops serving with a :class:`~online_sao.config.ConfigError`) and called for every interaction,
before the record is built, encoded, sent to Kafka or spooled, with the decoded texts and the
request's metadata. It returns the texts to log (:class:`Texts`) or None to log no text at all.
A hook that raises or returns something else logs no text (fails closed) and the error is
logged; the request is still answered.

What redaction does not do: the record keeps the token ids of prompt and response, which the
learner trains on and which decode to the original text. Redaction keeps texts out of the
logged fields (and out of anything that reads them: the judge, dashboards, dead letters); to
remove a user's data entirely, erase their records (docs/RELIABILITY.md, "Security and
erasure").

:func:`mask_contacts` is a built-in example: e-mail addresses and phone numbers are masked.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from online_sao.config import ConfigError

log = logging.getLogger(__name__)

EMAIL_MASK = "[email]"
PHONE_MASK = "[phone]"
_EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_PHONE = re.compile(r"(?<![\w+])\+?\d[\d ().-]{6,}\d(?!\w)")
MIN_PHONE_DIGITS = 7
"""Digit runs shorter than this (years, counts, prices) are not taken for phone numbers."""


@dataclass(frozen=True)
class Texts:
    """The decoded texts of one interaction (special tokens included, as logged)."""

    prompt: str
    response: str


@dataclass(frozen=True)
class RequestMetadata:
    """What the hook may use to decide: who asked, where, under which id."""

    interaction_id: str
    route: str
    """``chat`` or ``completions``."""
    model: str
    deployment_id: str
    user: str | None
    session_id: str | None


Redactor = Callable[[Texts, RequestMetadata], "Texts | None"]


def load_redactor(spec: str) -> Redactor:
    """The callable named ``package.module:function``; ConfigError naming the key when it cannot be used."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"serving.redact_hook: {spec!r} is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"serving.redact_hook: cannot import module {module_name!r}: {exc}") from exc
    hook = getattr(module, attr, None)
    if not callable(hook):
        raise ConfigError(f"serving.redact_hook: {module_name!r} has no callable {attr!r}")
    return hook


def apply_redactor(redactor: Redactor, texts: Texts, metadata: RequestMetadata) -> Texts | None:
    """The hook's answer; None (no text logged) when it fails or answers something else."""
    try:
        redacted = redactor(texts, metadata)
    except Exception:  # fail closed: an unredacted text must not be logged because the hook broke
        log.exception("serving.redact_hook failed for %s: logging it without text", metadata.interaction_id)
        return None
    if redacted is not None and not (isinstance(redacted, Texts) and isinstance(redacted.prompt, str)
                                     and isinstance(redacted.response, str)):
        log.error("serving.redact_hook returned %s for %s, not Texts or None: logging it without text",
                  type(redacted).__name__, metadata.interaction_id)
        return None
    return redacted


def _mask_phone(match: re.Match) -> str:
    digits = sum(c.isdigit() for c in match.group())
    return PHONE_MASK if digits >= MIN_PHONE_DIGITS else match.group()


def mask_text(text: str) -> str:
    """``text`` with e-mail addresses and phone numbers masked."""
    return _PHONE.sub(_mask_phone, _EMAIL.sub(EMAIL_MASK, text))


def mask_contacts(texts: Texts, metadata: RequestMetadata) -> Texts:
    """Built-in hook (``serving.redaction:mask_contacts``): e-mail addresses and phone numbers masked.

    It masks generously (any run of 7 or more digits with separators, a range like 1999-2024
    too) and knows no other kind of personal data: an example to start from, not a guarantee."""
    return Texts(prompt=mask_text(texts.prompt), response=mask_text(texts.response))
