"""PlotHook: loss.png, train and valid loss against step, redrawn at each checkpoint and at the end.

It plots metrics.jsonl (the run's machine-readable record), so a resumed run's plot shows the whole
run. matplotlib is used through its Agg canvas directly (no pyplot global state, no display needed).
"""
from __future__ import annotations

import json
import os

from zerogpt.trainer.hooks.base import Hook


def plot_losses(metrics_path: str, out_path: str, title: str = "") -> bool:
    """Draw train and valid loss from metrics.jsonl into `out_path` (written atomically).

    Returns False (and writes nothing) when the file has no loss yet.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curves: dict[str, tuple[list, list]] = {"train": ([], []), "valid": ([], [])}
    with open(metrics_path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("split") in curves and rec.get("loss") is not None:
                curves[rec["split"]][0].append(rec["step"])
                curves[rec["split"]][1].append(rec["loss"])
    if not curves["train"][0] and not curves["valid"][0]:
        return False
    fig = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(*curves["train"], label="train", color="tab:blue", linewidth=1.2)
    if curves["valid"][0]:
        ax.plot(*curves["valid"], label="valid", color="tab:orange", marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = f"{out_path}.tmp.{os.getpid()}.png"
    fig.savefig(tmp)
    os.replace(tmp, out_path)
    return True


class PlotHook(Hook):
    """Writes <output_dir>/loss.png from <output_dir>/metrics.jsonl (rank 0); needs LogMetricByStepHook."""


    def __init__(self, output_dir: str, title: str = ""):
        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        self.out_path = os.path.join(output_dir, "loss.png")
        self.title = title or os.path.basename(os.path.normpath(output_dir))

    def _draw(self, trainer) -> None:
        if trainer.is_main and os.path.exists(self.metrics_path):
            plot_losses(self.metrics_path, self.out_path, self.title)

    def on_checkpoint(self, trainer, path: str) -> None:
        self._draw(trainer)

    def after_train(self, trainer) -> None:
        self._draw(trainer)
