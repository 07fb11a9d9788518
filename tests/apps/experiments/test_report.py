"""The report on synthetic results: files, valid PNGs, table numbers equal to the metrics (one seed
and several), MLflow. The group-wait column is checked on a real arm's files in test_inprocess.py."""

from __future__ import annotations

import json
import random

import pytest
from matplotlib.image import imread
from mlflow import MlflowClient

from apps.config import ExperimentConfig
from apps.experiments.intervals import interval
from apps.experiments.metrics import phase_metrics, post_switch_mean
from apps.experiments.plots import PLOTS
from apps.experiments.aggregate import NoResults
from apps.experiments.report import MlflowTarget, write_report
from apps.experiments.results import (ArmSummary, EvalRow, RewardRow, append_row, count_reward_rows, read_arm,
                                      write_scenario, write_summary)

SCENARIO = ExperimentConfig(
    name="synthetic", rollouts_per_arm=60, metrics_window=4, eval_every=20,
    schedule=[{"from_rollout": 0, "style": "formal"}, {"from_rollout": 20, "style": "cute"},
              {"from_rollout": 40, "style": "archaic"}],
    arms=[{"name": "sao"}, {"name": "running_mean_w8", "algorithm": {"name": "running_mean",
                                                                     "running_mean_window": 8}}])
STARTS, STYLES = [0, 20, 40], ["formal", "cute", "archaic"]


def synthetic_rewards(recovery: int, seed: int) -> list[float]:
    """Reward 0.9 except for ``recovery`` rollouts of 0.1 after each switch, plus noise."""
    rng = random.Random(seed)
    out = []
    for i in range(60):
        since = i if i < 20 else (i - 20 if i < 40 else i - 40)
        base = 0.1 if i >= 20 and since < recovery else 0.9
        out.append(min(1.0, max(0.0, base + rng.uniform(-0.05, 0.05))))
    return out


def write_run(directory, series: dict[str, list[float]], seed: int = 0, evals: bool = True) -> None:
    scenario = SCENARIO.model_copy(update={"seed": seed})
    write_scenario(directory, scenario)
    for name, rewards in series.items():
        path = directory / f"{name}.jsonl"
        for i, r in enumerate(rewards):
            append_row(path, RewardRow(rollout=i, t=1000.0 + i, version=i // 4, reward=r, quality=1.0, style=r,
                                       preferred=SCENARIO.preferred_style(i), sampled_style=STYLES[i % 3]))
            if evals and i % SCENARIO.eval_every == SCENARIO.eval_every - 1:
                append_row(path, EvalRow(rollout=i, t=1000.0 + i, version=i // 4, style_accuracy=r,
                                         preferred=SCENARIO.preferred_style(i), prompts=8))


@pytest.fixture
def results(tmp_path):
    directory = tmp_path / "results"
    series = {"sao": synthetic_rewards(3, 0), "running_mean_w8": synthetic_rewards(12, 1)}
    write_run(directory, series)
    return directory, series


