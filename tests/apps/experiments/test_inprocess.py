"""The in-process driver: a real arm (tiny model, serving's request path, judge, join, learner
step) in rollout time, its results files, and the report read from them."""

from __future__ import annotations

import json

import pytest

from apps.experiments.inprocess import StepRule, collect_pretrain_inprocess, run_arm_inprocess
from apps.experiments.plots import STYLE_SHARE_PNG
from apps.experiments.report import write_report
from apps.experiments.results import read_arm, summary_path, write_scenario, write_summary
from tests.fixtures.models import tiny_config

ROLLOUTS = 24


def scenario(**fields) -> dict:
    return {"experiment.name": "tiny", "experiment.rollouts_per_arm": ROLLOUTS, "experiment.concurrency": 2,
            "experiment.max_tokens": 8, "experiment.eval_every": 12, "experiment.eval_prompts": 2,
            "experiment.prompt_pool_size": 6, "experiment.metrics_window": 4,
            "experiment.requests_per_second": 10.0, "experiment.reward_delay_s": 0.2,
            "experiment.schedule": [{"from_rollout": 0, "style": "cute"}, {"from_rollout": 8, "style": "archaic"},
                                    {"from_rollout": 16, "style": "formal"}],
            "algorithm.policy_lr": 1e-3, "trainer.min_rollouts": 2, **fields}


@pytest.fixture(scope="module")
def classifier():
    from apps.default_model.corpus import STYLES
    from apps.experiments.style import train_classifier

    return train_classifier(STYLES, seed=0)


def run_arm(tmp_path, tiny_model_dir, classifier, arm: dict, pretrain: bool = False, **fields):
    cfg = tiny_config(tmp_path / "data", **{"model.path": str(tiny_model_dir), "experiment.arms": [arm],
                                            "experiment.results_dir": str(tmp_path / "results"), **scenario(**fields)})
    out = tmp_path / "results"
    write_scenario(out, cfg.experiment)
    pretrain_file = collect_pretrain_inprocess(cfg, classifier, progress=lambda _: None) if pretrain else None
    summary = run_arm_inprocess(cfg, arm["name"], classifier, out, progress=lambda _: None,
                                pretrain_file=pretrain_file)
    write_summary(out, summary)
    return cfg, out, summary


def test_a_sao_arm_pretrains_its_critic_runs_every_rollout_and_trains(tmp_path, tiny_model_dir, classifier):
    cfg, out, summary = run_arm(tmp_path, tiny_model_dir, classifier, {"name": "sao"}, pretrain=True,
                                **{"experiment.pretrain_rollouts": 10})
    records = (out / "arms" / "pretrain-data" / "records.jsonl").read_text().splitlines()
    assert len(records) == 20  # 10 interactions of the starting policy and their rewards
    assert summary.value_pretraining["train_rollouts"] + summary.value_pretraining["held_out_rollouts"] == 10
    arm = read_arm(out / "sao.jsonl")
    assert [r.rollout for r in arm.rewards] == list(range(ROLLOUTS))
    assert [r.preferred for r in arm.rewards] == [cfg.experiment.preferred_style(i) for i in range(ROLLOUTS)]
    assert all(r.sampled_style in cfg.experiment.styles for r in arm.rewards)
    assert [e.rollout for e in arm.evals] == [0, 12, 24] and arm.evals[0].version == 0
    assert summary.answered == ROLLOUTS and summary.learner_steps == len(arm.steps) > 0
    versions = [s.version for s in arm.steps]
    assert versions == sorted(versions) and versions[-1] >= 1
    assert all("value_loss" in s.metrics for s in arm.steps)  # sao's critic trained in each step
    assert max(r.version for r in arm.rewards) >= 1  # later answers came from a trained version
    assert summary.group_wait_s is None and summary.incomplete_groups is None  # not a grouped rule


