"""Bad input to the ZeRO engine fails early with a message that names the key, the value and the fix.

Covered: invalid stage / precision / shard strategy / zero keys, optimizers not built on the model,
parameters left out of the optimizer, step() without backward(), a non-scalar loss, a parameter whose
gradient arrives after its chunk was reduced (reentrant checkpointing of a shared layer), mixed devices
(meta vs cpu, cpu vs cuda), ctx.world_size that does not match the process group, and ranks that
built different models (the collectives would otherwise hang or fail mid-step).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import zerogpt
from tests.dist_utils import run_distributed
from tests.zero.reference import cpu_ctx


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 4)


def _init(model=None, optimizer=None, **config):
    model = model if model is not None else _linear()
    optimizer = optimizer if optimizer is not None else torch.optim.AdamW(model.parameters())
    return zerogpt.initialize(model, optimizer, config=config, ctx=cpu_ctx())


# ----------------------------------------------------------------------------------------------
# config


@pytest.mark.parametrize("stage,error,message", [
    (4, ValueError, r"zero\.stage must be one of 0, 1, 2, 3, got 4"),
    (-1, ValueError, r"zero\.stage must be one of 0, 1, 2, 3, got -1"),
    ("3", TypeError, r"zero\.stage must be int, got '3' \(str\)"),
    (True, TypeError, r"zero\.stage must be int, got True \(bool\)"),
])
def test_invalid_stage(stage, error, message):
    with pytest.raises(error, match=message):
        _init(zero=dict(stage=stage))


def test_invalid_precision_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"precision must be one of 'fp32', 'bf16', 'fp16', 'fp8', got 'int8'"):
        _init(precision="int8")
    with pytest.raises(ValueError, match=r"got 'bf32'.*did you mean 'fp32'|got 'bf32'.*'bf16'"):
        _init(precision="bf32")


@pytest.mark.parametrize("strategy", ["bucket", object(), 25])
def test_invalid_shard_strategy(strategy):
    with pytest.raises(TypeError, match=r"zero\.shard_strategy must be ShardStrategy, got"):
        _init(zero=dict(stage=2, shard_strategy=strategy))


def test_invalid_bucket_size():
    from zerogpt.zero import BucketTensorShardStrategy

    with pytest.raises(ValueError, match=r"bucket_mb=\.\.\.\) must be > 0, got -1"):
        BucketTensorShardStrategy(bucket_mb=-1)


def test_unknown_zero_key_suggests_the_nearest():
    with pytest.raises(ValueError, match=r"unknown key 'zero\.stag'.*did you mean 'zero\.stage'"):
        _init(zero=dict(stag=2))


def test_param_offload_needs_stage_3():
    with pytest.raises(ValueError, match=r"offload_param needs zero\.stage=3, got 2; pass --set zero\.stage=3"):
        _init(zero=dict(stage=2, offload_param=dict(device="cpu")))


# ----------------------------------------------------------------------------------------------
# optimizer


def test_optimizer_not_built_on_the_model():
    other = nn.Linear(3, 4)
    with pytest.raises(ValueError, match=r"optimizer holds 2 tensor\(s\) that are not parameters of the model; "
                                         r"build it on model\.parameters\(\)"):
        _init(optimizer=torch.optim.AdamW(other.parameters()), zero=dict(stage=2))


def test_trainable_parameter_missing_from_the_optimizer():
    model = _linear()
    with pytest.raises(ValueError, match=r"parameter 'bias' requires grad but is in no optimizer param group; "
                                         r"add it to the optimizer or set requires_grad=False"):
        _init(model, torch.optim.AdamW([model.weight]), zero=dict(stage=1))


@pytest.mark.parametrize("optimizer,error,message", [
    (dict(type="Adamw"), ValueError, r"optimizer\.type 'Adamw' is not one of AdamW, Adam, SGD, HybridAdam, CPUAdam; "
                                     r"did you mean 'AdamW'\? Or pass the class itself"),
    (dict(type=42), TypeError, r"optimizer\.type must be an optimizer class or one of AdamW, .*, got 42"),
    ("adam", TypeError, r"optimizer must be a torch\.optim\.Optimizer built on model\.parameters\(\) or a "
                        r"dict\(type=\.\.\., \*\*kwargs\), got str"),
])
def test_bad_optimizer_spec(optimizer, error, message):
    with pytest.raises(error, match=message):
        _init(optimizer=optimizer)


# ----------------------------------------------------------------------------------------------
# step protocol


def test_step_without_backward():
    engine = _init(zero=dict(stage=2))
    with pytest.raises(RuntimeError, match=r"engine\.step\(\) called without engine\.backward\(loss\).*"
                                           r"call engine\.backward\(loss\) first"):
        engine.step()
    engine.backward(engine(torch.randn(2, 3)).sum())
    engine.step()
    with pytest.raises(RuntimeError, match=r"without engine\.backward"):  # again after a completed step
        engine.step()
    engine.close()


def test_non_scalar_loss():
    engine = _init(zero=dict(stage=1))
    with pytest.raises(ValueError, match=r"expects a scalar loss, got shape \(2, 4\); reduce it first"):
        engine.backward(engine(torch.randn(2, 3)))
    engine.close()


class SharedAcrossReentrantSegments(nn.Module):
    """One layer in two reentrant checkpoint segments: its gradient arrives in two separate backward calls."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(3, 3)
        self.middle = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = checkpoint(lambda t: self.middle(self.shared(t)), x, use_reentrant=True)
        return checkpoint(self.shared, x, use_reentrant=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_second_gradient_after_the_reduction_is_refused(stage):
    from zerogpt.zero import TensorShardStrategy

    model = SharedAcrossReentrantSegments()
    engine = _init(model, zero=dict(stage=stage, shard_strategy=TensorShardStrategy()))
    with pytest.raises(RuntimeError, match=r"parameter 'shared\.(weight|bias)' got a second gradient in one backward"
                                           r".*checkpoint with use_reentrant=False"):
        engine.backward(engine(torch.randn(2, 3, requires_grad=True)).sum())
    engine.close()


# ----------------------------------------------------------------------------------------------
# devices


def test_meta_and_cpu_parameters_mixed():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))
    with pytest.raises(ValueError, match=r"parameter '1\.weight' is on the meta device .* values are unknown"):
        _init(model, zero=dict(stage=3))


