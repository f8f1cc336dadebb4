"""Tensor parallelism for jax arrays: a named axis of a ``jax.sharding.Mesh``.

The choice, and why: the tensor-parallel layers run their per-shard code under ``shard_map``
with explicit collectives (``AxisTensorParallel``: ``jax.lax.psum`` / ``all_gather`` over the
axis), not as globally sharded arrays left to the SPMD partitioner. The per-shard code is then
the same code the torch ranks run (the engine's semantics, collective for collective), the
Pallas kernels inside see plain local arrays, and the collectives in the compiled program are
exactly the ones written (``dualop compile`` reports them per layer) rather than whatever the
partitioner picks.

- ``tensor_parallel_mesh(tp, devices=None, axis="tp")``: a one-axis mesh over the first ``tp``
  devices (or those given).
- ``AxisTensorParallel(axis, size)``: the ``TensorParallel`` for code inside ``shard_map`` over
  ``axis``; its rank is the traced ``jax.lax.axis_index(axis)``.
- ``shard_map``: ``jax.shard_map`` (or the legacy one on older jax) with the replication check
  off (Pallas calls carry no replication rule).

The layers keep each weight as one global array sharded over the axis on its split dim
(``NamedSharding(mesh, PartitionSpec(..., axis, ...))``), laid out rank-major: shard r of the
global array is exactly rank r's shard (for fused QKV / merged layouts the loader permutes the
checkpoint's rows into that order), so ``shard_map`` hands each device its rank's weight.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from dualop.jax.expert_parallel import shard_map
from dualop.parallel import TensorParallel

__all__ = ["AxisTensorParallel", "tensor_parallel_mesh", "shard_map", "axis_size"]


class AxisTensorParallel(TensorParallel):
    """The ``axis`` of the enclosing ``shard_map`` (``size`` shards) as a ``TensorParallel``."""

    def __init__(self, axis: Any = "tp", size: int = 1) -> None:
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"AxisTensorParallel: size must be a positive int, got {size!r}")
        self.axis, self.size = axis, size

    @property
    def rank(self) -> Any:
        return jax.lax.axis_index(self.axis) if self.size > 1 else 0

    def all_reduce(self, x: Any) -> Any:
        return jax.lax.psum(x, self.axis) if self.size > 1 else x

    def all_gather(self, x: Any, dim: int = -1) -> Any:
        if self.size == 1:
            return x
        return jax.lax.all_gather(x, self.axis, axis=dim % x.ndim, tiled=True)

    def __repr__(self) -> str:
        return f"AxisTensorParallel(axis={self.axis!r}, size={self.size})"


def axis_size(mesh: Mesh, axis: Any, *, op: str) -> int:
    """The number of shards along ``axis`` of ``mesh``, or a ValueError naming ``op``."""
    if axis not in mesh.shape:
        raise ValueError(f"{op}: axis {axis!r} is not an axis of the mesh (axes: {tuple(mesh.shape)})")
    return int(mesh.shape[axis])


def tensor_parallel_mesh(tp: int, devices: Any = None, axis: str = "tp") -> Mesh:
    """A one-axis mesh named ``axis`` over ``tp`` devices (default: the first ``tp`` of
    ``jax.devices()``; on CPU set ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before
    importing jax to get N host devices)."""
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(tp, int) or tp <= 0:
        raise ValueError(f"tensor_parallel_mesh: tp must be a positive int, got {tp!r}")
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_mesh: tp {tp} needs {tp} devices; {len(devices)} available "
                         "(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax)")
    return Mesh(np.array(devices[:tp]), (axis,))
