"""bench/gpu_check.py without a GPU: which slice --next picks (made-up result files), --record, the goals' statuses,
bench/README.md's goals block against bench/results/, the watchdog and the budget, each slice's full-size plan, and
the four slices' tiny CPU forms end to end in one run."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import zerogpt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "bench")
SCRIPT = os.path.join(BENCH, "gpu_check.py")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny forms are the no-CUDA path")


@pytest.fixture(scope="module")
def slices():
    """bench/gpu_slices, imported as gpu_check.py imports it (bench/ last on the path, only while importing)."""
    sys.path.append(BENCH)
    try:
        from gpu_slices import compute, largest, record, runner, verify
    finally:
        sys.path.remove(BENCH)
    return argparse.Namespace(compute=compute, largest=largest, record=record, runner=runner, verify=verify)


def write(d, name: str, **rec) -> None:
    (d / name).write_text(json.dumps(dict(dict(figures={}), **rec)))


def run_check(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO), timeout=timeout)


# -- the record: which slice is next, --record, the goals ---------------------------------------------------------

def test_next_slice_takes_the_first_missing_then_the_oldest(tmp_path, slices):
    nxt = slices.record.next_slice
    assert nxt(tmp_path) == "verify"
    write(tmp_path, "gpu_h100_2026-11-24_goals.json", slice=None)  # the first run's figures: no slice
    write(tmp_path, "gpu_cpu_2026-12-01_offload.json", slice="offload", tiny=True)  # a tiny run never counts
    write(tmp_path, "gpu_h100_2026-12-01_verify.json", slice="verify", measured_at="2026-12-01T10:00:00Z")
    assert nxt(tmp_path) == "offload"
    write(tmp_path, "gpu_h200_2026-12-02_largest.json", slice="largest", measured_at="2026-12-02T09:00:00Z")
    assert nxt(tmp_path) == "offload"  # missing ones first, in order, whatever else is there
    write(tmp_path, "gpu_h100_2026-12-02_offload.json", slice="offload", measured_at="2026-12-02T09:00:00Z")
    assert nxt(tmp_path) == "compute"
    write(tmp_path, "gpu_h100_2026-12-03_compute.json", slice="compute")  # no measured_at: its date counts
    assert nxt(tmp_path) == "verify"  # every slice has one: the oldest
    write(tmp_path, "gpu_h100_2026-12-04_verify_b.json", slice="verify", measured_at="2026-12-04T08:00:00Z",
          complete=False)  # a partial result counts too
    assert nxt(tmp_path) == "offload"  # offload and largest tie at 2026-12-02 09:00: the order decides
    write(tmp_path, "gpu_h100_2026-12-05_offload.json", slice="offload", measured_at="2026-12-05T08:00:00Z")
    assert nxt(tmp_path) == "largest"
    write(tmp_path, "gpu_h100_2026-12-05_largest.json", slice="largest", measured_at="2026-12-05T09:00:00Z")
    assert nxt(tmp_path) == "compute"  # 2026-12-03 (a date, the day's start) is now the oldest


def test_record_copies_device_results_and_rewrites_the_readme_block(tmp_path, slices):
    rec = slices.record
    device, results = tmp_path / "device", tmp_path / "results"
    device.mkdir()
    results.mkdir()
    write(device, "gpu_h100_2026-12-01_verify.json", slice="verify", device="h100", date="2026-12-01",
          commit="0123456789abcdef", measured_at="2026-12-01T10:00:00Z", complete=True,
          figures=dict(train_gpt_tokens_per_s=26000.0))
    assert rec.record([str(device / "gpu_h100_2026-12-01_verify.json")], str(results)) == \
        ["gpu_h100_2026-12-01_verify.json"]
    # the same file again is recorded already; another result of that name gets a suffix
    assert rec.record([str(device / "gpu_h100_2026-12-01_verify.json")], str(results)) == \
        ["gpu_h100_2026-12-01_verify.json"]
    write(device, "gpu_h100_2026-12-01_verify.json", slice="verify", measured_at="2026-12-01T18:00:00Z",
          figures=dict(train_gpt_tokens_per_s=27000.0))
    assert rec.record([str(device / "gpu_h100_2026-12-01_verify.json")], str(results)) == \
        ["gpu_h100_2026-12-01_verify_b.json"]
    write(device, "gpu_cpu_2026-12-01_verify.json", slice="verify", tiny=True)
    with pytest.raises(ValueError, match="tiny CPU runs are not recorded"):
        rec.record([str(device / "gpu_cpu_2026-12-01_verify.json")], str(results))
    readme = tmp_path / "README.md"
    readme.write_text(f"# bench\n\nbefore\n\n{rec.BEGIN}\nold\n{rec.END}\n\nafter\n")
    assert rec.update_readme(str(readme), str(results)) and not rec.update_readme(str(readme), str(results))
    text = readme.read_text()
    assert text.startswith("# bench\n\nbefore\n\n") and text.endswith("\n\nafter\n") and "old" not in text
    assert "27,000 tok/s" in text and "[gpu_h100_2026-12-01_verify_b.json](results/gpu_h100_2026-12-01_verify_b.json)" \
        in text and "| verify | h100, 2026-12-01, 0123456" not in text  # the newer one is the latest
    assert "Next slice (`python bench/gpu_check.py --next`): **offload**" in text
    (tmp_path / "bare.md").write_text("no block")
    with pytest.raises(ValueError, match="has no generated goals block"):
        rec.update_readme(str(tmp_path / "bare.md"), str(results))


def test_goal_statuses_and_figures_taken_together(tmp_path, slices):
    rec = slices.record
    write(tmp_path, "gpu_h100_2026-11-24_goals.json", date="2026-11-24", commit="baad7cf",
          figures=dict(largest_params=3.9e9, largest_host_bytes_per_param=25.6, largest_state_dtype="fp32",
                       largest_build_s=236, deepspeed_build_s=67, mfu_best=0.404, host_step_s=2.15))
    write(tmp_path, "gpu_h100_2026-12-01_verify.json", slice="verify", commit="a" * 40,
          figures=dict(train_gpt_tokens_per_s=26000.0))
    write(tmp_path, "gpu_h100_2026-12-02_offload.json", slice="offload", commit="b" * 40, dirty_files=2,
          figures=dict(shipped_deepspeed_tokens_per_s=12000.0, k16_zerogpt_tokens_per_s=9000.0,
                       k16_deepspeed_tokens_per_s=8000.0, host_step_s=0.7))
    # a newer largest try that did not train: its size shows, the figures stay those of one record
    write(tmp_path, "gpu_h100_2026-12-03_largest.json", slice="largest", commit="c" * 40,
          figures=dict(largest_params=None, largest_tried="8.03B (32 layers): host_ram", deepspeed_unbuilt_after_s=90))
    rows = {r["goal"].figure: r for r in rec.goals_rows(rec.load_records(str(tmp_path)))}
    shipped = rows["shipped config through train_gpt.py"]
    assert shipped["status"] == "met" and "= 2.17×" in shipped["text"]  # train_gpt from verify, DeepSpeed from offload
    assert [s["slice"] for s in shipped["sources"]] == ["verify", "offload"]
    assert rows["16k tokens per step"]["status"] == "unmet"  # 1.125×
    assert rows["host step for 1.56B"]["status"] == "met" and "0.70 s" in rows["host step for 1.56B"]["text"]
    largest = rows["largest model"]
    assert largest["status"] == "unmet" and "3.90B at 25.6 B/param" in largest["text"]
    assert "vs DeepSpeed 67 s" in largest["text"] and "newest try: 8.03B (32 layers): host_ram" in largest["text"]
    assert "tokens/s" not in largest["text"]  # a record from before the shipped step was measured: nothing shown
    assert rows["MFU without offload"]["status"] == "unmet"
    assert rows["`pytest -m gpu`"]["status"] == "unmeasured"
    syncs = [g for g in rec.GOALS if g.keys[0] == "syncs_per_step_max"][0]
    assert rec._status(syncs, dict(syncs_per_step_max=0.0, sync_rows_failed=0)) == "met"
    assert rec._status(syncs, dict(syncs_per_step_max=0.0, sync_rows_failed=2)) == "partly measured"
    assert rec._status(syncs, dict(syncs_per_step_max=1.0)) == "unmet"
    markdown = rec.goals_markdown(str(tmp_path))
    assert "h100, 2026-12-02, bbbbbbb + uncommitted edits" in markdown and "Next slice" in markdown
    # the largest goal met: 8B, 12 B/param or less, bf16 moments, DeepSpeed still building when zerogpt had built
    v = dict(largest_params=8.03e9, largest_host_bytes_per_param=11.9, largest_state_dtype="bf16",
             largest_build_s=80.0, deepspeed_unbuilt_after_s=95.0)
    goal = rec.GOALS[3]
    assert rec._status(goal, v) == "met"
    assert rec._status(goal, dict(v, deepspeed_unbuilt_after_s=60.0)) == "partly measured"  # not known to be slower
    assert rec._status(goal, dict(v, deepspeed_unbuilt_after_s=None, deepspeed_build_s=70.0)) == "unmet"
    assert rec._status(goal, dict(v, largest_state_dtype="fp32")) == "unmet"
    shipped_8b = dict(v, largest_tokens_per_s=12345.4, largest_step_shape="8 x 8192 tokens, chunked loss")
    assert "; shipped config's step (8 x 8192 tokens, chunked loss) 12,345 tokens/s" in rec._text(goal, shipped_8b, {})
    assert rec._status(goal, shipped_8b) == "met"  # a figure beside the goal, not part of it
    assert rec._status(rec.GOALS[0], {}) == "unmeasured" and rec._text(rec.GOALS[0], {}, {}) == "no figure yet"
    assert rec._status(rec.GOALS[0], dict(train_gpt_tokens_per_s=30000.0)) == "partly measured"


def test_readme_goals_block_matches_bench_results(slices):
    """bench/README.md's GPU goals table is what bench/results/ gives: a recorded result updates it
    (`python bench/gpu_check.py --update-readme`, which --record runs)."""
    rec = slices.record
    block = rec.readme_block(os.path.join(BENCH, "README.md"))
    assert block == rec.goals_markdown(os.path.join(BENCH, "results")), "run python bench/gpu_check.py --update-readme"


# -- the machinery: watchdog, budget, plans ---------------------------------------------------------------------

def test_watchdog_kills_at_the_deadline_and_stops_on_request(slices, tmp_path):
    runner = slices.runner
    sleeper = [sys.executable, "-c", "import signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *a: sys.exit(130))\nprint('up', flush=True)\ntime.sleep(60)"]
    t0 = time.monotonic()
    run = runner.run_watched(sleeper, timeout_s=1.5, reserve_bytes=0)
    assert run["killed"] == "timeout" and run["returncode"] == -9 and time.monotonic() - t0 < 20
    out = tmp_path / "out.txt"  # as train_gpt.py is stopped: a SIGTERM once its output says it is far enough
    run = runner.run_watched(sleeper, timeout_s=30, reserve_bytes=0, output_path=str(out),
                             stop_when=lambda: "up" in out.read_text())
    assert run["stopped"] and run["killed"] is None and run["returncode"] == 130 and run["output"] == "up\n"
    budget = runner.Budget(100.0, time.monotonic())
    assert 84 < budget.left() <= 85  # the margin for the result is kept back
    assert budget.share(1, 3) == pytest.approx(budget.left() / 4, rel=1e-3) and budget.can_start(21)
    assert runner.device_tag("NVIDIA H100 80GB HBM3") == "h100" and runner.device_tag("NVIDIA H200") == "h200"
    assert runner.device_tag(None) == "cpu"


def test_full_size_plans(slices):
    """What a GPU run measures (built here, not run): the sync matrix, the compute rows, the 8B's depth."""
    args = argparse.Namespace(tiny=False, seq=1024, vocab=50257, llama_vocab=128256, steps=3, warmup=2,
                              systems=["zerogpt", "deepspeed", "torch"], host_reserve_gib=8.0,
                              largest_bytes_per_param=14.0, largest_max_layers=32)
    rows = {(s.stage, s.offload, s.compile, s.chunked_loss, s.state_dtype) for s in slices.verify.sync_specs(args)}
    assert {(t, o) for t, o, *_ in rows} >= {(t, o) for t in range(4) for o in ("none", "cpu")}
    assert {(3, "cpu+param"), (3, "disk")} <= {(t, o) for t, o, *_ in rows}
    assert (3, "none", True, False, None) in rows and (3, "none", False, True, None) in rows
    assert (3, "cpu", False, False, "bf16") in rows
    plan = slices.compute.plan(args)
    assert {(v, s.stage) for g in plan.values() for v, s in g if s.system == "zerogpt"} == {
        (v, t) for v in ("eager", "chunked loss", "compile", "compile+chunked loss", "fp8", "fp8+compile")
        for t in (0, 3)}
    assert all(s.shape == (48, 25, 1600) and s.batch == 8 for g in plan.values() for _, s in g)
    assert slices.largest.params_at(32, args) == 8_030_261_248  # Llama-3.1-8B
    depth = slices.largest.choose_depth(args)
    assert 1 <= depth["layers"] <= 32 and depth["params"] == slices.largest.params_at(depth["layers"], args)
    # zerogpt at the shipped 8B config's step, read from its file; DeepSpeed (no chunked loss) at 1 x --seq
    cfg = zerogpt.Config.from_file(os.path.join(REPO, slices.largest.SHIPPED_CONFIG))
    step = slices.largest.shipped_step(args)
    z, d = (slices.largest.spec_for(s, args, depth, step) for s in ("zerogpt", "deepspeed"))
    assert (z.batch, z.seq, z.accum) == (cfg.BATCH_SIZE, cfg.SEQ_LEN, cfg.GRADIENT_ACCUMULATION)
    assert (z.chunked_loss, z.checkpoint) == (cfg.model["chunked_loss"], cfg.model["checkpoint"])
    assert (z.bucket_mb, z.prefetch) == (cfg.zero["shard_strategy"].bucket_mb, cfg.zero["prefetch"])
    assert (z.stage, z.offload, z.state_dtype, z.steps, z.warmup) == (3, "cpu+param", "bf16", 1, 1)
    assert (d.batch, d.seq, d.chunked_loss, d.state_dtype, d.checkpoint) == (1, 1024, False, None, True)
    assert z.shape == d.shape == (depth["layers"], 32, 4096)
    assert slices.largest.step_shape(step).startswith(f"{cfg.BATCH_SIZE} x {cfg.SEQ_LEN}")


