"""The verify slice: do zerogpt's CUDA paths work, and does the shipped single-GPU config train?

Three steps, each with its share of the budget (25 / 30 / 45 %; what one leaves flows to the next):
1. device syncs per step: a small GPT at stages 0-3 without and with optimizer offload, stage 3 with the
   parameters offloaded too, with bf16 Adam moments, with the disk tier, under compile and with the chunked loss,
   and the Llama family at the same size (an untied GQA Llama at stage 3; a tied one offloaded with the chunked loss
   over the 128k vocabulary), all with 2 micro-batches per step (device-side accumulation); after the timed steps, a
   few more run under torch.cuda.set_sync_debug_mode("warn") and every synchronizing call is counted by the line
   that made it (the steps between two log steps: the goal is 0). Each row is also a smoke run of that CUDA path.
2. configs/gpt2_xl_zero3_offload.py through train_gpt.py on mock data: stopped with SIGTERM once it has logged
   the steps wanted (save_on_interrupt off, so no 22 GB checkpoint is written); tokens/s, h2d/d2h bytes and the
   engine's host step from its metrics.jsonl.
3. `pytest -m gpu` over the test files that hold GPU tests, its output streamed to DIR/pytest_gpu.log, so a run
   the budget cuts short still counts what passed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from typing import Callable

from gpu_slices.runner import REPO, Spec, log, measure_group, note_failures, run_watched

SHIPPED_CONFIG = "configs/gpt2_xl_zero3_offload.py"
WEIGHTS = dict(syncs=25, train_gpt=30, pytest=45)  # shares of the measurement time, in this order
DISK = os.path.join(tempfile.gettempdir(), "gpu_check_verify_disk")


def sync_specs(args) -> list[Spec]:
    """The sync-count matrix: (stage, offload, extra) on a small GPT and Llamas of its size, 2 micro-batches per step,
each clipping the gradient norm to 1.0 as the shipped configs train (the clip factor's path is counted too).
    The tiny form runs five of its rows, without compile (minutes on the CPU) and bf16 moments (their op would build
    in the worker)."""
    shape, batch, seq = ((2, 2, 64), 1, 32) if args.tiny else ((4, 8, 512), 2, 256)
    chunked = dict(chunked_loss=True, loss_chunk_size=batch * seq // 4)
    rows = [(stage, offload, {}) for stage in range(4) for offload in ("none", "cpu")]
    # the models users bring: an untied GQA Llama, and a tied one (Llama-3.2's) offloaded with the chunked loss over
    # the 128k vocabulary; both at the small GPT's depth and width (gpu_measure.llama_shape)
    llama = [(3, "none", dict(model="llama3_8b", vocab=args.llama_vocab)),
             (3, "cpu", dict(model="llama3_2_1b", vocab=args.llama_vocab, **chunked))]
    rows += [(3, "cpu+param", {}), (3, "cpu", dict(state_dtype="bf16")), (3, "disk", dict(offload_path=DISK)),
             (3, "none", chunked), *llama, (3, "none", dict(compile=True))]  # compile last: the slowest to start
    if args.tiny:
        rows = [(0, "none", {}), (3, "cpu+param", {}), (3, "disk", dict(offload_path=DISK)), (3, "none", chunked),
                llama[1]]
    specs = []
    for stage, offload, extra in rows:
        what = " ".join(f"{k}={v}" for k, v in extra.items() if k not in ("offload_path", "vocab"))
        extra = {"vocab": args.vocab, **extra}
        specs.append(Spec("zerogpt", shape, stage=stage, offload=offload, batch=batch, seq=seq, accum=2,
                          steps=min(2, args.steps), warmup=args.warmup, count_syncs=3, clip=1.0, **extra,
                          label=f"syncs stage {stage} offload={offload} {what}".strip()))
    return specs


def mock_run_overrides(args) -> list[str]:
    """train_gpt.py's --set overrides every measured config run takes: mock data, log every step, no checkpoint on
    the stop; in tiny form also the config's model shrunk (its structure kept: stage, offload, bucket, prefetch,
    checkpointing), fp32 and `args.seq` tokens per sequence."""
    sets = ["data.mock=true", f"data.vocab_size={args.vocab}", "train.max_steps=1000", "train.log_interval=1",
            "train.eval_iters=1", "train.save_on_interrupt=false", "lr_scheduler.warmup_steps=1"]
    if args.tiny:
        sets += ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", f"model.max_position_embeddings={args.seq}",
                 f"SEQ_LEN={args.seq}", "precision=fp32"]
    return sets


TINY_BATCH = 2
"""The shipped config's micro-batch in tiny form (its accumulation kept): TINY_BATCH x accumulation x args.seq."""


