"""The registry's evidence: the window, the monitors, and the gate inside
Releases through a scripted preference switch (real MLflow registry, real weight store)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from mlflow import MlflowClient

from online_sao.batch import Rollout
from online_sao.config import load_config
from online_sao.schemas import WeightsNotice, decode
from online_sao.weights import FileWeightStore, WeightsRef
from streams.memory import InMemoryBackend
from tests.trainer.test_tracking import empty_store  # noqa: F401  (the module-scoped template store)
from trainer.deploy import OffPolicyGate, RecentWindow, read_monitors
from trainer.publisher import Publisher
from trainer.releases import Releases
from trainer.tracking import RunTracker

STYLE_A, STYLE_B = 11, 22
"""The last answer token marks a rollout's style in the scripted scenario."""


def _rollout(iid: str, answer: list[int], version: int = 0, reward: float = 0.0, logprob: float = -1.0) -> Rollout:
    n = len(answer) + 1
    return Rollout(iid, [1, *answer], [False] + [True] * len(answer), [0.0] + [logprob] * len(answer),
                   [0] + [version] * len(answer), {n - 1: reward})


def test_window_keeps_the_newest_and_round_trips():
    window = RecentWindow(3)
    window.observe([_rollout(f"r{i}", [5, 6], version=i, reward=i) for i in range(5)])
    assert [r.interaction_id for r in window.rollouts] == ["r2", "r3", "r4"]
    assert window.versions() == (2, 4) and window.versions(min_version=3) == (3, 4)
    assert window.versions(min_version=5) == (0, 0) and window.since(5) == []
    assert window.answers(min_version=4) == [[5, 6]]
    window.since_registration = (10.0, 1.0)
    again = RecentWindow(3)
    again.load_state_dict(window.state_dict())
    assert list(again.rollouts) == list(window.rollouts) and again.since_registration == (10.0, 1.0)


def test_monitors_read_length_repetition_and_dead_letters_against_thresholds():
    cfg = load_config(environ={}, overrides={"deploy.monitor_max_mean_length": 5, "deploy.monitor_max_repetition": 0.3,
                                             "deploy.monitor_ngram": 2}).deploy
    window = RecentWindow(10)
    window.observe([_rollout("old", [1] * 20, version=1),  # sampled before the candidate: not its answers
                    _rollout("a", [7, 8, 7, 8, 7, 8], version=3), _rollout("b", [1, 2], version=4)])
    window.since_registration = (100.0, 2.0)
    reading = read_monitors(cfg, window, since_version=3, records_read=200.0, dead_letters=7.0)
    assert reading.values["mean_length"] == 4.0  # (6 + 2) / 2
    # bigrams of "a": 78 87 78 87 78 -> 3 repeats; "b": 12 -> none; 3 of 6
    assert reading.values["repetition"] == 0.5
    assert reading.values["dead_letter_share"] == 0.05  # 5 of 100 since registration
    assert reading.tripped == ["repetition"]  # length 4 <= 5; dead-letter monitor is off
    assert reading.tags()["monitor.tripped"] == "repetition"
    empty = read_monitors(cfg, RecentWindow(4), since_version=0, records_read=0.0, dead_letters=0.0)
    assert all(math.isnan(v) for v in empty.values.values()) and empty.tripped == []


class ScriptedScorer:
    """Versions of two styles: a version samples its own style with probability 0.9."""

    def __init__(self, style_of: dict[int, int]) -> None:
        self.style_of = style_of

    def log_ratios(self, ref: WeightsRef, window: list[Rollout]) -> torch.Tensor:
        own = self.style_of[ref.version]
        target = torch.tensor([math.log(0.9 if r.token_ids[-1] == own else 0.1) for r in window])
        behaviour = torch.tensor([sum(lp for lp, a in zip(r.logprobs, r.action_mask) if a) for r in window])
        return target - behaviour


@pytest.fixture
def registry_cfg(tmp_path, empty_store):  # noqa: F811
    db = tmp_path / "mlflow.db"
    shutil.copy(empty_store, db)
    cfg = load_config(environ={}, overrides={"paths.data_dir": str(tmp_path / "data"),
                                             "mlflow.tracking_uri": f"sqlite:///{db}", "deploy.window": 120})
    cfg.model_dir.mkdir(parents=True)
    (cfg.model_dir / "config.json").write_text('{"model_type": "fake"}')
    return cfg


