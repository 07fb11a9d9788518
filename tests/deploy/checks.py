"""Checks shared by the Dockerfile, compose and Kubernetes tests.

Each check runs the project's own code where it can: the ``online-sao`` argparse parser,
``load_config``, torchrun's parser, MLflow's click commands, importlib for ``-m`` modules, so
a renamed flag, field or module breaks these tests instead of a deployment. Problems are
raised as :class:`DeployCheckError` with a message naming the offending item.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import fnmatch
import importlib.util
import io
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from apps import cli, commands
from apps.config import AppConfig, load_app_config
from online_sao.config import ENV_PREFIX, ConfigError
from tests.deploy.dockerfile import Dockerfile

REPO = Path(__file__).resolve().parents[2]
"""Root of the repository (the Docker build context)."""

_COMPOSE_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
_K8S_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


GO_BUILD_TIMEOUT_S = 1800
"""A Go tool's first build: promtool took 5 minutes and 2 GB of modules on 2 cores."""


def go_tool(name: str, version: str, go_args: list[str], cwd: Path | None = None) -> Path:
    """``.cache/<name>/<version>/<name>``, built once by ``go <go_args>`` (``go install`` puts it
    there through GOBIN; ``go build`` is given ``-o`` that path), modules in ``.cache/gopath`` (one
    module cache for every tool: promtool and Prometheus share most of theirs). Needs Go and the Go
    module proxy on the first use."""
    out = REPO / ".cache" / name / version
    binary = out / name
    out.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(f"{version}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # test workers wanting one tool at once: the first builds it
        if not binary.exists():
            go = shutil.which("go") or "/usr/local/go/bin/go"
            env = {**os.environ, "GOBIN": str(out), "GOPATH": str(REPO / ".cache" / "gopath"),
                   "GOFLAGS": "-modcacherw"}
            if go_args[0] == "build":
                go_args = [*go_args[:1], "-o", str(binary), *go_args[1:]]
            subprocess.run([go, *go_args], env=env, cwd=cwd, check=True, timeout=GO_BUILD_TIMEOUT_S)
    return binary


class DeployCheckError(AssertionError):
    """A deployment file names something the project does not have."""


def compose_interpolate(value: str, environ: Mapping[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?msg}`` and ``$$``."""

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = environ.get(name)
        if op in (":-", "-"):
            return value if value or (op == "-" and value is not None) else arg
        if op in (":?", "?") and not value:
            raise DeployCheckError(f"${{{name}}} is required: {arg}")
        return value or ""

    return _COMPOSE_VAR.sub(one, value)


def k8s_expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` in command/args, from the container's variables."""
    return _K8S_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), value)


def online_sao_env(env: Mapping[str, Any]) -> dict[str, str]:
    """The ``ONLINE_SAO__`` variables of a container's environment, as strings."""
    return {k: str(v) for k, v in env.items() if k.startswith(ENV_PREFIX)}


def check_config_env(env: Mapping[str, Any]) -> AppConfig:
    """Every ``ONLINE_SAO__...`` variable names a real field with a valid value."""
    try:
        return load_app_config(None, environ=online_sao_env(env))
    except ConfigError as exc:
        raise DeployCheckError(f"environment {sorted(online_sao_env(env))}: {exc}") from None


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """``online-sao argv`` parsed by the real parser (``apps.cli.build_parser``)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return cli.build_parser().parse_args(argv)
    except SystemExit:
        raise DeployCheckError(f"online-sao {' '.join(argv)}: {err.getvalue().strip()}") from None


@dataclass
class Invocation:
    """An ``online-sao`` command line and the configuration it resolves to."""

    args: argparse.Namespace
    cfg: AppConfig


def resolve_invocation(argv: list[str], mounts: Mapping[str, Path], env: Mapping[str, Any]) -> Invocation:
    """Parse ``argv`` and load its configuration as the process would: the ``--config`` file
    (a container path, found through ``mounts``: container path -> file here), the
    environment, and the ``--set`` / ``--port`` overrides."""
    args = parse_cli(argv)
    path = None
    if args.config is not None:
        if args.config not in mounts:
            raise DeployCheckError(f"--config {args.config} is not a mounted file (mounted: {sorted(mounts)})")
        path = mounts[args.config]
        if not path.is_file():
            raise DeployCheckError(f"--config {args.config} is mounted from {path}, which does not exist")
    try:
        cfg = load_app_config(path, environ=online_sao_env(env), overrides=commands.overrides(args))
    except ConfigError as exc:
        raise DeployCheckError(f"online-sao {' '.join(argv)}: {exc}") from None
    return Invocation(args, cfg)


def check_module(name: str) -> None:
    """``python -m name`` would find the module."""
    try:
        found = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        found = None
    if found is None:
        raise DeployCheckError(f"python -m {name}: no such module")


@dataclass
class Torchrun:
    """A ``torchrun ... -m module args`` command line, parsed by torchrun's own parser."""

    options: argparse.Namespace
    module: str
    module_args: list[str]


