"""The applications' part of the configuration tree: the default model's build and the
drifting-preference experiment. :class:`AppConfig` extends the core tree
(:class:`online_sao.config.Config`) with these sections, so a run is still one YAML file
validated as one tree; serving and trainer only ever see the core sections.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from apps.default_model.corpus import STYLES
from apps.default_model.corpus_content import TOPICS
from online_sao.config import AlgorithmConfig, Config, ModelConfig, Section, load_config


class BaseModelConfig(Section):
    """The project's own default policy, built by ``online-sao base-model``."""

    architecture: Literal["qwen2", "llama"] = "qwen2"
    """transformers architecture of the default model."""
    vocab_size: int = Field(2048, ge=300)
    """Size of the byte-level BPE vocabulary trained on the corpus."""
    hidden_size: int = Field(128, ge=16)
    """Width of the transformer."""
    intermediate_size: int = Field(384, ge=16)
    """Width of the MLP."""
    num_layers: int = Field(4, ge=1)
    """Decoder layers."""
    num_heads: int = Field(4, ge=1)
    """Attention heads."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention)."""
    max_position_embeddings: int = Field(512, ge=64)
    """Longest sequence the model handles."""
    train_steps: int = Field(500, ge=1)
    """Optimizer steps of supervised pre-training on the corpus (style pairs and 12% tool-use trajectories)."""
    batch_size: int = Field(32, ge=1)
    """Sequences per pre-training step."""
    learning_rate: float = Field(3e-3, gt=0)
    """Peak learning rate of pre-training."""
    seed: int = 0
    """Seed of corpus generation, tokenizer and training."""

    @model_validator(mode="after")
    def _heads_divide(self) -> "BaseModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        return self


class AppModelConfig(ModelConfig):
    base: BaseModelConfig = BaseModelConfig()
    """How the default model is built."""


PRETRAIN_ARM = "pretrain-data"
"""Names the topics, spool and logs of the pass that collects value pre-training data
(apps/experiments/pretrain_data.py); no arm may take it."""


class PreferencePhase(Section):
    """From rollout ``from_rollout`` on, simulated users prefer ``style``."""

    from_rollout: int = Field(ge=0)
    """First rollout (0-based count of interactions the judge has scored in this run) of the phase."""
    style: str
    """Preferred writing style during the phase (one of ``experiment.styles``)."""


def schedule_problems(schedule: list[PreferencePhase], styles: list[str], rollouts: int, min_phases: int,
                      what: str) -> list[str]:
    """What is wrong with a preference schedule (empty: valid): its first phase starts at rollout 0,
    phases start at increasing rollouts before ``rollouts``, each switches to a different style of
    ``styles``, at least ``min_phases`` of them. ``what`` names the schedule in the messages."""
    if len(schedule) < min_phases:
        switches = {1: "one switch", 2: "two switches"}.get(min_phases - 1, f"{min_phases - 1} switches")
        return [f"{what} needs at least {switches} ({min_phases} phases)"]
    problems = []
    if schedule[0].from_rollout != 0:
        problems.append(f"the first phase of {what} must start at rollout 0")
    for before, after in zip(schedule, schedule[1:]):
        if after.from_rollout <= before.from_rollout:
            problems.append(f"{what}: phases must start at increasing rollouts")
        if after.style == before.style:
            problems.append(f"{what}: phase at rollout {after.from_rollout} does not switch style")
    problems += [f"{what}: style {p.style!r} is not in styles {styles}" for p in schedule if p.style not in styles]
    if len(schedule) > 1 and schedule[-1].from_rollout >= rollouts:
        problems.append(f"{what}: the last switch must happen before rollouts_per_arm")
    return problems


SHARE_TOLERANCE = 1e-6
"""Segment shares are written as decimals in YAML (0.3 + 0.7 is not exactly 1 in binary)."""
MAX_RATER_SCALE = 10.0
"""Largest factor a topic's raters may put on the judge's value, and largest shift they may add
(either sign): keeps every reward within a few units of the judge's [0, 1], far inside the
records' bound."""


