"""bench/gpu_check.py without a GPU: the dry run in tiny form writes summary.json with every key the GPU run
fills, measures the tiny offloaded step and profiles it, and --merge joins phase runs into one summary."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "gpu_check.py")


def run_check(*args: str, timeout: float = 280) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the no-CUDA path")
def test_dry_run_without_cuda_writes_the_summary(tmp_path):
    out = tmp_path / "check"
    res = run_check("--out", str(out), "--only", "env,offload,profile", "--steps", "1")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("no CUDA on this machine") == 1  # said once
    files = sorted(os.listdir(out))
    assert files == ["gpu_check.log", "profile.txt", "summary.json"], files
    summary = json.loads((out / "summary.json").read_text())
    for key in ("device", "cuda_checks_failed", "offload_gpt2_xl", "largest_params", "mfu_gpt2_xl_no_offload"):
        assert key in summary, key
    assert set(summary["offload_gpt2_xl"]) >= {"zerogpt_tokens_per_s", "deepspeed_tokens_per_s", "zerogpt_tflops",
                                               "deepspeed_tflops"}
    assert summary["tiny"] and "no CUDA" in summary["device"] and summary["cuda_checks_failed"] is None
    assert summary["env"]["torch"] == torch.__version__ and summary["env"]["cpu_adam"]["fallback"] == "torch-fused"
    assert summary["offload_gpt2_xl"]["zerogpt_tokens_per_s"] > 0 and summary["offload_gpt2_xl"]["zerogpt_tflops"] > 0
    rows = summary["offload_rows"]
    assert [(r["spec"]["system"], r["spec"]["offload"]) for r in rows] == [("zerogpt", "cpu"), ("zerogpt", "cpu+param")]
    assert all("error" not in r and r["peak_host_gib"] > 0 for r in rows), rows
    parts = {r["part"]: r for r in summary["profile"]}
    assert parts["forward"]["host_ms"] > 0 and parts["backward"]["host_ms"] > 0 and parts["CPU Adam"]["host_ms"] > 0
    assert "CPU Adam" in (out / "profile.txt").read_text()

    merged = tmp_path / "merged"
    later = tmp_path / "later"
    later.mkdir()
    (later / "summary.json").write_text(json.dumps(dict(phases_run=["largest"], largest_params=123, skipped=[],
                                                        device="ignored: env did not run here")))
    res = run_check("--merge", str(out), str(later), "--out", str(merged), timeout=60)
    assert res.returncode == 0, res.stderr
    both = json.loads((merged / "summary.json").read_text())
    assert both["largest_params"] == 123 and both["phases_run"] == ["env", "offload", "profile", "largest"]
    assert both["offload_gpt2_xl"] == summary["offload_gpt2_xl"] and both["device"] == summary["device"]


def test_unknown_phase_is_refused(tmp_path):
    res = run_check("--out", str(tmp_path), "--only", "env,offlaod", timeout=60)
    assert res.returncode == 2 and "unknown phase(s) ['offlaod']" in res.stderr, res.stderr
