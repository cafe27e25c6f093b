"""Trainer: the training loop, the math of a step around the engine, and the hook events.

Owns the loop (batch -> forward -> engine.backward -> engine.step -> LR schedule), averaging the loss over
ranks, and timing throughput over each logging window. Hooks only observe (log, eval, checkpoint, plot) and
run in list order. Numbers reach the host only on log steps: a step that logs nothing makes no host sync
(fp16's overflow check, inside the engine, excepted). Resumable state: `Trainer.state_dict()` is the
`extra_state` a checkpoint carries (counters, data position, LR schedule, hook state).
"""
from __future__ import annotations

import logging
import math
import signal
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

from zerogpt.parallel.parallel_model import plain_loss
from zerogpt.trainer.engine_surface import TrainingEngine
from zerogpt.trainer.hooks.base import Hook
from zerogpt.trainer.hooks.lr import LRSchedulerHook
from zerogpt.trainer.interrupt import StopOnSignal
from zerogpt.trainer.json_safe import json_safe
from zerogpt.trainer.metrics import EpochMetrics, StepMetrics, host_float

EVENTS = ("before_train", "after_train", "before_epoch", "after_epoch", "before_step", "after_step",
          "before_eval", "after_eval", "on_checkpoint")


def epoch_steps(epochs: int, micro_batches_per_epoch: int, accumulation: int) -> int:
    """The optimizer steps `epochs` passes make (a step's window may span two epochs). ValueError when they make
    none: a run that would end before it starts (its LR schedule of 0 steps) is a mistake to say, not to run."""
    steps = epochs * micro_batches_per_epoch // accumulation
    if steps == 0 and epochs > 0:
        raise ValueError(f"{epochs} epoch(s) of {micro_batches_per_epoch} micro-batches make no optimizer step of "
                         f"{accumulation} (gradient accumulation); use more data, a smaller GRADIENT_ACCUMULATION "
                         f"or BATCH_SIZE, or train.max_steps")
    return steps


@dataclass
class TrainerState:
    """Counters and the latest numbers of a run; hooks read it instead of passing dicts around."""

    step: int = 0
    """optimizer steps done (an fp16 step skipped on overflow still counts: its data was consumed)"""
    epoch: int = 0
    """passes over the training data started before the current one"""
    micro_step: int = 0
    """forward/backward passes done (step * gradient_accumulation at step boundaries)"""
    consumed_samples: int = 0
    """samples consumed by all ranks together since the start of the run"""
    epoch_samples: int = 0
    """samples consumed by all ranks in the current epoch (where the sampler resumes)"""
    epoch_batches: int = 0
    """micro-batches this rank consumed in the current epoch (a run resumed at an epoch's end ends it first)"""
    tokens_seen: int = 0
    """input tokens consumed by all ranks together"""
    skipped_steps: int = 0
    """optimizer steps whose update was skipped (a non-finite gradient; fp16: an overflow), as of the last log
    step or checkpoint (counted on the device in between)"""
    max_steps: int | None = None
    """the step at which fit() stops (resolved from max_steps or epochs)"""
    metrics: StepMetrics | None = None
    """the last step's numbers (device tensors until `metrics.logged`: see zerogpt.trainer.metrics)"""
    epoch_metrics: EpochMetrics | None = None
    """the last finished epoch's numbers (set before after_epoch fires)"""
    eval_results: dict[str, float] = field(default_factory=dict)
    """the latest evaluation: {"step", "loss", "ppl"}"""
    should_stop: bool = False
    """a hook sets this to end fit() after the current step (early stopping)"""
    interrupted: str | None = None
    """the signal that ended fit() early ("SIGINT", "SIGTERM"; with stop_on_signal), else None"""

    _COUNTERS = ("step", "epoch", "micro_step", "consumed_samples", "epoch_samples", "epoch_batches", "tokens_seen",
                 "skipped_steps")
    _ADDED = ("skipped_steps", "epoch_batches")  # older checkpoints lack them: 0

    def state_dict(self) -> dict[str, int]:
        """The counters that resume a run (plain ints, JSON-safe)."""
        return {k: getattr(self, k) for k in self._COUNTERS}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for k in self._COUNTERS:
            setattr(self, k, int(state.get(k, 0) if k in self._ADDED else state[k]))