def test_grpo_group_counters_reach_the_report_from_a_real_arm(tmp_path, tiny_model_dir, classifier):
    arm = {"name": "grpo_g2", "algorithm": {"name": "grpo", "group_size": 2, "ppo_epochs": 1}}
    cfg, out, summary = run_arm(tmp_path, tiny_model_dir, classifier, arm, **{
        "experiment.drop_rate": 0.5, "reward.group_timeout_s": 0.5})
    rows = read_arm(out / "grpo_g2.jsonl").rewards
    dropped = sum(not r.delivered for r in rows)
    assert 0 < dropped < ROLLOUTS
    # Every prompt is asked twice in a row: a dropped reward leaves its group one short, and the
    # group goes to a step as it is once its member has waited 0.5 s (five arrivals at 10/s).
    assert summary.incomplete_groups >= 1
    assert 2 * summary.complete_groups + summary.incomplete_groups <= ROLLOUTS - dropped
    assert summary.group_wait_s >= 0.5 * summary.incomplete_groups / (summary.complete_groups + summary.incomplete_groups)
    saved = summary_path(out, "grpo_g2").read_text()
    assert f'"incomplete_groups": {summary.incomplete_groups}' in saved
    # what the arm ran with: the run's algorithm section (its policy rate) with the arm's overrides,
    # and the learner's settings beside it
    ran = json.loads(saved)["settings"]
    assert ([ran[f"algorithm.{k}"] for k in ("name", "group_size", "ppo_epochs", "policy_lr")]
            == ["grpo", 2, 1, 1e-3])
    assert ran["trainer.min_rollouts"] == 2 and ran["reward.group_timeout_s"] == 0.5

    text = write_report(out, tmp_path / "report").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| grpo_g2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[7] == f"{summary.group_wait_s:.1f}" and cells[8] == f"{summary.incomplete_groups:.1f}"
    assert (tmp_path / "report" / STYLE_SHARE_PNG).is_file()


def test_drift_restarts_and_roll_backs_are_counted_in_the_summary_and_the_report(tmp_path, tiny_model_dir,
                                                                                  classifier):
    """A detector that fires on almost any fall (windows of 2, a drop of 0.001 at z 0.001) of rewards
    that rise by 1 for half the topics (the tiny model's own answers score about 0); with
    rollback_first some alarms roll back. The summary's counts must be the steps' own alarm records."""
    shifted = {topic: 1.0 for topic in ("cooking", "travel", "work", "music", "sports", "gardening", "money")}
    _, out, summary = run_arm(tmp_path, tiny_model_dir, classifier, {"name": "sao"},
                              **{"drift.enabled": True, "drift.recent": 2, "drift.reference": 2,
                                 "drift.min_drop": 0.001, "drift.z_threshold": 0.001, "drift.rollback_first": True,
                                 "experiment.rater_offset": shifted})
    steps = read_arm(out / "sao.jsonl").steps
    alarms = [s for s in steps if s.metrics.get("drift_alarm", 0.0) > 0]
    rolled_back = [s for s in alarms if s.metrics.get("drift_rollback", 0.0) > 0]
    assert alarms  # else the counts below would be checked at zero only
    assert (summary.drift_restarts, summary.drift_rollbacks) == (len(alarms) - len(rolled_back), len(rolled_back))
    cells = [c.strip() for c in next(line for line in write_report(out, tmp_path / "report").read_text().splitlines()
                                     if line.startswith("| sao | 1 |")).strip("|").split("|")]
    assert cells[-2:] == [f"{summary.drift_restarts:.1f}", f"{summary.drift_rollbacks:.1f}"]
    assert json.loads(summary_path(out, "sao").read_text())["drift_restarts"] == summary.drift_restarts


def test_the_step_rule_is_the_learners_on_the_virtual_clock():
    rule = StepRule(min_rollouts=4, token_budget=100, max_wait_s=2.0)
    assert not rule.due(0, 0, now=0.0)
    assert not rule.due(3, 30, now=1.0)  # ready since 1.0
    assert rule.due(4, 40, now=1.5)  # min_rollouts
    rule.ready_since = None  # a step took them
    assert rule.due(1, 100, now=2.0)  # token budget
    rule.ready_since = None
    assert not rule.due(1, 10, now=3.0) and not rule.due(1, 10, now=4.9)
    assert rule.due(1, 10, now=5.0)  # ready for max_wait_s
    assert StepRule(4, 100, None).due(3, 30, now=1e9) is False


def test_the_same_seeds_give_the_same_run(tmp_path, tiny_model_dir, classifier):
    """Requests are answered one at a time at their arrival and every weight swap happens between
    two of them, with seeded sampling: a run is reproducible (live runs are not)."""
    arm = {"name": "rm", "algorithm": {"name": "running_mean", "running_mean_window": 4}}
    first = run_arm(tmp_path / "a", tiny_model_dir, classifier, arm)[1]
    second = run_arm(tmp_path / "b", tiny_model_dir, classifier, arm)[1]
    rows = [read_arm(out / "rm.jsonl").rewards for out in (first, second)]
    assert [(r.reward, r.version, r.sampled_style) for r in rows[0]] == [(r.reward, r.version, r.sampled_style)
                                                                         for r in rows[1]]
    assert rows[0][-1].version > 0  # the policy changed along the way


