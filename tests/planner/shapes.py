"""Small shapes and machines the planner tests share."""
from zerogpt.memory_model import ModelShape
from zerogpt.planner.plan import GIB, Machine, Workload

XL = ModelShape(layers=48, hidden=1600, heads=25)  # GPT-2 XL
TINY = ModelShape(layers=2, hidden=64, heads=2, vocab=1024, positions=256)  # model_zoo's gpt2_tiny


def gpu(device_gib: float, host_gib: float = 128, disk_gib: float | None = None, ranks: int = 1) -> Machine:
    return Machine(device_bytes=int(device_gib * GIB), host_bytes=int(host_gib * GIB),
                   disk_bytes=None if disk_gib is None else int(disk_gib * GIB), local_ranks=ranks,
                   name="NVIDIA H100 80GB HBM3")


def xl_work(**kw) -> Workload:
    return Workload(**{**dict(shape=XL, seq_len=1024, tokens_per_step=64 * 1024), **kw})
