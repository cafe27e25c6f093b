"""zerogpt/parallel/mesh.py and context.py: the layout's checks name the keys and numbers, the rank arithmetic that
the launch log prints is the DeviceMesh's, and DistContext.with_mesh hands ZeRO the data-parallel group."""
import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from zerogpt.config import ParallelConfig, TensorParallelConfig
from zerogpt.context import DistContext
from zerogpt.parallel import ParallelDims


def dims(tp: int, pp: int, world: int) -> ParallelDims:
    return ParallelDims.from_config(ParallelConfig(tensor=TensorParallelConfig(size=tp), pipeline=pp), world)


def test_from_config_gives_the_data_parallel_size():
    assert dims(1, 1, 8) == ParallelDims(tp=1, pp=1, dp=8)
    assert dims(2, 2, 8) == ParallelDims(tp=2, pp=2, dp=2)
    assert dims(2, 1, 2).world_size == 2 and dims(2, 1, 2).model_parallel
    assert not dims(1, 1, 4).model_parallel


def test_from_config_names_the_keys_and_numbers():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by parallel.tensor.size \(2\) x "
                                         r"parallel.pipeline \(2\) = 4"):
        dims(2, 2, 6)
    with pytest.raises(ValueError, match=r"parallel.tensor.size must be >= 1, got 0"):
        TensorParallelConfig(size=0)
    with pytest.raises(ValueError, match=r"parallel.pipeline must be >= 1, got 0"):
        ParallelConfig(pipeline=0)


SHAPE = dict(n_head=16, n_layer=24, padded_vocab_size=50304, n_inner=4096)   # GPT-2 medium


@pytest.mark.parametrize("layout, change, message", [
    ((3, 1, 3), {}, r"n_head=16 is not divisible by parallel.tensor.size=3"),
    ((2, 1, 2), dict(n_inner=4095), r"MLP width 4095 is not divisible by parallel.tensor.size=2"),
    ((2, 1, 2), dict(padded_vocab_size=50257), r"padded vocabulary \(50257 rows\) is not divisible by "
                                               r"parallel.tensor.size=2; set model.pad_vocab_multiple"),
    ((1, 5, 5), {}, r"n_layer=24 is not divisible by parallel.pipeline=5"),
])
def test_check_model_names_the_shape_and_the_key(layout, change, message):
    tp, pp, world = layout
    with pytest.raises(ValueError, match=message):
        dims(tp, pp, world).check_model(**{**SHAPE, **change})


def test_check_model_accepts_gpt2_medium_at_the_seed_layouts():
    for tp, pp in ((2, 1), (1, 2), (2, 2), (4, 4), (8, 1)):
        dims(tp, pp, tp * pp).check_model(**SHAPE)


def test_rank_groups_follow_megatron_order():
    d = ParallelDims(tp=2, pp=2, dp=2)                 # 8 ranks: tp adjacent, then dp, pipeline outermost
    assert d.rank_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.rank_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.rank_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for dim in ("tp", "dp", "pp"):                     # every rank in exactly one group of each dimension
        assert sorted(r for g in d.rank_groups(dim) for r in g) == list(range(8))
    with pytest.raises(ValueError, match=r"'ep' is not one of pp, dp, tp"):
        d.rank_groups("ep")


def test_describe_lists_the_groups_compactly():
    assert ParallelDims(tp=2, pp=1, dp=2).describe() == (
        "mesh (pp=1, dp=2, tp=2) over 4 ranks, D = 4 / (T=2 x P=1)\n"
        "  tp groups: [0,1] [2,3]\n"
        "  dp groups: [0,2] [1,3]")
    assert ParallelDims().describe() == "mesh (pp=1, dp=1, tp=1) over 1 rank, D = 1 / (T=1 x P=1)"
    big = ParallelDims(tp=8, pp=4, dp=32).describe().splitlines()   # 1,024 ranks stay four lines
    assert big[1] == "  tp groups: [0-7] [8-15] [16-23] ... (128 groups) ... [1016-1023]"
    assert big[2] == "  pp groups: [0,256,512,768] [1,257,513,769] [2,258,514,770] ... (256 groups) ... [255,511,767,1023]"
    assert big[3] == "  dp groups: [0,8,..,248] [1,9,..,249] [2,10,..,250] ... (32 groups) ... [775,783,..,1023]"


def _mesh_on_4_ranks(rank, world, tp):
    d = ParallelDims(tp=tp, pp=1, dp=world // tp)
    mesh = d.build_mesh("cpu")
    ctx = DistContext.current("cpu").with_mesh(mesh)
    mine = lambda groups: next(g for g in groups if rank in g)           # noqa: E731
    # the groups the mesh made are the ones rank_groups (and the launch log) name
    assert dist.get_process_group_ranks(ctx.dp_group) == mine(d.rank_groups("dp"))
    assert dist.get_process_group_ranks(mesh["tp"].get_group()) == mine(d.rank_groups("tp"))
    # a sum over each group proves who is in it
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=ctx.dp_group)
    if ctx.model_parallel_group is None:
        return ctx.dp_rank, ctx.dp_size, x.item(), None
    assert dist.get_process_group_ranks(ctx.model_parallel_group) == mine(d.rank_groups("tp"))
    y = torch.tensor([float(rank)])
    dist.all_reduce(y, group=ctx.model_parallel_group)
    return ctx.dp_rank, ctx.dp_size, x.item(), y.item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp, expected", [
    # tp=2, dp=2: dp groups {0,2} {1,3}, model-parallel (tp) groups {0,1} {2,3}
    (2, [(0, 2, 2.0, 1.0), (0, 2, 4.0, 1.0), (1, 2, 2.0, 5.0), (1, 2, 4.0, 5.0)]),
    # no model parallelism: ZeRO's group is the world, and there is no model-parallel group
    (1, [(r, 4, 6.0, None) for r in range(4)]),
])
def test_build_mesh_and_dist_context_on_4_ranks(tp, expected):
    assert run_distributed(_mesh_on_4_ranks, 4, tp, timeout=100) == expected