def test_a_window_rewarded_under_other_reward_settings_is_not_restored(caplog):
    """A learner restarted with other ``reward.*`` settings: its checkpointed window's rewards are on
    the old scale, and scoring both versions on a mix of the two scales decides on neither."""
    window = RecentWindow(3, reward_definition="a" * 16)
    window.observe([_rollout(f"r{i}", [5, 6], version=i, reward=i) for i in range(5)])
    window.since_registration = (10.0, 1.0)
    same = RecentWindow(3, reward_definition="a" * 16)
    same.load_state_dict(window.state_dict())
    assert [r.interaction_id for r in same.rollouts] == ["r2", "r3", "r4"]
    unknown = RecentWindow(3)  # nothing to compare with: restored
    unknown.load_state_dict(window.state_dict())
    assert len(unknown.rollouts) == 3
    other = RecentWindow(3, reward_definition="b" * 16)
    with caplog.at_level("WARNING", logger="trainer.deploy"):
        other.load_state_dict(window.state_dict())
    assert list(other.rollouts) == [] and other.since_registration == (10.0, 1.0) and other.observed == 5
    assert "window of 3 rollouts was rewarded under reward definition " + "a" * 16 in caplog.text
    other.observe([_rollout("r5", [5, 6], version=5, reward=1.0)])
    assert other.state_dict()["reward_definition"] == "b" * 16 and other.since(0)[0].interaction_id == "r5"


def _registry_parts(cfg):
    """The broker (in memory), a publisher on a real weight store, the MLflow tracker and the window."""
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    publisher = Publisher(FileWeightStore(cfg.weight_store_url), backend.producer(), cfg.kafka.topics.weights, "m",
                          keep_versions=2)
    return backend, publisher, RunTracker(cfg), RecentWindow(cfg.deploy.window)


def test_preference_switch_promotes_the_realigned_policy_and_never_rolls_back(registry_cfg):
    """Rewards pay style A up to version 6, style B after; the learner's versions follow with a
    lag (A up to 8, B from 9). Each version serves 40 rollouts, 36 of its own style; the window
    holds three versions' traffic, of which the gate scores the candidate's and its successor's
    (those sampled since the candidate); the gate's floors are the defaults (32 rollouts, ESS 8)."""
    cfg = registry_cfg
    style_of = {v: STYLE_A if v <= 8 else STYLE_B for v in range(1, 17)}
    backend, publisher, tracker, window = _registry_parts(cfg)
    releases = Releases(publisher, tracker, OffPolicyGate(ScriptedScorer(style_of), cfg.deploy), window, cfg.deploy,
                        register_every=2)
    champions = []
    for version in range(1, 17):
        outcome = releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0))
        assert outcome.rolled_back_to is None, f"rolled back at v{version}"
        found = tracker.registry.champion()
        champions.append(found[0] if found else None)
        preferred = STYLE_A if version <= 6 else STYLE_B
        for i in range(40):  # the traffic this version serves before the next one is out
            style = style_of[version] if i % 10 else ({STYLE_A, STYLE_B} - {style_of[version]}).pop()
            window.observe([_rollout(f"v{version}-{i}", [5, style], version, float(style == preferred),
                                     logprob=math.log(0.9 if style == style_of[version] else 0.1) / 2)])
    notices = [decode(m.value) for m in backend.consumer([cfg.kafka.topics.weights]).poll(0.1, 1000)]
    assert all(n.action in ("publish", "champion") for n in notices if isinstance(n, WeightsNotice))
    assert style_of[champions[-1]] == STYLE_B  # the re-aligned policy is champion at the end
    client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)
    versions = client.search_model_versions(f"name = '{cfg.mlflow.registered_model}'")
    by_policy = {int(v.tags["policy_version"]): v.tags for v in versions}
    switch = by_policy[10]  # the first B candidate, decided against an A champion on B-paying traffic
    assert switch["decision"] == "promoted" and switch["gate.decision"] == "promoted"
    assert float(switch["gate.champion_value"]) < 0.5 < float(switch["gate.candidate_value"])
    # decided when v12 is published: the window holds v9-v11's traffic; scored: v10's and v11's 80
    assert switch["gate.window_versions"] == "10-11" and switch["gate.n"] == "80"
    # on those 80 (72 B answers, 8 A) the old champion v8 (A) has weight 0.1/0.9 = 1/9 on a B answer
    # and 0.9/0.1 = 9 on an A one: ESS = (72/9 + 8*9)^2 / (72/9^2 + 8*9^2) = 80^2 / (72/81 + 8*81), about 9.9
    assert float(switch["gate.champion_ess"]) == pytest.approx(80 ** 2 / (72 / 81 + 8 * 81))
    assert float(switch["gate.candidate_ess"]) == pytest.approx(80.0)  # it sampled them all itself
    assert switch["monitor.tripped"] == "none"


