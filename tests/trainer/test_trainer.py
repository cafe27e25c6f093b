"""Trainer loop: hook order, TrainerState counters, the loop's math (loss, LR schedule), epochs, stopping, eval,
state_dict, and no host sync on steps that log nothing."""
import math
import os

import pytest
import torch

from tests.trainer.engine_double import EngineDouble, token_batches
from tests.trainer.host_sync import HostSyncCounter
from zerogpt.trainer import EVENTS, Hook, StepMetrics, Trainer, TrainerState, split_batch
from zerogpt.context import DistContext


class Recorder(Hook):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getattribute__(self, attr):
        if attr in EVENTS:
            def record(trainer, **kwargs):
                self.log.append((self.name, attr, trainer.state.step))
            return record
        return object.__getattribute__(self, attr)


class KeepLosses(Hook):
    """Reads every step's numbers (so every step is a log step)."""

    def __init__(self):
        self.losses, self.metrics = [], []

    def logs_at(self, step, max_steps):
        return True

    def after_step(self, trainer):
        self.metrics.append(trainer.state.metrics)
        self.losses.append(trainer.state.metrics.loss)


def events_of(log, name):
    return [(e, step) for n, e, step in log if n == name]


def test_hook_events_in_order_across_epochs():
    log = []
    trainer = Trainer(EngineDouble(), hooks=[Recorder("a", log)])
    trainer.fit(token_batches(3), epochs=2)
    epoch = [("before_epoch", 0)]
    for step in range(3):
        epoch += [("before_step", step), ("after_step", step + 1)]
    expected = ([("before_train", 0)] + epoch + [("after_epoch", 3)]
                + [(e, s + 3) for e, s in epoch] + [("after_epoch", 6), ("after_train", 6)])
    assert events_of(log, "a") == expected
    assert trainer.state.epoch == 2 and trainer.state.step == 6


def test_hooks_run_in_list_order():
    log = []
    hooks = [Recorder("late", log), Recorder("first", log), Recorder("mid", log)]
    trainer = Trainer(EngineDouble(), hooks=hooks)
    assert trainer.hooks == hooks
    trainer.fit(token_batches(2), max_steps=2)
    for event in ("before_train", "before_step", "after_step", "after_train"):
        assert [n for n, e, s in log if e == event][:3] == ["late", "first", "mid"], event


def test_state_counters_with_accumulation():
    engine = EngineDouble(accumulation=2, loss_scale=1024.0)
    keep = KeepLosses()
    trainer = Trainer(engine, hooks=[keep])
    s = trainer.fit(token_batches(8, batch_size=4, seq_len=8), max_steps=3)
    assert (s.step, s.micro_step, s.epoch) == (3, 6, 0)
    assert s.consumed_samples == s.epoch_samples == 6 * 4
    assert s.tokens_seen == 6 * 4 * 8
    assert engine.global_step == 3
    m = s.metrics
    assert isinstance(m, StepMetrics) and m.logged and m.step == 3
    assert math.isfinite(m.loss) and isinstance(m.grad_norm, float) and m.grad_norm > 0
    assert m.skipped is False and m.loss_scale == 1024.0 and m.lr == 1e-2
    assert m.step_ms > 0 and m.tokens_per_s > 0 and m.samples_per_s == pytest.approx(m.tokens_per_s / 8)


def test_epochs_resolve_max_steps_and_stream_across_epochs():
    # 3 batches/epoch, accumulation 2: 2 epochs = 6 micro-batches = 3 optimizer steps, the second
    # step's window spanning the epoch boundary.
    log = []
    trainer = Trainer(EngineDouble(accumulation=2), hooks=[Recorder("r", log)])
    s = trainer.fit(token_batches(3), epochs=2)
    assert (s.max_steps, s.step, s.micro_step, s.epoch) == (3, 3, 6, 2)
    assert [e for e, _ in events_of(log, "r")].count("after_epoch") == 2

    with pytest.raises(ValueError, match=r"1 epoch\(s\) of 3 micro-batches make no optimizer step of 4"):
        Trainer(EngineDouble(accumulation=4)).fit(token_batches(3), epochs=1)


def test_loss_falls():
    keep = KeepLosses()
    Trainer(EngineDouble(lr=0.5), hooks=[keep]).fit(token_batches(8), max_steps=40, epochs=None)
    assert keep.losses[-1] < keep.losses[0] * 0.7


