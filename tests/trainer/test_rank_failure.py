"""One rank of a torchrun learner fails: the job ends within seconds, with the failure in its output,
instead of the other rank waiting in a collective for gloo's 30 minutes (trainer/distributed.py,
``run_on_ranks``; ``trainer.collective_timeout_s``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import _free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = REPO_ROOT / "tests" / "trainer" / "rank_failure_worker.py"
RUN_TIMEOUT_S = 180
"""Two ranks importing torch on two shared cores, then a failure handled in seconds; a job that is
still running after this waits for a collective timeout it should not need (30 minutes on gloo)."""
STOP_TIMEOUT_S = 60
"""torchrun's own wait for its ranks after a SIGTERM (it kills those left after 30 s)."""


def _torchrun(tmp_path: Path, *worker_args: str) -> subprocess.CompletedProcess:
    """Run the worker on two gloo ranks; a job past :data:`RUN_TIMEOUT_S` is stopped and fails the test.
    Output goes to a file: torchrun starts each rank in a session of its own, so a pipe would stay open
    as long as a rank lives, and only torchrun's own SIGTERM handling stops them all."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(WORKER), *worker_args]
    log = tmp_path / "torchrun.log"
    with log.open("w") as out:
        job = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            job.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            job.send_signal(signal.SIGTERM)  # torchrun terminates its ranks, then exits
            job.wait(timeout=STOP_TIMEOUT_S)
            pytest.fail(f"the job was still running after {RUN_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
    return subprocess.CompletedProcess(cmd, job.returncode, log.read_text())


# slow like the other gloo tests (tests/trainer/test_distributed.py): a CI-only rank abort is under study
@pytest.mark.slow
def test_a_rank_that_raises_ends_the_job_with_its_error(tmp_path):
    done = _torchrun(tmp_path, "--mode", "raise")
    assert done.returncode != 0
    assert "RuntimeError: injected failure on rank 1" in done.stdout


@pytest.mark.slow
def test_a_rank_that_stops_answering_ends_the_job_after_the_collective_timeout(tmp_path):
    done = _torchrun(tmp_path, "--mode", "stall", "--timeout-s", "5")
    assert done.returncode != 0
    # rank 0 is the one that failed: its collective timed out while rank 1 slept
    assert "Root Cause" in done.stdout and "rank      : 0" in done.stdout, done.stdout[-4000:]