class TrainedOnScorer:
    """A version rates each rollout sampled before it (the learner trained it on those) many
    nats above the behaviour, by a different amount for each, as a training step that pushed
    rewarded answers up does; the rollouts sampled by it or later it rates as the behaviour did."""

    def log_ratios(self, ref: WeightsRef, window: list[Rollout]) -> torch.Tensor:
        return torch.tensor([13.0 + k if max(r.versions) < ref.version else 0.0 for k, r in enumerate(window)])


def test_gate_scores_neither_version_on_the_candidates_training_rollouts():
    """Window: 40 rollouts each of v3, v4, v5; candidate v4 (trained on v3's), champion v2."""
    window = RecentWindow(120)
    for version in (3, 4, 5):
        window.observe([_rollout(f"v{version}-{i}", [5, 6], version, float(i % 2)) for i in range(40)])
    cfg = load_config(environ={}, overrides={}).deploy
    candidate, champion = WeightsRef(4, "c", "0" * 64), WeightsRef(2, "h", "0" * 64)
    evidence = OffPolicyGate(TrainedOnScorer(), cfg).compare(candidate, champion, window)
    # scored: v4's and v5's 80 rollouts only; both versions rate them as the behaviour did (weights
    # all equal: ESS 80, each value the mean reward 1/2); on all 120 the candidate's ESS would be
    # about (1/(1 - e^-1))^2 / (1/(1 - e^-2)), 2.2, and the gate would refuse
    assert (evidence.decision, evidence.n, evidence.window) == ("promoted", 80, (4, 5))
    assert evidence.candidate_ess == pytest.approx(80.0) and evidence.champion_ess == pytest.approx(80.0)
    assert evidence.candidate_value == pytest.approx(0.5) and evidence.difference == pytest.approx(0.0)
    strict = load_config(environ={}, overrides={"deploy.gate_min_rollouts": 50}).deploy
    newest = OffPolicyGate(TrainedOnScorer(), strict).compare(WeightsRef(5, "c", "0" * 64), champion, window)
    assert (newest.decision, newest.reason, newest.window) == ("refused", "n=40 < min_rollouts=50", (5, 5))
    assert newest.tags()["gate.n"] == "40" and newest.tags()["gate.window_versions"] == "5-5"


def test_kl_monitor_trips_only_above_its_threshold():
    cfg = load_config(environ={}, overrides={"deploy.monitor_max_kl": 0.25}).deploy
    window = RecentWindow(4)
    window.observe([_rollout("a", [1, 2], version=1)])
    at_edge = read_monitors(cfg, window, since_version=1, records_read=0.0, dead_letters=0.0, kl=0.25)
    assert at_edge.values["kl"] == 0.25 and at_edge.tripped == []
    above = read_monitors(cfg, window, since_version=1, records_read=0.0, dead_letters=0.0, kl=0.2500001)
    assert above.tripped == ["kl"] and above.tags()["monitor.kl"] == "0.2500001"
    unread = read_monitors(cfg, window, since_version=1, records_read=0.0, dead_letters=0.0)
    assert "kl" not in unread.values and unread.tripped == []
    nan = read_monitors(cfg, window, since_version=1, records_read=0.0, dead_letters=0.0, kl=math.nan)
    assert nan.tripped == []  # no answer of the candidate yet: nothing to judge


