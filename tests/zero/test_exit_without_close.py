"""Issue 31.9: a script that never calls engine.close() exits cleanly: at exit the shared-memory transport's thread
is joined, then the process group launch_from_torch made is destroyed, in that order, before the interpreter
tears anything down. The abort it fixes came once in 16 runs; the order is checked on every run (it fails
without the fix), and every one of several short runs must exit 0."""
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_without_close.py")
RUNS = 4


@pytest.mark.timeout(240)
def test_runs_that_skip_close_exit_cleanly_with_the_transport_and_group_torn_down(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for run in range(RUNS):
        rendezvous, report = tmp_path / f"rdzv{run}", tmp_path / f"report{run}"
        procs = [subprocess.Popen([sys.executable, SCRIPT, str(rank), "2", str(rendezvous), str(report)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
        logs = [p.communicate(timeout=60)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], (run, logs)
        assert "terminate called" not in "".join(logs)
        assert report.read_text().splitlines() == ["threads=[] initialized=False"] * 2, (run, report.read_text())
