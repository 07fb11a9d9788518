"""The Kubernetes example (docs/deploy/k8s) names only commands, settings, ports, volumes and
objects that exist: in the project, in torchrun, in MLflow, or in the manifests themselves."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

import pytest
import yaml
from pydantic import SecretStr

from apps.experiments.scenario import results_dir
from online_sao.config import KafkaConfig, load_config
from serving.app import _ROUTES as SERVING_ROUTES
from serving.auth import check_exposure
from streams.broker import LocalBroker
from tests.deploy.checks import (
    REPO,
    Invocation,
    Torchrun,
    check_config_env,
    check_kafka_kraft,
    k8s_expand,
    kafka_properties,
    mlflow_admits,
    mlflow_params,
    parse_torchrun,
    resolve_invocation,
)
from tests.deploy.dockerfile import parse_dockerfile

K8S = REPO / "docs" / "deploy" / "k8s"
FILES = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
OBJECTS = [doc for path in FILES for doc in yaml.safe_load_all(path.read_text()) if doc]
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")
DOCKERFILE = parse_dockerfile((REPO / "Dockerfile").read_text())


def named(kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in OBJECTS if o["kind"] == kind}


WORKLOADS = {o["metadata"]["name"]: o for o in OBJECTS if o["kind"] in WORKLOAD_KINDS}
SECRETS = {name: s.get("stringData", {}) for name, s in named("Secret").items()}
CONFIGMAPS = {name: c["data"] for name, c in named("ConfigMap").items()}


def pod(workload: str) -> dict:
    return WORKLOADS[workload]["spec"]["template"]["spec"]


def containers(workload: str, init: bool = False) -> list[dict]:
    return pod(workload).get("initContainers" if init else "containers", [])


def container_env(c: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(SECRETS[source["secretRef"]["name"]])
    for item in c.get("env", []):
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        env[item["name"]] = SECRETS[ref["name"]][ref["key"]] if ref else item.get("value", "0")
    return env


@dataclass
class Mount:
    volume: str
    """What backs it: ``pvc:<claim>``, ``template:<name>``, ``emptyDir:<name>``, ``configMap:<name>``."""
    inside: str
    read_only: bool


def mount_at(workload: str, c: dict, path: str) -> Mount:
    """The volume of ``c`` holding ``path`` (the deepest mount above it)."""
    volumes = {v["name"]: v for v in pod(workload).get("volumes", [])}
    best = None
    for m in c.get("volumeMounts", []):
        if PurePosixPath(path).is_relative_to(m["mountPath"]) and (best is None or len(m["mountPath"]) > len(best["mountPath"])):
            best = m
    assert best is not None, f"{workload}/{c['name']}: {path} is on no volume"
    v = volumes.get(best["name"])
    if v is None:
        source = f"template:{best['name']}"
    elif "persistentVolumeClaim" in v:
        source = f"pvc:{v['persistentVolumeClaim']['claimName']}"
    else:
        source = f"{next(k for k in v if k != 'name')}:{v['name']}"
    read_only = bool(best.get("readOnly") or (v or {}).get("persistentVolumeClaim", {}).get("readOnly"))
    return Mount(source, str(PurePosixPath(path).relative_to(best["mountPath"])), read_only)


@pytest.fixture(scope="module")
def configmap_files(tmp_path_factory) -> dict[str, Path]:
    """ConfigMap name/key -> the key's content written to a file here."""
    root = tmp_path_factory.mktemp("configmaps")
    files = {}
    for name, data in CONFIGMAPS.items():
        for key, text in data.items():
            (root / name).mkdir(exist_ok=True)
            (root / name / key).write_text(text)
            files[f"{name}/{key}"] = root / name / key
    return files


def app_containers() -> list[tuple[str, str]]:
    return [(w, c["name"]) for w in WORKLOADS for c in containers(w) if c["image"].startswith("online-sao:")]


def invocation(workload: str, name: str, files: dict[str, Path]) -> tuple[Invocation, Torchrun | None]:
    c = next(c for c in containers(workload) if c["name"] == name)
    env = container_env(c)
    volumes = {v["name"]: v for v in pod(workload).get("volumes", [])}
    mounts = {}
    for m in c.get("volumeMounts", []):
        cm = volumes.get(m["name"], {}).get("configMap")
        if cm:
            mounts.update({f"{m['mountPath']}/{key}": files[f"{cm['name']}/{key}"] for key in CONFIGMAPS[cm["name"]]})
    command = [k8s_expand(w, env) for w in c.get("command", [])]
    argv = [k8s_expand(w, env) for w in c.get("args", [])]
    torchrun = None
    if command:
        torchrun = parse_torchrun(command + argv)
        assert torchrun.module == "apps.cli", "torchrun must start the online-sao CLI"
        argv = torchrun.module_args
    return resolve_invocation(argv, mounts, env), torchrun


