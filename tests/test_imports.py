"""Importing zerogpt, model_zoo or data_pipeline changes nothing process-wide: no umask, no malloc setting,
no threads. Those happen in `initialize()` from config keys, where `engine.describe()` reports them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import json, os, resource, threading
    os.umask(0o027)
    import data_pipeline.io, data_pipeline.run_all, model_zoo, zerogpt, zerogpt.build_engine, zerogpt.engine
    import zerogpt.trainer, zerogpt.zero.comm, zerogpt.optim
    umask = os.umask(0o027)
    print(json.dumps({"umask": umask, "threads": [t.name for t in threading.enumerate()]}))
""")


@pytest.mark.timeout(120)
def test_imports_leave_the_process_alone():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=110, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["umask"] == 0o027, oct(result["umask"])
    assert result["threads"] == ["MainThread"], result["threads"]


def test_atomic_write_creates_files_with_the_umask_mode(tmp_path):
    from data_pipeline.io import atomic_write

    old = os.umask(0o027)
    try:
        with atomic_write(str(tmp_path / "out.txt")) as f:
            f.write("x")
    finally:
        os.umask(old)
    assert (tmp_path / "out.txt").read_text() == "x"
    assert (tmp_path / "out.txt").stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
