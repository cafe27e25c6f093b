"""bench/gpu_check.py without a GPU: which slice --next picks (made-up result files), --record, the goals' statuses,
bench/README.md's goals block against bench/results/, the watchdog and the budget, each slice's full-size plan, and
the six slices' tiny CPU forms end to end in one run, and the auto slice's in its own."""
from __future__ import annotations

import argparse
import dataclasses
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
        import gpu_measure
        from gpu_slices import auto, compute, compute_llama, largest, mfu, record, runner, verify
    finally:
        sys.path.remove(BENCH)
    return argparse.Namespace(auto=auto, compute=compute, compute_llama=compute_llama, largest=largest, mfu=mfu,
                              record=record, runner=runner, verify=verify, measure=gpu_measure)


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
    assert nxt(tmp_path) == "llama1b"
    write(tmp_path, "gpu_h100_2026-12-03_llama1b.json", slice="llama1b", measured_at="2026-12-03T11:00:00Z")
    write(tmp_path, "gpu_h100_2026-12-03_llama3b.json", slice="llama3b", measured_at="2026-12-03T12:00:00Z")
    assert nxt(tmp_path) == "auto"
    write(tmp_path, "gpu_h100_2026-12-03_auto.json", slice="auto", measured_at="2026-12-03T13:00:00Z")
    assert nxt(tmp_path) == "verify"  # every slice has one: the oldest
    assert slices.record.slice_order(tmp_path) == ["verify", "offload", "largest", "compute", "llama1b", "llama3b",
                                                   "auto"]
    write(tmp_path, "gpu_h100_2026-12-04_verify_b.json", slice="verify", measured_at="2026-12-04T08:00:00Z",
          complete=False)  # a partial result counts too
    assert nxt(tmp_path) == "offload"  # offload and largest tie at 2026-12-02 09:00: the order decides
    write(tmp_path, "gpu_h100_2026-12-05_offload.json", slice="offload", measured_at="2026-12-05T08:00:00Z")
    assert nxt(tmp_path) == "largest"
    write(tmp_path, "gpu_h100_2026-12-05_largest.json", slice="largest", measured_at="2026-12-05T09:00:00Z")
    assert nxt(tmp_path) == "compute"  # 2026-12-03 (a date, the day's start) is now the oldest
    assert slices.record.slice_order(tmp_path) == ["compute", "llama1b", "llama3b", "auto", "verify", "offload",
                                                   "largest"]


def test_next_goes_on_while_the_expected_seconds_fit(tmp_path, slices):
    """--next's second and later slices (issue 46.7): each expected to take its last result's seconds; the first in
    order that fits in what is left runs, one that does not is passed over for a shorter one after it."""
    rec = slices.record
    assert rec.expected_seconds(str(tmp_path)) == dict(slices.record.EXPECTED_S)  # no result: the estimates
    write(tmp_path, "gpu_h200_2026-12-01_verify.json", slice="verify", complete=True, elapsed_s=190.0)
    write(tmp_path, "gpu_h200_2026-12-01_compute.json", slice="compute", complete=False, elapsed_s=100.0)
    write(tmp_path, "gpu_h200_2026-12-01_llama1b.json", slice="llama1b", complete=False, elapsed_s=400.0)
    expected = rec.expected_seconds(str(tmp_path))
    assert expected["verify"] == 190.0  # a complete run: its own seconds
    assert expected["compute"] == rec.EXPECTED_S["compute"]  # cut short at 100 s: at least the estimate
    assert expected["llama1b"] == 400.0  # cut short after longer than the estimate
    order = ["largest", "offload", "compute", "verify", "llama1b"]
    expected = dict(largest=540.0, offload=274.0, compute=213.0, verify=190.0, llama1b=240.0)
    # the verify slice took 190 s of 540: 350 s left, offload (274 s) fits
    assert rec.chain_next(order, {"largest"}, expected, 350.0) == ("offload", [])
    # 250 s left after it: offload done, compute (213 s) is next in order and fits
    assert rec.chain_next(order, {"largest", "offload"}, expected, 250.0) == ("compute", [])
    # 200 s: compute does not fit, verify (190 s) after it does
    nxt, passed = rec.chain_next(order, {"largest", "offload"}, expected, 200.0)
    assert nxt == "verify" and passed == ["compute: expected 213 s, 200 s left"]
    assert rec.chain_next(order, set(order), expected, 1e9) == (None, [])
    assert rec.chain_next(order, {"largest"}, expected, 100.0)[0] is None


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
    assert rows["MFU without offload, GPT-2 XL, stage 0"]["status"] == "unmeasured"  # 0.404: no stage, no goal
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


