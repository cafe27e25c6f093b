"""train_gpt.py end to end: a 2-rank torchrun run on CPU writes the files of DESIGN §5, resumes exactly,
and fails fast and clearly (config typo, missing data, a crash on one rank)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.py")
# A few steps of the demo config; data.path named stdlib_docs = the bundled sample, built on first use.
SHORT = ["train.max_steps=6", "train.log_interval=2", "train.eval_interval=3", "train.eval_iters=2",
         "train.save_interval=3", "lr_scheduler.warmup_steps=2", "SEQ_LEN=64", "BATCH_SIZE=4"]


def torchrun(args, timeout=150, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "train_gpt.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


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
    assert sorted(os.listdir(out)) == ["checkpoints", "config.py", "loss.png", "metrics.jsonl", "tensorboard"]
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
                              "loss_scale", "skipped", "mem"]
    assert list(valid[0]) == ["split", "step", "loss", "ppl"]
    assert valid[-1]["loss"] < valid[0]["loss"]
    # demo data was built from the bundled corpus on first use
    assert os.path.exists(f"{data_dir}/stdlib_docs.idx") and os.path.exists(f"{data_dir}/tokenizer")
    for where in ("metrics.jsonl", "loss.png", "checkpoints/step_6"):
        assert where in log


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
def test_crash_on_one_rank_stops_all_ranks_with_its_error(data_dir, tmp_path):
    config = tmp_path / "crash.py"
    config.write_text(open(DEMO).read() + textwrap.dedent("""
        from zerogpt.trainer import Hook

        class CrashOnRank1(Hook):
            def after_step(self, trainer):
                if trainer.rank == 1 and trainer.state.step == 2:
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


def test_config_typo_fails_before_any_process_group(capsys):
    import torch.distributed as dist
    import train_gpt
    with pytest.raises(ValueError, match=r"unknown key 'train.max_stepz'.*did you mean 'train.max_steps'"):
        train_gpt.main.__wrapped__(["--config", DEMO, "--set", "train.max_stepz=3"])
    assert not dist.is_initialized()


def test_missing_data_names_the_pipeline_command(tmp_path):
    import torch.distributed as dist
    import train_gpt
    with pytest.raises(FileNotFoundError, match=r"python -m data_pipeline tokenize"):
        train_gpt.main.__wrapped__(["--config", DEMO, "--set", f"data.path={tmp_path}/nothing_here"])
    with pytest.raises(ValueError, match=r"data.path is not set"):
        train_gpt.main.__wrapped__(["--config", DEMO, "--set", "data.path=None"])
    assert not dist.is_initialized()


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
