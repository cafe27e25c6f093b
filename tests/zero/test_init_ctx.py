"""ZeroInitContext: a model built under it gets, after initialize() on 1-3 gloo ranks at any stage, bit-exactly the
weights of plain construction with the same seed; it is never materialised whole; the RNG stream, training and
torch itself are as if the context had not been used.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import zerogpt
from model_zoo.gpt import gpt2_tiny
from tests.dist_utils import run_distributed
from tests.zero.init_checks import LargestAllocation, mean_losses
from zerogpt.zero import BucketTensorShardStrategy, TensorShardStrategy
from zerogpt.zero.init_ctx import ZeroInitContext, recorded_init
from zerogpt.context import DistContext

SEED = 1234


class InitZoo(nn.Module):
    """Init ops beyond nn.Linear's, on odd shapes (shards split parameters mid-way): orthogonal_ (QR, sign, copy),
    trunc_normal_ (rejection sampling with value reads), sparse_ (randperm + index_put_), an explicit generator, a
    random factory scaled out of place, a copy from a real tensor, in-place ops on slices and on another
    parameter's views, a frozen parameter, a causal-mask buffer and a torch.tensor one."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(13, 7)
        nn.init.orthogonal_(self.proj.weight)
        self.emb = nn.Embedding(11, 5, padding_idx=3)
        nn.init.trunc_normal_(self.emb.weight, std=0.5, a=-1.0, b=1.0)
        self.sparse = nn.Parameter(torch.empty(9, 6))
        nn.init.sparse_(self.sparse, sparsity=0.5)
        self.seeded = nn.Parameter(torch.empty(17))
        self.seeded.data.normal_(generator=torch.Generator().manual_seed(7))
        self.scaled = nn.Parameter(torch.randn(3, 5) * 0.02)
        self.copied = nn.Parameter(torch.empty(4, 3))
        self.frozen = nn.Parameter(torch.rand(5), requires_grad=False)
        with torch.no_grad():
            self.copied.copy_(torch.linspace(-1.0, 1.0, 12, device="cpu").view(4, 3))
            self.copied.add_(self.scaled[:, :3].t()[:1].expand(4, 3)).div_(0.3, rounding_mode="floor")
            self.proj.bias[2:5].mul_(3.0).add_(1.0)
        self.register_buffer("mask", torch.ones(6, 6).tril().bool(), persistent=False)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


MODELS = {
    "gpt2_tiny": lambda: gpt2_tiny(),
    # odd widths and vocab (padded 100 -> 128), dropout, tied head
    "gpt_odd": lambda: gpt2_tiny(vocab_size=100, n_embd=48, n_head=3, n_inner=100, max_position_embeddings=37,
                                 dropout=0.1),
    "init_zoo": InitZoo,
}


def build(name: str, under_ctx: bool, cfg=None) -> tuple[nn.Module, torch.Tensor]:
    """(model, CPU RNG state right after construction), from seed SEED."""
    torch.manual_seed(SEED)
    if under_ctx:
        with ZeroInitContext(cfg):
            model = MODELS[name]()
    else:
        model = MODELS[name]()
    return model, torch.get_rng_state()


def make_config(stage: int, strategy=None, precision: str = "fp32") -> zerogpt.Config:
    strategy = strategy or BucketTensorShardStrategy(bucket_mb=0.02)
    return zerogpt.Config(dict(zero=dict(stage=stage, shard_strategy=strategy), precision=precision))


def plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What engine.state_dict_full() holds: unique parameters (a tied one once) and every buffer."""
    return {n: t.detach() for n, t in [*model.named_parameters(), *model.named_buffers()]}


# ----------------------------------------------------------------------------------------------
# in one process: the recording replays to plain construction


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(MODELS))
def test_replay_equals_plain_construction_and_rng_stream(name):
    ref, ref_rng = build(name, under_ctx=False)
    model, rng = build(name, under_ctx=True)
    assert torch.equal(rng, ref_rng), "the RNG stream after the context differs from plain construction"
    init = recorded_init(model)
    for n, p in ref.named_parameters():
        assert torch.equal(init.param_value(n), p.detach()), n
    buffers = init.buffer_values()
    assert set(buffers) == {n for n, _ in ref.named_buffers()}
    for n, b in ref.named_buffers():
        assert buffers[n].dtype == b.dtype and torch.equal(buffers[n], b), n
    assert torch.equal(torch.get_rng_state(), ref_rng), "replay must leave the RNG where it found it"


@pytest.mark.timeout(120)
def test_hugging_face_gpt2_replays_bit_exactly():
    """HF skips its weight init when it detects a meta "current device"; ours must not look like one."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=101, n_positions=40, bos_token_id=None,
                     eos_token_id=None)
    torch.manual_seed(SEED)
    ref = GPT2LMHeadModel(cfg)
    ref_rng = torch.get_rng_state()
    torch.manual_seed(SEED)
    with ZeroInitContext():
        model = GPT2LMHeadModel(cfg)
    assert torch.equal(torch.get_rng_state(), ref_rng)
    init = recorded_init(model)
    for n, p in ref.named_parameters():
        assert torch.equal(init.param_value(n), p.detach()), n


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(MODELS))
def test_nothing_is_materialised_inside_the_context(name):
    """Every parameter and buffer has meta storage (shown to Python as a CPU tensor inside the context, plainly
    meta after it); real storage never exceeds one parameter (the scratch a random op runs on to advance the RNG,
    and the replay behind a value read such as trunc_normal_'s rejection test)."""
    watch = LargestAllocation()
    torch.manual_seed(SEED)
    with watch, ZeroInitContext():
        model = MODELS[name]()
        tensors = [*model.parameters(), *model.buffers()]
        assert all(t.untyped_storage().device.type == "meta" for t in tensors)
        assert all(t.device.type == "cpu" and not t.is_meta for t in tensors)
    assert all(t.is_meta for t in tensors)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < watch.max_bytes <= largest, (watch.max_bytes, largest)


def _torch_state() -> dict:
    import torch.nn.modules.module as module_mod

    return dict(dispatch_modes=len(_get_current_dispatch_mode_stack()),
                function_modes=torch._C._len_torch_function_stack(),
                param_hooks=len(module_mod._global_parameter_registration_hooks),
                buffer_hooks=len(module_mod._global_buffer_registration_hooks),
                default_device=torch.get_default_device())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fail_inside", [False, True])
def test_torch_is_unchanged_after_the_context(fail_inside):
    before = _torch_state()
    if fail_inside:
        with pytest.raises(KeyError, match="boom"):
            with ZeroInitContext():
                nn.Linear(3, 4)
                raise KeyError("boom")
    else:
        with ZeroInitContext():
            nn.Linear(3, 4)
    assert _torch_state() == before
    lin = nn.Linear(3, 4)
    assert lin.weight.device.type == "cpu" and not lin.weight.is_meta
    assert torch.zeros(2).device.type == "cpu" and torch.randn(2).isfinite().all()


@pytest.mark.timeout(60)
def test_value_reads_inside_the_context_see_plain_values():
    torch.manual_seed(SEED)
    ref = nn.Linear(3, 2)
    ref_rng = torch.get_rng_state()
    torch.manual_seed(SEED)
    with ZeroInitContext():
        lin = nn.Linear(3, 2)
        assert lin.bias.tolist() == ref.bias.tolist() and lin.weight[1, 2].item() == ref.weight[1, 2].item()
        assert torch.equal(lin.weight, lin.weight) and lin.weight.to("cpu") is lin.weight
    assert torch.equal(torch.get_rng_state(), ref_rng)


