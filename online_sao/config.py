"""One configuration tree for every component of online-sao.

Each component owns one section (a pydantic model); every field has a docstring
that says what it controls. Runs are described by YAML files in ``configs/``;
any field can be overridden from the environment with
``ONLINE_SAO__<SECTION>__<FIELD>=value`` (double underscores separate levels,
values are parsed as YAML scalars). Unknown keys and invalid values raise
:class:`ConfigError` naming the offending key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Mapping, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from online_sao.schemas import MAX_ABS_REWARD, MAX_SCORES_PER_REWARD, ScoreName

ENV_PREFIX = "ONLINE_SAO__"



class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class PathsConfig(Section):
    data_dir: Path = Path("data")
    """Root for everything the service writes locally: broker data, models, spool,
    weights, checkpoints, MLflow database. Relative paths resolve against the
    working directory."""


class TopicsConfig(Section):
    interactions: str = "sao.interactions"
    """Topic of completed interactions (rollouts), keyed by interaction id."""
    rewards: str = "sao.rewards"
    """Topic of reward records, keyed by interaction id (co-partitioned with interactions)."""
    weights: str = "sao.weights"
    """Compacted topic of weights-published and rollback notices."""
    dead_letters: str = "sao.dead-letters"
    """Records that failed validation, with the reason."""


class KafkaConfig(Section):
    bootstrap_servers: str | None = None
    """An existing cluster (``host:port[,host:port]``). When set it is used as is
    and no local broker is started; when unset, ``online-sao kafka up`` runs one."""
    host: str = "127.0.0.1"
    """Address the local broker listens on (loopback by default)."""
    port: int = Field(19092, ge=1, le=65535)
    """Client port of the local broker."""
    controller_port: int = Field(19093, ge=1, le=65535)
    """KRaft controller port of the local broker."""
    kafka_version: str = "4.4.0"
    """Version of ``org.apache.kafka:kafka_2.13`` resolved from Maven Central."""
    heap_mb: int = Field(512, ge=128)
    """Java heap of the local broker, sized for a small machine."""
    startup_timeout_s: float = Field(90.0, gt=0)
    """How long ``kafka up`` waits for the broker to accept connections."""
    client_timeout_s: float = Field(10.0, gt=0)
    """How long a client waits for the cluster (first connection, metadata of a send,
    an admin request) before the stream backend raises StreamUnavailable."""
    partitions: int = Field(4, ge=1)
    """Partitions of the interactions and rewards topics (same count: co-partitioned)."""
    retention_ms: int = Field(7 * 24 * 3600 * 1000, ge=-1)
    """Retention of interactions, rewards and dead letters (-1 keeps forever)."""
    replication_factor: int = Field(1, ge=1)
    """Replication factor of created topics (1 for the local single node)."""
    topics: TopicsConfig = TopicsConfig()
    """Topic names."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """Passed through to kafka-python clients."""
    sasl_mechanism: str | None = None
    """SASL mechanism (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512) for SASL protocols."""
    sasl_username: str | None = None
    """SASL user name."""
    sasl_password: SecretStr | None = None
    """SASL password."""
    ssl_cafile: Path | None = None
    """CA bundle for SSL protocols."""

    @model_validator(mode="after")
    def _ports_differ(self) -> "KafkaConfig":
        if self.port == self.controller_port:
            raise ValueError("port and controller_port must differ")
        return self

    @property
    def bootstrap(self) -> str:
        """The address clients connect to: the configured cluster or the local broker."""
        return self.bootstrap_servers or f"{self.host}:{self.port}"

    @property
    def is_local(self) -> bool:
        return self.bootstrap_servers is None


class ModelConfig(Section):
    path: Path | None = None
    """A local Hugging Face model directory to serve and train. When unset the
    project's default model is built (once, cached) under data_dir/models/base."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for serving and training."""


