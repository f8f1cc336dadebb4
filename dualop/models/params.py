"""How a model's parameters come from checkpoint tensors, per tensor-parallel rank.

A model lists its parameters as ``Param``s: a name, the checkpoint tensors it is built from (with
their full shapes, checked before anything is read), the dim it is split on over the ranks (None:
every rank holds it whole) and ``build(get, rank)``, which returns rank ``rank``'s part from the
full tensors (``get(name)``). The torch frontend keeps its own rank's part; the jax frontend lays
the ranks' parts out rank-major in one global array sharded over the mesh (``dualop.jax.parallel``
says why), so ``shard_map`` hands each device its rank's part.

The shard arithmetic is the ops' own: ``linear`` asks a linear op's ``checkpoint_layout`` (fused
QKV and merged gate/up included), ``vocab`` the embedding's ``VocabShard``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Param", "whole", "linear", "split", "vocab", "stacked"]

Getter = Callable[[str], Any]


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter: ``expected`` {checkpoint tensor: full shape}, ``split_dim`` over the ranks
    (None: replicated) and ``build(get, rank)`` -> rank ``rank``'s array. ``packable``: a GEMM
    weight that only linear ops and the LM head read, which a frontend may hold in its GEMM's
    packed layout (torch on the CPU: ``kernels/cpu/linear.py``)."""

    name: str
    expected: dict[str, tuple[int, ...]]
    split_dim: int | None
    build: Callable[[Getter, int], Any]
    packable: bool = False


def _slice(x: Any, dim: int, start: int, stop: int) -> Any:
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, stop)
    return x[tuple(index)]


def _concat(parts: Sequence[Any], dim: int) -> Any:
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if type(first).__module__.startswith("torch"):
        import torch

        return torch.cat(list(parts), dim=dim)
    import jax.numpy as jnp

    return jnp.concatenate(list(parts), axis=dim)


def whole(name: str, tensor: str, shape: Sequence[int], transform: Callable[[Any], Any] | None = None) -> Param:
    """A parameter every rank holds whole: checkpoint tensor ``tensor`` (optionally transformed)."""
    return Param(name, {tensor: tuple(shape)}, None,
                 lambda get, rank: get(tensor) if transform is None else transform(get(tensor)))


def split(name: str, tensor: str, shape: Sequence[int], dim: int, tp: int) -> Param:
    """Checkpoint tensor ``tensor`` cut into ``tp`` equal blocks along ``dim``; rank r holds block r."""
    size = shape[dim] // tp
    return Param(name, {tensor: tuple(shape)}, dim if tp > 1 else None,
                 lambda get, rank: _slice(get(tensor), dim, rank * size, (rank + 1) * size))


def linear(name: str, op: Any, sources: Sequence[tuple[str, Any]], param: str = "weight", *,
           packable: bool = False) -> Param:
    """``param`` ("weight"/"bias") of the linear op ``op`` built from checkpoint tensors
    ``sources`` = [(tensor, loaded_shard_id)] (shard id None for a plain linear; 'q'/'k'/'v' for
    QKV; 0, 1, ... for merged), each rank's rows where the op's ``checkpoint_layout`` puts them."""
    expected: dict[str, tuple[int, ...]] = {}
    dim = None
    for tensor, shard_id in sources:
        shape, dim, _ = op.checkpoint_layout(param, shard_id, rank=0)
        expected[tensor] = shape

    def build(get: Getter, rank: int) -> Any:
        pieces = []
        rank = rank if op.tp.size > 1 else 0  # an op outside the model's tp (disable_tp): every rank holds it whole
        for tensor, shard_id in sources:
            _, d, copies = op.checkpoint_layout(param, shard_id, rank=rank)
            full = get(tensor)
            for c in copies:
                pieces.append((c.dst_start, full if d is None else _slice(full, d, c.src_start, c.src_stop)))
        pieces.sort(key=lambda p: p[0])
        return _concat([p for _, p in pieces], 0 if dim is None else dim)

    return Param(name, expected, dim if op.tp.size > 1 else None, build, packable and param == "weight")


def vocab(name: str, tensor: str, op: Any, *, packable: bool = False) -> Param:
    """A vocabulary-parallel embedding / LM head weight: rank r's rows are ``op.shard(r)``'s base
    rows padded with zeros to its per-partition size (no added vocabulary in a checkpoint)."""
    shape = (op.org_vocab_size, op.embedding_dim)

    def build(get: Getter, rank: int) -> Any:
        shard = op.shard(rank)
        full = get(tensor)
        rows = _slice(full, 0, shard.org_vocab_start, shard.org_vocab_end)
        pad = op.num_embeddings_per_partition - rows.shape[0]
        if pad == 0:
            return rows
        zeros = rows[:1] * 0
        return _concat([rows, _concat([zeros] * pad, 0)], 0)

    return Param(name, {tensor: shape}, 0 if op.tp.size > 1 else None, build, packable)


def stacked(name: str, tensors: Sequence[Sequence[str]], shapes: Sequence[Sequence[int]], dim: int,
            tp: int) -> Param:
    """A ``[E, sum(rows), cols]`` expert stack: expert e's block is its tensors ``tensors[e]``
    (shapes ``shapes``) each cut into ``tp`` equal blocks along ``dim`` (0 rows, 1 cols) and
    concatenated along it; rank r keeps block r of each (gate and up rows stay paired per rank)."""
    expected = {t: tuple(s) for row in tensors for t, s in zip(row, shapes)}

    def build(get: Getter, rank: int) -> Any:
        experts = []
        for row in tensors:
            parts = []
            for t, s in zip(row, shapes):
                size = s[dim] // tp
                parts.append(_slice(get(t), dim, rank * size, (rank + 1) * size))
            experts.append(_concat(parts, dim)[None])
        return _concat(experts, 0)

    return Param(name, expected, dim + 1 if tp > 1 else None, build)
