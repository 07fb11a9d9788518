"""The stack of processes an experiment or the smoke run starts: a SIGTERM to the parent stops them."""

import os
import signal
import subprocess
import sys

import pytest

from apps.stack import Component, Stack


def test_sigterm_inside_the_stack_stops_its_processes_and_restores_the_handler(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(SystemExit) as exited:
        with Stack(None, {}, tmp_path) as stack:
            stack.components.append(Component("sleeper", child, tmp_path / "sleeper.log"))
            os.kill(os.getpid(), signal.SIGTERM)
    assert exited.value.code == 128 + signal.SIGTERM
    assert child.poll() is not None  # terminated by stop_all, not left running
    assert signal.getsignal(signal.SIGTERM) == before
