"""plan="auto" through train_gpt.py on CPU with a simulated device (ZEROGPT_DEVICE_MEM): the trials run, the table is
in the run directory, and the run is the hand-set run of the chosen plan, loss for loss; a resumed run reuses the
plan; trial steps on a real engine measure, and one over the simulated capacity is lost, not a crash."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = """\
from model_zoo.gpt import gpt2_tiny
from zerogpt.optim import HybridAdam
plan = "auto"
TOKENS_PER_STEP = 4 * 64
SEQ_LEN = 64
precision = "fp32"
model = dict(type=gpt2_tiny)
optimizer = dict(type=HybridAdam, lr=1e-3)
data = dict(mock=True, vocab_size=1024)
train = dict(max_steps=3, log_interval=1, output_dir={out!r})
"""


def train(args, env):
    cmd = [sys.executable, os.path.join(ROOT, "train_gpt.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **env)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if r.get("split") == "train"]


@pytest.mark.timeout(600)
def test_auto_runs_as_the_hand_set_plan_and_resumes_with_it(tmp_path):
    auto, hand = tmp_path / "auto", tmp_path / "hand"
    config = tmp_path / "auto.py"
    config.write_text(CONFIG.format(out=str(auto)))
    env = dict(ZEROGPT_DEVICE_MEM="48MiB", ZEROGPT_PLAN_CACHE=str(tmp_path / "plans.json"))
    proc = train(["--config", str(config)], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert log.count("plan='auto': trial steps of") >= 2
    table = (auto / "plan.txt").read_text()
    assert table.startswith("plan='auto':") and "\n*  " in table and "measured" in table
    assert table.splitlines()[0] in log
    # the run directory's config.py is the hand-set config of the chosen plan: run it as one
    written = (auto / "config.py").read_text()
    assert "plan = 'manual'" in written
    proc = train(["--config", str(auto / "config.py"), "--set", f"train.output_dir={hand}"], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert losses(auto) == losses(hand) and len(losses(auto)) == 3
    # resumed: the same plan, not searched again
    proc = train(["--config", str(config), "--resume", "auto", "--set", "train.max_steps=4"], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "resumed: reusing this run's plan" in log and "trial steps of" not in log


def test_a_tokens_per_step_the_world_cannot_split_is_one_line(tmp_path):
    config = tmp_path / "auto.py"
    config.write_text(CONFIG.format(out=str(tmp_path / "run")).replace("4 * 64", "4 * 64 + 1"))
    proc = train(["--config", str(config)], {})
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: tokens per step 257 is not a multiple of world 1 x SEQ_LEN 64 = 64; use 256 or 320"]


@pytest.mark.timeout(300)
def test_trial_steps_measure_and_a_trial_over_the_simulated_device_is_lost():
    from model_zoo import GPTLMLoss, build_model
    from model_zoo.gpt import gpt2_tiny
    import zerogpt
    from zerogpt.config import Config
    from zerogpt.planner.trial import run_trial

    cfg = Config(precision="fp32", zero=dict(stage=0), BATCH_SIZE=2, SEQ_LEN=32, model=dict(type=gpt2_tiny),
                 optimizer=dict(type="AdamW", lr=1e-3)).validate()
    launched = zerogpt.launch_from_torch(seed=0)
    try:
        def build():
            with torch.device("meta"):
                model = build_model(dict(cfg.model), vocab_size=1024)
            return zerogpt.initialize(model, dict(cfg.optimizer), GPTLMLoss(shift=False), config=cfg, ctx=launched)

        torch.manual_seed(5)
        before = torch.rand(3)
        torch.manual_seed(5)
        ran = run_trial(build, micro_batch=2, accumulation=1, seq_len=32, vocab=1024, steps=2)
        assert torch.equal(torch.rand(3), before)  # the trial drew from no RNG the run will use
        assert ran["seconds"] > 0 and ran["device_peak"] > 4 * 180_000  # fp32 params at least
        lost = run_trial(build, micro_batch=2, accumulation=1, seq_len=32, vocab=1024, steps=1,
                         device_capacity=ran["device_peak"] // 2)
        assert lost["error"].startswith("out of memory (device peak")
    finally:
        launched.destroy()


@pytest.mark.timeout(300)
def test_two_ranks_plan_together_and_train(tmp_path):
    out = tmp_path / "run"
    config = tmp_path / "auto.py"
    config.write_text(CONFIG.format(out=str(out)).replace("4 * 64", "2 * 4 * 64"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train_gpt.py"), "--config", str(config), "--set", "train.max_steps=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, ZEROGPT_DEVICE_MEM="64MiB",
               ZEROGPT_PLAN_CACHE=str(tmp_path / "plans.json"))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (out / "plan.txt").read_text()
    assert ", world 2, fp32)" in table.splitlines()[0]
    assert len(losses(out)) == 2
    assert json.loads((tmp_path / "plans.json").read_text())  # rank 0 cached the choice


@pytest.mark.timeout(300)
def test_a_stage_3_trial_counts_the_activations_it_keeps_through_its_own_hooks():
    """Stage 3 saves its activations through the engine's saved-tensor hooks; a CPU trial's device peak still grows
    with the micro-batch as stage 0's does (at one rank the two hold the same)."""
    from model_zoo import GPTLMLoss, build_model
    from model_zoo.gpt import gpt2_tiny
    import zerogpt
    from zerogpt.config import Config
    from zerogpt.planner.trial import run_trial

    launched = zerogpt.launch_from_torch(seed=0)
    growth = {}
    try:
        for stage in (0, 3):
            cfg = Config(precision="fp32", zero=dict(stage=stage), BATCH_SIZE=1, SEQ_LEN=32,
                         model=dict(type=gpt2_tiny), optimizer=dict(type="AdamW", lr=1e-3)).validate()

            def build():
                with torch.device("meta"):
                    model = build_model(dict(cfg.model), vocab_size=1024)
                return zerogpt.initialize(model, dict(cfg.optimizer), GPTLMLoss(shift=False), config=cfg,
                                          ctx=launched)

            peaks = [run_trial(build, micro_batch=mb, accumulation=1, seq_len=32, vocab=1024, steps=1)["device_peak"]
                     for mb in (1, 8)]
            growth[stage] = peaks[1] - peaks[0]
    finally:
        launched.destroy()
    assert growth[0] > 7 * 32 * 1024 * 4  # 7 more samples' logits at least
    assert 0.9 * growth[0] <= growth[3] <= 1.1 * growth[0]