def split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), both (B, T), from a (B, T+1) token window, an (inputs, labels) pair or a dict.

    A packed window of T+1 tokens gives inputs = window[:, :-1] and labels = window[:, 1:], so labels
    are already shifted and the criterion compares position t with token t+1.
    """
    if isinstance(batch, dict):
        if "labels" in batch:
            return batch["input_ids"], batch["labels"]
        batch = batch["input_ids"]
    if isinstance(batch, (tuple, list)):
        if len(batch) != 2:
            raise TypeError(f"a batch tuple must be (inputs, labels); got {len(batch)} items")
        return batch[0], batch[1]
    if not isinstance(batch, torch.Tensor) or batch.dim() != 2:
        raise TypeError("a batch must be a (B, T+1) LongTensor, an (inputs, labels) pair or a dict with "
                        f"'input_ids'; got {type(batch).__name__}")
    return batch[:, :-1], batch[:, 1:]


def _batch_sampler(loader: Any) -> Any:
    """The object that decides the data order: the DataLoader's batch sampler or sampler (or None)."""
    for name in ("batch_sampler", "sampler"):
        s = getattr(loader, name, None)
        if s is not None and (hasattr(s, "set_epoch") or hasattr(s, "load_state_dict")):
            return s
    return None


def _iterate(loader: Iterable) -> Iterator[Any]:
    """iter(loader) without touching the global RNG.

    A DataLoader draws its workers' base seed from the global generator when its iterator is created. A
    resumed run creates its iterator at another point of that stream than the uninterrupted run did, so
    every later dropout mask would shift by one draw and resume would not be exact.
    """
    with torch.random.fork_rng(devices=[]):
        return iter(loader)