def test_cpu_and_cuda_parameters_mixed():
    """Checked before any data moves, so fake parameters stand in for a CUDA one on a CPU-only box."""
    from zerogpt.build_engine import _check_devices

    params = [("a.weight", SimpleNamespace(device=torch.device("cpu")), 0),
              ("b.weight", SimpleNamespace(device=torch.device("cuda", 0)), 0)]
    with pytest.raises(ValueError, match=r"parameters are on mixed devices .*'cpu': 'a\.weight'.*"
                                         r"'cuda': 'b\.weight'|parameters are on mixed devices .*'cuda': 'b\.weight'"):
        _check_devices(params)


# ----------------------------------------------------------------------------------------------
# distributed mismatches


def _world_size_mismatch(rank: int, world: int) -> str:
    ctx = cpu_ctx(rank, world=2)  # but the process group has 1 rank
    model = _linear()
    try:
        zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=dict(zero=dict(stage=2)), ctx=ctx)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(90)
def test_ctx_dp_size_must_match_the_process_group():
    [message] = run_distributed(_world_size_mismatch, 1, timeout=60)
    assert "ctx.dp_size=2 but its process group has 1 ranks; pass the context from launch_from_torch" in message


def _different_models(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = nn.Linear(4, 4 + rank)  # rank 1 built a different model
    try:
        zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=dict(zero=dict(stage=3)),
                           ctx=cpu_ctx(rank, world))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(90)
def test_ranks_with_different_models_fail_at_initialize_on_every_rank():
    messages = run_distributed(_different_models, 2, timeout=60)
    for message in messages:  # every rank raises (no rank is left waiting in a collective)
        assert "rank 0 and rank 1 built different ZeRO layouts (padded elements: 20 vs 26" in message
        assert "every rank must build the same model with the same zero/precision config" in message
