"""zerogpt/preflight.py and the CPU thread choice: every mistake a run can see in its config is found before
launch and names the key or flag to change."""
import json
import os

import pytest

import torch

import train_gpt
from model_zoo import build_model, gpt2_tiny
from zerogpt.config import Config, DataConfig, LRSchedulerConfig, TrainConfig
from zerogpt.launch import cpu_threads
from zerogpt.preflight import (PreflightError, RUN_FILES, check_data, check_fresh_run, check_output_dir,
                               check_parallel, check_resume, check_schedule, check_vocab, clear_run, data_from_env,
                               env_world_size, finished_message, known_vocab_size, run_data_vocab)


def test_schedule_longer_than_the_run_names_the_users_keys():
    with pytest.raises(PreflightError, match=r"train.max_steps=20 is shorter than lr_scheduler.warmup_steps=30") as e:
        check_schedule(TrainConfig(max_steps=20), LRSchedulerConfig(type="cosine", warmup_steps=30))
    assert "total_steps" not in str(e.value)  # a key the user never set is not named
    with pytest.raises(PreflightError, match=r"lr_scheduler.total_steps=10 is shorter than .*warmup_steps=30"):
        check_schedule(TrainConfig(max_steps=100), LRSchedulerConfig(type="linear", warmup_steps=30, total_steps=10))
    check_schedule(TrainConfig(max_steps=30), LRSchedulerConfig(type="cosine", warmup_steps=30))
    check_schedule(TrainConfig(max_steps=20), LRSchedulerConfig(type="constant", warmup_steps=30))
    check_schedule(TrainConfig(max_steps=20), None)


def test_output_dir_that_cannot_be_written_names_the_key(tmp_path):
    with pytest.raises(PreflightError, match=r"train.output_dir='/proc/nope' cannot be written"):
        check_output_dir("/proc/nope")
    check_output_dir(str(tmp_path / "new" / "run"))
    assert (tmp_path / "new" / "run").is_dir()


def test_a_fresh_run_refuses_a_directory_holding_another_run(tmp_path):
    (tmp_path / "config.py").write_text("")
    check_fresh_run(str(tmp_path), None, False)                 # config.py alone: a run that never logged
    for step in (2, 10):
        os.makedirs(tmp_path / "checkpoints" / f"step_{step}")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(PreflightError) as e:
        check_fresh_run(str(tmp_path), None, False)
    assert "checkpoints up to step_10" in str(e.value)
    for way_out in ("--resume auto", "train.output_dir", "--overwrite"):
        assert way_out in str(e.value)
    check_fresh_run(str(tmp_path), "auto", False)
    check_fresh_run(str(tmp_path), None, True)


def test_overwrite_clears_exactly_the_runs_files(tmp_path):
    for name in ("metrics.jsonl", "loss.png", "config.py", "notes.txt"):
        (tmp_path / name).write_text("x")
    for name in ("checkpoints/step_4", "tensorboard"):
        os.makedirs(tmp_path / name)
    (tmp_path / "tensorboard" / "events.out.tfevents.1").write_text("x")
    (tmp_path / "checkpoints" / "latest").write_text("step_4")
    assert sorted(clear_run(str(tmp_path))) == sorted(RUN_FILES)
    assert os.listdir(tmp_path) == ["notes.txt"]
    check_fresh_run(str(tmp_path), None, False)


def test_resume_from_a_missing_directory_says_it_does_not_exist(tmp_path):
    os.makedirs(tmp_path / "checkpoints" / "step_3")
    with pytest.raises(PreflightError, match=r"--resume .*step_300: no such directory.*holds: step_3") as e:
        check_resume(str(tmp_path / "checkpoints" / "step_300"))
    assert "meta.json" not in str(e.value)
    check_resume("auto")
    check_resume(None)
    check_resume(str(tmp_path / "checkpoints" / "step_3"))
    with pytest.raises(PreflightError, match=r"holds checkpoints but is not one.*checkpoints/step_3"):
        check_resume(str(tmp_path / "checkpoints"))
    with pytest.raises(PreflightError, match=r"holds checkpoints but is not one.*--resume auto"):
        check_resume(str(tmp_path))