def with_command(command: str, files) -> list[tuple[str, str]]:
    return [wc for wc in app_containers() if invocation(*wc, files)[0].args.command == command]


def test_kustomization_lists_every_manifest():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == [p.name for p in FILES]


def test_objects_are_well_formed_and_uniquely_named():
    seen = set()
    for o in OBJECTS:
        assert o["apiVersion"] and o["kind"] and o["metadata"]["name"]
        assert (o["kind"], o["metadata"]["name"]) not in seen
        seen.add((o["kind"], o["metadata"]["name"]))
    assert {"Deployment", "StatefulSet", "Job", "Service", "ConfigMap", "Secret", "PersistentVolumeClaim"} <= {
        o["kind"] for o in OBJECTS}


def test_every_reference_resolves():
    claims = set(named("PersistentVolumeClaim"))
    for w, workload in WORKLOADS.items():
        spec = pod(w)
        templates = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"] for v in spec.get("volumes", [])}
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, f"{w}: {v}"
            if "configMap" in v:
                assert v["configMap"]["name"] in CONFIGMAPS, f"{w}: {v}"
        for c in containers(w) + containers(w, init=True):
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes | templates, f"{w}/{c['name']}: no volume {m['name']}"
            container_env(c)  # every secret and key it names exists (KeyError otherwise)


def pod_labels(workload: str) -> list[dict[str, str]]:
    """The labels of each pod the workload runs: its template's, and for a StatefulSet those its
    controller adds to pod ``i`` (Kubernetes 1.28 or newer for the pod index)."""
    w = WORKLOADS[workload]
    labels = w["spec"]["template"]["metadata"]["labels"]
    if w["kind"] != "StatefulSet":
        return [labels]
    return [{**labels, "statefulset.kubernetes.io/pod-name": f"{workload}-{i}", "apps.kubernetes.io/pod-index": str(i)}
            for i in range(w["spec"]["replicas"])]


def selected_pods(service: dict) -> dict[str, list[int]]:
    """Workload -> the indices of its pods the Service selects."""
    selector = service["spec"]["selector"]
    found = {w: [i for i, labels in enumerate(pod_labels(w)) if selector.items() <= labels.items()] for w in WORKLOADS}
    return {w: pods for w, pods in found.items() if pods}


def test_services_select_workloads_and_their_ports():
    for name, service in named("Service").items():
        matches = list(selected_pods(service))
        assert len(matches) == 1, f"Service {name} selects {matches}"
        ports = {p.get("name"): p["containerPort"] for c in containers(matches[0]) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports or port["targetPort"] in ports.values(), f"{name}: {port}"
    for w, workload in WORKLOADS.items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        if workload["kind"] != "Job":
            assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items(), w
        if workload["kind"] == "StatefulSet":
            assert workload["spec"]["serviceName"] in named("Service"), w


@pytest.mark.parametrize("workload, container", app_containers())
def test_every_online_sao_command_parses_and_its_configuration_validates(workload, container, configmap_files):
    inv, _ = invocation(workload, container, configmap_files)
    assert inv.args.config is not None


def test_secrets_are_config_fields():
    check_config_env(SECRETS["online-sao-secrets"])
    assert all(k.startswith("ONLINE_SAO__") for k in SECRETS["online-sao-secrets"])


def test_serving_deployment_probes_and_service(configmap_files):
    (workload, name), = with_command("serve", configmap_files)
    inv, _ = invocation(workload, name, configmap_files)
    cfg = inv.cfg
    c = next(c for c in containers(workload) if c["name"] == name)
    assert WORKLOADS[workload]["kind"] == "Deployment" and WORKLOADS[workload]["spec"]["replicas"] == 2
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] in SERVING_ROUTES and ports[get["port"]] == cfg.serving.port, probe
    # the example's secrets are placeholders ("replace every value before applying"): refused as they are
    with pytest.raises(ValueError, match="feedback_secret is a placeholder"):
        check_exposure(cfg.serving)
    check_exposure(cfg.serving.model_copy(update={"feedback_secret": SecretStr("0f" * 32),
                                                   "api_keys": [SecretStr("sk-operators-own")]}))
    assert mount_at(workload, c, cfg.weight_store_url).read_only
    assert not mount_at(workload, c, str(cfg.spool_dir)).read_only


