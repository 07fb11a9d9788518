"""What one loop of the straggler benchmark runs, the messages between its two
processes, and what each process reports.

Response lengths: request ``i`` asks for exactly ``response_length(spec, i)``
tokens, drawn from lognormal(mu = log(median), sigma) with a generator seeded by
``(seed, i)`` and clipped to ``[1, max_tokens]``; with no stop token ids the
engine samples exactly that many (``finish_reason`` 'length'). Request ``i``
belongs to prompt group ``i // group_size``: the same prompt ``group_size`` times.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal

from online_sao.config import AlgorithmConfig, TrainerConfig
from online_sao.schemas import Interaction

Mode = Literal["sync", "stream"]
MODES: tuple[Mode, ...] = ("sync", "stream")

SEED_STRIDE = 1_000_003
"""Request ``i`` of seed ``s`` draws its length and samples its tokens with seed
``s * SEED_STRIDE + i``: distinct per request for any realistic run."""


@dataclass(frozen=True)
class LoopSpec:
    mode: Mode
    """'sync': generate a batch of groups, wait for all, train, repeat. 'stream':
    ``concurrency`` requests always in flight, the learner trains on what is ready."""
    model_dir: str
    """Hugging Face model directory shared by generator and learner."""
    weights_dir: str
    """Directory of the FileWeightStore the learner publishes to."""
    sigma: float
    """Lognormal sigma of the response lengths (0: every response has the median length)."""
    median_tokens: int
    """Median response length in tokens (exp(mu) of the lognormal)."""
    max_tokens: int
    """Cap on a response's length."""
    group_size: int
    """Requests per prompt group (the same prompt G times)."""
    groups_per_batch: int
    """Groups in one batch of the synchronous loop."""
    concurrency: int
    """Requests kept in flight by the streaming generator."""
    rollouts: int | None
    """The loop ends once this many rollouts are trained (None: only ``duration_s``)."""
    duration_s: float | None
    """The loop ends after this many seconds (None: only ``rollouts``)."""
    seed: int
    """Seeds the learner (torch), every response length and every request's sampling."""
    max_untrained: int
    """Streaming backpressure: the generator starts no request while this many
    submitted rollouts are not trained yet (the learner's READY_BACKLOG_STEPS idea)."""
    kv_layout: Literal["padded", "flat"] = "padded"
    """The torch engine's cache layout (ServingConfig.kv_layout), the same in both loops."""
    engine_compile: bool = False
    """Compile the torch engine's body (ServingConfig.compile) in both loops; its
    warm-up runs before the loop's clock starts."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The learning rule and its hyper-parameters (SAO by default)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """min_rollouts, token_budget, max_rollouts_per_step, max_wait_s of the learner."""

    def __post_init__(self) -> None:
        if self.rollouts is None and self.duration_s is None:
            raise ValueError("a loop needs rollouts or duration_s to end")
        if min(self.median_tokens, self.max_tokens, self.group_size, self.groups_per_batch, self.concurrency) < 1:
            raise ValueError("median_tokens, max_tokens, group_size, groups_per_batch and concurrency must be >= 1")
        if self.sigma < 0:
            raise ValueError("sigma must be >= 0")

    @property
    def batch_requests(self) -> int:
        """Requests in one synchronous batch."""
        return self.group_size * self.groups_per_batch

    @property
    def max_batch_size(self) -> int:
        """The engine's batch limit, the same in both loops."""
        return max(self.batch_requests, self.concurrency)


def lognormal_length(seed: int, index: int, median: int, sigma: float, cap: int) -> int:
    """Tokens request ``index`` of ``seed`` generates: lognormal(log(median), sigma), rounded, in [1, cap]."""
    draw = random.Random(seed * SEED_STRIDE + index).lognormvariate(math.log(median), sigma)
    return max(1, min(cap, round(draw)))


def response_length(spec: LoopSpec, index: int) -> int:
    """:func:`lognormal_length` with the loop's seed, median, sigma and cap."""
    return lognormal_length(spec.seed, index, spec.median_tokens, spec.sigma, spec.max_tokens)


def request_seed(spec: LoopSpec, index: int) -> int:
    return spec.seed * SEED_STRIDE + index


@dataclass(frozen=True)
class Finished:
    """Generator -> learner: one completed request."""

    loop: int
    index: int
    planned_tokens: int
    interaction: Interaction


@dataclass(frozen=True)
class Published:
    """Learner -> generator: a new policy version in the store, and how many rollouts are trained."""

    loop: int
    version: int
    location: str
    checksum: str
    trained: int


@dataclass(frozen=True)
class StepRecord:
    """One learner step (collate, SAO step, publish)."""

    start: float
    end: float
    indices: tuple[int, ...]
    """Request indices trained in this step."""
    produced_tokens: tuple[int, ...]
    """Action tokens of each of those rollouts."""
    padded_slots: int
    """B x T of the collated batch."""
    real_tokens: int
    """Tokens that are not padding."""
    version_lag_mean: float
    """Mean over action tokens of (learner version - sampling version)."""
    cpu_s: float
    """CPU seconds the learner process used during the step (``time.process_time``)."""
    packed_slots: int
    """Rows x capacity of the packed layout the forward passes run on (online_sao.batch.pack_layout)."""


@dataclass
class LearnerReport:
    start: float
    end: float
    """When the loop ended (``perf_counter``, the same clock in both processes)."""
    steps: list[StepRecord]
    planned_tokens: dict[int, int]
    """Request index -> the length the generator was asked for, per trained rollout."""
    compile_s: float = 0.0
    """Seconds of untimed steps that compiled the bodies before this loop (``trainer.compile``;
    the first loop of the learner process only)."""

    @property
    def trained(self) -> int:
        return sum(len(s.indices) for s in self.steps)


@dataclass(frozen=True)
class EngineStep:
    start: float
    end: float
    kind: str
    batch_size: int


@dataclass
class GeneratorReport:
    engine_steps: list[EngineStep]
    generated: dict[int, tuple[int, int]]
    """Request index -> (planned tokens, tokens the engine produced), per completed request."""
    swaps: int
    """Policy versions the engine switched to."""
    cpu_s: float = 0.0
    """CPU seconds the generator process used from the loop's start until it saw ``stop``."""
    wall_s: float = 0.0
    """Wall seconds of that same span."""
