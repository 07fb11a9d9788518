"""A small Dockerfile parser for the deployment tests (no container engine runs in CI).

It understands what the project's Dockerfile uses: line continuations, comments, stages
(``FROM image AS name``), ``ARG`` defaults substituted into ``FROM`` and later instructions,
flags (``COPY --from=build``, ``HEALTHCHECK --interval=15s``), exec form (JSON arrays) and
shell form, ``ENV`` in both syntaxes, ``EXPOSE``.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_FLAG = re.compile(r"--([a-z-]+)(?:=(\S*))?")


class DockerfileError(ValueError):
    """A line the parser does not understand; the message gives the line number."""


@dataclass
class Instruction:
    keyword: str
    """Upper-case instruction, e.g. ``COPY``."""
    args: str
    """Everything after the keyword and its flags, continuation lines joined."""
    flags: dict[str, str]
    """Leading ``--name=value`` flags (``--name`` alone maps to ``""``)."""
    line: int
    """1-based line where the instruction starts."""

    @property
    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form instruction, else None."""
        if self.args.startswith("["):
            try:
                value = json.loads(self.args)
            except json.JSONDecodeError as exc:
                raise DockerfileError(f"line {self.line}: {self.keyword} is not a valid JSON array: {exc}") from None
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise DockerfileError(f"line {self.line}: {self.keyword} must be an array of strings")
            return value
        return None

    def health_command(self) -> list[str] | None:
        """The command of ``HEALTHCHECK [flags] CMD ...`` (exec or shell form); None for ``NONE``."""
        if self.keyword != "HEALTHCHECK":
            raise DockerfileError(f"line {self.line}: {self.keyword} is not a HEALTHCHECK")
        head, _, rest = self.args.partition(" ")
        if head.upper() == "NONE":
            return None
        if head.upper() != "CMD":
            raise DockerfileError(f"line {self.line}: HEALTHCHECK expects CMD or NONE")
        return Instruction("CMD", rest.strip(), {}, self.line).words()

    def words(self) -> list[str]:
        """Arguments as a list: the exec form, or the shell form split like a shell would."""
        form = self.exec_form
        return form if form is not None else shlex.split(self.args)


@dataclass
class Stage:
    base: str
    """Image of ``FROM`` with build arguments substituted."""
    name: str | None
    """The ``AS`` name, if any."""
    instructions: list[Instruction] = field(default_factory=list)
    args: dict[str, str] = field(default_factory=dict)
    """Build arguments visible in this stage with their defaults (substituted)."""

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None

    @property
    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for ins in self.all("ENV"):
            out.update(parse_env(ins))
        return out

    @property
    def exposed(self) -> set[int]:
        return {int(p.split("/")[0]) for ins in self.all("EXPOSE") for p in ins.args.split()}


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    """ARGs before the first FROM (usable in FROM lines)."""
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage named {name!r}; stages: {[s.name for s in self.stages]}")

    @property
    def default_target(self) -> Stage:
        """The stage ``docker build`` builds without --target: the last one."""
        return self.stages[-1]


def substitute(text: str, values: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` replaced where ``values`` defines them (others are left as is)."""
    return _VAR.sub(lambda m: values.get(m.group(1) or m.group(2), m.group(0)), text)


def parse_env(ins: Instruction) -> dict[str, str]:
    """``ENV A=1 B="two words"`` or the legacy ``ENV A value``."""
    words = shlex.split(ins.args)
    if words and "=" not in words[0]:
        return {words[0]: ins.args.split(None, 1)[1] if len(words) > 1 else ""}
    out = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep:
            raise DockerfileError(f"line {ins.line}: ENV expects NAME=value, got {word!r}")
        out[key] = value
    return out


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction text) with comments dropped and continuations joined."""
    out: list[tuple[int, str]] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not parts):
            continue  # comments (also inside a continued instruction) and blank lines
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped)
        out.append((start, " ".join(p for p in parts if p)))
        parts = []
    if parts:
        raise DockerfileError(f"line {start}: the file ends inside a continued instruction")
    return out


def _split_flags(rest: str) -> tuple[dict[str, str], str]:
    flags: dict[str, str] = {}
    while rest.startswith("--"):
        token, _, rest = rest.partition(" ")
        m = _FLAG.fullmatch(token)
        if m is None:
            raise DockerfileError(f"bad flag {token!r}")
        flags[m.group(1)] = m.group(2) or ""
        rest = rest.lstrip()
    return flags, rest


def parse_dockerfile(text: str) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line, logical in _logical_lines(text):
        keyword, _, rest = logical.partition(" ")
        keyword = keyword.upper()
        if not re.fullmatch(r"[A-Z]+", keyword):
            raise DockerfileError(f"line {line}: not an instruction: {logical[:40]!r}")
        flags: dict[str, str] = {}
        if keyword in {"COPY", "ADD", "FROM", "RUN", "HEALTHCHECK"}:
            try:
                flags, rest = _split_flags(rest.strip())
            except DockerfileError as exc:
                raise DockerfileError(f"line {line}: {exc}") from None
        ins = Instruction(keyword, rest.strip(), flags, line)
        if keyword == "ARG":
            name, _, default = ins.args.partition("=")
            scope = stages[-1].args if stages else global_args
            scope[name] = substitute(default.strip('"'), scope)
            continue
        if keyword == "FROM":
            words = substitute(ins.args, global_args).split()
            if len(words) not in (1, 3) or (len(words) == 3 and words[1].upper() != "AS"):
                raise DockerfileError(f"line {line}: FROM expects 'image [AS name]'")
            stages.append(Stage(base=words[0], name=words[2] if len(words) == 3 else None))
            continue
        if not stages:
            raise DockerfileError(f"line {line}: {keyword} before the first FROM")
        stages[-1].instructions.append(ins)
    if not stages:
        raise DockerfileError("no FROM: not a Dockerfile")
    return Dockerfile(global_args, stages)
