"""Tensor and pipeline parallelism around ZeRO's data parallelism (Megatron's layout, torch's DTensor/pipelining).

mesh.py: the (pp, dp, tp) sizes from `parallel = dict(...)`, their checks, and the one DeviceMesh they come from.
"""
from zerogpt.parallel.context import EngineContext, engine_context
from zerogpt.parallel.mesh import ParallelDims

__all__ = ["ParallelDims", "EngineContext", "engine_context"]
