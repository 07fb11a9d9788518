"""The HTTP endpoint and its inference engine."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator

from online_sao.config.base import Section
from online_sao.schemas import MAX_TOKENS_PER_RECORD


DEFAULT_WAITING_PER_SLOT = 4
"""Default ``serving.max_waiting`` per batch slot: a queue of a few answer times at most (see the field)."""


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
    feedback_sources: list[str] | None = None
    """The ``source`` values ``POST /v1/feedback`` accepts (others: 403 ``source_not_allowed``, nothing
    logged). A client names its own source, so with ``reward.sources`` trusting a source that writes
    to Kafka itself (a judge), list here only what HTTP callers may claim (``[user]``): otherwise any
    caller with a key can post as the judge. None: any source."""
    source_keys: dict[str, list[SecretStr]] = {}
    """Sources of ``POST /v1/feedback`` that only these API keys may claim (``{judge: [<the judge's
    key>]}``: a judge posting over HTTP, users on keys of their own); another key claiming one gets 403
    ``source_not_allowed``. Each key must also be in ``api_keys``. A source not named here is open to
    every key, within ``feedback_sources``."""
    rate_limit_per_minute: int = Field(600, ge=1)
    """Requests per minute per API key; without keys, per client address (loopback callers
    are not limited; docs/SERVING.md, Access). With keys, failed authentications (a missing or wrong
    key) are limited at the same rate per client address, loopback included: past them, 429."""
    rate_limit_burst: int = Field(20, ge=1)
    """Requests a key (or address) may send at once before the per-minute rate applies
    (token-bucket size); the same for an address's failed authentications."""
    max_batch_size: int = Field(16, ge=1)
    """Sequences decoded together (continuous batching)."""
    max_waiting: int | None = Field(None, ge=0)
    """Generation requests queued for a batch slot (admitted, no token sampled yet, beyond the slots
    ``max_batch_size`` leaves free), at most; a new one beyond it is refused at once, before its prompt
    is tokenised or anything logged, with 503 ``server_overloaded`` and ``Retry-After``, so that its
    client (through its retry, or the load balancer) tries later or elsewhere instead of waiting in an
    unbounded queue. None (default): 4 x ``max_batch_size``: the last request queued waits about four
    answer times for a slot (one frees every answer time / ``max_batch_size``), and the queue refills
    the whole batch four times over through a burst. 0 queues nothing: a full batch refuses. Counted
    by serving for every engine (``sao_serving_engine_waiting``)."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Seconds from a generation request's admission to its answer, at most (its deadline). A request
    still queued then leaves the queue unsampled; one sampling is cancelled in the engine as a
    disconnect is (what it sampled is logged with ``finish_reason`` ``abort``). The client gets 504
    ``request_timeout`` (a stream that began: a final error event), counted in
    ``sao_serving_request_timeouts_total``. Default 300 s: far above an answer of ``max_new_tokens``
    (256 by default) at a CPU engine's tens of tokens per second plus a full queue's wait, and below
    the official openai client's own 600 s timeout, so that its callers read the 504 instead of
    giving up on a server still working for them. Raise it with ``max_new_tokens`` on slow engines;
    keep it below the timeouts of clients and of a proxy in front (a client that gives up first
    closes its connection, which cancels the request too, but without an answer)."""
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
    cheaper. It switches the model from transformers' ``sdpa`` to serving/engine/grouped_attention.py.
    Its mask has no attention window: a model with sliding-window attention (``sliding_window``
    within its positions, as Mistral v0.1 and Qwen2 with ``use_sliding_window``; ``layer_types`` with
    sliding layers, as Gemma2/3; GPT-Neo, which masks with a buffer of its own) is refused at start,
    ``padded`` serves it. Either layout checks at
    start that two prompts it serves get a plain forward's log-probs (serving/engine/self_check.py)."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")
    """Torch engine: where the model runs. ``auto``: the first CUDA GPU when torch sees one (the
    learner's rule, trainer/distributed.py), else the CPU; or ``cpu``, ``cuda``, ``cuda:<index>``. A
    GPU named where torch sees none is refused at start. (vLLM places its model itself; the
    in-process experiment driver runs everything on the CPU.)"""
    compile: bool = False
    """Torch engine: compile the model's transformer body with ``torch.compile`` (dynamic shapes)
    when the engine is built; the hot-swap's spare copy is compiled too and shares the graphs. The
    engine compiles while it starts, before the server reports ready (tens of seconds on 2 CPU
    cores, less from inductor's on-disk cache; a C++ compiler is needed, the service image has
    one); a batch shape it has not met yet may still compile later, stalling decoding once. Either
    ``kv_layout``. Measured in benchmarks/results/engine_compile.md (flat) and
    engine_compile_padded.md. False runs eagerly."""
    vllm_self_check: bool = True
    """vLLM engine: check at start that two prompts it serves get the log-probs of the transformers
    model the learner loads from the same directory (serving/engine/vllm_self_check.py); a model vLLM
    implements otherwise (a window, a config field or a weight handled differently) is refused with
    a ConfigError instead of logging behaviour log-probs the learner's importance ratios would not
    match. The reference is loaded on the CPU in the served dtype and freed after the check: for a
    moment a second copy of the weights in host memory (2 bytes per parameter in bfloat16: 14 GB for
    a 7B model) and a CPU forward of a dozen tokens; start takes longer by reading those weights
    (not measured on a 7B model; 1.5-3.8 s on the tiny test model, most of it serving the two
    prompts). A host whose available memory (a container's limit included) is under 1.5 times the
    weights skips it with a warning. False skips it silently."""
    vllm_memory_share: float | None = Field(None, gt=0, le=1)
    """vLLM engine: the share of memory vLLM may take for the model's weights, activations and KV cache
    (vLLM's ``gpu_memory_utilization``): of the GPU's memory on a GPU; of the host's total memory on
    vLLM's CPU build, where that much must be available when the engine starts or it refuses to start.
    With a canary (``deploy.canary_share`` above 0) the two engines in the process take half each. None
    (default): vLLM's own default (0.92, half each with a canary), which on a CPU host fails the start
    whenever other processes hold more than 8% of its memory."""
    weights_catch_up_s: float | None = Field(120.0, ge=0)
    """Seconds a starting replica stays unready (``/readyz`` 503 ``catching_up_weights``; ``/healthz``
    stays 200) while its weights follower catches up: reads the weights topic up to where it ended
    when the follower connected and loads the version in force there (the newest publish, a rollback,
    an operator's hold, a canary's champion; a notice whose weights do not load gives way to the one
    before it, and a champion that does not load is retried meanwhile without holding the wait). A
    topic with no notice is caught up after its first read (well under a second). A replica that
    has not caught up in time (the broker unreachable, a slow store) becomes ready on the
    weights it has, at worst those of ``model.path`` (policy version 0), with a warning naming that
    version and what it waited for; the follower goes on and swaps the newest version in once it can.
    Default 120 s: connecting, reading the topic and one load of a version of several GB from a
    network store, with room to spare, while replicas restarted during a broker outage still come back
    (on the base model) within two minutes. None waits for ever (no answer from stale weights, but no
    capacity from a replica restarted while the broker is away); 0 does not wait."""
    swap_in_place: bool = False
    """Torch engine: memory-short hot-swap: copy new weights into the serving model between two
    decode steps instead of loading a second copy off the request path (half the
    weight memory, a stall as long as the copy). The vLLM engine always swaps in place (vLLM holds one
    copy): its decoding stalls for the copy whatever this says."""
    torch_threads: int | None = Field(None, ge=1)
    """Torch engine: intra-op CPU threads of torch, set process-wide when the engine starts
    (None keeps torch's default). On a busy small machine 1 is often fastest:
    spinning OpenMP workers that wait for a core cost more than they save. The vLLM engine does not
    read it (vLLM sets this process to one thread and its worker's threads itself: on its CPU build
    ``VLLM_CPU_OMP_THREADS_BIND`` and ``VLLM_CPU_NUM_OF_RESERVED_CPU``, vLLM's environment variables,
    choose its cores); the experiment drivers and the load test still size their own threads by it."""
    max_prompt_tokens: int = Field(1024, ge=1)
    """Longest prompt accepted, in tokens (400 ``prompt_too_long`` above, as OpenAI answers a prompt over the
    context)."""
    max_new_tokens: int = Field(256, ge=1)
    """Largest max_tokens a request may ask for. Its sum with ``max_prompt_tokens`` may be at most
    32768 (``online_sao.schemas.MAX_TOKENS_PER_RECORD``), the longest trajectory one interaction
    record holds: a longer answer would be generated and then could not be logged."""
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
    an older or evicted parent is refused with 404. Each holds its conversation's records (token
    ids, log-probs, texts): about 77 KiB for a 1,024-token prompt and 256 new tokens (measured with
    tracemalloc, 2026-12-07), so about 77 MiB of a replica's memory at the default when full."""
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

    @property
    def waiting_bound(self) -> int:
        """``max_waiting``, or its default of 4 x ``max_batch_size``."""
        return self.max_waiting if self.max_waiting is not None else DEFAULT_WAITING_PER_SLOT * self.max_batch_size

    @model_validator(mode="after")
    def _an_answer_fits_its_record(self) -> "ServingConfig":
        if self.max_prompt_tokens + self.max_new_tokens > MAX_TOKENS_PER_RECORD:
            raise ValueError(f"serving.max_prompt_tokens + serving.max_new_tokens ({self.max_prompt_tokens} + "
                             f"{self.max_new_tokens}) exceeds the {MAX_TOKENS_PER_RECORD} tokens one interaction "
                             "record holds: such an answer would be generated and then could not be logged")
        return self

    @model_validator(mode="after")
    def _compile_fits_the_engine(self) -> "ServingConfig":
        if self.compile and self.engine != "torch":
            raise ValueError("serving.compile applies to the torch engine (vLLM compiles its own graphs)")
        return self

    @model_validator(mode="after")
    def _memory_share_fits_the_engine(self) -> "ServingConfig":
        if self.vllm_memory_share is not None and self.engine != "vllm":
            raise ValueError("serving.vllm_memory_share applies to the vLLM engine (serving.engine: vllm)")
        return self

    @model_validator(mode="after")
    def _source_keys_are_api_keys(self) -> "ServingConfig":
        accepted = {key.get_secret_value() for key in self.api_keys}  # at start, never against a caller's input
        for source, keys in self.source_keys.items():
            if not keys:
                raise ValueError(f"serving.source_keys.{source} lists no key: no caller could claim it")
            if not all(key.get_secret_value() in accepted for key in keys):
                raise ValueError(f"serving.source_keys.{source} holds a key that is not in serving.api_keys")
            if self.feedback_sources is not None and source not in self.feedback_sources:
                raise ValueError(f"serving.source_keys names {source!r}, which serving.feedback_sources "
                                 f"({self.feedback_sources}) refuses anyway")
        return self
