"""SaveCheckpointHook: checkpoints/step_<N>/ every `save_interval` steps, `latest`, and pruning.

`engine.save_checkpoint(dir, extra_state)` writes the directory under a temporary name and renames it
when complete; only then does this hook point `checkpoints/latest` (a one-line file naming the
directory) at it, itself by an atomic rename, so `latest` never names a partial checkpoint. The
extra_state is `trainer.state_dict()`: trainer counters, data position and hook state (LR schedule).
A save that finds the disk full is dropped (nothing of it is left), rank 0 says so in one line, and training
goes on: the next save tries again.
"""
from __future__ import annotations

import os
import re
import shutil

from zerogpt.trainer.hooks.base import Hook, every

_STEP_DIR = re.compile(r"^step_(\d+)$")


def latest_checkpoint(output_dir: str) -> str | None:
    """The directory `<output_dir>/checkpoints/latest` names, or None when there is none yet."""
    from zerogpt.checkpoint_reader import restore_set_aside

    root = os.path.join(output_dir, "checkpoints")
    try:
        with open(os.path.join(root, "latest")) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(root, name)
    if not restore_set_aside(path) and not os.path.isdir(path):
        raise FileNotFoundError(f"{root}/latest names {name!r} but {path} does not exist; pass "
                                "--resume <checkpoint dir> explicitly or delete the stale 'latest' file")
    return path


class SaveCheckpointHook(Hook):
    """Saves every `save_interval` steps and after the last step; keeps the newest `keep_last`.

    Args:
        output_dir: checkpoints go to <output_dir>/checkpoints/step_<N>/.
        save_interval: steps between checkpoints (None: only at the end).
        keep_last: checkpoints kept (older ones are deleted after a save; <= 0 keeps all).
        save_at_end: also save after the last step.
        checkpoint_dir: the Colossal-AI form: checkpoints go to <checkpoint_dir>/step_<N>/ instead.
        save_on_interrupt: save the last finished step when a signal stops the run (Trainer's stop_on_signal).
    """

    def __init__(self, output_dir: str | None = None, save_interval: int | None = None, keep_last: int = 3,
                 save_at_end: bool = True, checkpoint_dir: str | None = None, save_on_interrupt: bool = True):
        if (output_dir is None) == (checkpoint_dir is None):
            raise ValueError("SaveCheckpointHook needs output_dir (checkpoints go to <output_dir>/checkpoints) "
                             "or checkpoint_dir, not both")
        self.root = checkpoint_dir if checkpoint_dir is not None else os.path.join(output_dir, "checkpoints")
        self.save_interval = save_interval
        self.keep_last = keep_last
        self.save_at_end = save_at_end
        self.save_on_interrupt = save_on_interrupt
        self._last_saved: int | None = None

    def before_train(self, trainer) -> None:
        if trainer.state.step > 0:          # resumed: this step's checkpoint exists already
            self._last_saved = trainer.state.step

    def after_step(self, trainer) -> None:
        s = trainer.state
        # A step with a non-finite gradient was skipped by the engine (its weights are the step before's), so
        # every step's weights are fit to save.
        if every(s.step, self.save_interval, s.max_steps if self.save_at_end else None):
            self.save(trainer)

    def after_train(self, trainer) -> None:
        # Only when training ended before max_steps (data exhausted, should_stop, a signal).
        wanted = self.save_on_interrupt if trainer.state.interrupted else self.save_at_end
        if wanted and self._last_saved != trainer.state.step and trainer.state.step > 0:
            self.save(trainer)

    def save(self, trainer) -> str | None:
        """Save now (all ranks call); returns the checkpoint directory, or None when the disk was full."""
        from zerogpt.checkpoint import CheckpointNotSaved

        step = trainer.state.step
        path = os.path.join(self.root, f"step_{step}")
        try:
            trainer.engine.save_checkpoint(path, extra_state=trainer.state_dict())
        except CheckpointNotSaved as e:   # every rank gets it: they stay in step, and rank 0 says it once
            if trainer.is_main:
                trainer.logger.warning(self._not_saved(trainer, e))
            return None
        trainer.barrier()   # every rank's shard is in place before `latest` moves
        if trainer.is_main:
            tmp = os.path.join(self.root, f".latest.tmp.{os.getpid()}")
            with open(tmp, "w") as f:
                f.write(f"step_{step}\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.root, "latest"))
            self._prune(step)
            trainer.logger.info(f"saved checkpoint {path}")
        trainer.barrier()
        self._last_saved = step
        trainer.fire("on_checkpoint", path=path)
        return path

    def _not_saved(self, trainer, e) -> str:
        """One line: which checkpoint, where, the space it needed, what is intact, what to do, what happens next."""
        s = trainer.state
        try:
            with open(os.path.join(self.root, "latest")) as f:
                kept = f"{f.read().strip()} and latest are intact"
        except FileNotFoundError:
            kept = "there is no earlier checkpoint"
        upcoming = s.step - s.step % self.save_interval + self.save_interval if self.save_interval else None
        if s.step < (s.max_steps or 0) and not s.interrupted:
            goes_on = "training goes on and saves again " + (f"at step {min(upcoming, s.max_steps)}"
                                                            if upcoming else "at its end")
        else:
            goes_on = "training has ended without it"
        return (f"checkpoint {os.path.basename(e.directory)} not saved: {e.reason.lower()} in {self.root} (it needs "
                f"about {e.needed_bytes / 2**20:,.1f} MiB, {e.free_bytes / 2**20:,.1f} MiB free); the partial directory "
                f"is removed and {kept}. Free space there, lower train.keep_last or move train.output_dir; {goes_on}")

    def _prune(self, current: int) -> None:
        """Delete all but the newest `keep_last` of step_<N> <= current (newer ones from an abandoned
        run that was resumed from an older checkpoint are left alone)."""
        if self.keep_last <= 0:
            return
        steps = sorted(int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(self.root))
                       if m and int(m.group(1)) <= current)
        for step in steps[:-self.keep_last]:
            shutil.rmtree(os.path.join(self.root, f"step_{step}"), ignore_errors=True)