class FixedKL:
    """The KL of each version, as the monitor would read it."""

    def __init__(self, kl_of: dict[int, float]) -> None:
        self.kl_of = kl_of
        self.asked: list[tuple[int, int]] = []

    def reference_kl(self, ref: WeightsRef, rollouts: list[Rollout]) -> tuple[float, dict[str, float]]:
        self.asked.append((ref.version, len(rollouts)))
        return self.kl_of[ref.version], {}


def test_kl_monitor_rolls_the_candidate_back_and_goes_to_mlflow(registry_cfg):
    cfg = registry_cfg.model_copy(update={"deploy": registry_cfg.deploy.model_copy(update={"monitor_max_kl": 0.5})})
    backend, publisher, tracker, window = _registry_parts(cfg)
    reference = FixedKL({2: 0.1, 4: 0.9})
    with pytest.raises(ValueError, match="monitor_max_kl"):
        Releases(publisher, tracker, OffPolicyGate(ScriptedScorer({}), cfg.deploy), window, cfg.deploy, 2)
    releases = Releases(publisher, tracker, OffPolicyGate(ScriptedScorer({v: STYLE_A for v in range(1, 7)}),
                                                          cfg.deploy), window, cfg.deploy, 2, reference=reference)
    outcomes = []
    for version in range(1, 7):
        outcomes.append(releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0)))
        window.observe([_rollout(f"v{version}-{i}", [5, STYLE_A], version, 1.0, logprob=math.log(0.9) / 2)
                        for i in range(40)])
    # v2 registered, decided at v4 (KL 0.1: promoted); v4 registered, decided at v6 (KL 0.9: rolled back)
    assert reference.asked == [(2, 80), (4, 80)]  # the candidate's and newer answers only
    assert outcomes[5].rolled_back_to is not None and outcomes[5].rolled_back_to.version == 2
    client = MlflowClient(tracking_uri=cfg.mlflow_uri)
    history = [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "registry_monitor_kl")]
    assert history == [(4, 0.1), (6, 0.9)]
    by_policy = {int(v.tags["policy_version"]): v.tags
                 for v in client.search_model_versions(f"name = '{cfg.mlflow.registered_model}'")}
    assert by_policy[4]["decision"] == "rolled_back" and by_policy[4]["monitor.tripped"] == "kl"


class MixtureScorer:
    """Each version samples style B with its own probability (the restart point: one half)."""

    def __init__(self, prob_b: dict[int, float]) -> None:
        self.prob_b = prob_b

    def log_ratios(self, ref: WeightsRef, window: list[Rollout]) -> torch.Tensor:
        p = self.prob_b[ref.version]
        target = torch.tensor([math.log(p if r.token_ids[-1] == STYLE_B else 1 - p) for r in window])
        behaviour = torch.tensor([sum(lp for lp, a in zip(r.logprobs, r.action_mask) if a) for r in window])
        return target - behaviour


