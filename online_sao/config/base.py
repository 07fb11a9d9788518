"""What every configuration section shares: the error a bad value raises and the model base."""

from __future__ import annotations

import re
from pathlib import PurePath
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key."""


NUMBER_TYPES = (int, float)


def _options(annotation: Any) -> list[Any]:
    """The types a field's annotation allows, None left out (``int | None`` -> ``[int]``)."""
    if get_origin(annotation) in (Union, UnionType):
        return [a for a in get_args(annotation) if a is not type(None)]
    return [annotation]


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_number(annotation: Any) -> bool:
    """An int or float field (optional or not) that takes no boolean of its own."""
    options = _options(annotation)
    return bool(options) and all(o in NUMBER_TYPES for o in options)


BOOLEAN_NUMBER = "a boolean is not a number (YAML reads yes/no/on/off/true/false as booleans)"


class Section(BaseModel):
    # allow_inf_nan: a rate, window or penalty of .inf (or an unbounded field of .nan) passed the bounds
    # and failed later, e.g. every learner step refused as non-finite
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _plain_value(cls, value: Any, info: ValidationInfo) -> Any:
        """What YAML gives a field, before its type's own conversion: a section with nothing under it
        (``serving:`` with every line commented out: None) is an empty section, as it is when an
        environment variable or ``--set`` touches it; a boolean given to a number (``off`` -> 0: the
        lax conversion turned ``metrics_port: off`` into "any free port") is refused."""
        field = cls.model_fields.get(info.field_name) if info.field_name else None
        if field is None:
            return value
        annotation = field.annotation
        if value is None and _is_section(annotation):
            return {}
        if isinstance(value, bool) and _is_number(annotation):
            raise ValueError(BOOLEAN_NUMBER)
        if isinstance(value, dict) and get_origin(annotation) is dict and _is_number(get_args(annotation)[1]):
            booleans = sorted(str(k) for k, v in value.items() if isinstance(v, bool))
            if booleans:
                raise ValueError(f"{BOOLEAN_NUMBER}: {', '.join(booleans)}")
        return value


def expand_home(value: Any) -> Any:
    """A path field's value with ``~`` expanded (for a field read as is where it is used, not through
    one of :class:`~online_sao.config.Config`'s path properties, which expand it themselves)."""
    if not isinstance(value, PurePath):
        return value
    try:
        return value.expanduser()
    except RuntimeError as exc:  # ~user of no such user, or no home directory
        raise ValueError(f"cannot expand {str(value)!r}: {exc}") from None


MASKED_PASSWORD = "***"
"""What a URL's password is shown as."""
_URL_PASSWORD = re.compile(r"(?P<user>\b[A-Za-z][A-Za-z0-9+.-]*://[^/?#:@\s'\"]*):[^/?#\s'\"]*@")
"""A URL's scheme and user, then its password up to the last ``@`` of the authority, which ends at the
first ``/``, ``?`` or ``#`` (as urllib and requests read a URL; a raw ``@`` in a password stays masked)."""
_DATABASE_URL_PASSWORD = re.compile(
    r"(?P<user>\b(?:postgres(?:ql)?|mysql|mariadb|mssql|oracle|sqlite|cockroachdb)(?:\+\w+)?://[^/?#:@\s'\"]*)"
    r":\S*@")
"""A database URL's scheme and user, then its password up to the URL's last ``@``: SQLAlchemy (MLflow's
database stores) takes everything after the user's ``:`` up to an ``@`` as the password, ``/``, ``?``,
``#`` and quotes included, where the rule above would stop and leave such a password in clear."""
_QUERY_PASSWORD = re.compile(r"(?P<key>[?&;](?:password|passwd|pwd|sslpassword)=)[^&\s'\"]+", re.IGNORECASE)
"""A password given as a URL's query parameter (``postgresql://db/mlflow?user=ml&password=pw``, as the
database drivers behind SQLAlchemy take it; ``passwd`` for MySQL's, ``pwd`` for ODBC's, ``sslpassword``
for libpq's client key), up to the next parameter: a ``#`` is the password's (SQLAlchemy reads the query
to the URL's end)."""
_ENCODED_ODBC_PASSWORD = re.compile(
    r"(?P<key>(?:%3B|[=;&?])(?:pwd|password)%3D)(?:%7B(?:(?!%7D)[^\s'\"]|%7D%7D)*(?:%7D)?|(?:(?!%3B)[^&\s'\"])+)",
    re.IGNORECASE)
"""The password inside a percent-encoded ODBC connection string (``?odbc_connect=DRIVER%3D...%3BPWD%3Dpw``,
the form SQLAlchemy's documentation gives for pyodbc), up to its next ``;`` (``%3B``), or in braces
(``%7B...%7D``, ODBC's quoting of a password holding ``;``, a ``}`` in it doubled) to the closing one."""


def mask_uri_password(text: str | None) -> str | None:
    """``text`` with the password of every URL in it masked (``postgresql://user:pw@db/x`` ->
    ``postgresql://user:***@db/x``; a query parameter ``password``, ``passwd`` or ``pwd``:
    ``?user=ml&password=***``): a configured URL, or a message quoting one (httpx's errors
    name the URL they asked), for wherever it is shown or logged. Text without one is returned as
    given."""
    if not text:
        return text
    masked = _DATABASE_URL_PASSWORD.sub(rf"\g<user>:{MASKED_PASSWORD}@", text)
    masked = _QUERY_PASSWORD.sub(rf"\g<key>{MASKED_PASSWORD}", masked)
    masked = _ENCODED_ODBC_PASSWORD.sub(rf"\g<key>{MASKED_PASSWORD}", masked)
    return _URL_PASSWORD.sub(rf"\g<user>:{MASKED_PASSWORD}@", masked)
