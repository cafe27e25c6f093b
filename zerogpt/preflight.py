"""Checks a run makes with its config before it launches: each names the key or flag the user sets.

Everything here runs before the first optimizer step (most of it before any process group exists), so a
mistake costs seconds, not a run: a schedule longer than the run, an output directory that cannot be
written or that holds another run, a `--resume` path that is not there, and a vocabulary that does not
match between the data, its tokenizer and the model, and a parallel layout (`parallel = dict(...)`) that does
not fit the world size, the batch or the model's shape. Every failure is a `PreflightError`, a user error
that train_gpt.py reports as one line (see zerogpt/errors.py), never a traceback.
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
import json
from typing import Any, Callable

from zerogpt.config import engine_config, parallel_config
from zerogpt.parallel.mesh import ParallelDims

__all__ = ["PreflightError", "data_from_env", "check_data", "is_jsonl", "check_schedule", "check_output_dir",
           "check_fresh_run", "clear_run", "check_resume", "check_vocab", "check_parallel", "check_optimizer",
           "env_world_size", "known_vocab_size", "lock_run_dir", "RunLock", "RUN_FILES", "LOCK_FILE"]

RUN_FILES = ("metrics.jsonl", "loss.png", "config.py", "checkpoints", "tensorboard")
"""What a run writes into train.output_dir; --overwrite deletes exactly these."""
LOCK_FILE = ".zerogpt.lock"
"""In train.output_dir while a run holds it: who (pid, host, command). The lock is the OS's, not the file's."""


class PreflightError(ValueError):
    """A config, data or path mistake found before training: the message alone says what to change."""


def is_jsonl(path: str | None) -> bool:
    """A data.path naming a JSONL corpus (read through WebtextDataset's cached tokenization), not a prefix."""
    return path is not None and path.endswith((".json", ".jsonl")) and os.path.isfile(path)


def data_from_env(data: Any) -> bool:
    """No data.path in the config: take the Colossal-AI tutorial's `export DATA=...` (JSONL file or .bin/.idx prefix).
    Returns whether it did."""
    if data.path is not None or data.mock or not os.environ.get("DATA"):
        return False
    data.path = os.environ["DATA"]
    return True


def check_data(data: Any, skip: bool = False) -> None:
    """Fail before any process starts talking when the dataset is not there, naming the command that makes it."""
    if data.mock or skip:
        return
    if data.path is None:
        raise PreflightError("data.path is not set: pass --set data.path=PREFIX (a tokenized .bin/.idx dataset, made "
                             "by `python -m data_pipeline tokenize`) or a JSONL file, export DATA=PATH, or pass "
                             "--set data.mock=True for random tokens")
    if data.path.endswith((".json", ".jsonl")) and not is_jsonl(data.path):
        raise PreflightError(f"data.path={data.path!r}: no such file (a JSONL corpus, one {{\"text\": ...}} per "
                             f"line, or the prefix of a tokenized .bin/.idx dataset)")
    missing = [f"{data.path}{ext}" for ext in (".bin", ".idx") if not os.path.exists(data.path + ext)]
    prefix, ext = os.path.splitext(data.path)
    if missing and ext in (".bin", ".idx") and all(os.path.exists(prefix + e) for e in (".bin", ".idx")):
        raise PreflightError(f"data.path={data.path!r} names one of the dataset's two files; give the prefix "
                             f"its .bin and .idx share: --set data.path={prefix}")
    if missing and not is_jsonl(data.path):
        raise PreflightError(
            f"data.path={data.path!r}: {' and '.join(missing)} not found. Create it with\n"
            f"    python -m data_pipeline tokenize CORPUS.jsonl --tokenizer TOKENIZER_DIR --output-prefix {data.path}\n"
            f"(the whole chain from URLs: README 'Data pipeline'), or give a JSONL file as data.path.")
    if data.tokenizer is not None and not os.path.exists(data.tokenizer):
        raise PreflightError(f"data.tokenizer={data.tokenizer!r} not found; train one with `python -m data_pipeline "
                             f"train-tokenizer CORPUS.jsonl --output {data.tokenizer}` or point it at the tokenizer "
                             f"the dataset was made with")


def check_schedule(train: Any, lr: Any | None) -> None:
    """A decaying LR schedule must fit in the run: warmup longer than the run never reaches the peak LR.

    Args:
        train: the `train` section (TrainConfig); lr: the `lr_scheduler` section, or None when the config has none.
    """
    if lr is None or lr.type == "constant" or lr.warmup_steps == 0:
        return
    if lr.total_steps is not None and lr.total_steps < lr.warmup_steps:
        raise PreflightError(f"lr_scheduler.total_steps={lr.total_steps} is shorter than lr_scheduler.warmup_steps="
                             f"{lr.warmup_steps}; raise total_steps or lower warmup_steps")
    if lr.total_steps is None and train.max_steps is not None and train.max_steps < lr.warmup_steps:
        raise PreflightError(f"train.max_steps={train.max_steps} is shorter than lr_scheduler.warmup_steps="
                             f"{lr.warmup_steps}: the run would end before the warmup reaches the peak LR; raise "
                             f"train.max_steps (e.g. --set train.max_steps={lr.warmup_steps * 10}) or lower "
                             f"lr_scheduler.warmup_steps")


def check_output_dir(out: str) -> None:
    """train.output_dir exists (it is created here) and this process can write files into it."""
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise PreflightError(f"train.output_dir={out!r} cannot be written: {e.strerror or e}; set "
                             f"--set train.output_dir=DIR to a directory you can write") from None


def _run_files(out: str) -> list[str]:
    """The files of an earlier run in `out` (config.py alone is not a run: a run writes it first)."""
    found = []
    for name in ("metrics.jsonl", "checkpoints", "tensorboard"):
        path = os.path.join(out, name)
        if os.path.isfile(path) or (os.path.isdir(path) and os.listdir(path)):
            found.append(path)
    return found


def check_fresh_run(out: str, resume: str | None, overwrite: bool) -> None:
    """A run started without --resume must not mix its metrics and checkpoints with another run's."""
    if resume is not None or overwrite:
        return
    found = _run_files(out)
    if found:
        steps = [int(p.rsplit("_", 1)[1]) for p in glob.glob(os.path.join(out, "checkpoints", "step_*"))
                 if p.rsplit("_", 1)[1].isdigit()]
        what = f"checkpoints up to step_{max(steps)}" if steps else ", ".join(found)
        raise PreflightError(f"train.output_dir={out!r} already holds a run ({what}). Pass --resume auto to "
                             f"continue it, --set train.output_dir=NEW_DIR to start a new run beside it, or "
                             f"--overwrite to delete it and start over")


class RunLock:
    """An exclusive lock on a run directory, held by this process until `release()` or its death (kill -9 too).

    A POSIX record lock (fcntl.lockf): the kernel drops it when the process dies, a forked child (a DataLoader
    worker) does not inherit it, and it works on NFS. The lock file names its holder for whoever is refused.
    """

    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path

    def release(self) -> None:
        """Remove the lock file, then unlock (a run that opened the old file finds it unlinked and retries)."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)   # closing drops the lock
        self.fd = None


def lock_run_dir(out: str) -> RunLock:
    """Lock train.output_dir for this run (its global rank 0), or raise naming the process that holds it.

    Two runs started at once into one directory would both pass check_fresh_run (neither has written yet) and
    then mix their metrics and checkpoints; the lock, taken before that check and held until the run ends,
    lets exactly one of them in.
    """
    import fcntl
    import socket
    import sys
    import time

    path = os.path.join(out, LOCK_FILE)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            raise PreflightError(f"train.output_dir={out!r} is in use by another run: "
                                 f"{holder or 'a process holds ' + path}. Wait for it to finish or stop it, or "
                                 f"pass --set train.output_dir=NEW_DIR") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)   # the holder removed it as we opened it: lock the file that is there now
    launcher = f", torchrun pid {os.getppid()}" if os.environ.get("TORCHELASTIC_RUN_ID") else ""
    who = (f"pid {os.getpid()}{launcher} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
           f"{' '.join(sys.argv)}")
    os.ftruncate(fd, 0)
    os.pwrite(fd, who.encode() + b"\n", 0)
    return RunLock(fd, path)


def clear_run(out: str) -> list[str]:
    """--overwrite: delete the earlier run's files (RUN_FILES) from `out`; other files are left alone."""
    removed = []
    for name in RUN_FILES:
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
        else:
            continue
        removed.append(name)
    return removed


def check_resume(resume: str | None) -> None:
    """--resume DIR must exist; a missing directory is a typo, not an interrupted save."""
    if resume is None or resume == "auto":
        return
    if not os.path.isdir(resume):
        parent = os.path.dirname(os.path.normpath(resume))
        near = sorted(os.listdir(parent)) if parent and os.path.isdir(parent) else []
        raise PreflightError(f"--resume {resume}: no such directory"
                             + (f" ({parent} holds: {', '.join(near[-5:])})" if near else "")
                             + "; pass a checkpoint directory such as runs/x/checkpoints/step_1000, or "
                               "--resume auto for the newest checkpoint of train.output_dir")
    steps = sorted(n for n in os.listdir(resume) if n.startswith("step_"))
    holds_checkpoints = steps or os.path.isdir(os.path.join(resume, "checkpoints"))
    if holds_checkpoints and not os.path.exists(os.path.join(resume, "meta.json")):
        raise PreflightError(f"--resume {resume} holds checkpoints but is not one: pass a checkpoint directory "
                             f"such as {os.path.join(resume, steps[-1]) if steps else resume + '/checkpoints/step_N'}"
                             f", or --resume auto with train.output_dir set to the run directory")


def check_vocab(*, tokenizer: tuple[int, str] | None = None, dataset: tuple[int, str] | None = None,
                max_id: tuple[int, str] | None = None, model: tuple[int, str] | None = None,
                data_key: tuple[int, str] | None = None) -> None:
    """Refuse data, tokenizer and model whose vocabularies disagree, naming each size and where it came from.

    Each argument is (size, where it came from) or None when unknown. The rules:
    the dataset's recorded vocabulary equals the tokenizer's (it is the tokenizer the data was made with);
    the largest token id is below both; the model's vocabulary (its embedding's rows, or GPT's vocab_size) and
    data.vocab_size may be larger (padding) but never smaller. A mismatch trains without any error and
    generates nonsense, so it is refused here, before the engine is built, and again by `zerogpt_tools.export`
    and `zerogpt_tools.generate`.
    """
    def name(entry: tuple[int, str]) -> str:
        return f"{entry[0]:,} ({entry[1]})"

    if tokenizer and dataset and tokenizer[0] != dataset[0]:
        raise PreflightError(f"vocabulary mismatch: the data was tokenized with {name(dataset)} tokens but the "
                             f"tokenizer has {name(tokenizer)}; point data.tokenizer at the tokenizer the data was "
                             f"made with, or re-tokenize the data with this one")
    if max_id:
        for entry in (tokenizer, dataset):
            if entry and max_id[0] >= entry[0]:
                raise PreflightError(f"vocabulary mismatch: the data holds token id {max_id[0]:,} ({max_id[1]}) "
                                     f"but the vocabulary has {name(entry)} tokens; use the tokenizer the data "
                                     f"was made with, or re-tokenize the data")
    # the tokenizer first: it is the one that says how many of its ids are added tokens
    needed = [e for e in (tokenizer, dataset) if e] + ([(max_id[0] + 1, f"ids 0..{max_id[0]:,}, {max_id[1]}")]
                                                      if max_id else [])
    for holder in (model, data_key):
        for entry in needed:
            if holder and holder[0] < entry[0]:
                raise PreflightError(f"vocabulary mismatch: {name(holder)} is smaller than the {name(entry)} it "
                                     f"must hold; raise it to at least {entry[0]:,} (a pretrained model's embedding: "
                                     f"python -m zerogpt_tools.extend_vocab), or pass the tokenizer the model "
                                     f"was trained with")


def check_optimizer(cfg: Any) -> None:
    """The `optimizer = dict(...)` section's values, checked by its own class on a one-element parameter (torch
    refuses lr=-1, betas out of [0, 1), ... in its constructor), so a bad value fails here, before anything is
    written, and names where it was set. An optimizer object in a library call is checked by its caller.
    """
    if "optimizer" not in cfg or not isinstance(cfg.optimizer, dict):
        return
    import torch

    from zerogpt.config import optimizer_class
    from zerogpt.optim import CPUAdam

    kwargs = {k: v for k, v in dict(cfg.optimizer).items() if k not in ("type", "no_decay_1d")}
    cls = optimizer_class(cfg.optimizer["type"])
    if issubclass(cls, CPUAdam):
        kwargs["backend"] = "torch"   # the values are what is checked here; the kernel is chosen at launch
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
    except (ValueError, TypeError, RuntimeError) as e:
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "backend")
        raise PreflightError(f"optimizer {cls.__name__}({given}) is refused by {cls.__name__}: {e} "
                             f"(in {cfg.where('optimizer')})") from None


