"""How a run reports failure: a user's mistake as one short line, a crash with its traceback and its rank.

Under torchrun every rank reads the same config, so a config, data or path error is found by every rank at
once; printing it from each, inside tracebacks, buries one sentence in a hundred lines. `report_user_error`
prints it once, from rank 0, and every rank exits non-zero. A real crash keeps its traceback
(`report_crash`). Both write this rank's torchelastic error file (TORCHELASTIC_ERROR_FILE, the file `@record`
writes) before the process group is torn down, so torchrun's "Root Cause" is the rank that failed first: a
rank that finds a sibling's error file already written failed because of it (e.g. `Connection closed by
peer`), and its own file is dated after the sibling's.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time
import traceback

__all__ = ["USER_ERRORS", "report_user_error", "report_crash", "env_rank"]

USER_ERRORS = (ValueError, TypeError, KeyError, OSError)
"""What the checks before training raise (config.py, preflight.py, missing files): the message says it all."""


def env_rank() -> int:
    """This process's global rank from torchrun's environment (0 for a plain `python` run)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _message(e: BaseException) -> str:
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def _sibling_timestamps(error_file: str) -> list[int]:
    """Timestamps in the other local ranks' error files (torchrun gives each rank <attempt>/<local_rank>/...)."""
    rank_dir = os.path.dirname(error_file)
    pattern = os.path.join(os.path.dirname(rank_dir), "*", os.path.basename(error_file))
    stamps = []
    for path in glob.glob(pattern):
        if os.path.dirname(path) == rank_dir:
            continue
        try:
            with open(path) as f:
                stamps.append(int(json.load(f)["message"]["extraInfo"]["timestamp"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return stamps


def write_error_file(message: str, callstack: str, not_before: int = 0, root_cause: bool = False) -> None:
    """This rank's failure in torchelastic's error-file format; dated after any sibling's that came first
    (unless this rank is known to be the `root_cause`)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    stamp = max(int(time.time()), not_before)
    earlier = [] if root_cause else _sibling_timestamps(path)
    if earlier:
        stamp = max(stamp, max(earlier) + 1)
    data = {"message": {"message": message, "extraInfo": {"py_callstack": callstack, "timestamp": str(stamp)}}}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # reporting must never hide the error itself
        pass


def report_user_error(e: BaseException, rank: int, from_config: bool = False, wait_s: float = 10.0) -> int:
    """A mistake found before training: rank 0 prints `error: <message>` once, no traceback. Returns the exit code.

    Every rank reads the same config and data, so the other ranks found the same mistake: they stay quiet and
    wait (up to `wait_s`) for torchrun to stop them once rank 0 has exited, so that torchrun never stops rank 0
    before it has printed. A rank still running after the wait found a mistake of its own, and prints it.
    `from_config`: found in the config alone, so certainly the same on every rank (torchrun's summary then
    shows it once, as rank 0's).
    """
    message = _message(e)
    if rank == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
        write_error_file(message, message, root_cause=True)
        return 1
    recorded = "stopped: rank 0 reports the error" if from_config else message
    write_error_file(recorded, recorded, not_before=int(time.time()) + 2)  # rank 0, if it failed too, comes first
    time.sleep(wait_s)
    print(f"[rank {rank}] error: {message}", file=sys.stderr, flush=True)
    return 1


def report_crash(e: BaseException, rank: int) -> int:
    """A failure during training: this rank prints its traceback, tagged with its rank. Returns the exit code.

    A rank whose sibling already failed (its error file is there) most likely failed because of it (a peer's
    closed connection): it reports one line, and the sibling's traceback is the one shown.
    """
    callstack = traceback.format_exc()
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and _sibling_timestamps(path):
        line = f"stopped after another rank failed: {type(e).__name__}: {e}"
        write_error_file(line, line)
        print(f"[rank {rank}] ERROR {line}", file=sys.stderr, flush=True)
        return 1
    write_error_file(f"{type(e).__name__}: {e}", callstack)
    sys.stderr.write(callstack)
    print(f"[rank {rank}] ERROR training failed on rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return 1
