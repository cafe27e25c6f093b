"""The disk tier (issue 30 point 3): with zero.offload_optimizer.device='disk' the fp32 master and Adam state live
in memory-mapped files and a step streams them through RAM chunk by chunk (read ahead the next chunk, drop the
pages of the chunk just stepped: zero/offload.py Placement.prefetch / evict), so the host holds the compute copy
and the gradients plus a staging bound of two chunks' state, not the state itself.

A 23M-parameter GPT-2 (280 MB of master + Adam state) in 2 MB buckets (chunks of at most ~1.3M parameters), stage
3, params on the host, fp32, on CPU, in a fresh interpreter so the peak (VmHWM) is this run's alone. Measured on
the 2-core CI VM: 10.3-10.7 bytes/param with the state on disk against 17.8-18.9 with it in RAM.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from zerogpt.zero.offload import Placement

PROBE = textwrap.dedent("""
    import json, sys, torch
    import zerogpt
    from model_zoo.gpt import GPT, GPTConfig
    from tests.zero.reference import cpu_ctx
    from zerogpt.optim import HybridAdam
    from zerogpt.zero import BucketTensorShardStrategy

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

    device, path = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)  # the model's init_seed
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=8, n_head=8, n_embd=512, vocab_size=2048, max_position_embeddings=64))
    offload = dict(device=device, path=path) if device == "disk" else dict(device="cpu")
    cfg = dict(precision="fp32", host=dict(cpu_adam="torch"),
               zero=dict(stage=3, offload_param=dict(device="cpu"), offload_optimizer=offload,
                         shard_strategy=BucketTensorShardStrategy(bucket_mb=2)))
    base = status("VmRSS")
    engine = zerogpt.initialize(model, dict(type=HybridAdam, lr=1e-4), config=cfg, ctx=cpu_ctx())
    tokens = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        logits = engine(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    stats = engine.memory_stats()
    print(json.dumps(dict(params=engine.num_params(), peak=status("VmHWM") - base, losses=losses,
                          largest=max(c.plan.shard_numel for c in engine.chunks),
                          disk=sum(stats[c]["disk"] for c in stats))))
    engine.close()
""")


def _run(device: str, path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, device, path], capture_output=True, text=True, timeout=300,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_disk_tier_keeps_host_ram_to_compute_copy_gradients_and_staging(tmp_path):
    disk, ram = _run("disk", str(tmp_path)), _run("cpu", str(tmp_path))
    n = disk["params"]
    assert disk["disk"] >= 12 * n                                # master + m + v are in the files
    assert disk["losses"] == pytest.approx(ram["losses"], rel=1e-5)  # the same training
    # the fp32 param shards and gradient shards (8 bytes/param), two chunks' master + Adam state staged, and the
    # compute's own buffers and the heap the build frees, 1.4-1.8 bytes/param at this size over four runs (peak
    # 10.33-10.72): 3 leaves room for that spread and still fails the masters left resident after the build (13.9)
    staging = 2 * disk["largest"] * 12
    bound = 8 * n + staging + 3 * n
    print(f"{n / 1e6:.1f}M params: disk tier peak {disk['peak'] / n:.2f} bytes/param (bound {bound / n:.2f}: "
          f"staging {staging / n:.2f}), state in RAM {ram['peak'] / n:.2f}")
    assert disk["peak"] <= bound, disk
    assert disk["peak"] <= 0.7 * ram["peak"], (disk, ram)       # well below the all-in-RAM figure


def test_bf16_tensors_on_disk(tmp_path):
    """numpy has no bfloat16: a bf16 disk tensor is its file's bytes mapped as int16, viewed as bfloat16."""
    placement = Placement(torch.device("cpu"), disk_path=str(tmp_path))
    t = placement.empty(1000, torch.bfloat16, "disk", "exp_avg0")
    assert t.dtype == torch.bfloat16 and placement.is_disk_backed(t) and not t.any()
    values = torch.randn(1000).to(torch.bfloat16)
    t.copy_(values)
    placement.evict(t)  # pages leave this process; the file keeps the bytes
    placement.prefetch(t)
    assert torch.equal(t, values)
    with open(placement._disk[t.untyped_storage().data_ptr()].path, "rb") as f:
        on_disk = torch.frombuffer(bytearray(f.read()), dtype=torch.bfloat16)
    assert torch.equal(on_disk, values)
    placement.close()
