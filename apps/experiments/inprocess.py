"""``online-sao simulate --driver inprocess``: one arm in one process, stepped in rollout time.

The live driver (experiments/orchestrate.py) is the reference: serving, the learner
and the judge as their own processes on Kafka, simulated users over HTTP at a fixed
rate in real time. That pacing makes a sweep of several seeds take hours on a small
machine. This driver runs the same parts without the transport and the clock:

* the request path is serving's own: :class:`~serving.openai_serving.OpenAIServing`
  over the :class:`~serving.engine.torch_engine.TorchEngine` (chat template, sampling,
  behaviour log-probs, the logged :class:`~online_sao.schemas.Interaction`), called
  directly instead of over HTTP; its log keeps records in memory instead of Kafka;
* the judge is :class:`~apps.experiments.judge_service.ScheduleJudge`, the scoring,
  seeded drops and results file of the judge service;
* the learner is the live learner's: its models and learning rule from
  :func:`trainer.startup.build_models`, interactions and rewards through
  :class:`~trainer.join.RewardJoiner`, a step when ``trainer.min_rollouts``,
  ``trainer.token_budget`` or ``trainer.max_wait_s`` say so (trainer/feed.py's rule),
  the joined rollouts converted by :func:`trainer.rollouts.to_rollouts`, one
  ``Algorithm.step``, and the new weights handed to the engine's hot-swap (what the
  weights follower does after a publish).

Time is virtual. Request i arrives at the i-th arrival of the same seeded Poisson
process the live users draw (rate ``requests_per_second``). At its arrival, first the
rewards due by then reach the join (a reward is due ``reward_delay_s`` after its
answer's arrival) and the learner takes every step its rule allows, each step's weights
served at once; then the request is answered by the version served at that moment, with
its arrival as the record time. Answers take no virtual time: live, at 3 requests/s, a
request is answered in a fraction of a second, mostly alone, and the learner keeps up
(docs/EXPERIMENTS.md); here it always does, and ``concurrency`` plays no part. On a busy
machine the live learner falls behind instead: on drift-short, seeds 0-2, live rollouts lagged
about twice as many versions as here and the two drivers' rewards disagreed
(docs/EXPERIMENTS.md, section 7), so the live stack stays the reference. What differs from live: no HTTP, no Kafka,
no MLflow, no weight store, no checkpoints, no registry (so no promotion gate and no
roll-back: every applied step is served), and per-request sampling seeds (derived
from ``experiment.seed``) where live users send none. With those seeds, and every weight
swap between two requests, a run is reproducible: the same configuration gives the same
results file (a live run is not: its timing decides which version samples what), on any
machine whose CPU rounds alike, when ``serving.torch_threads`` is set: every drift config sets it,
and the driver then runs the judge and the learner (this thread) on that many torch threads as the
engine does (:func:`pinned_threads`); left unset, torch uses every core and float rounding
follows the machine's core count. With
``experiment.segments`` each request draws its user segment as the live users do
(scenario.segment_draws) and carries it in the request's ``user`` field, so the logged
record's ``user_id`` names it for the judge.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from apps.config import AppConfig
from apps.experiments.judge import QualityStyleJudge, Raters
from apps.experiments.judge_service import SOURCE, ScheduleJudge
from apps.experiments.results import ArmSummary, EvalRow, StepRow, append_row, summary_path
from apps.experiments.resume import outcome_settings
from apps.experiments.scenario import (arrival_gaps, eval_prompts, prompt_order, prompt_pool, prompt_repeats,
                                      segment_draws)
from apps.experiments.style import StyleClassifier
from online_sao.batch import collate
from online_sao.modeling import load_policy, load_tokenizer
from online_sao.schemas import Interaction, Reward
from serving.engine.torch_engine import TorchEngine
from serving.ids import InteractionIdSigner
from serving.metrics import ServingMetrics
from serving.openai_serving import OpenAIServing
from serving.protocol import ChatCompletionRequest
from serving.receipt import Receipt
from serving.trajectories import TrajectoryCache
from trainer.distributed import DistContext
from trainer.rollouts import to_rollouts
from trainer.join import RewardJoiner
from trainer.plasticity import drift_counter
from trainer.startup import build_models

REQUEST_SEED_STRIDE = 1_000_000
"""Request i of scenario seed s samples with seed s * stride + i: distinct across seeds and arms' requests."""


