"""Tensor parallelism, frontend-neutral: who holds which shard, and where the collectives go.

A tensor-parallel layer runs the same code on every rank of a group of ``size`` ranks; each rank
holds a shard of the weights and calls ``all_reduce`` / ``all_gather`` where the math needs the
whole. ``TensorParallel`` is that group as the ops see it:

- ``TensorParallel()`` (size 1): one device, the collectives are the identity;
- ``dualop.torch.parallel.GroupTensorParallel``: a ``torch.distributed`` process group (gloo on
  CPU, nccl on GPU), eager collectives;
- ``dualop.jax.parallel.AxisTensorParallel``: a named axis of a ``jax.sharding.Mesh``, for code
  running inside ``shard_map`` over that axis (``psum`` / ``all_gather``; the rank is the traced
  ``axis_index``).

The shard arithmetic lives here once, as plain functions of ints: ``divide`` (with the error
that names the op and the argument), the vocabulary padding and shard layout of
``VocabParallelEmbedding`` (the reference engine's, LoRA/added vocabulary after the padded base),
and the QKV head layout (KV heads replicated when ``size >= num_kv_heads``).

``current_tensor_parallel()`` is the group layers use when none is given (the engine reads its
global tp group the same way); ``dualop.torch.parallel.init_tensor_parallel_group`` sets it, and
``use_tensor_parallel(tp)`` sets it for a block.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

__all__ = [
    "TensorParallel",
    "current_tensor_parallel",
    "set_tensor_parallel",
    "use_tensor_parallel",
    "divide",
    "pad_vocab_size",
    "VocabShard",
    "vocab_shard",
    "vocab_token_ids",
    "QKVLayout",
    "qkv_layout",
]


class TensorParallel:
    """One device: ``size`` 1, rank 0, collectives that return their input.

    Subclasses (one per distributed engine) override ``size``, ``rank``, ``all_reduce`` and
    ``all_gather``; every rank must make the same collective calls in the same order."""

    size: int = 1

    @property
    def rank(self) -> Any:
        """This rank's index in ``[0, size)``: an int, or a traced scalar inside ``shard_map``."""
        return 0

    def all_reduce(self, x: Any) -> Any:
        """The sum of ``x`` over the ranks, on every rank."""
        return x

    def all_gather(self, x: Any, dim: int = -1) -> Any:
        """The ranks' ``x`` concatenated along ``dim`` in rank order, on every rank."""
        return x

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size})"


_SINGLE = TensorParallel()
_current: TensorParallel = _SINGLE


def current_tensor_parallel() -> TensorParallel:
    """The group layers use when they are given none (one device unless set)."""
    return _current


def set_tensor_parallel(tp: TensorParallel | None) -> TensorParallel:
    """Make ``tp`` the current group (None: one device); returns the previous one."""
    global _current
    if tp is not None and not isinstance(tp, TensorParallel):
        raise TypeError(f"set_tensor_parallel: expected a dualop.parallel.TensorParallel, got {type(tp).__qualname__}")
    previous, _current = _current, tp or _SINGLE
    return previous


@contextlib.contextmanager
def use_tensor_parallel(tp: TensorParallel | None) -> Iterator[TensorParallel]:
    """``with use_tensor_parallel(tp):`` layers built inside use ``tp`` by default."""
    previous = set_tensor_parallel(tp)
    try:
        yield current_tensor_parallel()
    finally:
        set_tensor_parallel(previous)


def divide(numerator: int, denominator: int, *, op: str, what: str) -> int:
    """``numerator // denominator``, or a ``ValueError`` naming ``op`` and ``what`` when it does
    not divide (``what``: e.g. "argument 'output_size'" or "num_kv_heads")."""
    if denominator <= 0:
        raise ValueError(f"{op}: the tensor-parallel size must be positive, got {denominator}")
    if numerator % denominator:
        raise ValueError(f"{op}: {what} is {numerator}, which the tensor-parallel size {denominator} does not divide")
    return numerator // denominator