def test_loss_is_the_mean_over_micro_batches():
    engine = EngineDouble(accumulation=2)
    seen = []
    criterion = engine.criterion
    engine.criterion = lambda logits, labels: seen.append(criterion(logits, labels).item()) or criterion(logits,
                                                                                                         labels)
    keep = KeepLosses()
    Trainer(engine, hooks=[keep]).fit(token_batches(4), max_steps=2)
    assert keep.losses == pytest.approx([(seen[0] + seen[1]) / 2, (seen[2] + seen[3]) / 2])


def test_lr_schedule_is_stepped_by_the_loop_and_not_on_skipped_steps():
    engine = EngineDouble(lr=1.0, skip_steps={2})
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 0.5 ** step)
    keep = KeepLosses()
    trainer = Trainer(engine, hooks=[keep], lr_scheduler=sched)
    trainer.fit(token_batches(8), max_steps=4)
    # the rate each step used: step 2 was skipped (fp16 overflow), so the schedule did not advance after it
    assert [m.lr for m in keep.metrics] == [1.0, 0.5, 0.5, 0.25]
    assert trainer.state_dict()["lr_scheduler"]["last_epoch"] == 3


def test_colossalai_lr_scheduler_hook_hands_the_schedule_to_the_loop():
    from zerogpt.trainer import LRSchedulerHook
    engine = EngineDouble(lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda epoch: 0.1 ** epoch)
    trainer = Trainer(engine, hooks=[LRSchedulerHook(lr_scheduler=sched, by_epoch=True)])
    assert trainer.lr_scheduler is sched and trainer.schedule_by_epoch
    trainer.fit(token_batches(3), epochs=2)
    assert sched.last_epoch == 2 and engine.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    with pytest.raises(ValueError, match="two LR schedulers"):
        Trainer(engine, hooks=[LRSchedulerHook(sched)], lr_scheduler=torch.optim.lr_scheduler.LambdaLR(
            engine.optimizer, lambda step: 1.0))


def test_epoch_metrics_average_the_epochs_step_losses():
    keep = KeepLosses()
    epochs = []

    class KeepEpochs(Hook):
        def after_epoch(self, trainer):
            epochs.append(trainer.state.epoch_metrics)

    Trainer(EngineDouble(lr=0.5), hooks=[keep, KeepEpochs()]).fit(token_batches(3), epochs=2)
    assert [(e.epoch, e.steps) for e in epochs] == [(0, 3), (1, 3)]
    assert epochs[0].loss == pytest.approx(sum(keep.losses[:3]) / 3)
    assert epochs[1].loss == pytest.approx(sum(keep.losses[3:]) / 3)


def test_should_stop_ends_fit_and_after_train_still_fires():
    log = []

    class StopAt2(Hook):
        def after_step(self, t):
            t.state.should_stop = t.state.step == 2

    trainer = Trainer(EngineDouble(), hooks=[StopAt2(), Recorder("r", log)])
    trainer.fit(token_batches(8), max_steps=10)
    assert trainer.state.step == 2 and events_of(log, "r")[-1] == ("after_train", 2)


def test_data_exhausted_before_max_steps_stops_cleanly():
    trainer = Trainer(EngineDouble())
    assert trainer.fit(token_batches(3), epochs=1, max_steps=10).step == 3


def test_evaluate_fires_events_and_records_results():
    log = []
    trainer = Trainer(EngineDouble(), hooks=[Recorder("r", log)])
    trainer.fit(token_batches(2), max_steps=2, eval_dataloader=token_batches(4, seed=1))
    r = trainer.evaluate(num_batches=3)
    assert r["step"] == 2 and r["ppl"] == pytest.approx(math.exp(r["loss"]))
    assert events_of(log, "r")[-2:] == [("before_eval", 2), ("after_eval", 2)]
    assert trainer.state.eval_results is r


def test_every_evaluation_reads_the_same_batches_of_a_stateful_sampler():
    from data_pipeline import DistributedBatchSampler
    data = torch.cat(token_batches(6, seed=3))                         # 24 windows
    loader = torch.utils.data.DataLoader(data, batch_sampler=DistributedBatchSampler(data, 4, 0, 1))
    trainer = Trainer(EngineDouble())
    first, second = trainer.evaluate(loader, num_batches=2), trainer.evaluate(loader, num_batches=2)
    assert first["loss"] == second["loss"]


def test_state_dict_round_trip_is_json_safe():
    import json
    trainer = Trainer(EngineDouble(accumulation=2))
    trainer.fit(token_batches(8), max_steps=3)
    sd = json.loads(json.dumps(trainer.state_dict()))
    other = Trainer(EngineDouble())
    other.load_state_dict(sd)
    assert other.state.state_dict() == trainer.state.state_dict()
    assert sd["data"] == {"epoch": 0, "epoch_samples": 24, "consumed_samples": 24, "world_size": 1}


