"""docker-compose.yml names only commands, settings, ports, files and volumes the project has."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import PurePosixPath
from urllib.parse import urlparse

import pytest
import yaml

from apps.config import load_app_config
from online_sao.config import KafkaConfig, load_config
from serving.auth import check_exposure
from streams.broker import LocalBroker
from tests.deploy.checks import (
    REPO,
    Invocation,
    check_config_env,
    check_kafka_kraft,
    check_nginx_upstreams,
    compose_interpolate,
    kafka_properties,
    mlflow_admits,
    mlflow_params,
    parse_nginx,
    resolve_invocation,
)
from tests.deploy.dockerfile import parse_dockerfile

DOCKERFILE = parse_dockerfile((REPO / "Dockerfile").read_text())


OPERATOR_ENV = {"SAO_API_KEY": "sk-operators-own", "SAO_FEEDBACK_SECRET": "0f" * 32}
"""What README's ``docker compose up`` line sets (the file requires both)."""


def _interpolate(node, environ=OPERATOR_ENV):
    if isinstance(node, str):
        return compose_interpolate(node, environ=environ)
    if isinstance(node, list):
        return [_interpolate(n, environ) for n in node]
    if isinstance(node, dict):
        return {k: _interpolate(v, environ) for k, v in node.items()}
    return node


COMPOSE_TEXT = (REPO / "docker-compose.yml").read_text()
COMPOSE = _interpolate(yaml.safe_load(COMPOSE_TEXT))
SERVICES: dict[str, dict] = COMPOSE["services"]
APP = sorted(name for name, s in SERVICES.items() if s.get("build", {}).get("target") == DOCKERFILE.default_target.name)
"""Services running the online-sao image (the Dockerfile's default target)."""


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def volumes(service: dict) -> list[tuple[str, str, bool]]:
    """(source, container path, read-only) of the short volume syntax."""
    out = []
    for item in service.get("volumes", []):
        source, target, *mode = item.split(":")
        out.append((source, target, mode == ["ro"]))
    return out


def named_volume_at(service: dict, path: str) -> tuple[str, str, bool]:
    """(volume, path inside the volume, read-only) of the named volume holding ``path``."""
    best = None
    for source, target, ro in volumes(service):
        if source.startswith((".", "/")) or not PurePosixPath(path).is_relative_to(target):
            continue
        if best is None or len(target) > len(best[1]):
            best = (source, target, ro)
    assert best is not None, f"{path} is on no named volume (it would be lost with the container)"
    return best[0], str(PurePosixPath(path).relative_to(best[1])), best[2]


def invocation(name: str) -> Invocation:
    service = SERVICES[name]
    mounts = {target: REPO / source for source, target, _ in volumes(service) if source.startswith(".")}
    return resolve_invocation(service["command"], mounts, environment(service))


def with_command(command: str) -> list[str]:
    return [name for name in APP if invocation(name).args.command == command]


def test_the_services_of_the_issue_are_there():
    assert {"kafka", "mlflow", "postgres", "lb", "learner", "judge", "topics", "base-model"} <= set(SERVICES)
    assert len(with_command("serve")) == 2
    assert with_command("learn") == ["learner"] and with_command("judge") == ["judge"]


def test_images_build_from_stages_of_the_dockerfile():
    stage_names = {s.name for s in DOCKERFILE.stages}
    build_args = set(DOCKERFILE.global_args).union(*(s.args for s in DOCKERFILE.stages))
    images = {}
    for name, service in SERVICES.items():
        build = service.get("build")
        if build is None:
            continue
        assert build["context"] == "." and build["target"] in stage_names, name
        assert set(build.get("args", {})) <= build_args, f"{name}: unknown build args"
        assert images.setdefault(service["image"], build) == build, f"{service['image']} built two ways"


