"""docs/deploy/prometheus: every alert expression parses as PromQL and names only metrics, labels
and label values the project exports; the scrape targets are where compose runs the processes."""

from __future__ import annotations

import os
import subprocess

import promql_parser
import pytest
import yaml

from tests.deploy.checks import REPO, go_tool
from tests.deploy.promql import API_ROUTES, Exported, check_names, exported_samples, request_routes
from tests.deploy.test_compose import SERVICES, invocation, with_command

RULES_DIR = REPO / "docs" / "deploy" / "prometheus"
ALERTS = yaml.safe_load((RULES_DIR / "alerts.yml").read_text())
RULES = [rule for group in ALERTS["groups"] for rule in group["rules"]]


@pytest.fixture(scope="module")
def exported() -> Exported:
    return exported_samples()


@pytest.mark.parametrize("rule", RULES, ids=[r["alert"] for r in RULES])
def test_every_rule_parses_and_says_how_bad_it_is(rule):
    promql_parser.parse(rule["expr"])
    assert rule["labels"]["severity"] in {"critical", "warning"}
    assert rule["annotations"]["summary"]


@pytest.mark.parametrize("rule", RULES, ids=[r["alert"] for r in RULES])
def test_every_rule_names_metrics_labels_and_values_the_project_exports(rule, exported):
    check_names(rule["expr"], exported, rule["alert"])


def test_serving_errors_counts_the_api_requests_only():
    """A replica held unready answers its own readiness probe 503, a third of its requests with the
    liveness probe and the scrape (and 12 of 20 a minute under Kubernetes' probes): counted, the ratio
    fired a critical alert on probes; probes answering 200 diluted the users' errors."""
    rule, = (r for r in RULES if r["alert"] == "ServingErrors")
    counted = request_routes(rule["expr"])
    assert len(counted) == 2 and all(routes == API_ROUTES for routes in counted), counted


def test_the_prometheus_config_scrapes_where_compose_runs_the_processes():
    config = yaml.safe_load((RULES_DIR / "prometheus.yml").read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    replicas = with_command("serve")
    assert sorted(targets["serving"]) == sorted(f"{name}:{invocation(name).cfg.serving.port}" for name in replicas)
    learner = invocation("learner").cfg.trainer
    assert learner.metrics_host == "0.0.0.0"  # reachable from the prometheus container
    assert targets["learner"] == [f"learner:{learner.metrics_port}"]
    assert str(learner.metrics_port) in SERVICES["learner"]["expose"]
    mounted = {target: source for source, target, *_ in
               (item.split(":") for item in SERVICES["prometheus"]["volumes"])}
    for rule_file in config["rule_files"]:
        assert (REPO / mounted[rule_file]).resolve() == (RULES_DIR / "alerts.yml").resolve()
    assert (REPO / mounted["/etc/prometheus/prometheus.yml"]).resolve() == (RULES_DIR / "prometheus.yml").resolve()


def test_a_rule_naming_a_metric_nobody_exports_is_caught(exported):
    with pytest.raises(AssertionError, match="sao_learner_unread_recrods is not exported"):
        test_every_rule_names_metrics_labels_and_values_the_project_exports(
            {"alert": "Typo", "expr": "sao_learner_unread_recrods > 0"}, exported)
    with pytest.raises(AssertionError, match="never has topic='interaction'"):
        test_every_rule_names_metrics_labels_and_values_the_project_exports(
            {"alert": "Typo", "expr": 'sao_learner_unread_records{topic="interaction"} > 0'}, exported)


PROMETHEUS_VERSION = "v0.316.0"
"""Prometheus 3.16.0 (Go module versions v0.3XX.Y are releases v3.XX.Y), the release the compose
stack runs: its promtool here, the server itself in test_monitoring_stack.py."""


def _promtool() -> str:
    """``$PROMTOOL``, else a promtool built once with Go into .cache/promtool."""
    if os.environ.get("PROMTOOL"):
        return os.environ["PROMTOOL"]
    return str(go_tool("promtool", PROMETHEUS_VERSION, ["install", f"github.com/prometheus/prometheus/cmd/promtool@{PROMETHEUS_VERSION}"]))


@pytest.mark.slow
def test_the_rules_fire_when_and_only_when_their_unit_tests_say():
    """promtool checks the rule file and runs alerts.test.yml: series as the project exports them,
    and the minute each alert starts firing (each case also checks a minute before, silent)."""
    promtool = _promtool()
    subprocess.run([promtool, "check", "rules", str(RULES_DIR / "alerts.yml")], check=True)
    subprocess.run([promtool, "check", "config", "--syntax-only", str(RULES_DIR / "prometheus.yml")], check=True)
    subprocess.run([promtool, "test", "rules", str(RULES_DIR / "alerts.test.yml")], check=True)
