"""docs/deploy/grafana: every panel of the dashboard queries PromQL that names only what the
project exports, on the data source Grafana is given, and compose mounts what the provisioning
files point at."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.deploy.checks import REPO
from tests.deploy.promql import API_ROUTES, SELECTOR, Exported, check_names, exported_samples, request_routes
from tests.deploy.test_compose import SERVICES

GRAFANA = REPO / "docs" / "deploy" / "grafana"
DASHBOARD = json.loads((GRAFANA / "dashboards" / "online-sao.json").read_text())
PANELS = [p for p in DASHBOARD["panels"] if p["type"] != "row"]
EMPTY_WITHOUT_EVENTS = {
    ("API requests answered with a 5xx, per replica", "A"): "no request fails here, so no 5xx series exists",
    ("Weight versions considered, by outcome", "A"): "no weights are published here, so no swap was counted",
    ("Policy version: the learner's and each replica's", "C"): "no operator holds the weights here",
}
"""(panel title, query refId) of the queries that have no series until something the monitoring-stack
test (Prometheus scraping a live stack, tests/deploy/test_monitoring_stack.py) does not cause happens."""
DATASOURCES = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
PROVIDERS = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "online-sao.yml").read_text())["providers"]
GRID_COLUMNS = 24
GRAFANA_RANGES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}
"""Grafana's range variables, and a duration each stands for when the query is parsed here."""


@pytest.fixture(scope="module")
def exported() -> Exported:
    return exported_samples()


def promql(expr: str) -> str:
    """The query as Prometheus receives it: Grafana's range variables replaced by durations."""
    for variable, duration in GRAFANA_RANGES.items():
        expr = expr.replace(variable, duration)
    assert "$" not in expr, f"a Grafana variable this dashboard does not define: {expr}"
    return expr


def result_labels(expr: str, exported: Exported) -> set[str]:
    """Labels the query's series carry: those it aggregates by, or, without an aggregation, those
    of the metrics it names and the ones Prometheus adds to every scraped series."""
    grouped = re.findall(r"\bby\s*\(([^)]*)\)", expr)
    if grouped:
        return {label.strip() for labels in grouped for label in labels.split(",")}
    if re.search(r"\b(sum|max|min|avg|count)\s*\(", expr):
        return set()
    names = [name for name, _ in SELECTOR.findall(expr)]
    return {"instance", "job"} | {label for name in names for labels in exported[name] for label in labels}


@pytest.mark.parametrize("panel", PANELS, ids=[p["title"] for p in PANELS])
def test_every_query_names_metrics_labels_and_values_the_project_exports(panel, exported):
    assert panel["targets"], panel["title"]
    for target in panel["targets"]:
        check_names(promql(target["expr"]), exported, f"{panel['title']} ({target['refId']})")
        for label in re.findall(r"\{\{(\w+)\}\}", target.get("legendFormat", "")):
            assert label in result_labels(target["expr"], exported), \
                f"{panel['title']}: the legend names {label}, which the query's series do not have"


def test_the_5xx_share_counts_the_api_requests_only():
    """The panel of the ServingErrors alert counts what the alert counts: no probes, no scrapes."""
    panel, = (p for p in PANELS if "ServingErrors" in p.get("description", ""))
    for target in panel["targets"]:
        counted = request_routes(promql(target["expr"]))
        assert counted and all(routes == API_ROUTES for routes in counted), (panel["title"], counted)


def test_panels_use_the_provisioned_data_source_and_do_not_overlap():
    source, = DATASOURCES
    ids, cells = set(), set()
    for panel in DASHBOARD["panels"]:
        assert panel["id"] not in ids
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
        mine = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
    for panel in PANELS:
        for ref in [panel["datasource"], *(t["datasource"] for t in panel["targets"])]:
            assert ref == {"type": source["type"], "uid": source["uid"]}, panel["title"]


def test_compose_runs_grafana_on_its_prometheus_with_the_provisioned_files():
    source, = DATASOURCES
    prometheus_port = SERVICES["prometheus"]["ports"][0].split(":")[-1]
    assert source["url"] == f"http://prometheus:{prometheus_port}"
    mounts = {target: source for source, target, *_ in (m.split(":") for m in SERVICES["grafana"]["volumes"])}
    assert (REPO / mounts["/etc/grafana/provisioning"]).resolve() == (GRAFANA / "provisioning").resolve()
    provider, = PROVIDERS
    assert (REPO / mounts[provider["options"]["path"]]).resolve() == (GRAFANA / "dashboards").resolve()


def test_a_panel_on_a_counter_name_nobody_exports_is_caught(exported):
    panel = {"title": "Typo", "targets": [{"refId": "A", "expr": "rate(sao_serving_request_total[$__rate_interval])"}]}
    with pytest.raises(AssertionError, match="sao_serving_request_total is not exported"):
        test_every_query_names_metrics_labels_and_values_the_project_exports(panel, exported)
    panel["targets"][0] = {"refId": "A", "expr": 'sao_learner_count{name=~"dead_letters|roll_backs"}'}
    with pytest.raises(AssertionError, match="never has name='roll_backs'"):
        test_every_query_names_metrics_labels_and_values_the_project_exports(panel, exported)


def test_the_panels_left_empty_by_the_monitoring_stack_test_are_on_the_dashboard():
    """A renamed panel ("Requests answered with a 5xx" became "API requests answered with a 5xx") fell out of
    the slow monitoring-stack test's exceptions, which then failed on its empty query."""
    assert set(EMPTY_WITHOUT_EVENTS) <= {(p["title"], t["refId"]) for p in PANELS for t in p["targets"]}
