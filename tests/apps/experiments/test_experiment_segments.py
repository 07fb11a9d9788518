"""User segments of the drift experiments (issue 15): their configuration, the seeded draw, the
judge scoring each request against its own segment's schedule, and the per-segment measures on
hand-built curves. The report's per-segment section from a real run is in test_inprocess.py."""

from __future__ import annotations

import uuid
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest

from apps.config import ExperimentConfig, load_app_config
from apps.experiments.aggregate import Run
from apps.experiments.judge import JudgeScore
from apps.experiments.judge_service import ScheduleJudge
from apps.experiments.metrics import segment_moving_average, segment_phase_metrics
from apps.experiments.results import ArmResults, RewardRow
from apps.experiments.scenario import arrival_gaps, prompt_order, segment_draws
from apps.experiments.segments import segment_markdown, segment_reward_band, summarize_segment, summarize_segments
from online_sao.config import ConfigError
from online_sao.schemas import Interaction

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
SCHEDULE = [{"from_rollout": 0, "style": "formal"}, {"from_rollout": 4, "style": "cute"},
            {"from_rollout": 8, "style": "archaic"}]


def phases(*pairs):
    return [{"from_rollout": r, "style": s} for r, s in pairs]


def segments(early=phases((0, "formal"), (4, "cute")), late=phases((0, "formal"), (8, "cute")),
             shares=(0.5, 0.5), names=("early", "late")):
    return [{"name": names[0], "share": shares[0], "schedule": early},
            {"name": names[1], "share": shares[1], "schedule": late}]


def experiment(**fields) -> ExperimentConfig:
    return ExperimentConfig(**{"schedule": SCHEDULE, "rollouts_per_arm": 12, "segments": segments(), **fields})


# -- configuration ---------------------------------------------------------------------------------

def test_each_segment_prefers_by_its_own_schedule_and_no_segment_by_the_schedule():
    exp = experiment()
    assert [exp.preferred_style(r, "early") for r in (0, 3, 4, 11)] == ["formal", "formal", "cute", "cute"]
    assert [exp.preferred_style(r, "late") for r in (0, 7, 8, 11)] == ["formal", "formal", "cute", "cute"]
    assert [exp.preferred_style(r) for r in (0, 4, 8)] == ["formal", "cute", "archaic"]
    with pytest.raises(ValueError, match="unknown user segment 'other'"):
        exp.preferred_style(0, "other")


def test_a_scenario_without_segments_has_none():
    assert ExperimentConfig().segments == []
    for name in ("drift.yaml", "drift-short.yaml"):
        assert load_app_config(CONFIGS / name, environ={}).experiment.segments == []


@pytest.mark.parametrize("bad, message", [
    (segments(shares=(0.5, 0.6)), "sum to 1, got 1.1"),
    (segments(shares=(0.3, 0.3)), "sum to 1, got 0.6"),
    (segments(names=("a", "a")), "unique"),
    (segments(early=phases((2, "formal"), (4, "cute"))), "segment 'early' must start at rollout 0"),
    (segments(late=phases((0, "formal"), (8, "formal"))), "segment 'late'.*does not switch"),
    (segments(late=phases((0, "formal"), (8, "cute"), (6, "terse"))), "segment 'late'.*increasing"),
    (segments(early=phases((0, "formal"), (4, "gothic"))), "gothic"),
    (segments(late=phases((0, "formal"), (12, "cute"))), "segment 'late'.*before rollouts_per_arm"),
    (segments(shares=(0.0, 1.0)), "share"),
    ([{"name": "x", "share": 1.0, "schedule": []}], "schedule"),
    ([{"name": "a b", "share": 1.0, "schedule": phases((0, "formal"))}], "name"),
])
def test_bad_segments_are_named(bad, message):
    with pytest.raises(ConfigError, match=message):
        load_app_config(environ={}, overrides={"experiment.schedule": SCHEDULE, "experiment.rollouts_per_arm": 12,
                                               "experiment.segments": bad})


def test_shares_written_as_decimals_sum_to_one_and_a_segment_may_never_switch():
    exp = experiment(segments=segments(shares=(0.3, 0.7), late=phases((0, "terse"))))
    assert [s.share for s in exp.segments] == [0.3, 0.7]
    assert exp.preferred_style(11, "late") == "terse"


def test_the_segments_scenario_file_has_two_groups_switching_at_different_times():
    exp = load_app_config(CONFIGS / "drift-segments.yaml", environ={}).experiment
    assert [s.name for s in exp.segments] == ["early", "late"]
    early, late = ([p.from_rollout for p in s.schedule[1:]] for s in exp.segments)
    assert len(early) == len(late) >= 1 and all(a < b for a, b in zip(early, late))
    assert {a.name for a in exp.arms} == {"sao", "running_mean_w8"}


