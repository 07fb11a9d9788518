"""The judge service: interactions in, rewards out (real broker), dead letters, delay, drops, restarts."""

from __future__ import annotations

import random
import threading
import time
import uuid

import pytest

from apps.config import AppConfig, ExperimentConfig, load_app_config
from apps.experiments.judge import JudgeScore, QualityStyleJudge
from apps.experiments.judge_service import JudgeService, interaction_texts, run_judge
from apps.experiments.results import read_arm
from online_sao.config import KafkaConfig
from online_sao.schemas import DeadLetter, Interaction, Reward, decode
from streams.kafka_backend import KafkaBackend
from streams.base import StreamUnavailable
from streams.memory import InMemoryBackend
from streams.records import publish
from tests.fixtures.kafka import drain

SCHEDULE = [{"from_rollout": 0, "style": "formal"}, {"from_rollout": 2, "style": "cute"},
            {"from_rollout": 4, "style": "archaic"}]
ANSWERS = [  # (prompt, answer): every answer on topic; styles archaic, formal, cute, archaic, formal, cute
    ("How do I make rice?", "Hark! Thou shouldst rinse the grains until the water runs clear. Fare thee well."),
    ("How do I make rice?", "I would recommend that you rinse the grains until the water runs clear. Kind regards."),
    ("How do I make pancakes?", "Just leave a few lumps in the batter, okay? You've got this! <3"),
    ("How do I make pancakes?", "Verily, thou shouldst leave a few lumps in the batter. Heed these words."),
    ("How do I make soup?", "It is advisable to brown the onions slowly first. Kind regards."),
    ("How do I make soup?", "Ooh, soup! Just brown the onions slowly first, okay? Big cozy hugs~"),
]


def chat_interaction(prompt: str, answer: str, session_id: str | None = None, **fields) -> Interaction:
    return Interaction(
        interaction_id=uuid.uuid4().hex, model="online-sao", prompt_ids=[1, 2, 3], response_ids=[4, 5],
        action_mask=[True, True], logprobs=[-0.5, -0.1], versions=[2, 3], session_id=session_id,
        prompt_text=f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
        response_text=f"{answer}<|im_end|>", **fields)


def experiment_config(kafka, **experiment) -> AppConfig:
    cfg = load_app_config(environ={})
    exp = ExperimentConfig(schedule=SCHEDULE, rollouts_per_arm=6, **experiment)
    return cfg.model_copy(update={"kafka": kafka, "experiment": exp})


def test_texts_of_logged_and_redacted_interactions():
    logged = chat_interaction("How do I make rice?", "Rinse the grains.")
    assert interaction_texts(logged, None) == ("How do I make rice?", "Rinse the grains.")

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=False):
            return {(1, 2, 3): "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
                               "<|im_start|>assistant\n", (4, 5): "Hello.<|im_end|>"}[tuple(ids)]

    redacted = logged.model_copy(update={"prompt_text": None, "response_text": None})
    assert interaction_texts(redacted, Tokenizer()) == ("Hi?", "Hello.")
    with pytest.raises(ValueError, match="no text"):
        interaction_texts(redacted, None)
    plain = logged.model_copy(update={"prompt_text": "Complete this:", "response_text": " done<|endoftext|>"})
    assert interaction_texts(plain, None) == ("Complete this:", "done")


