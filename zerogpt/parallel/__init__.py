"""Tensor and pipeline parallelism around ZeRO's data parallelism (Megatron's layout, torch's DTensor/pipelining).

mesh.py: the (pp, dp, tp) sizes from `parallel = dict(...)`, their checks, and the one DeviceMesh they come from.
parallel_model.py: ParallelModel, what `initialize` learns of a model the plans changed.
tensor.py, pipeline.py: the two plans, the same for every model_zoo family but what families.py says of it (GPT,
the Llama family); plan.py: both applied in one call (`parallelize`). Import those from their
modules: they pull in torch's tensor-parallel and pipelining packages, which a data-parallel run does not need.
"""
from zerogpt.parallel.mesh import ParallelDims
from zerogpt.parallel.parallel_model import ParallelModel

__all__ = ["ParallelDims", "ParallelModel"]