class AlgorithmConfig(Section):
    name: Literal["sao", "running_mean", "grpo", "ppo"] = "sao"
    """Learning rule: SAO, or a baseline kept for comparison (SAO.md section 4)."""
    eps_low: float = Field(0.3, gt=0, lt=1)
    """DIS band: a token is kept only when 1 - eps_low < ratio."""
    eps_high: float = Field(5.0, gt=0)
    """DIS band: a token is kept only when ratio < 1 + eps_high."""
    use_dis: bool = True
    """Apply the DIS mask against the engine's behaviour log-probs (grpo may turn it off)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of token-level GAE."""
    lambda_alpha: float = Field(1.5, gt=0)
    """lambda_policy = 1 - 1/(alpha * l), l the number of action tokens of a rollout."""
    lambda_critic: float = Field(1.0, ge=0, le=1)
    """GAE lambda for critic targets (1 = Monte-Carlo returns)."""
    critic_updates: int = Field(2, ge=1)
    """Critic updates per policy step (K)."""
    freeze_critic_attention: bool = True
    """Freeze every attention parameter of the critic."""
    critic_trainable_layers: int | None = Field(None, ge=1)
    """With frozen attention, train the feed-forward blocks of only the last this many decoder
    layers (and the head); None trains those of every layer (the paper's critic). Not in the
    paper: fewer trained parameters memorise fewer particular answers (docs/EXPERIMENTS.md
    section 11)."""
    policy_lr: float = Field(1e-5, gt=0)
    """AdamW learning rate of the policy."""
    critic_lr: float = Field(5e-5, gt=0)
    """AdamW learning rate of the critic (about 5x the policy's)."""
    critic_warmup_steps: int = Field(10, ge=0)
    """Linear warm-up of the critic learning rate, in critic updates."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay of both optimisers."""
    optimizer_kernel: Literal["fused", "foreach", "for_loop"] = "fused"
    """How AdamW updates the parameters: ``fused`` (one kernel for all parameters; on CPU the
    optimiser's time in a SAO step of the default model 2.5x less than with ``foreach``, the
    whole step's gain inside the VM's noise: benchmarks/results/learner_optimizer.md),
    ``foreach`` (torch's default: a kernel per operation over all parameters) or ``for_loop``
    (a kernel per operation per parameter). The same update up to float rounding."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping of both models."""
    normalize_advantages: bool = False
    """Whiten advantages per step (the paper does not; off by default)."""
    critic_order: Literal["fit_then_judge", "judge_then_fit", "replay_then_judge"] = "judge_then_fit"
    """Where SAO's K critic updates run relative to the values its advantages use (SAO.md
    section 3). ``fit_then_judge``: K updates on the step's rollouts, then values and advantages
    (the paper's literal reading; the batch's own returns leak into its baseline and shrink its
    advantages). ``judge_then_fit``: values and advantages from the critic as it stands, then K
    updates on the step's rollouts. ``replay_then_judge``: K updates on the last
    ``critic_replay_rollouts`` already-trained rollouts (not this step's), then values and
    advantages, then the step's rollouts join that window. Default ``judge_then_fit``: in the
    drifting-style scenario (8 seeds, docs/EXPERIMENTS.md section 6) no order changed the reward
    measurably, and ``judge_then_fit`` kept advantages 1.5x larger than ``fit_then_judge`` at no
    extra cost (``replay_then_judge`` costs K updates on the whole window per step)."""
    critic_after_metrics: bool = False
    """Under ``critic_order: judge_then_fit``, also report ``value_loss_after`` and
    ``explained_variance_after`` (the critic on the step's rollouts after its K updates): one more
    critic forward per step, which the step's own values do not need (a quarter of the critic's
    forward work at K = 2). The other orders report them always: their advantages use those values."""
    critic_replay_rollouts: int = Field(16, ge=1)
    """Size, in rollouts, of the window of recent already-trained rollouts that
    ``critic_order: replay_then_judge`` fits the critic on (each update is one full-batch
    update on the whole window, so critic compute per step grows with it)."""
    critic_rewarm_rollouts: int = Field(0, ge=0)
    """SAO: after the learner forgets what it learned under an old preference (a drift restart,
    trainer/plasticity.py, which puts the critic back to its freshly built weights), the critic
    re-warms over the next this many rollouts: each step's K updates fit every rollout since the
    restart, and meanwhile the policy's advantages take the mean reward of those rollouts as
    their baseline instead of the cold critic's values (not in the paper, 0 turns it off). Before
    its traffic the learner can pre-train the critic on logged rollouts (``learn
    --pretrain-critic``; 64 in the drift experiments); after a restart no such rollouts exist, so
    the critic learns from the traffic while a running mean stands in for it (SAO.md: a cold critic is the main cause of early instability)."""
    value_shrinkage_window: int = Field(0, ge=0)
    """SAO: shrink the critic's values toward the mean reward of the last this many rollouts, by
    the slope of their returns on their out-of-sample values (online_sao/value_shrinkage.py; not
    in the paper, 0 turns it off). Where the critic predicts new answers no better than a
    constant, the advantages fall back to a running-mean baseline instead of carrying its
    errors; where it predicts them, its values stay."""
    value_level_window: int = Field(0, ge=0)
    """SAO: take the level of the critic's values from the mean reward of the last this many
    rollouts and only their course along each answer from the critic: V'_t = m + V_t - V_first,
    with V_first the critic's value at the rollout's first action token, its estimate of the
    prompt's value (online_sao/value_shrinkage.py; not in the paper, 0 turns it off). For
    traffic whose prompts do not predict the reward, where a critic's level chases its last few
    batches; it discards what the critic knows about one prompt against another."""
    kl_beta: float = Field(0.0, ge=0)
    """Weight of the KL penalty to a reference policy (SAO.md section 3b; not in the paper, 0 turns
    it off): the k3 estimate exp(d) - 1 - d, d = log pi_ref - log pi_theta, per action token,
    averaged like the DIS loss. Keeps the policy near the reference, so a style it stopped
    preferring is still sampled now and then. Costs one more model copy in the learner (the
    reference) and a forward pass of it per step."""
    kl_reference: Literal["initial", "ema"] = "initial"
    """The reference of the KL penalty: ``initial`` = the policy the learner started from (the
    model directory's weights), ``ema`` = a slow exponential moving average of the policy
    (``kl_ema_rate``), which follows lasting change but not one phase's swing."""
    kl_ema_rate: float = Field(0.01, gt=0, le=1)
    """With ``kl_reference: ema``: after every applied policy update the reference moves this
    share of the way to the policy (reference = (1 - rate) reference + rate policy)."""
    entropy_alpha: float = Field(0.0, ge=0)
    """Weight of the entropy bonus alpha * H(pi_theta) over action tokens (SAO.md section 3b; not
    in the paper, 0 turns it off), averaged like the DIS loss: pushes against one answer mode
    taking all the probability."""
    running_mean_window: int = Field(128, ge=1)
    """W of the running_mean baseline."""
    group_size: int = Field(4, ge=2)
    """G of the grpo baseline."""
    clip_low: float = Field(0.2, gt=0, lt=1)
    """PPO/GRPO clip range below 1."""
    clip_high: float = Field(0.28, gt=0)
    """PPO/GRPO clip range above 1 (clip-higher)."""
    ppo_lambda: float = Field(0.95, ge=0, le=1)
    """GAE lambda of the ppo baseline."""
    ppo_epochs: int = Field(2, ge=1)
    """Full-batch policy updates per step of the grpo and ppo baselines, all against
    the pi_old of the step's start (with 1 the clip never acts: pi_old is the policy)."""

    @model_validator(mode="after")
    def _critic_layers_need_frozen_attention(self) -> "AlgorithmConfig":
        if self.critic_trainable_layers is not None and not self.freeze_critic_attention:
            raise ValueError("critic_trainable_layers needs freeze_critic_attention: true "
                             "(it narrows the trained feed-forward blocks)")
        if self.value_shrinkage_window and self.value_level_window:
            raise ValueError("value_shrinkage_window and value_level_window are two ways to bring the "
                             "critic's values toward a running mean: set one of them")
        return self