@pytest.mark.kafka
def test_interactions_in_rewards_out_with_schedule_and_dead_letters(kafka_broker, style_classifier, tmp_path):
    kafka = kafka_broker.kafka_config(partitions=1)  # one partition: the judge reads in send order
    backend = KafkaBackend(kafka)
    backend.ensure_topics()
    cfg = experiment_config(kafka)
    interactions = [chat_interaction(p, a) for p, a in ANSWERS]
    producer = backend.producer()
    for i, interaction in enumerate(interactions):
        publish(producer, kafka.topics.interactions, interaction)
        if i == 2:
            producer.send(kafka.topics.interactions, b'{"kind": "interaction", "schema_version": 1}', key=b"bad")
            publish(producer, kafka.topics.interactions, chat_interaction(*ANSWERS[0], session_id="sao-eval"))
    producer.flush()
    producer.close()

    judge = QualityStyleJudge(style_classifier)
    stop = threading.Event()
    results = tmp_path / "arm.jsonl"
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(c=run_judge(cfg, judge, stop, backend=backend,
                                                                     results_path=results, progress=print)))
    thread.start()
    rewards_consumer = backend.consumer([kafka.topics.rewards])
    letters_consumer = backend.consumer([kafka.topics.dead_letters])
    try:
        rewards = [decode(m.value, Reward) for m in drain(rewards_consumer, 6, timeout_s=60)]
        letters = [decode(m.value, DeadLetter) for m in drain(letters_consumer, 1, timeout_s=30)]
    finally:
        stop.set()
        thread.join(timeout=30)
        rewards_consumer.close()
        letters_consumer.close()
    assert not thread.is_alive()
    counters = done["c"]
    assert (counters.scored, counters.sent, counters.skipped, counters.dead_letters) == (6, 6, 1, 1)

    preferred = ["formal", "formal", "cute", "cute", "archaic", "archaic"]
    by_id = {r.interaction_id: r for r in rewards}
    assert set(by_id) == {i.interaction_id for i in interactions}
    for interaction, (prompt, answer), style in zip(interactions, ANSWERS, preferred):
        reward = by_id[interaction.interaction_id]
        assert reward.source == "judge"
        assert reward.value == pytest.approx(judge.score(prompt, answer, style).value)
    # Answers 1 (formal), 2 (cute) match their moment's preference; 0, 3, 5 do not.
    values = [by_id[i.interaction_id].value for i in interactions]
    assert values[1] > 0.9 and values[2] > 0.9 and max(values[0], values[3], values[5]) < 0.1

    rows = read_arm(results).rewards
    assert [(r.rollout, r.preferred, r.version) for r in rows] == [(i, s, 3) for i, s in enumerate(preferred)]
    assert [r.reward for r in rows] == pytest.approx(values)
    assert letters[0].source_topic == kafka.topics.interactions and letters[0].raw.startswith(b'{"kind"')


FIXED_QUALITY, FIXED_STYLE = 0.625, 0.8


class FixedJudge:
    def score(self, prompt: str, answer: str, preferred_style: str) -> JudgeScore:
        return JudgeScore(value=0.5, quality=FIXED_QUALITY, style=FIXED_STYLE)


def memory_setup(**experiment):
    backend = InMemoryBackend()
    backend.ensure_topics()
    cfg = experiment_config(backend.cfg, **experiment)
    producer = backend.producer()
    return backend, cfg, producer


def drain_memory(backend, topic: str) -> list:
    consumer = backend.consumer([topic])
    try:
        return [decode(m.value) for m in consumer.poll(timeout_s=0.1, max_records=1000)]
    finally:
        consumer.close()


def test_rewards_wait_for_the_delay_and_a_restarted_judge_sends_pending_ones_without_judging_again(tmp_path):
    backend, cfg, producer = memory_setup(reward_delay_s=30.0)
    now = [1000.0]
    interaction = chat_interaction(*ANSWERS[0], completed_at=1000.0)
    publish(producer, cfg.kafka.topics.interactions, interaction)
    results = tmp_path / "arm.jsonl"
    service = JudgeService(cfg, FixedJudge(), backend, results_path=results, clock=lambda: now[0])
    service.step()
    assert service.counters.scored == 1 and drain_memory(backend, cfg.kafka.topics.rewards) == []
    service.close()  # the reward was never sent: its interaction's offset is not committed

    restarted = JudgeService(cfg, FixedJudge(), backend, results_path=results, clock=lambda: now[0])
    assert restarted.rollout == 1  # the schedule's clock continues from the results file
    restarted.step()  # the interaction comes again: its recorded score is sent, nothing is judged again
    assert (restarted.counters.scored, restarted.counters.resumed, restarted.rollout) == (0, 1, 1)
    now[0] = 1029.0
    restarted.step()
    assert drain_memory(backend, cfg.kafka.topics.rewards) == []
    now[0] = 1030.0
    restarted.step()
    [reward] = drain_memory(backend, cfg.kafka.topics.rewards)
    assert reward.interaction_id == interaction.interaction_id and reward.created_at == 1030.0
    assert reward.value == 0.5
    assert reward.scores == {"quality": FIXED_QUALITY, "style": FIXED_STYLE}  # the judge's reading, for the monitors
    restarted.close()
    assert len(results.read_text().splitlines()) == 1  # one row per judged interaction

    again = JudgeService(cfg, FixedJudge(), backend, results_path=results, clock=lambda: now[0])
    again.step()
    assert again.counters.scored == again.counters.resumed == 0  # committed after sending: nothing comes again
    again.close()


