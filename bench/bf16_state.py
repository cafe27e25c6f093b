"""bf16 Adam moments vs fp32 moments (issue 30 point 2): the same run twice through train_gpt.py, once with
`zero.offload_optimizer.state_dtype='bf16'`, and the validation losses side by side.

    python bench/bf16_state.py                      # the demo and the nanoGPT-Shakespeare-shaped recipe
    python bench/bf16_state.py --recipes demo --seeds 1337 1 2 3 4 5 6 --control 1e-5 --jobs 3 \
        --json out.json --plot out.png

Both recipes run 2 CPU ranks with the optimizer offloaded to the host (CPUAdam's fused host step; that is where
bf16 moments live) on the bundled sample corpus. "demo" is configs/demo_cpu.py. "nanogpt" is nanoGPT's
shakespeare_char recipe (6 layers x 6 heads x 384, block 256, dropout 0.2, lr 1e-3, beta2 0.99, weight decay 0.1,
warmup 100, cosine to 1e-4) with fewer steps and a smaller batch to fit 2 cores; the Shakespeare text itself
cannot be downloaded on this machine, so it reads the bundled corpus. The goal: the final validation losses
within 0.02, for each seed.

--seeds repeats the pair for several `train.seed`s (init and data order). --control R adds a third run per seed:
fp32 moments with the learning rate times (1 + R). Nothing in it is rounded differently, so its gap to the fp32
run is how far the recipe's final loss moves for a deterministic change of relative size R: where that already
exceeds 0.02, the recipe cannot tell a state format within 0.02 from one that is not. --jobs runs that many
trainings at once (each is 2 ranks; the runs are deterministic, so only the wall time changes).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from zerogpt.atomic_write import write_json_atomic  # noqa: E402

OFFLOAD = ["--set", "zero.offload_optimizer.device=cpu", "--set", "optimizer.type=HybridAdam"]
GOAL = 0.02  # |final valid loss, bf16 moments - fp32 moments|, per seed
# recipe -> (its learning rate, for the control; train_gpt.py arguments)
RECIPES = {
    "demo": (3e-3, ["--config", "configs/demo_cpu.py"]),
    "nanogpt": (1e-3, ["--config", "configs/demo_cpu.py", "--set", "model.n_layer=6", "--set", "model.n_head=6",
                       "--set", "model.n_embd=384", "--set", "model.dropout=0.2", "--set", "SEQ_LEN=256",
                       "--set", "model.max_position_embeddings=256", "--set", "BATCH_SIZE=4",
                       "--set", "optimizer.lr=1e-3", "--set", "optimizer.betas=(0.9,0.99)",
                       "--set", "lr_scheduler.warmup_steps=100", "--set", "lr_scheduler.min_lr=1e-4",
                       "--set", "train.max_steps=400", "--set", "train.eval_interval=100",
                       "--set", "train.eval_iters=16"]),
}


def run(recipe: str, label: str, seed: int, extra: list[str], out_dir: str, steps: int | None) -> list[dict]:
    """Train once; returns the eval records of metrics.jsonl ({"step", "loss", ...})."""
    run_dir = os.path.join(out_dir, f"{recipe}_{label}_seed{seed}")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "train_gpt.py", *RECIPES[recipe][1], *OFFLOAD, *extra, "--set", f"train.seed={seed}",
            "--set", f"train.output_dir={run_dir}", "--set", "train.save_interval=100000"]
    if steps:  # a smoke run: warmup and evaluation scaled to it
        argv += ["--set", f"train.max_steps={steps}", "--set", f"lr_scheduler.warmup_steps={steps // 4}",
                 "--set", f"train.eval_interval={max(steps // 2, 1)}"]
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [dict(step=r["step"], loss=r["loss"]) for r in records if r.get("split") == "valid"]


def variants(recipe: str, control: float | None) -> dict[str, list[str]]:
    """label -> the train_gpt.py arguments that make it."""
    out = {dtype: ["--set", f"zero.offload_optimizer.state_dtype={dtype}"] for dtype in ("fp32", "bf16")}
    if control:
        lr = RECIPES[recipe][0] * (1 + control)
        out["control"] = out["fp32"] + ["--set", f"optimizer.lr={lr!r}"]
    return out


def summarize(gaps: list[float]) -> dict:
    n = len(gaps)
    return dict(mean=sum(gaps) / n, rms=(sum(g * g for g in gaps) / n) ** 0.5, max_abs=max(map(abs, gaps)),
                within_goal=sum(abs(g) <= GOAL for g in gaps), seeds=n)


def commit() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(recipe, "curves") for recipe in results] + \
             [(recipe, "gaps") for recipe, r in results.items() if len(r["seeds"]) > 1]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, (recipe, kind) in zip(axes[0], panels):
        r = results[recipe]
        if kind == "curves":  # the first seed's validation curves
            seed, s = next(iter(r["seeds"].items()))
            for label, curve in s["curves"].items():
                name = {"fp32": "fp32 moments", "bf16": "bf16 moments"}.get(label) or \
                    "fp32, lr x (1 + %g)" % r["control"]
                ax.plot([c["step"] for c in curve], [c["loss"] for c in curve], marker="o", label=name)
            ax.set_title(f"{recipe}, seed {seed}")
            ax.set_xlabel("step")
            ax.set_ylabel("validation loss")
        else:  # each seed's final gap to its fp32 run
            seeds = list(r["seeds"])
            xs = range(len(seeds))
            ax.axhspan(-GOAL, GOAL, color="0.9", label=f"goal: within {GOAL}")
            ax.scatter(xs, [r["seeds"][s]["gap"] for s in seeds], label="bf16 moments - fp32")
            if r["control"]:
                ax.scatter(xs, [r["seeds"][s]["control_gap"] for s in seeds], marker="x",
                           label="fp32 lr x (1 + %g) - fp32" % r["control"])
            ax.axhline(0, color="0.5", lw=0.5)
            ax.set_xticks(list(xs), [str(s) for s in seeds])
            ax.set_title(f"{recipe}: final validation loss gap per seed")
            ax.set_xlabel("train.seed")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--seeds", nargs="+", type=int, default=[1337], help="train.seed values (1337: the configs')")
    p.add_argument("--control", type=float, help="add an fp32 run with the learning rate times (1 + CONTROL)")
    p.add_argument("--jobs", type=int, default=1, help="trainings at once (each takes 2 ranks)")
    p.add_argument("--steps", type=int, help="override each recipe's train.max_steps (a smoke run)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write the validation curves (and per-seed gaps) here (png)")
    args = p.parse_args(argv)
    todo = [(recipe, seed, label, extra) for recipe in args.recipes for seed in args.seeds
            for label, extra in variants(recipe, args.control).items()]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run, recipe, label, seed, extra, tmp, args.steps) for recipe, seed, label, extra in todo]
        curves = {key[:3]: f.result() for key, f in zip(todo, futures)}
    results = {}
    for recipe in args.recipes:
        r = results[recipe] = dict(control=args.control, seeds={})
        for seed in args.seeds:
            mine = {label: c for (rec, s, label), c in curves.items() if (rec, s) == (recipe, seed)}
            final = {label: c[-1]["loss"] for label, c in mine.items()}
            s = r["seeds"][seed] = dict(curves=mine, final=final, gap=final["bf16"] - final["fp32"])
            line = (f"{recipe} seed {seed}: final val loss fp32 moments {final['fp32']:.4f}, bf16 moments "
                    f"{final['bf16']:.4f}, gap {s['gap']:+.4f}")
            if args.control:
                s["control_gap"] = final["control"] - final["fp32"]
                line += f"; fp32 at lr x (1 + {args.control:g}) {final['control']:.4f}, gap {s['control_gap']:+.4f}"
            print(line + f" (goal |gap| <= {GOAL})")
        r["bf16_gaps"] = summarize([s["gap"] for s in r["seeds"].values()])
        if args.control:
            r["control_gaps"] = summarize([s["control_gap"] for s in r["seeds"].values()])
        if len(args.seeds) > 1:
            for key, name in (("bf16_gaps", "bf16 moments"), ("control_gaps", "control")):
                if key in r:
                    g = r[key]
                    print(f"{recipe} {name} over {g['seeds']} seeds: within {GOAL} at {g['within_goal']}; "
                          f"mean gap {g['mean']:+.4f} (a mean over seeds, not the per-seed goal), rms {g['rms']:.4f}, "
                          f"largest {g['max_abs']:.4f}")
    if args.json:
        meta = dict(commit=commit(), date=datetime.date.today().isoformat(), argv=sys.argv[1:])
        write_json_atomic(args.json, dict(meta=meta, results=results))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
