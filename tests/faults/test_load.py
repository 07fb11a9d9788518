"""Load (issue #7): 64 concurrent clients against one serving process while the learner trains
and serving hot-swaps, through the same code as ``online-sao load``: real broker, serving and
learner as subprocesses, the official openai client. Zero 5xx (zero failures at all), every
acknowledged interaction in Kafka exactly once with the versions its answer reported, and at
least one swap seen by the clients. 30 s by default; the 5-minute run is marked slow."""

from __future__ import annotations

import json
import uuid

import pytest

from apps.load.report import write_results
from apps.load.run import describe, run_on_stack, run_own_stack_overrides
from apps.load.stats import LoadParams

CLIENTS = 64


@pytest.mark.kafka
@pytest.mark.parametrize("duration_s", [30.0, pytest.param(300.0, marks=pytest.mark.slow)])
def test_load_under_swaps_answers_everything_and_logs_every_acknowledged_interaction(
        duration_s, kafka_broker, tiny_model_dir, tmp_path):
    run_id = f"load-{uuid.uuid4().hex[:10]}"
    run_dir = tmp_path / run_id
    overrides = {**run_own_stack_overrides(run_id, run_dir),
                 "paths.data_dir": str(tmp_path / "data"), "model.path": str(tiny_model_dir),
                 "kafka.bootstrap_servers": kafka_broker.bootstrap, "kafka.partitions": 3}
    params = LoadParams(clients=CLIENTS, duration_s=duration_s, max_tokens=24, progress_every_s=10.0)

    report = run_on_stack(None, overrides, run_dir, params)

    write_results(tmp_path / "load.json", report.result, report.summary,
                  {"kafka_check": report.logged.to_json()})
    figures = "\n".join(describe(report))
    print(figures)
    s, logged = report.summary, report.logged
    assert s.answered > CLIENTS, figures  # every client answered more than once
    assert s.server_errors == 0, figures
    assert s.errors == {}, figures
    assert s.feedback_ok == s.feedback_sent > 0, figures
    assert logged.acked == s.answered and logged.missing == [], figures
    assert logged.duplicates == {}, figures  # one serving process: each id exactly once
    assert logged.version_mismatches == [], figures
    assert len(s.versions_seen) >= 2 and s.swaps_observed >= 1, figures  # the clients saw a swap
    assert json.loads((tmp_path / "load.json").read_text())["summary"]["answered"] == s.answered
    assert report.passed
