"""bench/gpu_check.py without a GPU: the dry run in tiny form writes summary.json with every key the GPU run
fills, measures the tiny offloaded step and profiles it, and --merge joins phase runs into one summary; the
shipped_config, largest and no_offload (compile / FP8 / chunked-loss rows) phases each dry-run at tiny sizes, and
the measurement worker runs plain torch with the chunked loss."""
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


def dry_run(tmp_path, *args: str) -> dict:
    """One tiny phase run on the CPU; its summary.json."""
    out = tmp_path / "check"
    res = run_check("--out", str(out), *args, timeout=230)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the no-CUDA path")


@no_cuda
@pytest.mark.timeout(240)  # about 15 s of CPU: two short processes and train_gpt.py, slower on a busy machine
def test_shipped_config_dry_run(tmp_path):
    got = dry_run(tmp_path, "--only", "shipped_config")["shipped_config"]
    assert got["config"] == "configs/gpt2_xl_zero3_offload.py"
    assert got["tokens_per_step"] == got["batch"] * got["accum"] * got["seq"] and got["accum"] > 1
    run = got["train_gpt"]  # the user's command: its metrics.jsonl and its process times
    assert all(s > 0 for s in run["host_step_s"])  # offloaded: the host step's seconds, from metrics.jsonl
    assert "error" not in run, run
    assert run["timed_steps"] == run["records"] - 1 >= 1 and run["tokens_per_s"] > 0
    assert all(b > 0 for b in run["h2d_bytes"] + run["d2h_bytes"])  # gradients down, masters up, every step
    assert run["user_s"] > 0 and run["sys_s"] >= 0 and run["wall_s"] > 0
    z = got["zerogpt"]  # the same batch shape through gpu_measure.py
    assert "error" not in z, z
    assert (z["spec"]["batch"], z["spec"]["accum"], z["spec"]["seq"]) == (got["batch"], got["accum"], got["seq"])
    assert z["tokens_per_step"] == got["tokens_per_step"] and z["tokens_per_s"] > 0
    assert 0 < z["host_step_s"] < z["step_s"] and z["cpu_user_s_per_step"] > 0
    assert (z["h2d_bytes"], z["d2h_bytes"]) == (run["h2d_bytes"][-1], run["d2h_bytes"][-1])  # same copies
    assert z["process"]["user_s"] > 0 and z["process"]["wall_s"] > 0
    assert "not in --systems" in got["deepspeed"]["error"] and got["zerogpt_over_deepspeed"] is None


@no_cuda
@pytest.mark.timeout(240)  # about 15 s of CPU: three short processes
def test_largest_dry_run(tmp_path):
    got = dry_run(tmp_path, "--only", "largest", "--largest-tries", "1",
                  "--largest-variants", "zerogpt,zerogpt_disk,zerogpt_bf16_state,deepspeed")["largest"]
    assert "not in --systems" in got["deepspeed"]["error"]
    for name in ("zerogpt", "zerogpt_disk", "zerogpt_bf16_state"):
        v = got[name]
        assert len(v["rows"]) == 1 and v["estimate"]["layers"] >= 1 and v["host_bytes_free_gib"] > 0, v
        row = v["rows"][0]
        assert row["spec"]["meta_init"] and row["spec"]["offload"].endswith("+param") and row["est_host_gib"] > 0
        if name == "zerogpt_bf16_state" and "error" in row:  # the option is not in the engine: recorded
            assert v["errors"] and v["layers"] is None
            continue
        assert "error" not in row, row
        assert v["layers"] == row["spec"]["shape"][0] and v["params"] == row["params"] > 0
        assert v["host_bytes_per_param"] == pytest.approx(row["peak_host_gib"] * 2**30 / row["params"])
        assert v["build_s"] > 0 and v["step_s"] > 0
    assert got["zerogpt_disk"]["rows"][0]["spec"]["offload"] == "disk+param" and got["zerogpt_disk"]["disk_fs"]
    assert got["zerogpt_bf16_state"]["rows"][0]["spec"]["state_dtype"] == "bf16"
    est = {name: got[name]["estimate"]["est_host_bytes_per_param"] for name in got if name != "deepspeed"}
    assert est["zerogpt_disk"] < est["zerogpt_bf16_state"] < est["zerogpt"]  # Adam's moments leave the host