def test_vocab_mismatch_names_every_size_and_its_source():
    with pytest.raises(PreflightError, match=r"tokenized with 4,096 \(d.stats.json\) tokens but the tokenizer has "
                                             r"2,048 \(data.tokenizer=tok\)"):
        check_vocab(dataset=(4096, "d.stats.json"), tokenizer=(2048, "data.tokenizer=tok"), model=(4096, "model"))
    with pytest.raises(PreflightError, match=r"token id 3,000 \(largest id in d.bin\) but the vocabulary has 2,048"):
        check_vocab(max_id=(3000, "largest id in d.bin"), tokenizer=(2048, "data.tokenizer=tok"))
    with pytest.raises(PreflightError, match=r"1,024 \(data.vocab_size\) is smaller than the 2,048"):
        check_vocab(dataset=(2048, "d.stats.json"), data_key=(1024, "data.vocab_size"))
    with pytest.raises(PreflightError, match=r"1,000 \(the model's vocab_size\) is smaller than the 1,501"):
        check_vocab(max_id=(1500, "d.bin"), model=(1000, "the model's vocab_size"))
    # agreeing sizes, and a model padded past the tokenizer, pass
    check_vocab(dataset=(2048, "s"), tokenizer=(2048, "t"), max_id=(2047, "b"), model=(2112, "m"), data_key=None)
    check_vocab()


def test_run_data_vocab_reads_the_runs_recorded_vocabulary(tmp_path):
    prefix = tmp_path / "d"
    (tmp_path / "d.stats.json").write_text(json.dumps({"vocab_size": 4096}))
    config = tmp_path / "config.py"
    config.write_text(f"data = dict(path={str(prefix)!r})\n")
    assert run_data_vocab(str(config)) == (4096, f"{prefix}.stats.json")
    config.write_text("data = dict(mock=True)\n")
    assert run_data_vocab(str(config)) is None and run_data_vocab(None) is None


def test_data_from_the_environment_and_missing_data(tmp_path, monkeypatch):
    monkeypatch.setenv("DATA", str(tmp_path / "train_data.json"))
    data = DataConfig()
    assert data_from_env(data) and data.path == str(tmp_path / "train_data.json")
    with pytest.raises(PreflightError, match=r"train_data.json': no such file"):
        check_data(data)
    (tmp_path / "train_data.json").write_text('{"text": "hello"}\n')
    check_data(data)                                   # a JSONL file: tokenized on first use
    configured = DataConfig(path=str(tmp_path / "prefix"))
    assert not data_from_env(configured) and configured.path == str(tmp_path / "prefix")   # the config's own data.path wins
    with pytest.raises(PreflightError, match=r"(?s)prefix.bin and .*prefix.idx not found.*data_pipeline tokenize"):
        check_data(configured)
    monkeypatch.delenv("DATA")
    with pytest.raises(PreflightError, match=r"data.path is not set.*export DATA"):
        check_data(DataConfig())


def test_data_path_naming_the_bin_file_gives_the_prefix(tmp_path):
    """data.path=x.bin (the file a user sees) said 'x.bin.bin not found, create it with tokenize': the dataset is
    there, only the prefix is wrong."""
    for ext in (".bin", ".idx"):
        (tmp_path / f"train{ext}").write_bytes(b"")
    for ext in (".bin", ".idx"):
        with pytest.raises(PreflightError, match=rf"train{ext}' names one of the dataset's two files; give the "
                                                 rf"prefix its .bin and .idx share: --set data.path=.*train$"):
            check_data(DataConfig(path=str(tmp_path / f"train{ext}")))
    check_data(DataConfig(path=str(tmp_path / "train")))
    with pytest.raises(PreflightError, match=r"other.bin.bin and .*not found"):   # no dataset beside it: as before
        (tmp_path / "other.bin").write_bytes(b"")
        check_data(DataConfig(path=str(tmp_path / "other.bin")))


def test_finished_message_says_how_to_extend_and_what_the_lr_does():
    from types import SimpleNamespace
    cosine = SimpleNamespace(lr_lambdas=[SimpleNamespace(kind="cosine", total_steps=300)])
    msg = finished_message("runs/x/checkpoints/step_300", 300, 300, cosine)
    assert "train.max_steps=600" in msg and "not stretched" in msg and "lr_scheduler.min_lr" in msg
    assert "not stretched" not in finished_message("c", 300, 300, None)
    by_epochs = finished_message("c", 120, 120, cosine, epochs=2)   # a run sized by NUM_EPOCHS, not max_steps
    assert "NUM_EPOCHS=2 (120 steps)" in by_epochs and "--set NUM_EPOCHS=4" in by_epochs, by_epochs


