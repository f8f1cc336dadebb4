"""The MoE experts on the CPU for torch tensors: the (token, slot) pairs sorted by expert
(``moe_math.sort_by_expert``), then each projection as a grouped matmul over only the experts that
have tokens, the activation (float32) and the weighted combine in between.

The intermediate activation must stay float32 (``moe_math``'s rule), and torch's CPU matmuls
return their operands' dtype (``torch.mm`` has no float32 output for bfloat16 operands on the CPU;
``torch._grouped_mm`` requires the output dtype to match, and with transposed weights it measured
slower than one ``torch.mm`` per expert). So dualop has its own grouped matmuls (``csrc/moe.cc``):

- bfloat16 weights, where the library was built with AVX512-BF16 (``has_bf16_dot()``): every group
  goes to ``dualop_moe_grouped_linear_bf16``, bfloat16 operands with float32 accumulation and
  output at the bfloat16 peak. The first projection's rows are the tokens as given (bfloat16, exact);
  the float32 intermediate is fed to the second as two bfloat16 halves, ``hi = bf16(v)`` and
  ``lo = bf16(v - hi)`` (``v - hi`` is exact; ``hi + lo`` carries 16 of float32's 24 bits, the
  same split the Pallas and Triton paths use), both against the same weights into the same
  float32 sums: 4/3 of a bfloat16 layer's matmul work, never a 16-bit intermediate.
- other dtypes, CPUs without AVX512-BF16 and weights whose rows are not contiguous: float32 matmuls.
  Small groups (decode) go to ``dualop_moe_grouped_linear``, which reads each weight once at its
  own size and widens it in registers; larger groups are compute-bound and go to torch's float32
  matmul with that expert's weights widened once.

``apply_router_weight_on_input`` scales the first projection's output rows, before the bias and
the activation: ``w13 @ (s * x) == s * (w13 @ x)``, so the op's value is kept while the rows stay
the exact bfloat16 tokens (scaling the rows first would need the hi/lo split there too).
"""

from __future__ import annotations

from typing import Any

from dualop.kernels import moe_math
from dualop.kernels.cpu import gated_activation
from dualop.kernels.cpu.common import dtype_code, threads_for
from dualop.backends.torch.recording import decline_if_recording
from dualop.kernels.cpu.abi import c_function

_C_SPLIT_BF16 = c_function(
    "int dualop_split_bf16(const DualopArray* v, const DualopArray* hi, const DualopArray* lo, int threads)"
)
_C_MOE_GROUPED_LINEAR_BF16 = c_function(
    "int dualop_moe_grouped_linear_bf16(const DualopArray* hi, const DualopArray* lo, const DualopArray* w, "
    "const DualopArray* group_expert, const DualopArray* group_start, const DualopArray* group_end, "
    "const DualopArray* out, int threads)"
)
_C_MOE_HAS_BF16_DOT = c_function(
    "int dualop_moe_has_bf16_dot()"
)
_C_MOE_GROUPED_LINEAR = c_function(
    "int dualop_moe_grouped_linear(const DualopArray* x, const DualopArray* w, const DualopArray* group_expert, "
    "const DualopArray* group_start, const DualopArray* group_end, const DualopArray* out, int threads)"
)

__all__ = ["fused_experts", "has_bf16_dot"]

_OP = "unquantized_fused_moe"
# Row count from which torch's float32 matmul beats the C++ kernel on one expert's group.
_KERNEL_MAX_ROWS = 16


def has_bf16_dot() -> bool:
    """Whether the CPU kernel library was built with AVX512-BF16 (bfloat16 dot products with
    float32 sums): then bfloat16 experts run on ``dualop_moe_grouped_linear_bf16``."""
    return bool(_C_MOE_HAS_BF16_DOT())


def _rows_contiguous(weights: Any) -> bool:
    """Each weight row (``K``, innermost) contiguous and the experts packed: what the kernels read."""
    _, n, k = weights.shape
    return weights.stride(2) == 1 and weights.stride(1) == k and weights.stride(0) == n * k