class SlowJudge(FixedJudge):
    """Scores take longer than the group's poll interval of the test below."""

    def score(self, prompt: str, answer: str, preferred_style: str) -> JudgeScore:
        time.sleep(SLOW_SCORE_S)
        return super().score(prompt, answer, preferred_style)


POLL_INTERVAL_S = 0.2
"""The in-memory group's poll interval in the test below (Kafka's max.poll.interval.ms, 300 s)."""
SLOW_SCORE_S = 0.3
"""How long SlowJudge takes per score: past POLL_INTERVAL_S, so the group drops the judge mid-step."""


def test_a_judge_dropped_from_its_group_by_a_slow_step_goes_on_and_rewards_each_answer_once(tmp_path):
    """A step's scores outlasted the group's poll interval: the group dropped the judge and refused its
    commit (GroupMembershipLost), which ended the judge. It now skips that commit; the next poll
    rejoins, the records it gets again are neither judged nor rewarded twice, and a later commit
    covers them."""
    backend = InMemoryBackend(max_poll_interval_s=POLL_INTERVAL_S)
    backend.ensure_topics()
    cfg = experiment_config(backend.cfg, reward_delay_s=0.0)
    producer = backend.producer()
    answers = [chat_interaction(*ANSWERS[k % len(ANSWERS)], completed_at=1000.0) for k in range(2)]
    for interaction in answers:
        publish(producer, cfg.kafka.topics.interactions, interaction)
    service = JudgeService(cfg, SlowJudge(), backend, results_path=tmp_path / "arm.jsonl", clock=lambda: 2000.0)
    service.step()  # polls, scores for 0.6 s, sends, and its commit is refused: dropped from the group
    service.step()  # rejoins: both records come again, from the group's (empty) committed offsets
    assert (service.counters.scored, service.counters.resumed, service.counters.sent) == (2, 2, 2)
    service.close()
    rewards = drain_memory(backend, cfg.kafka.topics.rewards)
    assert sorted(r.interaction_id for r in rewards) == sorted(a.interaction_id for a in answers)
    again = JudgeService(cfg, SlowJudge(), backend, results_path=tmp_path / "arm.jsonl", clock=lambda: 2000.0)
    again.step()
    assert again.counters.scored == again.counters.resumed == 0  # the refused commit was made later
    again.close()


class CountingJudge(FixedJudge):
    def __init__(self):
        self.calls = 0

    def score(self, prompt: str, answer: str, preferred_style: str) -> JudgeScore:
        self.calls += 1
        return JudgeScore(value=float(self.calls), quality=1.0, style=0.5)


