"""Hooks: metrics.jsonl schema, LR schedule shapes, NaN guard, checkpoints, plot, the seed tutorial's hook list."""
import json
import logging
import math
import os

import pytest
import torch

from tests.trainer.engine_double import EngineDouble, token_batches
from zerogpt.trainer import (EvalHook, Hook, LogMetricByEpochHook, LogMetricByStepHook, LossHook, LRSchedulerHook,
                             MemoryHook, NaNGuardHook, PlotHook, ProgressBarHook, SaveCheckpointHook, TensorboardHook,
                             ThroughputHook, Trainer, latest_checkpoint)
from zerogpt.trainer.hooks.logging import TRAIN_KEYS, VALID_KEYS


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def standard_hooks(out, log_interval=2, eval_interval=3, save_interval=None):
    return [ThroughputHook(flops_per_token=1e6), MemoryHook(), LogMetricByStepHook(out, log_interval=log_interval),
            NaNGuardHook(), EvalHook(eval_interval, eval_iters=2), SaveCheckpointHook(out, save_interval=save_interval),
            PlotHook(out)]


def test_metrics_jsonl_schema(tmp_path):
    out = str(tmp_path)
    trainer = Trainer(EngineDouble(), hooks=standard_hooks(out))
    trainer.fit(token_batches(8), max_steps=7, eval_dataloader=token_batches(4, seed=1))
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    train = [r for r in recs if r["split"] == "train"]
    valid = [r for r in recs if r["split"] == "valid"]
    assert all(tuple(r) == TRAIN_KEYS for r in train)
    assert all(tuple(r) == VALID_KEYS for r in valid)
    assert [r["step"] for r in train] == [2, 4, 6, 7]          # every log_interval, and the last step
    assert [r["step"] for r in valid] == [3, 6, 7]              # every eval_interval, and the last step
    r = train[-1]
    assert r["epoch"] == 0 and r["skipped"] is False and r["loss_scale"] is None
    assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["lr"] == pytest.approx(1e-2)
    assert r["tokens_per_s"] > 0 and r["tflops"] == pytest.approx(1e6 * r["tokens_per_s"] / 1e12)
    assert set(r["mem"]) == {"states_device_mb", "states_host_mb", "states_disk_mb", "device_peak_mb",
                             "host_rss_mb"}
    assert r["mem"]["host_rss_mb"] > 0 and r["mem"]["device_peak_mb"] is None
    assert valid[-1]["ppl"] == pytest.approx(math.exp(valid[-1]["loss"]))


