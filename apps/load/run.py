"""``online-sao load``: hold N clients against serving while the learner trains and swaps happen.

Two ways to run it:

* against your own stack (no ``--url``): the broker (unless the configuration names a
  cluster), ``online-sao serve`` and ``online-sao learn`` start as subprocesses
  (:class:`apps.stack.Stack`) on topics, consumer group, weights, checkpoints,
  spool, MLflow experiment and registered model of their own for this run
  (``<data_dir>/runs/load-<time>``; :func:`apps.stack.own_state_overrides`): the
  deployment's learner, topics and registry are left alone, and a run that passed removes
  them but for its logs and MLflow experiment (``--keep-state`` keeps them); traffic starts
  once the learner holds its partitions; the clients' rewards (``/v1/feedback``) make
  the learner step and publish, serving hot-swaps under load.
* against a running endpoint (``--url``): only the clients; the interactions topic of
  the configuration is read for the check.

After the load, the interactions topic is read back from the broker: every
acknowledged interaction (a chat answer that arrived whole, with its id) must be
there, with the policy versions the answer reported. Duplicates by id are counted.
The run passes when requests were answered, none failed (so zero 5xx), no acknowledged
interaction is missing or logged with other versions, and (own stack) every process of the stack
ran to the end: one that exits stops the clients early. A run that does not pass still writes its
results, whatever stopped it after the load began (a process that exited, a broker gone for the
read back).
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from apps.config import AppConfig, client_api_key
from apps.load.readback import (STAMP_SLACK_S, LoggedCheck, acked_interactions, check_logged, stamped_since,
                                topic_ends)
from apps.load.stats import LoadParams, LoadResult, LoadSummary, summarize, versions_text
from online_sao.config import Config

SERVING_READY_TIMEOUT_S = 300.0
"""Serving loads the model and connects to the broker before /readyz answers."""
LEARNER_READY_TIMEOUT_S = 300.0
"""The learner loads the model and opens MLflow before it joins its group (slow on a busy machine)."""
FAILURE_KINDS_SHOWN = 5
"""Distinct failure details printed after a run (all of them are in the results JSON)."""
LOAD_STACK_OVERRIDES: dict[str, Any] = {
    "serving.rate_limit_per_minute": 10_000_000,
    "serving.rate_limit_burst": 100_000,
    "serving.torch_threads": 1,
}
"""Serving under load: the per-key rate limit (all loopback clients share one bucket) lifted so
that the run measures the service, not the limiter; one torch thread beside the learner."""


@dataclass
class LoadRunReport:
    result: LoadResult
    summary: LoadSummary
    logged: LoggedCheck | None
    run_dir: Path | None = None
    kafka_check_error: str | None = None
    """Why the Kafka check asked for could not run (the broker unreachable): the run then did not pass."""
    stack_error: str | None = None
    """A process of the run's own stack that exited during the load or before the read back (which
    one, its exit status, its log's tail): the run then did not pass."""

    @property
    def passed(self) -> bool:
        """Something answered, no request failed (so zero 5xx), the Kafka check (if run) clean, every
        process of the stack (if started) alive to the end."""
        s = self.summary
        return (s.answered > 0 and not s.errors and s.server_errors == 0 and self.kafka_check_error is None
                and self.stack_error is None and (self.logged is None or self.logged.ok))


def run_own_stack_overrides(run_id: str, run_dir: Path, cfg: Config | None = None) -> dict[str, Any]:
    """:data:`LOAD_STACK_OVERRIDES` and state of this run only (:func:`apps.stack.own_state_overrides`:
    topics, consumer group, weights, checkpoints, spool, MLflow experiment and registered model),
    its MLflow names derived from ``cfg``'s (the defaults' when None)."""
    from apps.stack import own_state_overrides

    return {**LOAD_STACK_OVERRIDES, **own_state_overrides(cfg or Config(), run_id, run_dir)}