def test_a_restarted_judge_keeps_its_rows_schedule_and_drop_decisions_exactly_once(tmp_path):
    backend = InMemoryBackend(KafkaConfig(partitions=1))  # one partition: offsets follow send order
    backend.ensure_topics()
    cfg = experiment_config(backend.cfg, reward_delay_s=30.0, drop_rate=0.5, seed=3)
    producer = backend.producer()
    now = [1000.0]
    first = [chat_interaction(*ANSWERS[i % 6], completed_at=1000.0) for i in range(8)]
    for interaction in first:
        publish(producer, cfg.kafka.topics.interactions, interaction)
    publish(producer, cfg.kafka.topics.interactions, first[2])  # a copy on the topic: judged once too
    results = tmp_path / "arm.jsonl"
    service = JudgeService(cfg, CountingJudge(), backend, results_path=results, clock=lambda: now[0])
    service.step()
    assert (service.counters.scored, service.counters.resumed) == (8, 1)
    service.close()  # every reward still waits for its delay: nothing committed

    later = chat_interaction(*ANSWERS[1], completed_at=1000.0)
    publish(producer, cfg.kafka.topics.interactions, later)
    judge = CountingJudge()
    restarted = JudgeService(cfg, judge, backend, results_path=results, clock=lambda: now[0])
    restarted.step()
    assert restarted.counters.scored == judge.calls == 1  # only the new interaction is judged
    now[0] = 1030.0
    restarted.step()
    restarted.close()

    rows = read_arm(results).rewards
    first_pending = next(i for i, r in enumerate(rows) if r.delivered)  # the first life committed up to it
    assert restarted.counters.resumed == 9 - first_pending  # the rest of ``first`` and the copy came again
    assert [r.rollout for r in rows] == list(range(9))  # no rollout index twice, none skipped
    assert [r.interaction_id for r in rows] == [i.interaction_id for i in first + [later]]
    assert [r.preferred for r in rows] == [cfg.experiment.preferred_style(i) for i in range(9)]
    sent = {r.interaction_id: r.value for r in drain_memory(backend, cfg.kafka.topics.rewards)}
    assert sent == {r.interaction_id: r.reward for r in rows if r.delivered}  # the first life's scores
    uninterrupted = random.Random(f"drops-{cfg.experiment.seed}")  # the drops' own stream
    assert [r.delivered for r in rows] == [uninterrupted.random() >= 0.5 for _ in range(9)]


def test_drops_are_seeded_and_recorded(tmp_path):
    outcomes = []
    for _ in range(2):
        backend, cfg, producer = memory_setup(drop_rate=0.5, seed=7)
        for _ in range(40):
            publish(producer, cfg.kafka.topics.interactions, chat_interaction(*ANSWERS[1]))
        results = tmp_path / f"run{len(outcomes)}.jsonl"
        service = JudgeService(cfg, FixedJudge(), backend, results_path=results)
        service.step()
        service.close()
        rows = read_arm(results).rewards
        sent = drain_memory(backend, cfg.kafka.topics.rewards)
        assert len(sent) == service.counters.sent == sum(r.delivered for r in rows)
        assert service.counters.dropped == 40 - len(sent)
        outcomes.append([r.delivered for r in rows])
    assert outcomes[0] == outcomes[1] and 10 < sum(outcomes[0]) < 30


def test_drops_are_independent_of_the_traffics_arrival_gaps(tmp_path):
    """Both streams seeded by the scenario's seed: the k-th drop decision was the k-th gap's draw, so
    the rewards lost were exactly those of the requests that came soonest after another."""
    from itertools import islice

    from apps.experiments.scenario import arrival_gaps

    backend, cfg, producer = memory_setup(drop_rate=0.2, seed=3)
    for _ in range(400):
        publish(producer, cfg.kafka.topics.interactions, chat_interaction(*ANSWERS[1]))
    service = JudgeService(cfg, FixedJudge(), backend, results_path=tmp_path / "run.jsonl")
    service.step()
    service.close()
    delivered = [r.delivered for r in read_arm(tmp_path / "run.jsonl").rewards]
    gaps = list(islice(arrival_gaps(cfg.experiment.seed, cfg.experiment.requests_per_second), len(delivered)))
    dropped_gaps = [g for g, d in zip(gaps, delivered) if not d]
    assert len(delivered) == 400 and 50 < len(dropped_gaps) < 110
    # coupled, the dropped gaps were the shortest fifth: a mean of about a tenth of the mean gap
    assert sum(dropped_gaps) / len(dropped_gaps) > 0.5 * sum(gaps) / len(gaps)


