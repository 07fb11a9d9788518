"""docs/deploy/k8s/monitoring: the Prometheus Operator's objects scrape the Services of the
example, under the job names the alert rules match on, and carry the rules of alerts.yml."""

from __future__ import annotations

import re

import yaml

from serving.app import _ROUTES as SERVING_ROUTES
from tests.deploy.checks import REPO
from tests.deploy.test_k8s import named

MONITORING = REPO / "docs" / "deploy" / "k8s" / "monitoring"
FILES = sorted(p for p in MONITORING.glob("*.yaml") if p.name != "kustomization.yaml")
OBJECTS = [doc for path in FILES for doc in yaml.safe_load_all(path.read_text()) if doc]
PROMETHEUS = REPO / "docs" / "deploy" / "prometheus"
ALERTS = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
JOB_MATCHER = re.compile(r'\bjob\s*=\s*"([^"]*)"')


def monitoring(kind: str) -> list[dict]:
    return [o for o in OBJECTS if o["kind"] == kind]


def test_the_kustomization_lists_every_manifest():
    listed = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == [p.name for p in FILES]
    assert {o["apiVersion"] for o in OBJECTS} == {"monitoring.coreos.com/v1"}


def test_each_service_monitor_scrapes_one_service_under_a_job_the_alerts_name():
    services = named("Service")
    jobs = {}
    for monitor in monitoring("ServiceMonitor"):
        spec = monitor["spec"]
        matched = [s for s in services.values() if spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert len(matched) == 1, f"{monitor['metadata']['name']} selects {[s['metadata']['name'] for s in matched]}"
        service = matched[0]
        port_names = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in spec["endpoints"]:
            assert endpoint["port"] in port_names, f"{monitor['metadata']['name']}: {endpoint}"
            assert endpoint["path"] == "/metrics"
        jobs[service["metadata"]["labels"][spec["jobLabel"]]] = service["metadata"]["name"]
    assert "/metrics" in SERVING_ROUTES
    assert jobs == {"serving": "online-sao-serving", "learner": "online-sao-learner-metrics"}
    in_rules = {job for group in ALERTS["groups"] for rule in group["rules"] for job in JOB_MATCHER.findall(rule["expr"])}
    compose = {job["job_name"] for job in yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())["scrape_configs"]}
    assert in_rules == set(jobs) == compose


def test_the_prometheus_rule_holds_the_groups_of_alerts_yml():
    rule, = monitoring("PrometheusRule")
    assert rule["spec"]["groups"] == ALERTS["groups"], (
        "docs/deploy/k8s/monitoring/prometheusrule.yaml differs from alerts.yml; its spec should read:\n"
        + yaml.safe_dump({"groups": ALERTS["groups"]}, sort_keys=False, width=100))