def test_resumed_run_drops_lines_after_the_checkpoint(tmp_path):
    out = str(tmp_path)
    first = Trainer(EngineDouble(), hooks=standard_hooks(out, log_interval=1, eval_interval=None, save_interval=3))
    first.fit(token_batches(8), max_steps=5, eval_dataloader=token_batches(2, seed=1))
    ckpt = os.path.join(out, "checkpoints", "step_3")
    engine = EngineDouble()
    second = Trainer(engine, hooks=standard_hooks(out, log_interval=1, eval_interval=None, save_interval=3))
    second.load_state_dict(engine.load_checkpoint(ckpt))
    assert second.state.step == 3
    second.fit(token_batches(8), max_steps=6, eval_dataloader=token_batches(2, seed=1))
    steps = [(r["split"], r["step"]) for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert steps == [("train", s) for s in (1, 2, 3)] + [("train", s) for s in (4, 5, 6)] + [("valid", 6)]


def test_checkpoint_hook_saves_prunes_and_points_latest(tmp_path):
    out = str(tmp_path)
    seen = []

    class OnCkpt(Hook):
        def on_checkpoint(self, trainer, path):
            seen.append((os.path.basename(path), open(os.path.join(out, "checkpoints", "latest")).read().strip()))

    engine = EngineDouble()
    Trainer(engine, hooks=[SaveCheckpointHook(out, save_interval=2, keep_last=2), OnCkpt()]).fit(
        token_batches(8), max_steps=7)
    assert seen == [("step_2", "step_2"), ("step_4", "step_4"), ("step_6", "step_6"), ("step_7", "step_7")]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_6", "step_7"]
    assert latest_checkpoint(out) == os.path.join(out, "checkpoints", "step_7")
    extra = engine.saved[-1][1]
    assert extra["trainer"]["step"] == 7 and extra["trainer"]["consumed_samples"] == 28


def test_a_step_with_a_non_finite_gradient_is_saved_like_any_other(tmp_path):
    """The engine skips such a step (its weights are the step before's, tests/zero/test_nonfinite_step.py), so the
    checkpoint hook saves on schedule and reads no norm (issue 31.4; it used to refuse, which cost checkpoints)."""
    out = str(tmp_path)

    class NaNNormEngine(EngineDouble):
        def step(self):
            norm = super().step()
            return None if norm is None else (norm * float("nan") if self.global_step >= 4 else norm)

    engine = NaNNormEngine()
    Trainer(engine, hooks=[SaveCheckpointHook(out, save_interval=2, keep_last=2)]).fit(token_batches(8), max_steps=7)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_6", "step_7"]


class NaNAtStep:
    """GPT loss that is NaN on optimizer step `bad` only (accumulation 1): its gradient is NaN everywhere."""

    def __init__(self, criterion, bad):
        self.criterion, self.bad, self.calls = criterion, bad, 0

    def __call__(self, logits, labels):
        self.calls += 1
        loss = self.criterion(logits, labels)
        return loss * float("nan") if self.calls == self.bad else loss


def test_a_nan_step_is_skipped_counted_and_shown_as_nan(tmp_path, caplog):
    """Issue 31.4 through the loop: one NaN batch on the real engine is skipped, the run goes on, metrics.jsonl
    counts it (skipped_steps, also in a checkpoint's trainer state), and the console line says `loss nan`."""
    import zerogpt
    from model_zoo import GPTLMLoss, gpt2_tiny
    from zerogpt.context import DistContext

    torch.manual_seed(0)
    cfg = zerogpt.Config(dict(zero=dict(stage=2), optimizer=dict(type="AdamW", lr=1e-3), clip_grad_norm=1.0))
    engine = zerogpt.initialize(gpt2_tiny(vocab_size=32, max_position_embeddings=8), dict(cfg.optimizer),
                                criterion=NaNAtStep(GPTLMLoss(shift=False), bad=3), config=cfg,
                                ctx=DistContext.current(logger=logging.getLogger("zerogpt.test.nan")))
    trainer = Trainer(engine, hooks=[LogMetricByStepHook(str(tmp_path), log_interval=1), NaNGuardHook()])
    with caplog.at_level(logging.INFO, logger="zerogpt.test.nan"):
        trainer.fit(token_batches(8), max_steps=6)
    train = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["skipped_steps"] for r in train] == [0, 0, 1, 1, 1, 1]
    assert train[2]["loss"] is None and train[2]["grad_norm"] is None           # strict JSON: null
    assert all(math.isfinite(r["loss"]) for r in train[3:])                      # the run goes on
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert "loss nan | norm nan" in lines[2] and "| 1 skipped" in lines[2], lines[2]
    assert "loss -" not in "".join(lines) and "skipped" not in lines[1]
    assert trainer.state_dict()["trainer"]["skipped_steps"] == 1
    engine.close()


def test_nan_guard_advice_leaves_out_what_the_run_does(tmp_path):
    engine = EngineDouble()
    engine.criterion = NaNAfter(start=1)
    engine.config.clip_grad_norm = 1.0
    hooks = [LogMetricByStepHook(None, log_interval=1), NaNGuardHook(max_bad_steps=2)]
    with pytest.raises(FloatingPointError, match="non-finite for 2") as error:
        Trainer(engine, hooks=hooks).fit(token_batches(8), max_steps=8)
    assert "clip_grad_norm" not in str(error.value) and "Lower optimizer.lr" in str(error.value)
    engine = EngineDouble()
    engine.criterion = NaNAfter(start=1)
    with pytest.raises(FloatingPointError, match="set clip_grad_norm=1.0"):
        Trainer(engine, hooks=hooks[:1] + [NaNGuardHook(max_bad_steps=2)]).fit(token_batches(8), max_steps=8)


def test_latest_checkpoint_none_and_stale(tmp_path):
    assert latest_checkpoint(str(tmp_path)) is None
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_9\n")
    with pytest.raises(FileNotFoundError, match="step_9"):
        latest_checkpoint(str(tmp_path))


def _lr_curve(sched_cfg, total_steps=20, lr=1.0, skip_steps=()):
    from zerogpt.config import LRSchedulerConfig
    from zerogpt.optim.lr_scheduler import build_lr_scheduler
    engine = EngineDouble(lr=lr, skip_steps=skip_steps)
    sched = build_lr_scheduler(engine.optimizer, LRSchedulerConfig(**sched_cfg), total_steps)
    lrs = []

    class Keep(Hook):
        def after_step(self, t):
            lrs.append(t.state.metrics.lr)            # the rate the step used (a float on every step)

    Trainer(engine, hooks=[Keep()], lr_scheduler=sched).fit(token_batches(4), max_steps=total_steps)
    return lrs