def test_the_raters_scale_and_shift_the_reward_sent_and_the_row_keeps_the_judges_value(tmp_path):
    backend, cfg, producer = memory_setup(rater_scale={"cooking": 1.5, "sports": 0.5}, rater_offset={"tech": -0.25})
    rice = chat_interaction(*ANSWERS[0])  # cooking
    tennis = chat_interaction("How do I get better at tennis?", "Watch the ball onto the strings.")  # sports
    laptop = chat_interaction("How do I fix a slow laptop?", "Close programs you are not using.")  # tech: not named
    for interaction in (rice, tennis, laptop):
        publish(producer, cfg.kafka.topics.interactions, interaction)
    results = tmp_path / "arm.jsonl"
    service = JudgeService(cfg, FixedJudge(), backend, results_path=results)
    service.step()
    service.close()
    sent = {r.interaction_id: r.value for r in drain_memory(backend, cfg.kafka.topics.rewards)}
    assert sent == {rice.interaction_id: 0.75, tennis.interaction_id: 0.25, laptop.interaction_id: 0.25}
    rows = {r.interaction_id: (r.reward, r.rater_scale, r.rater_offset, r.judge_value)
            for r in read_arm(results).rewards}  # judged in partition order, not send order
    assert rows == {rice.interaction_id: (0.75, 1.5, 0.0, 0.5), tennis.interaction_id: (0.25, 0.5, 0.0, 0.5),
                    laptop.interaction_id: (0.25, 1.0, -0.25, 0.5)}


def test_the_raters_scale_is_validated():
    with pytest.raises(ValueError, match="topics the corpus lacks: \\['astrology'\\]"):
        ExperimentConfig(schedule=SCHEDULE, rollouts_per_arm=6, rater_scale={"astrology": 2.0})
    with pytest.raises(ValueError, match="factors must be in"):
        ExperimentConfig(schedule=SCHEDULE, rollouts_per_arm=6, rater_scale={"cooking": 0.0})
    with pytest.raises(ValueError, match="rater_offset names topics the corpus lacks"):
        ExperimentConfig(schedule=SCHEDULE, rollouts_per_arm=6, rater_offset={"astrology": 0.5})
    with pytest.raises(ValueError, match="shifts must be within"):
        ExperimentConfig(schedule=SCHEDULE, rollouts_per_arm=6, rater_offset={"cooking": -11.0})


def test_raters_whose_rewards_leave_the_reward_range_are_refused_when_the_simulation_starts():
    """drift.yaml's range is [0, 1]; a topic rated 1.5 times gave its good answers rewards above it, which the
    learner dead-letters: the topic kept only its poor answers' rewards, and the experiment ran on. A topic
    not named gets the judge's own 0..1; a learner that runs no experiment may narrow its range."""
    from apps.config import load_app_config
    from apps.config_checks import check_raters_fit_the_reward_range
    from online_sao.config import ConfigError

    def loaded(low=0.0, high=1.0, **experiment):
        overrides = {"reward.min_value": low, "reward.max_value": high}
        overrides.update({f"experiment.{key}": value for key, value in experiment.items()})
        return load_app_config(environ={}, overrides=overrides)

    check_raters_fit_the_reward_range(loaded(rater_scale={"cooking": 0.5}, rater_offset={"cooking": 0.5}))
    with pytest.raises(ConfigError, match=r"raters of topic 'cooking' give rewards in \[0, 1.5\] .*\[0, 1\]"):
        check_raters_fit_the_reward_range(loaded(rater_scale={"cooking": 1.5}))
    with pytest.raises(ConfigError, match=r"raters of topic 'tech' give rewards in \[-0.25, 0.75\]"):
        check_raters_fit_the_reward_range(loaded(rater_offset={"tech": -0.25}))
    narrow = loaded(high=0.5, rater_scale={"cooking": 0.4})  # loads: a learner alone may narrow it
    with pytest.raises(ConfigError, match=r"give rewards in \[0, 1\] \(the judge's 0..1 x 1 \+0\)"):
        check_raters_fit_the_reward_range(narrow)  # every other topic rates 0..1


