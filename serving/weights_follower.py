"""Follows the weights topic and hot-swaps the engine to the newest published version.

A background thread reads the (compacted) weights topic without a consumer
group, from the earliest offset: a server that starts or restarts replays the
notices and converges on the version the topic says is current, and several
servers following the same topic converge on the same one.

Notices of one poll are applied as if in order, but only the one whose effect
would last is loaded: ``publish`` counts when it is newer than what the notices
before it left in place; ``rollback`` forces its version (older or not) and
makes the publishes after it forced as well. If the lasting one cannot be
loaded (file missing, checksum or finiteness failed, refused by the engine),
the next one back is tried, which is where processing the notices one by one
would also have ended. Every attempt is reported to ``on_result`` and logged;
the serving weights stay until a version is applied.

``champion`` notices (the registry's new champion) move no serving version: with a canary
(:class:`~serving.engine.canary.CanaryEngine`) the newest of a poll is loaded into its champion
engine; without one they are ignored. The registry sends one per promotion, so a champion that
cannot be loaded or swapped in (a store's transient error) stays pending and is tried again on later
polls, after :data:`CHAMPION_RETRY_S` doubling up to :data:`CHAMPION_RETRY_MAX_S`, until it is
applied, a later champion notice replaces it, or the engine refuses its weights. An operator's
``hold`` and ``release`` notices (:mod:`serving.weights_hold`) pin the serving version until
released; a canary's champion answers nothing meanwhile.

The follower has *caught up* (:attr:`WeightsFollower.caught_up`) once its first pass read the topic
up to the end offsets it had when the follower connected, the notice whose effect lasts among them
was applied (or every one behind it failed to load) and no champion waits for a retry: the app's
readiness waits for it (``serving.weights_catch_up_s``), so a restarted replica takes no traffic
with the weights of ``model.path`` while the topic names a newer version. With the broker
unreachable it cannot catch up: the weight store alone does not say which of its versions is in
force (a rolled-back version's file stays in the store, whether a hold is in force only the topic
says, a version saved by a learner killed before its notice was never published), and a notice's
checksum is what vouches for a file's bytes, so the follower loads nothing from the store on its own.

With ``model_name`` set, notices for other models are ignored (a topic may carry several models'
notices), each other name warned about once and named in :attr:`WeightsFollower.catch_up_state`:
a ``serving.model_name`` that is not the learner's leaves the server on ``model.path``'s weights.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from online_sao.schemas import RecordError, WeightsNotice, decode
from online_sao.weights import CorruptWeights, WeightStore
from serving.engine.base import InferenceEngine, SwapResult
from serving.engine.canary import ChampionServing
from serving.weights_hold import HoldState
from streams.base import Consumer, Producer, StreamBackend, StreamUnavailable, TopicPartition
from streams.broker_wait import until_broker_takes
from streams.records import decode_or_dead_letter

log = logging.getLogger(__name__)

RETRY_S = 2.0
"""Wait before reconnecting after the stream backend was unreachable."""
UNREACHABLE_LOG_EVERY_S = 60.0
"""During an outage (or while the topic is missing), the warning is logged on the first failed try
and then once per this many seconds, not on every try."""
CHAMPION_RETRY_S = 2.0
"""Wait before trying again a champion that could not be loaded; doubled after each failed try."""
CHAMPION_RETRY_MAX_S = 60.0
"""The longest wait between two tries of a pending champion."""
OTHER_MODELS_NOTE = "; notices ignored for other models (serving.model_name must match the learner's): "
"""How :attr:`WeightsFollower.catch_up_state` names the other models whose notices it ignored."""
EXPECTED_LOAD_ERRORS = (FileNotFoundError, CorruptWeights, OSError, ValueError, ImportError)
"""What a weight store raises for a version it cannot give (a missing or corrupt file, a location it
cannot parse, an fsspec protocol whose package is not installed): logged in a line. Anything else a
load raises is that version's failure too (fsspec's backends raise errors of their own), logged with
its traceback, as it may be a bug in the store."""


class WeightsFollower:
    """Thread that keeps ``engine`` on the newest version announced on ``topic``."""

    def __init__(self, backend: StreamBackend, topic: str, store: WeightStore, engine: InferenceEngine,
                 on_result: Callable[[SwapResult], None] | None = None, model_name: str | None = None,
                 dead_letters: tuple[Producer, str] | None = None, poll_timeout_s: float = 0.5):
        """``model_name`` ignores notices for other models; ``dead_letters`` (producer,
        topic) receives unreadable records (by default they are logged and skipped)."""
        self.backend, self.topic, self.store, self.engine = backend, topic, store, engine
        self.on_result = on_result
        self.model_name = model_name
        self.dead_letters = dead_letters
        self.poll_timeout_s = poll_timeout_s
        self.consumed = 0
        """Records read from the topic so far (readable or not)."""
        self.last_result: SwapResult | None = None
        self.last_champion_result: SwapResult | None = None
        """The canary's last champion load (None: no champion notice was acted on)."""
        self._champion_pending: WeightsNotice | None = None
        """The newest champion notice not yet applied (its load or swap failed): tried again when due."""
        self._champion_wait_s = CHAMPION_RETRY_S
        self._champion_due = 0.0
        """When (``time.monotonic``) the pending champion is tried next."""
        self.holds = HoldState(replaying=True)
        """The learner's notices followed, or an operator's hold (``holds.held_version``); replaying the
        topic until the first pass is done."""
        self._catch_up_ends: dict[TopicPartition, int] | None = None
        """The topic's end offsets when the consumer connected: the first pass ends there."""
        self._outage: tuple[float, float] | None = None
        """(since, last warned), ``time.monotonic``, while the backend is unreachable."""
        self._caught_up = threading.Event()
        self.other_models: frozenset[str] = frozenset()
        """Model names of notices ignored as not ``model_name``'s (each warned about once); replaced
        whole, not changed in place, as the app's thread reads it."""
        self._catch_up_reason = "connecting to the weights topic"
        self._progress = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="weights-follower", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop after the current poll (and any swap in progress) and join."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        self._thread = None

    @property
    def catch_up_state(self) -> str:
        """What the first pass waits for (the topic unreachable, notices left to read, a champion to
        load), or the version it caught up on, then the other models whose notices were ignored: for
        the readiness probe's reason and the app's log."""
        note = self.other_models_note
        return self._catch_up_reason if note is None else f"{self._catch_up_reason}; {note}"

    @property
    def other_models_note(self) -> str | None:
        """The other models whose notices were ignored, said as ``/readyz`` says it (None: none)."""
        if not self.other_models:
            return None
        return f"{OTHER_MODELS_NOTE.removeprefix('; ')}{', '.join(sorted(self.other_models))}"

    @property
    def caught_up(self) -> bool:
        """Whether the first pass is done (see the module): the engine serves what the topic said
        was in force when the follower connected, or the best of it that loads. Stays True."""
        return self._caught_up.is_set()

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Block until ``predicate()`` holds after some processed poll (or the timeout)."""
        with self._progress:
            return self._progress.wait_for(predicate, timeout_s)

    # ---- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        consumer: Consumer | None = None
        try:
            while not self._stop.is_set():
                try:
                    if consumer is None:
                        consumer = self.backend.consumer([self.topic], group_id=None, start="earliest")
                    if self._catch_up_ends is None:
                        self._catch_up_ends = consumer.end_offsets()
                    messages = consumer.poll(self.poll_timeout_s)
                except StreamUnavailable as exc:
                    self._unreachable(exc)
                    continue
                if self._outage is not None:
                    log.info("weights topic %s reachable again after %.0f s", self.topic,
                             time.monotonic() - self._outage[0])
                    self._outage = None
                try:
                    notices = [n for n in map(self._read, messages) if n is not None]
                except StreamUnavailable:  # only once stopping: _read waits out an outage until then
                    break
                if notices:
                    self._apply(notices)
                self._retry_champion()
                if not self._caught_up.is_set() and not self._stop.is_set():  # a stop may cut _apply short
                    self._check_caught_up(consumer)
                with self._progress:
                    self.consumed += len(messages)
                    self._progress.notify_all()
        finally:
            if consumer is not None:
                consumer.close()

    def _unreachable(self, exc: StreamUnavailable) -> None:
        self._behind(f"the weights topic is unreachable ({exc})")
        now = time.monotonic()
        since, warned = self._outage or (now, None)
        if warned is None or now - warned >= UNREACHABLE_LOG_EVERY_S:
            still = f" for {now - since:.0f} s" if warned is not None else ""
            log.warning("weights topic %s unreachable%s (%s); retrying every %.0f s", self.topic, still, exc, RETRY_S)
            warned = now
        self._outage = (since, warned)
        self._stop.wait(RETRY_S)

    def _behind(self, why: str) -> None:
        if not self._caught_up.is_set():
            self._catch_up_reason = why

    def _check_caught_up(self, consumer: Consumer) -> None:
        """Mark the first pass done once the consumer stands at the end offsets read when it
        connected (the notices read up to there are applied: this runs after the poll's notices
        were). A canary's champion whose load failed does not hold it: it is retried meanwhile, the
        newest version answering the canary's share (a champion whose file was gone kept every
        replica start unready for the whole of ``serving.weights_catch_up_s``)."""
        try:
            left = sum(max(0, end - consumer.position(tp)) for tp, end in self._catch_up_ends.items())
        except StreamUnavailable as exc:  # Kafka's position, when it does not know it, asks the broker
            self._behind(f"the weights topic's position is not known ({exc})")
            return
        if left:
            self._behind(f"{left} weights topic offsets left to read before where it ended at start")
            return
        self._catch_up_reason = f"caught up on v{self.engine.policy_version}"
        if self._champion_pending is not None:
            self._catch_up_reason += f" (champion v{self._champion_pending.version} not loaded: tried again)"
        self._caught_up.set()
        log.info("weights topic %s read to where it ended at start: %s", self.topic, self.catch_up_state)
        self.holds.end_replay()  # the hold the topic's history ends in, once (not each hold and release in it)

    def _read(self, message) -> WeightsNotice | None:
        if self.dead_letters is not None:
            producer, topic = self.dead_letters
            # a dead letter the broker does not take now is retried: an exception here would end the thread
            notice = until_broker_takes(lambda: decode_or_dead_letter(message, WeightsNotice, producer, topic),
                                        f"dead-lettering the weights notice at {message.topic}[{message.partition}]"
                                        f"@{message.offset}", self._stop)
            if notice is None:
                log.warning("unreadable weights notice at %s[%d]@%d sent to %s", message.topic,
                            message.partition, message.offset, topic)
        else:
            try:
                notice = decode(message.value, WeightsNotice)
            except RecordError as exc:
                log.warning("skipping unreadable weights notice at %s[%d]@%d: %s", message.topic,
                            message.partition, message.offset, exc)
                return None
        if notice is not None and self.model_name is not None and notice.model != self.model_name:
            self._note_other_model(notice.model)
            return None
        return notice

    def _note_other_model(self, model: str) -> None:
        """Warn once per other model name: a topic may carry several models' notices, but a renamed
        ``serving.model_name`` (or the learner's) leaves this server on its weights for good, silently."""
        if model in self.other_models:
            return
        self.other_models = self.other_models | {model}
        log.warning("weights notices for model %r ignored: this server follows %r (serving.model_name), and "
                    "the learner names its notices with its own serving.model_name: the two must be the same "
                    "for the learner's weights to be served", model, self.model_name)

    def _apply(self, notices: list[WeightsNotice]) -> None:
        champions = [n for n in notices if n.action == "champion"]
        if champions:
            self._champion_pending = champions[-1]  # the registry's newest word replaces any pending one
            self._champion_wait_s = CHAMPION_RETRY_S
            self._champion_due = 0.0
            self._retry_champion()
        notices = [n for n in notices if n.action != "champion"]
        if not notices:
            return
        chain = self.holds.take(notices, self.engine.policy_version)
        if isinstance(self.engine, ChampionServing):
            self.engine.hold_all_on_newest(self.holds.hold is not None)
        if not chain and self.holds.hold is None:
            log.info("weights notices for versions %s ignored: serving version %d is newer",
                     [n.version for n in notices], self.engine.policy_version)
        for notice, force in chain:
            if self._stop.is_set():
                return
            result = self._try(notice, force)
            self.last_result = result
            if self.on_result is not None:
                self.on_result(result)
            if result.applied:
                self.holds.applied(notice)
                return

    def _retry_champion(self) -> None:
        """Try the pending champion notice if its time has come; keep it pending (with a longer wait,
        up to :data:`CHAMPION_RETRY_MAX_S`) when it fails again."""
        notice = self._champion_pending
        if notice is None or self._stop.is_set() or time.monotonic() < self._champion_due:
            return
        if self._apply_champion(notice):
            self._champion_pending = None
            return
        self._champion_due = time.monotonic() + self._champion_wait_s
        log.warning("champion v%d will be tried again in %.0fs", notice.version, self._champion_wait_s)
        self._champion_wait_s = min(2 * self._champion_wait_s, CHAMPION_RETRY_MAX_S)

    def _apply_champion(self, notice: WeightsNotice) -> bool:
        """Load the newest champion into the canary's champion engine (if the engine has one).
        False: it may load on another try (the store or the swap failed); True: it is done with
        (applied, already held, refused by the engine or by its checksum, or there is no canary)."""
        if not isinstance(self.engine, ChampionServing) or self.engine.champion_version == notice.version:
            return True
        start = time.perf_counter()
        try:
            state = self.store.load(notice.location, notice.checksum)
        except Exception as exc:  # as in _try
            reason = f"cannot load champion v{notice.version} from {notice.location}: {exc!r}"
            _log_load_failure(exc, "%s; the canary keeps v%s", reason, self.engine.champion_version)
            self.last_champion_result = SwapResult(notice.version, False, time.perf_counter() - start, 0.0, reason)
            # bytes that fail their checksum (renamed into place whole) stay so: not read again every minute
            return isinstance(exc, CorruptWeights)
        try:
            result = self.engine.swap_champion(notice.version, state)
        except Exception as exc:  # as in _try: one notice must not end the thread (an out-of-memory spare copy)
            reason = f"swapping in champion v{notice.version} failed: {exc!r}"
            log.exception("%s; the canary keeps v%s", reason, self.engine.champion_version)
            self.last_champion_result = SwapResult(notice.version, False, time.perf_counter() - start, 0.0, reason)
            return False
        if not result.applied:  # the engine judged the weights themselves (not finite, wrong shapes): final
            log.warning("champion v%d refused: %s", notice.version, result.reason)
        self.last_champion_result = SwapResult(result.version, result.applied,
                                               time.perf_counter() - start, result.stall_s, result.reason)
        return True

    def _try(self, notice: WeightsNotice, force: bool) -> SwapResult:
        start = time.perf_counter()
        try:
            state = self.store.load(notice.location, notice.checksum)
        except Exception as exc:  # one notice must not end the thread: a missing or corrupt file, and
            # whatever fsspec raises for a location it cannot open (tarfile.ReadError, TypeError, an
            # HTTP client's connection error) are the version's failure, not the follower's
            reason = f"cannot load version {notice.version} from {notice.location}: {exc!r}"
            _log_load_failure(exc, "%s; keeping version %d", reason, self.engine.policy_version)
            return SwapResult(notice.version, False, time.perf_counter() - start, 0.0, reason=reason)
        fetch_s = time.perf_counter() - start
        try:
            result = self.engine.swap_weights(notice.version, state, force=force)
        except Exception as exc:  # one notice must not end the thread: later versions still apply
            reason = f"swapping in version {notice.version} failed: {exc!r}"
            log.exception("%s; keeping version %d", reason, self.engine.policy_version)
            return SwapResult(notice.version, False, time.perf_counter() - start, 0.0, reason=reason)
        if not result.applied:
            log.warning("%s version %d: %s", notice.action, notice.version, result.reason)
        # the store read is part of loading off the request path
        return SwapResult(result.version, result.applied, fetch_s + result.load_s, result.stall_s, result.reason)


def _log_load_failure(exc: Exception, message: str, *args: object) -> None:
    """An error line for a failure a store expects (:data:`EXPECTED_LOAD_ERRORS`), with the traceback otherwise."""
    if isinstance(exc, EXPECTED_LOAD_ERRORS):
        log.error(message, *args)
    else:
        log.error(message, *args, exc_info=exc)