def test_a_drift_restart_becomes_champion_and_the_gate_goes_on_from_it(registry_cfg):
    """A-concentrated versions 1-8 (B with probability 0.01); the preference is B from v7's
    traffic on; the learner detects the drop and restarts: v9 samples B with probability one half,
    then v10-16 learn B. The restart is champion at once, with the detector's evidence; every later
    candidate is compared with it or a successor on the same traffic; nothing rolls back."""
    cfg = registry_cfg
    prob_b = {v: 0.01 for v in range(1, 9)} | {9: 0.5} | {v: min(0.5 + 0.1 * (v - 9), 0.95) for v in range(10, 17)}
    backend, publisher, tracker, window = _registry_parts(cfg)
    releases = Releases(publisher, tracker, OffPolicyGate(MixtureScorer(prob_b), cfg.deploy), window, cfg.deploy,
                        register_every=2)
    drift = {"drift_alarm": 1.0, "drift_drop": 0.61, "drift_z": 5.2}
    champions = []
    for version in range(1, 17):
        outcome = releases.release({"w": torch.full((2,), float(version))}, version, version, {"reward_mean": 0.1},
                                   (0.0, 0.0), drift if version == 9 else None)
        assert outcome.rolled_back_to is None, f"rolled back at v{version}"
        assert outcome.registered == (version == 9 or version % 2 == 0)
        found = tracker.registry.champion()
        champions.append(found[0] if found else None)
        for i in range(40):  # B on every i < 40 * p_B, A otherwise: the version's own mixture, exactly
            style = STYLE_B if i < round(40 * prob_b[version]) else STYLE_A
            p = prob_b[version] if style == STYLE_B else 1 - prob_b[version]
            preferred = STYLE_B if version >= 7 else STYLE_A
            window.observe([_rollout(f"v{version}-{i}", [5, style], version, float(style == preferred),
                                     logprob=math.log(p) / 2)])
    assert champions[8] == 9  # the restart, as soon as it is published
    assert champions[-1] >= 12 and all(c >= 9 for c in champions[8:])  # the gate promoted past it; never back to A
    notices = [decode(m.value) for m in backend.consumer([cfg.kafka.topics.weights]).poll(0.1, 1000)]
    assert all(n.action in ("publish", "champion") for n in notices if isinstance(n, WeightsNotice))
    client = MlflowClient(tracking_uri=cfg.mlflow_uri, registry_uri=cfg.mlflow_uri)
    by_policy = {int(v.tags["policy_version"]): v.tags
                 for v in client.search_model_versions(f"name = '{cfg.mlflow.registered_model}'")}
    restart = by_policy[9]
    assert restart["decision"] == "promoted" and restart["gate.decision"] == "drift_restart"
    assert float(restart["drift.z"]) == 5.2 and float(restart["drift.drop"]) == 0.61
    # no record crosses a detected change; scored on the same window at once, the restart never needed
    # one (tests/trainer/test_champion_record.py has a restart that does)
    assert not any(k.startswith("record.") for k in restart)
    first_after = by_policy[10]  # decided at v12 against the restart, on v10's and v11's traffic
    assert first_after["decision"] == "promoted" and first_after["gate.window_versions"] == "10-11"


def test_window_canary_holds_the_champions_answers_since_registration():
    window = RecentWindow(6)
    window.observe([_rollout("before", [5, 6], version=2)])  # the champion's, before the candidate: not evidence
    window.mark_registration((5.0, 0.0))
    window.observe([_rollout("c1", [5, 6], version=2), _rollout("n1", [5, 6], version=4),
                    _rollout("mixed", [5, 6], version=2)])
    window.rollouts[-1].versions[-1] = 4  # straddled the swap to v4: not the champion's alone
    assert [r.interaction_id for r in window.canary(2)] == ["c1"]
    window.observe([_rollout(f"c{i}", [5, 6], version=2) for i in range(2, 6)])  # the window drops "before", "c1"
    assert [r.interaction_id for r in window.canary(2)] == ["c2", "c3", "c4", "c5"]
    again = RecentWindow(6)
    again.load_state_dict(window.state_dict())
    assert (again.observed, again.registered_at, again.since_registration) == (8, 1, (5.0, 0.0))
    assert again.canary(2) == window.canary(2)


