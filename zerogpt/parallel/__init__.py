"""Tensor and pipeline parallelism around ZeRO's data parallelism (Megatron's layout, torch's DTensor/pipelining).

mesh.py: the (pp, dp, tp) sizes from `parallel = dict(...)`, their checks, and the one DeviceMesh they come from.
context.py: the engine's view of that mesh (ZeRO over "dp", the grad norm summed over "pp" x "tp").
tensor.py, pipeline.py: the two plans; plan.py: both applied in one call (`parallelize`), and what the engine
then needs (`ParallelModel.context`, `.attach`). Import those from their modules: they pull in torch's
tensor-parallel and pipelining packages, which a data-parallel run does not need.
"""
from zerogpt.parallel.context import EngineContext, engine_context
from zerogpt.parallel.mesh import ParallelDims

__all__ = ["ParallelDims", "EngineContext", "engine_context"]