@no_cuda
@pytest.mark.timeout(240)  # two processes: 20 s, 40 s on a cold inductor cache (the compile rows), more when busy
def test_no_offload_compile_fp8_and_chunked_loss_rows_dry_run(tmp_path):
    summary = dry_run(tmp_path, "--only", "no_offload", "--no-offload-models", "gpt2_xl", "--systems", "zerogpt",
                      "--no-offload-stages", "3", "--steps", "1")
    table = {r["variant"]: r for r in summary["no_offload_gpt2_xl_variants"]}
    assert set(table) == {"eager", "compile", "fp8", "fp8+compile", "chunked loss", "compile+chunked loss"}
    assert all(r["system"] == "zerogpt" and r["stage"] == 3 for r in table.values())
    for variant in ("eager", "compile", "chunked loss", "compile+chunked loss"):
        assert table[variant]["error"] is None and table[variant]["tokens_per_s"] > 0
        assert table[variant]["first_step_s"] > 0
    assert table["compile"]["compile_s"] is not None and table["eager"]["compile_s"] is None
    assert table["compile+chunked loss"]["compile_s"] is not None and table["chunked loss"]["compile_s"] is None
    for variant in ("fp8", "fp8+compile"):  # float8 needs CUDA: an error row on the CPU, and the phase goes on
        assert table[variant]["error"] and table[variant]["tokens_per_s"] is None
    rows = summary["no_offload_rows"]
    assert {(r["variant"], r["spec"]["precision"], r["spec"]["compile"], r["spec"]["chunked_loss"]) for r in rows} == {
        ("eager", None, False, False), ("compile", None, True, False), ("fp8", "fp8", False, False),
        ("fp8+compile", "fp8", True, False), ("chunked loss", None, False, True),
        ("compile+chunked loss", None, True, True)}
    # the chunked rows took the model's own loss, without logits, in several chunks, and it is the plain loss
    # (fp32 on the CPU, same seed and batches) up to summation order, step after step
    by_variant = {r["variant"]: r for r in rows}
    for chunked, plain in (("chunked loss", "eager"), ("compile+chunked loss", "compile")):
        assert table[chunked]["chunked_loss_ran"] and not table[plain]["chunked_loss_ran"]
        spec = by_variant[chunked]["spec"]
        assert spec["loss_chunk_size"] < spec["batch"] * spec["seq"]  # several chunks per micro-batch
        assert by_variant[chunked]["losses"] == pytest.approx(by_variant[plain]["losses"], rel=1e-5)


@no_cuda
@pytest.mark.timeout(120)  # one short process, no compile: about 10 s
def test_measure_worker_runs_torch_with_the_chunked_loss(tmp_path):
    """Plain torch takes the chunked loss as zerogpt does (a fair side-by-side); DeepSpeed refuses it in a row."""
    base = dict(shape=[2, 2, 64], batch=2, seq=64, steps=1, warmup=1, vocab=512)
    specs = [dict(base, system="torch"), dict(base, system="torch", chunked_loss=True, loss_chunk_size=32),
             dict(base, system="deepspeed", chunked_loss=True)]
    result = tmp_path / "results.json"
    res = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_measure.py"), json.dumps(specs),
                          str(result)], capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                         timeout=100)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    plain, chunked, deepspeed = json.loads(result.read_text())
    assert "error" not in plain and "error" not in chunked, (plain, chunked)
    assert chunked["chunked_loss_ran"] and not plain["chunked_loss_ran"]
    assert chunked["losses"] == pytest.approx(plain["losses"], rel=1e-5) and len(plain["losses"]) == 2
    assert deepspeed["error"] == "ValueError" and "chunked_loss=True" in deepspeed["detail"]


def test_unknown_phase_is_refused(tmp_path):
    res = run_check("--out", str(tmp_path), "--only", "env,offlaod", timeout=60)
    assert res.returncode == 2 and "unknown phase(s) ['offlaod']" in res.stderr, res.stderr