def test_scheduler_shapes():
    warm = _lr_curve(dict(type="constant", warmup_steps=5))
    assert warm[:5] == pytest.approx([i / 6 for i in range(1, 6)])         # (s+1)/(warmup+1): never 0
    assert warm[5:] == pytest.approx([1.0] * 15)
    cos = _lr_curve(dict(type="cosine", warmup_steps=0, min_lr=0.1))
    assert cos[0] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(cos, cos[1:]))                       # monotone decay
    assert cos[10] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 10 / 20)), abs=0.05)
    assert cos[-1] == pytest.approx(0.1, abs=0.02)
    lin = _lr_curve(dict(type="linear", warmup_steps=0, min_lr=0.0))
    diffs = [a - b for a, b in zip(lin, lin[1:])]
    assert diffs == pytest.approx([diffs[0]] * len(diffs))                 # a straight line
    assert lin[-1] == pytest.approx(1.0 / 20, abs=0.051)


def test_scheduler_does_not_advance_on_skipped_steps():
    plain = _lr_curve(dict(type="linear", warmup_steps=0), total_steps=6)
    skipped = _lr_curve(dict(type="linear", warmup_steps=0), total_steps=6, skip_steps={2, 3})
    assert skipped[:4] == pytest.approx([plain[0], plain[1], plain[1], plain[1]])


def test_scheduler_state_travels_in_trainer_state_dict():
    from zerogpt.config import LRSchedulerConfig
    from zerogpt.optim.lr_scheduler import build_lr_scheduler
    engine = EngineDouble(lr=1.0)
    sched = build_lr_scheduler(engine.optimizer, LRSchedulerConfig(type="cosine"), 10)
    trainer = Trainer(engine, lr_scheduler=sched)
    trainer.fit(token_batches(4), max_steps=4)
    sd = json.loads(json.dumps(trainer.state_dict()))
    engine2 = EngineDouble(lr=1.0)
    sched2 = build_lr_scheduler(engine2.optimizer, LRSchedulerConfig(type="cosine"), 10)
    Trainer(engine2, lr_scheduler=sched2).load_state_dict(sd)
    assert sched2.get_last_lr() == pytest.approx(sched.get_last_lr())
    assert engine2.optimizer.param_groups[0]["lr"] == pytest.approx(engine.optimizer.param_groups[0]["lr"])
    assert engine2.optimizer.param_groups[0]["lr"] < 1.0                   # not the construction-time rate


class NaNAfter:
    """Criterion that turns non-finite from step `start` on (counted in optimizer steps, accumulation 1)."""

    def __init__(self, start):
        self.start, self.calls = start, 0

    def __call__(self, logits, labels):
        self.calls += 1
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        return loss * float("nan") if self.calls >= self.start else loss


def test_nan_guard_names_the_step():
    engine = EngineDouble()
    engine.criterion = NaNAfter(start=3)
    hooks = [LogMetricByStepHook(None, log_interval=1), NaNGuardHook(max_bad_steps=3)]
    with pytest.raises(FloatingPointError,
                       match=r"at step 5, non-finite for 3 consecutive logged steps \(steps 3..5\)"):
        Trainer(engine, hooks=hooks).fit(token_batches(8), max_steps=8)


def test_nan_guard_sees_log_steps_only():
    engine = EngineDouble()
    engine.criterion = NaNAfter(start=3)
    hooks = [LogMetricByStepHook(None, log_interval=2), NaNGuardHook(max_bad_steps=2)]
    with pytest.raises(FloatingPointError, match=r"at step 6, non-finite for 2 consecutive logged steps"):
        Trainer(engine, hooks=hooks).fit(token_batches(8), max_steps=8)


class StepLog(Hook):
    """Records each logged step's (step, loss is finite, skipped), as the NaN guard after it sees them."""

    def __init__(self):
        self.steps = []

    def logs_at(self, step, max_steps):
        return True

    def after_step(self, trainer):
        m = trainer.state.metrics
        self.steps.append((trainer.state.step, math.isfinite(m.loss), m.skipped))