# -- the tiny forms, end to end ----------------------------------------------------------------------------------

@no_cuda
@pytest.mark.timeout(300)  # one process and its six children: about 40 s of CPU
def test_every_slice_runs_in_tiny_form(tmp_path, slices):
    res = run_check("--slice", "verify,offload,largest,compute", "--out", str(tmp_path), "--commit", "abc1234",
                    timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    date = time.strftime("%Y-%m-%d", time.gmtime())
    got = {}
    for name in ("verify", "offload", "largest", "compute"):
        path = tmp_path / f"gpu_cpu_{date}_{name}.json"
        if not path.exists():  # the run crossed midnight UTC
            path = next(tmp_path.glob(f"gpu_cpu_*_{name}.json"))
        r = got[name] = json.loads(path.read_text())
        assert r["slice"] == name and r["device"] == "cpu" and r["tiny"] and r["commit"] == "abc1234"
        assert r["stopped_by"] is None and r["env"]["torch"] == torch.__version__ and r["elapsed_s"] > 0, r
    assert {p.name for p in tmp_path.iterdir()} >= {"gpu_check.log", "profile_offload.txt"}

    v = got["verify"]  # syncs: counted on a GPU only; every row a run of its CUDA path's CPU twin
    assert [(s["stage"], s["offload"]) for s in v["syncs"]] == [(0, "none"), (3, "cpu+param"), (3, "disk"),
                                                                 (3, "none")]
    assert all(s["error"] is None and s["syncs_per_step"] is None and s["losses"] for s in v["syncs"]), v["syncs"]
    t = v["train_gpt"]  # stopped by SIGTERM once logged, nothing saved
    assert t["stopped"] and t["returncode"] == 130 and "error" not in t, t
    assert t["timed_steps"] >= 1 and t["tokens_per_s"] > 0 and all(b > 0 for b in t["h2d_bytes"] + t["d2h_bytes"])
    assert v["figures"]["train_gpt_tokens_per_s"] == t["tokens_per_s"] and v["pytest"]["ran"] is False
    assert "tests/zero/test_gpu.py" in v["pytest"]["files"] and v["complete"]

    o = got["offload"]
    z_shipped, z_16k = o["rows"]
    assert "error" not in z_shipped and "error" not in z_16k, o["rows"]
    assert (z_shipped["spec"]["batch"], z_shipped["spec"]["accum"]) == (2, o["shipped_shape"]["accum"])
    assert z_shipped["spec"]["bucket_mb"] == o["shipped_shape"]["bucket_mb"] and z_16k["spec"]["offload"] == "cpu"
    assert z_shipped["h2d_bytes"] > 0 and z_shipped["engine_host_step_s"] > 0 and z_shipped["host_step_s"] > 0
    assert o["figures"]["host_step_s"] == z_shipped["engine_host_step_s"] and o["profile"] == "profile_offload.txt"
    assert o["figures"]["k16_deepspeed_tokens_per_s"] is None and "deepspeed: not in --systems" in o["skipped"][0]

    big = got["largest"]
    (row,) = big["rows"]
    assert "error" not in row and row["spec"]["model"] == "llama3_8b" and row["spec"]["meta_init"], row
    assert row["spec"]["offload"] == "cpu+param" and row["params"] == big["depth"]["params"]
    assert big["figures"]["largest_params"] == row["params"] and big["figures"]["largest_build_s"] > 0
    assert big["figures"]["largest_host_bytes_per_param"] == pytest.approx(row["host_bytes_per_param"])
    # zerogpt at the shipped 8B config's step, shrunk to 2 x 64 tokens: its knobs, its loss, tokens/s
    step, full = big["shipped_step"], slices.largest.shipped_step(argparse.Namespace(tiny=False))
    assert (step["batch"], step["seq"]) == (2, 64) and all(
        step[k] == full[k] for k in ("accum", "checkpoint", "chunked_loss", "bucket_mb", "prefetch"))
    assert {k: row["spec"][k] for k in ("batch", "seq", "accum", "bucket_mb", "prefetch", "loss_chunk_size",
                                        "chunked_loss", "checkpoint")} == step
    assert row["chunked_loss_ran"] == step["chunked_loss"]
    tok = big["figures"]["largest_tokens_per_s"]
    assert tok > 0 and tok == row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["step_s"])
    assert big["figures"]["largest_step_shape"] == slices.largest.step_shape(step)
    # as the goals table shows it, were this a GPU's record
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "gpu_h100_2026-12-01_largest.json").write_text(json.dumps(dict(big, tiny=False)))
    assert f"; shipped config's step ({big['figures']['largest_step_shape']}) {tok:,.0f} tokens/s" in \
        slices.record.goals_markdown(str(tmp_path / "results"))

    c = got["compute"]
    table = {(r["system"], r["stage"], r["variant"]): r for r in c["table"]}
    assert set(table) == {("zerogpt", t, v) for t in (0, 3) for v in ("eager", "chunked loss", "fp8")} | {
        ("torch", 0, "eager")}
    for stage in (0, 3):
        eager, chunked = table[("zerogpt", stage, "eager")], table[("zerogpt", stage, "chunked loss")]
        assert eager["error"] is None and chunked["error"] is None and chunked["chunked_loss_ran"]
        assert not eager["chunked_loss_ran"] and chunked["first_loss"] == pytest.approx(eager["first_loss"], rel=1e-5)
        assert table[("zerogpt", stage, "fp8")]["error"]  # float8 needs CUDA: an error row, and the slice goes on
    assert len(c["errors"]) == 2 and c["figures"]["mfu_best"] is None  # no MFU without a known peak


