"""The Kubernetes example decodes strictly into the Kubernetes API's own Go types (and the
Prometheus Operator's, for docs/deploy/k8s/monitoring): tests/deploy/kubecheck, built with Go on
first use. No cluster is needed, and none runs here."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.checks import REPO, go_tool

KUBECHECK = REPO / "tests" / "deploy" / "kubecheck"
MANIFESTS = sorted(p for p in (REPO / "docs" / "deploy" / "k8s").rglob("*.yaml") if p.name != "kustomization.yaml")


def _kubecheck() -> Path:
    """Built once per version of its sources (main.go, go.mod, go.sum)."""
    digest = hashlib.sha256(b"".join((KUBECHECK / f).read_bytes() for f in ("main.go", "go.mod", "go.sum")))
    return go_tool("kubecheck", digest.hexdigest()[:16], ["build", "."], cwd=KUBECHECK)


def _run(*args: Path | str) -> subprocess.CompletedProcess:
    return subprocess.run([str(_kubecheck()), *map(str, args)], capture_output=True, text=True, timeout=60)


def _objects(paths: list[Path]) -> list[str]:
    return sorted(f"{o['apiVersion']}/{o['kind']} {o['metadata']['name']}"
                  for path in paths for o in yaml.safe_load_all(path.read_text()) if o)


@pytest.mark.slow
def test_every_object_of_the_example_decodes_strictly_into_its_api_type():
    result = _run(*MANIFESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    checked = sorted(line.removeprefix("ok ") for line in result.stdout.splitlines())
    assert checked == _objects(MANIFESTS)


@pytest.mark.slow
def test_kustomize_builds_each_kustomization_into_objects_that_decode_strictly():
    """What ``kubectl apply -k`` applies: kustomize's own build of docs/deploy/k8s and of
    monitoring/, together every object of the files, each once."""
    kustomizations = sorted(p.parent for p in (REPO / "docs" / "deploy" / "k8s").rglob("kustomization.yaml"))
    result = _run("-k", *kustomizations)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(line.removeprefix("ok ") for line in result.stdout.splitlines()) == _objects(MANIFESTS)


@pytest.mark.slow
def test_a_kustomization_naming_a_missing_file_fails_to_build(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: [serving.yaml]\n")
    result = _run("-k", tmp_path)
    assert result.returncode == 1 and "serving.yaml" in result.stdout, result.stdout + result.stderr


BROKEN = {
    "unknown field": ("""
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  replicass: 2
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec: {containers: [{name: web, image: nginx}]}
""", 'unknown field "spec.replicass"'),
    "wrong type": ("""
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  selector: {app: web}
  ports: [{name: http, port: eighty}]
""", "spec.ports"),
    "field given twice": ("""
apiVersion: v1
kind: ConfigMap
metadata: {name: web}
data: {a: "1"}
data: {b: "2"}
""", 'key "data" already set'),
    "bad name": ("""
apiVersion: v1
kind: Service
metadata: {name: Web_Service}
spec: {selector: {app: web}, ports: [{port: 80}]}
""", "metadata.name"),
    "port name too long": ("""
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: web}
spec:
  serviceName: web
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec: {containers: [{name: web, image: nginx, ports: [{name: rendezvous-ports, containerPort: 29500}]}]}
""", "rendezvous-ports"),
    "operator's field misspelt": ("""
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata: {name: web}
spec:
  jobLabels: app
  selector: {matchLabels: {app: web}}
  endpoints: [{port: http}]
""", 'unknown field "spec.jobLabels"'),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", BROKEN)
def test_kubecheck_refuses_what_the_api_server_would(case, tmp_path):
    text, reason = BROKEN[case]
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    result = _run(path)
    assert result.returncode == 1 and result.stdout.startswith("FAIL"), result.stdout + result.stderr
    assert reason in result.stdout, result.stdout