def test_threshold_goals_and_a_recorded_compute_table_feeding_them(tmp_path, slices):
    """Issue 46's goals: met only when every held figure reaches the minimum; a GPT-2 XL compute result recorded
    before those figures existed gives them from its table (the same mfu.table_figures the slice uses)."""
    rec = slices.record
    goals = {g.figure: g for g in rec.GOALS}
    chunked = goals["chunked loss vs the plain loss"]
    assert rec._status(chunked, {}) == "unmeasured"
    assert rec._status(chunked, dict(gpt2xl_chunked_ratio=1.02)) == "partly measured"
    assert rec._status(chunked, dict(gpt2xl_chunked_ratio=1.02, llama3b_chunked_ratio=0.99)) == "unmet"
    assert rec._status(chunked, dict(gpt2xl_chunked_ratio=1.0, llama3b_chunked_ratio=1.1,
                                     llama1b_chunked_ratio=1.3)) == "met"
    assert rec._text(chunked, dict(gpt2xl_chunked_ratio=1.02, gpt2xl_chunked_ratio_what="chunked loss / eager, "
                                   "stage 3"), {}).startswith("GPT-2 XL (50k) 1.02× (chunked loss / eager, stage 3); "
                                                              "Llama-3.2-3B (128k) not measured")
    llama = goals["MFU without offload, Llama-3.2-3B"]
    v = dict(llama3b_mfu_best=0.512, llama3b_mfu_best_what="stage 0, compile, b2", llama3b_batch=2,
             llama3b_torch_mfu=0.47)
    assert rec._status(llama, v) == "met" and rec._status(llama, dict(v, llama3b_mfu_best=0.49)) == "unmet"
    assert rec._text(llama, v, {}) == "51.2% (stage 0, compile, b2); micro-batch 2 x 4096; transformers 47.0%"
    offload = goals["offload at 16k tokens per step, GPT-2 XL"]
    assert rec._status(offload, dict(k16_zerogpt_tokens_per_s=27_999.0)) == "unmet"
    assert rec._text(offload, dict(k16_zerogpt_tokens_per_s=28_500.4), {}) == "28,500 tokens/s"

    def row(stage, variant, tokens_per_s, mfu, system="zerogpt"):
        return dict(system=system, stage=stage, variant=variant, mfu=mfu, tokens_per_s=tokens_per_s, error=None)
    table = [row(0, "eager", 100.0, 0.40), row(0, "chunked loss", 90.0, 0.36), row(3, "eager", 100.0, 0.41),
             row(3, "chunked loss", 80.0, 0.33), row(0, "compile", 110.0, 0.44), row(0, "fp8+compile", 121.0, 0.48),
             row(3, "compile", 100.0, 0.45), dict(row(3, "fp8+compile", None, None), error="gpu_oom: ..."),
             row(0, "eager", 95.0, 0.39, system="torch")]
    write(tmp_path, "gpu_h200_2026-12-01_compute.json", slice="compute", table=table,
          figures=dict(gpt2xl_fp8_ratio=1.5))  # a figure the record gives itself is kept
    (record,) = rec.load_records(str(tmp_path))
    f = record["figures"]
    assert (f["gpt2xl_mfu_stage0"], f["gpt2xl_mfu_stage0_what"]) == (0.48, "stage 0, fp8+compile")
    assert (f["gpt2xl_mfu_stage3"], f["gpt2xl_mfu_best"], f["gpt2xl_torch_mfu"]) == (0.45, 0.48, 0.39)
    assert (f["gpt2xl_chunked_ratio"], f["gpt2xl_chunked_ratio_what"]) == (0.8, "chunked loss / eager, stage 3")
    assert f["gpt2xl_fp8_ratio"] == 1.5
    assert slices.mfu.table_figures("x", table)["x_fp8_ratio"] == pytest.approx(1.1)  # the failed stage 3 pair: none