def shipped_overrides(args) -> tuple[list[str], int]:
    """train_gpt.py's --set overrides for the shipped config (mock_run_overrides) and its tokens/step."""
    import zerogpt

    cfg = zerogpt.Config.from_file(os.path.join(REPO, SHIPPED_CONFIG))
    batch, accum, seq = cfg.BATCH_SIZE, cfg.GRADIENT_ACCUMULATION, cfg.SEQ_LEN
    sets = mock_run_overrides(args)
    if args.tiny:
        batch, seq = TINY_BATCH, args.seq
        sets.append(f"BATCH_SIZE={batch}")
    return sets, batch * accum * seq


def train_records(path: str, skip: int, tokens_per_step: int, most: int | None = None) -> dict:
    """metrics.jsonl's train records after the first `skip` (log_interval 1: one per step), at `most` of them:
    tokens/s over them (each step's seconds = tokens per step / its tokens/s, which leaves the hooks out), h2d/d2h
    bytes, host step."""
    with open(path) as f:
        recs = [r for r in map(json.loads, f) if r.get("split") == "train"]
    timed = recs[skip:] if most is None else recs[skip:skip + most]
    out = dict(records=len(recs), timed_steps=len(timed))
    if timed:
        step_s = [tokens_per_step / r["tokens_per_s"] for r in timed]
        out.update(step_s=step_s, tokens_per_s=tokens_per_step * len(timed) / sum(step_s),
                   h2d_bytes=[r.get("h2d_bytes") for r in timed], d2h_bytes=[r.get("d2h_bytes") for r in timed],
                   host_step_s=[r.get("host_step_s") for r in timed], losses=[r["loss"] for r in recs],
                   host_rss_mib_max=max((r.get("mem") or {}).get("host_rss_mb") or 0 for r in timed),
                   device_peak_mib_max=max((r.get("mem") or {}).get("device_peak_mb") or 0 for r in timed))
    return out


def run_train_gpt(args, seconds: float, reserve: int, config: str = SHIPPED_CONFIG,
                  overrides: tuple[list[str], int] | None = None, env: dict | None = None,
                  collect: Callable[[str], dict] | None = None, most: int | None = None) -> dict:
    """A config as a user runs it (the shipped one by default), until `args.shipped_steps` + 1 steps are logged
    (the first untimed: it holds the build, and with plan="auto" the planner's trials run before it).

    `overrides`: its --set list and tokens per step (default: shipped_overrides); `env`: variables added to the
    child's environment; `collect(run_dir)`: reads what the run wrote there before the directory is removed (its
    dict joins the result); `most`: timed steps at most (default: every step logged before the stop took)."""
    sets, tokens_per_step = overrides or shipped_overrides(args)
    out_dir = tempfile.mkdtemp(prefix="gpu_check_train_")
    sets = [*sets, f"train.output_dir={out_dir}"]
    cmd = [sys.executable, os.path.join(REPO, "train_gpt.py"), "--config", config,
           *[a for kv in sets for a in ("--set", kv)]]
    metrics = os.path.join(out_dir, "metrics.jsonl")
    wanted = args.shipped_steps + 1

    def logged_enough() -> bool:
        if not os.path.exists(metrics):
            return False
        with open(metrics) as f:
            return sum('"split": "train"' in line for line in f) >= wanted
    log(f"  train_gpt.py --config {config} " + " ".join(f"--set {kv}" for kv in sets))
    run = run_watched(cmd, seconds, reserve, stop_when=logged_enough, env=env)
    output = run.pop("output")
    res = dict(config=config, tokens_per_step=tokens_per_step, command=" ".join(cmd[1:]),
               **{k: run[k] for k in ("returncode", "killed", "stopped", "wall_s", "user_s", "sys_s")})
    if os.path.exists(metrics):
        res.update(train_records(metrics, skip=1, tokens_per_step=tokens_per_step, most=most))
    if collect is not None:
        res.update(collect(out_dir))
    # a stop we asked for ends with 130 (interrupted, nothing saved); a run that finished would give 0
    if run["killed"] or run["returncode"] not in (0, 130) or not res.get("timed_steps"):
        res["error"] = run["killed"] or f"exit {run['returncode']}"
        res["detail"] = "\n".join(output.strip().splitlines()[-8:])[-1500:]
        log("    train_gpt.py output (last lines):\n      " + "\n      ".join(output.strip().splitlines()[-12:]))
    else:
        log(f"    {res['tokens_per_s']:,.0f} tok/s over {res['timed_steps']} steps; h2d {res['h2d_bytes'][-1]}, d2h "
            f"{res['d2h_bytes'][-1]} bytes/step; host step {res['host_step_s'][-1]} s; wall {res['wall_s']:.0f} s")
    shutil.rmtree(out_dir, ignore_errors=True)
    return res


OUTCOME = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def gpu_test_files() -> list[str]:
    """The test files that hold GPU tests (the others may need packages the device lacks)."""
    files = []
    for d, _, names in os.walk(os.path.join(REPO, "tests")):
        for name in names:
            path = os.path.join(d, name)
            if name.endswith(".py") and "mark.gpu" in open(path).read():
                files.append(os.path.relpath(path, REPO))
    return sorted(files)


