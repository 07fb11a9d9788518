"""``online-sao judge``: a reward service that scores interactions and sends rewards.

It consumes the interactions topic in consumer group ``experiment.judge_group``,
skips evaluation requests (``session_id == experiment.eval_session_id``), scores
each answer with a :class:`~apps.experiments.judge.Judge` against the style
the schedule prefers (with ``experiment.segments``: the schedule of the segment named by the
record's ``user_id``, the OpenAI ``user`` field the simulated users send), and sends a Reward (source ``judge``) to the rewards topic
``experiment.reward_delay_s`` after the interaction completed; a seeded share
``experiment.drop_rate`` of rewards is withheld. Unreadable records go to the dead
letter topic, and so do interactions it cannot judge (:class:`Unjudgeable`: with segments, a
``user_id`` that is empty or names no segment; a record with no text and no tokenizer): one
stranger on the topic costs its own record, not the judge.

The schedule's clock is the count of rollouts this judge has scored. Rollouts,
unlike wall time, make arms of different speed meet the same preference at the
same point of their training. Offsets are committed once every reward of the
records before them was sent (or dropped), so a judge stopped with rewards still
pending reads those interactions again after a restart. Each interaction is judged
exactly once all the same: the results file is the judge's memory. A restarted
judge reads its rows back (the schedule's clock continues from their count, the
seeded drop decisions from the same point) and an interaction that already has a
row is not judged again: its recorded reward is sent (if it was not dropped) when
due, with no new row and no new rollout index. A reward sent just before a crash,
whose offset was not yet committed, is sent again once (the same value); within
one process an interaction's reward is sent once, also when the topic holds a copy
of the interaction.
"""

from __future__ import annotations

import heapq
import logging
import random
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from apps.config import AppConfig
from apps.experiments.judge import Judge, QualityStyleJudge, Raters
from apps.experiments.results import RewardRow, append_row, read_reward_rows
from online_sao.schemas import Interaction, Reward, encode
from streams.base import GroupMembershipLost, StreamBackend, StreamMessage, StreamUnavailable, TopicPartition
from streams.broker_wait import until_broker_takes
from streams.records import dead_letter_for, dead_letter_key, decode_or_dead_letter, publish

log = logging.getLogger(__name__)

SOURCE = "judge"
POLL_TIMEOUT_S = 0.5
"""Longest wait of one poll; bounds how late a stop request or a due reward is noticed."""
COMMIT_EVERY_S = 1.0
"""Offsets are committed at most this often (each commit is a broker round trip)."""
_SPECIAL = re.compile(r"<\|[A-Za-z0-9_]+\|>")
_LAST_USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)


class Unjudgeable(ValueError):
    """An interaction the judge cannot score as it is (what it lacks is in the message); the
    judge service dead-letters its record and goes on."""


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def interaction_texts(interaction: Interaction, tokenizer: Detokenizer | None) -> tuple[str, str]:
    """(the last user message, the answer) of an interaction, special tokens removed.

    Uses the logged text; a redacted record (no text) is decoded with ``tokenizer``.
    A prompt without a ChatML user turn (the completions API) is used whole.
    """
    prompt, response = interaction.prompt_text, interaction.response_text
    if prompt is None or response is None:
        if tokenizer is None:
            raise Unjudgeable(f"interaction {interaction.interaction_id} carries no text and no tokenizer was given")
        prompt = tokenizer.decode(interaction.prompt_ids, skip_special_tokens=False)
        response = tokenizer.decode(interaction.response_ids, skip_special_tokens=False)
    turns = _LAST_USER_TURN.findall(prompt)
    user = turns[-1] if turns else prompt
    return _SPECIAL.sub("", user).strip(), _SPECIAL.sub("", response).strip()


@dataclass
class JudgeCounters:
    scored: int = 0
    sent: int = 0
    dropped: int = 0
    skipped: int = 0
    dead_letters: int = 0
    resumed: int = 0
    """Interactions read again that were judged already (before a restart, or a copy on the topic)."""


@dataclass(order=True)
class _Pending:
    due: float
    seq: int
    tp: TopicPartition = field(compare=False)
    offset: int = field(compare=False)
    reward: Reward = field(compare=False)


