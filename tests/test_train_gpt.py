"""train_gpt.py end to end: a 2-rank torchrun run on CPU writes the files of DESIGN §5, resumes exactly,
and fails fast and clearly (config typo, missing data, a crash on one rank)."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.py")
# A few steps of the demo config; data.path named stdlib_docs = the bundled sample, built on first use.
SHORT = ["train.max_steps=6", "train.log_interval=2", "train.eval_interval=3", "train.eval_iters=2",
         "train.save_interval=3", "lr_scheduler.warmup_steps=2", "SEQ_LEN=64", "BATCH_SIZE=4"]


def torchrun(args, timeout=150, nproc=2, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "train_gpt.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def one_process(args, timeout=150):
    cmd = [sys.executable, os.path.join(ROOT, "train_gpt.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def data_args(data_dir):
    return [f"data.path={data_dir}/stdlib_docs", f"data.tokenizer={data_dir}/tokenizer"]


def root_cause(log):
    """The rank torchrun's summary names under "Root Cause"."""
    section = log.split("Root Cause (first observed failure):", 1)[1]
    return int(section.split("rank      : ", 1)[1].split()[0])


def overrides(items):
    return [a for item in items for a in ("--set", item)]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("run")
    proc = torchrun(["--config", DEMO, *overrides(SHORT + [f"train.output_dir={out}",
                                                           f"data.path={data_dir}/stdlib_docs",
                                                           f"data.tokenizer={data_dir}/tokenizer"])])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc.stdout + proc.stderr


@pytest.mark.timeout(200)
def test_two_rank_run_writes_the_run_directory(run_dir, data_dir):
    out, log = run_dir
    assert sorted(os.listdir(out)) == ["checkpoints", "config.py", "engine_plan.txt", "loss.png", "metrics.jsonl",
                                       "tensorboard"]
    plan = dict(line.split(": ", 1) for line in (out / "engine_plan.txt").read_text().splitlines())
    assert plan["stage"] == "2" and plan["precision"] == "fp32"  # every build decision, as the engine took it
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_3", "step_6"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_6"
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(out / "tensorboard"))
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the resolved config loads again and carries the overrides
    from zerogpt.config import Config
    assert Config.from_file(str(out / "config.py")).train.max_steps == 6
    recs = read_jsonl(out / "metrics.jsonl")
    train = [r for r in recs if r["split"] == "train"]
    valid = [r for r in recs if r["split"] == "valid"]
    assert [r["step"] for r in train] == [2, 4, 6] and [r["step"] for r in valid] == [0, 3, 6]
    assert list(train[0]) == ["split", "step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "tflops",
                              "loss_scale", "skipped", "skipped_steps", "h2d_bytes", "d2h_bytes", "host_step_s", "mem"]
    assert list(valid[0]) == ["split", "step", "loss", "ppl"]
    assert valid[-1]["loss"] < valid[0]["loss"]
    # demo data was built from the bundled corpus on first use
    assert os.path.exists(f"{data_dir}/stdlib_docs.idx") and os.path.exists(f"{data_dir}/tokenizer")
    for where in ("metrics.jsonl", "loss.png", "checkpoints/step_6"):
        assert where in log
    assert log.count("cpu threads: 1 per rank (OMP_NUM_THREADS;") == 1      # printed once, by rank 0