class UserSegment(Section):
    """A group of simulated users with a preference schedule of its own."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """Names the group: sent as the OpenAI ``user`` field of its requests, and in results and report."""
    share: float = Field(gt=0, le=1)
    """Probability that a simulated request comes from this group (the shares sum to 1)."""
    schedule: list[PreferencePhase] = Field(min_length=1)
    """The group's preference schedule, in the same format and rollout clock as
    ``experiment.schedule`` (rollouts of the whole arm, every group's counted together); one
    phase (no switch) is allowed, a group whose preference holds."""


class ArmConfig(Section):
    """One arm of the experiment: a name and the algorithm fields it changes."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """Names the arm in results files, plots and the report."""
    algorithm: dict[str, Any] = {}
    """Overrides of the ``algorithm`` section for this arm (validated against it)."""

    @model_validator(mode="after")
    def _overrides_name_fields(self) -> "ArmConfig":
        """Only the names here: the values are validated applied to the ``algorithm`` section they
        override (``algorithm_config``; ``apps.config_checks.check_arms_fit_the_algorithm``). Validated
        alone, on top of the defaults, an override that fits its section was refused (``use_dis: false`` over a
        grpo section read as sao without DIS)."""
        unknown = sorted(set(self.algorithm) - set(AlgorithmConfig.model_fields))
        if unknown:
            raise ValueError(f"algorithm overrides name no algorithm field: {unknown}")
        return self

    def algorithm_config(self, base: AlgorithmConfig) -> AlgorithmConfig:
        """``base`` with this arm's overrides applied."""
        return AlgorithmConfig.model_validate({**base.model_dump(), **self.algorithm})


def _default_arms() -> list[ArmConfig]:
    return [
        ArmConfig(name="sao", algorithm={"name": "sao"}),
        ArmConfig(name="running_mean_w8", algorithm={"name": "running_mean", "running_mean_window": 8}),
        ArmConfig(name="running_mean_w128", algorithm={"name": "running_mean", "running_mean_window": 128}),
        # one policy update per batch, like every other arm (ppo_epochs defaults to 2)
        ArmConfig(name="grpo_dis_g4", algorithm={"name": "grpo", "use_dis": True, "group_size": 4, "ppo_epochs": 1}),
        ArmConfig(name="sao_k1", algorithm={"name": "sao", "critic_updates": 1}),
        ArmConfig(name="sao_unfrozen_attention", algorithm={"name": "sao", "freeze_critic_attention": False}),
    ]


class ExperimentConfig(Section):
    """The drifting-preference experiment (``online-sao simulate`` / ``judge`` / ``report``)."""

    name: str = Field("drift", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """Names the experiment: results directory, report title, MLflow run."""
    styles: list[str] = list(STYLES)
    """Styles the judge's classifier distinguishes (a subset of the corpus styles, at least two, each named once)."""
    schedule: list[PreferencePhase] = [PreferencePhase(from_rollout=0, style="formal"),
                                       PreferencePhase(from_rollout=150, style="cute"),
                                       PreferencePhase(from_rollout=300, style="archaic")]
    """Preference schedule in rollouts: the first phase starts at 0, at least two switches,
    each to a different style. Counted in rollouts (not wall time) so arms of different
    speed see the same preference for the same rollout."""
    requests_per_second: float = Field(2.0, gt=0)
    """Mean rate at which simulated users send chat requests (Poisson arrivals)."""
    concurrency: int = Field(4, ge=1)
    """Requests in flight at most."""
    prompt_pool_size: int = Field(256, ge=1)
    """Training prompts of the corpus the users draw from (held-out prompts never appear)."""
    prompt_seed: int = 0
    """Seed of the prompt pool's selection and of the order prompts are drawn in."""
    max_tokens: int = Field(64, ge=1)
    """max_tokens of each simulated request; at most ``serving.max_new_tokens`` (``simulate`` and
    ``lr-sweep`` refuse more before they start)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of each simulated request."""
    reward_delay_s: float = Field(0.0, ge=0)
    """The judge sends each reward this long after it read the interaction."""
    drop_rate: float = Field(0.0, ge=0, lt=1)
    """Share of rewards the judge withholds (seeded), like users who never rate."""
    seed: int = 0
    """Seed of the judge's drops and of the traffic timing; same for every arm."""
    rollouts_per_arm: int = Field(450, ge=1)
    """Rollouts (simulated requests answered) per arm."""
    arms: list[ArmConfig] = Field(default_factory=_default_arms)
    """Arms run one after the other with the same seeds and traffic."""
    eval_every: int = Field(50, ge=1)
    """Measure held-out style accuracy every this many rollouts."""
    eval_prompts: int = Field(32, ge=1)
    """Held-out prompts answered at each measurement."""
    eval_session_id: str = Field("sao-eval", min_length=1)
    """session_id of evaluation requests; the judge skips those interactions (no reward, not counted)."""
    metrics_window: int = Field(32, ge=1)
    """Moving-average window (rollouts) of the re-alignment lag, the reward plots and the collapse check."""
    realign_threshold: float = Field(0.5, gt=0, le=1)
    """Moving reward (the last ``metrics_window`` rollouts, all inside the phase) at which an arm
    counts as aligned with a phase's preference; the re-alignment lag counts the rollouts until it
    is reached. Absolute and the same for every arm, so arms compare on one scale."""
    reference_arm: str | None = "sao"
    """Arm the report compares every other arm with (post-switch mean reward and whether the
    across-seed intervals are apart); None, or an arm the run does not have, leaves it out."""
    driver: Literal["live", "inprocess"] = "live"
    """How ``simulate`` runs an arm. ``live``: serving, learner and judge as their own processes on
    the Kafka broker, simulated users over HTTP at ``requests_per_second`` (the reference).
    ``inprocess``: the same engine, request path, reward join, learner step and judge in one
    process, stepped in rollout time without HTTP, Kafka or real-time pacing (multi-seed sweeps;
    apps/experiments/inprocess.py)."""
    seeds: int = Field(1, ge=1)
    """Seeds the scenario runs with: seed k adds k to ``seed``, ``prompt_seed`` and ``trainer.seed``;
    with more than one, each seed's results go to ``seed-<k>/`` and the report gives every measure
    as its mean over seeds with a 95% bootstrap interval."""
    jobs: int = Field(1, ge=1)
    """In-process driver only: how many (seed, arm) runs go side by side, each in a worker process
    of its own (torch threads: ``serving.torch_threads``, else an equal share of the cores). With
    ``serving.torch_threads`` set (every drift config sets 1) the results are the same as one after
    the other: each run is seeded and runs on that many threads wherever it runs
    (apps/experiments/parallel.py). 1: one after the other in this process. The live driver's arms
    share the serving port and the broker, so it runs one arm at a time."""
    resume: bool = False
    """Keep the (seed, arm) runs that finished in the results directory with this run's settings and
    run only the others (an interrupted sweep goes on where it stopped; the report covers all). A
    finished run with other settings stops the run before anything is written
    (apps/experiments/resume.py). False: every named arm runs again on every seed."""
    collapse_fraction: float = Field(0.5, gt=0, lt=1)
    """Collapse: the moving answer quality stays below this share of its first window's level
    until the end of the run."""
    pretrain_rollouts: int = Field(64, ge=0)
    """Rollouts of the starting policy, answered through serving and scored under the first
    phase's preference before the arms run, on which every arm with a critic pre-trains its
    value model (``learn --pretrain-critic``; SAO.md section 3). 0: no value pre-training. At most
    ``trainer.pretrain_max_rollouts``, the most the pass reads."""
    judge_group: str = Field("sao-judge", min_length=1)
    """Kafka consumer group of the judge."""
    results_dir: Path | None = None
    """Per-arm results (JSONL) and the report (default data_dir/experiments/<name>)."""
    segments: list[UserSegment] = []
    """User groups with preference schedules of their own (empty: one group that follows
    ``schedule``). Each simulated request draws its group (seeded by ``seed``, weighted by the
    shares) and sends the group's name as the OpenAI ``user`` field; the judge scores it against
    that group's schedule at that rollout, and the report adds per-group reward curves and phase
    levels. ``schedule`` still cuts the overall tables into phases and sets the preference of the
    held-out evaluation and of value pre-training. The policy never sees the group: the chat
    template leaves ``user`` out, as for a real service's users."""
    rater_scale: dict[str, float] = {}
    """Users who rate on a scale of their own, by the prompt's topic (a corpus topic's name ->
    factor): the reward the learner receives is the judge's value times the factor of the topic
    the prompt asks about (1 for a topic not named). Real feedback carries such offsets (some users
    rate everything high); a baseline that sees the prompt can learn them, a running mean cannot.
    The report's levels, lags and areas stay on the judge's own value (``RewardRow.judge_value``),
    so they measure alignment with the preference, not the raters' generosity. Empty: every
    reward is the judge's value (docs/EXPERIMENTS.md section 13)."""
    rater_offset: dict[str, float] = {}
    """Raters who shift every rating, by the prompt's topic (a corpus topic's name -> shift added
    after ``rater_scale``): reward = value x scale + shift, 0 for a topic not named. A shift moves
    the reward's level per prompt whatever the answer, so it is the part of the reward a
    per-prompt baseline can remove entirely (docs/EXPERIMENTS.md section 14)."""

    @model_validator(mode="after")
    def _schedule_valid(self) -> "ExperimentConfig":
        unknown = set(self.styles) - set(STYLES)
        if unknown or len(set(self.styles)) < 2:
            raise ValueError(f"styles must be at least two of {list(STYLES)}, got {self.styles}")
        if len(set(self.styles)) < len(self.styles):  # the judge's classifier takes each as a class of its own
            raise ValueError(f"styles must each be named once, got {self.styles}")
        problems = schedule_problems(self.schedule, self.styles, self.rollouts_per_arm, 3, "the schedule")
        if problems:
            raise ValueError("; ".join(problems))
        names = [arm.name for arm in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names must be unique, got {names}")
        if PRETRAIN_ARM in names:
            raise ValueError(f"arm name {PRETRAIN_ARM!r} is reserved for the value pre-training data")
        if self.jobs > 1 and self.driver != "inprocess":
            raise ValueError(f"jobs = {self.jobs} needs driver 'inprocess': the live driver's arms share the serving "
                             "port and the broker and run one at a time")
        self._segments_valid()
        self._raters_valid()
        return self

    def _raters_valid(self) -> None:
        topics = [t.name for t in TOPICS]
        for key, given in (("rater_scale", self.rater_scale), ("rater_offset", self.rater_offset)):
            unknown = sorted(set(given) - set(topics))
            if unknown:
                raise ValueError(f"{key} names topics the corpus lacks: {unknown}; its topics are {topics}")
        bad = {name: f for name, f in self.rater_scale.items() if not 0 < f <= MAX_RATER_SCALE}
        if bad:
            raise ValueError(f"rater_scale factors must be in (0, {MAX_RATER_SCALE:g}], got {bad}")
        bad = {name: f for name, f in self.rater_offset.items() if not abs(f) <= MAX_RATER_SCALE}
        if bad:
            raise ValueError(f"rater_offset shifts must be within +-{MAX_RATER_SCALE:g}, got {bad}")

    def _segments_valid(self) -> None:
        if not self.segments:
            return
        names = [s.name for s in self.segments]
        if len(set(names)) != len(names):
            raise ValueError(f"segment names must be unique, got {names}")
        total = sum(s.share for s in self.segments)
        if abs(total - 1.0) > SHARE_TOLERANCE:
            raise ValueError(f"segment shares must sum to 1, got {total:g} ({names})")
        problems = [p for s in self.segments
                    for p in schedule_problems(s.schedule, self.styles, self.rollouts_per_arm, 1,
                                               f"the schedule of segment {s.name!r}")]
        if problems:
            raise ValueError("; ".join(problems))

    def preferred_style(self, rollout: int, segment: str | None = None) -> str:
        """The style preferred at ``rollout`` (0-based): by ``segment``'s users when named, else
        by ``schedule``'s."""
        return [p.style for p in self.segment_schedule(segment) if p.from_rollout <= rollout][-1]

    def segment_schedule(self, segment: str | None) -> list[PreferencePhase]:
        """The schedule of the named segment (``schedule`` for None); an unknown name raises."""
        if segment is None:
            return self.schedule
        for s in self.segments:
            if s.name == segment:
                return s.schedule
        raise ValueError(f"unknown user segment {segment!r}; the scenario has {[s.name for s in self.segments]}")

    @property
    def switch_rollouts(self) -> list[int]:
        """Rollouts at which the preference switches (every phase start but the first)."""
        return [p.from_rollout for p in self.schedule[1:]]


class AgentConfig(Section):
    """The simulated agent scenario (``online-sao agent``): arithmetic tasks solved with the calculator
    tool through the live stack, judged on the final answer, the reward sent as feedback."""

    name: str = Field("agent", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """Names the run: results directory, topics, consumer group."""
    tasks: int = Field(240, ge=1)
    """Tasks (agent episodes) the run sends."""
    requests_per_second: float = Field(1.5, gt=0)
    """Mean rate at which tasks start (seeded Poisson arrivals); each task sends one request per turn."""
    concurrency: int = Field(4, ge=1)
    """Tasks in flight at most."""
    window: int = Field(40, ge=1)
    """Rolling window (tasks, in the order they finished) of the success rate over time."""
    progress_every: int = Field(20, ge=1)
    """A progress line every this many finished tasks."""
    max_tokens: int = Field(48, ge=1)
    """max_tokens of each request (a call is about 25 tokens, a final answer under 15); at most
    ``serving.max_new_tokens`` (``agent`` refuses more before it starts)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of each request."""
    max_tool_rounds: int = Field(2, ge=1)
    """Tool results the agent sends back at most per task; an answer still calling after them is final."""
    seed: int = 0
    """Seed of the tasks (another stream than the corpus's) and of the arrival times."""
    results_dir: Path | None = None
    """Results (per-task JSONL, summary JSON, plot) and the run's state (default data_dir/agent/<name>)."""


class AppConfig(Config):
    """The core tree plus the applications' sections."""

    model: AppModelConfig = AppModelConfig()
    """Which model is served and trained, and how the default one is built."""
    experiment: ExperimentConfig = ExperimentConfig()
    """The drifting-preference experiment (simulated users, judge, report)."""
    agent: AgentConfig = AgentConfig()
    """The simulated agent scenario (tool use through the live stack)."""


def client_api_key(cfg: Config) -> str | None:
    """The key a run's own client sends to the serving it started: the first of ``serving.api_keys``
    (None without keys: serving then asks loopback callers for none)."""
    return cfg.serving.api_keys[0].get_secret_value() if cfg.serving.api_keys else None


def load_app_config(path=None, environ=None, overrides=None) -> AppConfig:
    """:func:`online_sao.config.load_config` with the applications' tree."""
    return load_config(path, environ=environ, overrides=overrides, schema=AppConfig)
