"""Host bytes per parameter at stage 3 with parameters and Adam state offloaded to the host, fp32 and bf16, on CPU
(issue 30 point 1): the peak RSS of training steps, per parameter, stays under a bound, and the host RAM the
build line states (`Engine.host_bytes`) matches it within 10%.

The model is the issue's: a 532M-parameter GPT-2 (16 layers x 1536, vocab 50257) built on meta, so the build
costs the shards only. It runs in a fresh interpreter, so the peak (the kernel's VmHWM) is this run's alone,
measured from the RSS after imports and the meta build (interpreter, torch, the model's Python objects).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")

# The model state is 16 bytes/param (fp32 parameter shard = master, fp32 gradient shard, Adam m and v); the rest
# is what is in flight and what glibc keeps. Measured over 13 runs on the 2-core CI VM: 16.27-17.25
# bytes/param (ten at 16.27-16.35; 26.3 at first, then 19.2-20.4 before the two changes below), stated 16.02,
# 2-8% under the peak. What removed the rest: at one shard a gathered chunk is the shard itself (Chunk.gather:
# no copy of each chunk while it computes, and no fragmented heap from those copies, which grew ~0.05 bytes/param
# per layer in forward), and the tied embedding's gradient comes as rows added into the head's (grad_hooks.py:
# no dense embedding gradient and no third buffer for the sum, 1.2 bytes/param at the end of backward). The
# spread is the build's: the heap it frees (init values, shard staging) is 0-1.3 bytes/param and is not always
# reused by training's allocations; the second step now peaks <0.1 bytes/param above the first, so the gradient
# shards are still allocated per step (keeping them across steps would cost the wte gradient's steal: a copy of
# its 77M elements beside it at the end of backward). Since the build hands its freed heap back
# (host_memory.release_freed_host_memory): 16.32 in two runs.
# bf16, the precision of a GPU run, on this CPU: bf16 parameter shard 2 + the gradient kept as it crossed 2
# (ChunkState.keeps_as_crossed) + fp32 master 4 + Adam 8 = 16 bytes/param stated; measured 16.88-17.21 (with the
# gradient added into an fp32 shard, as before: stated 18.04, measured 20.28; and 17.57-18.03 before the build's
# freed heap was handed back, host_memory.release_freed_host_memory). Both precisions keep the bound
# and the match.
GOAL, BOUND = 18.0, 18.0
GOAL_MATCH, MATCH = 0.10, 0.10
PROBE = textwrap.dedent("""
    import json, sys, time, torch
    import zerogpt
    from model_zoo.gpt import GPT, GPTConfig
    from tests.zero.reference import cpu_ctx
    from zerogpt.optim import HybridAdam

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=16, n_head=24, n_embd=1536, vocab_size=50257, max_position_embeddings=64))
    cfg = dict(precision=sys.argv[1], host=dict(cpu_adam=sys.argv[2]),
               zero=dict(stage=3, offload_param=dict(device="cpu"), offload_optimizer=dict(device="cpu")))
    base = status("VmRSS")
    start = time.perf_counter()
    engine = zerogpt.initialize(model, dict(type=HybridAdam, lr=1e-4), config=cfg, ctx=cpu_ctx())
    build_s = time.perf_counter() - start
    stated = engine.host_bytes()
    tokens = torch.randint(0, 50257, (1, 33), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        logits = engine(tokens[:, :-1])
        engine.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
        engine.step()
        engine.zero_grad()
    print(json.dumps(dict(params=engine.num_params(), peak=status("VmHWM") - base, stated=stated,
                          build_s=build_s, line=engine.describe())))
""")


def probe(precision: str, kernel: str) -> tuple[dict, float, float]:
    """(the probe's report, peak bytes/param, stated bytes/param)."""
    out = subprocess.run([sys.executable, "-c", PROBE, precision, kernel], capture_output=True, text=True,
                         timeout=300, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r, r["peak"] / r["params"], r["stated"] / r["params"]


@pytest.mark.parametrize("precision, kernel", [("fp32", "torch"), ("bf16", "auto")])
def test_host_bytes_per_param_at_full_offload(precision, kernel):
    r, per_param, stated = probe(precision, kernel)
    print(f"{r['params'] / 1e6:.0f}M params, {precision}: peak {per_param:.2f} bytes/param, stated {stated:.2f}, "
          f"build {r['build_s']:.1f} s\n{r['line']}")
    assert f"({stated:.1f} bytes/param)" in r["line"]                     # the build line states it
    assert abs(r["peak"] - r["stated"]) <= MATCH * r["stated"], r         # and it is what the host holds
    assert per_param <= BOUND, r