@pytest.mark.parametrize("name", APP)
def test_every_online_sao_command_parses_and_its_configuration_validates(name):
    inv = invocation(name)
    assert inv.args.config == "/etc/online-sao/config.yaml"
    load_app_config(REPO / "configs" / "compose.yaml", environ={})


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_online_sao_variables_name_real_config_fields(name):
    check_config_env(environment(SERVICES[name]))


def test_serving_replicas_agree_and_keep_their_own_spool():
    healthcheck_port = re.search(r"get\('ONLINE_SAO__SERVING__PORT', '(\d+)'\)",
                                 DOCKERFILE.default_target.last("HEALTHCHECK").args).group(1)
    replicas = with_command("serve")
    cfgs = [invocation(name).cfg for name in replicas]
    spools = set()
    for name, cfg in zip(replicas, cfgs):
        service = SERVICES[name]
        assert str(cfg.serving.port) in [str(p) for p in service["expose"]]
        assert str(cfg.serving.port) == healthcheck_port, "the image's health check probes another port"
        check_exposure(cfg.serving)
        spools.add(named_volume_at(service, str(cfg.spool_dir))[0])
        assert named_volume_at(service, cfg.weight_store_url)[2], f"{name}: serving never writes weights"
    assert len(spools) == len(replicas), "replicas must not share a spool directory"
    for attr in ("deployment_id", "feedback_secret", "api_keys"):
        assert len({str(getattr(c.serving, attr)) for c in cfgs}) == 1, f"replicas disagree on serving.{attr}"
    assert len({c.serving.feedback_secret.get_secret_value() for c in cfgs}) == 1


def test_learner_and_replicas_share_the_weight_store_at_one_path():
    learner = invocation("learner").cfg
    volume, inside, ro = named_volume_at(SERVICES["learner"], learner.weight_store_url)
    assert not ro, "the learner publishes into the weight store"
    for name in with_command("serve"):
        cfg = invocation(name).cfg
        # weights notices carry the file's absolute path: it must be the same in every container
        assert cfg.weight_store_url == learner.weight_store_url
        assert named_volume_at(SERVICES[name], cfg.weight_store_url)[:2] == (volume, inside)


def test_learner_checkpoints_on_a_volume_of_its_own():
    volume = named_volume_at(SERVICES["learner"], str(invocation("learner").cfg.checkpoint_dir))[0]
    users = [n for n, s in SERVICES.items() if volume in [v[0] for v in volumes(s)]]
    assert users == ["learner"]


def test_every_process_reads_the_model_the_base_model_service_builds():
    builder = invocation("base-model").cfg
    assert builder.model.path is None, "base-model builds only when model.path is unset"
    built = named_volume_at(SERVICES["base-model"], str(builder.model_dir))
    assert not built[2]
    for name in APP:
        cfg = invocation(name).cfg
        if name in ("base-model", "topics"):
            continue
        assert cfg.model.path is not None, f"{name} would build its own model"
        assert named_volume_at(SERVICES[name], str(cfg.model_dir))[:2] == built[:2], name
        assert "base-model" in SERVICES[name]["depends_on"], name


def test_volume_mount_points_exist_in_the_image_owned_by_the_service_user():
    runtime = DOCKERFILE.default_target
    setup = " ".join(i.args for i in runtime.all("RUN"))
    made = {str(parent) for d in re.search(r"mkdir -p ([^&]+)", setup).group(1).split()
            for parent in [PurePosixPath(d), *PurePosixPath(d).parents]}  # -p makes the parents too
    owned = set(re.search(r"chown \S+ ([^&]+)", setup).group(1).split())
    for name in APP:
        for source, target, _ in volumes(SERVICES[name]):
            if not source.startswith((".", "/")):
                assert target in made & owned, f"{name}: volume {source} at {target} would start owned by root"