class KeepRows(Hook):
    """Every step's (step, loss, lr) and every epoch's (epoch, mean loss, steps)."""

    def __init__(self):
        self.rows = []

    def logs_at(self, step, max_steps):
        return True

    def after_step(self, trainer):
        m = trainer.state.metrics
        self.rows.append(("step", trainer.state.step, m.loss, m.lr))

    def after_epoch(self, trainer):
        e = trainer.state.epoch_metrics
        self.rows.append(("epoch", e.epoch, e.loss, e.steps))


def _run_with_epochs(root, make_loader, resume_from=None):
    """Two epochs of 3 steps (6 micro-batches, accumulation 2), the rate halved each epoch, a checkpoint every step."""
    from zerogpt.trainer import LRSchedulerHook, SaveCheckpointHook

    torch.manual_seed(0)
    engine, keep = EngineDouble(lr=0.5, accumulation=2), KeepRows()
    schedule = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda epoch: 0.5 ** epoch)
    trainer = Trainer(engine, hooks=[keep, LRSchedulerHook(schedule, by_epoch=True),
                                     SaveCheckpointHook(str(root), save_interval=1, keep_last=0)])
    if resume_from is not None:
        trainer.load_state_dict(engine.load_checkpoint(os.path.join(root, "checkpoints", f"step_{resume_from}")))
    state = trainer.fit(make_loader(), epochs=2)
    return keep.rows, (state.epoch, schedule.last_epoch), [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("loader", ["sampler", "list"])
def test_a_run_resumed_at_a_step_ends_as_the_uninterrupted_one(tmp_path, loader):
    """From the step that drew an epoch's last batch (its checkpoint is saved before that epoch ends) or from one
    inside an epoch: the same epochs, rates, losses, epoch means and weights as the run never stopped. With
    data_pipeline's sampler (it resumes mid-epoch; an epoch counted in samples) and a plain list of batches
    (counted in batches; it cannot resume mid-epoch, so only an epoch's end is resumed from)."""
    import shutil

    from data_pipeline import DistributedBatchSampler

    data = torch.cat(token_batches(6, seed=3))  # 24 windows: 6 micro-batches of 4 an epoch
    make_loader = {"sampler": lambda: torch.utils.data.DataLoader(
                       data, batch_sampler=DistributedBatchSampler(data, 4, 0, 1, shuffle=True, seed=1)),
                   "list": lambda: list(data.split(4))}[loader]
    whole = _run_with_epochs(tmp_path / "whole", make_loader)
    assert whole[1] == (2, 2) and [r[:2] for r in whole[0] if r[0] == "epoch"] == [("epoch", 0), ("epoch", 1)]
    for step in (3, 1, 4) if loader == "sampler" else (3,):
        root = tmp_path / f"from{step}"
        shutil.copytree(tmp_path / "whole" / "checkpoints" / f"step_{step}", root / "checkpoints" / f"step_{step}")
        rows, ends, params = _run_with_epochs(root, make_loader, resume_from=step)
        after = whole[0][whole[0].index(next(r for r in whole[0] if r[:2] == ("step", step))) + 1:]
        assert rows == after, step
        assert ends == whole[1], step
        assert all(torch.equal(a, b) for a, b in zip(params, whole[2])), step


def test_trainer_state_fields_are_typed():
    s = TrainerState()
    assert s.step == 0 and s.metrics is None and s.epoch_metrics is None and s.eval_results == {}
    s.load_state_dict({"step": 5, "epoch": 1, "micro_step": 10, "consumed_samples": 40, "epoch_samples": 8,
                       "tokens_seen": 320})
    assert s.state_dict()["tokens_seen"] == 320
    assert s.skipped_steps == 0   # a checkpoint from before skipped_steps was counted


def test_split_batch_forms():
    w = torch.arange(10).view(2, 5)
    x, y = split_batch(w)
    assert torch.equal(x, w[:, :-1]) and torch.equal(y, w[:, 1:])
    assert split_batch({"input_ids": w})[0].shape == (2, 4)
    assert split_batch((w, w))[1] is w
    with pytest.raises(TypeError, match="batch must be"):
        split_batch(torch.arange(5))


def test_user_errors():
    with pytest.raises(TypeError, match="Hook instances"):
        Trainer(EngineDouble(), hooks=[lambda t: None])
    with pytest.raises(ValueError, match="NUM_EPOCHS or train.max_steps"):
        Trainer(EngineDouble()).fit(token_batches(2))
    with pytest.raises(ValueError, match="unknown trainer event"):
        Trainer(EngineDouble()).fire("after_stpe")


# ------------------------------------------------------------------ with the real engine, 2 gloo ranks
def _real_engine_run(rank, world_size, stage):
    import zerogpt
    from data_pipeline import DistributedBatchSampler
    from model_zoo import GPTLMLoss, gpt2_tiny
    from zerogpt.config import Config

    cfg = Config(dict(BATCH_SIZE=2, GRADIENT_ACCUMULATION=2, SEQ_LEN=16, zero=dict(stage=stage),
                      optimizer=dict(type="AdamW", lr=1e-2)))
    ctx = zerogpt.launch_from_torch(cfg)
    engine = zerogpt.initialize(gpt2_tiny(vocab_size=64, max_position_embeddings=16),
                                         dict(cfg.optimizer), criterion=GPTLMLoss(shift=False), config=cfg, ctx=ctx)
    windows = torch.stack(token_batches(12, batch_size=2, seq_len=16, vocab=64))  # (12, 2, 17)
    data = windows.reshape(-1, 17)                                               # 24 samples
    loader = torch.utils.data.DataLoader(data, batch_sampler=DistributedBatchSampler(data, 2, rank, world_size))
    log, keep = [], KeepLosses()
    trainer = Trainer(engine, hooks=[keep, Recorder("r", log)])
    s = trainer.fit(loader, epochs=2, eval_dataloader=loader)
    ev = trainer.evaluate(num_batches=2)
    return dict(events=[e for _, e, _ in log], state=s.state_dict(), losses=keep.losses, eval=ev,
                global_step=engine.global_step)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [2, 3])