DEFAULT_ID_MEMORY_S = 86_400.0
"""Default of reward.memory_s: a day covers any broker or serving outage an operator lets run
before intervening, at the size of a day's ids (bounded anyway by the join's max_pending)."""


class RewardConfig(Section):
    min_value: float = Field(-10.0, ge=-MAX_ABS_REWARD)
    """Smallest reward accepted (422 below); no lower than the records allow (-1e6)."""
    max_value: float = Field(10.0, le=MAX_ABS_REWARD)
    """Largest reward accepted (422 above); no higher than the records allow (1e6)."""
    window_s: float = Field(300.0, gt=0)
    """How long after an interaction a reward is accepted and joined."""
    aggregation: Literal["first", "last", "sum", "mean"] = "last"
    """How several rewards for one interaction combine."""
    on_missing: Literal["default", "drop"] = "drop"
    """What happens to an interaction whose window closes without a reward."""
    default_value: float = 0.0
    """Reward given when on_missing is 'default'."""
    group_timeout_s: float | None = Field(30.0, gt=0)
    """grpo: how long (record time) the oldest ready member of an incomplete group waits for the
    rest; then the group is trained on as it is and counted (``join_incomplete_groups``). A group
    whose member lost its reward would otherwise never complete. None waits forever."""
    memory_s: float | None = Field(None, gt=0)
    """How long after its creation the learner remembers an interaction id (trainer/id_memory.py).
    An interaction first read later than that is refused (counted as join_expired_interactions), so
    none is ever trained twice, whenever a copy is replayed. None: one day, or two reward windows if
    longer. At least two reward windows (a late reward must still be recognised as late)."""

    @model_validator(mode="after")
    def _range(self) -> "RewardConfig":
        if not self.min_value < self.max_value:
            raise ValueError("min_value must be below max_value")
        if self.memory_s is not None and self.memory_s < 2 * self.window_s:
            raise ValueError(f"memory_s ({self.memory_s:g}) must be at least two reward windows "
                             f"(2 x window_s = {2 * self.window_s:g})")
        return self

    @property
    def id_memory_s(self) -> float:
        """``memory_s``, or its default when None."""
        return self.memory_s if self.memory_s is not None else max(DEFAULT_ID_MEMORY_S, 2 * self.window_s)