@pytest.mark.timeout(300)
def test_a_cpu_trial_counts_the_host_shards_a_gpu_would_copy_to_the_device():
    """Stage 3 with parameters offloaded at one rank: a CPU run computes on the host shard in place, a GPU run on a
    device copy of it; the CPU measure counts that copy while the chunk is gathered, and nothing for a device shard."""
    from model_zoo import GPTLMLoss, build_model
    from model_zoo.gpt import gpt2_tiny
    import zerogpt
    from zerogpt.config import Config
    from zerogpt.planner.trial import _host_shards_computed_in_place

    launched = zerogpt.launch_from_torch(seed=0)
    try:
        for offload in ("cpu", "none"):
            cfg = Config(precision="fp32", zero=dict(stage=3, offload_param=dict(device=offload)), BATCH_SIZE=1,
                         SEQ_LEN=32, model=dict(type=gpt2_tiny), optimizer=dict(type="HybridAdam", lr=1e-3)).validate()
            with torch.device("meta"):
                model = build_model(dict(cfg.model), vocab_size=1024)
            engine = zerogpt.initialize(model, dict(cfg.optimizer), GPTLMLoss(shift=False), config=cfg, ctx=launched)
            chunk = engine.chunks[0]
            chunk.gather()
            gathered = _host_shards_computed_in_place(engine)
            chunk.release()
            assert _host_shards_computed_in_place(engine) == 0
            assert gathered == (chunk.shard.untyped_storage().nbytes() if offload == "cpu" else 0)
            engine.close()
    finally:
        launched.destroy()