_TO_CALLS = [  # Tensor.to's three forms, positional and by keyword ("other" stands for a float16 tensor)
    ((torch.float16,), {}), (("cpu",), {}), ((None,), {}), (("cpu", torch.float64), {}), (("other",), {}),
    ((), {"tensor": "other"}), ((), {"dtype": torch.float64, "copy": True}), ((torch.float32, False, True), {}),
    (("cpu", torch.float32, True, True), {}), (("cpu",), {"memory_format": torch.channels_last}),
    (("other", True), {}), ((), {"device": torch.device("cpu"), "non_blocking": True}),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,kwargs", _TO_CALLS, ids=[f"{a}-{k}" for a, k in _TO_CALLS])
def test_tensor_to_inside_the_context_acts_as_on_the_cpu(args, kwargs):
    """The facade parses Tensor.to's arguments itself: every form gives what it gives on a plain CPU tensor (the
    dtype, the layout, the values, the same tensor back when nothing changes), with no device but the CPU."""
    def to(x: torch.Tensor, other: torch.Tensor) -> tuple:
        fill = lambda a: other if isinstance(a, str) and a == "other" else a  # noqa: E731
        y = x.to(*map(fill, args), **{k: fill(v) for k, v in kwargs.items()})
        return y.dtype, y.device, y.stride(), y is x, y.tolist()

    torch.manual_seed(SEED)
    plain = to(torch.randn(2, 3, 4, 5), torch.zeros(1, dtype=torch.float16))
    torch.manual_seed(SEED)
    with ZeroInitContext():
        assert to(torch.randn(2, 3, 4, 5), torch.zeros(1, dtype=torch.float16)) == plain


@pytest.mark.timeout(60)
def test_tensor_to_inside_the_context_rejects_what_torch_rejects():
    with ZeroInitContext():
        x = torch.zeros(2)
        with pytest.raises(TypeError):
            x.to(torch.float16, device="cpu")  # the dtype form takes no device
        with pytest.raises(TypeError):
            x.to("cpu", "cpu")
        with pytest.raises(RuntimeError, match=r"builds on the CPU.*got device='cuda'"):
            x.to("cuda", torch.float16)
        with pytest.raises(RuntimeError, match=r"builds on the CPU.*got device='cuda'"):
            x.to(device="cuda")


@pytest.mark.timeout(60)
def test_unsupported_ops_name_the_op_and_the_parameter():
    before = _torch_state()
    with pytest.raises(RuntimeError, match=r"aten\.nonzero.*Linear\.weight \(2, 3\).*after zerogpt\.initialize"):
        with ZeroInitContext():
            torch.nonzero(nn.Linear(3, 2).weight)
    with pytest.raises(RuntimeError, match=r"aten\.masked_select.*computed from Linear\.bias"):
        with ZeroInitContext():
            lin = nn.Linear(3, 2)
            torch.masked_select(lin.weight, lin.bias.unsqueeze(1) > 0)
    with pytest.raises(RuntimeError, match=r"builds on the CPU.*got device='cuda'"):
        with ZeroInitContext():
            torch.zeros(2, device="cuda")
    assert _torch_state() == before


@pytest.mark.timeout(60)
def test_meta_tensors_the_context_did_not_record_are_rejected():
    with torch.device("meta"):
        foreign = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"'weight' is on the meta device but was not built inside"):
        zerogpt.initialize(foreign, torch.optim.AdamW(foreign.parameters()), config=make_config(3),
                           ctx=DistContext.current())
    with ZeroInitContext():
        late = nn.Linear(2, 2)
    with torch.no_grad():
        late.weight.zero_()  # on meta, outside the context: not recorded
    with pytest.raises(ValueError, match=r"'weight' was modified in place after its ZeroInitContext exited"):
        recorded_init(late)
    src = torch.linspace(0.0, 1.0, 4, device="cpu")
    with ZeroInitContext():
        copied = nn.Linear(2, 2)
        with torch.no_grad():
            copied.weight.view(-1).copy_(src)
    src.add_(1.0)
    with pytest.raises(RuntimeError, match="was modified in place after it was used"):
        recorded_init(copied).param_value("weight")


@pytest.mark.timeout(60)
def test_nesting_and_initialize_inside_are_rejected():
    assert zerogpt.ZeroInitContext is ZeroInitContext
    with pytest.raises(RuntimeError, match="cannot be nested"):
        with ZeroInitContext():
            with ZeroInitContext():
                pass
    with pytest.raises(RuntimeError, match="initialize was called inside a ZeroInitContext"):
        with ZeroInitContext():
            early = nn.Linear(2, 2)
            zerogpt.initialize(early, torch.optim.AdamW(early.parameters()), config=make_config(3),
                               ctx=DistContext.current())
    assert _torch_state()["dispatch_modes"] == 0


