"""The report on synthetic results: files, valid PNGs, table numbers equal to the metrics, MLflow."""

from __future__ import annotations

import json
import random

import pytest
from matplotlib.image import imread
from mlflow import MlflowClient

from apps.config import ExperimentConfig
from apps.experiments.metrics import detect_collapse, switch_metrics
from apps.experiments.report import COMPARISON_PNG, REWARDS_PNG, STYLE_PNG, write_report
from apps.experiments.results import (ArmSummary, EvalRow, RewardRow, append_row, count_reward_rows,
                                            read_arm, write_scenario)

SCENARIO = ExperimentConfig(
    name="synthetic", rollouts_per_arm=60, metrics_window=4, eval_every=20,
    schedule=[{"from_rollout": 0, "style": "formal"}, {"from_rollout": 20, "style": "cute"},
              {"from_rollout": 40, "style": "archaic"}],
    arms=[{"name": "sao"}, {"name": "running_mean_w8", "algorithm": {"name": "running_mean",
                                                                     "running_mean_window": 8}}])


def synthetic_rewards(recovery: int, seed: int) -> list[float]:
    """Reward 0.9 except for ``recovery`` rollouts of 0.1 after each switch, plus noise."""
    rng = random.Random(seed)
    out = []
    for i in range(60):
        since = i if i < 20 else (i - 20 if i < 40 else i - 40)
        base = 0.1 if i >= 20 and since < recovery else 0.9
        out.append(min(1.0, max(0.0, base + rng.uniform(-0.05, 0.05))))
    return out


@pytest.fixture
def results(tmp_path):
    directory = tmp_path / "results"
    write_scenario(directory, SCENARIO)
    series = {"sao": synthetic_rewards(3, 0), "running_mean_w8": synthetic_rewards(12, 1)}
    for name, rewards in series.items():
        path = directory / f"{name}.jsonl"
        for i, r in enumerate(rewards):
            append_row(path, RewardRow(rollout=i, t=1000.0 + i, version=i // 4, reward=r, quality=1.0, style=r,
                                       preferred=SCENARIO.preferred_style(i)))
            if i % SCENARIO.eval_every == SCENARIO.eval_every - 1:
                append_row(path, EvalRow(rollout=i, t=1000.0 + i, version=i // 4, style_accuracy=r,
                                         preferred=SCENARIO.preferred_style(i), prompts=8))
    (directory / "running_mean_w8.summary.json").write_text(
        ArmSummary(name="running_mean_w8", group_wait_s=12.5).model_dump_json())
    return directory, series


def table_row(markdown: str, arm: str) -> list[str]:
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {arm} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_report_files_plots_and_table(results, tmp_path):
    directory, series = results
    out = tmp_path / "report"
    path = write_report(directory, out)
    assert path == out / "report.md"
    for png in (REWARDS_PNG, COMPARISON_PNG, STYLE_PNG):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = imread(out / png)
        assert image.shape[0] > 200 and image.shape[1] > 400
        assert f"]({png})" in path.read_text()
    text = path.read_text()
    for arm, rewards in series.items():
        expected = switch_metrics(rewards, [20, 40], 4)
        row = table_row(text, arm)
        assert row[1] == "60"
        assert row[2] == f"{sum(rewards) / 60:.3f}"
        assert row[3:7] == [str(expected[0].lag), f"{expected[0].level:.3f}",
                            str(expected[1].lag), f"{expected[1].level:.3f}"]
        assert row[7] == "no" and not detect_collapse(rewards, [1.0] * 60, 4, 0.5).collapsed
        assert row[8] == f"{rewards[59]:.3f}"  # the last held-out style accuracy
    assert table_row(text, "running_mean_w8")[9] == "12.5" and table_row(text, "sao")[9] == "-"
    # The slow arm recovers later: the synthetic data make the metric visible.
    assert int(table_row(text, "sao")[3]) < int(table_row(text, "running_mean_w8")[3])
    data = json.loads((out / "report.json").read_text())
    assert [d["name"] for d in data] == ["sao", "running_mean_w8"]  # the scenario's arm order


def test_report_is_logged_to_mlflow(results, tmp_path):
    directory, _ = results
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    write_report(directory, tmp_path / "report", mlflow_uri=uri, mlflow_experiment="exp-test")
    client = MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("exp-test").experiment_id])[0]
    assert run.info.run_name == "synthetic-report"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "report")}
    assert {"report/report.md", f"report/{REWARDS_PNG}", f"report/{STYLE_PNG}"} <= artifacts
    assert run.data.metrics["sao.lag_at_20"] == switch_metrics(synthetic_rewards(3, 0), [20, 40], 4)[0].lag


def test_results_rows_deduplicate_and_must_be_dense(tmp_path):
    path = tmp_path / "arm.jsonl"
    for rollout, reward in ((0, 0.1), (1, 0.2), (1, 0.3)):
        append_row(path, RewardRow(rollout=rollout, t=0.0, version=0, reward=reward, quality=1.0, style=reward,
                                   preferred="formal"))
    assert count_reward_rows(path) == 3
    assert [r.reward for r in read_arm(path).rewards] == [0.1, 0.3]
    append_row(path, RewardRow(rollout=5, t=0.0, version=0, reward=0.0, quality=1.0, style=0.0, preferred="formal"))
    with pytest.raises(ValueError, match="not dense"):
        read_arm(path)


def test_no_results_is_an_error(tmp_path):
    write_scenario(tmp_path, SCENARIO)
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path, tmp_path / "out")


def test_report_command_reads_the_configured_results(results, tmp_path, capsys):
    from apps.config import load_app_config
    from apps.experiments.report import run_report_cli

    directory, _ = results
    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path), "experiment.results_dir": str(directory)})
    assert run_report_cli(cfg) == 0
    assert capsys.readouterr().out.strip() == str(directory / "report" / "report.md")
    assert (tmp_path / "mlflow.db").is_file()  # the configured default tracking store
