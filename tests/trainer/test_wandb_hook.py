"""WandbHook in offline mode (no network): the run's history holds the scalars TensorboardHook writes at the same
steps, with the same values, plus skipped steps; its config is the run's config; the run id travels in the
checkpoint, and a resumed run logs into the same W&B run from the step after the checkpoint."""
import importlib.util
import json
import os

import pytest

from tests.trainer.engine_double import EngineDouble, token_batches
from tests.trainer.wandb_records import offline_runs, scalars
from zerogpt.trainer import (EvalHook, MemoryHook, SaveCheckpointHook, TensorboardHook, ThroughputHook, Trainer,
                             WandbHook)
from zerogpt.trainer.hooks.wandb import check_installed, plain_config

pytest.importorskip("wandb")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def wandb_home(tmp_path, monkeypatch):
    """wandb's settings, cache and artifacts in tmp_path, never the user's home; no console capture."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)


def hooks(out, checkpoints=None):
    import torch

    config = {"optimizer": {"type": torch.optim.SGD, "lr": 0.01}, "train": {"max_steps": 6, "log_interval": 2}}
    return [ThroughputHook(flops_per_token=1e6), MemoryHook(2),
            TensorboardHook(os.path.join(out, "tb"), log_interval=2),
            WandbHook(out, log_interval=2, project="zerogpt-test", mode="offline", config=config),
            EvalHook(3, eval_iters=1), SaveCheckpointHook(checkpoint_dir=checkpoints or os.path.join(out, "checkpoints"),
                                                          save_interval=3)]


def tensorboard_scalars(log_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_offline_history_is_the_tensorboard_scalars_and_resume_continues_the_run(tmp_path):
    out = str(tmp_path / "run")
    engine = EngineDouble(skip_steps={2})  # step 2's update is skipped: counted in train/skipped_steps
    Trainer(engine, hooks=hooks(out)).fit(token_batches(8), max_steps=6, eval_dataloader=token_batches(2, seed=1))
    (run,) = offline_runs(out)
    assert run["project"] == "zerogpt-test" and run["name"] == "run"  # named after the output folder
    tb = tensorboard_scalars(os.path.join(out, "tb"))
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/tflops", "valid/loss",
            "mem/host_rss_mb"} <= set(tb)
    for tag, by_step in tb.items():  # every TensorBoard scalar, at the same steps, with the same value
        got = scalars(run, tag)
        assert sorted(got) == sorted(by_step), tag
        assert all(got[s] == pytest.approx(v, rel=1e-6) for s, v in by_step.items()), tag  # TB keeps float32
    assert sorted(scalars(run, "train/loss")) == [2, 4, 6] and sorted(scalars(run, "valid/loss")) == [3, 6]
    assert scalars(run, "train/skipped_steps") == {2: 1, 4: 1, 6: 1}
    assert run["config"]["optimizer"] == {"type": "torch.optim.sgd.SGD", "lr": 0.01}
    assert run["config"]["train"] == {"max_steps": 6, "log_interval": 2}

    # the run id is in every checkpoint; a run resumed from step 3 logs into the same W&B run
    with open(os.path.join(out, "checkpoints", "step_3", "extra_state.json")) as f:
        saved = json.load(f)
    assert saved["hooks"]["WandbHook"] == {"run_id": run["id"]}
    engine = EngineDouble(skip_steps={2})
    resumed = Trainer(engine, hooks=hooks(out, checkpoints=str(tmp_path / "resumed")))
    resumed.load_state_dict(engine.load_checkpoint(os.path.join(out, "checkpoints", "step_3")))
    resumed.fit(token_batches(8), max_steps=6, eval_dataloader=token_batches(2, seed=1))
    first, second = offline_runs(out)
    assert second["id"] == first["id"] == run["id"]
    assert sorted(scalars(second, "train/loss")) == [4, 6] and sorted(scalars(second, "valid/loss")) == [6]


def test_a_fresh_hook_starts_a_new_run_and_rank_1_logs_nothing(tmp_path):
    out = str(tmp_path / "run")
    for _ in range(2):
        Trainer(EngineDouble(), hooks=hooks(out)[3:4]).fit(token_batches(4), max_steps=2)
    assert len({r["id"] for r in offline_runs(out)}) == 2
    other = EngineDouble()
    other.ctx.global_rank = 1  # not the main rank: no W&B run, no state
    hook = WandbHook(str(tmp_path / "rank1"), mode="offline")
    Trainer(other, hooks=[hook]).fit(token_batches(4), max_steps=2)
    assert not os.path.exists(tmp_path / "rank1") and hook.state_dict() == {}


def test_missing_wandb_is_one_clear_error(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'zerogpt\[wandb\]'"):
        check_installed("offline")
    check_installed("disabled")  # a disabled run needs no wandb


def test_config_values_are_written_by_name():
    import torch

    tree = {"a": (1, 2.5, None), "cls": torch.optim.AdamW, "fn": plain_config, "obj": object.__new__(EngineDouble)}
    got = plain_config(tree)
    assert got["a"] == [1, 2.5, None] and got["cls"] == "torch.optim.adamw.AdamW"
    assert got["fn"] == "zerogpt.trainer.hooks.wandb.plain_config" and got["obj"].startswith("<tests.trainer")
    json.dumps(got)