def test_the_judge_and_the_learner_run_on_the_configured_torch_threads(tmp_path, tiny_model_dir, classifier,
                                                                       monkeypatch):
    """torch keeps a thread count per thread: the engine sets its own, and without the driver's pin
    the judge and the learner (the caller's thread) would use every core, so a seed's floats would
    follow the machine's core count and whether it ran in a worker process."""
    import torch

    seen = []
    probs = type(classifier).probs
    monkeypatch.setattr(type(classifier), "probs", lambda self, texts: (seen.append(torch.get_num_threads()),
                                                                        probs(self, texts))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_arm(tmp_path, tiny_model_dir, classifier, {"name": "rm", "algorithm": {"name": "running_mean"}},
                **{"serving.torch_threads": 1})
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2  # the caller's own count is back
    finally:
        torch.set_num_threads(before)


def test_the_pretraining_pass_gives_the_same_records_twice(tmp_path, tiny_model_dir, classifier):
    """Answered concurrently, the pass's answers depended on the engine's batching and two runs of
    one seed pre-trained different critics; one at a time they are the same."""
    from online_sao.schemas import Interaction, decode

    def answers(where):
        cfg = tiny_config(where / "data", **{"model.path": str(tiny_model_dir), "experiment.arms": [{"name": "sao"}],
                                             "experiment.results_dir": str(where / "results"),
                                             **scenario(**{"experiment.pretrain_rollouts": 8,
                                                           "experiment.concurrency": 4})})
        path = collect_pretrain_inprocess(cfg, classifier, progress=lambda _: None)
        records = [decode(line) for line in path.read_bytes().splitlines()]
        return [(r.prompt_ids, r.response_ids, r.logprobs) for r in records if isinstance(r, Interaction)]

    first = answers(tmp_path / "a")
    assert len(first) == 8 and first == answers(tmp_path / "b")


def test_a_run_with_user_segments_scores_each_by_its_schedule_and_the_report_shows_them(tmp_path, tiny_model_dir,
                                                                                          classifier):
    import json
    import math
    from itertools import islice

    from apps.experiments.scenario import segment_draws
    from apps.experiments.segments import SEGMENTS_JSON, SEGMENTS_PNG

    groups = [{"name": "early", "share": 0.5, "schedule": [{"from_rollout": 0, "style": "cute"},
                                                          {"from_rollout": 8, "style": "archaic"}]},
              {"name": "late", "share": 0.5, "schedule": [{"from_rollout": 0, "style": "cute"},
                                                         {"from_rollout": 16, "style": "archaic"}]}]
    cfg, out, _ = run_arm(tmp_path, tiny_model_dir, classifier, {"name": "sao"}, **{"experiment.segments": groups})
    exp = cfg.experiment
    rows = read_arm(out / "sao.jsonl").rewards
    # One request at a time in rollout order: rollout i is request i, with the i-th drawn segment.
    assert [r.segment for r in rows] == list(islice(segment_draws(exp), ROLLOUTS))
    assert {r.segment for r in rows} == {"early", "late"}
    assert [r.preferred for r in rows] == [exp.preferred_style(r.rollout, r.segment) for r in rows]
    assert any(r.preferred == "cute" and r.segment == "late" for r in rows[8:16])  # the groups disagree there
    assert any(r.preferred == "archaic" and r.segment == "early" for r in rows[8:16])

    report = tmp_path / "report"
    text = write_report(out, report).read_text()
    assert (report / SEGMENTS_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [s["segment"] for s in json.loads((report / SEGMENTS_JSON).read_text())] == ["early", "late"]
    for group in groups:
        name, starts = group["name"], [p["from_rollout"] for p in group["schedule"]]
        table = text.split(f"### Segment {name}:", 1)[1].split("\n\n", 2)[1]
        assert table.splitlines()[0] == "| arm | cute 0-%d | archaic %d-%d |" % (starts[1] - 1, starts[1], ROLLOUTS - 1)
        cells = [c.strip() for c in table.splitlines()[2].strip("|").split("|")]
        assert cells[0] == "sao"
        for cell, start, end in zip(cells[1:], starts, starts[1:] + [ROLLOUTS]):
            own = [r.reward for r in rows if r.segment == name and start <= r.rollout < end]
            last = own[-max(1, math.ceil(len(own) / 4)):]
            assert cell == f"{sum(last) / len(last):.3f} / {sum(own) / len(own):.3f} / {len(own)}.0"  # one seed
