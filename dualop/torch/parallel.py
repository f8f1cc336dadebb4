"""Tensor parallelism for torch tensors over ``torch.distributed``.

``init_tensor_parallel_group(...)`` initialises the default process group if needed (``nccl``
when CUDA is there, else ``gloo``), makes a ``GroupTensorParallel`` over it (or over a subgroup
of ``ranks``) the current tensor-parallel group (``dualop.parallel.current_tensor_parallel``)
and returns it. Layers built afterwards shard their weights over it; ``tp_rank`` / ``tp_size``
read it.

The collectives are eager and collective: every rank of the group makes the same calls in the
same order. ``all_reduce`` sums into a new tensor (the input is left alone); ``all_gather``
concatenates the ranks' tensors along a dim. Both are the identity on a group of one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dualop.parallel import TensorParallel, current_tensor_parallel, set_tensor_parallel

__all__ = ["GroupTensorParallel", "init_tensor_parallel_group", "tp_rank", "tp_size"]


class GroupTensorParallel(TensorParallel):
    """A ``torch.distributed`` process group as a ``TensorParallel``."""

    def __init__(self, group=None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("GroupTensorParallel: torch.distributed is not initialised; call "
                               "dualop.torch.parallel.init_tensor_parallel_group first")
        self.group = group if group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        self._rank = dist.get_rank(self.group)

    @property
    def rank(self) -> int:
        return self._rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        out = x.clone()
        dist.all_reduce(out, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def __repr__(self) -> str:
        return f"GroupTensorParallel(size={self.size}, rank={self._rank}, backend={dist.get_backend(self.group)!r})"


def init_tensor_parallel_group(backend: str | None = None, *, init_method: str | None = None,
                               rank: int | None = None, world_size: int | None = None,
                               ranks: list[int] | None = None) -> GroupTensorParallel:
    """The tensor-parallel group, made current: initialises the default group if needed
    (``backend`` default ``nccl`` with CUDA, else ``gloo``; ``init_method``/``rank``/``world_size``
    as ``torch.distributed.init_process_group`` takes them, or its environment variables), then
    wraps it, or the subgroup of ``ranks`` (every rank must call this with the same ``ranks``)."""
    if not dist.is_available():
        raise RuntimeError("tensor parallelism: torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        kwargs = {k: v for k, v in (("init_method", init_method), ("rank", rank), ("world_size", world_size))
                  if v is not None}
        dist.init_process_group(backend, **kwargs)
    group = dist.group.WORLD if ranks is None else dist.new_group(ranks)
    tp = GroupTensorParallel(group)
    set_tensor_parallel(tp)
    return tp


def tp_size() -> int:
    """Size of the current tensor-parallel group (1 when none is set)."""
    return current_tensor_parallel().size


def tp_rank() -> int:
    """This process's rank in the current tensor-parallel group (0 when none is set)."""
    return current_tensor_parallel().rank