@no_cuda
@pytest.mark.timeout(120)
def test_a_try_killed_while_training_keeps_its_build_figures(slices):
    """The largest slice's 8B step may not finish in its share: the build's params, seconds and host peak stay."""
    spec = slices.runner.Spec("zerogpt", (2, 2, 32), batch=1, seq=16, steps=10**6, warmup=0, vocab=64)
    (row,) = slices.runner.run_specs([spec], timeout_s=25, reserve_bytes=0)
    assert row["error"] and row["stopped_in"] == "train", row
    built = row["built"]
    assert built["params"] > 0 and 0 < built["build_s"] < 25 and built["build_peak_host_gib"] > 0, built


@no_cuda
@pytest.mark.timeout(120)
def test_a_slice_cut_by_its_budget_still_writes_its_result(tmp_path):
    """16 s of budget less the 15 kept for the result: nothing starts, and the file says so."""
    res = run_check("--slice", "compute", "--out", str(tmp_path), "--budget-s", "16", timeout=100)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (path,) = tmp_path.glob("gpu_cpu_*_compute.json")
    r = json.loads(path.read_text())
    assert not r["complete"] and (r["skipped"] or r["stopped_by"]), r
    assert all("not started" in s for s in r["skipped"])


def test_unknown_slice_is_refused(tmp_path):
    res = run_check("--slice", "verify,offlaod", "--out", str(tmp_path), timeout=60)
    assert res.returncode == 2 and "unknown slice(s) ['offlaod']" in res.stderr, res.stderr