def test_palm_flops_count_gqa_and_the_128k_head(slices):
    """MFU's FLOPs (PaLM appendix B: 6 N + 12 L H Q T) against a count by hand from the published shapes."""
    shape = slices.measure.llama_shape
    flops, n = slices.mfu.llama_flops_per_token, slices.mfu.llama_params_in_matmuls
    # Llama-3.2-1B: width 2048, 16 layers, 32 query heads of 64, 8 k/v heads, SwiGLU 8192, tied 128256 vocab
    layer = 2048 * 2048 + 2 * 2048 * 512 + 2048 * 2048 + 3 * 2048 * 8192 + 2 * 2048  # q, k+v (GQA), o, MLP, norms
    assert layer == 60_821_504
    n_1b = 16 * layer + 2048 + 128256 * 2048  # + final norm + the head (the tied embedding, counted once)
    assert n_1b == 1_235_814_400  # the model card's 1.24B: everything is a matmul but the (tied) lookup
    assert 6 * n_1b + 12 * 16 * 32 * 64 * 2048 == 8_220_192_768
    one_b = shape(slices.runner.Spec("zerogpt", (16, 32, 2048), model="llama3_2_1b", vocab=128256, seq=2048))
    assert n(one_b) == n_1b and flops(one_b, 2048) == 8_220_192_768
    # Llama-3.2-3B at 4096: width 3072, 28 layers, 24 heads of 128, 8 k/v heads; 3.21B
    layer = 3072 * 3072 + 2 * 3072 * 1024 + 3072 * 3072 + 3 * 3072 * 8192 + 2 * 3072
    three_b = shape(slices.runner.Spec("zerogpt", (28, 24, 3072), model="llama3_2_3b", vocab=128256, seq=4096))
    assert flops(three_b, 4096) == 6 * (28 * layer + 3072 + 128256 * 3072) + 12 * 28 * 24 * 128 * 4096 \
        == 23_504_357_376
    # an untied head (Llama-3.1-8B): the head counts, the input embedding (a lookup) does not
    eight_b = shape(slices.runner.Spec("zerogpt", (32, 32, 4096), model="llama3_8b", vocab=128256))
    assert n(eight_b) == 8_030_261_248 - 128256 * 4096
    # model_zoo's own count of the same models agrees (built on meta: no memory)
    from model_zoo import llama
    with torch.device("meta"):
        for factory, s, seq in ((llama.llama3_2_1b, one_b, 2048), (llama.llama3_2_3b, three_b, 4096),
                                (llama.llama3_8b, eight_b, 8192)):
            assert factory().flops_per_token(seq) == flops(s, seq), factory.__name__