def section(markdown: str, title: str) -> str:
    return markdown.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def table_row(text: str, arm: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {arm} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_report_of_one_seed_files_plots_and_tables(results, tmp_path):
    directory, series = results
    out = tmp_path / "report"
    path = write_report(directory, out)
    assert path == out / "report.md"
    text = path.read_text()
    for png in PLOTS:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = imread(out / png)
        assert image.shape[0] > 200 and image.shape[1] > 400
        assert f"]({png})" in text
    for arm, rewards in series.items():
        phases = phase_metrics(rewards, STARTS, STYLES, 4, 0.5)
        summary = table_row(section(text, "Summary"), arm)
        assert summary[1:4] == ["1", "60", f"{sum(rewards) / 60:.3f}"]
        assert summary[4] == f"{post_switch_mean(rewards, 20):.3f}"
        assert summary[5] == "0/1" and summary[6] == f"{rewards[59]:.3f}"  # the last held-out measurement
        assert summary[7:] == ["-"] * 5  # no summary files here: no grpo counters, roll-backs or restarts
        assert table_row(section(text, "Level"), arm)[1:] == [f"{p.level:.3f}" for p in phases]
        assert table_row(section(text, "Area"), arm)[1:] == [f"{p.area:.3f}" for p in phases]
        assert table_row(section(text, "Re-alignment lag"), arm)[1:] == [f"{p.lag} (1/1)" for p in phases] + ["1/1"]
    # The slow arm re-aligns later: the synthetic data make the metric visible.
    lag = lambda arm: int(table_row(section(text, "Re-alignment lag"), arm)[2].split()[0])  # noqa: E731
    assert lag("sao") < lag("running_mean_w8")
    assert "the one that makes the reward" in text  # held-out accuracy is not an independent judge
    # one seed has no interval to compare: the comparison claims nothing
    row = table_row(section(text, "sao against each arm"), "running_mean_w8")
    assert row[3] == "- (one seed: no interval)"
    paired = post_switch_mean(series["sao"], 20) - post_switch_mean(series["running_mean_w8"], 20)
    assert row[4:] == [f"{paired:+.3f}", "-"]  # one seed's difference, no interval
    data = json.loads((out / "report.json").read_text())
    assert [d["name"] for d in data] == ["sao", "running_mean_w8"]  # the scenario's arm order


def test_the_style_share_plot_draws_the_last_block(results, tmp_path, monkeypatch):
    """Stacked with step="post" from the blocks' starts alone, the drawing stopped at the last block's
    start: rollouts 56-59 of this run were never drawn."""
    from matplotlib.axes import Axes

    drawn = []
    real = Axes.stackplot

    def recording(self, x, *series, **kwargs):
        drawn.append((list(x), [list(s) for s in series]))
        return real(self, x, *series, **kwargs)

    monkeypatch.setattr(Axes, "stackplot", recording)
    write_report(results[0], tmp_path / "report")
    assert drawn and all(x[-2:] == [56, 60] and all(s[-1] == s[-2] for s in series) for x, series in drawn)


def test_report_of_several_seeds_gives_means_and_bootstrap_intervals(tmp_path):
    directory = tmp_path / "results"
    write_scenario(directory, SCENARIO)
    per_seed = {k: {"sao": synthetic_rewards(3, 10 + k), "running_mean_w8": synthetic_rewards(15, 20 + k)}
                for k in range(3)}
    for k, series in per_seed.items():
        write_run(directory / f"seed-{k}", series, seed=k)
    text = write_report(directory, tmp_path / "report").read_text()
    assert "Seeds: 3 (experiment.seed 0, 1, 2" in text
    for arm in ("sao", "running_mean_w8"):
        means = [sum(per_seed[k][arm]) / 60 for k in range(3)]
        expected = interval(means)
        assert table_row(section(text, "Summary"), arm)[3] == f"{expected.mean:.3f} [{expected.low:.3f}, {expected.high:.3f}]"
        levels = [phase_metrics(per_seed[k][arm], STARTS, STYLES, 4, 0.5)[1].level for k in range(3)]
        assert table_row(section(text, "Level"), arm)[2].startswith(f"{sum(levels) / 3:.3f} [")
    comparison = section(text, "sao against each arm")
    row = table_row(comparison, "running_mean_w8")
    ref = interval([post_switch_mean(per_seed[k]["sao"], 20) for k in range(3)])
    other = interval([post_switch_mean(per_seed[k]["running_mean_w8"], 20) for k in range(3)])
    assert row[2] == f"{ref.mean - other.mean:+.3f}" and row[3] == ("yes" if ref.apart_from(other) else "no")
    assert row[3] == "yes"  # 3 against 15 low rollouts after each switch: far apart in every seed
    paired = interval([post_switch_mean(per_seed[k]["sao"], 20) - post_switch_mean(per_seed[k]["running_mean_w8"], 20)
                       for k in range(3)])
    assert row[4] == f"{paired.mean:+.3f} [{paired.low:+.3f}, {paired.high:+.3f}]" and row[5] == "yes"
    arms = json.loads((tmp_path / "report" / "report.json").read_text())
    assert [[row["seed"] for row in arm["per_seed"]] for arm in arms] == [[0, 1, 2], [0, 1, 2]]  # to pair by


def test_a_seed_without_a_measure_is_counted_not_averaged_away_unseen(tmp_path):
    directory = tmp_path / "results"
    write_scenario(directory, SCENARIO)
    for k in range(3):  # seed 2's sao run has no held-out evaluations
        write_run(directory / f"seed-{k}", {"sao": synthetic_rewards(3, 10 + k)}, seed=k, evals=k < 2)
        write_run(directory / f"seed-{k}", {"running_mean_w8": synthetic_rewards(15, 20 + k)}, seed=k)
    summary = section(write_report(directory, tmp_path / "report").read_text(), "Summary")
    assert table_row(summary, "sao")[6].endswith("] (2 of 3 seeds)")
    assert table_row(summary, "running_mean_w8")[6].endswith("]")  # every seed: nothing added
    assert not table_row(summary, "sao")[3].endswith("seeds)")


def test_the_seeds_that_re_aligned_after_every_switch_are_counted(tmp_path):
    """Phases of 20, a moving reward of 4 rollouts, threshold 0.5. Seed 0 re-aligns in both post-switch
    phases, seed 1 only after the first switch (0.1 throughout the last phase), seed 2 after neither;
    the first phase does not count (no switch before it)."""
    directory = tmp_path / "results"
    write_scenario(directory, SCENARIO)
    high, low = [0.9] * 20, [0.1] * 20
    for k, rewards in enumerate([high * 3, high * 2 + low, low + low + low]):
        write_run(directory / f"seed-{k}", {"sao": rewards}, seed=k)
    out = tmp_path / "report"
    text = write_report(directory, out).read_text()
    # lags: the first window of 4 is complete, at 0.9, after a phase's fourth rollout
    assert table_row(section(text, "Re-alignment lag"), "sao")[1:] == ["4 [4, 4] (2/3)", "4 [4, 4] (2/3)",
                                                                       "4 (1/3)", "1/3"]  # one seed: no interval
    assert json.loads((out / "report.json").read_text())[0]["realigned"] == 1


def test_the_paired_difference_takes_out_what_a_seed_does_to_every_arm(tmp_path):
    """Seeds at levels 0.2, 0.5 and 0.8, sao 0.05 above the other arm in each: the unpaired intervals
    overlap (the seeds' spread), the paired difference is 0.05 in every seed."""
    directory = tmp_path / "results"
    write_scenario(directory, SCENARIO)
    for k, level in enumerate([0.2, 0.5, 0.8]):
        write_run(directory / f"seed-{k}", {"sao": [level + 0.05] * 60, "running_mean_w8": [level] * 60}, seed=k)
    row = table_row(section(write_report(directory, tmp_path / "report").read_text(), "sao against each arm"),
                    "running_mean_w8")
    assert row[1] == "0.500 [0.200, 0.800]" and row[2] == "+0.050" and row[3] == "no"
    assert row[4] == "+0.050 [+0.050, +0.050]" and row[5] == "yes"


def test_an_arm_missing_a_seed_is_compared_on_the_seeds_both_ran(tmp_path):
    """running_mean_w8 0.05 above sao on every seed, and no run on seed 1, the easy one (0.9): over
    each arm's own seeds sao looked 0.113 ahead; on the three seeds both ran it is 0.05 behind."""
    directory = tmp_path / "results"
    write_scenario(directory, SCENARIO)
    levels = {0: 0.2, 1: 0.9, 2: 0.3, 3: 0.25}
    for k, level in levels.items():
        series = {"sao": [level] * 60, **({} if k == 1 else {"running_mean_w8": [level + 0.05] * 60})}
        write_run(directory / f"seed-{k}", series, seed=k)
    row = table_row(section(write_report(directory, tmp_path / "report").read_text(), "sao against each arm"),
                    "running_mean_w8")
    assert row[2] == "-0.050 (3 seeds in common of 4)"
    assert row[3] == "no"  # 0.25 [0.2, 0.3] against 0.3 [0.25, 0.35] on the common seeds: they overlap
    assert row[4] == "-0.050 [-0.050, -0.050] (3 of 4 seeds)" and row[5] == "yes"


def test_levels_are_on_the_judges_value_when_raters_scale_the_reward(tmp_path):
    directory = tmp_path / "results"
    write_run(directory, {"running_mean_w8": synthetic_rewards(12, 1)})
    write_scenario(directory, SCENARIO.model_copy(update={"rater_scale": {"cooking": 1.5, "weather": 0.5},
                                                          "rater_offset": {"pets": -0.25}}))
    values = synthetic_rewards(3, 0)
    for i, value in enumerate(values):  # generous and harsh raters by turns: 1.5x + 0.25 or 0.5x - 0.25
        scale, shift = (1.5, 0.25) if i % 2 else (0.5, -0.25)
        append_row(directory / "sao.jsonl", RewardRow(rollout=i, t=1000.0 + i, version=i // 4,
                                                      reward=value * scale + shift,
                                                      rater_scale=scale, rater_offset=shift, quality=1.0, style=value,
                                                      preferred=SCENARIO.preferred_style(i)))
    text = write_report(directory, tmp_path / "report").read_text()
    assert "(factors: cooking 1.5, weather 0.5; shifts: pets -0.25; 1 and 0 for any other topic)" in text
    phases = phase_metrics(values, STARTS, STYLES, 4, 0.5)
    assert table_row(section(text, "Summary"), "sao")[3:5] == [f"{sum(values) / 60:.3f}",
                                                               f"{post_switch_mean(values, 20):.3f}"]
    assert table_row(section(text, "Level"), "sao")[1:] == [f"{p.level:.3f}" for p in phases]


def test_report_is_logged_to_mlflow(results, tmp_path):
    directory, series = results
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    write_report(directory, tmp_path / "report", MlflowTarget(uri, "exp-test"))
    client = MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("exp-test").experiment_id])[0]
    assert run.info.run_name == "synthetic-report"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "report")}
    assert {"report/report.md", *(f"report/{png}" for png in PLOTS)} <= artifacts
    assert run.data.metrics["sao.level_20"] == pytest.approx(phase_metrics(series["sao"], STARTS, STYLES, 4, 0.5)[1].level)
    assert run.data.metrics["sao.realigned_seeds"] == 1.0  # 0.1 for 3 rollouts after each switch, then 0.9
    # with the seeds each count was measured on: a 0 of 0 read as "never" where report.md says n/a
    assert run.data.metrics["sao.realign_measured_seeds"] == 1.0
    assert "sao.collapse_measured_seeds" in run.data.metrics


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


