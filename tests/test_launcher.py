"""`zerogpt run` as a user meets it (issue 48.1-48.3): each shipped CPU config prints only zerogpt's own lines; a
failing worker's one line is the whole output and its exit code the launcher's; Ctrl-C ends with the run's
"checkpoint kept" line, no traceback. Real launches on 2 CPU ranks, a few steps each."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.test_run_faults import wait_for_steps
from tests.test_train_gpt import DEMO, ROOT, overrides, read_jsonl

# the console script setup.py installs (pip install -e .), else the same main through python -m
SCRIPT = os.path.join(os.path.dirname(sys.executable), "zerogpt")
ZEROGPT = [SCRIPT] if os.path.exists(SCRIPT) else [sys.executable, "-m", "zerogpt.launcher"]
# no OMP_NUM_THREADS: setting it quietly is the launcher's part
ENV = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOGLEVEL")}
ENV["PYTHONPATH"] = ROOT
SHORT = ["train.max_steps=4", "train.log_interval=2", "train.eval_interval=4", "train.eval_iters=2",
         "train.save_interval=4", "lr_scheduler.warmup_steps=1", "SEQ_LEN=64", "BATCH_SIZE=4"]

# Every line a normal run prints, by its source: anything else on the console is someone else's.
ZEROGPT_LINES = [
    r"launch: world_size=\d+ backend=\w+ device=\w+ seed=\d+",                          # zerogpt/launch.py
    r"cpu threads: \d+ per rank \(.*\)",
    r"mesh \(pp=\d+, dp=\d+, tp=\d+\) over \d+ ranks, .*", r"  (dp|tp|pp) groups: .*",  # parallel/mesh.py
    r"sample data: .* \(first run only\)", r"\[(train-tokenizer|tokenize)\] .*",        # the demo's first run
    r"model: \S+ \(\w+\) loads .*",                                                     # model_zoo build_model
    r"building .* \(first run only, about \d+ s\)", r"built .* in \d+ s",              # optim/op_build.py
    r"zerogpt engine: stage \d, .*",                                                    # engine.describe()
    r"tokens/step: .*",                                                                 # train_gpt.py
    r"valid step \d+ \| loss [\d.]+ \| ppl [\d.]+",                                     # trainer hooks
    r"step \d+/\d+ \| loss .*",
    r"saved checkpoint \S+",
    r"done: \d+ steps, [\d,]+ tokens.*",                                                # train_gpt.py's close
    r"  (metrics|plot|checkpoint|tensorboard|continue|start over): +.*",
    r"interrupted \(SIG\w+\) at step \d+: .*",
]


def foreign_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if not any(re.fullmatch(p, line) for p in ZEROGPT_LINES)]


def zerogpt_run(args, nproc=2, timeout=240, cwd=ROOT):
    """`zerogpt run --nproc-per-node N ARGS`, stdout and stderr as one console."""
    proc = subprocess.run([*ZEROGPT, "run", "--nproc-per-node", str(nproc), *args], cwd=cwd, env=ENV, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    return proc.returncode, proc.stdout


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The bundled sample corpus, tokenized once, and a tiny Hugging Face Llama over its 2,048 tokens (what
    llama_continue_cpu.py continues: the Llama demo's step 2 writes it with the exporter)."""
    from data_pipeline.__main__ import main as pipeline
    from train_gpt import SAMPLE_CORPUS, SAMPLE_VOCAB
    d = tmp_path_factory.mktemp("data")
    assert pipeline(["train-tokenizer", SAMPLE_CORPUS, "--output", f"{d}/tokenizer", "--vocab-size",
                     str(SAMPLE_VOCAB)]) == 0
    assert pipeline(["tokenize", SAMPLE_CORPUS, "--tokenizer", f"{d}/tokenizer", "--output-prefix",
                     f"{d}/stdlib_docs"]) == 0
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=SAMPLE_VOCAB,
                                      max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(d / "llama_tiny")
    return d


def data_args(d):
    return [f"data.path={d}/stdlib_docs", f"data.tokenizer={d}/tokenizer"]


# Each shipped config that runs on CPU, as its header launches it; the continuation at stage 3 with the optimizer
# and parameters offloaded and the CPU Adam ops (DeepSpeed's op loads there: its accelerator warning is foreign).
CPU_CONFIGS = {
    "demo_cpu.py": [],
    "llama_tiny_cpu.py": [],
    "llama_continue_cpu.py": ["model.path={data}/llama_tiny", "zero.offload_optimizer.device=cpu",
                              "zero.offload_param.device=cpu", "optimizer.type=HybridAdam"],
}


def test_the_cpu_configs_are_the_ones_shipped():
    shipped = sorted(n for n in os.listdir(os.path.join(ROOT, "configs")) if n.endswith("_cpu.py"))
    assert shipped == sorted(CPU_CONFIGS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(CPU_CONFIGS))
def test_a_shipped_cpu_config_prints_only_zerogpt_lines(name, data_dir, tmp_path):
    extra = [item.format(data=data_dir) for item in CPU_CONFIGS[name]]
    code, log = zerogpt_run(["train_gpt.py", "--config", f"configs/{name}", *overrides(
        SHORT + data_args(data_dir) + [f"train.output_dir={tmp_path / 'run'}"] + extra)])
    assert code == 0, log[-4000:]
    assert foreign_lines(log) == [], log
    assert re.search(r"^done: 4 steps", log, re.M)


