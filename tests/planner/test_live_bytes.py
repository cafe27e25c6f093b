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
