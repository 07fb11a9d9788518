"""The Dockerfile names only files, commands, ports and settings the project has."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from packaging.specifiers import SpecifierSet

from online_sao.config import ServingConfig
from serving.app import _ROUTES as SERVING_ROUTES
from tests.deploy.checks import (
    REPO,
    check_config_env,
    check_copies,
    dockerignore_patterns,
    dockerignored,
    mlflow_params,
    parse_cli,
)
from tests.deploy.dockerfile import Dockerfile, parse_dockerfile

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
HEALTHCHECK_TIMEOUT_S = 60
"""Generous bound on the health-check subprocess (a Python start-up on a loaded machine)."""


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile((REPO / "Dockerfile").read_text())


def test_stages_build_the_service_by_default(dockerfile):
    assert [s.name for s in dockerfile.stages] == ["build", "mlflow", "runtime"]
    assert dockerfile.default_target.name == "runtime"
    for stage in dockerfile.stages:
        assert stage.base == dockerfile.stages[0].base, "every stage shares one Python base (the venv moves between them)"


def test_base_image_python_satisfies_requires_python(dockerfile):
    tag = dockerfile.default_target.base.partition(":")[2]
    version = re.match(r"(\d+\.\d+)", tag)
    assert version, f"the base image tag {tag!r} does not name a Python version"
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(version.group(1) + ".0")


def test_cpu_by_default_and_cuda_by_build_argument(dockerfile):
    build = dockerfile.stage("build")
    assert build.args["VARIANT"] == "cpu"
    install = next(i.args for i in build.all("RUN") if "torch==" in i.args)
    assert re.search(r"\bcpu\)", install) and re.search(r"\bcuda\)", install)
    assert "download.pytorch.org/whl/cpu" in install
    # the torch version is read from constraints.txt with sed: exactly one pin must be there
    pins = re.findall(r"^torch==(\S+)$", (REPO / "constraints.txt").read_text(), re.MULTILINE)
    assert len(pins) == 1


def test_every_copied_file_exists_and_is_in_the_build_context(dockerfile):
    patterns = dockerignore_patterns((REPO / ".dockerignore").read_text())
    assert check_copies(dockerfile, REPO, patterns) >= 5


def test_build_context_leaves_out_local_state():
    patterns = dockerignore_patterns((REPO / ".dockerignore").read_text())
    for path in [".venv", "data", ".git", "mlruns", "online_sao/__pycache__", "tests"]:
        assert dockerignored(path, patterns), path
    assert not dockerignored("apps/cli.py", patterns)


def test_every_package_of_pyproject_is_copied(dockerfile):
    copied = {w.rstrip("/") for ins in dockerfile.stage("build").all("COPY") for w in ins.words()[:-1]}
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, f"packages not copied: {sorted(packages - copied)}"
    assert {"pyproject.toml", "constraints.txt", "README.md"} <= copied  # pip install . needs the readme


def test_runtime_runs_online_sao_as_a_non_root_user(dockerfile):
    runtime = dockerfile.default_target
    user = runtime.last("USER").args
    assert user not in {"root", "0"} and not user.startswith("0:")
    assert any(re.search(rf"useradd\b[^&]*\b{re.escape(user)}\b", i.args) for i in runtime.all("RUN"))
    entrypoint = runtime.last("ENTRYPOINT").exec_form
    assert entrypoint == ["online-sao"] and "online-sao" in PYPROJECT["project"]["scripts"]
    assert "/opt/venv/bin" in runtime.env["PATH"].split(":")
    parse_cli(runtime.last("CMD").exec_form)


def test_runtime_environment_names_real_config_fields(dockerfile):
    env = dockerfile.default_target.env
    cfg = check_config_env(env)
    assert str(cfg.paths.data_dir) == "/data"


def test_exposed_port_is_the_serving_port(dockerfile):
    assert dockerfile.default_target.exposed == {ServingConfig().port}


def test_no_weights_are_baked_in(dockerfile):
    for stage in dockerfile.stages:
        for ins in stage.all("COPY") + stage.all("ADD"):
            for source in ins.words()[:-1]:
                assert not source.startswith(("data", "mlruns")) and not source.endswith(".safetensors"), source


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def _run_healthcheck(argv: list[str], port: int) -> int:
    command = [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]
    env = {"ONLINE_SAO__SERVING__PORT": str(port), "PATH": "/usr/bin:/bin"}
    return subprocess.run(command, env=env, capture_output=True, timeout=HEALTHCHECK_TIMEOUT_S).returncode


@pytest.mark.parametrize("status, healthy", [(200, True), (503, False)])
def test_healthcheck_probes_healthz_on_the_serving_port(dockerfile, status, healthy):
    argv = dockerfile.default_target.last("HEALTHCHECK").health_command()
    assert "/healthz" in SERVING_ROUTES and "/healthz" in argv[-1]
    handler = type("Handler", (_Health,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert (_run_healthcheck(argv, server.server_address[1]) == 0) is healthy
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_fails_when_nothing_listens(dockerfile, free_port):
    argv = dockerfile.default_target.last("HEALTHCHECK").health_command()
    assert _run_healthcheck(argv, free_port) != 0


def test_mlflow_stage_runs_the_pinned_mlflow_server(dockerfile):
    stage = dockerfile.stage("mlflow")
    install = next(i.args for i in stage.all("RUN") if "pip install" in i.args)
    assert "-c /tmp/constraints.txt" in install and re.search(r"\bmlflow\b", install) and "psycopg2" in install
    assert re.search(r"^mlflow==", (REPO / "constraints.txt").read_text(), re.MULTILINE)
    assert stage.last("ENTRYPOINT").exec_form == ["mlflow"]
    params = mlflow_params(stage.last("CMD").exec_form)
    assert stage.exposed == {params["port"]}
    assert stage.last("USER").args not in {"root", "0"}
    health = stage.last("HEALTHCHECK").health_command()
    compile(health[-1], "<healthcheck>", "exec")
    assert f"127.0.0.1:{params['port']}/health'" in health[-1]
