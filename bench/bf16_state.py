"""bf16 Adam moments vs fp32 moments (issue 30 point 2): the same run twice through train_gpt.py, once with
`zero.offload_optimizer.state_dtype='bf16'`, and the validation losses side by side.

    python bench/bf16_state.py                      # the demo and the nanoGPT-Shakespeare-shaped recipe
    python bench/bf16_state.py --recipes demo --json out.json --plot out.png

Both recipes run 2 CPU ranks with the optimizer offloaded to the host (CPUAdam's fused host step; that is where
bf16 moments live) on the bundled sample corpus. "demo" is configs/demo_cpu.py. "nanogpt" is nanoGPT's
shakespeare_char recipe (6 layers x 6 heads x 384, block 256, dropout 0.2, lr 1e-3, beta2 0.99, weight decay 0.1,
warmup 100, cosine to 1e-4) with fewer steps and a smaller batch to fit 2 cores; the Shakespeare text itself
cannot be downloaded on this machine, so it reads the bundled corpus. The goal: the final validation losses
within 0.02.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFLOAD = ["--set", "zero.offload_optimizer.device=cpu", "--set", "optimizer.type=HybridAdam"]
RECIPES = {
    "demo": ["--config", "configs/demo_cpu.py"],
    "nanogpt": ["--config", "configs/demo_cpu.py", "--set", "model.n_layer=6", "--set", "model.n_head=6",
                "--set", "model.n_embd=384", "--set", "model.dropout=0.2", "--set", "SEQ_LEN=256",
                "--set", "model.max_position_embeddings=256", "--set", "BATCH_SIZE=4",
                "--set", "optimizer.lr=1e-3", "--set", "optimizer.betas=(0.9,0.99)",
                "--set", "lr_scheduler.warmup_steps=100", "--set", "lr_scheduler.min_lr=1e-4",
                "--set", "train.max_steps=400", "--set", "train.eval_interval=100", "--set", "train.eval_iters=16"],
}


def run(recipe: str, state_dtype: str, out_dir: str, steps: int | None) -> list[dict]:
    """Train once; returns the eval records of metrics.jsonl ({"step", "val_loss", ...})."""
    run_dir = os.path.join(out_dir, f"{recipe}_{state_dtype}")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "train_gpt.py", *RECIPES[recipe], *OFFLOAD,
            "--set", f"zero.offload_optimizer.state_dtype={state_dtype}", "--set", f"train.output_dir={run_dir}",
            "--set", "train.save_interval=100000"]
    if steps:  # a smoke run: warmup and evaluation scaled to it
        argv += ["--set", f"train.max_steps={steps}", "--set", f"lr_scheduler.warmup_steps={steps // 4}",
                 "--set", f"train.eval_interval={max(steps // 2, 1)}"]
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if r.get("split") == "valid"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--steps", type=int, help="override each recipe's train.max_steps (a smoke run)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write the validation curves here (png)")
    args = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes:
            curves = {dtype: run(recipe, dtype, tmp, args.steps) for dtype in ("fp32", "bf16")}
            final = {dtype: curve[-1]["loss"] for dtype, curve in curves.items()}
            results[recipe] = dict(curves=curves, final=final, gap=final["bf16"] - final["fp32"])
            print(f"{recipe}: final val loss fp32 moments {final['fp32']:.4f}, bf16 moments {final['bf16']:.4f}, "
                  f"gap {results[recipe]['gap']:+.4f} (goal |gap| <= 0.02)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.5), squeeze=False)
        for ax, (recipe, r) in zip(axes[0], results.items()):
            for dtype, curve in r["curves"].items():
                ax.plot([c["step"] for c in curve], [c["loss"] for c in curve], marker="o",
                        label=f"{dtype} moments")
            ax.set_title(recipe)
            ax.set_xlabel("step")
            ax.set_ylabel("validation loss")
            ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
