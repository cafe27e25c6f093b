"""zerogpt's GPU figures in slices that fit one lent machine: each run measures the next missing slice (issue 42).

    python bench/gpu_check.py --next --out DIR        # on the GPU: the next slice, then more while the 9 minutes
                                                      # allow, installs and builds included; writes
                                                      # DIR/gpu_<device>_<date>_<slice>.json as each ends
    python bench/gpu_check.py --slice offload --out DIR   # a named slice (several: a,b, one after another)
    python bench/gpu_check.py --status                # here: the goals table from bench/results/ and the next slice
    python bench/gpu_check.py --record FILE...        # here: copy device results into bench/results/ and rewrite
                                                      # bench/README.md's goals table
    python bench/gpu_check.py --slice verify,offload,largest,compute,llama1b,llama3b,auto --tiny --out /tmp/g  # CPU

Slices, in this order (bench/gpu_slices/): verify (pytest -m gpu, the shipped config through train_gpt.py, device
syncs per step at stages 0-3 with and without offload), offload (the shipped config's shape and 16k tokens per
step, zerogpt against DeepSpeed ZeRO-Offload), largest (Llama-3.1-8B's shape, everything offloaded, bf16 moments,
DeepSpeed at the same size), compute (MFU without offload at stages 0 and 3 on GPT-2 XL: eager, compile, FP8,
chunked loss; micro-batch 12 and max-autotune), llama1b and llama3b (Llama-3.2-1B at 2048 tokens, Llama-3.2-3B at
4096, at the largest micro-batch that fits: eager, compile, chunked loss, FP8 + compile at stages 0 and 3, and
transformers' LlamaForCausalLM beside them), auto (configs/gpt2_xl_auto.py, plan="auto", against the shipped
config through train_gpt.py at the same 65,536 tokens per step; issue 47). --next takes the first with no result
in bench/results/, else the one whose latest result is the oldest; when it ends, --next goes on to the next slice
whose expected seconds (its last recorded elapsed_s, gpu_slices.EXPECTED_S before it has one) fit in what is left
of the budget, and so on.
The budget (--budget-s, 540) counts from this process's start: the installs from .carry/ (which
bench/gpu_prepare.sh fills here) and the CPU Adam op builds are inside it, and with --next it is the whole run's,
every slice's included; with --slice each named slice has its own. Every measurement runs in a watched child
process that is killed at its share of the budget, and the result file is rewritten after each, so a run cut
short still leaves what it measured. Without CUDA every slice runs in tiny form (fp32, tiny models, no
DeepSpeed): its numbers say nothing about a GPU, and it is never recorded.
"""
from __future__ import annotations

import time

T0 = time.monotonic()  # the budget counts from here: imports, installs and builds are inside it

import os  # noqa: E402
import sys  # noqa: E402

# bench/ last on the path (after the standard library and the checkout), for gpu_measure and gpu_slices
_HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _HERE]
sys.path.insert(0, REPO)
sys.path.append(_HERE)

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import traceback  # noqa: E402

from gpu_slices import SLICES, record  # noqa: E402  (no torch: --status, --record and a bad flag stay fast)
from zerogpt.atomic_write import write_json_atomic  # noqa: E402

RESULTS = os.path.join(_HERE, "results")
README = os.path.join(_HERE, "README.md")
# what each slice needs on a bare machine: DeepSpeed (from the carried sdist), the CPU Adam ops
NEEDS = dict(verify=dict(deepspeed=False, ops=True), offload=dict(deepspeed=True, ops=True),
             largest=dict(deepspeed=True, ops=True), compute=dict(deepspeed=False, ops=False),
             llama1b=dict(deepspeed=False, ops=False), llama3b=dict(deepspeed=False, ops=False),
             auto=dict(deepspeed=False, ops=True))
TINY_VOCAB = 512
LLAMA3_VOCAB = 128256


class BudgetSpent(Exception):
    """The slice's whole budget ran out in the parent itself (every child has its own, shorter deadline)."""


class _Tee:
    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, s: str) -> None:
        for stream in self.streams:
            stream.write(s)
            stream.flush()

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def _on_alarm(signum, frame):
    raise BudgetSpent()