def test_cpu_threads_per_rank(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert cpu_threads() == (cores, f"{cores} cores available / 1 rank on this host")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_threads()[0] == max(1, cores // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))
    assert cpu_threads()[0] == 1                       # never zero
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads() == (3, "OMP_NUM_THREADS")
    assert cpu_threads(requested=5) == (5, "train.cpu_threads")
    with pytest.raises(ValueError, match=r"train.cpu_threads must be >= 1"):
        TrainConfig(cpu_threads=0)


def tiny_on_meta(**overrides):
    with torch.device("meta"):
        return build_model(dict(type=gpt2_tiny, **overrides))   # 2 layers, 2 heads, vocab 1024


def parallel_run(tp=1, pp=1, **keys):
    return Config(BATCH_SIZE=2, zero=dict(stage=keys.pop("stage", 1)),
                  parallel=dict(tensor=dict(size=tp), pipeline=pp), **keys)


def test_parallel_layout_is_checked_against_the_world_size():
    dims = check_parallel(parallel_run(tp=2), 4, tiny_on_meta)
    assert (dims.tp, dims.pp, dims.dp) == (2, 1, 2)
    with pytest.raises(PreflightError, match=r"world size 3 is not divisible by parallel.tensor.size \(2\) x "
                                             r"parallel.pipeline \(1\) = 2"):
        check_parallel(parallel_run(tp=2), 3, tiny_on_meta)


def test_parallel_layout_is_checked_against_the_models_shape():
    with pytest.raises(PreflightError, match=r"model \(GPT, vocab 1,024 padded to 1,024\): n_layer=2 is not "
                                             r"divisible by parallel.pipeline=4"):
        check_parallel(parallel_run(pp=4), 4, tiny_on_meta)
    with pytest.raises(PreflightError, match=r"n_head=2 is not divisible by parallel.tensor.size=4"):
        check_parallel(parallel_run(tp=4), 4, tiny_on_meta)
    with pytest.raises(PreflightError, match=r"padded vocabulary \(1001 rows\) is not divisible by "
                                             r"parallel.tensor.size=2"):
        check_parallel(parallel_run(tp=2), 2, lambda: tiny_on_meta(vocab_size=1001, pad_vocab_multiple=1))
    with pytest.raises(PreflightError, match=r"parallel.tensor.size=2 / parallel.pipeline=1 split a model_zoo GPT.*"
                                             r"Linear cannot be split"):
        check_parallel(parallel_run(tp=2), 2, lambda: torch.nn.Linear(2, 2, device="meta"))


def test_sequence_parallelism_needs_the_sequence_to_divide_by_t():
    run = parallel_run(tp=2, SEQ_LEN=63)
    run.parallel.tensor.sequence_parallel = True
    with pytest.raises(PreflightError, match=r"parallel.tensor.sequence_parallel=True .* SEQ_LEN=63 is not "
                                             r"divisible by 2"):
        check_parallel(run, 2, tiny_on_meta)
    run.SEQ_LEN = 64
    assert check_parallel(run, 2, tiny_on_meta).tp == 2


def test_without_model_parallelism_the_model_is_not_built():
    def never():
        raise AssertionError("built")
    assert check_parallel(parallel_run(), 3, never).dp == 3


def test_global_batch_divides_by_the_data_parallel_size_not_the_world():
    # 8 ranks with T=2, P=2: D=2, so GLOBAL_BATCH_SIZE=4 with BATCH_SIZE=2 is one micro-batch per rank
    assert check_parallel(parallel_run(tp=2, pp=2, GLOBAL_BATCH_SIZE=4), 8, tiny_on_meta).dp == 2
    with pytest.raises(PreflightError, match=r"GLOBAL_BATCH_SIZE=6 is not divisible by BATCH_SIZE \(2\) x "
                                             r"data-parallel size \(2\) = 4; .* \(data-parallel size 2 = world "
                                             r"size 8 / \(parallel.tensor.size 2 x parallel.pipeline 2\)\)"):
        check_parallel(parallel_run(tp=2, pp=2, GLOBAL_BATCH_SIZE=6), 8, tiny_on_meta)
    with pytest.raises(ValueError, match=r"GLOBAL_BATCH_SIZE=6 is not divisible by BATCH_SIZE \(2\) x "
                                         r"data-parallel size \(4\) = 8"):
        check_parallel(parallel_run(GLOBAL_BATCH_SIZE=6), 4, tiny_on_meta)       # D is the world: its message


def test_zero3_with_a_pipeline_is_refused_naming_both_keys():
    with pytest.raises(PreflightError, match=r"zero.stage=3 with parallel.pipeline=2 is not supported"):
        check_parallel(parallel_run(pp=2, stage=3), 2, tiny_on_meta)
    check_parallel(parallel_run(tp=2, stage=3), 2, tiny_on_meta)                # ZeRO-3 with TP is allowed
    check_parallel(parallel_run(pp=2, stage=2), 2, tiny_on_meta)


def test_world_size_and_vocabulary_known_before_launch(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert env_world_size() == 1                                                # plain `python train_gpt.py`
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert env_world_size() == 4
    assert known_vocab_size(DataConfig(mock=True)) == 50257
    assert known_vocab_size(DataConfig(mock=True, vocab_size=512)) == 512
    (tmp_path / "d.stats.json").write_text(json.dumps({"vocab_size": 4096}))
    assert known_vocab_size(DataConfig(path=str(tmp_path / "d"))) == 4096
    assert known_vocab_size(DataConfig(path=str(tmp_path / "megatron"))) is None   # no stats: the tokenizer's


def test_train_gpt_refuses_a_bad_layout_before_launch(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.delenv("RANK", raising=False)
    argv = ["--config", os.path.join(os.path.dirname(__file__), "..", "configs", "gpt2_medium_tp2.py"),
            "--set", "data.mock=True", "--set", f"train.output_dir={tmp_path / 'run'}"]
    assert train_gpt.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: world size 3 is not divisible by parallel.tensor.size (2) x parallel.pipeline (1) = 2; "
                   "launch a multiple of 2 ranks (torchrun --nproc_per_node) or change the parallel sizes"], err
    assert not (tmp_path / "run").exists()                                      # refused before anything was made


def test_the_run_directory_lock_names_its_holder_and_dies_with_it(tmp_path):
    """Issue 31.1: an OS lock held by the first run's process; released when that process dies, kill -9 included."""
    import signal
    import subprocess
    import sys

    from zerogpt.preflight import LOCK_FILE, lock_run_dir

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from zerogpt.preflight import lock_run_dir; "
                               f"lock_run_dir({str(tmp_path)!r}); print('locked', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(PreflightError, match=rf"is in use by another run: pid {holder.pid} on .*, started .*--set train.output_dir=NEW_DIR"):
            lock_run_dir(str(tmp_path))
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        lock = lock_run_dir(str(tmp_path))     # the kernel dropped the dead process's lock
        assert f"pid {os.getpid()} " in (tmp_path / LOCK_FILE).read_text()
        lock.release()
        assert not (tmp_path / LOCK_FILE).exists()
    finally:
        holder.kill()
        holder.wait()


def test_optimizer_values_are_checked_before_anything_is_written(tmp_path):
    """Issue 31.6: torch's own check of optimizer.lr=-1 runs in preflight and names the --set."""
    from zerogpt.preflight import check_optimizer

    cfg = Config.from_file(train_gpt.__file__.replace("train_gpt.py", "configs/demo_cpu.py"))
    check_optimizer(cfg)
    with pytest.raises(PreflightError, match=r"Invalid learning rate: -1 \(in --set optimizer.lr=-1\)"):
        check_optimizer(cfg.apply_overrides(["optimizer.lr=-1"]))
    hybrid = Config.from_file(train_gpt.__file__.replace("train_gpt.py", "configs/demo_cpu.py"))
    with pytest.raises(PreflightError, match=r"HybridAdam.*invalid betas=\(1.5, 0.9\).*\(in --set optimizer.betas"):
        check_optimizer(hybrid.apply_overrides(["optimizer.type='HybridAdam'", "optimizer.betas=(1.5, 0.9)"]))
