"""Every key of a configuration tree as Markdown, from the fields' own types, bounds and docstrings.

``online-sao config reference`` prints it for the applications' tree; docs/CONFIG.md is that
output, and a test keeps the two equal, so the reference cannot fall behind the code.
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from online_sao.config.base import Section
from online_sao.config.tree import ENV_PREFIX

BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥", "max_length": "length ≤"}
"""How each bound pydantic keeps in a field's metadata is written."""
SECRET_DEFAULT = "a development value: set your own"
"""Written instead of a secret's default (the value itself is not printed)."""
LONG_DEFAULT = 100
"""Characters of a default beyond which it is written in a block of its own, not inline."""


def type_name(annotation: Any) -> str:
    """``int``, ``str | None``, ``list[str]``, ``"padded" | "flat"``, ... as the YAML file sees them."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    if annotation is SecretStr:
        return "secret"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def bounds(field: FieldInfo) -> list[str]:
    """The field's bounds and pattern, e.g. ``["≥ 1", "≤ 65535"]``."""
    out = []
    for item in field.metadata:
        for attr, symbol in BOUNDS.items():
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{symbol} {value}")
        pattern = getattr(item, "pattern", None)
        if pattern is not None:
            out.append(f"matches `{pattern}`")
    return out


def default_text(field: FieldInfo) -> str | None:
    """The default as YAML would write it (JSON flow style); None for a required field."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return None
    else:
        value = field.default
    if isinstance(value, SecretStr) or (isinstance(value, list) and value and isinstance(value[0], SecretStr)):
        return SECRET_DEFAULT if value else "[]"
    return json.dumps(to_jsonable_python(value), ensure_ascii=False)


def subsection(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """``(model, suffix)`` when a field holds a section (``""``) or a list of them (``"[]"``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item, "[]"
    return None


def _is_key(field: FieldInfo) -> bool:
    """A field set by value: not a section (whose keys are listed under it); a list of sections
    is both, a key (its default is the whole list) and a section below."""
    found = subsection(field.annotation)
    return found is None or found[1] == "[]"


def _sections(model: type[BaseModel], path: str) -> Iterator[tuple[str, type[BaseModel]]]:
    """``(dotted path, model)`` of ``model`` and every section under it, depth first."""
    yield path, model
    for name, field in model.model_fields.items():
        if (found := subsection(field.annotation)) is not None:
            yield from _sections(found[0], f"{path}.{name}{found[1]}" if path else f"{name}{found[1]}")


def _field_entry(path: str, name: str, field: FieldInfo, listed: bool) -> list[str]:
    facts = [f"`{type_name(field.annotation)}`"]
    default = default_text(field)
    inline = default is not None and len(default) <= LONG_DEFAULT
    if default is None:
        facts.append("required")
    elif default == SECRET_DEFAULT:
        facts.append(f"default: {SECRET_DEFAULT}")
    else:
        facts.append(f"default `{default}`" if inline else "default below")
    facts.extend(bounds(field))
    key = f"{path}.{name}" if path else name
    lines = [f"- **`{key}`** ({', '.join(facts)})"]
    if not listed:
        lines[0] += f"; env `{ENV_PREFIX}{key.upper().replace('.', '__')}`"
    lines += ["", *(f"  {line}".rstrip() for line in (field.description or "").splitlines()), ""]
    if default is not None and not inline:
        lines += ["  ```json", f"  {default}", "  ```", ""]
    return lines


def reference(schema: type[Section], title: str) -> str:
    """Markdown with a heading per section and an entry per field: type, default, bounds, the
    environment variable that overrides it (not for the items of a list), and its docstring."""
    lines = [f"# {title}", "",
             f"Generated from the code (`online-sao config reference`); every key can be set in a YAML "
             f"file under its section, with `--set section.key=value`, or as `{ENV_PREFIX}SECTION__KEY`. "
             f"Numbers must be finite (`.inf` and `.nan` are refused). A value given in the environment or with "
             f"`--set` is read as YAML "
             f"(`[a, b]` is a list), except for a text field (`str`, `secret`, `path`), which takes it as "
             f"written (a password `p@ss #1` whole; `null` unsets an optional one); an empty one is null.", ""]
    for path, model in _sections(schema, ""):
        if not path:
            continue
        leaves = [(n, f) for n, f in model.model_fields.items() if _is_key(f)]
        lines += [f"## `{path}`", ""]
        doc = (model.__doc__ or "").strip()
        if doc and model.__doc__ is not BaseModel.__doc__:
            lines += [" ".join(doc.split()), ""]
        for name, field in leaves:
            lines += _field_entry(path, name, field, listed="[]" in path)
    return "\n".join(lines).rstrip() + "\n"