def pad_vocab_size(vocab_size: int, pad_to: int = 64) -> int:
    """``vocab_size`` rounded up to a multiple of ``pad_to``."""
    if pad_to <= 0:
        raise ValueError(f"pad_vocab_size: pad_to must be positive, got {pad_to}")
    return -(-vocab_size // pad_to) * pad_to


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """One rank's rows of a vocabulary-parallel embedding (the engine's shard indices).

    The full table is ``[padded base | padded added]``: the base vocabulary (``org_num_embeddings``
    ids) padded to a multiple of ``padding_size``, then the added (LoRA) ids, padded so the whole
    is a multiple of ``padding_size``. Base and added parts are each split evenly over the ranks
    (``tp_size`` must divide both padded sizes), and each rank's shard is ``[its base rows | its added rows]``
    (``num_embeddings_per_partition`` rows, padding included).

    ``org_vocab_start/end``: the base token ids this rank holds (end clipped to the real base);
    ``added_vocab_start/end``: the added token ids it holds; the ``padded_*`` bounds are the same
    ranges before clipping (they locate the rows: base rows first, added rows after
    ``num_org_vocab_padding`` padding rows)."""

    tp_size: int
    tp_rank: int
    num_embeddings: int
    org_num_embeddings: int
    num_embeddings_padded: int
    org_vocab_size_padded: int
    num_embeddings_per_partition: int
    padded_org_vocab_start: int
    padded_org_vocab_end: int
    padded_added_vocab_start: int
    padded_added_vocab_end: int
    org_vocab_start: int
    org_vocab_end: int
    added_vocab_start: int
    added_vocab_end: int

    @property
    def num_org_elements(self) -> int:
        return self.org_vocab_end - self.org_vocab_start

    @property
    def num_org_elements_padded(self) -> int:
        return self.padded_org_vocab_end - self.padded_org_vocab_start

    @property
    def num_added_elements(self) -> int:
        return self.added_vocab_end - self.added_vocab_start

    @property
    def num_org_vocab_padding(self) -> int:
        """Padding rows between this rank's base rows and its added rows."""
        return self.num_org_elements_padded - self.num_org_elements


def vocab_shard(num_embeddings: int, org_num_embeddings: int | None = None, padding_size: int = 64,
                tp_size: int = 1, tp_rank: int = 0, *, op: str = "vocab_parallel_embedding") -> VocabShard:
    """Rank ``tp_rank``'s ``VocabShard`` of a ``num_embeddings``-id vocabulary whose first
    ``org_num_embeddings`` ids (default: all) are the base vocabulary."""
    org = num_embeddings if org_num_embeddings is None else org_num_embeddings
    for name, value in (("num_embeddings", num_embeddings), ("org_num_embeddings", org),
                        ("padding_size", padding_size), ("tp_size", tp_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{op}: argument {name!r} must be a positive int, got {value!r}")
    if org > num_embeddings:
        raise ValueError(f"{op}: org_num_embeddings {org} exceeds num_embeddings {num_embeddings}")
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"{op}: tp_rank {tp_rank!r} is outside [0, {tp_size})")
    added = num_embeddings - org
    org_padded = pad_vocab_size(org, padding_size)
    total_padded = pad_vocab_size(org_padded + added, padding_size)
    org_per_rank = divide(org_padded, tp_size, op=op, what=f"the padded base vocabulary (padding_size {padding_size})")
    added_per_rank = divide(total_padded - org_padded, tp_size, op=op,
                            what=f"the padded added vocabulary (padding_size {padding_size})")
    per_rank = org_per_rank + added_per_rank
    padded_org_start = tp_rank * org_per_rank
    padded_added_start = org + tp_rank * added_per_rank  # added ids follow the base ids
    return VocabShard(
        tp_size=tp_size, tp_rank=tp_rank, num_embeddings=num_embeddings, org_num_embeddings=org,
        num_embeddings_padded=total_padded, org_vocab_size_padded=org_padded, num_embeddings_per_partition=per_rank,
        padded_org_vocab_start=padded_org_start, padded_org_vocab_end=padded_org_start + org_per_rank,
        padded_added_vocab_start=padded_added_start, padded_added_vocab_end=padded_added_start + added_per_rank,
        org_vocab_start=min(padded_org_start, org), org_vocab_end=min(padded_org_start + org_per_rank, org),
        added_vocab_start=min(padded_added_start, num_embeddings),
        added_vocab_end=min(padded_added_start + added_per_rank, num_embeddings),
    )


def vocab_token_ids(shard: VocabShard) -> list[int]:
    """The token id each of ``shard``'s rows holds, -1 for padding rows (the engine docstring's
    "corresponding token_id" line)."""
    base = list(range(shard.org_vocab_start, shard.org_vocab_end))
    base += [-1] * (shard.num_org_elements_padded - len(base))
    added = list(range(shard.added_vocab_start, shard.added_vocab_end))
    added += [-1] * (shard.num_embeddings_per_partition - len(base) - len(added))
    return base + added


@dataclasses.dataclass(frozen=True)
class QKVLayout:
    """Rank ``tp_rank``'s heads of a fused QKV projection: its q heads ``[q_head_start,
    q_head_start + num_heads)`` and kv heads ``[kv_head_start, kv_head_start + num_kv_heads)``
    (global head indices); ``kv_replicas`` ranks share each kv head when ``tp_size >
    total_num_kv_heads``. The rank's weight rows are ``[q | k | v]`` of those heads."""

    tp_size: int
    tp_rank: int
    head_size: int
    num_heads: int
    num_kv_heads: int
    q_head_start: int
    kv_head_start: int
    kv_replicas: int

    @property
    def output_size_per_partition(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_size


def qkv_layout(total_num_heads: int, total_num_kv_heads: int, head_size: int, tp_size: int = 1,
               tp_rank: int = 0, *, op: str = "qkv_parallel_linear") -> QKVLayout:
    """The engine's QKV split: q heads divide evenly; kv heads divide evenly when ``tp_size <=
    total_num_kv_heads``, else each is replicated on ``tp_size / total_num_kv_heads`` ranks."""
    num_heads = divide(total_num_heads, tp_size, op=op, what="total_num_heads")
    if tp_size >= total_num_kv_heads:
        replicas = divide(tp_size, total_num_kv_heads, op=op,
                          what=f"the tensor-parallel size (replicating {total_num_kv_heads} kv heads)")
        num_kv, kv_start = 1, tp_rank // replicas
    else:
        num_kv = divide(total_num_kv_heads, tp_size, op=op, what="total_num_kv_heads")
        replicas, kv_start = 1, tp_rank * num_kv
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"{op}: tp_rank {tp_rank} is outside [0, {tp_size})")
    return QKVLayout(tp_size=tp_size, tp_rank=tp_rank, head_size=head_size, num_heads=num_heads, num_kv_heads=num_kv,
                     q_head_start=tp_rank * num_heads, kv_head_start=kv_start, kv_replicas=replicas)