# -- the seeded draw -------------------------------------------------------------------------------

def test_the_segment_draw_is_seeded_weighted_and_leaves_the_traffic_as_it_was():
    exp = experiment(segments=segments(shares=(0.2, 0.8)), seed=5)
    first = list(islice(segment_draws(exp), 4000))
    assert first == list(islice(segment_draws(exp), 4000))
    assert first != list(islice(segment_draws(exp.model_copy(update={"seed": 6})), 4000))
    counts = Counter(first)
    # Binomial(4000, 0.2): standard deviation about 25, so 800 +- 100 is four of them.
    assert set(counts) == {"early", "late"} and abs(counts["early"] - 800) < 100
    # Its own stream: the arrival times and prompts of the seed are those of a scenario without segments.
    plain = exp.model_copy(update={"segments": []})
    assert list(islice(segment_draws(plain), 5)) == [None] * 5
    assert list(islice(arrival_gaps(exp.seed, 2.0), 20)) == list(islice(arrival_gaps(plain.seed, 2.0), 20))
    assert list(islice(prompt_order(["a", "b", "c"], exp.prompt_seed, 1), 9)) == \
        list(islice(prompt_order(["a", "b", "c"], plain.prompt_seed, 1), 9))


# -- the judge -------------------------------------------------------------------------------------

class RecordingJudge:
    def __init__(self):
        self.preferred: list[str] = []

    def score(self, prompt: str, answer: str, preferred_style: str) -> JudgeScore:
        self.preferred.append(preferred_style)
        return JudgeScore(value=0.5, quality=1.0, style=0.5, sampled_style="formal")


def interaction(user: str | None) -> Interaction:
    return Interaction(interaction_id=uuid.uuid4().hex, model="online-sao", prompt_ids=[1], response_ids=[2],
                       action_mask=[True], logprobs=[-0.5], versions=[0], user_id=user,
                       prompt_text="<|im_start|>user\nHow do I make rice?<|im_end|>\n", response_text="Rinse it.")


def judge_config(exp: ExperimentConfig):
    cfg = load_app_config(environ={})
    return cfg.model_copy(update={"experiment": exp})


def test_the_judge_scores_each_request_against_its_segments_preference_at_that_rollout(tmp_path):
    judge = RecordingJudge()
    scorer = ScheduleJudge(judge_config(experiment()), judge, results_path=tmp_path / "arm.jsonl")
    users = ["early", "late"] * 6  # rollouts 0..11: early switches to cute at 4, late at 8
    rows = [scorer.score(interaction(u)) for u in users]
    expected = ["formal"] * 4 + ["cute", "formal"] * 2 + ["cute"] * 4
    assert judge.preferred == expected
    assert [(r.segment, r.preferred) for r in rows] == list(zip(users, expected))
    assert [r.segment for r in (RewardRow.model_validate_json(line) for line in
                                (tmp_path / "arm.jsonl").read_text().splitlines())] == users


def test_the_judge_without_segments_ignores_the_user_and_with_segments_refuses_an_unknown_one():
    judge = RecordingJudge()
    plain = ScheduleJudge(judge_config(experiment(segments=[])), judge)
    row = plain.score(interaction("someone"))
    assert row.segment is None and judge.preferred == ["formal"]
    scorer = ScheduleJudge(judge_config(experiment()), RecordingJudge())
    with pytest.raises(ValueError, match="unknown user segment 'someone'"):
        scorer.score(interaction("someone"))
    with pytest.raises(ValueError, match="names no user segment"):
        scorer.score(interaction(None))


# -- per-segment measures on hand-built curves -----------------------------------------------------

VALUES = [0.0, 1.0, 0.2, 1.0, 0.4, 0.0, 0.6, 0.0, 0.8, 0.5]
SEGMENTS = ["a", "b", "a", "b", "a", "b", "a", "b", "a", "b"]


def test_segment_moving_average_follows_its_own_rollouts_on_the_runs_axis():
    b = ["b" if i else "a" for i in range(4)]  # "b" first appears at rollout 1
    assert segment_moving_average([0.0, 1.0, 0.0, 0.5], b, "b", 2) == [None, 1.0, 0.5, 0.25]
    # "a" has 0.0, 0.2, 0.4, 0.6, 0.8 at rollouts 0, 2, 4, 6, 8; window 2 of its own rollouts
    assert segment_moving_average(VALUES, SEGMENTS, "a", 2) == pytest.approx(
        [0.0, 0.0, 0.1, 0.1, 0.3, 0.3, 0.5, 0.5, 0.7, 0.7])
    assert segment_moving_average(VALUES, SEGMENTS, "c", 2) == [None] * 10


