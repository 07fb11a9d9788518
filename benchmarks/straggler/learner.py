"""The learner worker: the project's SAO step on the rollouts the generator sends.

Built as trainer/startup.py builds it (policy from the model directory, critic
copied from it, ``build_optimizers`` / ``build_algorithm``), it turns each
finished request into a Rollout with ``interaction_to_rollout``, collates a batch
and calls ``Algorithm.step``, then publishes the policy to a FileWeightStore and
announces the version (and how many rollouts are trained) to the generator.

* sync: waits for the whole batch of the generator, trains on it (in steps of at
  most ``max_rollouts_per_step`` / ``token_budget``, like the learner), publishes.
* stream: trains as soon as ``min_rollouts`` rollouts or ``token_budget`` action
  tokens are ready, or some have waited ``max_wait_s`` (trainer/feed.py's rule),
  never waiting for groups.

The loop ends when ``rollouts`` are trained or ``duration_s`` has passed; the
learner then sets ``stop``.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from online_sao.algorithms import build_algorithm, build_critic, build_optimizers
from online_sao.batch import Rollout, collate, pack_layout
from online_sao.modeling import compile_body, load_policy, load_tokenizer
from online_sao.schemas import Interaction
from online_sao.weights import FileWeightStore
from trainer.rollouts import interaction_to_rollout

from benchmarks.straggler.channels import Channels, drain, get_or_none
from benchmarks.straggler.spec import Finished, LearnerReport, LoopSpec, Published, StepRecord

KEEP_VERSIONS = 3
"""Versions left in the weight store (the generator loads only the newest)."""

WARM_UP_LENGTHS = ((40,), (60, 12, 7, 30, 5, 25))
"""Rollout lengths of the untimed steps that compile the bodies (``trainer.compile``): a batch of one
packed row, then one of several (a one-row batch gets a graph of its own)."""


def reward_of(interaction: Interaction) -> float:
    """A stand-in reward (share of even token ids in the response): the benchmark
    measures speed, the value only has to be a real number per rollout."""
    return sum(t % 2 == 0 for t in interaction.response_ids) / max(len(interaction.response_ids), 1)


def take(pending: list[Finished], max_rollouts: int, token_budget: int) -> list[Finished]:
    """Oldest first, until ``max_rollouts`` or until ``token_budget`` action tokens are
    reached (RewardJoiner.pop_ready without groups); removes them from ``pending``."""
    taken, tokens = [], 0
    for item in pending:
        if taken and (len(taken) + 1 > max_rollouts or tokens >= token_budget):
            break
        taken.append(item)
        tokens += len(item.interaction.logprobs)
    del pending[:len(taken)]
    return taken


class Learner:
    def __init__(self, loop: int, spec: LoopSpec, ch: Channels):
        self.loop, self.spec, self.ch = loop, spec, ch
        torch.manual_seed(spec.seed)
        self.policy, self.algorithm = build_learner(spec)
        self.pad_token_id = load_tokenizer(spec.model_dir).pad_token_id
        self.store = FileWeightStore(spec.weights_dir)
        self.version = 0
        self.trained = 0
        self.steps: list[StepRecord] = []
        self.planned: dict[int, int] = {}

    def run(self, start: float) -> LearnerReport:
        spec, tcfg = self.spec, self.spec.trainer
        pending: list[Finished] = []
        ready_since: float | None = None
        while True:
            now = time.perf_counter()
            if (spec.rollouts is not None and self.trained >= spec.rollouts) or (
                    spec.duration_s is not None and now - start >= spec.duration_s):
                break
            pending += self._received(block=not self._due(pending, ready_since, now))
            now = time.perf_counter()
            ready_since = (ready_since or now) if pending else None
            if self._due(pending, ready_since, now):
                ready_since = None
                self._train(take(pending, tcfg.max_rollouts_per_step, tcfg.token_budget))
                while spec.mode == "sync" and pending:  # the rest of the batch, step after step
                    self._train(take(pending, tcfg.max_rollouts_per_step, tcfg.token_budget))
        end = time.perf_counter()
        self.ch.stop.set()
        return LearnerReport(start, end, self.steps, self.planned)

    def _received(self, block: bool) -> list[Finished]:
        first = get_or_none(self.ch.rollouts) if block else None
        return [m for m in ([first] if first else []) + drain(self.ch.rollouts) if m.loop == self.loop]

    def _due(self, pending: list[Finished], ready_since: float | None, now: float) -> bool:
        """Whether a step starts now: sync, the whole batch is there; stream,
        trainer/feed.py's readiness rule."""
        if self.spec.mode == "sync":
            return len(pending) >= self.spec.batch_requests
        if not pending:
            return False
        tcfg = self.spec.trainer
        tokens = sum(len(f.interaction.logprobs) for f in pending)
        waited = ready_since is not None and tcfg.max_wait_s is not None and now - ready_since >= tcfg.max_wait_s
        return len(pending) >= tcfg.min_rollouts or tokens >= tcfg.token_budget or waited

    def _train(self, taken: list[Finished]) -> None:
        start, cpu_start = time.perf_counter(), time.process_time()
        rollouts = [interaction_to_rollout(f.interaction, reward_of(f.interaction),
                                           group_id=f.index // self.spec.group_size) for f in taken]
        batch = collate(rollouts, self.pad_token_id, policy_version=self.version)
        metrics = self.algorithm.step(batch)
        self.version += 1
        ref = self.store.save(self.version, self.policy.state_dict())
        self.store.prune(KEEP_VERSIONS)
        self.trained += len(taken)
        self.ch.weights.put(Published(self.loop, self.version, ref.location, ref.checksum, self.trained))
        for f in taken:
            self.planned[f.index] = f.planned_tokens
        self.steps.append(StepRecord(
            start=start, end=time.perf_counter(), indices=tuple(f.index for f in taken),
            produced_tokens=tuple(r.num_action_tokens for r in rollouts),
            padded_slots=batch.attention_mask.numel(), packed_slots=_packed_slots(batch.attention_mask),
            real_tokens=int(batch.attention_mask.sum()),
            version_lag_mean=float(metrics["version_lag_mean"]), cpu_s=time.process_time() - cpu_start))


def _packed_slots(attention_mask: torch.Tensor) -> int:
    layout = pack_layout(attention_mask)
    return layout.rows * layout.capacity


def build_learner(spec: LoopSpec):
    """The policy and the learning rule as trainer/startup.py builds them, the bodies compiled
    with ``spec.trainer.compile``."""
    policy = load_policy(spec.model_dir)
    critic = build_critic(spec.algorithm, policy)
    if spec.trainer.compile:
        for model in (policy, critic):
            if model is not None:
                compile_body(model)
    opts = build_optimizers(spec.algorithm, policy, critic)
    return policy, build_algorithm(spec.algorithm, policy, critic, opts.policy, opts.critic, opts.critic_scheduler)


def compile_before_timing(spec: LoopSpec) -> float:
    """Seconds of untimed steps on a throwaway learner that compile the bodies; later learners
    of this process reuse the compiled graphs (they are cached by code, not by module)."""
    start = time.perf_counter()
    _, algorithm = build_learner(spec)
    pad_token_id = load_tokenizer(spec.model_dir).pad_token_id
    for lengths in WARM_UP_LENGTHS:
        rollouts = [Rollout(f"warm-{i}", [3 + (i + t) % 50 for t in range(n)], [t >= 4 for t in range(n)],
                            [-1.0 if t >= 4 else 0.0 for t in range(n)], [0] * n, {n - 1: 1.0})
                    for i, n in enumerate(lengths)]
        algorithm.step(collate(rollouts, pad_token_id, policy_version=0))
    return time.perf_counter() - start


def run_learner(loop: int, spec: LoopSpec, ch: Channels) -> LearnerReport:
    compile_s = compile_before_timing(spec) if spec.trainer.compile and loop == 0 else 0.0
    learner = Learner(loop, spec, ch)
    ch.results.put(("ready", "learner", loop, None))
    start = ch.go("learner").get()
    time.sleep(max(0.0, start - time.perf_counter()))
    return replace(learner.run(start), compile_s=compile_s)