def _group_tensors(starts: list[int], used: list[int], groups: list[int]) -> tuple[Any, Any, Any]:
    """Expert, first row and end row of each of ``groups`` (indices into ``used``), as int64."""
    import torch

    return (torch.tensor([used[g] for g in groups], dtype=torch.int64),
            torch.tensor([starts[g] for g in groups], dtype=torch.int64),
            torch.tensor([starts[g + 1] for g in groups], dtype=torch.int64))


def _row_starts(counts: list[int]) -> list[int]:
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    return starts


def split_bf16(values: Any) -> tuple[Any, Any]:
    """float32 ``values`` as bfloat16 ``hi = bf16(v)`` and ``lo = bf16(v - hi)`` (``v - hi`` is
    exact in float32, so ``hi + lo`` is ``v`` to 16 significant bits; ``lo`` is 0 where ``hi`` is
    infinite), in one pass of the C++ kernel."""
    import torch

    values = values.contiguous()
    hi, lo = torch.empty_like(values, dtype=torch.bfloat16), torch.empty_like(values, dtype=torch.bfloat16)
    status = _C_SPLIT_BF16(v=values, hi=hi, lo=lo, threads=threads_for(values.numel()))
    if status != 0:
        raise NotImplementedError(f"dualop_split_bf16 returned {status}")
    return hi, lo


def _grouped_linear_bf16(hi: Any, lo: Any | None, weights: Any, used: list[int], counts: list[int]) -> Any:
    """float32 ``(hi + lo)[r] @ weights[used[g]].T`` (``lo`` may be None) for consecutive row groups
    of ``counts[g]`` rows, every group on the AVX512-BF16 kernel; ``hi``, ``lo`` bfloat16 ``[R, K]``,
    ``weights`` bfloat16 ``[E, N, K]`` with contiguous rows."""
    import torch

    _, n, k = weights.shape
    out = torch.empty((hi.shape[0], n), dtype=torch.float32)
    group_expert, group_start, group_end = _group_tensors(_row_starts(counts), used, list(range(len(counts))))
    status = _C_MOE_GROUPED_LINEAR_BF16(
        hi=hi, lo=lo, w=weights, group_expert=group_expert, group_start=group_start, group_end=group_end, out=out,
        threads=threads_for(sum(counts) * n * k * (1 if lo is None else 2)),
    )
    if status != 0:
        raise NotImplementedError(f"dualop_moe_grouped_linear_bf16 returned {status}")
    return out


def _grouped_linear(rows: Any, weights: Any, used: list[int], counts: list[int]) -> Any:
    """float32 ``rows[r] @ weights[used[g]].T`` for consecutive row groups of ``counts[g]`` rows;
    ``rows`` float32 ``[R, K]``, ``weights`` ``[E, N, K]`` in any kernel dtype.

    Groups of fewer than ``_KERNEL_MAX_ROWS`` rows (decode) go to the C++ kernel, which reads each
    weight once at its own size; larger groups are compute-bound and go to torch's float32
    matmul with that expert's weights widened (measured crossover, docs/BENCHMARKS.md). The kernel
    needs each weight row contiguous (``K`` innermost); other layouts (the transposed views of
    transformers' gpt-oss weights) take torch's matmul for every group rather than a copy of
    every expert."""
    import torch

    _, n, k = weights.shape
    out = torch.empty((rows.shape[0], n), dtype=torch.float32)
    starts = _row_starts(counts)
    rows_contiguous = _rows_contiguous(weights)
    small = [g for g, count in enumerate(counts) if count < _KERNEL_MAX_ROWS and rows_contiguous]
    if small:
        group_expert, group_start, group_end = _group_tensors(starts, used, small)
        status = _C_MOE_GROUPED_LINEAR(
            x=rows, w=weights, group_expert=group_expert, group_start=group_start, group_end=group_end, out=out,
            threads=threads_for(sum(counts[g] for g in small) * n * k),
        )
        if status != 0:
            raise NotImplementedError(f"dualop_moe_grouped_linear returned {status}")
    for g, count in enumerate(counts):
        if count >= _KERNEL_MAX_ROWS or not rows_contiguous:
            torch.mm(rows[starts[g]:starts[g + 1]], weights[used[g]].to(torch.float32).T,
                     out=out[starts[g]:starts[g + 1]])
    return out