def test_real_engine_two_ranks_agree_on_state_and_loss(stage):
    from tests.dist_utils import run_distributed
    r0, r1 = run_distributed(_real_engine_run, 2, stage, timeout=100)
    # 24 samples / (2 per rank x 2 ranks) = 6 micro-batches per epoch; 2 epochs / accumulation 2 = 6 steps
    assert r0["state"] == r1["state"]
    assert r0["state"] == {"step": 6, "epoch": 2, "micro_step": 12, "consumed_samples": 48, "epoch_samples": 0,
                           "epoch_batches": 0,
                           "tokens_seen": 48 * 16, "skipped_steps": 0}
    assert r0["global_step"] == 6
    assert r0["losses"] == r1["losses"] and r0["losses"][-1] < r0["losses"][0]
    assert r0["eval"] == r1["eval"]
    assert r0["events"][:3] == ["before_train", "before_epoch", "before_step"]
    assert r0["events"].count("after_epoch") == 2 and r0["events"][-3:] == ["after_train", "before_eval", "after_eval"]


# ------------------------------------------------------------------ no host sync between log steps
def _syncs_per_step(engine, monkeypatch, tmp_path, vocab=32, max_steps=12, log_interval=4):
    """Host reads made by zerogpt code during each step of a run with the built-in hooks, {step: [sites]}."""
    import zerogpt
    from tests.trainer import engine_double
    from zerogpt.trainer import (EvalHook, LogMetricByStepHook, LossHook, MemoryHook, NaNGuardHook,
                                 SaveCheckpointHook, TensorboardHook, ThroughputHook)

    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0 / (1 + step))
    per_step, seen = {}, [0]

    class StepEnd(Hook):                       # listed last: everything the step caused has happened
        def after_step(self, trainer):
            per_step[trainer.state.step] = counter.sites[seen[0]:]
            seen[0] = len(counter.sites)

    hooks = [LossHook(), ThroughputHook(flops_per_token=1e6), MemoryHook(log_interval),
             LogMetricByStepHook(str(tmp_path), log_interval), TensorboardHook(str(tmp_path / "tb"), log_interval),
             NaNGuardHook(), EvalHook(log_interval, eval_iters=1), SaveCheckpointHook(str(tmp_path)), StepEnd()]
    trainer = Trainer(engine, hooks=hooks, lr_scheduler=sched)
    counter = HostSyncCounter(monkeypatch, [os.path.dirname(zerogpt.__file__), engine_double.__file__])
    trainer.fit(token_batches(40, vocab=vocab), max_steps=max_steps,
                eval_dataloader=token_batches(2, seed=1, vocab=vocab))
    return per_step


def test_no_host_sync_on_steps_that_log_nothing(monkeypatch, tmp_path):
    per_step = _syncs_per_step(EngineDouble(), monkeypatch, tmp_path)
    assert sorted(per_step) == list(range(1, 13))
    assert {step: sites for step, sites in per_step.items() if step % 4 and sites} == {}
    for step in (4, 8, 12):             # a log step reads its numbers (so the counter does see reads)
        assert any("trainer.py" in site for site in per_step[step]), per_step[step]