def env_world_size() -> int:
    """The world size torchrun will give this run (WORLD_SIZE; 1 for a plain `python train_gpt.py`)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def known_vocab_size(data: Any) -> int | None:
    """The vocabulary the model will be built with, as far as it is known before the data is opened:
    data.vocab_size, the mock default, or the dataset's recorded `P.stats.json`; None when only the tokenizer knows."""
    if data.vocab_size or data.mock:
        return data.vocab_size or 50257  # train_gpt's mock default
    try:
        with open(f"{data.path}.stats.json") as f:
            return int(json.load(f)["vocab_size"]) or None
    except (OSError, TypeError, ValueError, KeyError):
        return None


def check_parallel(cfg: Any, world_size: int, model: Callable[[], Any]) -> ParallelDims:
    """The `parallel` section fits the world, the batch and the model: T x P divides the world size,
    GLOBAL_BATCH_SIZE divides by BATCH_SIZE x D (D = world / (T x P), the ranks ZeRO shards over), ZeRO-3
    is not asked to run with a pipeline, and the model's heads (a Llama's k/v heads too), MLP width and padded
    vocabulary divide by T and its layers by P.

    Args:
        cfg: the run's Config; world_size: the ranks torchrun will start (env_world_size()).
        model: builds the model without its weights (on the meta device); called only when T x P > 1.
    Returns the layout, whose describe() the launch log prints.
    """
    parallel = parallel_config(cfg)
    try:
        dims = ParallelDims.from_config(parallel, world_size)
    except ValueError as e:
        raise PreflightError(str(e)) from None
    t, p = dims.tp, dims.pp
    try:
        stage = engine_config(cfg, dims.dp).zero.stage  # GLOBAL_BATCH_SIZE vs GRADIENT_ACCUMULATION at D ranks
    except ValueError as e:
        if not dims.model_parallel:
            raise
        raise PreflightError(f"{e} (data-parallel size {dims.dp} = world size {world_size} / "
                             f"(parallel.tensor.size {t} x parallel.pipeline {p}))") from None
    if parallel.tensor.sequence_parallel and cfg.SEQ_LEN % t:
        raise PreflightError(f"parallel.tensor.sequence_parallel=True splits each sequence over the "
                             f"parallel.tensor.size={t} ranks, but SEQ_LEN={cfg.SEQ_LEN} is not divisible by {t}; "
                             f"pick a SEQ_LEN that is a multiple of {t}")
    try:
        dims.check_zero_stage(stage)
    except ValueError as e:
        raise PreflightError(str(e)) from None
    if dims.model_parallel:
        built = model()
        config = getattr(built, "config", None)
        if not hasattr(config, "padded_vocab_size"):
            raise PreflightError(f"parallel.tensor.size={t} / parallel.pipeline={p} split a model_zoo GPT or "
                                 f"Llama-family model (model = dict(type=gpt2_medium, ...), dict(type=llama3_8b, "
                                 f"...) or a Llama-family dict(type='hf', ...)); {type(built).__name__} cannot be "
                                 f"split")
        try:
            dims.check_config(config, where=f"model ({type(built).__name__}, vocab {config.vocab_size:,} padded to "
                                         f"{config.padded_vocab_size:,})")
        except ValueError as e:
            raise PreflightError(str(e)) from None
    return dims


