"""LiveBytes, a CPU run's device measure: what the ops make is counted until freed, views and in-place ops make
nothing, and activations kept through someone else's saved-tensor hooks (stage 3's) are counted all the same."""
import torch

from zerogpt.planner.live_bytes import LiveBytes


def test_new_storages_count_until_freed_and_views_count_nothing():
    base = torch.zeros(256)
    with LiveBytes() as live:
        x = torch.ones(1000)
        assert live.live == 4000
        view = x[10:20].t()
        x.add_(1)
        base.mul_(2)
        y = base.view(16, 16)
        assert live.live == 4000
        z = x * 2
        assert live.live == live.peak == 8000
        del x, view, z
        assert live.live == 0 and live.peak == 8000
    assert y.shape == (16, 16)


def _forward_backward(mlp, x):
    mlp(x).square().sum().backward()


def test_activations_kept_by_other_saved_tensor_hooks_are_counted():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(128, 64)
    with LiveBytes() as plain:
        _forward_backward(mlp, x)
    mlp.zero_grad(set_to_none=True)
    with LiveBytes() as hooked, torch.autograd.graph.saved_tensors_hooks(lambda t: ("kept", t), lambda p: p[1]):
        _forward_backward(mlp, x)
    hidden = 128 * 256 * 4  # one (tokens x 256) fp32 activation
    assert plain.peak >= 2 * hidden
    assert hooked.peak == plain.peak


def test_what_another_home_holds_is_left_out_while_it_is_held():
    """A storage made here and then held in another home (the host's grad shard at one rank) is not the device's
    from that moment: the peak counts it only while `elsewhere` does not name it."""
    held = set()
    with LiveBytes(lambda: held) as live:
        grad = torch.ones(1000)  # a reduced gradient buffer, 4000 bytes
        held.add(grad.untyped_storage().data_ptr())  # the engine takes it as the host's grad shard
        x = torch.ones(1500)  # the next micro-step's 6000 bytes: the device holds these alone
        assert live.live == 10000 and live.peak == 6000
        held.clear()  # back on the device
        y = torch.ones(1)
        assert live.peak == 10004
    del grad, x, y


def test_the_measure_lets_go_of_what_it_watched_when_it_ends():
    """A storage made under the mode that outlives it (an optimizer state made in the measured step) must not keep
    the measure, nor the engine its `elsewhere` names, alive: a CPU trial's whole engine stayed to the process's
    end that way (bench/auto_plan.py grew to 24 GB)."""
    import gc
    import weakref

    class Engine:  # what `elsewhere` closes over
        pass

    engine = Engine()
    gone = weakref.ref(engine)
    with LiveBytes(lambda: {id(engine)}) as live:
        state = torch.zeros(1000)  # outlives the mode
    measure = weakref.ref(live)
    del engine, live
    gc.collect()
    assert gone() is None and measure() is None
    assert state.sum() == 0


def test_a_trial_whose_step_raises_leaves_no_measure_behind():
    """The CPU measure is a dispatch mode and a global forward hook: a step that raises must take both away."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from zerogpt.planner.trial import StepClock

    class Engine:
        chunks = []

        def memory_stats(self):
            return {}

        def held_tensors(self):
            return iter(())

    class Trainer:
        class state:
            step = 0

    clock = StepClock(torch.device("cpu"), Engine(), measured_step=0)
    hooks_before = len(torch.nn.modules.module._global_forward_pre_hooks)
    clock.before_step(Trainer)
    assert isinstance(_get_current_dispatch_mode_stack()[-1], LiveBytes)
    clock.close()  # what run_trial's finally does when the step raised
    clock.close()
    assert not _get_current_dispatch_mode_stack()
    assert len(torch.nn.modules.module._global_forward_pre_hooks) == hooks_before