def test_runs_under_way_or_cut_short_are_left_out_and_named(tmp_path):
    """Three seeds. seed-2's running mean was cut short after 30 of 60 rollouts (no summary): the report
    leaves it out and says so. seed-1's sao answered 59 (one request failed) and finished (its summary):
    it stays. Files without summaries (from before they marked a finished run) count when complete."""
    directory = tmp_path / "results"
    write_scenario(directory, SCENARIO)
    per_seed = {k: {"sao": synthetic_rewards(3, 10 + k), "running_mean_w8": synthetic_rewards(15, 20 + k)}
                for k in range(3)}
    per_seed[2]["running_mean_w8"] = per_seed[2]["running_mean_w8"][:30]
    per_seed[1]["sao"] = per_seed[1]["sao"][:59]
    for k, series in per_seed.items():
        write_run(directory / f"seed-{k}", series, seed=k)
    write_summary(directory / "seed-1", ArmSummary(name="sao", driver="live", answered=59, failed=1, wall_s=1.0,
                                                  traffic_s=1.0))
    text = write_report(directory, tmp_path / "report").read_text()
    assert ("**Left out, not finished** (under way, or cut short: `simulate --resume` runs them again): "
            "seed-2 running_mean_w8 (30 of 60 rollouts). The seeds column counts the finished runs.") in text
    summary = section(text, "Summary")
    assert table_row(summary, "sao")[1] == "3"
    row = table_row(summary, "running_mean_w8")
    expected = interval([sum(per_seed[k]["running_mean_w8"]) / 60 for k in (0, 1)])
    assert row[1] == "2" and row[3] == f"{expected.mean:.3f} [{expected.low:.3f}, {expected.high:.3f}]"

    only_cut = tmp_path / "cut"
    write_run(only_cut, {"sao": synthetic_rewards(3, 0)[:10]})
    with pytest.raises(NoResults, match=r"no finished arm runs in .*cut; not finished: cut sao \(10 of 60 rollouts\)"):
        write_report(only_cut, tmp_path / "out")


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