def _stale_champion_scenario(cfg, prob_b: dict[int, float] | None = None):
    """Rewards pay style B throughout; versions 1-5 sample B with probability 0.001, versions 6-12
    with 0.95 (or as ``prob_b`` says). Each version's 40 requests: with a canary, every fifth is
    answered by the champion. Answer i of a server with probability p is B when (i + 0.5) / 40 < p
    (exact shares)."""
    prob_b = prob_b or {v: 0.001 if v <= 5 else 0.95 for v in range(1, 13)}
    backend, publisher, tracker, window = _registry_parts(cfg)
    releases = Releases(publisher, tracker, OffPolicyGate(MixtureScorer(prob_b), cfg.deploy), window, cfg.deploy,
                        register_every=2)
    champions = []
    for version in range(1, 13):
        assert releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0)) \
            .rolled_back_to is None
        found = tracker.registry.champion()
        champions.append(found[0] if found else None)
        for i in range(40):
            server = found[0] if cfg.deploy.canary_share > 0 and found and i % 5 == 0 else version
            style = STYLE_B if (i + 0.5) / 40 < prob_b[server] else STYLE_A
            p = prob_b[server] if style == STYLE_B else 1 - prob_b[server]
            window.observe([_rollout(f"v{version}-{i}", [5, style], server, float(style == STYLE_B),
                                     logprob=math.log(p) / 2)])
    messages = backend.consumer([cfg.kafka.topics.weights]).poll(0.1, 1000)
    notices = [decode(m.value) for m in messages]
    assert all(m.key == (b"m#champion" if n.action == "champion" else b"m") for m, n in zip(messages, notices))
    by_policy = {int(v.tags["policy_version"]): v.tags for v in
                 MlflowClient(tracking_uri=cfg.mlflow_uri).search_model_versions(
                     f"name = '{cfg.mlflow.registered_model}'")}
    return champions, notices, by_policy


def test_without_a_canary_or_records_a_stale_champion_stops_the_gate(registry_cfg):
    cfg = registry_cfg.model_copy(update={"deploy": registry_cfg.deploy.model_copy(
        update={"gate_champion_record": False})})
    champions, notices, by_policy = _stale_champion_scenario(cfg)
    assert champions[-1] == 4  # promoted at v6 on A traffic, never replaced
    # v6 against v4 on v6's and v7's 80 answers (76 B, 4 A): v4's weights are 0.999/0.05 on an A answer
    # and 0.001/0.95 on a B one: ESS = (4 * 19.98 + 76 * 0.00105)^2 / (4 * 19.98^2 + 76 * 0.00105^2), about 4.0
    assert by_policy[6]["gate.decision"] == "refused" and by_policy[6]["gate.reason"].startswith("ess=4.0")
    assert all(by_policy[v]["gate.decision"] == "refused" for v in (6, 8, 10))
    # no canary: the champion is announced all the same (replicas ignore it; weights hold --champion reads it)
    assert [n.version for n in notices if n.action == "champion"] == [2, 4]  # v2 promoted, then v4
    assert all(n.action in ("publish", "champion") for n in notices)


def test_with_a_canary_the_gate_compares_with_the_champions_own_answers(registry_cfg):
    cfg = registry_cfg.model_copy(update={"deploy": registry_cfg.deploy.model_copy(update={"canary_share": 0.2})})
    champions, notices, by_policy = _stale_champion_scenario(cfg)
    assert champions[5] == 4 and champions[7] == 6  # the B candidate replaces the A champion at once
    assert all(c is None or c >= 6 for c in champions[7:])  # and never goes back
    decided = by_policy[6]  # at v8: v6's and v7's 64 answers (60 B, 4 A) and v4's 16 canary answers (all A)
    assert decided["gate.decision"] == "promoted" and decided["gate.n"] == "80" and decided["gate.canary_n"] == "16"
    assert decided["gate.window_versions"] == "6-7"  # the candidate's side: canary answers are canary_n
    # weights against q = 0.8 pi_serving + 0.2 pi_champ, per answer divided by the behaviour mu:
    # a B answer of v6/v7: q/mu = 0.8 + 0.2 * 0.001/0.95; an A answer of v6/v7: 0.8 + 0.2 * 0.999/0.05;
    # a canary A answer (mu = v4's 0.999; v6 stands in for the serving version): 0.8 * 0.05/0.999 + 0.2
    b_cand = 1 / (0.8 + 0.2 * 0.001 / 0.95)
    a_cand = 1 / (0.8 + 0.2 * 0.999 / 0.05)
    k_cand = (0.05 / 0.999) / (0.8 * 0.05 / 0.999 + 0.2)
    b_champ, a_champ, k_champ = 0.001 / 0.95 * b_cand, 0.999 / 0.05 * a_cand, 1 / (0.8 * 0.05 / 0.999 + 0.2)
    champ_sum = 60 * b_champ + 4 * a_champ + 16 * k_champ
    assert float(decided["gate.champion_ess"]) == pytest.approx(
        champ_sum ** 2 / (60 * b_champ ** 2 + 4 * a_champ ** 2 + 16 * k_champ ** 2))  # about 20; 4.0 without
    assert float(decided["gate.champion_value"]) == pytest.approx(60 * b_champ / champ_sum)  # about 0.001
    assert float(decided["gate.candidate_value"]) == pytest.approx(
        60 * b_cand / (60 * b_cand + 4 * a_cand + 16 * k_cand))  # about 0.95
    champion_notices = [n for n in notices if n.action == "champion"]
    assert [n.version for n in champion_notices][:3] == [2, 4, 6]  # every promotion, in order
    assert not any(n.action == "rollback" for n in notices)


