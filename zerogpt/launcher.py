"""`zerogpt run`: torchrun with a quiet console, as `deepspeed`, `colossalai run` and `accelerate launch` wrap it.

`zerogpt run [torchrun's flags] train_gpt.py --config C ...` parses torchrun's own command line
(torch.distributed.run's parser: --nproc-per-node, --nnodes, --node-rank, --rdzv-*, --master-*, ...) and runs
its elastic agent in this process. Around it, it
  - sets OMP_NUM_THREADS where torchrun would set 1 and print a 4-line banner about it: the cores this process
    may run on divided by the workers on this node, zerogpt's own rule for CPU threads (launch.cpu_threads);
  - keeps torchrun's agent, launcher and elastic logs off the console (LOGLEVEL=INFO, torchrun's own switch,
    shows them again);
  - on a worker's failure prints nothing more when the worker's own stderr reached the console (zerogpt's
    one-line `error:`, or a crash's traceback), one line when it could not (a signal, a redirected log), and
    exits with the exit code of the rank that failed first (torchrun's root cause; a signal N as 128 + N);
  - on Ctrl-C / SIGTERM lets torchrun forward the signal and wait for the workers (each stops at a step
    boundary and the run says "checkpoint ... kept"), then exits 128 + N with no traceback of its own.
What torchrun's `@record` does for a parent with an error file (TORCHELASTIC_ERROR_FILE: a scheduler's agent
above this one), this does too: the root cause's error file is copied into it.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Sequence

__all__ = ["main", "run", "build_ops", "root_cause", "threads_per_worker", "TorchLogFilter"]

USAGE = """usage: zerogpt <command> ...

commands:
  run        launch a script on N workers per node: torchrun's flags, a quiet console, the worker's exit code
             zerogpt run --nproc-per-node 2 train_gpt.py --config configs/demo_cpu.py
  build-ops  build the CPU Adam ops (zerogpt's host Adam, DeepSpeed's cpu_adam) into torch's extension cache
             now, so that no run waits on them (make install runs it)
"""

# torchrun's own bookkeeping, logged by the launching process: the agent's start, its signal and shutdown notes,
# each worker's failure and torchrun's ChildFailedError summary. The workers' own output is not touched.
TORCHRUN_LOGGERS = ("torch.distributed.run", "torch.distributed.launcher", "torch.distributed.elastic")


class TorchLogFilter(logging.Filter):
    """Drops the records of torchrun's agent and launcher (TORCHRUN_LOGGERS), lets every other record through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith(TORCHRUN_LOGGERS)