def test_a_non_finite_reward_is_refused_when_written_not_when_read(tmp_path):
    with pytest.raises(ValueError, match="finite number"):
        RewardRow(rollout=0, t=1000.0, version=0, reward=float("nan"), quality=1.0, style=0.5, preferred="formal")


def test_the_reports_mlflow_artifacts_go_to_the_data_dirs_artifact_root(results, tmp_path, monkeypatch):
    """The report, the first to create the MLflow experiment with the in-process driver, created it without
    the learner's artifact root: MLflow put the report's artifacts, and every later run's of the experiment,
    in ./mlruns of whatever directory the command ran in."""
    from apps.config import load_app_config
    from apps.experiments.report import run_report_cli

    directory, _ = results
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    data_dir = tmp_path / "data"
    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(data_dir), "experiment.results_dir": str(directory)})
    assert run_report_cli(cfg) == 0
    assert not (cwd / "mlruns").exists()
    assert list((data_dir / "mlflow-artifacts").rglob("report.md"))
    client = MlflowClient(tracking_uri=cfg.mlflow_uri)
    assert client.get_experiment_by_name(cfg.mlflow.experiment).artifact_location == \
        (data_dir / "mlflow-artifacts").as_uri()


def test_the_report_command_reads_with_the_report_settings_its_configuration_sets(results, tmp_path, capsys):
    """`online-sao report --set experiment.reference_arm=...` (and the threshold, window and collapse
    fraction) was accepted and ignored: the report read them from the results' scenario.json."""
    from apps.config import load_app_config
    from apps.experiments.report import run_report_cli

    directory, series = results
    overrides = {"paths.data_dir": str(tmp_path), "experiment.results_dir": str(directory),
                 "experiment.reference_arm": "running_mean_w8", "experiment.realign_threshold": 0.8,
                 "experiment.metrics_window": 2, "experiment.collapse_fraction": 0.5}  # 0.5 is the run's
    assert run_report_cli(load_app_config(environ={}, overrides=overrides)) == 0
    text = (directory / "report" / "report.md").read_text()
    assert ("**Read with other settings than the run's** (this command's configuration): experiment.reference_arm "
            "running_mean_w8 (the run's: sao); experiment.realign_threshold 0.8 (the run's: 0.5); "
            "experiment.metrics_window 2 (the run's: 4).") in text
    assert "## running_mean_w8 against each arm" in text and "## sao against each arm" not in text
    assert "(W=2, rollouts of the phase only) first reaches 0.8" in text
    phases = phase_metrics(series["sao"], STARTS, STYLES, 2, 0.8)
    assert table_row(section(text, "Re-alignment lag"), "sao")[1:4] == [f"{p.lag} (1/1)" for p in phases]
    # without them the run's own, as simulate reports its run
    assert run_report_cli(load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path),
                                                                 "experiment.results_dir": str(directory)})) == 0
    text = (directory / "report" / "report.md").read_text()
    assert "Read with other settings" not in text and "## sao against each arm" in text and "(W=4," in text