def test_learner_runs_torchrun_across_the_statefulset(configmap_files):
    (workload, name), = with_command("learn", configmap_files)
    sts = WORKLOADS[workload]
    c = next(c for c in containers(workload) if c["name"] == name)
    inv, run = invocation(workload, name, configmap_files)
    assert sts["kind"] == "StatefulSet" and sts["spec"]["podManagementPolicy"] == "Parallel"
    assert run.options.nnodes == str(sts["spec"]["replicas"])
    assert int(run.options.nproc_per_node) == int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert c["command"][c["command"].index("--node-rank") + 1] == "$(NODE_RANK)"
    node_rank = next(e for e in c["env"] if e["name"] == "NODE_RANK")["valueFrom"]["fieldRef"]["fieldPath"]
    assert node_rank == "metadata.labels['apps.kubernetes.io/pod-index']"
    service = named("Service")[sts["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"
    assert run.options.master_addr == f"{workload}-0.{sts['spec']['serviceName']}"
    rendezvous = {p["name"]: p["containerPort"] for p in c["ports"]}["rendezvous"]
    assert run.options.master_port == rendezvous == service["spec"]["ports"][0]["port"]
    cfg = inv.cfg
    checkpoints = mount_at(workload, c, str(cfg.checkpoint_dir))
    assert checkpoints.volume.startswith("template:") and not checkpoints.read_only
    weights = mount_at(workload, c, cfg.weight_store_url)
    assert not weights.read_only
    (s_workload, s_name), = with_command("serve", configmap_files)
    s_cfg = invocation(s_workload, s_name, configmap_files)[0].cfg
    s_container = next(x for x in containers(s_workload) if x["name"] == s_name)
    assert s_cfg.weight_store_url == cfg.weight_store_url  # notices carry absolute paths
    assert mount_at(s_workload, s_container, s_cfg.weight_store_url).volume == weights.volume


TORCHRUN_EXIT_S = 30
"""What torchrun keeps of the pod's grace period for itself: its SIGKILL of the workers and its exit."""


def test_torchrun_gives_the_workers_the_pods_grace_period(configmap_files):
    """On SIGTERM torchrun sends the workers SIGTERM and SIGKILLs them after its shutdown timeout (30 s
    by default, whatever the pod's grace period): the learner's graceful stop (finish the step,
    checkpoint, commit the offsets) gets that, not the grace period."""
    (workload, name), = with_command("learn", configmap_files)
    c = next(c for c in containers(workload) if c["name"] == name)
    _, run = invocation(workload, name, configmap_files)
    timeout_s = run.options.shutdown_timeout
    if timeout_s is None:  # as torch.distributed.launcher reads it
        timeout_s = int(container_env(c).get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    grace_s = pod(workload)["terminationGracePeriodSeconds"]
    assert grace_s - TORCHRUN_EXIT_S <= timeout_s < grace_s, (timeout_s, grace_s)


def test_the_learner_metrics_service_reaches_rank_zero_alone(configmap_files):
    """Only rank 0 serves trainer.metrics_port: the Service selects pod 0 of the StatefulSet (a
    scrape of every pod would show the other ranks down) on the port rank 0 listens on."""
    (workload, name), = with_command("learn", configmap_files)
    c = next(c for c in containers(workload) if c["name"] == name)
    cfg = invocation(workload, name, configmap_files)[0].cfg.trainer
    assert cfg.metrics_host == "0.0.0.0"  # reachable from Prometheus's pod
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    services = [s for s in named("Service").values()
                if any(ports.get(p["targetPort"]) == cfg.metrics_port for p in s["spec"]["ports"])]
    assert len(services) == 1, [s["metadata"]["name"] for s in services]
    assert selected_pods(services[0]) == {workload: [0]}


def test_every_process_reads_the_model_the_job_builds(configmap_files):
    (workload, name), = with_command("base-model", configmap_files)
    builder = invocation(workload, name, configmap_files)[0].cfg
    assert builder.model.path is None
    c = next(c for c in containers(workload) if c["name"] == name)
    built = mount_at(workload, c, str(builder.model_dir))
    assert built.volume.startswith("pvc:") and not built.read_only
    readers = [wc for command in ("serve", "learn", "judge") for wc in with_command(command, configmap_files)]
    assert len(readers) == 3
    for w, n in readers:
        cfg = invocation(w, n, configmap_files)[0].cfg
        assert cfg.model.path is not None, f"{w}/{n} would build its own model"
        c = next(c for c in containers(w) if c["name"] == n)
        here = mount_at(w, c, str(cfg.model_dir))
        assert (here.volume, here.inside) == (built.volume, built.inside), f"{w}/{n}"
        for init in containers(w, init=True):  # a wait-for-model step waits for this very model
            assert f"{cfg.model_dir}/config.json" in " ".join(init["command"])
            assert mount_at(w, init, str(cfg.model_dir)).volume == built.volume


def test_the_judge_keeps_its_results_on_a_claim_and_never_runs_twice(configmap_files):
    """Its results file is its memory: the preference schedule counts the rollouts it scored, read back
    at every start (a pod rescheduled onto a new emptyDir began the schedule again). One
    judge at a time: a rolling update runs the new pod beside the old in one consumer group."""
    (workload, name), = with_command("judge", configmap_files)
    deployment = WORKLOADS[workload]
    c = next(c for c in containers(workload) if c["name"] == name)
    results = mount_at(workload, c, str(results_dir(invocation(workload, name, configmap_files)[0].cfg)))
    assert results.volume.startswith("pvc:") and not results.read_only, results
    assert results.volume.removeprefix("pvc:") in named("PersistentVolumeClaim")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"].get("strategy", {}).get("type") == "Recreate"


def test_kafka_statefulset_is_the_configured_bootstrap(configmap_files):
    sts = named("StatefulSet")["online-sao-kafka"]
    c = containers("online-sao-kafka")[0]
    image, _, tag = c["image"].partition(":")
    assert image == "apache/kafka" and tag == KafkaConfig().kafka_version
    props = kafka_properties(container_env(c))
    local_keys = {line.partition("=")[0] for line in
                  LocalBroker(load_config(None, environ={})).server_properties().splitlines()}
    advertised = check_kafka_kraft(props, local_keys)
    host = advertised["PLAINTEXT"].partition(":")[0]
    assert re.fullmatch(rf"online-sao-kafka-\d+\.{sts['spec']['serviceName']}", host)
    log_dir = mount_at("online-sao-kafka", c, props["log.dirs"])
    assert log_dir.volume.startswith("template:")
    # a block volume's root holds lost+found, which the broker takes for a partition and stops: fatal at start
    assert log_dir.inside != ".", f"log.dirs {props['log.dirs']} is the root of its volume"
    for w, n in app_containers():
        assert invocation(w, n, configmap_files)[0].cfg.kafka.bootstrap_servers == advertised["PLAINTEXT"]


def test_mlflow_runs_on_postgres_and_admits_the_processes(configmap_files):
    c = containers("online-sao-mlflow")[0]
    assert c["image"].startswith("online-sao-mlflow:")  # the Dockerfile's mlflow target
    params = mlflow_params([k8s_expand(a, container_env(c)) for a in c["args"]])
    db = urlparse(params["backend_store_uri"])
    pg = container_env(containers("online-sao-postgres")[0])
    pg_data = mount_at("online-sao-postgres", containers("online-sao-postgres")[0], pg["PGDATA"])
    assert pg_data.inside != ".", "PGDATA is the root of its volume, where lost+found makes initdb refuse it"
    pg_service = named("Service")[db.hostname]
    assert (db.username, db.password, db.path.lstrip("/")) == (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"],
                                                               pg["POSTGRES_DB"])
    assert db.port == pg_service["spec"]["ports"][0]["port"]
    service = named("Service")["online-sao-mlflow"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]}[service["spec"]["ports"][0]["targetPort"]] == params["port"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    for w, n in app_containers():
        uri = urlparse(invocation(w, n, configmap_files)[0].cfg.mlflow_uri)
        assert (uri.hostname, uri.port) == ("online-sao-mlflow", service["spec"]["ports"][0]["port"])
        assert mlflow_admits(params["allowed_hosts"], uri.netloc), f"MLflow would refuse Host {uri.netloc}"


def test_pods_run_as_the_users_the_images_create():
    runtime_uid = int(DOCKERFILE.default_target.args["UID"])
    mlflow_uid = int(re.search(r"--uid (\d+)", " ".join(i.args for i in DOCKERFILE.stage("mlflow").all("RUN"))).group(1))
    for w in WORKLOADS:
        images = {c["image"].partition(":")[0] for c in containers(w)}
        expected = {"online-sao": runtime_uid, "online-sao-mlflow": mlflow_uid}.get(images.pop())
        if expected is not None:
            security = pod(w)["securityContext"]
            assert security["runAsNonRoot"] and security["runAsUser"] == expected == security["fsGroup"], w


def test_disruption_budgets_cover_one_workload_and_still_let_a_drain_through():
    budgets = named("PodDisruptionBudget")
    assert budgets, "serving has a disruption budget"
    for name, budget in budgets.items():
        selector = budget["spec"]["selector"]["matchLabels"]
        matches = [w for w in WORKLOADS if any(selector.items() <= labels.items() for labels in pod_labels(w))]
        assert len(matches) == 1, f"PodDisruptionBudget {name} covers {matches}"
        replicas = WORKLOADS[matches[0]]["spec"]["replicas"]
        # a budget that allows no eviction at all blocks every node drain
        assert budget["spec"]["minAvailable"] < replicas, f"{name}: no pod of {matches[0]} may ever be evicted"