def test_nan_guard_counts_fp16_skipped_steps_and_resets_on_finite():
    # Steps 3..8 have a NaN loss and are fp16-skipped: a lower loss scale never makes a forward loss finite, so the
    # guard stops at step 4, the second in a row, as without fp16 (it would skip to the run's end).
    engine = EngineDouble(skip_steps=set(range(3, 9)), loss_scale=1024.0)
    engine.criterion = NaNAfter(start=3)
    log = StepLog()
    with pytest.raises(FloatingPointError, match="at step 4"):
        Trainer(engine, hooks=[log, NaNGuardHook(max_bad_steps=2)]).fit(token_batches(8), max_steps=8)
    assert log.steps == [(1, True, False), (2, True, False), (3, False, True), (4, False, True)]

    class Flaky:
        calls = 0

        def __call__(self, logits, labels):
            Flaky.calls += 1
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
            return loss + float("nan") if Flaky.calls % 2 else loss   # NaN value, finite grads

    # Every other step is NaN: 4 bad steps in all, past max_bad_steps=2, but each finite one resets the count.
    engine = EngineDouble()
    engine.criterion = Flaky()
    log = StepLog()
    Trainer(engine, hooks=[log, NaNGuardHook(max_bad_steps=2)]).fit(token_batches(8), max_steps=8)
    assert log.steps == [(s, s % 2 == 0, False) for s in range(1, 9)]  # counted without resets: raised at step 3


def test_plot_written_at_checkpoint_and_end(tmp_path):
    out = str(tmp_path)
    sizes = []

    class AtCkpt(Hook):
        def on_checkpoint(self, trainer, path):
            sizes.append(os.path.getsize(os.path.join(out, "loss.png")))

    hooks = standard_hooks(out, log_interval=1, eval_interval=2, save_interval=3) + [AtCkpt()]
    Trainer(EngineDouble(), hooks=hooks).fit(token_batches(8), max_steps=5, eval_dataloader=token_batches(2))
    assert len(sizes) == 2 and all(s > 1000 for s in sizes)
    with open(tmp_path / "loss.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_tensorboard_and_progress_bar(tmp_path):
    hooks = [ThroughputHook(), TensorboardHook(str(tmp_path / "tb"), log_interval=1),
             ProgressBarHook(), EvalHook(2, eval_iters=1)]
    Trainer(EngineDouble(), hooks=hooks).fit(token_batches(4), max_steps=3, eval_dataloader=token_batches(2))
    files = os.listdir(tmp_path / "tb")
    assert any(f.startswith("events.out.tfevents") for f in files)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {"train/loss", "train/tokens_per_s", "valid/loss"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]


def test_eval_hook_at_start_gives_baseline(tmp_path):
    out = str(tmp_path)
    hooks = [LogMetricByStepHook(out, 1), EvalHook(None, eval_iters=1, at_start=True)]
    Trainer(EngineDouble(), hooks=hooks).fit(token_batches(4), max_steps=2, eval_dataloader=token_batches(2))
    valid = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "valid"]
    assert valid == [0, 2]


def test_seed_tutorial_hook_list_runs_as_written(tmp_path, caplog):
    # The hook list of Colossal-AI's GPT-2 ZeRO tutorial, unchanged (its commented-out hooks included).
    from zerogpt.config import LRSchedulerConfig
    from zerogpt.optim.lr_scheduler import build_lr_scheduler
    engine = EngineDouble(lr=1.0)
    lr_scheduler = build_lr_scheduler(engine.optimizer, LRSchedulerConfig(type="linear", warmup_steps=1), 6)
    logger = logging.getLogger("tutorial")
    hook_list = [
        LossHook(),
        LRSchedulerHook(lr_scheduler=lr_scheduler, by_epoch=False),
        LogMetricByEpochHook(logger),
        ThroughputHook(),
        LogMetricByStepHook(),
        TensorboardHook(log_dir=str(tmp_path / "tb_logs"), ranks=[0]),
        SaveCheckpointHook(checkpoint_dir=str(tmp_path / "ckpt")),
    ]
    with caplog.at_level(logging.INFO):
        state = Trainer(engine, hooks=hook_list).fit(token_batches(3), epochs=2)
    assert state.step == 6 and lr_scheduler.last_epoch == 6                  # stepped by the loop, per step
    epoch_lines = [r.getMessage() for r in caplog.records if r.name == "tutorial"]
    assert [line.split(" | ")[0] for line in epoch_lines] == ["epoch 1", "epoch 2"]
    assert all(" | loss " in line and "3 steps" in line for line in epoch_lines)
    assert any(r.getMessage().startswith("step 6/6 | loss ") for r in caplog.records)   # the last step's line
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb_logs"))
    assert os.path.isdir(tmp_path / "ckpt" / "step_6")