def parse_torchrun(argv: list[str]) -> Torchrun:
    from torch.distributed.run import get_args_parser

    if not argv or argv[0] != "torchrun":
        raise DeployCheckError(f"not a torchrun command: {argv[:1]}")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            options = get_args_parser().parse_args(argv[1:])
    except SystemExit:
        raise DeployCheckError(f"{' '.join(argv)}: {err.getvalue().strip()}") from None
    if not options.module:
        raise DeployCheckError(f"{' '.join(argv)}: the learner is started as a module (-m apps.cli)")
    check_module(options.training_script)
    return Torchrun(options, options.training_script, list(options.training_script_args))


def mlflow_params(argv: list[str]) -> dict[str, Any]:
    """``mlflow argv`` parsed by MLflow's click commands; returns the options."""
    import click
    from mlflow.cli import cli as mlflow_cli

    command: click.Command = mlflow_cli
    rest, name = list(argv), "mlflow"
    while isinstance(command, click.Group):
        if not rest or rest[0] not in command.commands:
            raise DeployCheckError(f"mlflow {' '.join(argv)}: no command {rest[:1]} in {sorted(command.commands)}")
        name, rest = rest[0], rest[1:]
        command = command.commands[name]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return dict(command.make_context(name, rest).params)
    except click.ClickException as exc:
        raise DeployCheckError(f"mlflow {' '.join(argv)}: {exc.format_message()}") from None


def mlflow_admits(allowed_hosts: str, host_header: str) -> bool:
    """Whether an MLflow server started with ``--allowed-hosts allowed_hosts`` accepts ``host_header``."""
    from mlflow.server.security_utils import is_allowed_host_header

    return is_allowed_host_header([h.strip() for h in allowed_hosts.split(",")], host_header)


