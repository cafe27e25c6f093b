"""A two-rank script that trains on the engine and returns without engine.close() or ctx.destroy() (issue 31.9).

    python tests/zero/exit_without_close.py RANK WORLD RENDEZVOUS_FILE REPORT_FILE

ZeRO-2 with the optimizer offloaded and the shared-memory transport on (the defaults): train, write a result,
barrier, return. Its first atexit handler (so the last to run) records whether the transport's thread was
joined and the process group destroyed by then.
"""
import atexit
import os
import sys
import threading

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def report(path: str) -> None:
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("zerogpt"))
    with open(path, "a") as f:
        f.write(f"threads={threads} initialized={dist.is_initialized()}\n")


def main(rank: int, world: int, rendezvous: str, report_path: str) -> int:
    import zerogpt
    from zerogpt.launch import launch_from_torch

    atexit.register(report, report_path)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    ctx = launch_from_torch(seed=0, device="cpu", init_method=f"file://{rendezvous}")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    cfg = zerogpt.Config(dict(zero=dict(stage=2, offload_optimizer=dict(device="cpu"))))
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg, ctx=ctx)
    assert engine.transport is not None, "the shared-memory transport is what this script exercises"
    for step in range(2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank * 10 + step))
        engine.backward(engine(x).square().mean())
        engine.step()
        engine.zero_grad()
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]))
