"""The learner loop and where it tracks its runs and registers its versions."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_serializer, field_validator

from online_sao.config.base import Section, expand_home, mask_uri_password

STORE_NAME_PATTERN = r"[A-Za-z0-9_-]{1,100}"
"""The ``<name>`` of a ``shm://<name>`` or ``cuda-ipc://<name>`` weight store: it becomes part of
file names in ``/dev/shm``. Here, not in online_sao/weights, so the configuration checks it
without importing torch; the stores match their names and locations with it."""
STORE_NAME_RULE = "use 1-100 letters, digits, '_' or '-'"
"""What :data:`STORE_NAME_PATTERN` allows, in words."""
NAMED_STORE_SCHEMES = ("shm://", "cuda-ipc://")
"""Weight-store URLs whose rest is a store name (online_sao/weights: open_weight_store)."""


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
    """Upper bound on a step's batch, but for one rollout (grpo: one group) per rank, which a step of
    several ranks always takes."""
    max_wait_s: float | None = Field(0.5, gt=0)
    """A step also starts, with fewer than min_rollouts, once rollouts have been
    ready this long (wall clock): light traffic must not leave them untrained, and a
    reward should reach serving within about a second (issue 17: freshness p50 was
    1.08 s with 2.0 at 2 requests/s, the wait for four rollouts;
    benchmarks/results/learner.md). Under load the batch fills before the deadline.
    None waits for min_rollouts or token_budget however long it takes. On several ranks (torchrun) a
    step needs a rollout (grpo: a group) for every rank whatever this says: fewer wait for more traffic
    (logged once per wait)."""
    max_version_lag: int | None = Field(None, ge=0)
    """Drop rollouts sampled more than this many versions ago (None keeps all; 0 trains only
    rollouts of the learner's current version)."""
    publish_every: int = Field(1, ge=1)
    """Publish weights every N learner steps."""
    keep_versions: int = Field(3, ge=1)
    """Newest weight versions kept in the store (the registry's candidate and champion are kept too)."""
    checkpoint_every: int = Field(1, ge=1)
    """Checkpoint every N steps (offsets are committed only after a checkpoint)."""
    checkpoint_in_background: bool = True
    """Write checkpoints on a thread of their own while the learner trains on (the state is
    copied first; the offsets are committed after the write): a step no longer waits for the
    previous step's checkpoint to reach the disk. False writes each one before the next step."""
    weight_store: str | None = None
    """Directory or fsspec URL of published weights (default data_dir/weights);
    ``shm://<name>`` (host shared memory) or ``cuda-ipc://<name>`` (GPU memory)
    skip the disk when learner and serving share a host (docs/SERVING.md); their ``<name>`` is 1-100
    letters, digits, '_' or '-'. A password in a URL is shown and logged as ``user:***@``."""
    checkpoint_dir: Path | None = None
    """Learner checkpoints (default data_dir/checkpoints)."""
    ledger_segment_bytes: int = Field(64 * 2**20, ge=1)
    """Size at which the learner's ledger of trained ids (``<checkpoint_dir>/ledger/``) starts a new
    segment file, named by its first step: the next checkpoint appends to a new segment once the
    current one holds this many bytes. Only the current segment is ever read or truncated by the
    learner; older (sealed) ones may be archived or deleted (``online-sao ledger sealed``,
    docs/RELIABILITY.md). A trained rollout costs about 116 bytes of ledger, and as much again per
    earlier turn it absorbed (serving's ids have 113 characters): at 10 rollouts/s the ledger grows about 100 MB a day, and the default 64 MiB makes
    a segment about every 16 hours (1 starts a segment at every checkpoint).
    Checkpoint directories of the layout before segments (one ``ledger.jsonl``) are migrated on the
    learner's start: that file becomes the first segment."""
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
    collective_timeout_s: float | None = Field(None, gt=0)
    """Under torchrun: how long a rank waits in one collective (a broadcast of the step's rollouts,
    a vote, FSDP's gathers) for its peers before it fails, which ends the job (torchrun stops the
    other ranks). None keeps torch's default: 30 minutes on gloo, 10 on NCCL. A rank that stops
    answering (a hung GPU, a frozen node) holds the others this long. Keep it above the longest
    time rank 0 spends alone while the others wait: its registry calls wait out an MLflow outage
    (docs/RELIABILITY.md), so a short value turns an outage into a failed job."""
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
    pretrain_max_rollouts: int = Field(4096, gt=0)
    """Most logged rollouts ``learn --pretrain-critic`` fits the critic on: the newest usable ones of
    the starting version, in the order the reward join hands them out (the order their records were
    read: offsets within a partition; record time in a file). The read holds no more than these (and
    the rollouts of the join's open windows) whatever the topics retain: holding all of a week's
    retention ran the learner out of memory before its first step. A rollout of 1,000 tokens takes
    about 130 kB of host memory: the default about 0.5 GB; each training batch is put on the device
    only when it trains."""
    compile: bool = False
    """Compile the transformer bodies of the policy, the critic and the KL reference with
    ``torch.compile`` (dynamic shapes, in place: parameter names and checkpoints unchanged). On
    the CPU, SAO's model passes on the default model run 1.27x faster
    (benchmarks/results/compile.md); the first steps wait for the compilation (about a minute on
    2 cores, seconds from inductor's on-disk cache), which needs a C++ compiler (the service image
    has one). False runs eagerly."""

    _pretrain_file_home = field_validator("pretrain_file")(expand_home)
    """``~`` expanded: the learner opens the file as given (trainer/learner.py)."""

    @field_validator("weight_store")
    @classmethod
    def _store_name_valid(cls, url: str | None) -> str | None:
        """A shared-memory store's name checked at load: the store refused it only when the learner
        opened it, with a traceback after the models were built."""
        for scheme in NAMED_STORE_SCHEMES:
            name = url[len(scheme):] if url is not None and url.startswith(scheme) else None
            if name is not None and not re.fullmatch(STORE_NAME_PATTERN, name):
                raise ValueError(f"{scheme}<name>: store name {name!r}: {STORE_NAME_RULE}")
        return url

    @field_serializer("weight_store", when_used="json")
    def _store_password_masked(self, url: str | None) -> str | None:
        return mask_uri_password(url)


class MLflowConfig(Section):
    tracking_uri: str | None = None
    """MLflow tracking URI; default a SQLite database data_dir/mlflow.db (no server). A password in
    it (``postgresql://user:pw@db/mlflow``) is shown and logged as ``user:***@``, one given as a
    query parameter ``password``, ``passwd`` or ``pwd`` (``?user=ml&password=pw``) as ``password=***``."""
    experiment: str = "online-sao"
    """Experiment of learner and simulation runs."""
    registered_model: str = "online-sao-policy"
    """Name in the model registry."""
    register_every: int = Field(10, ge=1)
    """Register every M-th published version as 'candidate'; the previous candidate is decided on
    first (``deploy``: the gate and the monitors)."""
    keep_registered_artifacts: int = Field(5, ge=1)
    """Registered versions whose model directory stays in MLflow's artifacts: the newest N, plus
    every version holding an alias (``candidate``, ``champion``, or one an operator set to keep a
    version). After each registration the learner deletes the model directories of the others
    and tags their registry versions ``weights_pruned=true``; the versions and their tags (the
    deploy decisions' record) stay. Each registration copies a whole model into the artifacts
    (4 MB on the default model, GBs on an LLM): unpruned, the default model at 1 step/s filled
    37 GB a day. At least 1; the default 5 leaves the last few candidates to roll back to by hand
    (docs/DEPLOY.md, "Registry retention")."""
    log_every_steps: int = Field(10, ge=1)
    """Log the learner's cycle metrics to MLflow at every N-th step (the steps that are multiples
    of N) and, for the steps since, when the learner stops: the step's own figures (its metrics,
    times and rates; a 0/1 flag such as ``drift_alarm`` becomes the share of steps it was set on)
    as their mean over the steps since the last log (NaN left out; NaN when no step had a
    number), the readings taken at a cycle's end (counters, ``policy_version``, the monitors,
    keeping-up, segments) as the newest. A logged step is about 91 metric rows, 50 KB of
    tracking database: logged every step at 1 step/s that filled a 10 Gi PostgreSQL in two days.
    Prometheus (``trainer.metrics_port``) still reads every step; a registry decision's
    ``registry_monitor_*`` and pre-training metrics are logged when they happen. A learner
    killed (not stopped) loses the steps not yet logged. 1 logs every step (the experiments:
    their summaries count the learner's steps in MLflow)."""

    @field_serializer("tracking_uri", when_used="json")
    def _password_masked(self, uri: str | None) -> str | None:
        """Masked wherever the configuration is dumped (``config show``, the learner's MLflow params
        and ``config/resolved.yaml``), as the secrets are; ``dump_config(reveal_secrets=True)``
        restores it for a child process."""
        return mask_uri_password(uri)
