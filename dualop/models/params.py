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

__all__ = ["Param", "whole", "linear", "split", "vocab", "stacked", "with_quantization"]

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
    # a linear op's weight: the op and its checkpoint sources [(tensor, loaded_shard_id)], which
    # ``with_quantization`` reads where the checkpoint stores that weight quantized
    linear_op: Any = None
    sources: tuple[tuple[str, Any], ...] = ()


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

    return Param(name, expected, dim if op.tp.size > 1 else None, build, packable and param == "weight",
                 op if param == "weight" else None, tuple(sources) if param == "weight" else ())


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


# --- quantized checkpoints ------------------------------------------------------------------------

def _weight_quant(layer: Any, weight_only: bool) -> Any:
    """The ``WeightQuant`` of a checkpoint's quantized layer (``dualop.models.quantized``)."""
    from dualop.ops.quantized_weight import WeightQuant

    codes = "fp8" if layer.scheme == "fp8" else f"int{layer.bits}"
    return WeightQuant(codes, layer.strategy, group_size=layer.group_size, block=layer.block,
                       symmetric=layer.symmetric, layout=layer.layout,
                       activations="none" if weight_only else layer.activations)


def with_quantization(plan: Sequence[Param], quantization: Any, tp_size: int,
                      weight_only: bool = False) -> list[Param]:
    """``plan`` with each linear weight the checkpoint stores quantized (``quantization``: a
    ``dualop.models.quantized.QuantizedCheckpoint``) built as a ``QuantizedWeight`` of its codes and
    scales, kept quantized. A fused weight (QKV, gate/up) takes its parts' codes side by side along
    the output features; per-tensor scales of several parts become per-channel ones (each part's
    scale on its rows, exactly), and their static activation scales the largest (as the engine
    does). ``weight_only``: activations stay unquantized whatever the checkpoint says (its static
    input scales unread). With tensor parallelism each rank keeps its shard of every array, cut where
    the op's ``checkpoint_layout`` cuts the float weight (``QuantizedWeight.features``). Raises
    ``CheckpointError`` (nothing read yet) where the model cannot take the layout: a fused weight
    with quantized and float parts or parts of different schemes, a shard that would split a scale
    block, group or packed word, or a quantized layer no linear op of the model reads (an LM head,
    experts)."""
    from dualop.models.checkpoint import CheckpointError

    if quantization is None:
        return list(plan)
    layers = quantization.linears
    out, used, problems = [], set(), []
    for p in plan:
        parts = [layers.get(tensor.removesuffix(".weight")) for tensor, _ in p.sources]
        if not p.sources or not any(parts):
            out.append(p)
            continue
        used.update(q.layer for q in parts if q is not None)
        if not all(parts):
            problems.append(f"{p.name}: fuses quantized and float checkpoint layers "
                            f"({', '.join(t for t, _ in p.sources)})")
            continue
        try:
            quants = {_weight_quant(q, weight_only) for q in parts}
        except ValueError as err:
            problems.append(f"{p.name}: {err}")
            continue
        if len(quants) > 1:
            problems.append(f"{p.name}: its parts are quantized differently ({'; '.join(q.describe() for q in quants)})")
            continue
        quant = quants.pop()
        misaligned = _misaligned_part(parts, quant) or _misaligned_shards(p, parts, quant)
        if misaligned:
            problems.append(f"{p.name}: {misaligned}")
            continue
        out.append(_quantized_param(p, parts, quant, tp_size))
    unused = sorted(set(layers) - used)
    if unused:
        problems.append(f"quantized layers this model reads no linear weight from ({len(unused)}): "
                        + ", ".join(unused[:4]) + (" ..." if len(unused) > 4 else ""))
    if problems:
        raise CheckpointError(f"from_pretrained: the {quantization.method!r} quantized checkpoint cannot be "
                              "loaded into this model; nothing was loaded\n  " + "\n  ".join(problems))
    return out


def _misaligned_part(parts: Sequence[Any], quant: Any) -> str | None:
    """Why ``parts`` cannot sit side by side in one fused weight (None: they can): a block of
    scales or a word of packed zero points would straddle two parts."""
    if len(parts) < 2:
        return None
    rows = {"block": quant.block[0] if quant.block else 1}.get(quant.strategy, 1)
    if quant.layout == "packed" and not quant.symmetric:
        rows = 32 // quant.bits  # zero points packed along the output features
    for q in parts[:-1]:
        if q.shape[0] % rows:
            return (f"{q.layer} has {q.shape[0]} output features, not a multiple of the {rows} that one "
                    f"{'scale block' if quant.strategy == 'block' else 'zero-point word'} spans, so its part of "
                    "the fused weight cannot be laid beside the next")
    return None


def _shard_copies(p: Param, rank: int) -> list[tuple[Any, str, list[Any]]]:
    """Per checkpoint part of ``p``'s weight: (its shard id, the features the op splits: "out" or
    "in", the op's copies of rank ``rank``), as ``checkpoint_layout`` gives them for the float weight."""
    op = p.linear_op
    rank = rank if op.tp.size > 1 else 0
    out = []
    for _, shard_id in p.sources:
        _, dim, copies = op.checkpoint_layout("weight", shard_id, rank=rank)
        out.append((shard_id, "in" if dim == 1 else "out", copies if dim is not None else []))
    return out