def test_with_a_canary_a_drift_restart_is_announced_as_champion(registry_cfg):
    cfg = registry_cfg.model_copy(update={"deploy": registry_cfg.deploy.model_copy(update={"canary_share": 0.25})})
    backend, publisher, tracker, window = _registry_parts(cfg)
    releases = Releases(publisher, tracker, OffPolicyGate(ScriptedScorer({}), cfg.deploy), window, cfg.deploy,
                        register_every=10)
    for version in (1, 2):
        releases.release({"w": torch.full((2,), float(version))}, version, version, {}, (0.0, 0.0))
    releases.release({"w": torch.full((2,), 3.0)}, 3, 7, {}, (0.0, 0.0), {"drift_alarm": 1.0, "drift_drop": 0.5})
    notices = [decode(m.value) for m in backend.consumer([cfg.kafka.topics.weights]).poll(0.1, 1000)]
    assert [(n.action, n.version) for n in notices] == [("publish", 1), ("publish", 2), ("publish", 3),
                                                         ("champion", 3)]
    assert notices[-1].step == 7 and tracker.registry.champion()[0] == 3


def test_the_gate_weighs_a_canary_pool_at_its_own_share_not_the_traffics(registry_cfg):
    """Serving answers enter the pool by version, canary answers by when they were observed: here 6
    answers of the candidate (v3) and 6 of the champion (v1) observed since the registration, three
    of them sampled before v3 existed. The pool was drawn half and half, not at the configured 0.2."""
    prob_b = {1: 0.2, 3: 0.8}
    window = RecentWindow(64)
    window.observe([_rollout(f"old-{i}", [5, STYLE_A], 2, 0.0, logprob=math.log(0.5)) for i in range(4)])
    window.mark_registration((0.0, 0.0))
    styles = [STYLE_B, STYLE_B, STYLE_A, STYLE_B, STYLE_A, STYLE_A]
    for i, style in enumerate(styles):  # the champion's answers first, as they came in
        p = prob_b[1] if style == STYLE_B else 1 - prob_b[1]
        window.observe([_rollout(f"canary-{i}", [5, style], 1, float(style == STYLE_B), logprob=math.log(p))])
    for i, style in enumerate(styles):
        p = prob_b[3] if style == STYLE_B else 1 - prob_b[3]
        window.observe([_rollout(f"serving-{i}", [5, style], 3, float(style == STYLE_B), logprob=math.log(p))])
    deploy = registry_cfg.deploy.model_copy(update={"canary_share": 0.2, "gate_min_rollouts": 4, "gate_min_ess": 1.0})
    evidence = OffPolicyGate(MixtureScorer(prob_b), deploy).compare(WeightsRef(3, "c", "x"), WeightsRef(1, "h", "x"),
                                                                    window)
    assert (evidence.n, evidence.canary_n) == (12, 6)
    # q = 0.5 pi_3 + 0.5 pi_1 on every answer (the candidate stands in for the serving version)
    q = {STYLE_B: 0.5 * 0.8 + 0.5 * 0.2, STYLE_A: 0.5 * 0.2 + 0.5 * 0.8}
    for value, pi in ((evidence.candidate_value, prob_b[3]), (evidence.champion_value, prob_b[1])):
        w = {STYLE_B: pi / q[STYLE_B], STYLE_A: (1 - pi) / q[STYLE_A]}
        total = sum(2 * w[s] for s in styles)
        assert value == pytest.approx(sum(2 * w[s] * (s == STYLE_B) for s in styles) / total)
