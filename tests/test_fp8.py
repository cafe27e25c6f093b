"""`precision = "fp8"` (zerogpt/fp8.py): the config path, the refusals, the module conversion and its checkpoints.

On the CPU: precision="fp8" is a valid key with compile=True and refused without it; which layers the size filter
keeps bf16 (on meta models); initialize refuses a device without float8 matmuls and a missing
torchao with the fix in the message; the conversion swaps the blocks' Linear layers for torchao's Float8Linear
and leaves the LM head; state dicts keep the plain keys (a converted model's checkpoint loads into a plain GPT
and exports to Hugging Face). A ZeRO-3 engine over a converted model trains, saves and resumes on the CPU
(torch's CPU float8 matmul emulates the kernel: this checks the engine's hooks on Float8Linear, not speed).
The loss check against bf16 needs a float8 GPU: marked `gpu`.
"""
from __future__ import annotations

import sys

import pytest
import torch

import zerogpt
from model_zoo.gpt import LMHead, gpt2_tiny
from tests.zero.reference import cpu_ctx, train_losses
from zerogpt.amp import compute_dtype
from zerogpt.config import engine_config
from zerogpt.context import DistContext
from zerogpt.fp8 import check_fp8_device, convert_linears, float8_choice

VOCAB, SEQ = 128, 16


def tiny(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt2_tiny(vocab_size=VOCAB, max_position_embeddings=SEQ, **kw)


def float8_linear() -> type:
    return pytest.importorskip("torchao.float8.float8_linear").Float8Linear


def test_config_accepts_fp8_compiled_and_refuses_it_eager():
    assert engine_config(zerogpt.Config(dict(precision="fp8", compile=True))).precision == "fp8"
    assert engine_config(zerogpt.Config().apply_overrides(["precision=fp8", "compile=true"])).precision == "fp8"
    assert compute_dtype("fp8") == torch.bfloat16  # everything outside the float8 matmuls
    for eager in (lambda: engine_config(zerogpt.Config(dict(precision="fp8"))),
                  lambda: zerogpt.Config().apply_overrides(["precision=fp8"])):  # --set checks at once
        with pytest.raises(ValueError, match=r"runs only compiled.*set compile=True \(--set compile=true\)") as e:
            eager()
        assert "\n" not in str(e.value)


def test_initialize_refuses_a_device_without_float8_matmuls():
    model = tiny()
    with pytest.raises(ValueError, match=r"compute capability 8\.9 or newer.*'cpu'.*precision='bf16'"):
        zerogpt.initialize(model, torch.optim.AdamW(model.parameters()),
                           config=zerogpt.Config(dict(precision="fp8", compile=True)), ctx=cpu_ctx())
    assert type(model.transformer.h[0].mlp.c_fc) is torch.nn.Linear  # refused before converting anything
    with pytest.raises(ValueError, match="compute capability"):
        check_fp8_device(torch.device("cpu"))


def test_missing_torchao_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import torchao.float8 raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'zerogpt\[fp8\]'"):
        convert_linears(tiny())


def test_conversion_swaps_the_block_linears_and_keeps_the_head():
    cls = float8_linear()
    model = tiny()
    params = [id(p) for p in model.parameters()]
    # c_attn, attn.c_proj, c_fc, mlp.c_proj per block (all small: the size filter off)
    assert convert_linears(model, only_gaining=False) == 4 * model.config.n_layer
    for block in model.transformer.h:
        for linear in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
            assert isinstance(linear, cls)
    assert type(model.lm_head) is LMHead and model.lm_head.weight is model.transformer.wte.weight
    assert [id(p) for p in model.parameters()] == params  # the optimizer's and ZeRO's Parameters, unchanged


def test_layers_too_small_to_gain_stay_bf16():
    """torchao's tensorwise rule (zerogpt/fp8.py): in <= 4096 and out <= 1024 stays bf16, as do the head and dims
    not multiples of 16. Decided on shapes alone: a meta model, no float8 matmul."""
    with torch.device("meta"):
        model = torch.nn.ModuleDict(dict(
            kv=torch.nn.Linear(3072, 1024), q=torch.nn.Linear(3072, 3072), up=torch.nn.Linear(3072, 8192),
            wide_in=torch.nn.Linear(8192, 1024), xl_proj=torch.nn.Linear(1600, 1600), small=torch.nn.Linear(512, 512),
            odd=torch.nn.Linear(1000, 8192), lm_head=torch.nn.Linear(3072, 128256)))
    want = dict(kv=False, q=True, up=True, wide_in=True, xl_proj=True, small=False, odd=False, lm_head=False)
    assert float8_choice(model) == want
    cls = float8_linear()
    assert convert_linears(model) == sum(want.values())
    assert {name: isinstance(m, cls) for name, m in model.items()} == want


def test_llama_3b_keeps_its_kv_projections_and_head_bf16():
    from model_zoo.llama import llama3_2_3b

    with torch.device("meta"):
        model = llama3_2_3b()
    layer = {name.split("layers.0.", 1)[1]: on for name, on in float8_choice(model).items() if "layers.0." in name}
    assert layer == {"self_attn.q_proj": True, "self_attn.k_proj": False, "self_attn.v_proj": False,
                     "self_attn.o_proj": True, "mlp.gate_proj": True, "mlp.up_proj": True, "mlp.down_proj": True}
    assert float8_choice(model)["lm_head"] is False


def test_zerogpt_imports_without_torchao():
    import subprocess

    code = "import sys, zerogpt, zerogpt.fp8, zerogpt.config; assert 'torchao' not in sys.modules, 'torchao'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_state_dict_round_trip_has_the_plain_keys(tmp_path):
    float8_linear()
    plain, converted = tiny(), tiny()
    convert_linears(converted, only_gaining=False)
    with torch.no_grad():
        for p in converted.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not the init: a loaded value must come from the file
    state = converted.state_dict()
    assert list(state) == list(plain.state_dict())
    torch.save(state, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt")
    again = tiny()
    convert_linears(again, only_gaining=False)
    again.load_state_dict(loaded)
    plain.load_state_dict(loaded)  # strict: the same keys and shapes as a model never converted
    for name, tensor in state.items():
        assert torch.equal(again.state_dict()[name], tensor), name
        assert torch.equal(plain.state_dict()[name], tensor), name
    from model_zoo.gpt import to_hf

    pytest.importorskip("transformers")
    hf_state = to_hf(converted).state_dict()
    assert torch.equal(hf_state["transformer.h.0.mlp.c_fc.weight"], state["transformer.h.0.mlp.c_fc.weight"].t())


def test_compiled_float8_blocks_trace_in_one_graph():
    """compile = True with fp8: the blocks' Float8Linear trace into the blocks' one graph, no graph break."""
    float8_linear()
    from tests.test_compile import CountingBackend
    from zerogpt.compile import compile_blocks

    torch._dynamo.reset()
    model = tiny()
    convert_linears(model, only_gaining=False)
    model = model.to(torch.bfloat16)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    expected = model(x, labels=x).loss
    backend = CountingBackend()
    assert compile_blocks(model, backend=backend) == 2
    for _ in range(2):
        loss = model(x, labels=x).loss
        loss.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-3)  # bf16 loss of the same computation
    assert backend.graphs == 1
    torch._dynamo.reset()


def _fp8_engine(ctx: DistContext):
    """The tiny GPT converted by hand on a ZeRO-3 bf16 engine (the engine's fp8 path refuses the CPU)."""
    from zerogpt.zero import BucketTensorShardStrategy

    model = tiny()
    convert_linears(model, only_gaining=False)
    zero = dict(stage=3, shard_strategy=BucketTensorShardStrategy(bucket_mb=0.02))
    return zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                              config=zerogpt.Config(dict(zero=zero, precision="bf16")), ctx=ctx)