class ServingConfig(Section):
    host: str = "127.0.0.1"
    """Bind address of the HTTP endpoint."""
    port: int = Field(8000, ge=0, le=65535)
    """Bind port (0 picks a free one)."""
    engine: Literal["torch", "vllm"] = "torch"
    """Inference engine: native PyTorch (default) or vLLM."""
    model_name: str = "online-sao"
    """Model name served in /v1/models and accepted in requests."""
    deployment_id: str = "local"
    """Names this deployment; signed interaction ids are bound to it."""
    feedback_secret: SecretStr = SecretStr("change-me-online-sao-dev-secret")
    """HMAC secret that signs interaction ids (set your own in production)."""
    api_keys: list[SecretStr] = []
    """Accepted API keys; required unless bound to loopback."""
    rate_limit_per_minute: int = Field(600, ge=1)
    """Requests per minute per API key; without keys, per client address (loopback callers
    are not limited; docs/SERVING.md, Access)."""
    rate_limit_burst: int = Field(20, ge=1)
    """Requests a key (or address) may send at once before the per-minute rate applies
    (token-bucket size)."""
    max_batch_size: int = Field(16, ge=1)
    """Sequences decoded together (continuous batching)."""
    max_prefill_tokens: int = Field(8192, ge=1)
    """Torch engine: padded prompt positions (requests x longest prompt) one prefill forward may
    hold. Requests admitted in the same round are prefilled together up to this bound, in order;
    a prompt longer than it is prefilled alone. Bounds the activation memory of a burst."""
    kv_layout: Literal["padded", "flat"] = "padded"
    """Torch engine: how the running batch's cache is laid out. ``padded``: a row per sequence,
    left-padded to the longest, prompts prefilled in forwards of their own (serving/engine/kv_batch.py).
    ``flat``: every sequence's columns in one row with a mask per query, the round's new prompts
    prefilled inside its decode forward (serving/engine/flat_kv.py); ``max_prefill_tokens`` then
    bounds the prompt tokens one forward takes on. ``flat`` is faster where a forward's fixed cost
    dominates (small models and batches on a CPU: benchmarks/results/kv_layout.md); its attention
    reads every running sequence's cache, so with large batches of long contexts ``padded`` is
    cheaper. It switches the model from transformers' ``sdpa`` to serving/engine/grouped_attention.py."""
    compile: bool = False
    """Torch engine: compile the model's transformer body with ``torch.compile`` (dynamic shapes)
    when the engine is built; the hot-swap's spare copy is compiled too and shares the graphs. The
    engine compiles while it starts, before the server reports ready (tens of seconds on 2 CPU
    cores, less from inductor's on-disk cache; a C++ compiler is needed, the service image has
    one); a batch shape it has not met yet may still compile later, stalling decoding once. Either
    ``kv_layout``. Measured in benchmarks/results/engine_compile.md (flat) and
    engine_compile_padded.md. False runs eagerly."""
    swap_in_place: bool = False
    """Memory-short hot-swap: copy new weights into the serving model between two
    decode steps instead of loading a second copy off the request path (half the
    weight memory, a stall as long as the copy)."""
    torch_threads: int | None = Field(None, ge=1)
    """Intra-op CPU threads of torch, set process-wide when the engine starts
    (None keeps torch's default). On a busy small machine 1 is often fastest:
    spinning OpenMP workers that wait for a core cost more than they save."""
    max_prompt_tokens: int = Field(1024, ge=1)
    """Longest prompt accepted (413 above)."""
    max_new_tokens: int = Field(256, ge=1)
    """Largest max_tokens a request may ask for."""
    max_request_bytes: int = Field(1_000_000, ge=1024)
    """Largest request body accepted (413 above)."""
    spool_dir: Path | None = None
    """Append-only spool used while the broker is unreachable (default data_dir/spool)."""
    redact_text: bool = False
    """Drop prompt and response text from logged records (token ids are kept)."""
    redact_hook: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """``package.module:function`` called with the prompt and response texts and the request's
    metadata before an interaction is logged; it returns the texts to log, or None for none (token
    ids are kept). Imported when serving starts. Built in: ``serving.redaction:mask_contacts``
    (e-mail addresses and phone numbers masked). Ignored when redact_text drops the texts."""
    spool_max_bytes: int = Field(1 << 30, ge=1024)
    """Largest spool on disk; beyond it (or on a full disk) the server can no longer log
    while the broker is unreachable and answers 503 for new work."""
    log_durability: Literal["write_ahead", "memory"] = "write_ahead"
    """When a request is acknowledged relative to its record. ``write_ahead``: the
    interaction (or reward) is appended to the spool and fsynced before the client gets
    its response (streams: before the final chunk); concurrent requests share one fsync.
    A crash or SIGKILL loses nothing acknowledged; each request waits for one fsync
    (measured in benchmarks/results/write_ahead.md). ``memory``: records wait in memory
    for the broker and reach the spool only when it stalls; nothing waits on the disk,
    but records acknowledged shortly before a crash are lost."""
    log_ack_timeout_s: float = Field(10.0, gt=0)
    """write_ahead: how long a response waits for its record to become durable (spool
    fsync, or the broker's acknowledgement while the spool cannot be written) before it
    is answered 503 instead (the record may still reach the broker later)."""
    log_queue_size: int = Field(10_000, ge=1)
    """Records waiting for the log sender above which new work gets 503 (admitted work is never dropped)."""
    log_window: int = Field(256, ge=1)
    """Records handed to the producer and not yet acknowledged, at most."""
    log_stall_s: float = Field(5.0, gt=0)
    """A record unacknowledged this long means the broker is unreachable: start spooling."""
    log_retry_s: float = Field(1.0, gt=0)
    """Pause before a failed record is sent again during spool replay."""
    log_ship_interval_s: float = Field(0.25, ge=0, le=10)
    """write_ahead: the sender ships spooled records to the broker in cycles at least this far
    apart, so one spool read, one produce request and one watermark write serve every record
    of the cycle. Clients do not wait for it (their records are durable in the spool); the
    learner sees a record up to this much later. 0 ships each record at once (more CPU per
    record beside the engine: benchmarks/results/serving.md)."""
    keep_alive_s: float = Field(65.0, gt=0)
    """Seconds an idle HTTP keep-alive connection stays open. Longer than clients' own idle
    expiry (httpx, hence the openai client: 5 s) so that a client never sends a request on a
    connection the server is closing at that instant (seen as connection resets under load
    with uvicorn's default of 5 s)."""
    shutdown_flush_s: float = Field(10.0, ge=0)
    """On shutdown, how long to keep delivering before the rest is left in the spool."""
    max_trajectories: int = Field(1024, ge=1)
    """Recent trajectories kept in memory so a request can continue one (parent_interaction_id);
    an older or evicted parent is refused with 404."""
    tool_call_parser: Literal["hermes", "none"] = "hermes"
    """How tool calls are read from a chat answer when the request has ``tools``: ``hermes`` is
    ``<tool_call>{"name", "arguments"}</tool_call>`` (Qwen-family templates); ``none`` refuses
    requests with tools (400)."""
    segment_field: str | None = Field(None, min_length=1, max_length=64)
    """Where a request's segment key comes from (docs/DEPLOY.md, "Segments"): None, the OpenAI
    ``user`` field; otherwise this key of the request's ``metadata`` (OpenAI's string map). The key
    is logged on the interaction (``segment``); a request without it has no segment, one whose
    value is not 1-256 printable characters is refused (400)."""
    monitor_window: int = Field(256, ge=1)
    """Newest answers over which serving computes its monitor gauges (mean length, repetition of
    ``deploy.monitor_ngram``-grams) for ``/metrics``."""

    @model_validator(mode="after")
    def _compile_fits_the_engine(self) -> "ServingConfig":
        if self.compile and self.engine != "torch":
            raise ValueError("serving.compile applies to the torch engine (vLLM compiles its own graphs)")
        return self


