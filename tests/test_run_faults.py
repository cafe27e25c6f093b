"""train_gpt.py under the faults a user meets (issue 31): two runs into one directory, Ctrl-C / SIGTERM (once,
twice), a bad value from --set, and the progress bar in a terminal. Real launches on CPU; helpers from
test_train_gpt.py."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.terminal import in_a_terminal
from tests.test_train_gpt import DEMO, ROOT, SHORT, data_args, overrides, read_jsonl, user_error

PY = sys.executable
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
LONG = ["train.max_steps=1000", "train.log_interval=1", "train.save_interval=1000", "train.eval_interval=1000"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The bundled sample corpus, tokenized once (so concurrent runs do not race to build it)."""
    from data_pipeline.__main__ import main as pipeline
    from train_gpt import SAMPLE_CORPUS, SAMPLE_VOCAB
    d = tmp_path_factory.mktemp("data")
    assert pipeline(["train-tokenizer", SAMPLE_CORPUS, "--output", f"{d}/tokenizer", "--vocab-size",
                     str(SAMPLE_VOCAB)]) == 0
    assert pipeline(["tokenize", SAMPLE_CORPUS, "--tokenizer", f"{d}/tokenizer", "--output-prefix",
                     f"{d}/stdlib_docs"]) == 0
    return d