class Trainer:
    """Runs `engine` over a dataloader, steps the LR schedule and fires hook events; `trainer.state` is shared.

    Args:
        engine: what `zerogpt.initialize` returns, or anything with its training surface (TrainingEngine,
            zerogpt/trainer/engine_surface.py).
        hooks: Hook instances; every event calls them in list order.
        lr_scheduler: stepped once per applied optimizer step (an fp16 step skipped on overflow does not
            advance it, as in DeepSpeed); an `LRSchedulerHook(lr_scheduler=...)` in `hooks` passes it too.
        schedule_by_epoch: step the schedule once per epoch instead (Colossal-AI's `by_epoch=True`).
        logger: defaults to the engine's rank-aware logger.
        stop_on_signal: during fit(), SIGINT/SIGTERM stop every rank after the same step (`state.interrupted`;
            hooks' after_train runs: the checkpoint hook saves); a second signal raises KeyboardInterrupt.

    Example:
        trainer = Trainer(engine, hooks=[LogMetricByStepHook("runs/x", log_interval=10)], lr_scheduler=sched)
        trainer.fit(train_dl, max_steps=100, eval_dataloader=valid_dl)
    """

    def __init__(self, engine: TrainingEngine, hooks: Iterable[Hook] = (), lr_scheduler: Any = None,
                 schedule_by_epoch: bool = False, logger: logging.Logger | None = None, pipeline: Any = None,
                 stop_on_signal: bool = False):
        self.engine = engine
        self.pipeline = pipeline
        self.ctx = ctx = engine.ctx
        # The writer of files and logs is global rank 0; the loop's math runs over the data-parallel group
        # (with tensor/pipeline parallelism the T x P ranks of one model copy read the same batches).
        self.is_main: bool = ctx.is_main
        self.dp_size: int = ctx.dp_size
        self.world_size: int = ctx.world_size
        self.device = ctx.device
        self.group = ctx.dp_group
        self._model_loss = engine.model_computes_loss  # the model returns its own loss (no logits for criterion)
        self.logger = logger or ctx.logger
        self.hooks: list[Hook] = list(hooks)
        for h in self.hooks:
            if not isinstance(h, Hook):
                raise TypeError(f"hooks must be zerogpt.trainer.Hook instances; got {h!r} ({type(h).__name__})")
            if isinstance(h, LRSchedulerHook):   # the Colossal-AI form: the schedule is handed over in a hook
                if lr_scheduler is not None and lr_scheduler is not h.lr_scheduler:
                    raise ValueError("Trainer got two LR schedulers (lr_scheduler= and an LRSchedulerHook); "
                                     "pass one")
                lr_scheduler, schedule_by_epoch = h.lr_scheduler, h.by_epoch
        self.lr_scheduler = lr_scheduler
        self.schedule_by_epoch = schedule_by_epoch
        self.stop_on_signal = stop_on_signal
        # The ranks agree on a signal through a CPU all-reduce: the default group under gloo, else one of its own
        # (made here, where every rank is).
        multi = stop_on_signal and self.world_size > 1 and torch.distributed.is_initialized()
        self._signal_group = torch.distributed.new_group(backend="gloo") if multi and ctx.backend != "gloo" else None
        # one tensor for every step's vote, held here: a temporary's last reference could fall to gloo's worker,
        # which at interpreter exit cannot take the GIL to free it (zero/shm.py's barrier tensor says more)
        self._signum = torch.zeros(1, dtype=torch.int64)
        self.state = TrainerState()
        self.train_dataloader: Any = None
        self.eval_dataloader: Any = None
        self._pending_data_state: dict | None = None
        self._epoch_loss: torch.Tensor | None = None   # sum of this rank's step losses in the epoch (device)
        self._epoch_steps = 0
        self._epoch_before_resume = (0.0, 0)   # (sum of the steps' mean losses, steps) of the epoch before a resume
        self._skipped: torch.Tensor | None = None  # state.skipped_steps, counted on the device between reads
        self._window: dict[str, float] = {}      # where the current logging window started
        self._hook_s = 0.0                       # seconds spent in hooks since the window started
        self._fire_depth = 0

    # ---------------------------------------------------------------- the loop
    def fit(self, train_dataloader: Iterable, epochs: int | None = None, max_steps: int | None = None,
            eval_dataloader: Iterable | None = None) -> TrainerState:
        """Train until `max_steps` optimizer steps (or `epochs` passes over the data) are done, or a signal
        (`stop_on_signal`) ends the run early."""
        if not self.stop_on_signal:
            return self._fit(train_dataloader, epochs, max_steps, eval_dataloader, None)
        with StopOnSignal() as stop:
            return self._fit(train_dataloader, epochs, max_steps, eval_dataloader, stop)

    def _fit(self, train_dataloader: Iterable, epochs: int | None, max_steps: int | None,
             eval_dataloader: Iterable | None, stop: StopOnSignal | None) -> TrainerState:
        s, engine, pipeline = self.state, self.engine, self.pipeline
        accum = engine.gradient_accumulation
        self.train_dataloader, self.eval_dataloader = train_dataloader, eval_dataloader
        s.max_steps = self._resolve_max_steps(train_dataloader, epochs, max_steps, accum)
        self._restore_data_position(train_dataloader)
        batches = self._batches(train_dataloader, epochs)
        engine.train()
        self._skipped = torch.full((), float(s.skipped_steps), device=self.device)
        self.fire("before_train")
        self._start_window()
        while s.step < s.max_steps and not s.should_stop:
            if stop is not None and (signum := self._agreed_signal(stop)):   # a step boundary, on every rank
                s.interrupted = signal.Signals(signum).name
                break
            batch = next(batches, None)             # fetched first, so epoch events precede before_step
            if batch is None:
                break
            self.fire("before_step")
            # ------------------------------ TRAINING SECTION BEGIN ------------------------------
            # One optimizer step = `accum` micro-batches; engine.step() acts only on the last one.
            micro_losses = []
            pipeline_batches = []                                   # a pipeline runs them all in one schedule
            for micro in range(accum):
                if micro > 0 and (batch := next(batches, None)) is None:
                    break                                           # data exhausted mid-step: stop
                inputs, labels = (t.to(self.device, non_blocking=True) for t in split_batch(batch))
                if pipeline is None:
                    with engine.loss_context():                     # tensor parallelism's vocab-parallel loss
                        loss = self._loss(inputs, labels)           # scalar mean over B*T
                        engine.backward(loss)                       # scales by 1/accum (and fp16 scale)
                    grad_norm = engine.step()                       # a device tensor at the boundary, else None
                    micro_losses.append(loss.detach())
                else:
                    pipeline_batches.append((inputs, labels))
                s.micro_step += 1
                s.consumed_samples += inputs.shape[0] * self.dp_size
                s.epoch_samples += inputs.shape[0] * self.dp_size
                s.epoch_batches += 1
                s.tokens_seen += inputs.numel() * self.dp_size
            if len(micro_losses) + len(pipeline_batches) < accum:
                break
            if pipeline is not None:   # 1F1B over the stages; the mean loss is on the last stage (_share_loss)
                step_loss = pipeline.train_step(pipeline_batches)
                grad_norm = engine.step()
            else:
                step_loss = torch.stack(micro_losses).float().mean()    # this rank's mean, on the device
            engine.zero_grad()
            skipped = engine.last_step_skipped                      # a Python bool (fp16 reads it anyway)
            self._skipped += engine.last_step_found_inf             # bf16/fp32 skip on the device: count there
            lr = engine.lr                                          # the rate this step used
            if self.lr_scheduler is not None and not self.schedule_by_epoch and not skipped:
                self.lr_scheduler.step()
            # ------------------------------ TRAINING SECTION END --------------------------------
            s.step += 1
            self._add_to_epoch(step_loss)
            traffic = engine.last_step_traffic                      # host<->device bytes: Python ints
            s.metrics = StepMetrics(step=s.step, loss=step_loss, grad_norm=grad_norm, lr=lr, skipped=skipped,
                                    loss_scale=engine.loss_scale, skipped_steps=self._skipped,
                                    h2d_bytes=traffic.h2d_bytes, d2h_bytes=traffic.d2h_bytes,
                                    host_step_s=engine.last_host_step_s)
            if any(h.logs_at(s.step, s.max_steps) for h in self.hooks):
                self._read_metrics(s.metrics)                       # the one host sync of a log step
            self.fire("after_step")
        self._finish_epoch_if_complete(train_dataloader)
        self.fire("after_train")
        return s

    def _start_window(self) -> None:
        s = self.state
        self._window = {"t": time.perf_counter(), "step": s.step, "tokens": s.tokens_seen,
                        "samples": s.consumed_samples}
        self._hook_s = 0.0

    def _read_metrics(self, m: StepMetrics) -> None:
        """Bring a log step's numbers to the host: loss averaged over ranks, grad norm, window throughput."""
        loss = m.loss.detach().double().reshape(1)
        self._share_loss(loss)
        m.loss = loss.item() / self.dp_size
        m.grad_norm = host_float(m.grad_norm)
        m.skipped_steps = self.state.skipped_steps = int(host_float(m.skipped_steps))
        if self.device.type == "cuda":   # kernels are asynchronous: read the clock after the device is done
            torch.cuda.synchronize(self.device)
        s, w = self.state, self._window
        seconds = max(time.perf_counter() - w["t"] - self._hook_s, 1e-9)
        m.step_ms = seconds * 1e3 / max(1, s.step - w["step"])
        m.tokens_per_s = (s.tokens_seen - w["tokens"]) / seconds
        m.samples_per_s = (s.consumed_samples - w["samples"]) / seconds
        m.logged = True
        self._start_window()

    def _loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The micro-batch's mean loss: `engine.criterion` on the model's logits, or, when the model computes its
        loss from the labels itself (`engine.model_computes_loss`: the (B, T, vocab) logits never exist), that loss."""
        if self._model_loss:
            return plain_loss(self.engine(inputs, labels=labels).loss)
        out = self.engine(inputs)
        return self.engine.criterion(getattr(out, "logits", out), labels)

    def _add_to_epoch(self, step_loss: torch.Tensor) -> None:
        if self._epoch_loss is None:
            self._epoch_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._epoch_loss += step_loss.double()
        self._epoch_steps += 1

    def _batches(self, loader: Iterable, epochs: int | None) -> Iterator[Any]:
        """Micro-batches across epochs as one stream (an accumulation window may span two epochs). An epoch ends
        when the batch after its last is asked for, after the step that drew its last (and that step's
        checkpoint); a run resumed from that checkpoint ends it first, as the uninterrupted run did then."""
        while epochs is None or self.state.epoch < epochs:
            if not self._epoch_drawn(loader):
                sampler = _batch_sampler(loader)
                if sampler is not None and hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(self.state.epoch)
                self.fire("before_epoch")
                yield from _iterate(loader)
                if self.state.epoch_batches == 0:
                    raise ValueError(f"the training dataloader yielded no batches in epoch {self.state.epoch}; "
                                     "the dataset is smaller than one global batch (lower BATCH_SIZE or add data)")
            self._end_epoch()

    def _epoch_drawn(self, loader: Any) -> bool:
        """Whether this epoch's every batch was consumed: by the samples of all ranks where the sampler says where
        an epoch ends (data_pipeline's: at any global batch, a resume with another one too), else by this rank's
        batches (a sized loader; an iterable one ends when it is exhausted)."""
        ends_epoch = getattr(_batch_sampler(loader), "ends_epoch", None)
        if callable(ends_epoch):
            return bool(ends_epoch(self.state.epoch_samples))
        try:
            return 0 < len(loader) <= self.state.epoch_batches
        except TypeError:
            return False

    def _epoch_totals(self) -> tuple[float, int]:
        """(sum of the steps' losses, each the mean over the data-parallel ranks; steps) of the current epoch, the
        part before a resume included. Collective: every rank calls it."""
        total = torch.tensor([0.0, float(self._epoch_steps)], dtype=torch.float64, device=self.device)
        if self._epoch_loss is not None:
            total[0] += self._epoch_loss                    # (sum of step losses, steps) of this rank
        self._share_loss(total)
        loss_sum, steps = total.tolist()                    # one sync
        before_sum, before_steps = self._epoch_before_resume
        return loss_sum / self.dp_size + before_sum, self._epoch_steps + before_steps

    def _end_epoch(self) -> None:
        s = self.state
        loss_sum, steps = self._epoch_totals()
        s.epoch_metrics = EpochMetrics(s.epoch, loss_sum / steps if steps else None, steps)
        self._epoch_loss, self._epoch_steps, self._epoch_before_resume = None, 0, (0.0, 0)
        if self.lr_scheduler is not None and self.schedule_by_epoch:
            with warnings.catch_warnings():  # a run resumed at an epoch's end steps it before its first step, rightly
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
                self.lr_scheduler.step()
        self.fire("after_epoch")
        s.epoch += 1
        s.epoch_samples = s.epoch_batches = 0

    def _finish_epoch_if_complete(self, loader: Any) -> None:
        """max_steps landed exactly on the last batch of an epoch: close that epoch too."""
        if self._epoch_drawn(loader):
            self._end_epoch()

    def _resolve_max_steps(self, loader: Any, epochs: int | None, max_steps: int | None, accum: int) -> int:
        if max_steps is not None:
            return int(max_steps)
        if epochs is None:
            raise ValueError("Trainer.fit needs epochs or max_steps; set NUM_EPOCHS or train.max_steps "
                             "in the config (e.g. --set train.max_steps=1000)")
        try:
            batches_per_epoch = len(loader)
        except TypeError:
            raise ValueError("Trainer.fit(epochs=...) needs a dataloader with len(); pass max_steps "
                             "(train.max_steps) instead") from None
        return epoch_steps(epochs, batches_per_epoch, accum)

    # ---------------------------------------------------------------- eval
    @torch.no_grad()
    def evaluate(self, dataloader: Iterable | None = None, num_batches: int | None = None) -> dict[str, float]:
        """Mean loss over the first `num_batches` batches (all ranks), and its perplexity; fires before/after_eval.

        Every rank must run the same number of batches: ZeRO-3 gathers parameters collectively.
        """
        loader = dataloader if dataloader is not None else self.eval_dataloader
        if loader is None:
            raise ValueError("evaluate() needs an eval dataloader: pass eval_dataloader to fit() "
                             "(train_gpt.py builds it from the validation split, data.split)")
        self.fire("before_eval")
        # Rewind a resumable sampler, so every evaluation reads the same batches (a stateful sampler
        # would otherwise continue where the previous, truncated evaluation stopped).
        sampler = _batch_sampler(loader)
        if sampler is not None and hasattr(sampler, "load_state_dict"):
            sampler.load_state_dict({"consumed_samples": 0, "epoch": 0, "epoch_samples": 0})
        elif sampler is not None:
            sampler.set_epoch(0)
        self.engine.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)   # (sum of losses, batches)
        for i, batch in enumerate(_iterate(loader)):
            if num_batches is not None and i >= num_batches:
                break
            inputs, labels = (t.to(self.device, non_blocking=True) for t in split_batch(batch))
            if self.pipeline is not None:   # forward through the stages; the loss on the last one
                total[0] += self.pipeline.eval_loss(inputs, labels).double()
            else:
                with self.engine.loss_context():
                    total[0] += self._loss(inputs, labels).double()
            total[1] += 1
        self.engine.train()
        self._share_loss(total)
        loss = (total[0] / total[1].clamp(min=1)).item()
        self.state.eval_results = {"step": self.state.step, "loss": loss,
                                   "ppl": math.exp(loss) if loss < 700 else float("inf")}
        self.fire("after_eval")
        return self.state.eval_results

    # ---------------------------------------------------------------- hooks and resume
    def fire(self, event: str, **kwargs: Any) -> None:
        """Call `event` on every hook in list order; the time spent is left out of the throughput window."""
        if event not in EVENTS:
            raise ValueError(f"unknown trainer event {event!r}; events are {', '.join(EVENTS)}")
        t0, self._fire_depth = time.perf_counter(), self._fire_depth + 1
        try:
            for h in self.hooks:
                getattr(h, event)(self, **kwargs)
        finally:
            self._fire_depth -= 1
            if self._fire_depth == 0:   # an event fired inside a hook (eval's) is inside the outer one's time
                self._hook_s += time.perf_counter() - t0

    def state_dict(self) -> dict[str, Any]:
        """Everything besides the engine that a resumed run needs (JSON-safe): counters, the epoch's loss so far, LR
        schedule, hooks. Collective (the epoch's loss is summed over the ranks): every rank calls it, as
        `engine.save_checkpoint` is called."""
        hooks = {}
        for key, h in self._hook_keys():
            sd = h.state_dict()
            if sd:
                hooks[key] = sd
        schedule = json_safe(self.lr_scheduler.state_dict()) if self.lr_scheduler is not None else None
        if self._skipped is not None:   # a checkpoint is a sync anyway
            self.state.skipped_steps = int(host_float(self._skipped))
        loss_sum, steps = self._epoch_totals()
        return {"trainer": self.state.state_dict(), "hooks": hooks, "lr_scheduler": schedule,
                "epoch_loss": {"sum": loss_sum, "steps": steps},
                "data": {"epoch": self.state.epoch, "epoch_samples": self.state.epoch_samples,
                         "consumed_samples": self.state.consumed_samples, "world_size": self.dp_size}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved; the data position is applied to the sampler when fit() starts."""
        self.state.load_state_dict(state["trainer"])
        saved = state.get("hooks", {})
        for key, h in self._hook_keys():
            if key in saved:
                h.load_state_dict(saved[key])
        # Checkpoints written before the schedule moved into the loop kept it under the hook's name.
        schedule = state.get("lr_scheduler") or saved.get("LRSchedulerHook")
        if self.lr_scheduler is not None and schedule:
            self.lr_scheduler.load_state_dict(schedule)
            # The scheduler sets the optimizer's rates only when it steps: put the resumed rates in place now,
            # whether or not the engine's checkpoint restored the param groups. A schedule saved with its position
            # only (an import from Megatron-LM, zerogpt_tools/import_megatron.py) has no rates of its own yet: the
            # schedule's closed form at that position gives them (LambdaLR: base_lr x lambda(step)).
            sched = self.lr_scheduler
            if "_last_lr" in schedule:
                rates = sched.get_last_lr()
            else:
                rates = [base * lam(sched.last_epoch) for base, lam in zip(sched.base_lrs, sched.lr_lambdas)]
            for group, lr in zip(sched.optimizer.param_groups, rates):
                group["lr"] = lr
        self._pending_data_state = state.get("data")
        epoch_loss = state.get("epoch_loss") or {"sum": 0.0, "steps": 0}  # older checkpoints: the epoch from here
        self._epoch_before_resume = (float(epoch_loss["sum"]), int(epoch_loss["steps"]))

    def _hook_keys(self) -> list[tuple[str, Hook]]:
        """Stable names for hook state: the class name, with #i for repeated classes."""
        seen: dict[str, int] = {}
        out = []
        for h in self.hooks:
            name = type(h).__name__
            seen[name] = seen.get(name, 0) + 1
            out.append((name if seen[name] == 1 else f"{name}#{seen[name]}", h))
        return out

    def _restore_data_position(self, loader: Any) -> None:
        """Tell the sampler how many samples the resumed run consumed, so none is repeated or skipped.

        The sampler's load_state_dict gets {"consumed_samples" (global, all epochs), "epoch",
        "epoch_samples"} (data_pipeline.DistributedBatchSampler reads consumed_samples, which is
        world-size independent). These are the trainer's own counts, not the sampler's, because a
        DataLoader with workers draws batches ahead of training.
        """
        data, self._pending_data_state = self._pending_data_state, None
        if not data or not data.get("consumed_samples"):
            return
        sampler = _batch_sampler(loader)
        if sampler is None or not hasattr(sampler, "load_state_dict"):
            if data.get("epoch_samples") and not self._epoch_drawn(loader):
                self.logger.warning("resuming mid-epoch but the dataloader's sampler has no load_state_dict; "
                                    "the data order restarts at the beginning of epoch %d", data["epoch"])
            return
        sampler.load_state_dict({k: data[k] for k in ("consumed_samples", "epoch", "epoch_samples")})

    # ---------------------------------------------------------------- small collectives for hooks
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks (no-op on one process)."""
        if self.dp_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(tensor, group=self.group)
        return tensor

    def _share_loss(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place: a loss sum over the data-parallel ranks, on every rank (a pipeline's is its last stage's)."""
        self.all_reduce_sum(tensor)
        if self.pipeline is not None:
            self.pipeline.from_last_stage(tensor)
        return tensor

    def _agreed_signal(self, stop: StopOnSignal) -> int:
        """The signal any rank got (the largest number), the same on every rank; 0 when none did."""
        if self.world_size == 1 or not torch.distributed.is_initialized():
            return stop.signum
        self._signum.fill_(stop.signum)
        torch.distributed.all_reduce(self._signum, op=torch.distributed.ReduceOp.MAX, group=self._signal_group)
        return int(self._signum.item())   # a CPU tensor: no device sync

    def barrier(self) -> None:
        """Every rank of the run (the checkpoint hook's: files span the run, not one data-parallel group)."""
        if self.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()