class MemoryInteractionLog:
    """Stands in for serving's InteractionLogger: keeps each submitted record, durable at once."""

    def __init__(self) -> None:
        self._records: dict[str, Interaction] = {}

    def submit(self, record: Interaction) -> Receipt:
        self._records[record.interaction_id] = record
        return Receipt(durable=True)

    def refusal(self) -> str | None:
        return None

    def take(self, interaction_id: str) -> Interaction:
        return self._records.pop(interaction_id)


class InProcessServing:
    """Serving's request path (chat template, engine, logged record) without HTTP."""

    def __init__(self, cfg: AppConfig, engine: TorchEngine, tokenizer) -> None:
        from serving.server import stop_token_ids
        from transformers import AutoConfig

        s = cfg.serving
        self.cfg = cfg
        self.engine = engine
        self.log = MemoryInteractionLog()
        signer = InteractionIdSigner(s.feedback_secret.get_secret_value().encode("utf-8"), s.deployment_id,
                                     cfg.reward.window_s)
        max_len = getattr(AutoConfig.from_pretrained(cfg.model_dir), "max_position_embeddings", None)
        self.api = OpenAIServing(engine, self.log, tokenizer, s, signer, TrajectoryCache(s.max_trajectories),
                                 ServingMetrics(CollectorRegistry()), stop_token_ids=stop_token_ids(cfg.model_dir, tokenizer),
                                 max_model_len=max_len)

    async def chat(self, prompt: str, seed: int, session_id: str | None = None,
                   user: str | None = None) -> tuple[str, Interaction]:
        """(answer text, logged interaction) of one chat request; ``user`` is the OpenAI ``user`` field."""
        exp = self.cfg.experiment
        request = ChatCompletionRequest(model=self.cfg.serving.model_name, messages=[{"role": "user", "content": prompt}],
                                        max_tokens=exp.max_tokens, temperature=exp.temperature, seed=seed,
                                        session_id=session_id, user=user)
        response = await self.api.chat(request)
        return response.choices[0].message.content or "", self.log.take(response.interaction_id)


@dataclass
class StepRule:
    """When the live learner starts a step (trainer/learner.py), on the virtual clock."""

    min_rollouts: int
    token_budget: int
    max_wait_s: float | None
    ready_since: float | None = None

    def due(self, ready: int, ready_tokens: int, now: float) -> bool:
        self.ready_since = (self.ready_since if self.ready_since is not None else now) if ready else None
        waited = self.ready_since is not None and self.max_wait_s is not None and now - self.ready_since >= self.max_wait_s
        return ready > 0 and (ready >= self.min_rollouts or ready_tokens >= self.token_budget or waited)


