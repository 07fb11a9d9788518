"""One serving process per spool directory: a second is refused at start, naming the holder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving.spool_lock import SpoolInUse, exclusive_spool

REPO = Path(__file__).resolve().parents[2]


def test_a_held_spool_is_refused_naming_its_holder_and_free_again_after(tmp_path):
    with exclusive_spool(tmp_path / "spool"):
        with pytest.raises(SpoolInUse, match=rf"spool_dir .*spool is in use by another serving process \(pid {os.getpid()}\)"):
            with exclusive_spool(tmp_path / "spool"):
                pass
    with exclusive_spool(tmp_path / "spool"):  # released when the holder leaves
        pass


def test_a_second_online_sao_serve_on_the_same_spool_exits_with_one_line(tmp_path):
    spool = tmp_path / "data" / "spool"
    with exclusive_spool(spool):  # the first server, here
        done = subprocess.run([sys.executable, "-m", "apps.cli", "--set", f"paths.data_dir={tmp_path / 'data'}",
                               "--set", "serving.port=0", "serve"], cwd=REPO, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"online-sao: serving.spool_dir {spool} is in use")
    assert not (tmp_path / "data" / "models").exists()  # refused before building anything


def test_a_crashed_holder_leaves_no_lock_behind(tmp_path):
    spool = tmp_path / "spool"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from serving.spool_lock import exclusive_spool\n"
                               f"with exclusive_spool(Path({str(spool)!r})):\n print('held', flush=True); time.sleep(60)"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(SpoolInUse):
        with exclusive_spool(spool):
            pass
    holder.kill()
    holder.wait(30)
    with exclusive_spool(spool):
        pass
