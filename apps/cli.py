"""The ``online-sao`` command: parse the configuration, build, run.

Each subcommand is a thin wrapper over one function of the component that owns
the work; heavy imports happen inside the subcommand so that ``--help`` and
``config show`` stay fast.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import signal
import sys
import threading
from typing import Callable

from apps.config import AppConfig, load_app_config
from apps.config_checks import check_agent_rewards_are_taken, check_requests_fit_serving
from apps.stack import exit_on_sigterm
from online_sao.config import ConfigError, dump_config
from online_sao.config.reference import reference
from online_sao.config.tree import setting_value

REFERENCE_TITLE = "Configuration reference"
"""Title of ``config reference``'s Markdown (docs/CONFIG.md is that output)."""


def _config(cfg: AppConfig, args: argparse.Namespace) -> int:
    if args.action == "reference":
        print(reference(AppConfig, REFERENCE_TITLE), end="")
    else:
        print(dump_config(cfg), end="")
    return 0


def _kafka(cfg: AppConfig, args: argparse.Namespace) -> int:
    from streams import broker_cli

    return {"up": broker_cli.kafka_up, "down": broker_cli.kafka_down,
            "status": broker_cli.kafka_status}[args.action](cfg)


def _base_model(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.default_model.builder import run_base_model

    return run_base_model(cfg, force=args.force)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The long-running commands' log lines, as the learner's: when, how bad, which part."""
SERVICE_LOG_LEVEL = logging.INFO
"""serve, judge: their INFO lines say what they do ("ready after", "spool replayed", "serving stopped")."""
DRIVER_LOG_LEVEL = logging.WARNING
"""simulate, lr-sweep, agent, load print their progress; at INFO the in-process driver's serving and
learner (in its process) would add a line per weight swap and per late reward."""


def _log_to_stderr(level: int) -> None:
    """Log to stderr from ``level`` up, with time and level (with nothing set up, serve's INFO lines never
    showed and its warnings came out bare); a no-op where logging is set up already (pytest)."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    logging.getLogger("kafka").setLevel(logging.WARNING)  # kafka-python narrates every connection at INFO


def _serve(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.default_model.builder import build_base_model
    from serving.server import check_exposure, run_server
    from serving.spool_lock import exclusive_spool

    _log_to_stderr(SERVICE_LOG_LEVEL)
    check_exposure(cfg.serving)  # before any build
    log = logging.getLogger("serving.server")
    with exclusive_spool(cfg.spool_dir):  # held from before any build: a second process is refused at once
        return run_server(cfg, build_base_model(cfg, progress=lambda line: log.info("%s", line)))


def _learn(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.default_model.builder import build_base_model
    from trainer.learner import run_learner

    build_base_model(cfg)
    return run_learner(cfg, pretrain_critic=args.pretrain_critic)


def _ledger(cfg: AppConfig, args: argparse.Namespace) -> int:
    from trainer.checkpoint import Checkpointer
    from trainer.ledger import ledger_files, redact_ledger, torn_files

    root = cfg.checkpoint_dir
    if args.action == "sealed":  # paths on stdout (for xargs), what else is said on stderr
        if not root.is_dir():
            print(f"no checkpoints in {root}", file=sys.stderr)
            return 1
        sealed = Checkpointer(root).sealed_segments()
        for path in sealed:
            print(path)
        if not sealed:
            print(f"no sealed ledger segments under {root} (only the current one, which the learner appends to)",
                  file=sys.stderr)
        return 0
    if not args.ids:
        print("ledger redact needs the ids to redact", file=sys.stderr)
        return 2
    files = ledger_files(root)
    if not files:
        print(f"no ledger in {root}", file=sys.stderr)
        return 1
    redacted = redact_ledger(root, set(args.ids))
    print(f"{redacted} occurrence(s) of {len(set(args.ids))} id(s) redacted in {len(files)} ledger file(s) "
          f"under {root}")
    for torn in torn_files(root):  # an append the learner was making when it stopped (a full disk, a kill)
        print(f"{torn} ends in a torn line, which no checkpoint covers: left as it is (not JSON to redact in); "
              "in the current segment the learner's next start cuts it, ids in it included; in a sealed one "
              "(`online-sao ledger sealed`) nothing does: edit it by hand", file=sys.stderr)
    if not redacted:  # an erasure request that erased nothing: a mistyped id, or the wrong data_dir
        print(f"none of the ids is in the ledger under {root} (never trained on, already redacted, or another "
              "checkpoint directory)", file=sys.stderr)
        return 1
    return 0


INTERRUPTED = 130
"""Exit status of a run stopped by Ctrl-C (128 + SIGINT), as shells report it."""
TERMINATED = 128 + signal.SIGTERM
"""Exit status of a sweep stopped by SIGTERM (an operator's kill, a CI timeout), as shells report it."""
RESUME_HINT = "the runs that finished are kept: the same command with --resume runs the rest"


def _resumable(sweep: Callable[[], object]) -> int:
    """Run a sweep; on Ctrl-C or SIGTERM say how to go on instead of printing where the wait was
    interrupted. SIGTERM is raised as ``SystemExit(TERMINATED)`` (as the live driver's stack and the
    in-process workers' pool do while they run), so the sweep unwinds and stops what it started
    rather than dying with its processes left running."""
    previous = (signal.signal(signal.SIGTERM, exit_on_sigterm)
                if threading.current_thread() is threading.main_thread() else None)
    try:
        sweep()
    except KeyboardInterrupt:
        print(f"online-sao: interrupted; {RESUME_HINT}", file=sys.stderr)
        return INTERRUPTED
    except SystemExit as exc:
        if exc.code != TERMINATED:
            raise
        print(f"online-sao: terminated (SIGTERM); {RESUME_HINT}", file=sys.stderr)
        return TERMINATED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0



def _weights(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.weights_control import run_weights_cli
    from streams.kafka_backend import KafkaBackend

    if args.action != "hold" and (args.version is not None or args.champion):
        print(f"online-sao weights {args.action} takes no version (only hold does)", file=sys.stderr)
        return 2
    if args.version is not None and args.champion:
        print("online-sao weights hold: a VERSION or --champion, not both", file=sys.stderr)
        return 2
    return run_weights_cli(cfg, KafkaBackend(cfg.kafka), args.action, args.version, args.champion, args.reason)


def _simulate(cfg: AppConfig, args: argparse.Namespace) -> int:
    check_requests_fit_serving(cfg, "experiment")
    _log_to_stderr(DRIVER_LOG_LEVEL)
    from apps.experiments.orchestrate import run_simulation

    return _resumable(lambda: run_simulation(cfg, arms=args.arm or None, progress=lambda line: print(line, flush=True)))


def _lr_sweep(cfg: AppConfig, args: argparse.Namespace) -> int:
    check_requests_fit_serving(cfg, "experiment")
    _log_to_stderr(DRIVER_LOG_LEVEL)
    from apps.experiments.sweep import run_lr_sweep

    return _resumable(lambda: run_lr_sweep(cfg, args.rates, arms=args.arm or None,
                                           progress=lambda line: print(line, flush=True)))


def _agent(cfg: AppConfig, args: argparse.Namespace) -> int:
    check_requests_fit_serving(cfg, "agent")
    check_agent_rewards_are_taken(cfg)
    _log_to_stderr(DRIVER_LOG_LEVEL)
    from apps.agent.run import run_agent

    print(run_agent(cfg, progress=lambda line: print(line, flush=True)), flush=True)
    return 0


def _judge(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.experiments.judge_service import run_judge_cli

    _log_to_stderr(SERVICE_LOG_LEVEL)
    return run_judge_cli(cfg, arm=args.arm)


def _report(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.experiments.report import run_report_cli

    return run_report_cli(cfg)


def _smoke(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.smoke import run_smoke

    return run_smoke(cfg, config_path=args.config, overrides=_overrides(args))


def _load(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.load.run import run_load_cli

    _log_to_stderr(DRIVER_LOG_LEVEL)
    return run_load_cli(cfg, args, config_path=args.config, overrides=_overrides(args))


def _rates(text: str) -> list[float]:
    """``--rates``: comma-separated positive finite numbers (a usage error otherwise)."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not all(math.isfinite(r) and r > 0 for r in rates):  # nan passed "<= 0" and reached pydantic's traceback
        raise argparse.ArgumentTypeError(f"expected positive finite learning rates, got {text!r}")
    return rates


def _version(text: str) -> int:
    """``weights hold VERSION``: 0 or above (-5 was taken, and said to be compacted away), as a number or
    as ``weights status`` writes it (``v3``)."""
    try:
        version = int(text.removeprefix("v"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a version number, got {text!r}") from None
    if version < 0:
        raise argparse.ArgumentTypeError(f"versions are numbered from 0, got {version}")
    return version


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="online-sao", description=__doc__.splitlines()[0])
    parser.add_argument("--config", "-c", help="YAML run configuration (see configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one field, e.g. --set serving.port=8001 (repeatable)")
    # the same two after the subcommand (`online-sao agent --config configs/agent.yaml`), kept apart so
    # that neither place overwrites the other: main() joins them
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", dest="config_after", metavar="CONFIG",
                        help="YAML run configuration (see configs/); also before the subcommand")
    common.add_argument("--set", action="append", dest="set_after", default=[], metavar="KEY=VALUE",
                        help="override one field (repeatable); also before the subcommand")
    sub = parser.add_subparsers(dest="command", required=True)
    command = functools.partial(sub.add_parser, parents=[common])

    show = command("config", help="configuration tools: show (the resolved tree as YAML), "
                                  "reference (every key, its type, default and meaning, as Markdown)")
    show.add_argument("action", choices=["show", "reference"])
    show.set_defaults(run=_config)

    kafka = command("kafka", help="the local Apache Kafka broker")
    kafka.add_argument("action", choices=["up", "down", "status"])
    kafka.set_defaults(run=_kafka)

    base = command("base-model", help="build the default model (cached); prints its directory last")
    base.add_argument("--force", action="store_true", help="rebuild even when cached")
    base.set_defaults(run=_base_model)

    serve = command("serve", help="run the OpenAI-compatible endpoint")
    serve.add_argument("--port", type=int, help="shortcut for --set serving.port=N")
    serve.set_defaults(run=_serve)

    learn = command("learn", help="run the continuous SAO learner")
    learn.add_argument("--pretrain-critic", action="store_true", help="fit the critic on logged rollouts first")
    learn.set_defaults(run=_learn)

    ledger = command("ledger", help="the learner's ledger of trained ids: redact ID... overwrites them in place "
                                    "in every segment (same length, so the checkpoints still cover it; stop the "
                                    "learner first); sealed prints the segments the learner no longer reads, "
                                    "which may be archived or deleted")
    ledger.add_argument("action", choices=["redact", "sealed"])
    ledger.add_argument("ids", nargs="*", metavar="ID", help="interaction id to redact")
    ledger.set_defaults(run=_ledger)

    weights = command("weights", help="what serving's weights follow, and an operator's hold: status; hold "
                                      "[VERSION | --champion] makes every replica answer with one version (by "
                                      "default the one they follow now) until release")
    weights.add_argument("action", choices=["status", "hold", "release"])
    weights.add_argument("version", nargs="?", type=_version, metavar="VERSION", help="hold: the version to hold")
    weights.add_argument("--champion", action="store_true", help="hold: the registry's champion")
    weights.add_argument("--reason", help="hold, release: why (logged by every replica, kept on the topic)")
    weights.set_defaults(run=_weights)

    simulate = command("simulate", help="run a drifting-preference scenario through the real service")
    simulate.add_argument("--scenario", help="scenario YAML (same as --config), e.g. configs/drift-short.yaml")
    simulate.add_argument("--arm", action="append", help="run only this arm (repeatable)")
    simulate.add_argument("--seeds", type=int, metavar="N",
                          help="shortcut for --set experiment.seeds=N: run the scenario with N seeds")
    simulate.add_argument("--driver", choices=["live", "inprocess"],
                          help="shortcut for --set experiment.driver=...: live processes on Kafka (the "
                               "reference) or everything in one process in rollout time (fast sweeps)")
    simulate.add_argument("--jobs", type=int, metavar="N",
                          help="shortcut for --set experiment.jobs=N: with the in-process driver, N (seed, arm) "
                               "runs side by side in worker processes (same results as one at a time)")
    simulate.add_argument("--resume", action="store_true",
                          help="shortcut for --set experiment.resume=true: keep the (seed, arm) runs that finished "
                               "in the results directory with these settings, run the rest")
    simulate.set_defaults(run=_simulate)

    sweep = command("lr-sweep", help="run every arm of a scenario once per policy learning rate; "
                                     "report, and the best rate per arm")
    sweep.add_argument("--scenario", help="scenario YAML (same as --config)")
    sweep.add_argument("--rates", required=True, type=_rates,
                       help="comma-separated policy learning rates, e.g. 1e-4,3e-4,1e-3")
    sweep.add_argument("--arm", action="append", help="sweep only this arm (repeatable)")
    sweep.add_argument("--seeds", type=int, metavar="N", help="shortcut for --set experiment.seeds=N")
    sweep.add_argument("--driver", choices=["live", "inprocess"], help="shortcut for --set experiment.driver=...")
    sweep.add_argument("--jobs", type=int, metavar="N", help="shortcut for --set experiment.jobs=N (in-process driver)")
    sweep.add_argument("--resume", action="store_true", help="shortcut for --set experiment.resume=true")
    sweep.set_defaults(run=_lr_sweep)

    agent = command("agent", help="the simulated agent scenario: calculator tasks through the live stack, "
                                  "judged on the final answer; success rate over time (JSON + PNG)")
    agent.set_defaults(run=_agent)

    judge = command("judge", help="the reward service: scores interactions from Kafka, produces rewards")
    judge.add_argument("--arm", help="experiment arm whose results file the scores go to")
    judge.set_defaults(run=_judge)

    report = command("report", help="write the experiment report (Markdown + PNG plots) and log it to MLflow")
    report.set_defaults(run=_report)

    smoke = command("smoke", help="a quick end-to-end check of the stack: chat, feedback, a new policy version")
    smoke.set_defaults(run=_smoke)

    from apps.load.run import add_load_arguments

    load = command("load", help="hold N concurrent clients against serving while the learner swaps weights; "
                                "checks no request fails and every answered interaction is in Kafka")
    add_load_arguments(load)
    load.set_defaults(run=_load)
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        out[key] = setting_value(AppConfig, key.split("."), value, f"--set {key}")  # a text field as written
    if getattr(args, "port", None) is not None:
        out["serving.port"] = args.port
    if getattr(args, "seeds", None) is not None:
        out["experiment.seeds"] = args.seeds
    if getattr(args, "driver", None) is not None:
        out["experiment.driver"] = args.driver
    if getattr(args, "jobs", None) is not None:
        out["experiment.jobs"] = args.jobs
    if getattr(args, "resume", False):
        out["experiment.resume"] = True
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.config_after is not None:
        if args.config is not None and args.config != args.config_after:
            print("online-sao: give --config once (before or after the subcommand)", file=sys.stderr)
            return 2
        args.config = args.config_after
    args.set = args.set + args.set_after
    if getattr(args, "scenario", None):
        if args.config:
            print("online-sao: give --config or --scenario, not both", file=sys.stderr)
            return 2
        args.config = args.scenario
    try:
        cfg = load_app_config(args.config, overrides=_overrides(args))
    except ConfigError as exc:
        print(f"online-sao: {exc}", file=sys.stderr)
        return 2
    run: Callable[[AppConfig, argparse.Namespace], int] = args.run
    try:
        return run(cfg, args)
    except ConfigError as exc:  # a setting that cannot be used here (an unknown arm, a results directory's other run)
        print(f"online-sao: {exc}", file=sys.stderr)
        return 2
    except _operator_errors() as exc:  # the outside world, not a bug: one line, not a traceback
        print(f"online-sao: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        from trainer.mlflow_store import disk_refused

        # a full disk or quota, or a disk error (MLflow's SQLite store says "disk I/O error" for a full
        # quota): the operator makes room or mends the disk (the error names the file)
        if not disk_refused(exc):
            raise
        print(f"online-sao: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("online-sao: interrupted", file=sys.stderr)
        return INTERRUPTED


def _operator_errors() -> tuple[type[BaseException], ...]:
    """What an operator can fix and a traceback does not help with: the broker unreachable or not
    starting, a process of the stack not starting, the MLflow server not answering, a directory that
    cannot be written, serving refusing the agent's rewards or its tasks failing in a row. Imported
    only when an error is being matched (``--help`` and ``config show`` stay light)."""
    from apps.agent.episode import FeedbackRefused
    from apps.agent.run import TasksFailing
    from apps.stack import StackError
    from streams.base import StreamUnavailable, TopicsMisconfigured
    from streams.broker import BrokerError
    from trainer.mlflow_store import TrackingUnavailable

    return (StreamUnavailable, TopicsMisconfigured, BrokerError, StackError, TrackingUnavailable, PermissionError,
            NotADirectoryError, FileExistsError, FeedbackRefused, TasksFailing)


if __name__ == "__main__":
    sys.exit(main())