class FlakyBackend:
    """The in-memory backend whose producer refuses the first ``failures`` sends, as Kafka
    does while the broker is down."""

    def __init__(self, backend: InMemoryBackend, failures: int):
        self.backend, self.failures = backend, failures

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def producer(self):
        real, outer = self.backend.producer(), self

        class Producer:
            def send(self, *args, **kwargs):
                if outer.failures > 0:
                    outer.failures -= 1
                    raise StreamUnavailable("broker down (test)")
                return real.send(*args, **kwargs)

            def __getattr__(self, name):
                return getattr(real, name)

        return Producer()


def _judge_until_rewarded(cfg, judged_backend, backend: InMemoryBackend, count: int, progress) -> list:
    """Run the judge on ``judged_backend`` in a thread until ``count`` rewards are on the topic (10 s
    at most), stop it, and return the rewards sent."""
    stop = threading.Event()
    worker = threading.Thread(target=run_judge, args=(cfg, FixedJudge(), stop),
                              kwargs={"backend": judged_backend, "progress": progress})
    worker.start()
    deadline = time.monotonic() + 10
    while len(drain_memory(backend, cfg.kafka.topics.rewards)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    worker.join(10)
    return drain_memory(backend, cfg.kafka.topics.rewards)


def test_judge_keeps_running_through_an_outage_and_sends_every_reward(tmp_path, monkeypatch):
    import apps.experiments.judge_service as judge_service

    monkeypatch.setattr(judge_service, "RETRY_S", 0.01)
    backend, cfg, producer = memory_setup()
    interactions = [chat_interaction(*qa) for qa in ANSWERS[:3]]
    for interaction in interactions:
        publish(producer, cfg.kafka.topics.interactions, interaction)
    flaky = FlakyBackend(backend, failures=2)
    rewards = _judge_until_rewarded(cfg, flaky, backend, 3, progress=lambda _: None)
    assert flaky.failures == 0  # the outage happened
    assert sorted(r.interaction_id for r in rewards) == sorted(i.interaction_id for i in interactions)


class DownAtStartBackend:
    """The in-memory backend refusing the first ``failures`` consumers, as Kafka does when the
    judge starts before the broker."""

    def __init__(self, backend: InMemoryBackend, failures: int):
        self.backend, self.failures = backend, failures

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def consumer(self, *args, **kwargs):
        if self.failures > 0:
            self.failures -= 1
            raise StreamUnavailable("no broker yet (test)")
        return self.backend.consumer(*args, **kwargs)


def test_a_judge_started_before_the_broker_waits_for_it_and_says_so_once(tmp_path, monkeypatch):
    monkeypatch.setattr("streams.broker_wait.BROKER_RETRY_S", 0.01)
    backend, cfg, producer = memory_setup()
    interactions = [chat_interaction(*qa) for qa in ANSWERS[:2]]
    for interaction in interactions:
        publish(producer, cfg.kafka.topics.interactions, interaction)
    lines = []
    down = DownAtStartBackend(backend, failures=5)
    rewards = _judge_until_rewarded(cfg, down, backend, 2, progress=lines.append)
    assert down.failures == 0
    assert sorted(r.interaction_id for r in rewards) == sorted(i.interaction_id for i in interactions)
    assert sum("waiting for it" in line for line in lines) == 1


def test_a_judge_stopped_while_waiting_for_the_broker_returns_without_judging(monkeypatch):
    monkeypatch.setattr("streams.broker_wait.BROKER_RETRY_S", 0.01)
    backend, cfg, _ = memory_setup()
    stop, lines = threading.Event(), []
    stop.set()
    counters = run_judge(cfg, FixedJudge(), stop, backend=DownAtStartBackend(backend, failures=10**6),
                         progress=lines.append)
    assert counters.scored == 0
    assert lines[-1] == "judge: stopped before the broker came up; nothing judged"


SEGMENTS = [{"name": "early", "share": 1.0, "schedule": [{"from_rollout": 0, "style": "formal"}]}]


def test_an_interaction_of_no_known_segment_is_dead_lettered_and_the_judge_goes_on(tmp_path):
    """With segments, a record whose ``user_id`` is missing or names no segment (another client of the
    same serving) made the scorer raise: the judge died on it, and having marked it read committed
    past it on the way out, so it was neither judged nor dead-lettered."""
    backend = InMemoryBackend(KafkaConfig(partitions=1))  # one partition: offsets follow send order
    backend.ensure_topics()
    cfg = experiment_config(backend.cfg, reward_delay_s=0.0, segments=SEGMENTS)
    producer = backend.producer()
    good, stranger, anonymous, redacted, after = (
        chat_interaction(*ANSWERS[k], user_id=user, completed_at=1000.0)
        for k, user in enumerate(["early", "someone-else", None, "early", "early"]))
    redacted = redacted.model_copy(update={"prompt_text": None, "response_text": None})  # and no tokenizer
    for interaction in (good, stranger, anonymous, redacted, after):
        publish(producer, cfg.kafka.topics.interactions, interaction)
    results = tmp_path / "arm.jsonl"
    service = JudgeService(cfg, FixedJudge(), backend, results_path=results, clock=lambda: 2000.0)
    service.step()
    service.close()
    assert (service.counters.scored, service.counters.dead_letters, service.counters.sent) == (2, 3, 2)
    assert [r.interaction_id for r in read_arm(results).rewards] == [good.interaction_id, after.interaction_id]
    assert [r.rollout for r in read_arm(results).rewards] == [0, 1]  # a dead letter takes no rollout
    letters = drain_memory(backend, cfg.kafka.topics.dead_letters)
    assert [decode(letter.raw, Interaction).interaction_id for letter in letters] == [
        stranger.interaction_id, anonymous.interaction_id, redacted.interaction_id]
    assert "unknown user segment 'someone-else'" in letters[0].reason and "names no user segment" in letters[1].reason
    assert "no text" in letters[2].reason
    again = JudgeService(cfg, FixedJudge(), backend, results_path=results, clock=lambda: 2000.0)
    again.step()  # everything was handled and committed: nothing comes again
    assert again.counters == type(again.counters)()
    again.close()


def test_a_record_whose_handling_failed_is_read_again_not_committed_past(tmp_path):
    """The dead letter of an unreadable record could not be sent (broker down): the step raised with
    the record and the one after it read, run_judge retried, and the next poll started after them:
    neither was handled, and the next commit went past both."""
    backend = InMemoryBackend(KafkaConfig(partitions=1))
    backend.ensure_topics()
    cfg = experiment_config(backend.cfg, reward_delay_s=0.0)
    producer = backend.producer()
    producer.send(cfg.kafka.topics.interactions, b"not a record", key=b"bad")
    good = chat_interaction(*ANSWERS[0], completed_at=1000.0)
    publish(producer, cfg.kafka.topics.interactions, good)
    results = tmp_path / "arm.jsonl"
    service = JudgeService(cfg, FixedJudge(), FlakyBackend(backend, failures=1), results_path=results,
                           clock=lambda: 2000.0)
    with pytest.raises(StreamUnavailable):
        service.step()  # the dead letter's send is refused
    service.step()  # as run_judge retries after an outage
    service.close()
    assert (service.counters.dead_letters, service.counters.scored, service.counters.sent) == (1, 1, 1)
    assert [r.raw for r in drain_memory(backend, cfg.kafka.topics.dead_letters)] == [b"not a record"]
    assert [r.interaction_id for r in drain_memory(backend, cfg.kafka.topics.rewards)] == [good.interaction_id]
