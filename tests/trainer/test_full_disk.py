"""A full disk during a checkpoint save (issue 31.3): one line from rank 0, nothing partial left, training goes on.

Rank 1's writer raises ENOSPC partway through its files of the step-4 save (a disk that fills up mid-save), on a
real 2-rank engine: the other rank must not hang or crash, `.step_4.tmp` must be gone, `latest` must still name
step_2, and the run must finish and save step_6.
"""
from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.trainer.engine_double import token_batches


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _train_with_a_full_disk(rank: int, world: int, out: str) -> dict:
    import zerogpt
    import zerogpt.checkpoint as checkpoint
    from model_zoo import GPTLMLoss, gpt2_tiny
    from zerogpt.context import DistContext
    from zerogpt.trainer import Hook, SaveCheckpointHook, Trainer

    torch.set_num_threads(1)
    write, calls = checkpoint._save_safetensors_atomic, []

    def filling_disk(tensors, path):
        calls.append(path)
        if rank == 1 and "step_4" in path and len(calls) > 3:   # a few files in: the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", path)
        write(tensors, path)

    checkpoint._save_safetensors_atomic = filling_disk
    logger = logging.getLogger(f"zerogpt.test.full_disk.{rank}")
    logger.addHandler(lines := Lines())
    logger.setLevel(logging.INFO)
    torch.manual_seed(0)
    cfg = zerogpt.Config(dict(zero=dict(stage=2), optimizer=dict(type="AdamW", lr=1e-3)))
    engine = zerogpt.initialize(gpt2_tiny(vocab_size=32, max_position_embeddings=8), dict(cfg.optimizer),
                                criterion=GPTLMLoss(shift=False), config=cfg,
                                ctx=DistContext(rank, world, torch.device("cpu"), logger=logger))
    seen = {}

    class After(Hook):
        def after_step(self, trainer):
            if trainer.state.step != 4:
                return
            root = os.path.join(out, "checkpoints")
            seen[trainer.state.step] = (open(os.path.join(root, "latest")).read().strip(), sorted(os.listdir(root)))

    hooks = [SaveCheckpointHook(out, save_interval=2, keep_last=5), After()]
    state = Trainer(engine, hooks=hooks).fit(token_batches(12), max_steps=6)
    engine.close()
    return dict(lines=lines.lines, seen=seen, step=state.step)


@pytest.mark.timeout(120)
def test_a_full_disk_during_a_save_is_one_line_and_training_goes_on(tmp_path):
    r0, r1 = run_distributed(_train_with_a_full_disk, 2, str(tmp_path), timeout=110)
    assert r0["step"] == r1["step"] == 6
    assert r0["seen"][4] == ("step_2", ["latest", "step_2"])        # nothing partial, latest untouched
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_2", "step_6"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_6"
    said = [line for line in r0["lines"] if "not saved" in line]
    assert len(said) == 1 and not [line for line in r1["lines"] if "not saved" in line]
    line = said[0]
    assert line.startswith(f"checkpoint step_4 not saved: no space left on device in {tmp_path}/checkpoints")
    assert "MiB free" in line and "it needs about" in line and "step_2 and latest are intact" in line
    assert line.endswith("training goes on and saves again at step 6") and "\n" not in line
