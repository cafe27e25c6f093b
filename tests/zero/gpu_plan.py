"""A GPU run's build decisions, taken on this CPU: `initialize()` inside `planned(...)` builds from an EnginePlan
with those fields replaced (zerogpt/build_engine.py: the plan records every decision of the build, and a GPU
computing sets `hand_over_at_launch`, `host_step_overlaps` and `stages_compute_copies`). The code that follows a
decision is the same on both devices, so CPU tests exercise it. Works in spawned ranks too (a module attribute of
the rank's own process)."""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any, Iterator
from unittest import mock

import zerogpt.build_engine as build_engine
from zerogpt.zero.chunk_state import ChunkState


@contextmanager
def planned(**decisions: Any) -> Iterator[None]:
    """Within the block, `plan_engine` returns its plan with `decisions` (EnginePlan field -> value) in place."""
    plan_engine = build_engine.plan_engine

    def replaced(*args: Any, **kwargs: Any) -> build_engine.EnginePlan:
        return dataclasses.replace(plan_engine(*args, **kwargs), **decisions)

    build_engine.plan_engine = replaced
    try:
        yield
    finally:
        build_engine.plan_engine = plan_engine


@contextmanager
def device_master() -> Iterator[None]:
    """Within the block, a chunk's master steps as one on the device would (not CPUAdam's host step): the route a
    GPU run's HybridAdam takes without optimizer offload, on this CPU."""
    with mock.patch.object(ChunkState, "steps_on_host", new_callable=mock.PropertyMock, return_value=False):
        yield