@pytest.mark.timeout(120)
def test_a_config_mistake_is_one_line_and_exit_code_1(tmp_path):
    code, log = zerogpt_run(["train_gpt.py", "--config", DEMO, "--set", "train.max_steps=4",
                             "--set", f"train.output_dir={tmp_path}"])
    assert (code, log.splitlines()) == (1, [
        "error: train.max_steps=4 is shorter than lr_scheduler.warmup_steps=30: the run would end before the warmup "
        "reaches the peak LR; raise train.max_steps (e.g. --set train.max_steps=300) or lower "
        "lr_scheduler.warmup_steps"])


@pytest.mark.timeout(120)
def test_a_failed_worker_gives_its_own_line_and_exit_code_and_a_signal_one_line(tmp_path):
    """Rank 1 fails while rank 0 still works (torchrun then stops rank 0 with SIGTERM): rank 1's line and exit
    code, nothing of torchrun's; a rank killed by a signal cannot say so itself: the launcher's one line."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time
        if os.environ["RANK"] == "1":
            if sys.argv[1] == "exit":
                print("error: rank 1 failed on purpose", file=sys.stderr, flush=True)
                sys.exit(7)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """))
    code, log = zerogpt_run([str(script), "exit"], cwd=tmp_path)
    assert (code, log.splitlines()) == (7, ["error: rank 1 failed on purpose"])
    logs = tmp_path / "logs"                         # its stderr to a file: the launcher names the rank
    code, log = zerogpt_run(["--redirects", "2", "--log-dir", str(logs), str(script), "exit"], cwd=tmp_path)
    assert (code, log.splitlines()) == (7, [f"error: rank 1 exited with code 7; its output is under {logs}"])
    code, log = zerogpt_run([str(script), "kill"], cwd=tmp_path)
    assert code == 128 + signal.SIGKILL
    assert re.fullmatch(r"error: rank 1 \(pid \d+\) was killed by SIGKILL; the other ranks were stopped\n", log), log


@pytest.mark.timeout(300)
def test_ctrl_c_ends_with_the_checkpoint_kept_line_and_exit_code_130(data_dir, tmp_path):
    out = tmp_path / "run"
    run = subprocess.Popen([*ZEROGPT, "run", "--nproc-per-node", "2", "train_gpt.py", "--config", DEMO, *overrides(
        SHORT + data_args(data_dir) + [f"train.output_dir={out}", "train.max_steps=1000", "train.log_interval=1",
                                       "train.save_interval=1000", "train.eval_interval=1000"])],
        cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    wait_for_steps(out, 3, run, timeout=180)
    os.killpg(run.pid, signal.SIGINT)                # what Ctrl-C in a terminal sends to the launcher's group
    log = run.communicate(timeout=120)[0]
    assert run.returncode == 130, log[-3000:]
    assert foreign_lines(log) == [], log
    last = log.splitlines()[-1]
    step = int(re.fullmatch(r"interrupted \(SIGINT\) at step (\d+): checkpoint .*/checkpoints/step_(\d+) kept, "
                            r"continue with --resume auto", last).group(1))
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
    assert max(r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train") == step


def test_the_root_cause_is_the_first_failure_not_a_rank_the_agent_stopped():
    """torchrun's own pick, ChildFailedError.get_first_failure, is the earliest stamp; with no error files the
    stamps tie and it names rank 0, which the agent itself stopped with SIGTERM after rank 1 failed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from zerogpt.launcher import root_cause

    stopped = ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGTERM, error_file="")
    failed = ProcessFailure(local_rank=1, pid=11, exitcode=7, error_file="")
    stopped.timestamp = failed.timestamp = 1_700_000_000
    failures = {0: stopped, 1: failed}
    assert ChildFailedError("worker.py", failures).get_first_failure()[0] == 0
    assert root_cause(failures) == (1, failed)
    failed.exitcode = -signal.SIGTERM                # every rank stopped by SIGTERM (a scheduler's): the first
    assert root_cause(failures)[0] == 0


def test_the_launcher_drops_torchruns_records_and_no_others():
    import logging

    from zerogpt.launcher import TorchLogFilter

    def record(name):
        return logging.LogRecord(name, logging.ERROR, __file__, 1, "message", None, None)

    keep = TorchLogFilter()
    assert not keep.filter(record("torch.distributed.elastic.multiprocessing.api"))
    assert not keep.filter(record("torch.distributed.run"))
    assert keep.filter(record("torch.distributed.distributed_c10d")) and keep.filter(record("zerogpt.rank0"))


def test_a_rank_whose_stderr_went_to_a_file_is_named_by_the_launcher():
    from torch.distributed.run import get_args_parser

    from zerogpt.launcher import _shows_stderr

    def shows(*flags, local_rank=1):
        return _shows_stderr(get_args_parser().parse_args([*flags, "train.py"]), local_rank)

    assert shows() and shows("--redirects", "1")                            # stdout only to the file
    assert not shows("--redirects", "2") and not shows("--redirects", "0:3,1:2")
    assert shows("--redirects", "3", "--tee", "3") and shows("--redirects", "1:2", local_rank=0)
    assert not shows("--local-ranks-filter", "0") and shows("--local-ranks-filter", "0,1")


def test_the_console_script_names_its_commands(capsys):
    from zerogpt.launcher import main

    assert main(["launch"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("error: unknown command 'launch'; use `zerogpt run [torchrun flags] train_gpt.py --config C`")
    assert any(line.startswith("  run ") for line in err) and any(line.startswith("  build-ops ") for line in err)
