"""LogMetricByStepHook: one console line per `log_interval` steps and the same numbers in metrics.jsonl;
LogMetricByEpochHook: one console line per epoch.

metrics.jsonl (DESIGN §5) holds one JSON object per line, written by rank 0 only:
  train: {"split": "train", "step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "tflops",
          "loss_scale", "skipped", "skipped_steps", "h2d_bytes", "d2h_bytes", "host_step_s", "mem"}
  (h2d_bytes / d2h_bytes: the logged step's host<->device copies on rank 0; host_step_s: the seconds of the
  last finished optimizer step's chunk steps, the host step when offloaded; StepMetrics)
  valid: {"split": "valid", "step", "loss", "ppl"}
A number the run does not have (tflops without a FLOP count, loss_scale outside fp16) is null, and so is a
non-finite one (strict JSON has no NaN); the console line shows it as `nan` / `inf`.
"""
from __future__ import annotations

import json
import math
import os

from dataclasses import asdict

from zerogpt.trainer.hooks.base import Hook, every

TRAIN_KEYS = ("split", "step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "tflops",
              "loss_scale", "skipped", "skipped_steps", "h2d_bytes", "d2h_bytes", "host_step_s", "mem")
VALID_KEYS = ("split", "step", "loss", "ppl")


def _plain(v):
    """JSON numbers: NaN/inf -> null (strict JSON has neither)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


class LogMetricByStepHook(Hook):
    """Logs train metrics every `log_interval` steps (and the last) and every evaluation.

    Args:
        output_dir: metrics.jsonl is written here (rank 0); None logs to the console only.
        log_interval: steps between train lines.

    On a fresh run metrics.jsonl is started empty; on a resumed run the lines after the resumed step
    (written by the interrupted run after its last checkpoint) are dropped, so the file reads as one run.
    """

    def __init__(self, output_dir: str | None = None, log_interval: int = 10):
        self.path = os.path.join(output_dir, "metrics.jsonl") if output_dir is not None else None
        self.log_interval = log_interval
        self._started = False

    def logs_at(self, step: int, max_steps: int | None) -> bool:
        return every(step, self.log_interval, max_steps)

    def before_train(self, trainer) -> None:
        if not trainer.is_main or self.path is None:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        kept = []
        if trainer.state.step > 0 and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [ln for ln in f if ln.strip() and json.loads(ln)["step"] <= trainer.state.step]
        with open(self.path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(self.path + ".tmp", self.path)
        self._started = True

    def after_step(self, trainer) -> None:
        s = trainer.state
        if not trainer.is_main or not self.logs_at(s.step, s.max_steps):
            return
        m = asdict(s.metrics)
        rec = {"split": "train", "step": s.step, "epoch": s.epoch, **{k: m[k] for k in TRAIN_KEYS[3:]}}
        self._write({k: _plain(v) for k, v in rec.items()})
        trainer.logger.info(format_train_line(rec, s.max_steps, m["step_ms"]))   # nan stays nan on the console

    def after_eval(self, trainer) -> None:
        if not trainer.is_main:
            return
        r = trainer.state.eval_results
        self._write({"split": "valid", "step": r["step"], "loss": _plain(r["loss"]), "ppl": _plain(r["ppl"])})
        trainer.logger.info(f"valid step {r['step']} | loss {r['loss']:.4f} | ppl {r['ppl']:.2f}")

    def _write(self, rec: dict) -> None:
        # Open per line (a few per interval): the file is complete whenever PlotHook or a user reads it.
        if self._started and self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")


def format_train_line(rec: dict, max_steps: int | None, step_ms: float | None) -> str:
    """Fixed fields, same every time: step/N | loss | norm | lr | ms | tok/s | mem (STYLE §14)."""
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)
    parts = [f"step {rec['step']}/{max_steps}", f"loss {num(rec['loss'], '.4f')}",
             f"norm {num(rec['grad_norm'], '.3f')}", f"lr {num(rec['lr'], '.2e')}",
             f"{num(step_ms, '.0f')} ms", f"{num(rec['tokens_per_s'], ',.0f')} tok/s"]
    if rec.get("tflops") is not None:
        parts.append(f"{rec['tflops']:.3g} TFLOPS")
    if rec.get("skipped"):
        parts.append(f"SKIPPED (loss scale {rec.get('loss_scale')})")
    if rec.get("skipped_steps"):
        parts.append(f"{rec['skipped_steps']} skipped")
    if rec.get("h2d_bytes") or rec.get("d2h_bytes"):  # offload: what crossed the bus in this step
        parts.append(f"h2d {_size(rec.get('h2d_bytes'))} d2h {_size(rec.get('d2h_bytes'))}")
        if rec.get("host_step_s") is not None:
            parts.append(f"host step {rec['host_step_s'] * 1e3:.0f} ms")
    mem = rec.get("mem") or {}
    if mem:
        dev = mem.get("device_peak_mb")
        parts.append(("" if dev is None else f"dev {dev / 1024:.2f}G ") + f"host {mem['host_rss_mb'] / 1024:.2f}G")
    return " | ".join(parts)


def _size(nbytes: int | None) -> str:
    """Bytes as the mem field writes them: G (GiB) from 1 GiB up, else M (MiB)."""
    if nbytes is None:
        return "-"
    return f"{nbytes / 2**30:.2f}G" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f}M"


class LogMetricByEpochHook(Hook):
    """Logs the epoch's mean loss (over its steps and all ranks) every `interval` epochs, on rank 0.

    Args:
        logger: defaults to the trainer's logger.
        interval: epochs between lines.
    """

    def __init__(self, logger=None, interval: int = 1):
        self.logger = logger
        self.interval = interval

    def after_epoch(self, trainer) -> None:
        e = trainer.state.epoch_metrics
        if not trainer.is_main or e is None or (e.epoch + 1) % self.interval:
            return
        loss = "-" if e.loss is None else f"{e.loss:.4f}"
        (self.logger or trainer.logger).info(f"epoch {e.epoch + 1} | loss {loss} | {e.steps} steps")
