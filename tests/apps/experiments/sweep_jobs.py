"""A stand-in for the in-process driver's arm job (apps/experiments/parallel._arm_job), importable by
the sweep's spawned workers, and the parent script that runs a sweep of them: what
test_parallel.py interrupts to see whether a worker outlives the sweep.

The job says it started (a file holding its pid), waits for a ``go`` file, then appends its
"result" to ``results.jsonl``: a worker left running after its parent stopped writes there as
soon as the test creates ``go``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

GO_TIMEOUT_S = 120.0
"""A job waits this long at most for ``go``: a worker left behind by a failing test still ends."""
POLL_S = 0.05
"""Pause between looks for ``go``."""

PARENT = """
import sys, types
from apps import commands
from apps.experiments import parallel
from tests.apps.experiments import sweep_jobs

parallel._arm_job = sweep_jobs.arm_waiting_for_go
run = types.SimpleNamespace(serving=types.SimpleNamespace(torch_threads=1), where=sys.argv[1])
plan = [(run, ["a", "b", "c", "d"])]
sys.exit(commands.resumable(lambda: parallel.run_arms_inprocess(plan, None, 2, lambda run, names: False,
                                                            lambda line: print(line, flush=True))))
"""
"""``python -c PARENT WHERE``: a sweep of four such jobs, two at a time, as ``online-sao simulate``
runs one (its Ctrl-C and SIGTERM handling included)."""


def arm_waiting_for_go(run, name: str, classifier, pretrain_file, threads: int, label: str) -> str:
    where = Path(run.where)
    (where / f"started-{name}").write_text(str(os.getpid()))
    deadline = time.monotonic() + GO_TIMEOUT_S
    while not (where / "go").exists() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    with (where / "results.jsonl").open("a") as fh:
        fh.write(json.dumps({"arm": name, "pid": os.getpid()}) + "\n")
    return name
