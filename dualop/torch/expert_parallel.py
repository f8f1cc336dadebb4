"""Expert parallelism for torch tensors over ``torch.distributed``: each rank of a process group
holds a contiguous block of the experts and the results combine across ranks.

Pieces (the reference engine's, by role):

- ``init_expert_parallel_group(...)``: the default process group (``gloo`` for CPU tensors,
  ``nccl`` when CUDA is there), or a subgroup of given ranks.
- ``expert_map_for_rank(num_experts, ep_size, ep_rank)``: ``(local count, expert_map)``, the
  engine's ``determine_expert_map`` (contiguous blocks, the first ``E % size`` ranks one more);
  ``local_experts(weight, num_experts, ep_size, ep_rank)`` slices a global ``[E, ...]`` weight.
- prepare/finalize objects for ``modular_fused_moe`` (``FusedMoEModularMethod(prepare_finalize)``):
  ``AllReducePrepareAndFinalize``: every rank has every token (small batches, decode), computes
  its experts' float32 share and a float32 all-reduce sums the shares;
  ``AllToAllPrepareAndFinalize``: each rank has its own tokens; each (token, expert) pair goes to
  the expert's owner and its weighted float32 output comes back, with ``all_to_all_single`` and
  exact per-rank counts (exchanged first), so nothing is padded or dropped, and a token's pairs
  are summed in float32.
  Both cast to x's dtype once, after the combine (``modular_fused_moe``'s experts run with
  ``float32_output``): in 16-bit dtypes the result is one process's float32 sum rounded once,
  at twice the bytes of a 16-bit combine.

gloo (CPU) implements ``all_to_all_single`` (with split sizes) and ``all_reduce``; in torch 2.9 it
has no list ``all_to_all`` ("Backend gloo does not support alltoall"), so only the former is used.
The calls are eager and collective: every rank of the group must make them, in the same order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from dualop.backends import array_namespace
from dualop.ops.moe_modular import PrepareAndFinalize, Prepared, expert_blocks, expert_owner

__all__ = ["init_expert_parallel_group", "expert_map_for_rank", "local_experts", "AllReducePrepareAndFinalize",
           "AllToAllPrepareAndFinalize"]


def init_expert_parallel_group(backend: str | None = None, *, init_method: str | None = None,
                               rank: int | None = None, world_size: int | None = None,
                               ranks: list[int] | None = None):
    """The expert-parallel process group: initialises the default group if needed (``backend``
    default: ``nccl`` with CUDA, else ``gloo``; ``init_method``/``rank``/``world_size`` as
    ``torch.distributed.init_process_group`` takes them, or its environment variables), then
    returns it, or the subgroup of ``ranks`` (every rank must call this with the same ``ranks``)."""
    if not dist.is_available():
        raise RuntimeError("expert parallelism: torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        kwargs = {k: v for k, v in (("init_method", init_method), ("rank", rank), ("world_size", world_size))
                  if v is not None}
        dist.init_process_group(backend, **kwargs)
    if ranks is None:
        return dist.group.WORLD
    return dist.new_group(ranks)


def expert_map_for_rank(num_experts: int, ep_size: int, ep_rank: int,
                        device: Any = None) -> tuple[int, torch.Tensor]:
    """``(number of local experts, expert_map int32 [num_experts])`` for ``ep_rank``: its block's
    experts get local indices 0.., the rest -1."""
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"expert parallelism: ep_rank {ep_rank} is outside [0, {ep_size})")
    start, count = expert_blocks(num_experts, ep_size)[ep_rank]
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    expert_map[start:start + count] = torch.arange(count, dtype=torch.int32, device=device)
    return count, expert_map


def local_experts(weight: torch.Tensor | None, num_experts: int, ep_size: int, ep_rank: int) -> torch.Tensor | None:
    """Rank ``ep_rank``'s block of a global ``[num_experts, ...]`` expert weight (or bias); None stays None."""
    if weight is None:
        return None
    if weight.shape[0] != num_experts:
        raise ValueError(f"expert parallelism: the weight has {weight.shape[0]} experts; expected {num_experts}")
    start, count = expert_blocks(num_experts, ep_size)[ep_rank]
    return weight[start:start + count].contiguous()


@dataclasses.dataclass(frozen=True, eq=False)
class AllReducePrepareAndFinalize(PrepareAndFinalize):
    """Every rank has every token; the ranks' float32 shares are summed with ``all_reduce`` over
    ``group``, then cast to x's dtype."""

    group: Any = None

    def prepare(self, x, topk_weights, topk_ids, expert_map, num_local_experts: int) -> Prepared:
        return Prepared(x, topk_weights, topk_ids, expert_map)

    def finalize(self, out, prepared: Prepared, x):
        out = out.to(torch.float32).contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out.to(x.dtype)


def _all_to_all(values: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: Any) -> torch.Tensor:
    out = values.new_empty((sum(recv_counts), *values.shape[1:]))
    dist.all_to_all_single(out, values.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts,
                           group=group)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class AllToAllPrepareAndFinalize(PrepareAndFinalize):
    """Each rank's tokens go to their experts' owners and back with ``all_to_all_single`` over
    ``group`` (experts placed by ``expert_map_for_rank``; ``expert_map`` must be given to the op):
    x's rows go out in x's dtype, the pairs' float32 outputs come back, summed in float32 and cast
    to x's dtype."""

    prepare_communicates: ClassVar[bool] = True

    group: Any = None

    def prepare(self, x, topk_weights, topk_ids, expert_map, num_local_experts: int) -> Prepared:
        if expert_map is None:
            raise ValueError("modular_fused_moe: all-to-all expert parallelism needs the rank's 'expert_map'")
        n = dist.get_world_size(self.group)
        top_k = topk_ids.shape[1]
        ids = topk_ids.reshape(-1).to(torch.int32)
        owner = expert_owner(array_namespace(ids), ids, expert_map.shape[0], n)
        order = torch.argsort(owner, stable=True)  # pairs by destination; bad ids (owner n) last
        send_counts = torch.bincount(owner, minlength=n + 1)[:n]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        kept = order[: sum(send)]
        x_rows = x[kept // top_k]
        recv_x = _all_to_all(x_rows, send, recv, self.group)
        recv_ids = _all_to_all(ids[kept], send, recv, self.group)
        recv_w = _all_to_all(topk_weights.reshape(-1)[kept].to(torch.float32), send, recv, self.group)
        return Prepared(recv_x, recv_w[:, None], recv_ids[:, None], expert_map, state=(kept, send, recv, top_k))

    def finalize(self, out, prepared: Prepared, x):
        kept, send, recv, top_k = prepared.state
        # the kept pairs' weighted float32 outputs, in ``kept``'s order
        back = _all_to_all(out.to(torch.float32), recv, send, self.group)
        summed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return summed.index_add_(0, kept // top_k, back).to(x.dtype)