def run_on_stack(config_path: Path | None, overrides: dict[str, Any], run_dir: Path, params: LoadParams,
                 progress: Callable[[str], None] = print, keep_state: bool = False) -> LoadRunReport:
    """Start serving and the learner (and the broker if the configuration has no cluster) with
    ``overrides``, hold the load, read the interactions back, stop everything. A run that passed
    removes the state it made for itself unless ``keep_state`` (:mod:`apps.run_state`).

    Once the load began, a process that exits (the load then stops early) or a broker that cannot be
    read back is recorded in the report, which fails, rather than raised: the check ran only after the
    whole load and its error unwound past the results, so none were written."""
    from apps.default_model.builder import build_base_model
    from apps.experiments.orchestrate import learner_threads, wait_for_consumers
    from apps.load.gen import run_load
    from apps.stack import Stack, StackError, free_port, threads_env
    from streams.base import StreamUnavailable
    from streams.kafka_backend import KafkaBackend

    port = free_port()
    with Stack(config_path, {**overrides, "serving.port": port}, run_dir, progress=progress) as stack:
        stack.start_broker()
        cfg = stack.cfg
        progress(f"model: {build_base_model(cfg, progress=progress)}")
        started = time.monotonic()
        server = stack.start("serving", ["serve"], env=threads_env(cfg.serving.torch_threads or 1))
        stack.start("learner", ["learn"], env=threads_env(learner_threads(cfg)))  # both load at once
        base_url = f"http://127.0.0.1:{port}"
        stack.wait_http(server, f"{base_url}/readyz", SERVING_READY_TIMEOUT_S)
        backend = KafkaBackend(cfg.kafka)
        wait_for_consumers(backend, [cfg.trainer.consumer_group], stack.check_alive, LEARNER_READY_TIMEOUT_S)
        progress(f"serving ready and the learner holding its partitions {time.monotonic() - started:.1f} s after "
                 f"they started; {params.clients} clients start")

        def exited() -> str | None:
            """Why the stack is broken (a process exited: name, status, log tail), or None."""
            try:
                stack.check_alive()
            except StackError as exc:
                return str(exc)
            return None

        result = run_load(base_url, client_api_key(cfg), params, progress, halt=exited)
        stack_error = result.stopped_early or exited()
        acked = acked_interactions(result.records)
        progress(f"reading {cfg.kafka.topics.interactions} back for {len(acked)} acknowledged interactions")
        logged, check_error = None, None
        try:  # with a process gone too: what serving acknowledged before it went must be there
            logged = check_logged(backend, cfg.kafka.topics.interactions, acked)
        except StreamUnavailable as exc:
            check_error = f"the Kafka check could not run: {exc}"
        report = LoadRunReport(result, summarize(result.records, result.wall_s, result.versions), logged, run_dir,
                               kafka_check_error=check_error, stack_error=stack_error)
        if report.passed and not keep_state:  # before the broker this run started stops
            from apps.run_state import remove_run_state_of

            stack.stop_components()
            remove_run_state_of(cfg, run_dir, progress)
    return report


def describe(report: LoadRunReport) -> list[str]:
    """The figures of a run as lines for the terminal."""
    s = report.summary

    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    lines = [f"{s.requests} chat requests in {s.wall_s:.1f} s: {s.answered} answered, "
             f"{s.throughput_rps:.2f} req/s, {s.tokens_per_s:.1f} completion tokens/s",
             f"latency p50 {secs(s.latency_p50_s)}, p99 {secs(s.latency_p99_s)}, max {secs(s.latency_max_s)}; "
             f"stream first token p50 {secs(s.ttft_p50_s)}",
             f"errors {s.errors or 'none'}; 5xx {s.server_errors}; feedback {s.feedback_ok}/{s.feedback_sent}",
             f"versions seen {versions_text(s.versions_seen)}; served version changed {s.swaps_observed} times "
             f"(polled each {report.result.params.version_poll_s:g} s); {s.answers_across_swap} answers sampled "
             f"across a swap"]
    details = Counter(f"{r.kind} {r.error}: {r.detail}" for r in report.result.records if r.error and r.detail)
    lines += [f"  {count} x {detail}" for detail, count in details.most_common(FAILURE_KINDS_SHOWN)]
    if report.stack_error is not None:
        lines.append(f"stack: {report.stack_error}")
    if report.kafka_check_error is not None:
        lines.append(f"kafka: {report.kafka_check_error}")
    if report.logged is not None:
        c = report.logged
        lines.append(f"kafka: {c.found}/{c.acked} acknowledged interactions logged, {len(c.missing)} missing, "
                     f"{len(c.duplicates)} duplicated, {len(c.version_mismatches)} with other versions; "
                     f"{c.unacked_logged} logged but not acknowledged; {c.records_read} records read")
    lines.append("PASSED: no failed request (zero 5xx), every acknowledged interaction logged" if report.passed else
                 "FAILED: nothing answered, failed requests, acknowledged interactions missing from Kafka, "
                 "or a process of the stack exited (see above)")
    return lines