def test_a_gpu_oom_halves_the_batch_only_when_fitting(slices):
    m = slices.measure
    fit = m.Spec("zerogpt", (2, 2, 32), batch=8, fit_batch=True)
    assert m.batch_after_oom(fit, dict(error="gpu_oom")) == 4
    assert m.batch_after_oom(m.Spec("zerogpt", (2, 2, 32), batch=1, fit_batch=True), dict(error="gpu_oom")) is None
    assert m.batch_after_oom(fit, dict(error="RuntimeError", detail="CUDA out of memory. Tried to ...")) == 4
    assert m.batch_after_oom(fit, dict(error="RuntimeError", detail="shape mismatch")) is None
    assert m.batch_after_oom(fit, {}) is None
    assert m.batch_after_oom(m.Spec("zerogpt", (2, 2, 32), batch=8), dict(error="gpu_oom")) is None
    assert m.inductor_options(None) == {} and m.inductor_options("default") == {}
    assert m.inductor_options("max-autotune-no-cudagraphs")["max_autotune"] is True
    assert "triton.cudagraphs" not in m.inductor_options("max-autotune-no-cudagraphs")


def test_the_worker_halves_a_fitting_batch_until_it_trains(slices, tmp_path, monkeypatch):
    """gpu_measure's worker with a measure() that runs out of GPU memory above batch 2: the fit row is measured at
    8, 4, then 2, says so, and is relabelled; a row that is not fitting keeps its error."""
    m = slices.measure
    tried = []

    def measure(spec, on_built):
        tried.append(spec.batch)
        if spec.batch > 2:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at batch {spec.batch}")
        return dict(spec=dataclasses.asdict(spec), tokens_per_s=1.0)
    monkeypatch.setattr(m, "measure", measure)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "DS_ACCELERATOR"):
        monkeypatch.setenv(key, "")  # recorded, so the worker's values go afterwards (a later launch would read
        monkeypatch.delenv(key)  # a RANK with no MASTER_PORT); then unset, as a fresh worker process finds them
    specs = [m.Spec("zerogpt", (2, 2, 32), batch=8, fit_batch=True, label="fit b8x16"),
             m.Spec("zerogpt", (2, 2, 32), batch=8, label="plain b8x16")]
    out = tmp_path / "rows.json"
    assert m.worker_main(json.dumps([dataclasses.asdict(s) for s in specs]), str(out)) == 0
    fit, plain = json.loads(out.read_text())
    assert tried == [8, 4, 2, 8]
    assert fit["spec"]["batch"] == 2 and fit["oom_batches"] == [8, 4] and fit["spec"]["label"] == "fit b2x16"
    assert plain["error"] == "gpu_oom" and "oom_batches" not in plain


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
                              largest_bytes_per_param=14.0, largest_max_layers=32, out="OUT")
    rows = {(s.stage, s.offload, s.compile, s.chunked_loss, s.state_dtype) for s in slices.verify.sync_specs(args)}
    assert {(t, o) for t, o, *_ in rows} >= {(t, o) for t in range(4) for o in ("none", "cpu")}
    assert {(3, "cpu+param"), (3, "disk")} <= {(t, o) for t, o, *_ in rows}
    assert (3, "none", True, False, None) in rows and (3, "none", False, True, None) in rows
    assert (3, "cpu", False, False, "bf16") in rows
    llamas = {(s.model, s.stage, s.offload, s.chunked_loss, s.vocab) for s in slices.verify.sync_specs(args)
              if s.model != "gpt"}
    assert llamas == {("llama3_8b", 3, "none", False, 128256), ("llama3_2_1b", 3, "cpu", True, 128256)}
    plan = slices.compute.plan(args)
    rows = {(s.system, v, s.stage, s.batch, s.compile_mode) for g in plan.values() for v, s in g}
    assert {(v, s.stage, s.batch, s.profile_to) for g in plan.values() for v, s in g if s.profile_to} == {
        (v, z, 8, f"OUT/{slices.compute.profile_name(v, z)}") for v in ("eager", "chunked loss") for z in (0, 3)}
    variants = ("eager", "chunked loss", "compile", "compile+chunked loss", "fp8", "fp8+compile")
    assert {r for r in rows if r[3] == 8 and r[4] is None} == {
        ("zerogpt", v, t, 8, None) for t in (0, 3) for v in variants} | {("torch", "eager", 0, 8, None)}
    # the levers: micro-batch 12 (the 49.9% anchor's) with plain PyTorch's compile beside it, CUDA graphs,
    # max-autotune
    assert {r for r in rows if r[3] != 8 or r[4]} == {
        ("zerogpt", "compile", 0, 12, None), ("zerogpt", "compile", 3, 12, None), ("torch", "compile", 0, 12, None),
        ("zerogpt", "compile reduce-overhead", 0, 8, "reduce-overhead"),
        ("zerogpt", "compile max-autotune-no-cudagraphs", 0, 8, "max-autotune-no-cudagraphs")}
    assert all(s.shape == (48, 25, 1600) for g in plan.values() for _, s in g)
    assert list(plan) == ["A", "B", "C", "D", "E"] and plan["E"][0][1].compile_mode  # the slowest compile last
    # the Llama slices: a fit row first (halving on OOM), then four modes at stages 0 and 3, transformers beside
    for name, model, seq in (("llama1b", "llama3_2_1b", 2048), ("llama3b", "llama3_2_3b", 4096)):
        groups = slices.compute_llama.plan(name, args, batch=4)
        ((_, fit),) = groups["fit"]
        assert fit.fit_batch and fit.batch == 4 and (fit.system, fit.stage, fit.compile) == ("zerogpt", 0, False)
        specs = [s for g in groups.values() for _, s in g]
        assert all(s.model == model and s.seq == seq and s.batch == 4 and s.vocab == 128256 for s in specs)
        assert {(v, s.stage) for g in groups.values() for v, s in g if s.system == "zerogpt"} == {
            (v, t) for v in ("eager", "compile", "chunked loss", "fp8+compile") for t in (0, 3)}
        torch_rows = [s for g in groups.values() for _, s in g if s.system == "torch"]
        assert [(s.compile, s.precision, s.chunked_loss) for s in torch_rows] == [(False, None, False)]
        assert sum(s.fit_batch for s in specs) == 1 and slices.compute_llama.plan(name, args)["fit"][0][1].batch == 8
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
    # auto: the shipped GPT-2 XL config and plan="auto" at the same tokens per step; no memory key set on auto
    shipped_sets, shipped_tokens = slices.verify.shipped_overrides(args)
    auto_sets, auto_tokens = slices.auto.auto_overrides(args)
    auto_cfg = zerogpt.Config.from_file(os.path.join(REPO, slices.auto.AUTO_CONFIG))
    assert shipped_tokens == auto_tokens == auto_cfg.TOKENS_PER_STEP and auto_cfg.plan == "auto"
    assert auto_sets == shipped_sets and not any(kv.split("=")[0] in ("BATCH_SIZE", "GRADIENT_ACCUMULATION")
                                                 for kv in auto_sets)