class InProcessLearner:
    """The live learner's models (trainer/startup.py), join, step rule and step in one process;
    each applied step's weights go to ``engine`` as the next version."""

    def __init__(self, cfg: AppConfig, engine: TorchEngine) -> None:
        torch.manual_seed(cfg.trainer.seed)
        self.cfg = cfg
        self.engine = engine
        self.ctx = DistContext(rank=0, world_size=1, device=torch.device("cpu"))
        self.models = build_models(cfg, self.ctx)
        self.joiner = RewardJoiner(cfg.reward, cfg.trainer.join_max_pending)
        t = cfg.trainer
        self.rule = StepRule(t.min_rollouts, t.token_budget, t.max_wait_s)
        self.version = engine.policy_version
        self.steps = 0
        self.counters: dict[str, float] = {"invalid_rollouts": 0.0, "empty_rollouts": 0.0, "refused_steps": 0.0,
                                           "drift_restarts": 0.0, "drift_rollbacks": 0.0}

    @property
    def algorithm(self):
        return self.models.trainables.algorithm

    def step_if_due(self, now: float) -> dict[str, float] | None:
        """One step when the learner's rule says so; returns its metrics (None: no step)."""
        t = self.cfg.trainer
        if t.max_version_lag is not None:
            self.joiner.drop_stale(min_version=self.version - t.max_version_lag)
        ready, tokens = self.joiner.ready_stats(self.algorithm.group_size)
        if not self.rule.due(ready, tokens, now):
            return None
        self.rule.ready_since = None
        taken = self.joiner.pop_ready(t.max_rollouts_per_step, t.token_budget, self.algorithm.group_size)
        rollouts = to_rollouts(taken, self.counters, self.models.vocab_size)
        if not rollouts:
            return None
        batch = collate(rollouts, self.models.pad_token_id, policy_version=self.version)
        metrics = self.algorithm.step(batch)
        self.steps += 1
        if metrics.get("skipped_nonfinite", 0.0) > 0:
            self.counters["refused_steps"] += 1
            return metrics
        if self.models.drift is not None:  # as trainer/learner.py's learn
            metrics.update(self.models.drift.after_rollouts(rollouts, self.version + 1))
            if (counter := drift_counter(metrics)) is not None:
                self.counters[counter] += 1
        self.version += 1
        policy = self.models.trainables.policy
        self.engine.swap_weights(self.version, {k: v.detach() for k, v in policy.state_dict().items()})
        return metrics


@dataclass(order=True)
class _DueReward:
    due: float
    seq: int
    reward: Reward = field(compare=False)