def _misaligned_shards(p: Param, parts: Sequence[Any], quant: Any) -> str | None:
    """Why a rank's shard of ``p`` would cut a scale block, group or packed word (None: none does)."""
    op = p.linear_op
    if op is None or op.tp.size == 1:
        return None
    for rank in range(op.tp.size):
        for q, (_, which, copies) in zip(parts, _shard_copies(p, rank)):
            unit = quant.shard_alignment(which)
            total = q.shape[0] if which == "out" else q.shape[1]
            for c in copies:
                if c.src_start % unit or (c.src_stop % unit and c.src_stop != total):
                    return (f"{q.layer}: rank {rank}'s {which}put features [{c.src_start}, {c.src_stop}) at tp="
                            f"{op.tp.size} split its {quant.describe()} scale blocks, groups or packed words "
                            f"(shards must fall on multiples of {unit})")
    return None


def _quantized_param(p: Param, parts: Sequence[Any], quant: Any, tp_size: int = 1) -> Param:
    """``p`` (a linear weight) from its parts' codes, scales, zero points and input scales; with
    tensor parallelism each rank's shard (``QuantizedWeight.features`` where the op's
    ``checkpoint_layout`` cuts the float weight), laid out rank-major along every array's first
    dim by the jax frontend (``split_dim`` 0)."""
    from dualop.ops.quantized_weight import QuantizedWeight, WeightQuant

    fused = len(parts) > 1
    axis = 1 if quant.layout == "awq" else 0  # the output features' axis of codes, scales, zero points
    final = quant
    if fused and quant.strategy == "tensor":
        final = WeightQuant(quant.codes, "channel", symmetric=quant.symmetric, layout=quant.layout,
                            activations=quant.activations)
    expected = {}
    for q in parts:
        expected[q.tensors["codes"]] = quant.codes_shape(*q.shape)
        if "zero_point" in q.tensors:
            expected[q.tensors["zero_point"]] = quant.zero_point_shape(*q.shape)

    def part_weight(get: Getter, q: Any) -> QuantizedWeight:
        """Checkpoint part ``q`` whole, in the fused scheme ``final``."""
        arrays = {"codes": get(q.tensors["codes"])}
        scale = _as_float32_if_e8m0(get(q.tensors["scale"]))
        if quant.strategy == "tensor":  # one element, stored as () or (1,)
            scale = scale.reshape(1, 1) if final.strategy == "channel" else scale.reshape(1)
            if final.strategy == "channel":  # a fused weight's per-tensor scales, on each part's rows
                scale = _concat([scale] * q.shape[0], 0)
        arrays["scale"] = scale
        if "zero_point" in q.tensors:
            arrays["zero_point"] = get(q.tensors["zero_point"])
        if "input_scale" in q.tensors and final.activations == "static":
            arrays["input_scale"] = get(q.tensors["input_scale"]).reshape(1)
        return QuantizedWeight(final, shape=q.shape, **arrays)

    def build(get: Getter, rank: int) -> Any:
        pieces = []  # (where in the rank's fused output features, the piece)
        for q, (_, which, copies) in zip(parts, _shard_copies(p, rank) if tp_size > 1 else [(None, "out", [])] * len(parts)):
            whole = part_weight(get, q)
            if not copies:  # tp 1 (or an op outside the model's tp): the part whole, after the previous
                pieces.append((len(pieces), whole))
            for c in copies:
                pieces.append((c.dst_start, whole.features(which, c.src_start, c.src_stop)))
        pieces.sort(key=lambda piece: piece[0])
        weights = [w for _, w in pieces]
        arrays = {name: [getattr(w, name) for w in weights if getattr(w, name) is not None]
                  for name in ("codes", "scale", "zero_point", "input_scale")}
        joined = {name: _concat(v, axis) if name != "input_scale" else _largest(v)
                  for name, v in arrays.items() if v}
        rows = sum(w.shape[0] for w in weights)
        return QuantizedWeight(final, shape=(rows, weights[0].shape[1]), **joined)

    return Param(p.name, expected, 0 if tp_size > 1 else None, build, False, p.linear_op, p.sources)


def _as_float32_if_e8m0(scale: Any) -> Any:
    """float8_e8m0 scales (powers of two) as float32, exactly: the linear ops take float scales."""
    if "e8m0" not in str(scale.dtype):
        return scale
    if type(scale).__module__.startswith("torch"):
        import torch

        return scale.to(torch.float32)
    import jax.numpy as jnp

    return scale.astype(jnp.float32)


def _largest(values: Sequence[Any]) -> Any:
    out = values[0]
    for v in values[1:]:
        if type(v).__module__.startswith("torch"):
            import torch

            out = torch.maximum(out, v)
        else:
            import jax.numpy as jnp

            out = jnp.maximum(out, v)
    return out