@pytest.mark.timeout(120)
def test_zero3_engine_over_float8_linears_resumes_exactly(tmp_path):
    float8_linear()
    torch.set_num_threads(1)
    data = torch.randint(0, VOCAB, (4, 2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    straight = _fp8_engine(cpu_ctx())
    expected = train_losses(straight, data)
    straight.close()
    assert all(torch.isfinite(torch.tensor(expected)))
    first = _fp8_engine(cpu_ctx())
    head = train_losses(first, data[:2])
    first.save_checkpoint(str(tmp_path / "step_2"))
    first.close()
    resumed = _fp8_engine(cpu_ctx())
    resumed.load_checkpoint(str(tmp_path / "step_2"))
    assert head + train_losses(resumed, data[2:]) == expected
    resumed.close()


def half_predictable(step: int, batch: int = 16, seq: int = 64) -> torch.Tensor:
    """(batch, seq + 1) tokens, fresh each step: even positions random, each odd one a function of the token
    before it. The loss floor is ln(VOCAB) / 2 = 2.43 (half the targets are noise), and fresh data leaves nothing
    to memorise, so a trained model's loss sits at the floor whatever its precision, unless the precision hurts."""
    x = torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(step))
    x[:, 1::2] = (x[:, 0:-1:2] * 7 + 3) % VOCAB
    return x


def demo_losses(precision: str, ctx: DistContext, steps: int = 150) -> list[float]:
    """A demo-size GPT (4 layers, width 256) trained on half_predictable batches at `precision`, ZeRO-2, lr 5e-4
    and clipping at 1 (at lr 1e-3 without clipping a bf16 run spiked by 0.14 at step 180 on the CPU)."""
    torch.manual_seed(0)
    model = gpt2_tiny(vocab_size=VOCAB, max_position_embeddings=64, n_layer=4, n_head=4, n_embd=256)
    config = zerogpt.Config(dict(zero=dict(stage=2), precision=precision, clip_grad_norm=1.0,
                                 compile=precision == "fp8"))  # fp8 runs only compiled
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=5e-4), config=config, ctx=ctx)
    losses = train_losses(engine, torch.stack([half_predictable(s) for s in range(steps)]).to(ctx.device))
    engine.close()
    return losses


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_cuda_fp8_reaches_the_bf16_loss():
    """fp8's mean loss over the last 20 of 150 steps is within 0.02 of bf16's, both at the floor."""
    float8_linear()
    ctx = DistContext(0, 1, torch.device("cuda", torch.cuda.current_device()), local_rank=0)
    check_fp8_device(ctx.device)
    tails = {precision: sum(demo_losses(precision, ctx)[-20:]) / 20 for precision in ("bf16", "fp8")}
    assert tails["bf16"] < 2.6, tails  # it learned the predictable half (ln 128 = 4.85 at the start)
    assert abs(tails["fp8"] - tails["bf16"]) < 0.02, tails