def _project(rows: Any, weights: Any, used: list[int], counts: list[int]) -> Any:
    """float32 ``rows[r] @ weights[used[g]].T`` per row group; ``rows`` bfloat16 (exact) or float32.
    bfloat16 weights take the AVX512-BF16 kernel where the library has it (float32 rows as hi/lo
    halves); everything else the float32 route."""
    import torch

    if weights.dtype == torch.bfloat16 and _rows_contiguous(weights) and has_bf16_dot():
        hi, lo = (rows, None) if rows.dtype == torch.bfloat16 else split_bf16(rows)
        return _grouped_linear_bf16(hi.contiguous(), lo, weights, used, counts)
    return _grouped_linear(rows.to(torch.float32).contiguous(), weights, used, counts)


def _activate(xp: Any, h: Any, activation: str) -> Any:
    """``moe_math.activate`` of the float32 ``h``; the gates the C++ gated-activation kernel covers
    (silu, gelu, gelu_tanh on ``[gate | up]``) in its one pass instead of torch's several."""
    spec = moe_math.gate_spec(activation)
    if spec is not None and gated_activation.covers(spec) is None:
        return gated_activation.gated_activation(h, spec=spec)
    return moe_math.activate(xp, h, activation)


def fused_experts(
    x: Any,
    topk_weights: Any,
    topk_ids: Any,
    w13: Any,
    w2: Any,
    w13_bias: Any = None,
    w2_bias: Any = None,
    expert_map: Any = None,
    *,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    float32_output: bool = False,
) -> Any:
    """``[T, H]`` in ``x``'s dtype (float32 with ``float32_output``): ``sum_j w[t, j] * (w2[e] @
    act(w13[e] @ x[t] + b13[e]) + b2[e])`` over the local experts ``e`` of token ``t``'s slots
    (``moe_math.experts_reference``'s value)."""
    import torch

    from dualop.backends import array_namespace

    decline_if_recording(_OP, x, topk_weights, w13, w2, w13_bias, w2_bias)
    tensors = (x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, expert_map)
    if any(t is not None and t.device.type != "cpu" for t in tensors):
        raise NotImplementedError(f"{_OP}: the CPU path takes CPU tensors")
    if dtype_code(w13) is None:
        raise NotImplementedError(f"{_OP}: the C++ CPU kernel has no {w13.dtype} weights")
    tokens, hidden = x.shape
    out_dtype = torch.float32 if float32_output else x.dtype
    if tokens == 0:
        return x.new_empty((0, hidden), dtype=out_dtype)
    f32 = torch.float32
    num_local, top_k = w13.shape[0], topk_ids.shape[1]
    xp = array_namespace(x)
    local_ids = moe_math.local_expert_ids(xp, topk_ids, expert_map, num_local)
    order, group_sizes = moe_math.sort_by_expert(xp, local_ids, num_local)
    sizes = group_sizes.tolist()
    used = [e for e, count in enumerate(sizes) if count]
    counts = [sizes[e] for e in used]
    pairs = order[:sum(counts)]
    out = torch.zeros((tokens, hidden), dtype=f32)
    if not used:
        return out.to(out_dtype)
    token_of_row = torch.div(pairs, top_k, rounding_mode="floor")
    weight_of_row = topk_weights.reshape(-1).to(f32).index_select(0, pairs)
    expert_of_row = torch.repeat_interleave(torch.tensor(used), torch.tensor(counts))

    h = _project(x.index_select(0, token_of_row), w13, used, counts)
    if apply_router_weight_on_input:  # w13 @ (s * x) == s * (w13 @ x): the rows stay exact (module docstring)
        h *= weight_of_row[:, None]
    if w13_bias is not None:
        h += w13_bias.to(f32).index_select(0, expert_of_row)
    y = _project(_activate(xp, h, activation), w2, used, counts)
    if w2_bias is not None:
        y += w2_bias.to(f32).index_select(0, expert_of_row)
    if not apply_router_weight_on_input:
        y *= weight_of_row[:, None]
    out.index_add_(0, token_of_row, y)
    return out.to(out_dtype)
