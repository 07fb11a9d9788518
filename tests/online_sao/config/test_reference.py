from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import Field, SecretStr

from online_sao.config import Config, Section
from online_sao.config.reference import reference, type_name


class Phase(Section):
    start: int = Field(ge=0)
    """Where it starts."""


class Inner(Section):
    """An inner section,
    over two lines."""

    name: str = Field("x", min_length=1, pattern=r"^[a-z]+$")
    """Its name."""


class Tree(Section):
    inner: Inner = Inner()
    """Not a key: a section."""
    port: int = Field(8000, ge=0, le=65535)
    """The port.

    A second paragraph."""
    mode: Literal["a", "b"] = "a"
    """One of two."""
    token: SecretStr = SecretStr("dev")
    """Signs things."""
    where: Path | None = None
    """A place, or none."""
    phases: list[Phase] = [Phase(start=0), Phase(start=10), Phase(start=20), Phase(start=30), Phase(start=40),
                           Phase(start=50), Phase(start=60)]
    """The phases."""


class Root(Section):
    tree: Tree = Tree()
    """The tree."""


EXPECTED = """\
# T

Generated from the code (`online-sao config reference`); every key can be set in a YAML file under its section, \
with `--set section.key=value`, or as `ONLINE_SAO__SECTION__KEY`. Numbers must be finite (`.inf` and `.nan` are refused). \
A value given in the environment or with `--set` is read as YAML (`[a, b]` is a list), except for a text field \
(`str`, `secret`, `path`), which takes it as written (a password `p@ss #1` whole; `null` unsets an optional one); \
an empty one is null.

## `tree`

- **`tree.port`** (`int`, default `8000`, ≥ 0, ≤ 65535); env `ONLINE_SAO__TREE__PORT`

  The port.

  A second paragraph.

- **`tree.mode`** (`"a" | "b"`, default `"a"`); env `ONLINE_SAO__TREE__MODE`

  One of two.

- **`tree.token`** (`secret`, default: a development value: set your own); env `ONLINE_SAO__TREE__TOKEN`

  Signs things.

- **`tree.where`** (`path | None`, default `null`); env `ONLINE_SAO__TREE__WHERE`

  A place, or none.

- **`tree.phases`** (`list[Phase]`, default below); env `ONLINE_SAO__TREE__PHASES`

  The phases.

  ```json
  [{"start": 0}, {"start": 10}, {"start": 20}, {"start": 30}, {"start": 40}, {"start": 50}, {"start": 60}]
  ```

## `tree.inner`

An inner section, over two lines.

- **`tree.inner.name`** (`str`, default `"x"`, length ≥ 1, matches `^[a-z]+$`); env `ONLINE_SAO__TREE__INNER__NAME`

  Its name.

## `tree.phases[]`

- **`tree.phases[].start`** (`int`, required, ≥ 0)

  Where it starts.
"""


def test_a_small_tree_is_written_key_by_key():
    assert reference(Root, "T") == EXPECTED


@pytest.mark.parametrize(("annotation", "written"), [
    (int, "int"), (str | None, "str | None"), (list[str], "list[str]"), (dict[str, float], "dict[str, float]"),
    (Literal["padded", "flat"], '"padded" | "flat"'), (dict[Annotated[str, Field(pattern="^a")], float], "dict[str, float]"), (list[SecretStr], "list[secret]"), (Path, "path"),
])
def test_types_are_written_as_a_yaml_file_sees_them(annotation, written):
    assert type_name(annotation) == written


def test_every_key_of_the_core_tree_has_an_entry_and_its_variable():
    text = reference(Config, "T")
    for section, model in Config.model_fields.items():
        for name in model.annotation.model_fields:
            if name == "topics":
                continue
            key = f"{section}.{name}"
            assert f"- **`{key}`**" in text
            assert f"env `ONLINE_SAO__{section.upper()}__{name.upper()}`" in text
    assert "- **`kafka.topics.weights`**" in text