class ScheduleJudge:
    """The judge's work that needs no broker: the schedule's clock (rollouts judged so far), the
    seeded drops, the results file and the memory of what was judged. :class:`JudgeService` runs
    it on Kafka; the in-process driver (experiments/inprocess.py) calls it directly, so both
    score, drop and record alike."""

    def __init__(self, cfg: AppConfig, judge: Judge, tokenizer: Detokenizer | None = None,
                 results_path: Path | None = None, clock: Callable[[], float] = time.time) -> None:
        self.exp = cfg.experiment
        self.judge = judge
        self.tokenizer = tokenizer
        self.results_path = results_path
        self.clock = clock
        self.raters = Raters(self.exp.rater_scale, self.exp.rater_offset)
        rows = read_reward_rows(results_path) if results_path is not None else []
        self.rollout = len(rows)
        self.judged: dict[str, RewardRow] = {r.interaction_id: r for r in rows if r.interaction_id is not None}
        """Every interaction judged so far, by id: its row says what was decided."""
        # a stream of its own: seeded as the arrival gaps (scenario.arrival_gaps), the k-th draw made
        # both, and exactly the requests that came soonest after another lost their rewards
        self._rng = random.Random(f"drops-{self.exp.seed}")
        for _ in range(self.rollout):  # the same drop decisions as an uninterrupted run
            self._rng.random()

    def segment_of(self, interaction: Interaction) -> str | None:
        """The user segment of ``interaction``: its ``user_id`` when the scenario has segments
        (a record without one, or with a name the scenario lacks, raises :class:`Unjudgeable`: the
        simulated users always send one), else None."""
        if not self.exp.segments:
            return None
        if interaction.user_id is None:
            raise Unjudgeable(f"interaction {interaction.interaction_id} names no user segment (user_id is empty)")
        names = [s.name for s in self.exp.segments]
        if interaction.user_id not in names:
            raise Unjudgeable(f"interaction {interaction.interaction_id}: unknown user segment "
                              f"{interaction.user_id!r}; the scenario has {names}")
        return interaction.user_id

    def score(self, interaction: Interaction) -> RewardRow:
        """Judge an interaction not judged before: its row (recorded), the next rollout index.
        :class:`Unjudgeable` is raised before anything is recorded or drawn."""
        segment = self.segment_of(interaction)
        preferred = self.exp.preferred_style(self.rollout, segment)
        prompt, answer = interaction_texts(interaction, self.tokenizer)
        score = self.judge.score(prompt, answer, preferred)
        rating = self.raters.rate(prompt, score.value)
        deliver = self._rng.random() >= self.exp.drop_rate
        row = RewardRow(rollout=self.rollout, t=self.clock(), version=interaction.policy_version, reward=rating.reward,
                        rater_scale=rating.scale, rater_offset=rating.offset, quality=score.quality, style=score.style,
                        preferred=preferred, delivered=deliver, interaction_id=interaction.interaction_id,
                        sampled_style=score.sampled_style, segment=segment)
        if self.results_path is not None:
            append_row(self.results_path, row)
        self.judged[interaction.interaction_id] = row
        self.rollout += 1
        return row


