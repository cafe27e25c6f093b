"""zero/host_step.py: the host step beside forward and backward runs on its own thread count (host.step_threads), so
the training thread that launches the GPU's work can keep cores of its own; the training thread's count stays."""
from __future__ import annotations

import pytest
import torch

from tests.zero.gpu_plan import planned
from tests.zero.recipes import lm_loss, tiny_gpt, token_batches
from tests.zero.reference import cpu_ctx, single_thread
from zerogpt.config.schema import HostConfig


def overlapped_engine(host: dict):
    """Stage 3, the optimizer on the host, the step behind the next forward as a GPU run plans it."""
    import zerogpt

    cfg = zerogpt.Config(dict(zero=dict(stage=3, offload_optimizer=dict(device="cpu")), host=host))
    with planned(host_step_overlaps=True):
        return zerogpt.initialize(tiny_gpt(), dict(type="HybridAdam", lr=1e-3), config=cfg, ctx=cpu_ctx())


@pytest.mark.timeout(120)
def test_the_host_step_takes_its_own_thread_count():
    with single_thread():
        engine = overlapped_engine(dict(step_threads=2))
        data = token_batches(1, 1, 1)
        engine.backward(lm_loss(engine, data[0, 0, 0], 0))
        engine.step()
        host_step = engine.sharded_optim.host_step
        assert host_step.overlaps and host_step.threads == 2
        assert host_step._start_worker().submit(torch.get_num_threads).result() == 2
        assert torch.get_num_threads() == 1  # the training thread's own
        assert "host step on 2 threads beside forward and backward" in engine.describe()
        engine.close()


@pytest.mark.timeout(120)
def test_by_default_the_host_step_has_the_training_threads_count():
    with single_thread():
        engine = overlapped_engine({})
        assert engine.sharded_optim.host_step.threads == torch.get_num_threads() == 1
        engine.close()


def test_step_threads_is_a_count_and_its_variable_overrides_it():
    with pytest.raises(ValueError, match=r"host.step_threads=0: expected a count of threads >= 1"):
        HostConfig(step_threads=0)
    assert HostConfig(step_threads=4).with_env_overrides({"ZEROGPT_HOST_STEP_THREADS": "12"}).step_threads == 12
    assert HostConfig(step_threads=4).with_env_overrides({}).step_threads == 4
    with pytest.raises(ValueError, match=r"\$ZEROGPT_HOST_STEP_THREADS='all': expected a count of threads >= 1"):
        HostConfig().with_env_overrides({"ZEROGPT_HOST_STEP_THREADS": "all"})
