"""The monitoring stack end to end, with real parts: Prometheus itself (3.16.0, built with Go on
first use) scrapes the real serving stack (TorchEngine, real broker, real HTTP) and the learner's
exporter, loads alerts.yml, and answers every query of the Grafana dashboard."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from tests.deploy.checks import REPO, go_tool
from tests.deploy.test_grafana import EMPTY_WITHOUT_EVENTS, PANELS
from tests.deploy.test_prometheus import ALERTS, PROMETHEUS_VERSION
from tests.fixtures.models import tiny_config
from tests.serving.conftest import start_live_server
from trainer.exporter import LearnerExporter
from trainer.feed import KeepingUp
from trainer.rank_zero import COUNTERS

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

SCRAPE_EVERY_S = 1
RATE_WINDOW = "15s"
"""What the dashboard's ``$__rate_interval`` stands for here: many scrapes at one a second."""


def _prometheus() -> str:
    return str(go_tool("prometheus", PROMETHEUS_VERSION,
                       ["install", f"github.com/prometheus/prometheus/cmd/prometheus@{PROMETHEUS_VERSION}"]))


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _query(base: str, expr: str) -> dict:
    return _get(f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")


@pytest.fixture
def prometheus(tmp_path, tiny_model_dir, kafka_config, free_port_factory):
    """Prometheus scraping a live serving stack (job serving) and a learner exporter (job learner)
    every second, with alerts.yml loaded; yields (its base URL, the serving stack, the exporter) once
    both targets are up."""
    cfg = tiny_config(tmp_path).model_copy(update={"kafka": kafka_config})
    live = start_live_server(cfg, tiny_model_dir)
    learner = LearnerExporter("127.0.0.1", 0)
    learner.step(7, 1, 0.5, {"mean_length": 12.0, "repetition": 0.1}, {name: 0.0 for name in COUNTERS})
    learner.keeping_up(KeepingUp(unread_interactions=0, unread_rewards=0, waiting=3, ready=1,
                                 data_age_mean_s=2.0, data_age_max_s=4.0))
    learner.decision({"repetition": 0.1}, [])
    learner.sources({"user": (0.4, 12), "judge": (0.7, 30)})
    serving_target = urllib.parse.urlparse(live.base_url).netloc
    config = {
        "global": {"scrape_interval": f"{SCRAPE_EVERY_S}s", "evaluation_interval": f"{SCRAPE_EVERY_S}s"},
        "rule_files": [str(REPO / "docs" / "deploy" / "prometheus" / "alerts.yml")],
        "scrape_configs": [{"job_name": "serving", "static_configs": [{"targets": [serving_target]}]},
                           {"job_name": "learner", "static_configs": [{"targets": [f"127.0.0.1:{learner.port}"]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port_factory()
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen([_prometheus(), f"--config.file={tmp_path / 'prometheus.yml'}",
                                f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                targets = _get(f"{base}/api/v1/targets")["data"]["activeTargets"]
                if len(targets) == 2 and all(t["health"] == "up" for t in targets):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"Prometheus did not scrape both targets: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
        yield base, live, learner
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
        learner.close()
        live.stop()


def test_prometheus_answers_every_dashboard_query_and_evaluates_every_rule(prometheus):
    base, live, learner = prometheus
    client = live.openai()
    for i in range(6):  # serving answers, the learner steps (at version 1: serving, at 0, is not behind)
        client.chat.completions.create(model=live.cfg.serving.model_name, max_tokens=8,
                                       messages=[{"role": "user", "content": f"hello {i}"}])
        learner.step(8 + i, 1, 0.5, {"mean_length": 12.0, "repetition": 0.1}, {name: 0.0 for name in COUNTERS})
        time.sleep(SCRAPE_EVERY_S)
    time.sleep(int(RATE_WINDOW.removesuffix("s")))  # every rate window holds the requests

    for panel in PANELS:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", RATE_WINDOW)
            answer = _query(base, expr)
            assert answer["status"] == "success", f"{panel['title']}: {answer}"
            series = answer["data"]["result"]
            if (panel["title"], target["refId"]) in EMPTY_WITHOUT_EVENTS:
                continue
            assert series, f"{panel['title']} ({target['refId']}): no series for {expr}"
            for label in re.findall(r"\{\{(\w+)\}\}", target.get("legendFormat", "")):
                assert all(label in s["metric"] for s in series), f"{panel['title']}: a series without {label}"

    rules = [r for group in _get(f"{base}/api/v1/rules")["data"]["groups"] for r in group["rules"]]
    expected = [r["alert"] for group in ALERTS["groups"] for r in group["rules"]]
    assert sorted(r["name"] for r in rules) == sorted(expected)
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    # a stack that answers and a learner that steps and keeps up: nothing pending, nothing firing
    # (the first run of this test, with a learner whose step never moved, had LearnerStalled pending)
    assert _get(f"{base}/api/v1/alerts")["data"]["alerts"] == []
