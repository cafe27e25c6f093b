"""Trainer loop: hook order and priorities, TrainerState counters, epochs, stopping, eval, state_dict."""
import math

import pytest
import torch

from tests.trainer.engine_double import EngineDouble, token_batches
from zerogpt.trainer import EVENTS, Hook, Trainer, TrainerState, split_batch


class Recorder(Hook):
    def __init__(self, name, log, priority=50):
        self.name, self.log, self.priority = name, log, priority

    def __getattribute__(self, attr):
        if attr in EVENTS:
            def record(trainer, **kwargs):
                self.log.append((self.name, attr, trainer.state.step))
            return record
        return object.__getattribute__(self, attr)


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


def test_hooks_run_by_priority_then_list_order():
    log = []
    hooks = [Recorder("late", log, 90), Recorder("first", log, 5), Recorder("mid1", log), Recorder("mid2", log)]
    trainer = Trainer(EngineDouble(), hooks=hooks)
    assert [h.name for h in trainer.hooks] == ["first", "mid1", "mid2", "late"]
    trainer.fit(token_batches(2), max_steps=2)
    after_step_1 = [n for n, e, s in log if e == "after_step" and s == 1]
    assert after_step_1 == ["first", "mid1", "mid2", "late"]


def test_state_counters_with_accumulation():
    engine = EngineDouble(accumulation=2)
    trainer = Trainer(engine)
    s = trainer.fit(token_batches(8, batch_size=4, seq_len=8), max_steps=3)
    assert (s.step, s.micro_step, s.epoch) == (3, 6, 0)
    assert s.consumed_samples == s.epoch_samples == 6 * 4
    assert s.tokens_seen == 6 * 4 * 8
    assert engine.global_step == 3
    assert math.isfinite(s.loss)
    assert set(s.metrics) >= {"grad_norm", "skipped", "loss_scale", "lr"}


def test_epochs_resolve_max_steps_and_stream_across_epochs():
    # 3 batches/epoch, accumulation 2: 2 epochs = 6 micro-batches = 3 optimizer steps, the second
    # step's window spanning the epoch boundary.
    log = []
    trainer = Trainer(EngineDouble(accumulation=2), hooks=[Recorder("r", log)])
    s = trainer.fit(token_batches(3), epochs=2)
    assert (s.max_steps, s.step, s.micro_step, s.epoch) == (3, 3, 6, 2)
    assert [e for e, _ in events_of(log, "r")].count("after_epoch") == 2


def test_loss_falls():
    trainer = Trainer(EngineDouble(lr=0.5))
    losses = []

    class Keep(Hook):
        def after_step(self, t):
            losses.append(t.state.loss)

    trainer.hooks.append(Keep())
    trainer.fit(token_batches(8), max_steps=40, epochs=None)
    assert losses[-1] < losses[0] * 0.7


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


def test_trainer_state_fields_are_typed():
    s = TrainerState()
    assert s.step == 0 and s.metrics == {} and s.eval_results == {}
    s.load_state_dict({"step": 5, "epoch": 1, "micro_step": 10, "consumed_samples": 40, "epoch_samples": 8,
                       "tokens_seen": 320})
    assert s.state_dict()["tokens_seen"] == 320


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
    engine, _, _, _ = zerogpt.initialize(gpt2_tiny(vocab_size=64, max_position_embeddings=16),
                                         dict(cfg.optimizer), criterion=GPTLMLoss(shift=False), config=cfg, ctx=ctx)
    windows = torch.stack(token_batches(12, batch_size=2, seq_len=16, vocab=64))  # (12, 2, 17)
    data = windows.reshape(-1, 17)                                               # 24 samples
    loader = torch.utils.data.DataLoader(data, batch_sampler=DistributedBatchSampler(data, 2, rank, world_size))
    log, losses = [], []

    class Keep(Hook):
        priority = 60

        def after_step(self, t):
            losses.append(t.state.metrics["loss"])

    from zerogpt.trainer import LossHook
    trainer = Trainer(engine, hooks=[Keep(), Recorder("r", log), LossHook()])
    s = trainer.fit(loader, epochs=2, eval_dataloader=loader)
    ev = trainer.evaluate(num_batches=2)
    return dict(events=[e for _, e, _ in log], state=s.state_dict(), losses=losses, eval=ev,
                global_step=engine.global_step)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [2, 3])
def test_real_engine_two_ranks_agree_on_state_and_loss(stage):
    from tests.dist_utils import run_distributed
    r0, r1 = run_distributed(_real_engine_run, 2, stage, timeout=100)
    # 24 samples / (2 per rank x 2 ranks) = 6 micro-batches per epoch; 2 epochs / accumulation 2 = 6 steps
    assert r0["state"] == r1["state"]
    assert r0["state"] == {"step": 6, "epoch": 2, "micro_step": 12, "consumed_samples": 48, "epoch_samples": 0,
                           "tokens_seen": 48 * 16}
    assert r0["global_step"] == 6
    assert r0["losses"] == r1["losses"] and r0["losses"][-1] < r0["losses"][0]
    assert r0["eval"] == r1["eval"]
    assert r0["events"][:3] == ["before_train", "before_epoch", "before_step"]
    assert r0["events"].count("after_epoch") == 2 and r0["events"][-3:] == ["after_train", "before_eval", "after_eval"]