class JudgeService:
    """The loop of ``run_judge``; one ``step`` polls once, scores, sends due rewards, commits."""

    def __init__(self, cfg: AppConfig, judge: Judge, backend: StreamBackend, tokenizer: Detokenizer | None = None,
                 results_path: Path | None = None, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.exp = cfg.experiment
        self.topics = cfg.kafka.topics
        self.clock = clock
        self.scorer = ScheduleJudge(cfg, judge, tokenizer, results_path, clock)
        self.counters = JudgeCounters()
        self._rewarded: set[str] = set()
        """Interactions whose reward this process has scheduled (sent or pending)."""
        self._pending: list[_Pending] = []
        self._seq = 0
        self._read: dict[TopicPartition, int] = {}
        self._last_commit = 0.0
        self.consumer = backend.consumer([self.topics.interactions], group_id=self.exp.judge_group, start="earliest")
        try:
            self.producer = backend.producer()
        except BaseException:  # the broker went away between the two: the caller retries both
            self.consumer.close()
            raise

    @property
    def rollout(self) -> int:
        """Rollouts judged so far (the schedule's clock)."""
        return self.scorer.rollout

    def step(self) -> None:
        now = self.clock()
        wait = POLL_TIMEOUT_S if not self._pending else min(POLL_TIMEOUT_S, max(0.0, self._pending[0].due - now))
        messages = self.consumer.poll(timeout_s=wait)
        for i, message in enumerate(messages):
            try:
                self._handle(message)
            except BaseException:  # an outage (retried) or a bug: read again from here, never committed past
                self._rewind(messages[i:])
                raise
            self._read[message.tp] = message.offset + 1  # read only once handled
        self._send_due()
        self._commit()

    def _rewind(self, unhandled: list[StreamMessage]) -> None:
        """Put each partition back at its first record of ``unhandled``: the step that failed on
        them is retried after an outage (run_judge), and the consumer had read past them."""
        first: dict[TopicPartition, int] = {}
        for message in unhandled:
            first.setdefault(message.tp, message.offset)
        for tp, offset in first.items():
            self.consumer.seek(tp, offset)

    def _handle(self, message: StreamMessage) -> None:
        interaction = decode_or_dead_letter(message, Interaction, self.producer, self.topics.dead_letters)
        if interaction is None:
            self.counters.dead_letters += 1
        elif interaction.session_id == self.exp.eval_session_id:
            self.counters.skipped += 1
        elif interaction.interaction_id in self.scorer.judged:
            self.counters.resumed += 1
            self._schedule(self.scorer.judged[interaction.interaction_id], interaction, message.tp, message.offset)
        else:
            try:
                self._score(interaction, message.tp, message.offset)
            except Unjudgeable as exc:  # this record's fault: it goes aside, the judge goes on
                self._dead_letter(message, f"not judged: {exc}")

    def _dead_letter(self, message: StreamMessage, reason: str) -> None:
        """Send ``message`` to the dead-letter topic, as decode_or_dead_letter does for unreadable ones."""
        log.warning("judge: dead-lettered %s[%d]@%d: %s", message.topic, message.partition, message.offset, reason)
        self.producer.send(self.topics.dead_letters, encode(dead_letter_for(message, reason)),
                           key=dead_letter_key(message.key))
        self.counters.dead_letters += 1

    def _score(self, interaction: Interaction, tp: TopicPartition, offset: int) -> None:
        row = self.scorer.score(interaction)
        self.counters.scored += 1
        if not row.delivered:
            self.counters.dropped += 1
        self._schedule(row, interaction, tp, offset)

    def _schedule(self, row: RewardRow, interaction: Interaction, tp: TopicPartition, offset: int) -> None:
        """Queue the reward ``row`` decided on, due ``reward_delay_s`` after the interaction."""
        if not row.delivered or interaction.interaction_id in self._rewarded:
            return
        self._rewarded.add(interaction.interaction_id)
        reward = Reward(interaction_id=interaction.interaction_id, value=row.reward, source=SOURCE,
                            scores=row.scores())
        due = interaction.completed_at + self.exp.reward_delay_s
        heapq.heappush(self._pending, _Pending(due, self._seq, tp, offset, reward))
        self._seq += 1

    def _send_due(self) -> None:
        now = self.clock()
        while self._pending and self._pending[0].due <= now:
            item = self._pending[0]  # popped only once handed to the producer: a failed send is retried
            publish(self.producer, self.topics.rewards, item.reward.model_copy(update={"created_at": now}))
            heapq.heappop(self._pending)
            self.counters.sent += 1

    def _commit(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self._read or (not force and now - self._last_commit < COMMIT_EVERY_S):
            return
        offsets = dict(self._read)
        for item in self._pending:  # nothing at or after a reward still waiting is committed
            offsets[item.tp] = min(offsets[item.tp], item.offset)
        self.producer.flush()
        try:
            self.consumer.commit(offsets)
        except GroupMembershipLost as exc:  # a step outlasted the poll interval: the next poll rejoins
            # and gets these records again, which are neither judged nor rewarded twice; a later commit covers them
            log.warning("judge: offsets not committed (%s); committing after the next poll", exc)
            return
        self._last_commit = now

    def close(self) -> None:
        """Commit what was sent; rewards not yet due are left for a restarted judge."""
        try:
            self._commit(force=True)
        finally:
            self.producer.close()
            self.consumer.close()


RETRY_S = 2.0
"""Pause before the judge tries the broker again after it was unreachable."""


def run_judge(cfg: AppConfig, judge: Judge, stop_event: threading.Event, backend: StreamBackend | None = None,
              tokenizer: Detokenizer | None = None, results_path: Path | None = None,
              progress: Callable[[str], None] = print, progress_every: int = 50) -> JudgeCounters:
    """Judge interactions until ``stop_event`` is set; returns what was done."""
    if backend is None:
        from streams.kafka_backend import KafkaBackend

        backend = KafkaBackend(cfg.kafka)
    try:  # a broker down at start: wait for it, as the learner and serving do
        service = until_broker_takes(lambda: JudgeService(cfg, judge, backend, tokenizer, results_path),
                                     "judge: connecting to Kafka", stop_event, notify=progress)
    except StreamUnavailable:
        if not stop_event.is_set():
            raise
        progress("judge: stopped before the broker came up; nothing judged")
        return JudgeCounters()
    reported = service.counters.scored
    try:
        while not stop_event.is_set():
            try:
                service.step()
            except StreamUnavailable as exc:  # the broker comes back; a long-running judge waits for it
                progress(f"judge: Kafka unavailable ({exc}); retrying in {RETRY_S:.0f} s")
                stop_event.wait(RETRY_S)
                continue
            if service.counters.scored - reported >= progress_every:
                reported = service.counters.scored
                c = service.counters
                progress(f"judge: {c.scored} scored, {c.sent} rewards sent, {c.dropped} dropped, "
                         f"{c.skipped} eval skipped, {c.dead_letters} dead letters; rollout {service.rollout} "
                         f"prefers {cfg.experiment.preferred_style(service.rollout)}")
    finally:
        service.close()
    return service.counters


class LazyTokenizer:
    """Loads the model's tokenizer on first use (only redacted records need it)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._tokenizer: Detokenizer | None = None

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def run_judge_cli(cfg: AppConfig, arm: str | None = None) -> int:
    """``online-sao judge [--arm NAME]``: run until SIGINT/SIGTERM; results go to
    ``<results_dir>/<arm>.jsonl`` (``judge.jsonl`` without an arm)."""
    from apps.experiments.scenario import results_dir
    from apps.experiments.style import load_or_train

    out = results_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    progress = lambda line: print(line, flush=True)  # noqa: E731
    judge = QualityStyleJudge(load_or_train(cfg, progress))
    counters = run_judge(cfg, judge, stop, tokenizer=LazyTokenizer(cfg.model_dir),
                         results_path=out / f"{arm or 'judge'}.jsonl", progress=progress)
    progress(f"judge stopped: {counters}")
    return 0
