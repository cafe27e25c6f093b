"""Tests for data_pipeline/files.py: a killed writer's temporaries are removed by the next one, and only those."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

from data_pipeline.files import atomic_dir, temp_sibling


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_temp_sibling_removes_dead_processes_leftovers_on_this_host_only(tmp_path):
    target = str(tmp_path / "corpus.bin")
    host = socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_file = f"{target}.tmp-{host}-{_dead_pid()}"
        dead_npy = f"{target}.tmp-{host}-{_dead_pid()}.npy"
        dead_dir = f"{target}.tmp-{host}-{_dead_pid()}"
        kept = [f"{target}.tmp-{host}-{live.pid}", f"{target}.tmp-other{host}-{_dead_pid()}",
                f"{target}.tmp-{host}-notapid", f"{target}.old-{host}-{_dead_pid()}"]
        for path in (dead_file, dead_npy, *kept):
            open(path, "w").close()
        os.makedirs(os.path.join(dead_dir, "inner"))
        assert temp_sibling(target) == f"{target}.tmp-{host}-{os.getpid()}"
        assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in kept)
    finally:
        live.kill()
        live.wait()


def test_a_killed_atomic_dirs_temporary_is_removed_by_the_next(tmp_path):
    out = str(tmp_path / "tokenizer")
    leftover = f"{out}.tmp-{socket.gethostname()}-{_dead_pid()}"
    os.makedirs(leftover)
    open(os.path.join(leftover, "tokenizer.json"), "w").close()
    with atomic_dir(out) as tmp:
        open(os.path.join(tmp, "vocab.json"), "w").close()
    assert os.listdir(tmp_path) == ["tokenizer"] and os.listdir(out) == ["vocab.json"]
