"""DistributedBatchSampler: which samples each data-parallel rank reads, resumable to the exact sample.

The global order is one sequence of sample ids (the dataset order, or a seeded per-epoch permutation of
it). It is cut into global micro-batches of `batch_size * world_size` consecutive ids and rank r takes
the r-th slice of each, as Megatron-LM's pretraining sampler does; so which samples form a global batch
does not depend on the world size, and its state (a global count, the epoch and the position in it) resumes at
any world size or global batch.
It does not shuffle within the dataset's own order (GPTDataset is already shuffled) unless asked.
"""
from __future__ import annotations

from typing import Iterator, Sized

import numpy as np
import torch


class DistributedBatchSampler(torch.utils.data.Sampler):
    """Batch sampler for `DataLoader(dataset, batch_sampler=...)` giving each rank its slice of each global batch.

    Args:
        dataset: the dataset (or its length).
        batch_size: micro-batch size per rank (samples).
        rank, world_size: data-parallel coordinates (default: from torch.distributed, else 0 and 1).
        consumed_samples: samples already consumed globally (all ranks together), e.g. from a checkpoint.
        drop_last: drop the final incomplete global batch; if False it is completed with samples from the
            start of the epoch's order (as torch's DistributedSampler pads), so every rank gets a full batch.
        shuffle: permute the order each epoch with `seed + epoch` (False: the dataset order, which for
            GPTDataset is already a seeded shuffle).

    Iterating yields the rest of the current epoch from where the last batch ended (at construction: where
    `consumed_samples` falls at this global batch); each yielded batch adds `batch_size * world_size` to
    `consumed_samples`, and an `iter()` after the epoch's last batch starts the next epoch. `state_dict` holds the
    epoch and the position in it besides the global count, so a run resumed with another global batch (more
    ranks, another micro-batch) goes on with the same epoch's next sample. With a
    DataLoader using worker processes the loader draws batches ahead of training, so checkpoint the
    trainer's own count (optimizer steps x global batch) and restore it with `load_state_dict`.

    Example:
        >>> s = DistributedBatchSampler(range(10), batch_size=2, rank=1, world_size=2)
        >>> list(s)
        [[2, 3], [6, 7]]
        >>> s.load_state_dict({"consumed_samples": 4}); list(s)
        [[6, 7]]
    """

    def __init__(self, dataset: Sized | int, batch_size: int, rank: int | None = None,
                 world_size: int | None = None, consumed_samples: int = 0, drop_last: bool = True,
                 shuffle: bool = False, seed: int = 0) -> None:
        if rank is None or world_size is None:
            dist = torch.distributed.is_available() and torch.distributed.is_initialized()
            rank = rank if rank is not None else (torch.distributed.get_rank() if dist else 0)
            world_size = world_size if world_size is not None else (torch.distributed.get_world_size() if dist else 1)
        self.num_samples = dataset if isinstance(dataset, int) else len(dataset)
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size >= 1 and 0 <= rank < world_size, got batch_size={batch_size}, "
                             f"rank={rank}, world_size={world_size}")
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.global_batch = batch_size * world_size
        self.drop_last, self.shuffle, self.seed = drop_last, shuffle, seed
        if drop_last and self.num_samples < self.global_batch:
            raise ValueError(f"dataset has {self.num_samples} samples, fewer than one global micro-batch "
                             f"(batch_size {batch_size} x world_size {world_size} = {self.global_batch}); "
                             "use more data, a smaller batch, or drop_last=False")
        if self.num_samples == 0:
            raise ValueError("dataset is empty")
        self.consumed_samples = consumed_samples
        # where the next batch starts: an epoch and a position in its order (samples, all ranks), kept apart from
        # the global count, so a run resumed with another global batch continues the epoch where it stopped
        self._epoch, self._position = divmod(consumed_samples, self.samples_per_epoch)

    @property
    def samples_per_epoch(self) -> int:
        """Samples one epoch consumes globally: a whole number of global micro-batches."""
        full = self.num_samples // self.global_batch * self.global_batch
        return full if self.drop_last or full == self.num_samples else full + self.global_batch

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch + self.ends_epoch(self._position)

    def ends_epoch(self, position: int) -> bool:
        """Whether an epoch is drawn once `position` of its samples (all ranks) are: no global batch starts there
        (padded from the epoch's start, one starts at any position inside it; else only a whole one)."""
        return position + (1 if not self.drop_last else self.global_batch) > self.num_samples

    def __len__(self) -> int:
        """Micro-batches per rank in one full epoch."""
        return self.samples_per_epoch // self.global_batch

    def _order(self, epoch: int) -> np.ndarray:
        if self.shuffle:
            return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return np.arange(self.num_samples)

    def __iter__(self) -> Iterator[list[int]]:
        if self.ends_epoch(self._position):  # the last epoch was drawn to its end: this one starts the next
            self._epoch, self._position = self._epoch + 1, 0
        order = self._order(self._epoch)
        while not self.ends_epoch(self._position):
            start = self._position
            ids = np.arange(start, start + self.global_batch) % self.num_samples  # wraps only when padding
            mine = ids[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
            self.consumed_samples += self.global_batch
            self._position += self.global_batch
            yield order[mine].tolist()

    def state_dict(self) -> dict:
        """The global count and the epoch and position in it: the state loads at any world size or batch split."""
        return {"consumed_samples": self.consumed_samples, "epoch": self._epoch, "epoch_samples": self._position,
                "seed": self.seed, "shuffle": self.shuffle, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_samples", self.num_samples) != self.num_samples:
            raise ValueError(f"sampler state is for a dataset of {state['num_samples']} samples, this one has "
                             f"{self.num_samples}; resume with the same data, seq_len and num_samples")
        self.consumed_samples = int(state["consumed_samples"])
        if "epoch" in state and "epoch_samples" in state:  # exact at any global batch (the trainer's counts too)
            self._epoch, self._position = int(state["epoch"]), int(state["epoch_samples"])
        else:  # the global count alone: exact where the global batch is the one it was counted in
            self._epoch, self._position = divmod(self.consumed_samples, self.samples_per_epoch)
        self.seed = state.get("seed", self.seed)
        self.shuffle = state.get("shuffle", self.shuffle)
