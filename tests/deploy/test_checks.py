"""The deployment checks catch what they are meant to catch: each is fed a deliberate mistake."""

from __future__ import annotations

import pytest

from tests.deploy.checks import (
    DeployCheckError,
    check_config_env,
    check_copies,
    check_kafka_kraft,
    check_module,
    check_nginx_upstreams,
    compose_interpolate,
    dockerignored,
    k8s_expand,
    mlflow_admits,
    mlflow_params,
    parse_cli,
    parse_nginx,
    parse_torchrun,
    resolve_invocation,
)
from tests.deploy.dockerfile import DockerfileError, parse_dockerfile


@pytest.mark.parametrize("env", [
    {"ONLINE_SAO__SERVING__PROT": "8000"},        # misspelt field
    {"ONLINE_SAO__SERVNG__PORT": "8000"},         # misspelt section
    {"ONLINE_SAO__SERVING__PORT": "eighty"},      # invalid value
    {"ONLINE_SAO__SERVING__API_KEYS": "sk-1"},    # a list field given a plain string
])
def test_env_check_catches_wrong_variables(env):
    with pytest.raises(DeployCheckError, match="invalid configuration"):
        check_config_env(env)


def test_env_check_accepts_real_fields_and_ignores_other_variables():
    cfg = check_config_env({"ONLINE_SAO__SERVING__PORT": "8001", "ONLINE_SAO__SERVING__API_KEYS": "[a, b]",
                            "KAFKA_NODE_ID": "1"})
    assert cfg.serving.port == 8001 and len(cfg.serving.api_keys) == 2


@pytest.mark.parametrize("argv", [["serv"], ["serve", "--portt", "1"], ["kafka", "start"], ["learn", "--nproc", "2"]])
def test_cli_check_catches_unknown_commands_and_flags(argv):
    with pytest.raises(DeployCheckError, match="online-sao"):
        parse_cli(argv)


