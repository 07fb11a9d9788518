"""The ``online-sao`` subcommands, each a thin wrapper over one function of the component that owns
the work (apps/cli.py parses the command line and calls one). Heavy imports happen inside each, so that
``--help`` and ``config show`` stay fast."""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import threading
from typing import Callable

from apps.config import AppConfig
from apps.config_checks import (check_agent_rewards_are_taken, check_raters_fit_the_reward_range,
                                check_requests_fit_serving)
from apps.stack import exit_on_sigterm
from online_sao.config import ConfigError, dump_config
from online_sao.config.reference import reference
from online_sao.config.tree import setting_value
from online_sao.log_setup import log_to_stderr

REFERENCE_TITLE = "Configuration reference"
"""Title of ``config reference``'s Markdown (docs/CONFIG.md is that output)."""


def config(cfg: AppConfig, args: argparse.Namespace) -> int:
    if args.action == "reference":
        print(reference(AppConfig, REFERENCE_TITLE), end="")
    else:
        print(dump_config(cfg), end="")
    return 0


def kafka(cfg: AppConfig, args: argparse.Namespace) -> int:
    from streams import broker_cli

    return {"up": broker_cli.kafka_up, "down": broker_cli.kafka_down,
            "status": broker_cli.kafka_status}[args.action](cfg)


def base_model(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.default_model.builder import run_base_model

    return run_base_model(cfg, force=args.force)


SERVICE_LOG_LEVEL = logging.INFO
"""serve, judge: their INFO lines say what they do ("ready after", "spool replayed", "serving stopped")."""
DRIVER_LOG_LEVEL = logging.WARNING
"""simulate, lr-sweep, agent, load print their progress; at INFO the in-process driver's serving and
learner (in its process) would add a line per weight swap and per late reward."""


def serve(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.default_model.builder import build_base_model
    from serving.server import check_exposure, run_server
    from serving.spool_lock import exclusive_spool

    log_to_stderr(SERVICE_LOG_LEVEL)
    check_exposure(cfg.serving)  # before any build
    log = logging.getLogger("serving.server")
    with exclusive_spool(cfg.spool_dir):  # held from before any build: a second process is refused at once
        return run_server(cfg, build_base_model(cfg, progress=lambda line: log.info("%s", line)))


def learn(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.default_model.builder import build_base_model
    from trainer.learner import run_learner

    build_base_model(cfg)
    return run_learner(cfg, pretrain_critic=args.pretrain_critic)


def ledger(cfg: AppConfig, args: argparse.Namespace) -> int:
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


def resumable(sweep: Callable[[], object]) -> int:
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



def weights(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.weights_control import run_weights_cli
    from streams.kafka_backend import KafkaBackend

    if args.action != "hold" and (args.version is not None or args.champion):
        print(f"online-sao weights {args.action} takes no version (only hold does)", file=sys.stderr)
        return 2
    if args.version is not None and args.champion:
        print("online-sao weights hold: a VERSION or --champion, not both", file=sys.stderr)
        return 2
    return run_weights_cli(cfg, KafkaBackend(cfg.kafka), args.action, args.version, args.champion, args.reason)


def simulate(cfg: AppConfig, args: argparse.Namespace) -> int:
    check_requests_fit_serving(cfg, "experiment")
    log_to_stderr(DRIVER_LOG_LEVEL)
    from apps.experiments.orchestrate import run_simulation

    return resumable(lambda: run_simulation(cfg, arms=args.arm or None, progress=lambda line: print(line, flush=True)))


def lr_sweep(cfg: AppConfig, args: argparse.Namespace) -> int:
    check_requests_fit_serving(cfg, "experiment")
    log_to_stderr(DRIVER_LOG_LEVEL)
    from apps.experiments.sweep import run_lr_sweep

    return resumable(lambda: run_lr_sweep(cfg, args.rates, arms=args.arm or None,
                                           progress=lambda line: print(line, flush=True)))


def agent(cfg: AppConfig, args: argparse.Namespace) -> int:
    check_requests_fit_serving(cfg, "agent")
    check_agent_rewards_are_taken(cfg)
    log_to_stderr(DRIVER_LOG_LEVEL)
    from apps.agent.run import run_agent

    print(run_agent(cfg, progress=lambda line: print(line, flush=True)), flush=True)
    return 0


def judge(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.experiments.judge_service import run_judge_cli

    check_raters_fit_the_reward_range(cfg)  # a judge started alone rates the experiment's traffic too

    log_to_stderr(SERVICE_LOG_LEVEL)
    return run_judge_cli(cfg, arm=args.arm)


def report(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.experiments.report import run_report_cli

    return run_report_cli(cfg)


def smoke(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.smoke import run_smoke

    return run_smoke(cfg, config_path=args.config, overrides=overrides(args), keep_state=args.keep_state)


def load(cfg: AppConfig, args: argparse.Namespace) -> int:
    from apps.load.run import run_load_cli

    log_to_stderr(DRIVER_LOG_LEVEL)
    return run_load_cli(cfg, args, config_path=args.config, overrides=overrides(args))


def rates(text: str) -> list[float]:
    """``--rates``: comma-separated positive finite numbers (a usage error otherwise)."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not all(math.isfinite(r) and r > 0 for r in rates):  # nan passed "<= 0" and reached pydantic's traceback
        raise argparse.ArgumentTypeError(f"expected positive finite learning rates, got {text!r}")
    return rates


def weights_version(text: str) -> int:
    """``weights hold VERSION``: 0 or above (-5 was taken, and said to be compacted away), as a number or
    as ``weights status`` writes it (``v3``)."""
    try:
        version = int(text.removeprefix("v"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a version number, got {text!r}") from None
    if version < 0:
        raise argparse.ArgumentTypeError(f"versions are numbered from 0, got {version}")
    return version


def overrides(args: argparse.Namespace) -> dict[str, object]:
    """The ``--set KEY=VALUE`` overrides, and those a subcommand's own flags stand for (``--port``, ``--seeds``...)."""
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