def test_segment_phase_levels_use_only_the_segments_rollouts_of_each_phase():
    # Phases [0, 6) and [6, 10). a: 0.0, 0.2, 0.4 | 0.6, 0.8; b: 1.0, 1.0, 0.0 | 0.0, 0.5.
    # Level: the mean of the last 25% of the segment's rollouts, at least one: ceil(0.75) = ceil(0.5) = 1.
    a = segment_phase_metrics(VALUES, SEGMENTS, "a", [0, 6], ["cute", "formal"])
    assert [(p.start, p.end, p.style, p.rollouts) for p in a] == [(0, 6, "cute", 3), (6, 10, "formal", 2)]
    assert [p.level for p in a] == pytest.approx([0.4, 0.8])
    assert [p.area for p in a] == pytest.approx([0.2, 0.7])
    b = segment_phase_metrics(VALUES, SEGMENTS, "b", [0, 6], ["cute", "formal"])
    assert [p.level for p in b] == pytest.approx([0.0, 0.5]) and [p.area for p in b] == pytest.approx([2 / 3, 0.25])
    # Eight rollouts of one segment in a phase: its level is the mean of the last two.
    eight = segment_phase_metrics([0.1] * 6 + [0.3, 0.9], ["a"] * 8, "a", [0], ["cute"])
    assert eight[0].level == pytest.approx(0.6)
    # A phase without any of the segment's rollouts (or past the run's end) has no level.
    empty = segment_phase_metrics(VALUES, ["b"] * 10, "a", [0, 6, 20], ["cute", "formal", "terse"])
    assert [(p.rollouts, p.level, p.area) for p in empty] == [(0, None, None)] * 3


def run_in_memory(values: list[float], segs: list[str], seed: int) -> Run:
    exp = experiment(rollouts_per_arm=len(values), seed=seed)
    rows = [RewardRow(rollout=i, t=float(i), version=0, reward=v, quality=1.0, style=v,
                      preferred=exp.preferred_style(i, s), segment=s) for i, (v, s) in enumerate(zip(values, segs))]
    return Run(Path(f"seed-{seed}"), exp, {"sao": ArmResults(name="sao", rewards=rows, evals=[])})


def test_over_seeds_each_phase_level_is_the_mean_of_the_seeds_and_the_band_starts_where_all_have_the_segment():
    # early switches at 4: phases [0, 4) and [4, 12).
    first = run_in_memory([0.2] * 12, ["early", "late"] * 6, seed=0)
    second = run_in_memory([0.6] * 12, ["late", "early"] * 6, seed=1)
    summary = summarize_segment([first, second], "sao", first.scenario.segments[0])
    assert summary.seeds == 2 and [(p.style, p.start, p.end) for p in summary.phases] == [("formal", 0, 4),
                                                                                          ("cute", 4, 12)]
    assert [p.level.mean for p in summary.phases] == pytest.approx([0.4, 0.4])
    assert [(p.level.low, p.level.high, p.level.n) for p in summary.phases] == [(0.2, 0.6, 2)] * 2
    assert [p.rollouts for p in summary.phases] == [2, 4]
    b = segment_reward_band([first, second], "sao", "early", window=4)
    assert list(b.x) == list(range(1, 12))  # the second seed's first early request is rollout 1
    assert b.seeds.shape == (2, 11) and b.mean == pytest.approx([0.4] * 11)


def test_a_phase_a_seed_gave_no_rollout_of_the_segment_is_marked_and_seeds_are_named():
    """Seed 1 drew no 'early' request before rollout 4: its first phase has no level, which was
    averaged over the other seed without a word, beside a rollout count printed as 0 (mean 0.5)."""
    first = run_in_memory([0.2] * 12, ["early", "late"] * 6, seed=0)
    second = run_in_memory([0.6] * 12, ["late"] * 4 + ["early", "late"] * 4, seed=1)
    summary = summarize_segment([first, second], "sao", first.scenario.segments[0])
    assert summary.per_seed_seeds == [0, 1]
    assert [p.rollouts for p in summary.per_seed[1]] == [0, 4]
    lines = segment_markdown(summarize_segments([first, second], ["sao"]), first.scenario)
    row = next(line for line in lines if line.startswith("| sao |"))  # the first table: segment early
    assert row == ("| sao | 0.200 (1 of 2 seeds) / 0.200 (1 of 2 seeds) / 1.0 "
                   "| 0.400 [0.200, 0.600] / 0.400 [0.200, 0.600] / 4.0 |")
