"""The pipeline's console (issue 31.5): `all` shows one progress line and one summary per stage; datatrove's own
logs and each task's lines go to WORKDIR/logs/STAGE.log, and -v shows them; on a terminal a bar counts tasks.
Run as real commands (subprocesses), since what is checked is what reaches the console."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.terminal import in_a_terminal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT)


def pipeline(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "data_pipeline", *argv], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)


def corpus(path, n=40):
    path.write_text("".join(f'{{"text": "document {i} about topic {i % 7}, with some words to keep"}}\n'
                            for i in range(n)))
    return str(path)


@pytest.mark.timeout(300)
def test_all_shows_a_line_per_stage_and_keeps_the_tasks_output_in_the_workdir(tmp_path, site):
    base, _ = site
    (tmp_path / "urls.txt").write_text("".join(f"{base}/article/{i}\n" for i in range(6)) +
                                       f"{base}/dup/0\n{base}/german\n")
    work = tmp_path / "w"
    proc = pipeline("all", "--urls", str(tmp_path / "urls.txt"), "--workdir", str(work), "--allow-private",
                    "--min-tokens", "50", "--timeout", "5", "--workers", "2", "--tasks", "2", "--tokenize",
                    "--vocab-size", "300")
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = (proc.stdout + proc.stderr).splitlines()
    assert len(console) <= 21, "\n".join(console)            # was 489 lines
    assert not [line for line in console if "datatrove" in line or "Stats" in line or "/.tasks/" in line]
    for stage, output in [("cleanup", "clean.jsonl"), ("find-duplicates", "pairs.jsonl"), ("shuffle", "webtext.jsonl"),
                          ("tokenize", "webtext_text_document")]:
        summary = [line for line in console if line.startswith(f"[{stage}] ")]
        assert len(summary) == 1 and f"{work}/{output}: " in summary[0], (stage, console)
        assert summary[0].endswith(f"(task output: {work}/logs/{stage}.log)")
        log = (work / "logs" / f"{stage}.log").read_text()
        assert "Launching pipeline for rank=" in log and "Stats" in log
    assert (work / "webtext_text_document.bin").stat().st_size > 0


@pytest.mark.timeout(200)
def test_a_stage_on_an_executor_is_quiet_unless_verbose_and_draws_a_bar_on_a_terminal(tmp_path):
    docs = corpus(tmp_path / "docs.jsonl")
    args = ["shuffle", docs, "--executor", "local", "--tasks", "3", "--workers", "2", "--workdir", str(tmp_path / "w")]
    quiet = pipeline(*args, "--output", str(tmp_path / "a.jsonl"))
    assert quiet.returncode == 0 and quiet.stdout == "", quiet.stderr
    assert quiet.stderr.count("\n") == 1 and quiet.stderr.startswith(f"[shuffle] {tmp_path}/a.jsonl: docs=40")
    verbose = pipeline(*args, "--output", str(tmp_path / "b.jsonl"), "-v")
    assert verbose.returncode == 0 and verbose.stderr.count("Launching pipeline for rank=") > 3   # every job's tasks
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()

    # the same on a terminal: a bar of finished tasks, erased, then the summary
    text, _ = in_a_terminal([sys.executable, "-m", "data_pipeline", *args, "--output", str(tmp_path / "c.jsonl")],
                            ENV, ROOT, timeout=180)
    assert re.search(r"\r\[shuffle\]: [1-9]\d*/\d+ tasks \[#+ *\]", text) and "datatrove" not in text, text
    assert text.rstrip().split("\x1b[K")[-1].startswith(f"[shuffle] {tmp_path}/c.jsonl: docs=40")


@pytest.mark.timeout(300)
def test_a_stage_on_ray_is_as_quiet(tmp_path):
    pytest.importorskip("ray")
    docs = corpus(tmp_path / "docs.jsonl")
    proc = pipeline("shuffle", docs, "--output", str(tmp_path / "r.jsonl"), "--executor", "ray", "--tasks", "2",
                    "--workers", "2", "--workdir", str(tmp_path / "w"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = (proc.stdout + proc.stderr).splitlines()
    # Ray's own start-up warnings may remain; nothing from datatrove or from the tasks (Ray forwards their output)
    assert not [line for line in console if "datatrove" in line or "Stats" in line or "pid=" in line], console
    assert console[-1].startswith(f"[shuffle] {tmp_path}/r.jsonl: docs=40") and len(console) <= 4, console
    assert "Stats" in (tmp_path / "w" / "logs" / "shuffle.log").read_text()   # the driver's datatrove log
