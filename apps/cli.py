"""The ``online-sao`` command: parse the configuration, build, run.

This module parses the command line and the configuration and runs one subcommand of
:mod:`apps.commands`, each a thin wrapper over one function of the component that owns the work.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable

from apps import commands
from apps.config import AppConfig, load_app_config
from online_sao.config import ConfigError


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
    show.set_defaults(run=commands.config)

    kafka = command("kafka", help="the local Apache Kafka broker")
    kafka.add_argument("action", choices=["up", "down", "status"])
    kafka.set_defaults(run=commands.kafka)

    base = command("base-model", help="build the default model (cached); prints its directory last")
    base.add_argument("--force", action="store_true", help="rebuild even when cached")
    base.set_defaults(run=commands.base_model)

    serve = command("serve", help="run the OpenAI-compatible endpoint")
    serve.add_argument("--port", type=int, help="shortcut for --set serving.port=N")
    serve.set_defaults(run=commands.serve)

    learn = command("learn", help="run the continuous SAO learner")
    learn.add_argument("--pretrain-critic", action="store_true", help="fit the critic on logged rollouts first")
    learn.set_defaults(run=commands.learn)

    ledger = command("ledger", help="the learner's ledger of trained ids: redact ID... overwrites them in place "
                                    "in every segment (same length, so the checkpoints still cover it; stop the "
                                    "learner first); sealed prints the segments the learner no longer reads, "
                                    "which may be archived or deleted")
    ledger.add_argument("action", choices=["redact", "sealed"])
    ledger.add_argument("ids", nargs="*", metavar="ID", help="interaction id to redact")
    ledger.set_defaults(run=commands.ledger)

    weights = command("weights", help="what serving's weights follow, and an operator's hold: status; hold "
                                      "[VERSION | --champion] makes every replica answer with one version (by "
                                      "default the one they follow now) until release")
    weights.add_argument("action", choices=["status", "hold", "release"])
    weights.add_argument("version", nargs="?", type=commands.weights_version, metavar="VERSION", help="hold: the version to hold")
    weights.add_argument("--champion", action="store_true", help="hold: the registry's champion")
    weights.add_argument("--reason", help="hold, release: why (logged by every replica, kept on the topic)")
    weights.set_defaults(run=commands.weights)

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
    simulate.set_defaults(run=commands.simulate)

    sweep = command("lr-sweep", help="run every arm of a scenario once per policy learning rate; "
                                     "report, and the best rate per arm")
    sweep.add_argument("--scenario", help="scenario YAML (same as --config)")
    sweep.add_argument("--rates", required=True, type=commands.rates,
                       help="comma-separated policy learning rates, e.g. 1e-4,3e-4,1e-3")
    sweep.add_argument("--arm", action="append", help="sweep only this arm (repeatable)")
    sweep.add_argument("--seeds", type=int, metavar="N", help="shortcut for --set experiment.seeds=N")
    sweep.add_argument("--driver", choices=["live", "inprocess"], help="shortcut for --set experiment.driver=...")
    sweep.add_argument("--jobs", type=int, metavar="N", help="shortcut for --set experiment.jobs=N (in-process driver)")
    sweep.add_argument("--resume", action="store_true", help="shortcut for --set experiment.resume=true")
    sweep.set_defaults(run=commands.lr_sweep)

    agent = command("agent", help="the simulated agent scenario: calculator tasks through the live stack, "
                                  "judged on the final answer; success rate over time (JSON + PNG)")
    agent.set_defaults(run=commands.agent)

    judge = command("judge", help="the reward service: scores interactions from Kafka, produces rewards")
    judge.add_argument("--arm", help="experiment arm whose results file the scores go to")
    judge.set_defaults(run=commands.judge)

    report = command("report", help="write the experiment report (Markdown + PNG plots) and log it to MLflow")
    report.set_defaults(run=commands.report)

    smoke = command("smoke", help="a quick end-to-end check of the stack: chat, feedback, a new policy version")
    smoke.add_argument("--keep-state", action="store_true",
                       help="keep the run's topics, consumer group, registered model, weights and checkpoints after "
                            "a run that passed (a failed run keeps them anyway)")
    smoke.set_defaults(run=commands.smoke)

    from apps.load.run import add_load_arguments

    load = command("load", help="hold N concurrent clients against serving while the learner swaps weights; "
                                "checks no request fails and every answered interaction is in Kafka")
    add_load_arguments(load)
    load.set_defaults(run=commands.load)
    return parser


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
        cfg = load_app_config(args.config, overrides=commands.overrides(args))
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
        return commands.INTERRUPTED


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