def run_load_cli(cfg: AppConfig, args: argparse.Namespace, config_path: str | None,
                 overrides: dict[str, Any]) -> int:
    """``online-sao load``: returns 0 when the run passed, 1 otherwise."""
    from apps.load.gen import run_load
    from apps.load.report import write_results
    from apps.stack import own_state_overrides
    from streams.base import StreamUnavailable, TopicNotFound
    from streams.kafka_backend import KafkaBackend

    params = LoadParams(clients=args.clients, duration_s=args.duration_s,
                        requests_per_client=args.requests_per_client, max_tokens=args.max_tokens,
                        stream_share=args.stream_share, feedback_share=args.feedback_share,
                        seed=args.seed, model=cfg.serving.model_name,
                        reward_range=(cfg.reward.min_value, cfg.reward.max_value))
    progress = lambda line: print(line, flush=True)  # noqa: E731
    if args.url:
        logged, check_error, since = None, None, {}
        if not args.no_kafka_check:
            try:  # the deployment's earlier traffic is not this run's
                since = topic_ends(KafkaBackend(cfg.kafka), cfg.kafka.topics.interactions)
            except TopicNotFound:
                pass  # serving cannot log to it yet either: whatever it holds after the load is the run's
            except StreamUnavailable as exc:  # the read back may still work once the load is over
                since = None
                progress(f"where {cfg.kafka.topics.interactions} ends before the load could not be read ({exc}): "
                         f"it will be read back from the records stamped since {STAMP_SLACK_S:.0f} s before the load")
        began = time.time()
        result = run_load(args.url, args.api_key, params, progress)
        if not args.no_kafka_check:
            acked = acked_interactions(result.records)
            progress(f"reading {cfg.kafka.topics.interactions} back for {len(acked)} acknowledged interactions")
            try:
                backend = KafkaBackend(cfg.kafka)
                if since is None:  # the run's records are stamped by serving's clock, after the load began
                    since = stamped_since(backend, cfg.kafka.topics.interactions, began - STAMP_SLACK_S)
                logged = check_logged(backend, cfg.kafka.topics.interactions, acked, since=since)
            except StreamUnavailable as exc:  # the load's results are still worth writing
                check_error = f"the Kafka check could not run: {exc}"
        report = LoadRunReport(result, summarize(result.records, result.wall_s, result.versions), logged,
                               kafka_check_error=check_error)
    else:
        from apps.stack import new_run

        run_id, run_dir = new_run(cfg.data_dir / "runs", "load")
        # the operator's --set over the load's serving settings, the run's own state over both (a --set
        # naming the deployment's topics or registered model would put the run back on them)
        run_overrides = {**LOAD_STACK_OVERRIDES, **overrides, **own_state_overrides(cfg, run_id, run_dir)}
        report = run_on_stack(Path(config_path) if config_path else None, run_overrides, run_dir, params, progress,
                              keep_state=args.keep_state)
    for line in describe(report):
        print(line, flush=True)
    extra = {"command": shlex.join(["online-sao", *sys.argv[1:]]), "passed": report.passed,
             "run_dir": str(report.run_dir) if report.run_dir else None, "stack_error": report.stack_error,
             "kafka_check": report.logged.to_json() if report.logged else report.kafka_check_error}
    out = Path(args.out)
    json_path, png = write_results(out, report.result, report.summary, extra, include_requests=not args.summary_only)
    print(f"results: {json_path}, plot: {png}", flush=True)
    return 0 if report.passed else 1


def positive(kind: type) -> Callable[[str], float]:
    """An argparse type: a finite number of ``kind`` above 0 (a usage error otherwise)."""
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        if not math.isfinite(value):  # --duration-s inf ran on and wrote Infinity, which is no JSON
            raise argparse.ArgumentTypeError(f"must be finite, got {text}")
        return value
    return parse


def share(text: str) -> float:
    """An argparse type: a share in [0, 1]."""
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {text}")
    return value


def results_path(text: str) -> str:
    """An argparse type: the results JSON's path, not the plot's (``x.png`` was written as JSON, then
    overwritten by the plot beside it, whose name is the same with .png)."""
    if Path(text).suffix.lower() == ".png":
        raise argparse.ArgumentTypeError(f"names the results JSON (its plot goes beside it as .png), got {text}")
    if Path(text).is_dir():  # found only when the results were written, after the whole run
        raise argparse.ArgumentTypeError(f"names the results file, not a directory: {text} is one "
                                         f"(e.g. {Path(text) / 'load.json'})")
    return text


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``online-sao load``."""
    defaults = LoadParams()
    parser.add_argument("--url", help="an endpoint already running (e.g. http://127.0.0.1:8000); "
                                      "without it serving and the learner are started for the run. Either way "
                                      "the rewards sent are drawn in the configuration's reward.min_value.."
                                      "reward.max_value (with --url, give that server's configuration)")
    parser.add_argument("--api-key", help="API key for --url (a started stack is sent the first of "
                                          "serving.api_keys, when any are configured)")
    parser.add_argument("--clients", type=positive(int), default=defaults.clients, help="concurrent clients")
    parser.add_argument("--duration-s", type=positive(float), default=defaults.duration_s, help="seconds of load")
    parser.add_argument("--requests-per-client", type=positive(int),
                        help="stop each client after this many requests (--duration-s still applies)")
    parser.add_argument("--max-tokens", type=positive(int), default=defaults.max_tokens, help="max_tokens per request")
    parser.add_argument("--stream-share", type=share, default=defaults.stream_share,
                        help="share of streaming requests")
    parser.add_argument("--feedback-share", type=share, default=defaults.feedback_share,
                        help="share of answers rewarded through /v1/feedback")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the clients' choices")
    parser.add_argument("--out", default="load-results.json", type=results_path,
                        help="results JSON (the plot goes beside it, .png)")
    parser.add_argument("--keep-state", action="store_true",
                        help="own stack: keep the run's topics, consumer group, registered model, weights and "
                             "checkpoints after a run that passed (a failed run keeps them anyway)")
    parser.add_argument("--summary-only", action="store_true", help="leave the per-request records out of the JSON")
    parser.add_argument("--no-kafka-check", action="store_true",
                        help="with --url: skip reading the interactions topic back")