def run_slice(name: str, args, start: float, began: float | None = None) -> str:
    """Run one slice under the budget that counts from `start` (the slice's own start, or with --next the run's);
    `began`: when the slice itself began (default `start`), what its elapsed_s counts from. The result file's path
    (written however the slice ends)."""
    began = start if began is None else began
    from gpu_slices.runner import MARGIN_S, Budget, commit_info, environment, kill_children, log, setup

    env, commit = environment(), commit_info(args.commit)
    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(slice=name, device=env["device"], gpu=env["gpu"], date=now.strftime("%Y-%m-%d"),
                  measured_at=now.strftime("%Y-%m-%dT%H:%M:%SZ"), commit=commit.get("commit"),
                  dirty_files=commit.get("dirty_files"), commit_source=commit.get("source"), tiny=args.tiny,
                  budget_s=args.budget_s, began_at_s=began - start, complete=False, stopped_by=None, env=env,
                  setup=None, figures={}, skipped=[], errors=[])
    path = os.path.join(args.out, record.result_name(env["device"], result["date"], name))

    def save() -> None:
        result["elapsed_s"] = time.monotonic() - began
        write_json_atomic(path, result)  # never a half-written file, whenever the run is stopped

    budget = Budget(args.budget_s, start, min_start_s=3.0 if args.tiny else 20.0)
    log(f"\n== {name} ({'TINY, ' if args.tiny else ''}budget {args.budget_s:.0f} s from the start, "
        f"{budget.left():.0f} s left; commit {result['commit']} via {result['commit_source']})")
    save()
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(max(1, int(budget.left() + MARGIN_S / 2)))
    try:
        result["setup"] = setup(args, budget, **NEEDS[name])
        save()
        importlib.import_module(f"gpu_slices.{name}").run(args, budget, result, save)
        result["complete"] = not result["skipped"]
    except BudgetSpent:
        kill_children()
        result["stopped_by"] = "budget: the slice's time ran out"
        log(f"  {name}: stopped, its budget is spent")
    except Exception as e:  # a broken slice still leaves its result: what it measured and the error
        kill_children()
        result["stopped_by"] = f"error: {type(e).__name__}: {e}"[:500]
        log(f"  {name} FAILED:\n{traceback.format_exc()}")
    finally:
        signal.alarm(0)
        save()
    log(f"  figures: {json.dumps(result['figures'])}")
    log(f"  skipped: {result['skipped']}\n  errors: {result['errors']}\n  wrote {path} ({result['elapsed_s']:.0f} s)")
    return path