def run_pytest(args, seconds: float, reserve: int) -> dict:
    """`pytest -m gpu -v` streamed to DIR/pytest_gpu.log; each test's outcome as it finished. Not run in tiny form:
    without CUDA every GPU test skips, and the normal suite already collects these files."""
    files = gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *files, "-p", "no:cacheprovider", "-v", "-rfE"]
    if args.tiny:
        log(f"  no CUDA: not run ({len(files)} files hold GPU tests)")
        return dict(files=files, command=" ".join(cmd[1:]), ran=False, killed=None, counts={}, failed=[])
    path = os.path.join(args.out, "pytest_gpu.log")
    run = run_watched(cmd, seconds, reserve, output_path=path)
    output = run.pop("output")
    outcomes = {}
    for line in output.splitlines():
        m = OUTCOME.match(line)
        if m:
            outcomes[m[1]] = m[2]
    counts = {k: sum(v == k for v in outcomes.values()) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    res = dict(files=files, command=" ".join(cmd[1:]), ran=True, killed=run["killed"], returncode=run["returncode"],
               wall_s=run["wall_s"], counts=counts, log="pytest_gpu.log",
               failed=[t for t, v in outcomes.items() if v in ("FAILED", "ERROR")])
    # a run cut short, or one that passed nothing (every GPU test skipped), proved nothing: one failure more
    res["cuda_checks_failed"] = counts["FAILED"] + counts["ERROR"] + (1 if run["killed"] or not counts["PASSED"]
                                                                       else 0)
    log(f"  pytest -m gpu: {counts}, killed: {run['killed']} -> cuda_checks_failed {res['cuda_checks_failed']}"
        + (f"; failed: {res['failed'][:6]}" if res["failed"] else ""))
    return res


def run(args, budget, result: dict, save) -> None:
    reserve = int(args.host_reserve_gib * 2**30)
    figures = result["figures"]
    log("  1. device syncs per step (small GPT, 2 micro-batches per step)")
    os.makedirs(DISK, exist_ok=True)
    rows = measure_group(budget, sync_specs(args), WEIGHTS["syncs"], WEIGHTS["train_gpt"] + WEIGHTS["pytest"],
                         reserve, result["skipped"])
    shutil.rmtree(DISK, ignore_errors=True)
    result["syncs"] = [dict(label=r["spec"]["label"], stage=r["spec"]["stage"], offload=r["spec"]["offload"],
                            syncs_per_step=r.get("syncs_per_step"), sync_sites=r.get("sync_sites"),
                            losses=r.get("losses"), error=r.get("error"), detail=r.get("detail")) for r in rows]
    counted = [r["syncs_per_step"] for r in result["syncs"] if r["syncs_per_step"] is not None]
    figures["syncs_per_step_max"] = max(counted) if counted else None
    figures["sync_rows_failed"] = sum(r["error"] is not None for r in result["syncs"])
    note_failures(result, rows)
    for r in result["syncs"]:
        if r["error"] is None and r["syncs_per_step"] is not None:
            log(f"    {r['label']}: {r['syncs_per_step']:g} syncs/step {r['sync_sites'] or ''}")
    save()

    log(f"  2. {SHIPPED_CONFIG} through train_gpt.py")
    seconds = budget.share(WEIGHTS["train_gpt"], WEIGHTS["pytest"])
    if budget.can_start(seconds):
        shipped = result["train_gpt"] = run_train_gpt(args, seconds, reserve)
        figures["train_gpt_tokens_per_s"] = shipped.get("tokens_per_s")
        steps = [s for s in shipped.get("host_step_s", []) if s is not None]
        figures["train_gpt_host_step_s"] = sum(steps) / len(steps) if steps else None
    else:
        result["skipped"].append(f"train_gpt.py: not started, {seconds:.0f} s left")
    save()

    log("  3. pytest -m gpu")
    seconds = budget.share(WEIGHTS["pytest"])
    if budget.can_start(seconds):
        tests = result["pytest"] = run_pytest(args, seconds, reserve)
        figures["gpu_tests_passed"] = tests["counts"].get("PASSED")
        figures["cuda_checks_failed"] = tests.get("cuda_checks_failed")
        if tests["killed"]:
            result["skipped"].append(f"pytest -m gpu: cut at {tests['wall_s']:.0f} s ({tests['killed']})")
    else:
        result["skipped"].append(f"pytest -m gpu: not started, {seconds:.0f} s left")
    shipped = result.get("train_gpt", {})
    if shipped.get("error"):
        result["skipped" if shipped["error"] == "timeout" else "errors"].append(f"train_gpt.py: {shipped['error']}")
    if result.get("pytest", {}).get("failed"):
        result["errors"] += [f"pytest: {t}" for t in result["pytest"]["failed"]]