class TrainerConfig(Section):
    consumer_group: str = "sao-learner"
    """Kafka consumer group of the learner."""
    consumer_instance_id: str | None = Field("learner", min_length=1)
    """Static member id of the learner's consumer in its group (Kafka's ``group.instance.id``):
    a learner restarted after a crash takes its partitions back at once instead of waiting for
    the dead member's session (45 s) to expire; a graceful stop leaves the group. Two learners
    running at once in one group need different ids (the second would replace the first).
    None: a dynamic member."""
    min_rollouts: int = Field(4, ge=1)
    """A step starts once this many rewarded rollouts are ready ..."""
    token_budget: int = Field(2048, ge=1)
    """... or once they hold this many action tokens, whichever comes first."""
    max_rollouts_per_step: int = Field(32, ge=1)
    """Upper bound on a step's batch."""
    max_wait_s: float | None = Field(0.5, gt=0)
    """A step also starts, with fewer than min_rollouts, once rollouts have been
    ready this long (wall clock): light traffic must not leave them untrained, and a
    reward should reach serving within about a second (issue 17: freshness p50 was
    1.08 s with 2.0 at 2 requests/s, the wait for four rollouts;
    benchmarks/results/learner.md). Under load the batch fills before the deadline.
    None waits for min_rollouts or token_budget however long it takes."""
    max_version_lag: int | None = None
    """Drop rollouts sampled more than this many versions ago (None keeps all)."""
    publish_every: int = Field(1, ge=1)
    """Publish weights every N learner steps."""
    keep_versions: int = Field(3, ge=1)
    """Weight versions kept in the store (registered ones are always kept)."""
    checkpoint_every: int = Field(1, ge=1)
    """Checkpoint every N steps (offsets are committed only after a checkpoint)."""
    checkpoint_in_background: bool = True
    """Write checkpoints on a thread of their own while the learner trains on (the state is
    copied first; the offsets are committed after the write): a step no longer waits for the
    previous step's checkpoint to reach the disk. False writes each one before the next step."""
    weight_store: str | None = None
    """Directory or fsspec URL of published weights (default data_dir/weights);
    ``shm://<name>`` (host shared memory) or ``cuda-ipc://<name>`` (GPU memory)
    skip the disk when learner and serving share a host (docs/SERVING.md)."""
    checkpoint_dir: Path | None = None
    """Learner checkpoints (default data_dir/checkpoints)."""
    seed: int = 0
    """Seed of the learner."""
    poll_timeout_s: float = Field(0.2, gt=0)
    """Longest wait of one poll of the interactions and rewards topics; bounds how
    late a step starts after its last rollout became ready."""
    join_max_pending: int = Field(100_000, ge=1)
    """Interactions waiting for a reward (and, separately, rewards waiting for
    their interaction) held at most; past it the oldest is given up (counted)."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many steps of this process (tests, benchmarks); None runs on."""
    idle_timeout_s: float | None = Field(None, gt=0)
    """Stop when no record arrived and no step ran for this long (tests, benchmarks);
    None waits for data forever."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve rank 0's Prometheus metrics (the registry's monitors over the learner's window and at
    each decision, the learner's counters; trainer/exporter.py) on this port at ``/metrics``
    (None: off; 0: any free port)."""
    metrics_host: str = "127.0.0.1"
    """Address the learner's metrics listen on (``0.0.0.0`` to be scraped from another machine)."""
    pretrain_file: Path | None = None
    """JSON-lines file of encoded interaction and reward records for
    ``learn --pretrain-critic`` (joined on the records' own times, in any line order);
    None reads the retained history of the topics."""
    compile: bool = False
    """Compile the transformer bodies of the policy, the critic and the KL reference with
    ``torch.compile`` (dynamic shapes, in place: parameter names and checkpoints unchanged). On
    the CPU, SAO's model passes on the default model run 1.27x faster
    (benchmarks/results/compile.md); the first steps wait for the compilation (about a minute on
    2 cores, seconds from inductor's on-disk cache), which needs a C++ compiler (the service image
    has one). False runs eagerly."""