def run_next(args, order: list[str], expected: dict[str, float]) -> list[str]:
    """--next: slice_order's first, then (record.chain_next) each next slice whose expected seconds fit in what is
    left of the run's budget less the margin every slice keeps for its result, every one under that budget from
    T0; the result files' paths."""
    from gpu_slices.runner import MARGIN_S, log

    paths, done = [], set()
    name = order[0]
    while name is not None:
        paths.append(run_slice(name, args, T0, began=T0 if not done else time.monotonic()))
        done.add(name)
        left = args.budget_s - (time.monotonic() - T0) - MARGIN_S  # a slice's measurements end MARGIN_S early
        name, passed = record.chain_next(order, done, expected, left)
        for line in passed:
            log(f"--next: passed over {line}")
        log(f"--next: {len(done)} slice(s) done, {left:.0f} s of the budget left; "
            + (f"going on to {name} (expected {expected[name]:.0f} s)" if name else "stopping"))
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--next", action="store_true",
                      help="measure the next slice (no result yet, else the oldest), then more while the budget allows")
    what.add_argument("--slice", help=f"measure these slices, comma-separated, of {', '.join(SLICES)}")
    what.add_argument("--status", action="store_true", help="print the goals table and the next slice, measure nothing")
    what.add_argument("--record", nargs="+", metavar="FILE", help="copy device results into --results and rewrite "
                      "bench/README.md's goals table")
    what.add_argument("--update-readme", action="store_true", help="rewrite bench/README.md's goals table")
    p.add_argument("--out", help="directory for the result file, gpu_check.log and the slice's logs")
    p.add_argument("--results", default=RESULTS, help="the committed results --next and the table read "
                   "(bench/results)")
    p.add_argument("--readme", default=README, help="the README whose goals table --record rewrites")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="seconds from the process's start, installs and builds included: --next's whole run, "
                        "each --slice's own (540: a 10-minute device call with room to spare)")
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU (the default without CUDA)")
    p.add_argument("--commit", default=None, help="the commit measured (default: git, else .carry/COMMIT)")
    p.add_argument("--systems", default=None, help="zerogpt,deepspeed,torch (tiny: zerogpt,torch: DeepSpeed's CPU "
                   "Adam op would build inside a measurement)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per measurement (3; tiny: 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (2; tiny: 1)")
    p.add_argument("--seq", type=int, default=None,
                   help="tokens per sequence (1024; the Llama slices: 2048 and 4096; tiny: 64, every slice)")
    p.add_argument("--shipped-steps", type=int, default=None,
                   help="verify: timed steps of train_gpt.py after one untimed (3; tiny: 1)")
    p.add_argument("--largest-bytes-per-param", type=float, default=14.0,
                   help="largest: host bytes/param expected when choosing the depth (14: 12 of states with bf16 "
                        "moments, plus slack)")
    p.add_argument("--largest-max-layers", type=int, default=None, help="largest: deepest tried (32: the 8B; tiny: 2)")
    p.add_argument("--host-reserve-gib", type=float, default=None,
                   help="kill a measurement that leaves less host RAM free than this (8; tiny: 1)")
    args = p.parse_args(argv)

    if args.status or args.update_readme or args.record:
        if args.record:
            written = record.record(args.record, args.results)
            print(f"recorded in {args.results}: {', '.join(written)}")
        if args.record or args.update_readme:
            changed = record.update_readme(args.readme, args.results)
            print(f"{args.readme}: goals table {'rewritten' if changed else 'already current'}")
        print(record.goals_markdown(args.results))
        return 0
    if not args.out:
        p.error("--out DIR is required to measure (on the device: --out $OUT)")
    order = record.slice_order(args.results) if args.next else []
    names = order[:1] if args.next else [s.strip() for s in args.slice.split(",") if s.strip()]
    unknown = [s for s in names if s not in SLICES]
    if unknown:
        p.error(f"--slice: unknown slice(s) {unknown}; valid: {', '.join(SLICES)}")
    import torch

    from gpu_slices.runner import log

    args.tiny = args.tiny or not torch.cuda.is_available()
    tiny = args.tiny
    defaults = dict(steps=(1, 3), warmup=(1, 2), seq=(64, 1024), shipped_steps=(1, 3), largest_max_layers=(2, 32),
                    host_reserve_gib=(1.0, 8.0))
    for key, (small, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, small if tiny else full)
    args.vocab = TINY_VOCAB if tiny else 50257
    args.llama_vocab = TINY_VOCAB if tiny else LLAMA3_VOCAB
    args.systems = [s.strip() for s in (args.systems or ("zerogpt,torch" if tiny else "zerogpt,deepspeed,torch"))
                    .split(",") if s.strip()]
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "gpu_check.log"), "a")
    sys.stdout = _Tee(sys.__stdout__, log_file)
    log(f"gpu_check {time.strftime('%Y-%m-%d %H:%M:%S')}: slices {names}" + (" (--next)" if args.next else "")
        + f", systems {args.systems}" + (", TINY: no CUDA, numbers say nothing about a GPU" if tiny else ""))
    if args.next:
        paths = run_next(args, order, record.expected_seconds(args.results))
    else:
        paths = [run_slice(name, args, T0 if k == 0 else time.monotonic()) for k, name in enumerate(names)]
    log(f"files in {args.out}: {sorted(os.listdir(args.out))}")
    log("record them here with: python bench/gpu_check.py --record " + " ".join(os.path.basename(x) for x in paths))
    sys.stdout = sys.__stdout__
    log_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