class InProcessArm:
    """One arm: traffic, judge, learner and held-out evaluation on the virtual clock."""

    def __init__(self, cfg: AppConfig, classifier: StyleClassifier, results_path: Path,
                 progress: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.exp = cfg.experiment
        self.classifier = classifier
        self.results_path = results_path
        self.progress = progress
        tokenizer = load_tokenizer(cfg.model_dir)
        self.engine = TorchEngine(load_policy(cfg.model_dir, cfg.model.dtype), tokenizer, cfg.serving)
        self.serving = InProcessServing(cfg, self.engine, tokenizer)
        self.learner = InProcessLearner(cfg, self.engine)
        self.judge = ScheduleJudge(cfg, QualityStyleJudge(classifier), results_path=results_path,
                                   clock=lambda: self.now)
        self.now = 0.0
        self._rewards: list[_DueReward] = []
        self._seq = 0

    def arrive(self, at: float) -> None:
        """Move the virtual clock to a request's arrival: rewards due by then reach the join in
        record-time order, each followed by as many learner steps as the rule asks for (the live
        learner checks its rule after every poll, so a step takes about ``min_rollouts``)."""
        while self._rewards and self._rewards[0].due <= at:
            due = heapq.heappop(self._rewards)
            self.now = max(self.now, due.due)
            self.learner.joiner.add_reward(due.reward, due.due)
            self._train()
        self.now = max(self.now, at)
        self._train()

    def answered(self, interaction: Interaction, arrived_at: float) -> None:
        """Judge an answer, schedule its reward, and let the interaction reach the join."""
        row = self.judge.score(interaction)
        if row.delivered:
            reward = Reward(interaction_id=interaction.interaction_id, value=row.reward, source=SOURCE,
                            scores=row.scores())
            heapq.heappush(self._rewards, _DueReward(arrived_at + self.exp.reward_delay_s, self._seq, reward))
            self._seq += 1
        self.learner.joiner.add_interaction(interaction, arrived_at)
        self._train()

    def _train(self) -> None:
        while (metrics := self.learner.step_if_due(self.now)) is not None:
            append_row(self.results_path, StepRow(step=self.learner.steps, rollout=self.judge.rollout,
                                                  version=self.learner.version, metrics=_finite(metrics)))

    async def evaluate(self, rollout: int) -> None:
        evals = eval_prompts(self.exp, self.cfg.model.base.seed)
        preferred = self.exp.preferred_style(rollout)
        answers = await asyncio.gather(*(self.serving.chat(p, self._eval_seed(rollout, i), self.exp.eval_session_id)
                                         for i, p in enumerate(evals)))
        accuracy = self.classifier.accuracy([text for text, _ in answers], [preferred] * len(answers))
        version = max(record.policy_version for _, record in answers)
        append_row(self.results_path, EvalRow(rollout=rollout, t=self.now, version=version, style_accuracy=accuracy,
                                              preferred=preferred, prompts=len(evals)))
        self.progress(f"rollout {rollout}/{self.exp.rollouts_per_arm}: {accuracy:.0%} of held-out answers "
                      f"{preferred} (policy v{version})")

    def _eval_seed(self, rollout: int, i: int) -> int:
        return -(self.exp.seed * REQUEST_SEED_STRIDE + rollout * 1000 + i) - 1  # never a traffic seed

    async def run(self) -> int:
        """Answer ``rollouts_per_arm`` requests, each at its arrival; returns how many were answered."""
        exp = self.exp
        gaps = arrival_gaps(exp.seed, exp.requests_per_second)
        prompts = prompt_order(prompt_pool(exp, self.cfg.model.base.seed), exp.prompt_seed, prompt_repeats(self.cfg))
        segments = segment_draws(exp)
        arrived_at = 0.0
        await self.evaluate(0)
        for index in range(exp.rollouts_per_arm):
            arrived_at += next(gaps)
            self.arrive(arrived_at)
            _, interaction = await self.serving.chat(next(prompts), exp.seed * REQUEST_SEED_STRIDE + index,
                                                     user=next(segments))
            self.answered(interaction, arrived_at)
            if (index + 1) % exp.eval_every == 0 or index + 1 == exp.rollouts_per_arm:
                await self.evaluate(index + 1)
        return exp.rollouts_per_arm


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    """Step metrics as JSON can hold them (a NaN metric, e.g. explained variance of one token, is left out)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


@contextmanager
def pinned_threads(threads: int | None) -> Iterator[None]:
    """This thread's torch threads set to ``threads`` (None: as they are), restored after.

    torch keeps the count per thread (a new thread starts from the last count set anywhere). The
    engine's ``start_thread`` sets ``serving.torch_threads`` on the thread that calls it, this one,
    but only from then on: the learner built and its critic pre-trained before it ran on torch's
    default (every core) in a process's first arm and on the engine's count in later ones. A matrix
    product split over another number of threads rounds differently, so a seed's run followed its
    place in the run, the machine's core count and whether it ran in a worker process
    (apps/experiments/parallel.py)."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def collect_pretrain_inprocess(cfg: AppConfig, classifier: StyleClassifier,
                               progress: Callable[[str], None] = print) -> Path:
    """The live pre-training pass (experiments/pretrain_data.py) in this process: the starting
    policy answers ``experiment.pretrain_rollouts`` pool prompts, in the order the live pass's
    users send them but one at a time (reproducible), scored under the first phase's preference;
    the records go to the same file."""
    from apps.config import PRETRAIN_ARM
    from apps.experiments.pretrain_data import PRETRAIN_FILE, judge_rewards, write_records
    from apps.experiments.scenario import results_dir

    exp = cfg.experiment
    tokenizer = load_tokenizer(cfg.model_dir)
    engine = TorchEngine(load_policy(cfg.model_dir, cfg.model.dtype), tokenizer, cfg.serving)
    serving = InProcessServing(cfg, engine, tokenizer)
    prompts = prompt_order(prompt_pool(exp, cfg.model.base.seed), exp.prompt_seed, 1)

    async def answer_all() -> list[Interaction]:
        # one at a time, as the measured traffic is answered: answers batched together come out of
        # forward passes whose batch depends on the engine thread's timing, a flipped token follows
        # from a last-bit difference, and two runs of one seed then pre-train different critics
        return [(await serving.chat(next(prompts), -(exp.seed * REQUEST_SEED_STRIDE + i) - 1))[1]
                for i in range(exp.pretrain_rollouts)]

    with pinned_threads(cfg.serving.torch_threads):
        engine.start_thread()
        try:
            interactions = asyncio.run(answer_all())
        finally:
            engine.stop_thread()
        rewards = judge_rewards(interactions, QualityStyleJudge(classifier), exp.preferred_style(0),
                                Raters(exp.rater_scale, exp.rater_offset))
    path = write_records(results_dir(cfg) / "arms" / PRETRAIN_ARM / PRETRAIN_FILE, interactions, rewards)
    progress(f"value pre-training data: {len(rewards)} rollouts of the starting policy, mean reward "
             f"{sum(r.value for r in rewards) / len(rewards):.3f} in {path}")
    return path