def threads_per_worker(workers: int) -> int:
    """CPU threads for each of `workers` processes on this node: the cores this process may run on, shared."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(workers, 1))


def _quiet_torchrun() -> None:
    """Filter torchrun's records out of the handlers torch installs ("torch", "torch.distributed")."""
    for name in ("torch", "torch.distributed"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(TorchLogFilter())


def _shows_stderr(args, local_rank: int) -> bool:
    """Whether torchrun let this local rank's stderr reach the console (not redirected to a file only, not
    left out by --local-ranks-filter)."""
    from torch.distributed.elastic.multiprocessing import Std

    def to_err(flag: str) -> bool:
        std = Std.from_str(flag)
        std = std.get(local_rank, Std.NONE) if isinstance(std, dict) else std
        return std in (Std.ERR, Std.ALL)

    shown = not args.local_ranks_filter or str(local_rank) in args.local_ranks_filter.split(",")
    return shown and (to_err(args.tee) or not to_err(args.redirects))


def _failure_line(rank: int, failure, args) -> str | None:
    """The one line the launcher adds for a failed worker, or None when the worker's own output said it all."""
    if failure.exitcode < 0:
        return (f"error: rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}; "
                f"the other ranks were stopped")
    if _shows_stderr(args, failure.local_rank):
        return None
    where = f"; its output is under {args.log_dir}" if args.log_dir else ""
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
    if not os.path.isfile(failure.error_file) or not str(message).strip():  # torchrun's stand-in is a docs link
        return f"error: rank {rank} exited with code {failure.exitcode}{where}"
    return f"error: rank {rank}: {str(message).strip().splitlines()[0]}{where}"


def root_cause(failures: dict) -> tuple[int, object]:
    """The rank that failed first, as torchrun's ChildFailedError.get_first_failure picks it (the earliest
    timestamp: an error file's, else when the agent saw the exit), less the ranks the agent itself stopped with
    SIGTERM once another had failed: without error files all stamps fall in one second, and torchrun's pick
    is then the lowest rank, often one it stopped."""
    failed = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    rank = min(failed, key=lambda r: (failed[r].timestamp, r))
    return rank, failed[rank]


def _exit_code(code: int) -> int:
    """A worker's exit code as a process's: a signal N (negative in torchrun's report) as 128 + N."""
    return 128 - code if code < 0 else code


def run(argv: Sequence[str]) -> int:
    """`zerogpt run ARGS`: torchrun's ARGS, launched quietly; the exit code of the worker that failed first."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, get_error_handler

    parser = torchrun.get_args_parser()
    parser.prog = "zerogpt run"
    parser.description = ("Launch a training script on N workers per node: torchrun's flags, zerogpt's console "
                          "(see zerogpt/launcher.py)")
    args = parser.parse_args(list(argv))
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets 1 and prints a banner; zerogpt's rule, quietly
        workers = torchrun.determine_local_world_size(args.nproc_per_node)
        if workers > 1:
            os.environ["OMP_NUM_THREADS"] = str(threads_per_worker(workers))
    if "LOGLEVEL" not in os.environ:  # torchrun's switch for its own logs: set, they all show as torchrun's do
        _quiet_torchrun()
    error_handler = get_error_handler()  # what @record does in torchrun's main, less its re-raise
    error_handler.initialize()
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        rank, failure = root_cause(e.failures)
        if os.environ.get("TORCHELASTIC_ERROR_FILE") and os.path.isfile(failure.error_file):
            error_handler.dump_error_file(failure.error_file, failure.exitcode)  # to a scheduler's agent above
        line = _failure_line(rank, failure, args)
        if line:
            print(line, file=sys.stderr, flush=True)
        return _exit_code(failure.exitcode) or 1
    except SignalException as e:  # the workers were sent the signal and waited for: they said how they ended
        return 128 + int(e.sigval)
    return 0


def build_ops(argv: Sequence[str]) -> int:
    """`zerogpt build-ops` (make install): both CPU Adam ops built now (optim/op_build.py says so around each
    build; a cached op only loads); a machine that cannot build them is told so, and the exit code is still 0."""
    from zerogpt.optim.cpu_adam import deepspeed_op_error
    from zerogpt.optim.host_adam import load_host_adam
    from zerogpt.optim.op_build import DEEPSPEED_ADAM, HOST_ADAM

    if argv:
        print(f"error: zerogpt build-ops takes no arguments, got {' '.join(argv)}", file=sys.stderr)
        return 2
    failed = []
    for what, error_of in ((HOST_ADAM, lambda: load_host_adam()[1]), (DEEPSPEED_ADAM, deepspeed_op_error)):
        error = error_of()
        if error:
            failed.append(what)
            print(f"build-ops: {what} did not build ({error}); runs fall back to torch's fused Adam", flush=True)
        else:
            print(f"build-ops: {what} ready", flush=True)
    if failed:
        print(f"build-ops: install ninja and a C++ compiler (g++), then `zerogpt build-ops` builds "
              f"{' and '.join(failed)}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The `zerogpt` console script: `zerogpt run ...`, `zerogpt build-ops`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    try:
        if command == "run":
            return run(rest)
        if command == "build-ops":
            return build_ops(rest)
    except KeyboardInterrupt:  # Ctrl-C before the agent took the signals over (while torch imports): no traceback
        return 128 + signal.SIGINT
    if command in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    print(USAGE, end="", file=sys.stderr)
    print(f"error: {'no command' if not command else f'unknown command {command!r}'}; "
          f"use `zerogpt run [torchrun flags] train_gpt.py --config C`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