def launch(args, nproc=None):
    """train_gpt.py in its own session (so a signal to the group is what a terminal's Ctrl-C sends)."""
    runner = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else [PY]
    return subprocess.Popen([*runner, os.path.join(ROOT, "train_gpt.py"), *args], cwd=ROOT, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_steps(out, n, proc, timeout=120):
    """Until metrics.jsonl holds n train lines (training is under way)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            with open(os.path.join(out, "metrics.jsonl")) as f:
                if sum('"train"' in line for line in f) >= n:
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"no {n} train steps in {out}: {proc.communicate(timeout=10)[0][-3000:]}")


# ---------------------------------------------------------------------------------------------------- 31.1


@pytest.mark.timeout(200)
def test_two_runs_started_at_once_into_one_directory_one_refuses_naming_the_other(data_dir, tmp_path):
    out = tmp_path / "mix"
    runs = [launch(["--config", DEMO, *overrides(SHORT + data_args(data_dir) + [f"train.output_dir={out}",
                                                                                f"optimizer.lr={lr}"])], nproc=2)
            for lr in (3e-3, 1e-3)]
    logs = [run.communicate(timeout=180)[0] for run in runs]
    codes = [run.returncode for run in runs]
    assert sorted(codes)[0] == 0 and sorted(codes)[1] != 0, (codes, logs[0][-2000:], logs[1][-2000:])
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    ours = [line for line in logs[loser].splitlines() if line.startswith("error: ")]
    assert len(ours) == 1, logs[loser]
    assert re.search(rf"train.output_dir='{out}' is in use by another run: pid \d+, torchrun pid "
                     rf"{runs[winner].pid} on .*train_gpt.py --config", ours[0]), ours[0]
    train = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train"]
    assert train == [2, 4, 6]                                       # one run's lines, once each
    assert len(os.listdir(out / "tensorboard")) == 1
    assert sorted(os.listdir(out)) == ["checkpoints", "config.py", "engine_plan.txt", "loss.png", "metrics.jsonl",
                                       "tensorboard"]


# ---------------------------------------------------------------------------------------------------- 31.2


@pytest.mark.timeout(200)
def test_ctrl_c_under_torchrun_stops_every_rank_at_one_step_and_keeps_a_checkpoint(data_dir, tmp_path):
    out = tmp_path / "run"
    run = launch(["--config", DEMO, *overrides(SHORT + LONG + data_args(data_dir) + [f"train.output_dir={out}"])],
                 nproc=2)
    wait_for_steps(out, 3, run)
    os.killpg(run.pid, signal.SIGINT)                # what Ctrl-C in a terminal sends to torchrun's group
    log = run.communicate(timeout=90)[0]
    ours = [line for line in log.splitlines() if line.startswith("interrupted")]
    assert len(ours) == 1, log
    step = int(re.fullmatch(r"interrupted \(SIGINT\) at step (\d+): checkpoint .*/checkpoints/step_(\d+) kept, "
                            r"continue with --resume auto", ours[0]).group(1))
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
    assert (out / "checkpoints" / f"step_{step}" / "meta.json").exists()
    assert max(r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train") == step
    # no rank crashed or reported a failure; the one traceback is torchrun's own report of its signal
    assert "training failed" not in log and "ERROR" not in log and "Connection closed" not in log
    assert log.count("Traceback") == 1 and "SignalException" in log
    assert not (out / ".zerogpt.lock").exists()


@pytest.mark.timeout(200)
def test_sigterm_without_save_on_interrupt_then_a_second_ctrl_c_exits_at_once(data_dir, tmp_path):
    out = tmp_path / "term"
    run = launch(["--config", DEMO, *overrides(SHORT + LONG + data_args(data_dir) + [
        f"train.output_dir={out}", "train.save_on_interrupt=False"])])
    wait_for_steps(out, 2, run)
    run.send_signal(signal.SIGTERM)
    log = run.communicate(timeout=60)[0]
    assert run.returncode == 130, log[-3000:]
    assert re.search(r"^interrupted \(SIGTERM\) at step \d+: no checkpoint yet, a new run starts at step 0$", log,
                     re.M), log[-2000:]
    assert not os.path.exists(out / "checkpoints") and "Traceback" not in log

    # A step that takes long (a slow hook): the first Ctrl-C waits for it, a second one a second later does not.
    config = tmp_path / "slow.py"
    config.write_text(open(DEMO).read() + textwrap.dedent("""
        import time
        from zerogpt.trainer import Hook

        class Slow(Hook):
            def after_step(self, trainer):
                if trainer.state.step == 3:
                    time.sleep(60)

        hooks = [Slow()]
        """))
    out = tmp_path / "twice"
    run = launch(["--config", str(config), *overrides(SHORT + LONG + data_args(data_dir) + [
        f"train.output_dir={out}"])])
    wait_for_steps(out, 3, run)
    run.send_signal(signal.SIGINT)
    time.sleep(1.5)
    started = time.time()
    run.send_signal(signal.SIGINT)
    log = run.communicate(timeout=30)[0]
    assert time.time() - started < 15 and run.returncode == 130, log[-3000:]
    assert re.search(r"^interrupted: stopped at once, no checkpoint saved; no checkpoint yet$", log, re.M), log[-2000:]
    assert "Traceback" not in log


# ---------------------------------------------------------------------------------------------------- 31.6


@pytest.mark.parametrize("override", ["BATCH_SIZE=-1", "train.max_steps=-1", "SEQ_LEN=0", "train.eval_iters=0"])
def test_a_bad_value_names_the_set_that_gave_it(override, capsys):
    code, err = user_error(capsys, "--set", override)
    assert code == 1 and err.rstrip().endswith(f"(in --set {override})") and "demo_cpu.py" not in err, err


def test_a_bad_optimizer_value_is_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "new"
    code, err = user_error(capsys, "--set", "optimizer.lr=-1", "--set", f"train.output_dir={out}")
    assert code == 1 and "Invalid learning rate: -1 (in --set optimizer.lr=-1)" in err and "Traceback" not in err
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------- 31.7


@pytest.mark.timeout(200)
def test_progress_bar_in_a_terminal_of_unknown_width_and_log_lines_on_their_own_line(data_dir, tmp_path):
    raw, code = in_a_terminal([PY, os.path.join(ROOT, "train_gpt.py"), "--config", DEMO, *overrides(
        SHORT + data_args(data_dir) + [f"train.output_dir={tmp_path}", "train.log_interval=3"])], ENV, ROOT)
    assert code == 0, raw[-3000:]
    bars = re.findall(r"train: +\d+%\|[^\r\n]*\| (\d+)/6 \[", raw)
    assert bars and bars[-1] == "6", raw[-3000:]                      # the bar is drawn, and reaches the end
    assert not re.search(r"step/s[^\r\n]*\](step \d+/6|valid step)", raw), raw   # no log line glued to a bar
    assert re.search(r"(^|[\r\n])step 6/6 \| loss", raw)