class MLflowConfig(Section):
    tracking_uri: str | None = None
    """MLflow tracking URI; default a SQLite database data_dir/mlflow.db (no server)."""
    experiment: str = "online-sao"
    """Experiment of learner and simulation runs."""
    registered_model: str = "online-sao-policy"
    """Name in the model registry."""
    register_every: int = Field(10, ge=1)
    """Register every M-th published version as 'candidate'; the previous candidate is decided on
    first (``deploy``: the gate and the monitors)."""


class DeployConfig(Section):
    """The registry's promotion gate and the monitors that can roll a candidate back
    (docs/DEPLOY.md, "The promotion gate")."""

    window: int = Field(128, ge=1)
    """Most recent trained rollouts (with their rewards and behaviour log-probs) kept; candidate
    and champion are both scored on those of them sampled by the candidate's version or newer
    (neither version was trained on those). The checkpoint carries it."""
    gate_min_rollouts: int = Field(32, ge=2)
    """The gate decides only with at least this many rollouts sampled since the candidate in the
    window; fewer: it refuses."""
    gate_min_ess: float = Field(8.0, gt=0)
    """Smallest effective sample size, (sum w)^2 / sum w^2, of either version's importance
    weights on the window; below it the estimate rests on a few rollouts and the gate refuses."""
    gate_confidence: float = Field(0.9, gt=0, lt=1)
    """Two-sided confidence of the normal interval on candidate minus champion."""
    gate_margin: float = Field(0.05, ge=0)
    """Non-inferiority margin, in reward units: promote when the interval's lower end is at least
    ``-gate_margin``, roll back when its upper end is below it, otherwise leave it undecided."""
    gate_weight_clip: float | None = Field(None, gt=1)
    """Cap on each rollout's importance ratio pi/mu before self-normalising (None: no cap);
    a cap trades bias for variance when one rollout would carry the whole estimate."""
    gate_champion_record: bool = True
    """When the champion's ESS on the window is under ``gate_min_ess`` (it is many versions behind
    and no canary answers with it), compare the candidate with the champion's record instead: its
    expected reward as last measured on traffic it could be scored on. A record never rolls a
    candidate back, and a drift restart starts without one (online_sao/gate_record.py;
    docs/DEPLOY.md, "The champion's record"). False: such decisions are refused."""
    gate_chunk: int = Field(16, ge=1)
    """Rollouts scored per forward pass when the gate computes a version's log-probs."""
    canary_share: float = Field(0.0, ge=0, lt=1)
    """Share of requests serving answers with the champion instead of the newest version (0: no
    canary). On, the learner announces every new champion on the weights topic, serving holds it
    in a second engine, and the gate adds the champion's own answers since the candidate was
    registered to its window, weighing every answer against the traffic's mixture of serving
    version and champion: the champion's weights stay under 1/share, however far the candidate
    has moved (docs/DEPLOY.md, "Canary")."""
    monitor_max_mean_length: float | None = Field(None, gt=0)
    """Roll back a candidate whose recent answers average more action tokens than this
    (None: off; a reward that pays for length shows here first)."""
    monitor_max_repetition: float | None = Field(None, gt=0, le=1)
    """Roll back a candidate whose recent answers repeat more than this share of their
    ``monitor_ngram``-grams (None: off)."""
    monitor_ngram: int = Field(3, ge=1)
    """n of the n-grams the repetition monitor counts."""
    monitor_max_dead_letter_share: float | None = Field(None, gt=0, le=1)
    """Roll back when more than this share of the records read since the candidate was
    registered went to the dead-letter topic (None: off)."""
    monitor_max_kl: float | None = Field(None, gt=0)
    """Roll back a candidate whose KL from the starting policy (the weights in ``model_dir``),
    estimated on its recent answers as the mean over their action tokens of
    ``k3 = exp(d) - 1 - d``, ``d = log pi_ref - log pi_candidate``, exceeds this (nats per token;
    None: off). On, rank 0 holds one more CPU copy of the policy for the reference."""
    monitor_min_scores: dict[ScoreName, float] = Field({}, max_length=MAX_SCORES_PER_REWARD)
    """Roll back a candidate when the mean of a named score (``Reward.scores``: what the reward's
    source measured besides the reward, e.g. the judge's ``quality``) over its recent answers falls
    below the floor given here, name -> floor (empty: off). Answers whose rewards carried no such
    score do not count; with none, the monitor has no value and cannot trip. Every score the window's
    rewards carry is shown as ``monitor_score_<name>`` whether or not it has a floor."""
    segments_top_n: int = Field(8, ge=1)
    """Segments shown by name in serving's ``/metrics`` and the learner's MLflow metrics, the
    largest by traffic; every other segment is folded into ``other`` (at most N + 1 labels)."""
    segments_window: int = Field(128, ge=1)
    """Newest rewards per segment over which the learner's ``segment.<name>.reward`` is the mean."""


