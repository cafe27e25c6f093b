"""The parallel layout of a run: tensor (T) x pipeline (P) x data (D = world / (T * P)) ranks, as one DeviceMesh.

Rank order follows Megatron: tensor-parallel ranks are adjacent (they talk every layer, so on one node they share
the fastest links), then data-parallel, then pipeline stages outermost. The mesh's dimensions are named
("pp", "dp", "tp"); every process group of the run (ZeRO's over "dp", TP's, PP's) comes from it.
Everything here is checked before launch, so a bad layout fails with the config key and the numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MESH_DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the three dimensions; tp * pp * dp is the world size."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    @classmethod
    def from_config(cls, parallel: Any, world_size: int) -> "ParallelDims":
        """From a ParallelConfig and the world size; ValueError naming the keys if T * P does not divide it."""
        tp, pp = parallel.tensor.size, parallel.pipeline
        if world_size % (tp * pp):
            raise ValueError(f"world size {world_size} is not divisible by parallel.tensor.size ({tp}) x "
                             f"parallel.pipeline ({pp}) = {tp * pp}; launch a multiple of {tp * pp} ranks "
                             f"(torchrun --nproc_per_node) or change the parallel sizes")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def model_parallel(self) -> bool:
        return self.tp * self.pp > 1

    def check_model(self, *, n_head: int, n_layer: int, padded_vocab_size: int, n_inner: int,
                    where: str = "model") -> None:
        """A GPT's shape fits this layout: heads, MLP width and vocab rows split by T, layers by P."""
        t, p = self.tp, self.pp
        if n_head % t:
            raise ValueError(f"{where}: n_head={n_head} is not divisible by parallel.tensor.size={t}; each "
                             f"tensor-parallel rank computes whole attention heads")
        if n_inner % t:
            raise ValueError(f"{where}: the MLP width {n_inner} is not divisible by parallel.tensor.size={t}")
        if padded_vocab_size % t:
            raise ValueError(f"{where}: the padded vocabulary ({padded_vocab_size} rows) is not divisible by "
                             f"parallel.tensor.size={t}; set model.pad_vocab_multiple to a multiple of {t} "
                             f"(e.g. {64 * t})")
        if n_layer % p:
            raise ValueError(f"{where}: n_layer={n_layer} is not divisible by parallel.pipeline={p}; every "
                             f"stage holds the same number of blocks")

    def build_mesh(self, device_type: str) -> Any:
        """The run's DeviceMesh over the default process group, dims ("pp", "dp", "tp")."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_DIMS)

    def describe(self) -> str:
        return f"mesh (pp={self.pp}, dp={self.dp}, tp={self.tp}) over {self.world_size} ranks"