def test_a_reference_arm_the_results_do_not_have_is_refused(results, tmp_path):
    from apps.config import load_app_config
    from apps.experiments.report import run_report_cli
    from online_sao.config import ConfigError

    directory, _ = results
    cfg = load_app_config(environ={}, overrides={"paths.data_dir": str(tmp_path), "experiment.results_dir": str(directory),
                                                 "experiment.reference_arm": "grpo"})
    with pytest.raises(ConfigError, match=r"experiment.reference_arm 'grpo': .* has no finished run of it "
                                          r"\(its arms: sao, running_mean_w8\)"):
        run_report_cli(cfg)


def test_what_a_short_run_cannot_measure_reads_n_a_not_zero(tmp_path):
    """A window of 32: the run of 60 rollouts is shorter than the collapse check's two windows, and every
    phase of 20 is shorter than one, so no lag can be found. The report said "0/1" collapsed and
    "- (0/1)" re-aligned, as if measured."""
    directory = tmp_path / "results"
    write_run(directory, {"sao": [0.9] * 60})
    write_scenario(directory, SCENARIO.model_copy(update={"metrics_window": 32}))
    text = write_report(directory, tmp_path / "report").read_text()
    assert table_row(section(text, "Summary"), "sao")[5] == "n/a"
    assert "Collapsed: n/a, or counted over fewer seeds (\"too short\"), where a run is shorter than two " \
           "windows (64 rollouts): too short to tell." in text
    assert table_row(section(text, "Re-alignment lag"), "sao")[1:] == ["n/a"] * 4
    assert "Lag: n/a, or counted over fewer seeds (\"too short\"), where a phase is shorter than the window (W=32)" in text
    write_scenario(directory, SCENARIO)  # a window of 4: everything measured, no note
    text = write_report(directory, tmp_path / "measured").read_text()
    assert "too short" not in text and table_row(section(text, "Summary"), "sao")[5] == "0/1"