def test_invocation_needs_a_mounted_config_and_real_overrides(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("serving: {port: 8001}\n")
    inv = resolve_invocation(["--config", "/etc/c.yaml", "serve", "--port", "8002"], {"/etc/c.yaml": config}, {})
    assert inv.cfg.serving.port == 8002 and inv.args.command == "serve"
    with pytest.raises(DeployCheckError, match="not a mounted file"):
        resolve_invocation(["--config", "/etc/other.yaml", "serve"], {"/etc/c.yaml": config}, {})
    with pytest.raises(DeployCheckError, match="does not exist"):
        resolve_invocation(["--config", "/etc/c.yaml", "serve"], {"/etc/c.yaml": tmp_path / "missing.yaml"}, {})
    with pytest.raises(DeployCheckError, match="serving.prot"):
        resolve_invocation(["--set", "serving.prot=1", "serve"], {}, {})


def test_module_check():
    check_module("apps.cli")
    for name in ("online_sao.nope", "no_such_package.cli"):
        with pytest.raises(DeployCheckError, match="no such module"):
            check_module(name)


def test_torchrun_check():
    run = parse_torchrun(["torchrun", "--nnodes", "2", "--nproc-per-node", "4", "-m", "apps.cli", "learn"])
    assert (run.module, run.module_args, run.options.nproc_per_node) == ("apps.cli", ["learn"], "4")
    for argv in (["torchrun", "--nprocs-per-node", "1", "-m", "apps.cli", "learn"],
                 ["torchrun", "--nproc-per-node", "1", "apps/cli.py", "learn"],
                 ["torchrun", "-m", "online_sao.climb", "learn"],
                 ["python", "-m", "apps.cli"]):
        with pytest.raises(DeployCheckError):
            parse_torchrun(argv)


def test_mlflow_checks():
    assert mlflow_params(["server", "--port", "5001"])["port"] == 5001
    with pytest.raises(DeployCheckError, match="no command"):
        mlflow_params(["servre"])
    with pytest.raises(DeployCheckError, match="no-such-flag"):
        mlflow_params(["server", "--no-such-flag"])
    assert mlflow_admits("mlflow:5000,localhost:*", "localhost:5000")
    assert not mlflow_admits("mlflow:5000,localhost:*", "mlflow-2:5000")


def test_dockerignore_matching():
    patterns = ["data", "**/__pycache__", "docs", "!docs/keep.md"]
    assert dockerignored("data/models/x", patterns)
    assert dockerignored("__pycache__", patterns) and dockerignored("a/b/__pycache__/c.pyc", patterns)
    assert dockerignored("docs/other.md", patterns) and not dockerignored("docs/keep.md", patterns)
    assert not dockerignored("database.py", patterns)


def test_copy_check_catches_missing_ignored_and_unknown_stage_sources(tmp_path):
    (tmp_path / "app.py").write_text("")
    (tmp_path / "secret.env").write_text("")
    good = "FROM python:3.11-slim AS a\nCOPY app.py /app/\nFROM python:3.11-slim\nCOPY --from=a /app /app\n"
    assert check_copies(parse_dockerfile(good), tmp_path, []) == 1
    cases = {
        "FROM python:3.11-slim\nCOPY missing.py /app/\n": "not in the build context",
        "FROM python:3.11-slim\nCOPY secret.env /app/\n": "excluded by .dockerignore",
        "FROM python:3.11-slim\nCOPY --from=build /opt /opt\n": "no earlier stage",
    }
    for text, message in cases.items():
        with pytest.raises(DeployCheckError, match=message):
            check_copies(parse_dockerfile(text), tmp_path, ["*.env"])


def test_dockerfile_parser():
    text = ("ARG BASE=python:3.11-slim\n# comment\nFROM ${BASE} AS build\nARG V=cpu\n"
            "RUN echo a \\\n  # inside\n  && echo $V\nENV A=1 B=\"two words\"\n"
            "HEALTHCHECK --interval=5s CMD [\"python\", \"-c\", \"pass\"]\nEXPOSE 8000/tcp 9000\n")
    df = parse_dockerfile(text)
    stage = df.stage("build")
    assert stage.base == "python:3.11-slim" and stage.args == {"V": "cpu"}
    assert stage.all("RUN")[0].args == "echo a && echo $V"
    assert stage.env == {"A": "1", "B": "two words"} and stage.exposed == {8000, 9000}
    check = stage.last("HEALTHCHECK")
    assert check.flags == {"interval": "5s"} and check.health_command() == ["python", "-c", "pass"]
    for bad in ("RUN echo\n", "FROM a AS\n", "FROM a\nRUN echo \\\n", "FROM a\nCMD [\"x\",\n"):
        with pytest.raises(DockerfileError):
            df = parse_dockerfile(bad)
            [i.exec_form for s in df.stages for i in s.instructions]


def test_nginx_upstream_check():
    conf = parse_nginx("http { upstream u { server a:8000 max_fails=3; server b:8000; }\n"
                       "server { listen 8080; client_max_body_size 2m; location / { proxy_pass http://u; } } }")
    assert conf.listen == [8080] and conf.client_max_body_size == 2 * 1024 * 1024
    check_nginx_upstreams(conf, {"a:8000", "b:8000"})
    with pytest.raises(DeployCheckError, match="serving replicas"):
        check_nginx_upstreams(conf, {"a:8000", "c:8000"})
    with pytest.raises(DeployCheckError, match="no upstream"):
        check_nginx_upstreams(parse_nginx("location / { proxy_pass http://v; }"), {"a:8000"})


def test_kafka_check():
    props = {"node.id": "1", "process.roles": "broker,controller", "listeners": "PLAINTEXT://:9092,CONTROLLER://:9093",
             "advertised.listeners": "PLAINTEXT://kafka:9092", "controller.listener.names": "CONTROLLER",
             "controller.quorum.voters": "1@kafka:9093",
             "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"}
    keys = set(props)
    assert check_kafka_kraft(props, keys) == {"PLAINTEXT": "kafka:9092"}
    wrong = [{**props, "controller.quorum.voters": "1@kafka:9094"}, {**props, "controller.quorum.voters": "2@kafka:9093"},
             {**props, "advertised.listeners": "EXTERNAL://kafka:9092"}]
    for bad in wrong:
        with pytest.raises(DeployCheckError):
            check_kafka_kraft(bad, keys)
    with pytest.raises(DeployCheckError, match="local broker does not use"):
        check_kafka_kraft({**props, "log.dir.typo": "x"}, keys)


def test_variable_interpolation():
    env = {"SET": "v", "EMPTY": ""}
    assert compose_interpolate("${SET:-d}|${UNSET:-d}|${EMPTY:-d}|${EMPTY-d}|$$HOME", env) == "v|d|d||$HOME"
    with pytest.raises(DeployCheckError, match="required"):
        compose_interpolate("${UNSET:?set it}", env)
    assert k8s_expand("--node-rank=$(NODE_RANK) $(OTHER)", {"NODE_RANK": "1"}) == "--node-rank=1 $(OTHER)"