# -- the tiny forms, end to end ----------------------------------------------------------------------------------

@no_cuda
@pytest.mark.timeout(300)  # one process and its ten children: about 60 s of CPU
def test_every_slice_runs_in_tiny_form(tmp_path, slices):
    res = run_check("--slice", "verify,offload,largest,compute,llama1b,llama3b", "--out", str(tmp_path), "--commit",
                    "abc1234", timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    date = time.strftime("%Y-%m-%d", time.gmtime())
    got = {}
    for name in ("verify", "offload", "largest", "compute", "llama1b", "llama3b"):
        path = tmp_path / f"gpu_cpu_{date}_{name}.json"
        if not path.exists():  # the run crossed midnight UTC
            path = next(tmp_path.glob(f"gpu_cpu_*_{name}.json"))
        r = got[name] = json.loads(path.read_text())
        assert r["slice"] == name and r["device"] == "cpu" and r["tiny"] and r["commit"] == "abc1234"
        assert r["stopped_by"] is None and r["env"]["torch"] == torch.__version__ and r["elapsed_s"] > 0, r
    assert {p.name for p in tmp_path.iterdir()} >= {"gpu_check.log", "profile_offload.txt"}

    v = got["verify"]  # syncs: counted on a GPU only; every row a run of its CUDA path's CPU twin
    assert [(s["stage"], s["offload"]) for s in v["syncs"]] == [(0, "none"), (3, "cpu+param"), (3, "disk"),
                                                                 (3, "none"), (3, "cpu")]
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
    assert c["figures"]["gpt2xl_chunked_ratio"] > 0 and c["figures"]["gpt2xl_batch"] == 2
    assert len(c["tiny_omitted"]) == 11 and all("compile" in label for label in c["tiny_omitted"])
    assert c["profiles"] == sorted(slices.compute.profile_name(v, z) for v in ("eager", "chunked loss") for z in (0, 3))
    assert "top ops by self time" in (tmp_path / c["profiles"][0]).read_text()

    for name in ("llama1b", "llama3b"):  # the fit row, then group A at its batch: zerogpt and transformers
        r = got[name]
        table = {(t["system"], t["stage"], t["variant"]): t for t in r["table"]}
        assert set(table) == {("zerogpt", 0, "eager"), ("zerogpt", 3, "eager"), ("zerogpt", 0, "chunked loss"),
                              ("zerogpt", 3, "chunked loss"), ("torch", 0, "eager")}, r["table"]
        assert all(t["error"] is None and t["batch"] == r["batch"] == 2 for t in r["table"]), r["table"]
        assert all(row["spec"]["model"] == slices.compute_llama.MODELS[name][0] for row in r["rows"])
        assert r["rows"][0]["spec"]["fit_batch"] and r["rows"][0]["flops_per_token"] > 0
        for stage in (0, 3):  # the chunked path ran, and gave the plain loss of the same tied GQA model
            eager, chunked = table[("zerogpt", stage, "eager")], table[("zerogpt", stage, "chunked loss")]
            assert chunked["chunked_loss_ran"] and chunked["first_loss"] == pytest.approx(eager["first_loss"], rel=1e-5)
        # transformers' LlamaForCausalLM at the same shape: a fresh init of the same vocabulary, near ln(vocab)
        assert table[("torch", 0, "eager")]["first_loss"] == pytest.approx(table[("zerogpt", 0, "eager")]["first_loss"],
                                                                           rel=0.05)
        assert r["figures"][f"{name}_batch"] == 2 and r["figures"][f"{name}_chunked_ratio"] > 0
        assert r["figures"][f"{name}_mfu_best"] is None and len(r["tiny_omitted"]) == 4  # compile, fp8+compile


@no_cuda
@pytest.mark.timeout(200)
def test_auto_slice_runs_in_tiny_form(tmp_path, slices):
    """The shipped config and plan="auto" through train_gpt.py at the same tiny step: the planner's trials ran,
    its table copied out, both timed over the same steps; as the goals table shows it, were this a GPU's record."""
    res = run_check("--slice", "auto", "--out", str(tmp_path), "--commit", "abc1234", timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(next(tmp_path.glob("gpu_cpu_*_auto.json")).read_text())
    assert r["stopped_by"] is None and r["complete"] and not r["errors"], r
    shipped, auto, f = r["shipped"], r["auto"], r["figures"]
    assert shipped["config"] == slices.verify.SHIPPED_CONFIG and auto["config"] == slices.auto.AUTO_CONFIG
    assert shipped["tokens_per_step"] == auto["tokens_per_step"] == r["tokens_per_step"]
    assert shipped["timed_steps"] == auto["timed_steps"] == 1 and "error" not in auto, auto  # tiny: --shipped-steps 1
    assert f["auto_tokens_per_s"] == auto["tokens_per_s"] and f["auto_shipped_tokens_per_s"] == shipped["tokens_per_s"]
    assert f["auto_vs_shipped"] == pytest.approx(auto["tokens_per_s"] / shipped["tokens_per_s"])
    table = (tmp_path / "plan_auto.txt").read_text()
    assert f["auto_plan"] == auto["plan_line"] and auto["plan_line"] in table
    assert set(auto["factors"]) and all(v > 0 for v in auto["factors"].values())  # calibrated: trials ran
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "gpu_h200_2026-12-01_auto.json").write_text(json.dumps(dict(r, tiny=False)))
    (row,) = [x for x in slices.record.goals_rows(slices.record.load_records(str(tmp_path / "results")))
              if x["goal"].keys[0] == "auto_vs_shipped"]
    assert row["status"] == ("met" if f["auto_vs_shipped"] >= 0.95 else "unmet")
    assert f"{f['auto_vs_shipped']:.2f}×" in row["text"] and f"chose {f['auto_plan']}" in row["text"]
    # memory_model against the device's own count over a grid (a CPU: the op count), the first plans in tiny form
    m = r["memory"]
    assert m["device"]["plans"] == slices.auto.MEMORY_TINY_PLANS and not m["failed"] and m["killed"] is None, m
    assert f["auto_memory_within_10"] == m["device"]["within_10"] / m["device"]["plans"]
    assert "by op count" in f["auto_memory_within_10_what"] and (tmp_path / slices.auto.MEMORY_FILE).exists()
    (row,) = [x for x in slices.record.goals_rows(slices.record.load_records(str(tmp_path / "results")))
              if x["goal"].keys[0] == "auto_memory_within_10"]
    assert row["status"] == ("met" if f["auto_memory_within_10"] == 1 else "unmet")


@no_cuda
@pytest.mark.timeout(200)
def test_next_runs_more_slices_while_the_budget_allows_in_tiny_form(tmp_path, slices):
    """--next on made-up records: compute first (the oldest), then llama1b (expected 1 s) in what is left, and no
    more: llama3b and the rest are expected to take longer than the whole budget."""
    results, out = tmp_path / "results", tmp_path / "out"
    results.mkdir()
    for k, name in enumerate(("verify", "offload", "largest", "llama3b", "auto")):
        write(results, f"gpu_h200_2026-12-0{k + 2}_{name}.json", slice=name, complete=True, elapsed_s=5000.0)
    write(results, "gpu_h200_2026-12-01_compute.json", slice="compute", complete=True, elapsed_s=1.0)
    write(results, "gpu_h200_2026-12-01_llama1b.json", slice="llama1b", measured_at="2026-12-01T12:00:00Z",
          complete=True, elapsed_s=1.0)
    res = run_check("--next", "--out", str(out), "--results", str(results), "--budget-s", "150", "--commit", "abc",
                    timeout=190)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    files = sorted(p.name.rsplit("_", 1)[1] for p in out.glob("gpu_cpu_*.json"))
    assert files == ["compute.json", "llama1b.json"], res.stdout[-3000:]
    assert "going on to llama1b (expected 1 s)" in res.stdout and "passed over llama3b: expected 5000 s" in res.stdout
    first, second = (json.loads(next(out.glob(f"gpu_cpu_*_{n}.json")).read_text()) for n in ("compute", "llama1b"))
    assert first["stopped_by"] is None and second["stopped_by"] is None and second["table"], second
    assert 0 < second["elapsed_s"] < 150 and first["budget_s"] == second["budget_s"] == 150  # one run's budget
    assert first["began_at_s"] == 0 and second["began_at_s"] >= first["elapsed_s"]  # seconds into the call


@no_cuda
@pytest.mark.timeout(120)
def test_a_try_killed_while_training_keeps_its_build_figures(slices, monkeypatch):
    """The largest slice's 8B step may not finish in its share: the build's params, seconds and host peak stay."""
    # torch's fused CPU Adam, as the tiny forms use it: DeepSpeed's op would JIT-build inside the worker, and the
    # kill at 25 s would leave torch's build lock behind on a machine where it was not built yet
    monkeypatch.setenv("ZEROGPT_CPU_ADAM", "torch")
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
