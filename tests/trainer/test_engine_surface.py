"""zerogpt/trainer/engine_surface.py: the engine initialize() builds and the trainer tests' stand-in both have every
member of TrainingEngine, their methods take the calls the Trainer makes, and the model's own loss is the engine's
declared property (read from the model once, at build)."""
from __future__ import annotations

import inspect

import pytest
import torch

from tests.trainer.engine_double import EngineDouble
from zerogpt.trainer.engine_surface import TrainingEngine

VOCAB, SEQ = 64, 16


def members() -> dict[str, object]:
    """The protocol's own members: attributes (annotations), methods and properties."""
    own = {name: value for name, value in vars(TrainingEngine).items()
           if callable(value) or isinstance(value, property)}
    own = {n: v for n, v in own.items() if not n.startswith("_") or n == "__call__"}
    return {**dict.fromkeys(TrainingEngine.__annotations__), **own}


def assert_satisfies(engine: object) -> None:
    for name, declared in members().items():
        assert hasattr(engine, name), f"{type(engine).__name__} lacks {name}"
        if not inspect.isfunction(declared):
            continue
        wanted = inspect.signature(declared)
        given = inspect.signature(getattr(engine, name))
        # the Trainer's calls: the protocol's parameters, positional first, keywords by name with their defaults
        args = [object() for p in list(wanted.parameters.values())[1:]
                if p.default is inspect.Parameter.empty and p.kind == p.POSITIONAL_OR_KEYWORD]
        kwargs = {p.name: p.default for p in wanted.parameters.values()
                  if p.default is not inspect.Parameter.empty}
        given.bind(*args, **kwargs)  # raises TypeError when the engine's method cannot take that call
    assert isinstance(engine, TrainingEngine)  # what typing.runtime_checkable sees: every member present


def test_the_test_double_satisfies_the_surface():
    assert_satisfies(EngineDouble())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("chunked", [False, True])
def test_the_engine_satisfies_the_surface_and_declares_the_models_loss(chunked):
    import zerogpt
    from model_zoo.gpt import GPTLMLoss, gpt2_tiny
    from zerogpt.context import DistContext

    model = gpt2_tiny(vocab_size=VOCAB, max_position_embeddings=SEQ, chunked_loss=chunked, loss_chunk_size=8)
    cfg = zerogpt.Config(dict(zero=dict(stage=2)))
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), GPTLMLoss(shift=False),
                                config=cfg, ctx=DistContext.current())
    try:
        assert_satisfies(engine)
        assert engine.model_computes_loss is chunked
    finally:
        engine.close()


def test_a_missing_member_or_a_call_it_cannot_take_is_seen():
    engine = EngineDouble()
    del engine.model_computes_loss
    with pytest.raises(AssertionError, match="model_computes_loss"):
        assert_satisfies(engine)

    class NoExtraState(EngineDouble):
        def save_checkpoint(self, path):
            return path

    with pytest.raises(TypeError):
        assert_satisfies(NoExtraState())
