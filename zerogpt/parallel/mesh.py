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

    def check_zero_stage(self, stage: int) -> None:
        """ZeRO-3 does not compose with a pipeline: stage 3 gathers a module's parameters for one forward and its
        backward, and a 1F1B schedule interleaves micro-batches, so every parameter would stay gathered (or be
        gathered twice per micro-batch). The one owner of that rule (preflight and initialize ask it)."""
        if stage == 3 and self.pp > 1:
            raise ValueError(f"zero.stage=3 with parallel.pipeline={self.pp} is not supported: a pipeline stage runs "
                             f"each layer once per micro-batch, and stage 3 would gather its parameters each "
                             f"time; use zero.stage 0-2 with a pipeline, or parallel.pipeline=1 with stage 3")

    def check_gpt(self, config: Any, where: str = "model") -> None:
        """`check_model` on a model_zoo GPTConfig (n_inner None: the MLP is 4 x n_embd wide)."""
        self.check_model(n_head=config.n_head, n_layer=config.n_layer, padded_vocab_size=config.padded_vocab_size,
                         n_inner=config.n_inner or 4 * config.n_embd, where=where)

    def check_llama(self, config: Any, where: str = "model") -> None:
        """`check_model` on a model_zoo LlamaConfig, whose k/v heads split by T too: rank r of T holds query heads
        [r*nh/T, (r+1)*nh/T) and k/v heads [r*nkv/T, (r+1)*nkv/T), the groups those query heads use. (Fewer k/v
        heads than T would need each replicated over several ranks, as Megatron does; not implemented.)"""
        t, p = self.tp, self.pp
        for key in ("num_attention_heads", "num_key_value_heads"):
            if getattr(config, key) % t:
                raise ValueError(f"{where}: {key}={getattr(config, key)} is not divisible by parallel.tensor.size="
                                 f"{t}; each tensor-parallel rank holds whole query and k/v heads (its query heads' "
                                 f"groups), so T must divide both num_attention_heads={config.num_attention_heads} "
                                 f"and num_key_value_heads={config.num_key_value_heads}")
        if config.num_hidden_layers % p:
            raise ValueError(f"{where}: num_hidden_layers={config.num_hidden_layers} is not divisible by "
                             f"parallel.pipeline={p}; every stage holds the same number of layers")
        self.check_model(n_head=config.num_attention_heads, n_layer=config.num_hidden_layers,
                         padded_vocab_size=config.padded_vocab_size, n_inner=config.intermediate_size, where=where)

    def check_config(self, config: Any, where: str = "model") -> None:
        """The shape check of a model_zoo config, by its class: GPTConfig (check_gpt) or LlamaConfig (check_llama)."""
        check = {"GPTConfig": self.check_gpt, "LlamaConfig": self.check_llama}.get(type(config).__name__)
        if check is None:
            raise ValueError(f"{where}: parallel.tensor.size / parallel.pipeline split model_zoo's GPT and "
                             f"Llama-family models; a {type(config).__name__} has no plan")
        check(config, where)

    def build_mesh(self, device_type: str) -> Any:
        """The run's DeviceMesh over the default process group, dims ("pp", "dp", "tp")."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_DIMS)

    def rank_groups(self, dim: str) -> list[list[int]]:
        """The global ranks of every process group along `dim` ("pp", "dp" or "tp"), as build_mesh lays them out.

        Pure arithmetic on the row-major (pp, dp, tp) layout, rank = (p * dp + d) * tp + t, so the launch log
        and the tests can name the groups without a process group.
        """
        sizes = dict(zip(MESH_DIMS, (self.pp, self.dp, self.tp)))
        if dim not in sizes:
            raise ValueError(f"mesh dimension {dim!r} is not one of {', '.join(MESH_DIMS)}")
        stride = {"pp": self.dp * self.tp, "dp": self.tp, "tp": 1}[dim]
        starts = [r for r in range(self.world_size) if (r // stride) % sizes[dim] == 0]
        return [[start + i * stride for i in range(sizes[dim])] for start in starts]

    def describe(self, max_groups: int = 4) -> str:
        """The layout for the launch log: the sizes, then which global ranks form each tp, pp and dp group.

        Example (tp=2, dp=2 on 4 ranks):
            mesh (pp=1, dp=2, tp=2) over 4 ranks, D = 4 / (T=2 x P=1)
              tp groups: [0,1] [2,3]
              dp groups: [0,2] [1,3]
        A dimension of size 1 has no line.
        """
        lines = [f"mesh (pp={self.pp}, dp={self.dp}, tp={self.tp}) over {self.world_size} "
                 f"rank{'s' if self.world_size > 1 else ''}, D = {self.world_size} / (T={self.tp} x P={self.pp})"]
        for dim in ("tp", "pp", "dp"):
            groups = self.rank_groups(dim)
            if len(groups[0]) == 1:  # a dimension of size 1 has no groups to show
                continue
            shown = [_ranks(g) for g in groups]
            if len(shown) > max_groups:  # thousands of ranks: the first groups show the pattern
                shown = shown[:max_groups - 1] + [f"... ({len(groups)} groups) ...", shown[-1]]
            lines.append(f"  {dim} groups: {' '.join(shown)}")
        return "\n".join(lines)


def _ranks(group: list[int]) -> str:
    """One group (an arithmetic progression of ranks) compactly: [0-7] when consecutive, [0,8,..,248] when long."""
    if len(group) > 2 and group[1] - group[0] == 1:
        return f"[{group[0]}-{group[-1]}]"
    if len(group) > 4:
        return f"[{group[0]},{group[1]},..,{group[-1]}]"
    return "[" + ",".join(map(str, group)) + "]"
