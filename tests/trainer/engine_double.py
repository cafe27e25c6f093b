"""A stand-in for zerogpt's engine with the same training surface (zerogpt/trainer/engine_surface.py's
TrainingEngine, checked by test_engine_surface.py), over plain PyTorch on one process.

Trainer and hook tests use it where the engine's sharding is not the subject (hook order, state,
metrics files); the end-to-end test in tests/test_train_gpt.py runs the real engine.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from types import SimpleNamespace

import torch
from torch import nn

from zerogpt.context import DistContext
from zerogpt.zero.offload import Traffic


class TinyLM(nn.Module):
    """Embedding -> linear head: enough to make the loss fall."""

    def __init__(self, vocab: int = 32, width: int = 16):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids):
        return self.head(self.wte(input_ids))       # (B, T, V)


def lm_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))


class EngineDouble:
    """forward / criterion / backward / step / zero_grad / save_checkpoint / load_checkpoint, one process."""

    def __init__(self, model=None, lr=1e-2, accumulation=1, skip_steps=(), loss_scale=None):
        self.module = model or TinyLM()
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=lr)
        self.criterion = lm_loss
        self.model_computes_loss = False           # TinyLM returns logits
        self.gradient_accumulation = accumulation
        self.ctx = DistContext(0, 1, torch.device("cpu"), logger=logging.getLogger("zerogpt.test"))
        self.loss_context = contextlib.nullcontext
        self.micro_step = 0
        self.global_step = 0
        self.skip_steps = set(skip_steps)      # optimizer steps reported as fp16-skipped
        self.last_step_skipped = False
        self.last_step_found_inf = torch.zeros(())
        self.last_step_traffic = Traffic()     # no offload: nothing crosses between host and device
        self.last_host_step_s = 0.0            # and no chunk steps
        self.loss_scale = loss_scale
        self.config = SimpleNamespace(clip_grad_norm=None, precision="fp32")   # what the NaN guard's advice reads
        self.saved: list[tuple[str, dict]] = []

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def is_accumulation_boundary(self) -> bool:
        return (self.micro_step + 1) % self.gradient_accumulation == 0

    def backward(self, loss):
        (loss / self.gradient_accumulation).backward()

    def step(self) -> torch.Tensor | None:
        boundary = self.is_accumulation_boundary
        self.micro_step += 1
        if not boundary:
            return None
        # A 0-dim device tensor, as the engine returns it: reading it is the trainer's choice (log steps only).
        grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad)
                                                          for p in self.module.parameters() if p.grad is not None]))
        self.last_step_skipped = (self.global_step + 1) in self.skip_steps
        self.last_step_found_inf = torch.tensor(float(self.last_step_skipped))
        if not self.last_step_skipped:
            self.optimizer.step()
        self.global_step += 1
        return grad_norm

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def train(self):
        self.module.train()

    def eval(self):
        self.module.eval()

    def memory_stats(self):
        n = sum(p.numel() * p.element_size() for p in self.module.parameters())
        return {"params": {"device": n, "host": 0, "disk": 0}, "grads": {"device": n, "host": 0, "disk": 0},
                "master": {"device": 0, "host": 0, "disk": 0}, "optimizer": {"device": 0, "host": 0, "disk": 0}}

    def save_checkpoint(self, path, extra_state=None):
        tmp = path + ".tmp"
        os.makedirs(tmp, exist_ok=True)
        torch.save({"model": self.module.state_dict(), "optim": self.optimizer.state_dict()},
                   os.path.join(tmp, "state.pt"))
        with open(os.path.join(tmp, "extra_state.json"), "w") as f:
            json.dump(extra_state or {}, f)     # extra_state must be JSON-safe, as the real engine needs
        os.replace(tmp, path)
        self.saved.append((path, extra_state))

    def load_checkpoint(self, path):
        sd = torch.load(os.path.join(path, "state.pt"))
        self.module.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optim"])
        with open(os.path.join(path, "extra_state.json")) as f:
            return json.load(f)


def token_batches(n_batches=8, batch_size=4, seq_len=8, vocab=32, seed=0):
    """(B, T+1) windows of a repeating pattern (learnable), as a list usable as a dataloader."""
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(vocab).repeat(4)
    out = []
    for _ in range(n_batches):
        starts = torch.randint(0, vocab, (batch_size,), generator=g)
        out.append(torch.stack([base[s:s + seq_len + 1] for s in starts]))
    return out