@pytest.mark.timeout(200)
def test_resume_continues_with_the_same_losses(run_dir, data_dir, tmp_path):
    out, _ = run_dir
    proc = torchrun(["--config", DEMO, "--resume", str(out / "checkpoints" / "step_3"),
                     *overrides(SHORT + [f"train.output_dir={tmp_path}", f"data.path={data_dir}/stdlib_docs",
                                         f"data.tokenizer={data_dir}/tokenizer"])])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    first = {(r["split"], r["step"]): r["loss"] for r in read_jsonl(out / "metrics.jsonl")}
    resumed = {(r["split"], r["step"]): r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert set(resumed) == {("train", 4), ("train", 6), ("valid", 6)}
    for key, loss in resumed.items():
        assert loss == first[key], key          # same world size: bit-for-bit


@pytest.mark.timeout(200)
def test_max_steps_decides_the_length_over_num_epochs_and_neither_means_one_epoch(data_dir, tmp_path):
    # 0.5% of the sample for training, 16 x 32-token windows per step: 22 steps per epoch. NUM_EPOCHS counts only
    # without train.max_steps (docs/configs.md); a run with both used to stop at the epoch's end, short of
    # max_steps and of its LR schedule, and its --resume auto then did nothing. With neither, fit() refused
    # after the engine was built, though the schedule and the resume check count one epoch.
    small = ["SEQ_LEN=32", "BATCH_SIZE=16", "data.split='5,994,1'", "train.log_interval=100", "train.eval_iters=1",
             "lr_scheduler.warmup_steps=2", *data_args(data_dir)]
    proc = one_process(["--config", DEMO, *overrides(small + ["NUM_EPOCHS=1", "train.max_steps=30",
                                                              f"train.output_dir={tmp_path}/both"])])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    train = [r for r in read_jsonl(tmp_path / "both" / "metrics.jsonl") if r["split"] == "train"]
    assert [(r["step"], r["epoch"]) for r in train] == [(30, 1)]   # on into the second pass, its last step logged
    assert "done: 30 steps" in proc.stdout + proc.stderr
    proc = one_process(["--config", DEMO, *overrides(small + ["train.max_steps=None",
                                                              f"train.output_dir={tmp_path}/neither"])])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    train = [r for r in read_jsonl(tmp_path / "neither" / "metrics.jsonl") if r["split"] == "train"]
    assert [(r["step"], r["epoch"]) for r in train] == [(22, 0)]   # one pass


@pytest.mark.timeout(200)
def test_the_nan_guards_stop_is_one_line_and_keeps_the_last_checkpoint(data_dir, tmp_path):
    # lr 1e12: step 1 blows the weights up, every later loss is NaN and the guard stops at step 4. That used to print
    # the trainer's 15-line traceback and the guard's message twice ("training failed on rank 0"), as for a crash.
    proc = one_process(["--config", DEMO, *overrides(SHORT + data_args(data_dir) + [
        "optimizer.lr=1e12", "lr_scheduler.warmup_steps=0", "train.log_interval=1", "train.save_interval=2",
        f"train.output_dir={tmp_path}"])])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Traceback" not in proc.stderr and "training failed" not in proc.stderr, proc.stderr[-5000:]
    errors = [line for line in proc.stderr.splitlines() if "non-finite for 3 consecutive" in line]
    assert len(errors) == 1 and errors[0].startswith("error: loss is nan at step 4,"), errors
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_2"   # nothing after the stop


@pytest.mark.timeout(200)
def test_crash_on_one_rank_stops_all_ranks_with_its_error(data_dir, tmp_path):
    config = tmp_path / "crash.py"
    config.write_text(open(DEMO).read() + textwrap.dedent("""
        from zerogpt.trainer import Hook

        class CrashOnRank1(Hook):
            def after_step(self, trainer):
                if trainer.ctx.global_rank == 1 and trainer.state.step == 2:
                    raise RuntimeError("injected failure on purpose")

        hooks = [CrashOnRank1()]
        """))
    proc = torchrun(["--config", str(config), *overrides(SHORT + [
        f"train.output_dir={tmp_path}/run", f"data.path={data_dir}/stdlib_docs",
        f"data.tokenizer={data_dir}/tokenizer", "train.max_steps=1000"])], timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "injected failure on purpose" in log
    assert "training failed on rank 1" in log
    assert root_cause(log) == 1              # not rank 0's "Connection closed by peer" that followed it
    assert log.count("injected failure on purpose\n") >= 1 and log.count("Traceback") <= 3


def user_error(capsys, *args):
    """train_gpt.main in this process: (exit code, stderr) for a mistake found before launch."""
    import torch.distributed as dist
    import train_gpt
    code = train_gpt.main.__wrapped__(["--config", DEMO, *args])
    err = capsys.readouterr().err
    assert not dist.is_initialized()
    return code, err


def test_config_typo_fails_before_any_process_group(capsys):
    code, err = user_error(capsys, "--set", "train.max_stepz=3")
    assert code == 1
    assert re.fullmatch(r"error: unknown key 'train.max_stepz'.*did you mean 'train.max_steps'.*\n", err, re.S)
    assert "Traceback" not in err


def test_missing_data_names_the_pipeline_command(tmp_path, capsys):
    code, err = user_error(capsys, "--set", f"data.path={tmp_path}/nothing_here")
    assert code == 1 and "python -m data_pipeline tokenize" in err and "Traceback" not in err
    code, err = user_error(capsys, "--set", "data.path=None")
    assert code == 1 and "data.path is not set" in err


def test_late_failures_are_found_with_the_config(tmp_path, capsys):
    """Issue 18.5 and 18.8: a schedule longer than the run, an output_dir that cannot be, a missing --resume dir."""
    code, err = user_error(capsys, "--set", "train.max_steps=20", "--set", f"train.output_dir={tmp_path}")
    assert code == 1 and "train.max_steps=20 is shorter than lr_scheduler.warmup_steps=30" in err
    assert "total_steps" not in err
    code, err = user_error(capsys, "--set", "train.output_dir=/proc/nope")
    assert code == 1 and err.startswith("error: train.output_dir='/proc/nope' cannot be written")
    code, err = user_error(capsys, "--set", f"train.output_dir={tmp_path}", "--resume", f"{tmp_path}/step_9")
    assert code == 1 and "step_9: no such directory" in err and "meta.json" not in err


@pytest.mark.timeout(200)
def test_user_error_under_torchrun_prints_once_from_rank_0(tmp_path):
    """Issue 18.4: one short message, no traceback from our ranks, non-zero exit, rank 0 as torchrun's root cause."""
    proc = torchrun(["--config", DEMO, "--set", "train.max_steps=20", "--set", f"train.output_dir={tmp_path}"],
                    timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    message = "train.max_steps=20 is shorter than lr_scheduler.warmup_steps=30"
    ours = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and message in ours[0]
    assert log.count("Traceback") == 1       # torchrun's own ChildFailedError; none from train_gpt.py
    assert root_cause(log) == 0 and "stopped: rank 0 reports the error" in log
    assert log.count(message) == 2           # our line, and torchrun's root cause (rank 0's error file)
    assert len(log.splitlines()) < 60, log   # was 91-123 lines


@pytest.mark.timeout(300)
def test_a_second_run_refuses_the_first_runs_directory_then_overwrite_clears_it(run_dir, data_dir, tmp_path):
    """Issue 18.2: same output_dir without --resume stops and names the ways out; --overwrite starts clean."""
    import shutil
    out, _ = run_dir
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    args = ["--config", DEMO, *overrides(SHORT + data_args(data_dir) + [f"train.output_dir={copy}"])]
    proc = one_process(args + ["--set", "train.max_steps=4"])
    assert proc.returncode == 1 and "already holds a run (checkpoints up to step_6)" in proc.stderr
    assert "--resume auto" in proc.stderr and "--overwrite" in proc.stderr and "Traceback" not in proc.stderr
    assert (copy / "metrics.jsonl").read_text() == (out / "metrics.jsonl").read_text()   # untouched

    # --resume auto on the finished run: says so and how to extend it, changes nothing
    proc = one_process(args + ["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to do" in proc.stdout and "train.max_steps=12" in proc.stdout and "not stretched" in proc.stdout
    assert (copy / "metrics.jsonl").read_text() == (out / "metrics.jsonl").read_text()

    proc = one_process(args + ["--overwrite", "--set", "train.max_steps=4", "--set", "train.save_interval=4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(copy / "checkpoints")) == ["latest", "step_4"]
    assert max(r["step"] for r in read_jsonl(copy / "metrics.jsonl")) == 4
    assert len(os.listdir(copy / "tensorboard")) == 1
    assert "--resume auto --set train.max_steps=8" in proc.stdout and "--overwrite" in proc.stdout


@pytest.mark.timeout(300)
def test_vocab_mismatch_is_refused_before_the_engine(data_dir, tmp_path):
    """Issue 18.1: data tokenized with a 2,048-token tokenizer, data.tokenizer a 1,024-token one."""
    from data_pipeline.__main__ import main as pipeline
    from train_gpt import SAMPLE_CORPUS
    one_process(["--config", DEMO, *overrides(SHORT + data_args(data_dir) + [f"train.output_dir={tmp_path}/a",
                                                                            "train.max_steps=2"])])
    small = tmp_path / "tok1024"
    assert pipeline(["train-tokenizer", SAMPLE_CORPUS, "--output", str(small), "--vocab-size", "1024"]) == 0
    proc = torchrun(["--config", DEMO, *overrides(SHORT + [f"data.path={data_dir}/stdlib_docs",
                                                           f"data.tokenizer={small}", f"train.output_dir={tmp_path}/b"])])
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    ours = [line for line in log.splitlines() if "error: vocabulary mismatch" in line]
    assert len(ours) == 1 and ours[0].startswith("error: "), log      # once, from rank 0, after launch too
    assert re.search(r"the data was tokenized with 2,048 \(.*stdlib_docs.stats.json\) tokens but the tokenizer "
                     r"has 1,024 \(data.tokenizer=.*tok1024\)", ours[0]), ours[0]
    assert "zerogpt engine" not in log and log.count("Traceback") == 1 and root_cause(log) == 0


@pytest.mark.timeout(300)
def test_tutorial_command_line_from_torch_and_DATA(data_dir, tmp_path):
    """Issue 18.11: `--from_torch` is accepted, and `export DATA=train_data.json` (a JSONL file with tokenizer/
    beside it) is read when the config sets no data.path; the JSONL is tokenized once into a cache."""
    import shutil
    from train_gpt import SAMPLE_CORPUS
    shutil.copy(SAMPLE_CORPUS, tmp_path / "train_data.json")
    one_process(["--config", DEMO, *overrides(SHORT + data_args(data_dir) + [f"train.output_dir={tmp_path}/a",
                                                                            "train.max_steps=2"])])
    shutil.copytree(f"{data_dir}/tokenizer", tmp_path / "tokenizer")
    args = ["--config", DEMO, "--from_torch", *overrides(SHORT + [
        "data.path=None", "data.tokenizer=None", f"train.output_dir={tmp_path}/run", "train.max_steps=2"])]
    proc = torchrun(args, nproc=1, env={"DATA": str(tmp_path / "train_data.json")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("--from_torch") == 1
    assert f"using DATA={tmp_path}/train_data.json" in proc.stdout
    assert [f for f in os.listdir(tmp_path / "index-cache") if f.endswith(".idx")]
    assert max(r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 2


@pytest.mark.timeout(200)
def test_resume_at_another_world_size_and_stage(run_dir, data_dir, tmp_path):
    """2 ranks at ZeRO-2 -> 1 process at ZeRO-3 with GLOBAL_BATCH_SIZE fixed (accumulation 2 instead of 2 ranks):
    the same global batches in the same order, so the losses continue within float tolerance."""
    out, _ = run_dir
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train_gpt.py"), "--config", DEMO, "--resume",
         str(out / "checkpoints" / "step_3"),
         *overrides(SHORT + [f"train.output_dir={tmp_path}", f"data.path={data_dir}/stdlib_docs",
                             f"data.tokenizer={data_dir}/tokenizer", "GLOBAL_BATCH_SIZE=8", "zero.stage=3"])],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT), capture_output=True, text=True,
        timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    first = {(r["split"], r["step"]): r["loss"] for r in read_jsonl(out / "metrics.jsonl")}
    resumed = {(r["split"], r["step"]): r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert set(resumed) == {("train", 4), ("train", 6), ("valid", 6)}
    for key, loss in resumed.items():
        assert loss == pytest.approx(first[key], rel=1e-5), key


@pytest.fixture(scope="module")
def tp_run_dir(tmp_path_factory, data_dir, run_dir):
    """The run_dir run's global batches (GLOBAL_BATCH_SIZE 8) at parallel.tensor.size=2: T=2, D=1, accumulation 2."""
    out = tmp_path_factory.mktemp("tp2")
    proc = torchrun(["--config", DEMO, *overrides(SHORT + [f"train.output_dir={out}", *data_args(data_dir),
                                                           "GLOBAL_BATCH_SIZE=8", "parallel.tensor.size=2"])])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc.stdout + proc.stderr


@pytest.mark.timeout(300)
def test_tensor_parallel_run_matches_the_data_parallel_one(run_dir, tp_run_dir):
    """train_gpt builds the mesh and applies the plan: same global batches, same losses (float tolerance)."""
    (dp_out, _), (tp_out, log) = run_dir, tp_run_dir
    assert "mesh (pp=1, dp=1, tp=2) over 2 ranks" in log and "x 1 data-parallel ranks" in log
    first = {(r["split"], r["step"]): r["loss"] for r in read_jsonl(dp_out / "metrics.jsonl")}
    tp = {(r["split"], r["step"]): r["loss"] for r in read_jsonl(tp_out / "metrics.jsonl")}
    assert set(tp) == set(first)
    for key, loss in tp.items():
        assert loss == pytest.approx(first[key], rel=1e-5), key


@pytest.mark.timeout(300)
def test_tensor_parallel_checkpoint_resumes_as_a_pipeline(tp_run_dir, data_dir, tmp_path):
    """A checkpoint saved at (T, P, D) = (2, 1, 1) resumes at (1, 2, 1): the losses continue."""
    tp_out, _ = tp_run_dir
    proc = torchrun(["--config", DEMO, "--resume", str(tp_out / "checkpoints" / "step_3"),
                     *overrides(SHORT + [f"train.output_dir={tmp_path}", *data_args(data_dir), "GLOBAL_BATCH_SIZE=8",
                                         "parallel.pipeline=2"])])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "mesh (pp=2, dp=1, tp=1)" in proc.stdout + proc.stderr
    first = {(r["split"], r["step"]): r["loss"] for r in read_jsonl(tp_out / "metrics.jsonl")}
    resumed = {(r["split"], r["step"]): r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert set(resumed) == {("train", 4), ("train", 6), ("valid", 6)}
    for key, loss in resumed.items():
        assert loss == pytest.approx(first[key], rel=1e-5), key