def test_kafka_is_the_official_image_in_kraft_mode_at_the_configured_bootstrap():
    kafka = SERVICES["kafka"]
    image, _, tag = kafka["image"].partition(":")
    assert image == "apache/kafka" and tag == KafkaConfig().kafka_version
    local_keys = {line.partition("=")[0] for line in
                  LocalBroker(load_config(None, environ={})).server_properties().splitlines()}
    props = kafka_properties(environment(kafka))
    advertised = check_kafka_kraft(props, local_keys)
    assert props["log.dirs"] in [t for _, t, _ in volumes(kafka)], "the broker's data is on no volume"
    for name in APP:
        bootstrap = invocation(name).cfg.kafka.bootstrap_servers
        assert bootstrap == advertised["PLAINTEXT"], name
        assert bootstrap.partition(":")[0] in SERVICES


def test_mlflow_server_on_postgres_is_where_the_processes_log():
    mlflow = SERVICES["mlflow"]
    params = mlflow_params(mlflow["command"])
    db = urlparse(params["backend_store_uri"])
    pg = environment(SERVICES["postgres"])
    assert db.scheme == "postgresql" and db.hostname in SERVICES
    assert (db.username, db.password, db.path.lstrip("/")) == (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"],
                                                               pg["POSTGRES_DB"])
    assert mlflow["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in APP:
        uri = urlparse(invocation(name).cfg.mlflow_uri)
        assert (uri.hostname, uri.port) == ("mlflow", params["port"]), name
        assert mlflow_admits(params["allowed_hosts"], uri.netloc), f"MLflow would refuse Host {uri.netloc}"
    assert mlflow_admits(params["allowed_hosts"], f"localhost:{params['port']}")  # the UI from the host
    assert f"{params['port']}:{params['port']}" in mlflow["ports"]


def test_load_balancer_spreads_over_the_serving_replicas():
    lb = SERVICES["lb"]
    conf_source = next(s for s, t, _ in volumes(lb) if t == "/etc/nginx/nginx.conf")
    conf = parse_nginx((REPO / conf_source).read_text())
    replicas = with_command("serve")
    check_nginx_upstreams(conf, {f"{n}:{invocation(n).cfg.serving.port}" for n in replicas})
    published = [p.split(":")[-1] for p in lb["ports"]]
    assert published and all(int(p) in conf.listen for p in published)
    assert conf.client_max_body_size >= invocation(replicas[0]).cfg.serving.max_request_bytes
    assert set(lb["depends_on"]) == set(replicas)


def test_the_load_balancer_waits_longer_than_a_replicas_deadline():
    """A request near serving's deadline gets serving's JSON 504 (``request_timeout``), not nginx's
    HTML one (docs/SERVING.md: keep the deadline below the timeouts of proxies in front)."""
    lb = SERVICES["lb"]
    conf_source = next(s for s, t, _ in volumes(lb) if t == "/etc/nginx/nginx.conf")
    conf = parse_nginx((REPO / conf_source).read_text())
    deadlines = {invocation(n).cfg.serving.request_timeout_s for n in with_command("serve")}
    assert conf.proxy_read_timeout_s is not None and conf.proxy_read_timeout_s > max(deadlines)


class _CatchingUpReplica(BaseHTTPRequestHandler):
    """A serving replica as its probes see it: alive all along (``/healthz`` 200), ready (``/readyz``
    200) only once it serves the weights the weights topic names (503 ``catching_up_weights`` before)."""

    ready = False

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response({"/healthz": 200, "/readyz": 200 if self.ready else 503}.get(self.path, 404))
        self.end_headers()

    def log_message(self, *args):
        pass


HEALTHCHECK_TIMEOUT_S = 60
"""Generous bound on the health-check subprocess (a Python start-up on a loaded machine)."""
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_DURATION_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration_s(text: str) -> float:
    """Seconds of a compose (Go) duration such as ``240s`` or ``1m30s``."""
    parts = _DURATION.findall(text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * _DURATION_S[u] for n, u in parts)


def health_check(name: str) -> tuple[list[str], dict[str, str]]:
    """The command Docker runs as ``name``'s health check and its timings: compose's own, else the
    image's ``HEALTHCHECK`` (flags as ``start_period``, ...)."""
    own = SERVICES[name].get("healthcheck")
    if own is not None:
        test = own["test"]
        assert test[0] == "CMD", f"{name}: a health check in exec form"
        return test[1:], {k: str(v) for k, v in own.items() if k != "test"}
    image = DOCKERFILE.stage(SERVICES[name]["build"]["target"]).last("HEALTHCHECK")
    return image.health_command(), {k.replace("-", "_"): v for k, v in image.flags.items()}


def _healthy(argv: list[str], ready: bool) -> bool:
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Replica", (_CatchingUpReplica,), {"ready": ready}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        command = [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]
        env = {"ONLINE_SAO__SERVING__PORT": str(server.server_address[1]), "PATH": "/usr/bin:/bin"}
        return subprocess.run(command, env=env, capture_output=True, timeout=HEALTHCHECK_TIMEOUT_S).returncode == 0
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("ready", [False, True])
def test_the_load_balancer_starts_once_the_replicas_are_ready_not_merely_alive(ready):
    """nginx probes nothing: the only readiness compose honours is ``lb`` waiting for healthy replicas.
    A replica catching up on weights (docs/SERVING.md, "After a start") answers with the base model,
    so it must not count as healthy; the image's check (``/healthz``) did."""
    for name in with_command("serve"):
        assert SERVICES["lb"]["depends_on"][name] == {"condition": "service_healthy"}
        argv, _ = health_check(name)
        assert _healthy(argv, ready) is ready, f"{name}: healthy={not ready} while ready={ready}"


def test_a_replicas_start_period_covers_its_weights_catch_up():
    """Failures inside the start period do not count: past it, a replica still catching up would be
    unhealthy and ``up`` would give up on ``lb``. /readyz says ready by ``serving.weights_catch_up_s``
    after the start at the latest, so the period covers the image's start period (loading the model)
    plus that bound."""
    image_start_s = duration_s(DOCKERFILE.default_target.last("HEALTHCHECK").flags["start-period"])
    for name in with_command("serve"):
        catch_up_s = invocation(name).cfg.serving.weights_catch_up_s
        assert catch_up_s is not None, f"{name}: with no bound on the catch-up no start period covers it"
        _, timings = health_check(name)
        assert duration_s(timings["start_period"]) >= image_start_s + catch_up_s


def test_dependencies_can_be_satisfied():
    for name, service in SERVICES.items():
        for target, spec in (service.get("depends_on") or {}).items():
            assert target in SERVICES, f"{name} depends on an unknown service {target}"
            other = SERVICES[target]
            if spec["condition"] == "service_healthy":
                own = other.get("healthcheck")
                from_image = other.get("build", {}).get("target")
                has_check = own is not None and not own.get("disable") or (
                    own is None and from_image and DOCKERFILE.stage(from_image).last("HEALTHCHECK"))
                assert has_check, f"{name} waits for {target} to be healthy, which has no health check"
            elif spec["condition"] == "service_completed_successfully":
                assert other.get("restart") in (None, "no", "on-failure"), f"{target} never completes"
            else:
                assert spec["condition"] == "service_started"


def test_volumes_are_declared_and_bind_mounts_exist():
    declared = set(COMPOSE["volumes"])
    used = set()
    for name, service in SERVICES.items():
        for source, target, _ in volumes(service):
            assert target.startswith("/"), f"{name}: {target}"
            if source.startswith("."):
                assert (REPO / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"
                used.add(source)
    assert used == declared, f"declared but unused: {sorted(declared - used)}"


@pytest.mark.parametrize("unset", sorted(OPERATOR_ENV))
def test_compose_refuses_to_start_without_the_operators_key_and_secret(unset):
    """Serving is exposed: a default in the file would be public (serving refuses placeholders too)."""
    environ = {k: v for k, v in OPERATOR_ENV.items() if k != unset}
    with pytest.raises(AssertionError, match=f"{unset}.* is required"):
        _interpolate(yaml.safe_load(COMPOSE_TEXT), environ)