class DriftConfig(Section):
    """Following a preference switch: a detector on the trained rewards and what the learner
    does when it fires (online_sao/drift.py, trainer/plasticity.py; docs/EXPERIMENTS.md)."""

    enabled: bool = False
    """Watch the rewards for a sustained drop (off: the paper's learner, which never restarts)."""
    recent: int = Field(16, ge=2)
    """Newest trained rewards whose mean is compared with the ``reference`` rewards before them."""
    reference: int = Field(48, ge=2)
    """Rewards before the ``recent`` ones: the level the drop is measured from."""
    min_drop: float = Field(0.2, gt=0)
    """Smallest fall of the mean reward, in reward units, that counts as a drift."""
    z_threshold: float = Field(3.0, gt=0)
    """...and the fall in standard errors (Welch): at 3, one test on a stable reward stream
    alarms with probability about 1e-3 under a normal approximation. Calibrated by replaying
    40 logged drift runs without restarts (docs/EXPERIMENTS.md section 10)."""
    policy_shrink: float = Field(0.0, ge=0, le=1)
    """On an alarm the policy becomes ``start + policy_shrink * (policy - start)``, ``start`` the
    weights in ``model_dir``: 0 restarts from them (every style sampled at its starting share
    again), 1 keeps the policy (shrink-and-perturb without the perturbation; Ash & Adams 2020)."""
    reset_critic: bool = True
    """On an alarm the critic returns to its initial weights: values fitted under the old
    preference mis-rank the new one's answers (explained variance about -2 after a switch)."""
    reset_optimizers: bool = True
    """On an alarm the optimisers' moment estimates are cleared (they point the old way)."""
    rollback_first: bool = False
    """On an alarm, first return policy and critic to their weights from the start of the
    detector's reference window (the weights that earned the reference level) and restart only
    if the next ``recent`` rewards of answers sampled by the restored version are still below
    that level by the same test. For a drop of the learner's own quality, which a restart would
    answer by discarding what it learned (docs/EXPERIMENTS.md section 17); a real switch pays
    about ``recent`` more rollouts of delay. Keeps about ``(reference + recent) / recent + 2``
    snapshots of policy and critic in memory."""
    rollback_score: str | None = None
    """With ``rollback_first``: roll back only when this named score of the rewards
    (``Reward.scores``, e.g. a judge's ``quality``) fell over the alarm's two windows as well, by
    at least ``rollback_score_z`` Welch standard errors; an alarm with the score held restarts at
    once, since a preference change leaves the answers' quality as it was. Where either window has
    fewer than two rollouts with the score, the alarm rolls back. None: every alarm rolls back first."""
    rollback_score_z: float = Field(2.0, gt=0)
    """The score's fall, in standard errors, that makes an alarm a roll-back (``rollback_score``)."""