# ----------------------------------------------------------------------------------------------
# on 1-3 gloo ranks: initialize() replays each rank's shards


SHARDINGS = [(stage, "bucket") for stage in (0, 1, 2, 3)] + [(3, "tensor"), (2, "tensor")]


def _sharded_init(rank: int, world: int) -> dict:
    import os

    # No shared-memory transport (this spawned process only): each engine would open its own inside the watched
    # construction, and its staging buffer is communication, not model state.
    os.environ["ZEROGPT_SHM_COMM"] = "0"
    out = {}
    for name in MODELS:
        for stage, kind in SHARDINGS:
            cfg = make_config(stage, TensorShardStrategy() if kind == "tensor" else None)
            watch = LargestAllocation()
            with watch:
                model, rng = build(name, True, cfg)
                engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg,
                                            ctx=DistContext.current())
            tied = name == "init_zoo" or model.lm_head.weight is model.transformer.wte.weight
            largest_shard = max(c.plan.shard_numel for c in engine.chunks) * 4
            out[(name, stage, kind)] = dict(state=engine.state_dict_full(), rng=rng, tied=tied,
                                            max_bytes=watch.max_bytes, largest_shard=largest_shard,
                                            num_chunks=len(engine.chunks),
                                            params_bytes=sum(engine.memory_stats()["params"].values()))
            engine.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_weights_equal_plain_construction(world):
    results = run_distributed(_sharded_init, world, timeout=280)
    for name in MODELS:
        ref, ref_rng = build(name, under_ctx=False)
        expected = plain_state(ref)
        largest_param = max(p.numel() * p.element_size() for p in ref.parameters())
        total = sum(p.numel() * p.element_size() for p in ref.parameters())
        for stage, kind in SHARDINGS:
            r = results[0][(name, stage, kind)]
            what = f"{name} stage={stage} {kind} world={world}"
            assert set(r["state"]) == set(expected), what
            for n, t in expected.items():
                assert r["state"][n].dtype == t.dtype and torch.equal(r["state"][n], t), f"{what}: {n}"
            assert r["tied"], f"{what}: the tied head lost its tie"
            for rank_result in results:
                got = rank_result[(name, stage, kind)]
                assert torch.equal(got["rng"], ref_rng), what
                if stage == 3:  # never the whole model: one parameter or one shard at a time, shards at rest
                    assert got["max_bytes"] <= max(largest_param, got["largest_shard"]), (what, got["max_bytes"])
                    # 1/N of the model, plus under one element of padding per chunk
                    assert got["params_bytes"] <= total / world + 4 * got["num_chunks"], (what, got, total)


STEPS = 3


def _train(rank: int, world: int) -> dict:
    out = {}
    for stage, precision in ((3, "fp32"), (1, "bf16")):
        for under_ctx in (False, True):
            cfg = make_config(stage, precision=precision)
            model, _ = build("gpt_odd", under_ctx, cfg)  # dropout 0.1: the RNG stream after initialize matters
            engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), config=cfg,
                                        ctx=DistContext.current())
            losses = mean_losses(engine, 100, STEPS, rank, world)
            out[(stage, precision, under_ctx)] = (losses, engine.state_dict_full())
            engine.close()
    return out


@pytest.mark.timeout(240)
def test_training_after_the_context_matches_plain_construction():
    results = run_distributed(_train, 2, timeout=220)[0]
    for stage, precision in ((3, "fp32"), (1, "bf16")):
        plain_losses, plain_params = results[(stage, precision, False)]
        ctx_losses, ctx_params = results[(stage, precision, True)]
        torch.testing.assert_close(torch.tensor(ctx_losses), torch.tensor(plain_losses), rtol=1e-6, atol=0)
        for n, t in plain_params.items():
            torch.testing.assert_close(ctx_params[n], t, rtol=1e-6, atol=0,
                                       msg=lambda m: f"stage={stage} {precision} {n}: {m}")