def dockerignore_patterns(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether ``path`` (relative to the context) is left out by these .dockerignore patterns:
    a pattern excludes a path or any directory above it; ``**/`` matches any depth (also none);
    ``!`` re-includes; the last matching pattern wins."""
    parts = Path(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        options = [pattern, pattern[3:]] if pattern.startswith("**/") else [pattern]
        if any(fnmatch.fnmatchcase(c, p) for c in candidates for p in options):
            excluded = not negate
    return excluded


def check_copies(dockerfile: Dockerfile, context: Path, patterns: list[str]) -> int:
    """Every ``COPY``/``ADD`` source exists under ``context`` and is not left out by
    .dockerignore; every ``--from`` names an earlier stage. Returns the files checked."""
    earlier: set[str | None] = set()
    checked = 0
    for stage in dockerfile.stages:
        for ins in stage.all("COPY") + stage.all("ADD"):
            *sources, _dest = ins.words()
            if "from" in ins.flags:
                if ins.flags["from"] not in earlier:
                    raise DeployCheckError(f"line {ins.line}: COPY --from={ins.flags['from']}: no earlier stage")
                continue
            for source in sources:
                if not (context / source).exists():
                    raise DeployCheckError(f"line {ins.line}: {ins.keyword} {source}: not in the build context")
                if dockerignored(source, patterns):
                    raise DeployCheckError(f"line {ins.line}: {source} is excluded by .dockerignore")
                checked += 1
        earlier.add(stage.name)
    return checked


@dataclass
class NginxConf:
    upstreams: dict[str, list[str]]
    """Upstream name -> its ``server`` addresses."""
    listen: list[int]
    proxy_pass: list[str]
    client_max_body_size: int | None
    proxy_read_timeout_s: float | None
    """``proxy_read_timeout`` in seconds (plain seconds or an ``s``/``m`` suffix); None when unset."""


_SIZE = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_nginx(text: str) -> NginxConf:
    """The parts of an nginx configuration the load-balancer test looks at."""
    text = re.sub(r"#[^\n]*", "", text)
    upstreams = {}
    for m in re.finditer(r"\bupstream\s+(\S+)\s*\{([^}]*)\}", text):
        statements = [st.split() for st in m.group(2).split(";")]
        upstreams[m.group(1)] = [st[1] for st in statements if len(st) > 1 and st[0] == "server"]
    size = re.search(r"\bclient_max_body_size\s+(\d+)([kKmMgG]?)\s*;", text)
    read_timeout = re.search(r"\bproxy_read_timeout\s+(\d+)(s|m)?\s*;", text)
    return NginxConf(
        upstreams=upstreams,
        listen=[int(p) for p in re.findall(r"\blisten\s+(?:[\d.]+:)?(\d+)[^;]*;", text)],
        proxy_pass=re.findall(r"\bproxy_pass\s+([^;\s]+)\s*;", text),
        client_max_body_size=int(size.group(1)) * _SIZE[size.group(2).lower()] if size else None,
        proxy_read_timeout_s=(float(read_timeout.group(1)) * (60 if read_timeout.group(2) == "m" else 1)
                              if read_timeout else None),
    )


def check_nginx_upstreams(conf: NginxConf, expected: set[str]) -> None:
    """Every request is proxied to an upstream that lists exactly ``expected`` (host:port)."""
    for target in conf.proxy_pass:
        name = target.removeprefix("http://").rstrip("/")
        if name not in conf.upstreams:
            raise DeployCheckError(f"proxy_pass {target}: no upstream {name!r}")
        if set(conf.upstreams[name]) != expected:
            raise DeployCheckError(f"upstream {name} lists {sorted(conf.upstreams[name])}, "
                                   f"the serving replicas are {sorted(expected)}")
    if not conf.proxy_pass:
        raise DeployCheckError("nginx proxies nothing (no proxy_pass)")


def kafka_properties(env: Mapping[str, Any]) -> dict[str, str]:
    """Broker properties of the official apache/kafka image's ``KAFKA_*`` variables (JVM
    options excluded): ``KAFKA_LOG_DIRS`` -> ``log.dirs``."""
    jvm = {"KAFKA_HEAP_OPTS", "KAFKA_OPTS", "KAFKA_JVM_PERFORMANCE_OPTS", "KAFKA_LOG4J_OPTS", "KAFKA_JMX_OPTS",
           "KAFKA_GC_LOG_OPTS"}
    return {k.removeprefix("KAFKA_").lower().replace("_", "."): str(v)
            for k, v in env.items() if k.startswith("KAFKA_") and k not in jvm}


def check_kafka_kraft(props: Mapping[str, str], local_broker_keys: set[str]) -> dict[str, str]:
    """A consistent single-node KRaft broker using only settings the project's own local
    broker (the one the tests run against) also sets; returns listener name -> host:port."""
    unknown = set(props) - local_broker_keys
    if unknown:
        raise DeployCheckError(f"broker settings the local broker does not use: {sorted(unknown)}")
    missing = {"node.id", "process.roles", "listeners", "advertised.listeners", "controller.listener.names",
               "controller.quorum.voters", "listener.security.protocol.map"} - set(props)
    if missing:
        raise DeployCheckError(f"KRaft needs {sorted(missing)}")
    protocols = dict(p.split(":") for p in props["listener.security.protocol.map"].split(","))
    listeners = dict(_listener(item) for item in props["listeners"].split(","))
    advertised = dict(_listener(item) for item in props["advertised.listeners"].split(","))
    for name in {*listeners, *advertised, props["controller.listener.names"]}:
        if name not in protocols:
            raise DeployCheckError(f"listener {name} has no entry in listener.security.protocol.map")
    voter_id, _, voter = props["controller.quorum.voters"].partition("@")
    if voter_id != props["node.id"]:
        raise DeployCheckError(f"the quorum voter {voter_id} is not this node ({props['node.id']})")
    controller_port = listeners[props["controller.listener.names"]].rpartition(":")[2]
    if voter.rpartition(":")[2] != controller_port:
        raise DeployCheckError(f"voter {voter} does not use the controller listener's port {controller_port}")
    return advertised


def _listener(item: str) -> tuple[str, str]:
    name, sep, address = item.partition("://")
    if not sep:
        raise DeployCheckError(f"listener {item!r} is not NAME://host:port")
    return name, address