class Config(Section):
    paths: PathsConfig = PathsConfig()
    """Where local state lives."""
    kafka: KafkaConfig = KafkaConfig()
    """Broker and topics."""
    model: ModelConfig = ModelConfig()
    """Which model is served and trained."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Learning rule."""
    reward: RewardConfig = RewardConfig()
    """Reward validation and joining."""
    serving: ServingConfig = ServingConfig()
    """HTTP endpoint."""
    trainer: TrainerConfig = TrainerConfig()
    """Learner loop."""
    mlflow: MLflowConfig = MLflowConfig()
    """Experiment tracking and registry."""
    deploy: DeployConfig = DeployConfig()
    """Promotion gate and monitors of the registry."""
    drift: DriftConfig = DriftConfig()
    """Detecting a preference switch and restarting the learner's exploration."""

    @property
    def data_dir(self) -> Path:
        return self.paths.data_dir.expanduser().resolve()

    @property
    def model_dir(self) -> Path:
        return (self.model.path or self.data_dir / "models" / "base").expanduser().resolve()

    @property
    def spool_dir(self) -> Path:
        return (self.serving.spool_dir or self.data_dir / "spool").expanduser().resolve()

    @property
    def weight_store_url(self) -> str:
        return self.trainer.weight_store or str(self.data_dir / "weights")

    @property
    def checkpoint_dir(self) -> Path:
        return (self.trainer.checkpoint_dir or self.data_dir / "checkpoints").expanduser().resolve()

    @property
    def mlflow_uri(self) -> str:
        return self.mlflow.tracking_uri or f"sqlite:///{self.data_dir / 'mlflow.db'}"


C = TypeVar("C", bound="Config")


def _apply_env(raw: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        keys = [k.lower() for k in name[len(ENV_PREFIX):].split("__") if k]
        if not keys:
            continue
        node = raw
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{name}: {'.'.join(keys[:-1])} is not a section")
            node = child
        node[keys[-1]] = yaml.safe_load(value) if value != "" else None
    return raw


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{key}: {msg}")
    return "invalid configuration: " + "; ".join(lines)


def load_config(path: str | Path | None = None, environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None, schema: type[C] = Config) -> C:  # type: ignore[assignment]
    """Read a YAML file (optional), apply environment and explicit overrides, validate against
    ``schema`` (the core tree, or an application's extension of it such as ``apps.config.AppConfig``)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"configuration file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        raw = loaded or {}
    raw = _apply_env(raw, os.environ if environ is None else environ)
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def dump_config(cfg: Config, reveal_secrets: bool = False) -> str:
    """The resolved configuration as YAML; secrets are masked unless ``reveal_secrets``
    (used to hand a resolved configuration to a child process through a private file)."""
    data = cfg.model_dump(mode="json")
    if reveal_secrets:
        _reveal(cfg, data)
    return yaml.safe_dump(data, sort_keys=False)


def flat_settings(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``section.field`` -> value of every leaf of a nested mapping (a configuration's JSON dump: secrets
    masked); a list is a leaf, an empty mapping has none."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping):
            flat.update(flat_settings(value, path))
        else:
            flat[path] = value
    return flat


def _reveal(model: BaseModel, data: dict[str, Any]) -> None:
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, SecretStr):
            data[name] = value.get_secret_value()
        elif isinstance(value, list) and value and isinstance(value[0], SecretStr):
            data[name] = [v.get_secret_value() for v in value]
        elif isinstance(value, BaseModel):
            _reveal(value, data[name])