@pytest.mark.parametrize("fused", [True, False])
def test_real_engine_no_host_sync_on_steps_that_log_nothing(fused, monkeypatch, tmp_path):
    """A fused AdamW (what initialize gives a GPU run's AdamW) skips a non-finite step on the device: a step that
    logs nothing reads nothing. A for-loop AdamW has the step's non-finite flag read on the host, once per step
    (issue 31.4; free on the CPU, the reason a GPU run gets the fused kernel)."""
    import zerogpt
    from model_zoo import GPTLMLoss, gpt2_tiny
    from zerogpt.config import Config

    cfg = Config(dict(BATCH_SIZE=4, SEQ_LEN=8, zero=dict(stage=2), optimizer=dict(type="AdamW", lr=1e-3, fused=fused),
                      clip_grad_norm=1.0))
    engine = zerogpt.initialize(gpt2_tiny(vocab_size=32, max_position_embeddings=8), dict(cfg.optimizer),
                                         criterion=GPTLMLoss(shift=False), config=cfg, ctx=DistContext.current())
    per_step = _syncs_per_step(engine, monkeypatch, tmp_path)
    quiet = {step: sites for step, sites in per_step.items() if step % 4}
    if fused:
        assert {step: sites for step, sites in quiet.items() if sites} == {}
    else:
        assert all(len(sites) == 1 and sites[0].startswith("item at sharded_optim.py") for sites in quiet.values()), \
            quiet


# ------------------------------------------------------------------ the model's own (chunked) loss
def _chunked_loss_run(stage: int, chunked: bool) -> dict:
    import zerogpt
    from model_zoo import GPTLMLoss, gpt2_tiny
    from tests.zero.reference import cpu_ctx

    def refuse(logits, labels):
        raise AssertionError("the criterion ran, with the model computing its own loss")

    torch.manual_seed(0)
    model = gpt2_tiny(vocab_size=64, max_position_embeddings=16, chunked_loss=chunked, loss_chunk_size=8)
    cfg = zerogpt.Config(dict(BATCH_SIZE=2, GRADIENT_ACCUMULATION=2, precision="fp32", zero=dict(stage=stage)))
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                criterion=refuse if chunked else GPTLMLoss(shift=False), config=cfg, ctx=cpu_ctx())
    data = [b for b in torch.stack(token_batches(8, batch_size=2, seq_len=16, vocab=64))]
    keep = KeepLosses()
    trainer = Trainer(engine, hooks=[keep])
    trainer.fit(data, max_steps=4)
    out = {"losses": keep.losses, "eval": trainer.evaluate(data[:2])["loss"]}
    engine.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 3])
def test_a_model_with_the_chunked_loss_trains_on_its_own_loss(stage):
    """GPTConfig.chunked_loss: the Trainer passes the labels to the model and takes its loss (no logits exist, the
    criterion is not called), in training and evaluation; the run is the plain-loss run to fp32 summation order."""
    plain, chunked = _chunked_loss_run(stage, False), _chunked_loss_run(stage, True)
    torch.testing.assert_close(chunked["losses"], plain["losses"], rtol=1e-5, atol=1e-6)
    assert chunked["eval"] == pytest.approx(plain["eval"], rel=1e-5)


def _tensor_parallel_model_loss(rank: int, world: int, chunked: bool) -> tuple[list, float]:
    from tests.parallel.test_pipeline import STEPS, Record, _trainer_data
    from tests.parallel.test_tp_pp import build

    engine, _ = build(2, 1, 1, n_layer=2, chunked_loss=chunked, loss_chunk_size=8)
    train_data, eval_data = _trainer_data(1)
    record = Record()
    trainer = Trainer(engine, hooks=[record])
    trainer.fit([b[0] for b in train_data], max_steps=STEPS)
    evaluation = trainer.evaluate([b[0] for b in eval_data])["loss"]
    engine.close()
    return record.losses, evaluation


@pytest.mark.timeout(120)
def test_under_tensor_parallelism_the_models_own_loss_is_made_local():
    """Under TP the model computes its loss on vocab-sharded logits (the plain path: the chunked one needs the whole
    vocabulary), a replicated DTensor; the Trainer takes its local value, and the run is the criterion's."""
    from tests.dist_utils import run_distributed

    plain = run_distributed(_tensor_parallel_model_loss, 2, False, timeout=100)
    own = run_distributed(_tensor_parallel_model_loss, 2, True, timeout=100)
    assert own == plain