def finished_message(ckpt: str, step: int, max_steps: int, lr_scheduler: Any = None,
                     epochs: int | None = None) -> str:
    """--resume auto on a run that is done: say so, how to extend it, and what that does to the LR.

    `epochs` is given when the run's length came from NUM_EPOCHS (no train.max_steps): `max_steps` is then
    the step those epochs end at."""
    if epochs is None:
        msg = (f"nothing to do: {ckpt} is at step {step} and train.max_steps={max_steps}. To train further, raise "
               f"it: --resume auto --set train.max_steps={2 * step}.")
    else:
        msg = (f"nothing to do: {ckpt} is at step {step}, the end of NUM_EPOCHS={epochs} ({max_steps} steps). To "
               f"train further, raise it: --resume auto --set NUM_EPOCHS={2 * epochs} (or set train.max_steps).")
    schedule = lr_scheduler.lr_lambdas[0] if lr_scheduler is not None else None
    if getattr(schedule, "kind", "constant") != "constant":
        msg += (f" The LR schedule comes back from the checkpoint and is not stretched: its {schedule.kind} decay "
                f"ends at step {schedule.total_steps}, and the extra steps run at its floor, lr_scheduler.min_lr.")
    return msg


def run_data_vocab(config_path: str | None) -> tuple[int, str] | None:
    """(vocab_size, file) recorded for the dataset a run trained on (its config's data.path), or None if unknown."""
    if not config_path:
        return None
    import json

    from zerogpt.config import Config, data_config

    try:
        prefix = data_config(Config.from_file(config_path)).path
        with open(f"{prefix}.stats.json") as f:
            size = json.load(f).get("vocab_size")
    except Exception:  # no data.path, Megatron data without stats, or a config that no longer loads: unknown
        return None
    return (int(size), f"{prefix}.stats.json") if size else None