def test_seeds_a_short_phase_leaves_unmeasured_are_counted_apart(tmp_path):
    """A window of 20, phases of 20: seed 1's run finished one rollout short (a request failed), so its last
    phase (19 rollouts) holds no full window; seed 0's does."""
    directory = tmp_path / "results"
    scenario = SCENARIO.model_copy(update={"metrics_window": 20})
    write_scenario(directory, scenario)
    for k, length in ((0, 60), (1, 59)):
        write_run(directory / f"seed-{k}", {"sao": [0.9] * length}, seed=k)
        write_scenario(directory / f"seed-{k}", scenario.model_copy(update={"seed": k}))
    write_summary(directory / "seed-1", ArmSummary(name="sao", driver="live", answered=59, failed=1, wall_s=1.0,
                                                  traffic_s=1.0))
    text = write_report(directory, tmp_path / "report").read_text()
    assert table_row(section(text, "Re-alignment lag"), "sao")[1:] == [
        "20 [20, 20] (2/2)", "20 [20, 20] (2/2)", "20 (1/1, 1 too short)", "1/1, 1 too short"]
    assert table_row(section(text, "Summary"), "sao")[5] == "0/2"  # 59 rollouts are two windows


def test_the_header_lists_only_the_seeds_with_a_finished_run(tmp_path):
    """seed 1's only run was cut short: the report leaves it out, and its header listed its seed all the same."""
    directory = tmp_path / "results"
    write_scenario(directory, SCENARIO)
    write_run(directory / "seed-0", {"sao": synthetic_rewards(3, 10)}, seed=0)
    write_run(directory / "seed-1", {"sao": synthetic_rewards(3, 11)[:25]}, seed=1)
    text = write_report(directory, tmp_path / "report").read_text()
    assert "Seeds: 1 (experiment.seed 0; prompt and learner seeds shifted alike)" in text
    assert "seed-1 sao (25 of 60 rollouts)" in text