def pretrain_critic(learner: InProcessLearner, pretrain_file: Path) -> dict[str, float]:
    """What ``learn --pretrain-critic`` does before the loop (trainer/startup.py, one rank)."""
    from trainer.history import rollouts_from_file
    from trainer.pretrain import pretrain_critic as fit_critic

    logged = rollouts_from_file(pretrain_file, learner.cfg, learner.version, learner.models.vocab_size)
    if not logged:
        return {}
    trainables = learner.models.trainables
    return fit_critic(trainables.critic, trainables.optimizers.critic, logged, learner.cfg.algorithm,
                      learner.models.pad_token_id, scheduler=trainables.optimizers.critic_scheduler)


def run_arm_inprocess(cfg: AppConfig, arm_name: str, classifier: StyleClassifier, out: Path,
                      progress: Callable[[str], None] = print, pretrain_file: Path | None = None) -> ArmSummary:
    """Run one arm of ``cfg``'s scenario in this process; results go to ``out/<arm>.jsonl``. An
    arm with a critic pre-trains it on ``pretrain_file`` first when given (as live)."""
    from apps.experiments.scenario import arm_config

    arm = next(a for a in cfg.experiment.arms if a.name == arm_name)
    acfg = arm_config(cfg, arm)
    results_path = out / f"{arm.name}.jsonl"
    summary_path(out, arm.name).unlink(missing_ok=True)  # first: only a finished run has one
    results_path.unlink(missing_ok=True)
    started = time.monotonic()
    with pinned_threads(acfg.serving.torch_threads):
        runner = InProcessArm(acfg, classifier, results_path, progress)
        fit = {}
        if pretrain_file is not None and runner.learner.models.trainables.critic is not None:
            fit = _finite(pretrain_critic(runner.learner, pretrain_file))
            progress(f"value pre-training: {fit}")
        runner.engine.start_thread()
        try:
            answered = asyncio.run(runner.run())
        finally:
            runner.engine.stop_thread()
    wall = round(time.monotonic() - started, 1)
    c = runner.learner.joiner.counters
    groups = c.complete_groups + c.incomplete_groups
    grouped = acfg.algorithm.name == "grpo"
    summary = ArmSummary(name=arm.name, driver="inprocess", answered=answered, wall_s=wall, traffic_s=wall,
                         learner_steps=runner.learner.steps,
                         complete_groups=c.complete_groups if grouped else None,
                         incomplete_groups=c.incomplete_groups if grouped else None,
                         group_wait_s=(c.group_wait_s / groups if groups else None) if grouped else None,
                         drift_restarts=int(runner.learner.counters["drift_restarts"]),
                         drift_rollbacks=int(runner.learner.counters["drift_rollbacks"]),
                         value_pretraining=fit, settings=outcome_settings(acfg))
    progress(f"arm {arm.name}: {answered} answered, {runner.learner.steps} learner steps, "
             f"policy v{runner.learner.version}, {wall} s")
    return summary
