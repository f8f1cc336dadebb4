"""Attention over a paged KV cache: ``RaggedPagedAttention`` (registered ``ragged_paged_attention``),
the serving engine's TPU attention kernel, with the exact call of JAX's
``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` so callers can swap it in::

    out = RaggedPagedAttention()(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks=None, *,
                                 sm_scale=1.0, sliding_window=None, soft_cap=None,
                                 mask_value=None, k_scale=None, v_scale=None)

- ``q`` ``[T, Hq, D]`` (float32/bfloat16/float16); ``kv_pages`` ``[num_pages, page_size, 2*Hkv, D]``
  in ``q``'s dtype or float8 (float8_e4m3fn, float8_e5m2: the codes ``reshape_and_cache`` writes,
  each read as its exact float32 value), K and V heads interleaved (combined head ``2h`` is K head ``h``, ``2h+1`` V head
  ``h``); ``kv_lens`` int32 ``[S]``; ``page_indices`` int32 ``[S, pages_per_seq]``; ``cu_q_lens``
  int32 ``[S+1]``; ``num_seqs`` int32 ``[1]``.
- Sequence ``i < num_seqs[0]`` owns query rows ``cu_q_lens[i]:cu_q_lens[i+1]`` and KV positions
  ``0..kv_lens[i]-1``; token ``j`` lives at page ``page_indices[i, j // page_size]``, offset
  ``j % page_size``. Its queries are its last positions: row ``r`` of a sequence sits at position
  ``kv_len - q_len + r`` and sees KV position ``p`` iff ``p <= position`` (and, with a sliding
  window ``w``, ``p > position - w``). One call thus mixes prefill, chunked prefill and decode.
- In float32: ``s = (q . k) * sm_scale``; with ``soft_cap`` c, ``s = c * tanh(s / c)``; the score
  of a masked position below ``kv_len`` is replaced by ``mask_value`` (default JAX's
  ``DEFAULT_MASK_VALUE``, ``-0.7 *`` float32 max; JAX's reference adds it instead, which gives the
  same result unless a mask value near the scores is asked for), positions from ``kv_len`` on never
  count; softmax; ``p . v``; cast once to ``q``'s dtype. ``sinks`` (``[Hq]``, any float dtype, read
  as float32; gpt-oss's learned per-head attention sinks): one logit per query head that joins
  every row's softmax denominator and weighs no V row, so a row's weights sum to less than 1
  (``paged_attention_math.sink_logits``: clipped to +-float32 max, so +inf makes the output 0 and
  -inf is no sink; a NaN sink makes its head's rows NaN). It is compared with the scores as they
  are after ``sm_scale``, the soft cap and the mask (not capped itself). ``k_scale`` / ``v_scale``
  (Python numbers, a quantised cache's scales: an fp8 cache's element is read as ``code * scale``)
  multiply K / V in float32 before use; scale tensors are not taken (the kernels bake the scales in:
  the Pallas kernel as static values), so an engine passes its float copies (``layer._k_scale_float``). GQA: query head ``h`` reads KV
  head ``h // (Hq // Hkv)``.
- Rows past ``cu_q_lens[num_seqs[0]]`` (padding up to ``T``) are zeros, never NaN; a sequence with
  ``q_len == 0`` produces nothing.
- Non-finite values, on every path: a NaN or inf in sequence i's queries or in the K/V rows it
  reads (positions below its ``kv_len``) reaches only sequence i's output rows; cache rows from
  ``kv_len`` on (the rest of its last page, pages it does not use: a recycled page, a
  ``torch.empty`` cache) never reach any output, whatever they hold (the native body masks their
  scores and zeroes their V rows, the kernels never read them or zero them). In the native body
  and the C++ kernel a score of finite q and k is the float32 rounding of its exact dot product
  (+-inf past float32's range), never NaN, whatever order the sums take (``overflow_safe_scores``).

Validation (``check_inputs``, before any kernel): kinds, dtypes, ranks and shapes always; where the
metadata's values are visible (torch CPU/GPU tensors, jax arrays outside a trace: see
``_checks.concrete_values``) also ``cu_q_lens`` starting at 0, non-decreasing and ending at most at
``T`` (over its first ``num_seqs + 1`` entries), ``0 <= num_seqs <= S``, ``q_len <= kv_len <=
pages_per_seq * page_size`` per sequence, and every page index a sequence uses in
``[0, num_pages)``. Where they are not visible (under ``jax.jit``, torch_xla and torchax tensors)
nothing reads out of bounds: ``num_seqs`` is clamped to ``[0, S]``, ``cu_q_lens`` to ``[0, T]`` and
made non-decreasing (a running max: each row belongs to at most one sequence), ``kv_lens`` to
``[0, pages_per_seq * page_size]`` and page indices to ``[0, num_pages)`` (the native body here; the
Pallas, Triton and C++ kernels clamp the same way, each documents it), so bad metadata gives wrong
numbers, the same on every path, never a fault.
"""

from __future__ import annotations

import math
from typing import Any

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import CustomOp, Serves, validates_inputs
from dualop.kernels.paged_attention_math import DEFAULT_MASK_VALUE, sink_logits
from dualop.kernels.kv_cache_math import FP8_KV_FORMATS, fp8_kv_format
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import (
    check_array, check_optional_like, checked_before, concrete_values, decline_if_recording,
    remember_checked,
)
from dualop.platforms import frontend_of
from dualop.kernels import cost as cost_model
from dualop.kernels.cost import KernelCost
from dualop.spec import BenchCase, InputSpec, Serving

__all__ = ["RaggedPagedAttention", "DEFAULT_MASK_VALUE"]

OP = "ragged_paged_attention"
INT32 = frozenset({"int32"})
FLOATS = frozenset({"float32", "bfloat16", "float16"})

_PALLAS_RPA = KernelRef("dualop.kernels.pallas.ragged_paged_attention", "ragged_paged_attention")
_TRITON_RPA = KernelRef("dualop.kernels.cuda.ragged_paged_attention", "ragged_paged_attention")
_CPU_RPA = KernelRef("dualop.kernels.cpu.ragged_paged_attention", "ragged_paged_attention")
_CPU_FAST_RPA = KernelRef("dualop.kernels.cpu.ragged_paged_attention", "FAST_RAGGED_PAGED_ATTENTION")


def _check_option(name: str, value: Any, *, kind: type, positive: bool) -> None:
    """A keyword option: None or a number of ``kind`` (an int passes for a float), positive and
    finite if asked; a float option is never NaN."""
    if value is None:
        return
    ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
    if ok and positive:
        ok = math.isfinite(value) and value > 0
    if ok and kind is float:
        ok = not math.isnan(value)
    if not ok:
        want = ("a positive, finite " if positive else "a ") + ("int" if kind is int else "float")
        raise ValueError(f"{OP}: option '{name}' must be None or {want}, got {value!r}")


def _options(sm_scale, sliding_window, soft_cap, mask_value, k_scale, v_scale) -> dict[str, Any]:
    return dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, mask_value=mask_value,
                k_scale=k_scale, v_scale=v_scale)


def check_metadata_shapes(op: str, q: Any, fe: str, kv_lens: Any, page_indices: Any, cu_q_lens: Any,
                          num_seqs: Any, q_name: str = "q") -> None:
    """The ragged metadata's kinds, dtypes (int32) and shapes against ``q`` (any paged attention op)."""
    arrays = dict(kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu_q_lens, num_seqs=num_seqs)
    check_optional_like(op, "page_indices", page_indices, q_name, q, fe,
                        shape=tuple(getattr(page_indices, "shape", ())), dtypes=INT32)
    if page_indices.ndim != 2:
        raise ValueError(f"{op}: argument 'page_indices' must be [max_num_seqs, pages_per_seq], "
                         f"got shape {tuple(page_indices.shape)}")
    max_seqs, pages_per_seq = page_indices.shape
    for name, shape in (("kv_lens", (max_seqs,)), ("page_indices", (max_seqs, pages_per_seq)),
                        ("cu_q_lens", (max_seqs + 1,)), ("num_seqs", (1,))):
        check_optional_like(op, name, arrays[name], q_name, q, fe, shape=shape, dtypes=INT32)


def check_metadata_values(op: str, num_tokens: int, num_pages: int, page_size: int, kv_lens: Any,
                          page_indices: Any, cu_q_lens: Any, num_seqs: Any) -> None:
    """The metadata's values, where they can be read (see the module docstring)."""
    import numpy as np

    arrays, params = (kv_lens, page_indices, cu_q_lens, num_seqs), (op, num_tokens, num_pages, page_size)
    if checked_before("paged_metadata", arrays, params):
        return  # the same step's metadata, checked by the previous layer
    values = [concrete_values(a) for a in arrays]
    if any(v is None for v in values):
        return
    kv_len, pages, cu, count = values
    max_seqs, pages_per_seq = pages.shape
    n = int(count[0])
    if not 0 <= n <= max_seqs:
        raise ValueError(f"{op}: argument 'num_seqs' is {n}; expected 0 <= num_seqs <= {max_seqs} "
                         f"(page_indices' first dim)")
    used = cu[: n + 1].astype(np.int64)
    if used[0] != 0:
        raise ValueError(f"{op}: argument 'cu_q_lens' starts at {used[0]}; expected 0")
    steps = np.diff(used)
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        raise ValueError(f"{op}: argument 'cu_q_lens' is not non-decreasing: cu_q_lens[{i + 1}] = {used[i + 1]} "
                         f"< cu_q_lens[{i}] = {used[i]}")
    if used[-1] > num_tokens:
        raise ValueError(f"{op}: argument 'cu_q_lens' ends at {used[-1]} (cu_q_lens[num_seqs]); expected at most "
                         f"{num_tokens} (q's rows)")
    lens = kv_len[:n].astype(np.int64)
    short = np.nonzero(lens < steps)[0]
    if short.size:
        i = int(short[0])
        raise ValueError(f"{op}: argument 'kv_lens' has kv_lens[{i}] = {lens[i]} < q_len {steps[i]} of sequence "
                         f"{i}; expected kv_len >= q_len (queries are a sequence's last positions)")
    capacity = pages_per_seq * page_size
    long = np.nonzero(lens > capacity)[0]
    if long.size:
        i = int(long[0])
        raise ValueError(f"{op}: argument 'kv_lens' has kv_lens[{i}] = {lens[i]}; expected at most pages_per_seq * "
                         f"page_size = {capacity}")
    needed = (lens + page_size - 1) // page_size
    in_use = np.arange(pages_per_seq)[None, :] < needed[:, None]
    bad = in_use & ((pages[:n] < 0) | (pages[:n] >= num_pages))
    if bad.any():
        i, j = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"{op}: argument 'page_indices' has page_indices[{i}, {j}] = {pages[i, j]}, used by "
                         f"sequence {i}; expected a page in [0, {num_pages})")
    remember_checked("paged_metadata", arrays, params)


def row_sequences(xp: Any, q: Any, num_pages: int, page_size: int, kv_lens: Any, page_indices: Any, cu_q_lens: Any,
                  num_seqs: Any) -> tuple[Any, Any, Any, Any]:
    """Per query row of a ragged batch (the native bodies' rule, traceable with traced metadata):
    ``(valid [T], kv_len [T], position [T], pages [T, pages_per_seq], seq [T])``: whether a sequence
    owns the row, that sequence's kv_len, the row's KV position, its page ids and the sequence. Each row finds its
    sequence by comparison with ``cu_q_lens`` (no loop over the runtime ``num_seqs``); metadata is
    clamped (``num_seqs`` to ``[0, S]``, ``cu_q_lens`` to ``[0, T]`` and non-decreasing, ``kv_lens``
    to the page table's span, page ids to ``[0, num_pages)``)."""
    num_tokens = q.shape[0]
    max_seqs, pages_per_seq = page_indices.shape
    span = pages_per_seq * page_size
    rows = xp.arange(num_tokens, q)
    count = xp.clip(num_seqs[0], 0, max_seqs)
    # cu_q_lens clipped to [0, T] and made non-decreasing (a running max, as a masked max: S is small)
    clipped = xp.clip(cu_q_lens, 0, num_tokens)
    entries = xp.arange(max_seqs + 1, q)
    cu = xp.amax(xp.where(entries[None, :] <= entries[:, None], clipped[None, :], 0), axis=1)
    # sequence of each row: how many of the num_seqs sequences end at or before it (the entries of
    # cu_q_lens past num_seqs + 1 mean nothing and are never read)
    used = xp.arange(max_seqs, q)[None, :] < count
    seq = xp.astype(xp.sum(xp.astype((cu[None, 1:] <= rows[:, None]) & used, xp.int32), axis=1), xp.int32)
    valid = (seq < count) & (rows >= cu[0])
    seq = xp.minimum(seq, max_seqs - 1)
    q_start, q_end = xp.take(cu, seq), xp.take(cu, seq + 1)
    kv_len = xp.clip(xp.take(kv_lens, seq), 0, span)
    position = kv_len - (q_end - q_start) + (rows - q_start)  # [T]
    pages = xp.clip(xp.take(page_indices, seq, axis=0), 0, num_pages - 1)  # [T, pages_per_seq]
    return valid, kv_len, position, pages, seq


# A vector with an element above _BIG in magnitude is scaled by _DOWN before its dot products and
# the products by _UP after: exact powers of two, so nothing changes below _BIG, and scaled
# partial sums (at most 2^51 * 2^51 * head_dim) cannot overflow.
_BIG, _DOWN, _UP = 2.0 ** 50, 2.0 ** -77, 2.0 ** 77


def overflow_safe_scores(xp: Any, q: Any, k: Any) -> Any:
    """``einsum("tkgd,tlkd->tkgl", q, k)`` in float32 (q ``[T, Hkv, G, D]``, k ``[T, L, Hkv, D]``)
    whose dot products of finite vectors are the float32 rounding of their exact values (+-inf
    past float32's range), never NaN: unscaled, a sum of huge products can overflow to +inf in one
    partial sum and -inf in another, which depends on how the einsum orders its sums (torch and
    XLA differ). Vectors holding an element above ``_BIG`` are scaled down first (the others are
    untouched: the same sums). The C++ kernel computes its scores by the same rule."""
    q_big = xp.amax(xp.abs(q), axis=-1, keepdims=True) > _BIG  # [T, Hkv, G, 1]
    k_big = xp.amax(xp.abs(k), axis=-1, keepdims=True) > _BIG  # [T, L, Hkv, 1]
    scores = xp.einsum("tkgd,tlkd->tkgl", xp.where(q_big, q * _DOWN, q), xp.where(k_big, k * _DOWN, k))
    k_up = xp.where(k_big, _UP, 1.0)[..., 0].swapaxes(1, 2)[:, :, None, :]  # [T, Hkv, 1, L]
    return scores * xp.where(q_big, _UP, 1.0) * k_up  # scaled back one factor at a time: no spurious overflow


def finite_or_safe(xp: Any, fast: Any, safe: Any, *args: Any) -> Any:
    """``fast(*args)`` where all its values are finite, else ``safe(*args)``, for two computations
    that agree whenever ``fast``'s result is finite (an overflow, or a stale NaN row met by a 0
    weight, leaves a non-finite value in it) and ``safe`` costs a pass more. jax: ``lax.cond``, so
    the safe branch runs only when needed (``args``: the cache and the page ids, from which each
    branch gathers its rows: a gathered array as an operand would be copied on every call); eager
    torch on the CPU: a branch on the values; elsewhere (torch on a device, fake tensors of a
    compile) ``safe`` alone."""
    if xp.name == "jax":
        import jax

        value = fast(*args)
        finite = xp.sum(xp.astype(~(xp.abs(value) < math.inf), xp.int32)) == 0
        return jax.lax.cond(finite, lambda v, *a: v, lambda v, *a: safe(*a), value, *args)
    import torch
    from torch._subclasses.fake_tensor import is_fake

    first = args[0]
    if first.device.type == "cpu" and not torch.compiler.is_compiling() and not is_fake(first):
        value = fast(*args)
        if bool((xp.abs(value) < math.inf).all()):
            return value
    return safe(*args)


def _gatherable(pages: Any) -> Any:
    """A plain torch float8 cache as its uint8 view (torch 2.9's CPU indexing has no float8
    kernels); anything else as it is."""
    if frontend_of(pages) == "torch" and fp8_kv_format(pages.dtype) is not None:
        import torch

        return pages.view(torch.uint8)
    return pages


def _as_cache_dtype(rows: Any, kv_pages: Any) -> Any:
    """Gathered rows back in the cache's dtype (undoing ``_gatherable``'s view)."""
    return rows.view(kv_pages.dtype) if rows.dtype != kv_pages.dtype else rows


@CustomOp.register("ragged_paged_attention")
class RaggedPagedAttention(CustomOp):
    """Attention of a ragged batch of queries (prefill, chunked prefill and decode rows mixed) over a
    paged KV cache; see the module docstring for the contract.

    Fast paths: ``forward_tpu`` a Pallas kernel (K/V pages streamed from HBM by manual DMA),
    ``forward_cuda`` a Triton kernel, ``forward_cpu`` (torch CPU tensors) a C++ kernel that reads
    the pages in place.
    JAX arrays on a GPU run the native body (no jax-triton; ``jax.nn.dot_product_attention`` takes
    padded ``[batch, seq]`` layouts, not a ragged paged batch: see ``declines``).
    """

    def __init__(self, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)

    # ------------------------------------------------------------------ validation

    def check_inputs(self, q: Any = None, kv_pages: Any = None, kv_lens: Any = None, page_indices: Any = None,
                     cu_q_lens: Any = None, num_seqs: Any = None, sinks: Any = None, *, sm_scale: float = 1.0,
                     sliding_window: int | None = None, soft_cap: float | None = None,
                     mask_value: float | None = None, k_scale: float | None = None,
                     v_scale: float | None = None) -> None:
        arrays = dict(q=q, kv_pages=kv_pages, kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu_q_lens,
                      num_seqs=num_seqs)
        for name, value in arrays.items():
            if value is None:
                raise TypeError(f"{OP}: argument '{name}' is required")
        fe = check_array(OP, "q", q, min_ndim=3)
        if q.ndim != 3:
            raise ValueError(f"{OP}: argument 'q' must be [num_tokens, num_q_heads, head_dim], got shape {tuple(q.shape)}")
        fp8_cache = frontend_of(kv_pages) is not None and fp8_kv_format(kv_pages.dtype) is not None
        check_optional_like(OP, "kv_pages", kv_pages, "q", q, fe, shape=tuple(getattr(kv_pages, "shape", ())),
                            same_dtype=not fp8_cache, dtypes=frozenset(FP8_KV_FORMATS) if fp8_cache else FLOATS)
        if kv_pages.ndim != 4:
            raise ValueError(f"{OP}: argument 'kv_pages' must be [num_pages, page_size, 2 * num_kv_heads, head_dim], "
                             f"got shape {tuple(kv_pages.shape)}")
        num_tokens, num_q_heads, head_dim = q.shape
        num_pages, page_size, combined, kv_head_dim = kv_pages.shape
        if kv_head_dim != head_dim:
            raise ValueError(f"{OP}: argument 'kv_pages' has head dim {kv_head_dim}; expected q's head dim {head_dim}")
        if combined == 0 or combined % 2:
            raise ValueError(f"{OP}: argument 'kv_pages' has {combined} combined K/V heads; expected an even, "
                             f"non-zero count (K and V heads interleaved)")
        num_kv_heads = combined // 2
        if num_q_heads == 0 or num_q_heads % num_kv_heads:
            raise ValueError(f"{OP}: q has {num_q_heads} heads, which {num_kv_heads} KV heads do not divide; "
                             f"expected num_q_heads % num_kv_heads == 0")
        if page_size == 0:
            raise ValueError(f"{OP}: argument 'kv_pages' has page_size 0; expected at least 1")
        check_metadata_shapes(OP, q, fe, kv_lens, page_indices, cu_q_lens, num_seqs)
        check_optional_like(OP, "sinks", sinks, "q", q, fe, shape=(num_q_heads,), dtypes=FLOATS)
        _check_option("sm_scale", sm_scale, kind=float, positive=True)
        if sm_scale is None:
            raise ValueError(f"{OP}: option 'sm_scale' must be a positive, finite float, got None")
        _check_option("sliding_window", sliding_window, kind=int, positive=True)
        _check_option("soft_cap", soft_cap, kind=float, positive=True)
        _check_option("mask_value", mask_value, kind=float, positive=False)
        if mask_value is not None and mask_value == math.inf:
            raise ValueError(f"{OP}: option 'mask_value' must be None or a float below +inf (a masked score), "
                             f"got {mask_value!r}")
        _check_option("k_scale", k_scale, kind=float, positive=True)
        _check_option("v_scale", v_scale, kind=float, positive=True)
        check_metadata_values(OP, num_tokens, num_pages, page_size, kv_lens, page_indices, cu_q_lens, num_seqs)

    # ------------------------------------------------------------------ implementations

    def forward_native(self, q: Any, kv_pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any, num_seqs: Any,
                       sinks: Any = None, *, sm_scale: float = 1.0, sliding_window: int | None = None, soft_cap: float | None = None,
                       mask_value: float | None = None, k_scale: float | None = None,
                       v_scale: float | None = None) -> Any:
        """Each query row finds its sequence by comparison with ``cu_q_lens`` (no loop over the
        runtime ``num_seqs``, so it traces under ``jit`` with traced metadata), gathers that
        sequence's pages and masks by position. Memory: ``T * pages_per_seq * page_size`` K/V rows,
        a reference, not a serving path. Metadata is clamped (module docstring). Rows from ``kv_len``
        on (a recycled page's stale rows, NaN or inf garbage) never count: their scores are masked,
        and where some value of the product is not finite their V rows are zeroed first (``0 *
        NaN`` would reach the output); scores as ``overflow_safe_scores`` (``finite_or_safe``)."""
        xp = array_namespace(q)
        num_tokens, num_q_heads, head_dim = q.shape
        num_pages, page_size, combined, _ = kv_pages.shape
        num_kv_heads = combined // 2
        group = num_q_heads // num_kv_heads
        span = page_indices.shape[1] * page_size
        valid, kv_len, position, pages, _ = row_sequences(xp, q, num_pages, page_size, kv_lens, page_indices, cu_q_lens,
                                                       num_seqs)
        kv_pos = xp.arange(span, q)[None, :]
        cached = kv_pos < kv_len[:, None]  # [T, span]: positions past kv_len never count, whatever mask_value

        def rows(kv_pages, pages, half, scale):
            """K (``half`` 0) or V (1) rows ``[T, span, Hkv, D]`` of each row's sequence, float32."""
            x = xp.take(_gatherable(kv_pages[:, :, half::2, :]), pages, axis=0)
            x = _as_cache_dtype(x, kv_pages).reshape((num_tokens, span, num_kv_heads, head_dim))
            x = xp.astype(x, xp.float32)
            return x if scale is None else x * scale

        qf = xp.astype(q, xp.float32).reshape((num_tokens, num_kv_heads, group, head_dim))
        scores = finite_or_safe(  # [T, Hkv, G, span]; a stale K row's score is masked below
            xp, lambda kv, p: xp.einsum("tkgd,tlkd->tkgl", qf, rows(kv, p, 0, k_scale)),
            lambda kv, p: overflow_safe_scores(xp, qf, rows(kv, p, 0, k_scale)), kv_pages, pages) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * xp.tanh(scores / soft_cap)
        allowed = (kv_pos <= position[:, None]) & cached
        if sliding_window is not None:
            allowed = allowed & (kv_pos > position[:, None] - sliding_window)
        fill = DEFAULT_MASK_VALUE if mask_value is None else mask_value
        fill = xp.where(cached, fill, DEFAULT_MASK_VALUE)[:, None, None, :]
        scores = xp.where(allowed[:, None, None, :], scores, fill)
        top = xp.amax(scores, axis=-1, keepdims=True)
        if sinks is None:
            scores = xp.exp(scores - top)
            probs = scores / xp.sum(scores, axis=-1, keepdims=True)
        else:  # the sink joins the denominator only (sink_logits)
            sink = xp.reshape(sink_logits(xp, sinks), (1, num_kv_heads, group, 1))
            top = xp.maximum(top, sink)
            scores = xp.exp(scores - top)
            probs = scores / (xp.sum(scores, axis=-1, keepdims=True) + xp.exp(sink - top))
        # a stale V row weighs 0, but 0 * NaN is NaN: zeroed when some value is not finite
        zeroed = cached[:, :, None, None]
        out = finite_or_safe(
            xp, lambda kv, p: xp.einsum("tkgl,tlkd->tkgd", probs, rows(kv, p, 1, v_scale)),
            lambda kv, p: xp.einsum("tkgl,tlkd->tkgd", probs, xp.where(zeroed, rows(kv, p, 1, v_scale), 0.0)),
            kv_pages, pages).reshape((num_tokens, num_q_heads, head_dim))
        out = xp.where(valid[:, None, None], out, 0.0)
        return xp.astype(out, q.dtype)

    serves = {"forward_cuda": Serves(("torch",), (
        "no Triton kernel for {frontend} arrays (it would need jax-triton), and jax.nn.dot_product_attention "
        "does not apply: it takes padded [batch, seq] layouts, not ragged rows over a paged cache"))}

    def forward_tpu(self, q: Any, kv_pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any, num_seqs: Any,
                    sinks: Any = None, *, sm_scale: float = 1.0, sliding_window: int | None = None, soft_cap: float | None = None,
                    mask_value: float | None = None, k_scale: float | None = None,
                    v_scale: float | None = None) -> Any:
        options = _options(sm_scale, sliding_window, soft_cap, mask_value, k_scale, v_scale)
        return call_jax_function(frontend_of(q), _PALLAS_RPA, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                 sinks, native=_NativeWithOptions(self, options), **options)

    def forward_cuda(self, q: Any, kv_pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any, num_seqs: Any,
                     sinks: Any = None, *, sm_scale: float = 1.0, sliding_window: int | None = None, soft_cap: float | None = None,
                     mask_value: float | None = None, k_scale: float | None = None,
                     v_scale: float | None = None) -> Any:
        return call_triton(frontend_of(q), _TRITON_RPA, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                           sinks, **_options(sm_scale, sliding_window, soft_cap, mask_value, k_scale, v_scale))

    @validates_inputs
    def forward_cpu(self, q: Any, kv_pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any, num_seqs: Any,
                    sinks: Any = None, *, sm_scale: float = 1.0, sliding_window: int | None = None, soft_cap: float | None = None,
                    mask_value: float | None = None, k_scale: float | None = None,
                    v_scale: float | None = None) -> Any:
        """torch on the CPU: the C++ kernel (``kernels/cpu``), which reads each K/V row from its page
        once per (sequence, KV head, block of query rows), no gathered copy (docs/BENCHMARKS.md: about
        twice a gather-then-SDPA decode in float32 here). It declines while autograd records (no
        backward) and where the kernels cannot be built. A call with ``sm_scale`` alone and plain
        row-major tensors goes straight to the kernel's torch operator, which checks it (metadata
        values included) in C++; any other call is checked here first."""
        if (type(sm_scale) is float and sinks is None and sliding_window is None and soft_cap is None
                and mask_value is None and k_scale is None and v_scale is None):
            out = _CPU_FAST_RPA.resolve().take(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale)
            if out is not None:
                return out
        self.check_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks, sm_scale=sm_scale,
                          sliding_window=sliding_window, soft_cap=soft_cap, mask_value=mask_value, k_scale=k_scale,
                          v_scale=v_scale)
        decline_if_recording(OP, q, kv_pages, sinks)
        return _CPU_RPA(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks,
                        **_options(sm_scale, sliding_window, soft_cap, mask_value, k_scale, v_scale))


class _NativeWithOptions:
    """``forward_native`` with the call's keyword options bound: the backward pass of the Pallas
    path (``call_jax_function``'s ``native``) is the VJP of the same computation."""

    def __init__(self, op: RaggedPagedAttention, options: dict[str, Any]) -> None:
        self.op, self.options = op, options

    def __call__(self, *arrays: Any) -> Any:  # the op's arrays, sinks (or None) last
        return self.op.forward_native(*arrays, **self.options)


# --- check cases ---------------------------------------------------------------------------------


def paged_batch(rng, q_lens, kv_lens, *, num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                page_size: int, max_seqs: int | None = None, spare_pages: int = 1, q_scale: float = 1.0):
    """A ragged batch as numpy arrays ``(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)``
    (float32 q and pages, int32 metadata): the sequences' pages in random order across the cache,
    ``spare_pages`` unused page slots per sequence (random in-range ids), ``max_seqs - len(q_lens)``
    padding sequences and rows from ``sum(q_lens)`` to ``num_tokens`` as padding."""
    import numpy as np

    count = len(q_lens)
    max_seqs = count if max_seqs is None else max_seqs
    pages_per_seq = max([-(-k // page_size) for k in kv_lens] + [1]) + spare_pages
    num_pages = max_seqs * pages_per_seq + 2
    order = rng.permutation(num_pages).astype(np.int32)
    page_indices = order[: max_seqs * pages_per_seq].reshape(max_seqs, pages_per_seq)
    lens = np.zeros(max_seqs, np.int32)
    lens[:count] = kv_lens
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:count + 1] = np.cumsum(q_lens)
    cu[count + 1:] = cu[count]
    assert cu[count] <= num_tokens
    q = (rng.standard_normal((num_tokens, num_q_heads, head_dim)) * q_scale).astype(np.float32)
    kv_pages = rng.standard_normal((num_pages, page_size, 2 * num_kv_heads, head_dim)).astype(np.float32)
    return q, kv_pages, lens, page_indices, cu, np.array([count], np.int32)


# (q_len, kv_len) per sequence for a check shape's T rows: decode, prefill, a chunk of a longer
# prompt, another decode, an empty sequence; the rows left over are padding.
_MIXED = ((1, 9), (3, 3), (1, 14), (0, 6), (4, 11))


def _mixed_layout(num_tokens: int) -> tuple[list[int], list[int]]:
    q_lens, kv_lens, used = [], [], 0
    for q_len, kv_len in _MIXED:
        if used + q_len > num_tokens:
            break
        q_lens.append(q_len)
        kv_lens.append(kv_len)
        used += q_len
    return q_lens, kv_lens


def check_cases():
    """Small mixed batches (every cell runs them, interpreters included): ``shape`` is q's
    ``(T, Hq, D)``; the sequences are ``_MIXED``'s first ones that fit in ``T`` rows, with one
    padding sequence and padding rows."""
    from dualop.testing import OpCase, Pinned

    def inputs(group: int, page_size: int, sinks: bool = False):
        def make(shape, rng):
            num_tokens, num_q_heads, head_dim = shape
            q_lens, kv_lens = _mixed_layout(num_tokens)
            arrays = paged_batch(rng, q_lens, kv_lens, num_tokens=num_tokens, num_q_heads=num_q_heads,
                                 num_kv_heads=max(1, num_q_heads // group), head_dim=head_dim, page_size=page_size,
                                 max_seqs=len(q_lens) + 1)
            extra = ()
            if sinks:  # about the scores' size, one far above them (its head's rows near 0), one far below
                logits = rng.normal(0.0, 1.5, num_q_heads).astype(arrays[0].dtype)
                logits[:2] = (8.0, -30.0)[:num_q_heads]
                extra = (logits,)
            return (*arrays[:2], *(Pinned(a, "int32") for a in arrays[2:]), *extra)

        return make

    def fp8_inputs(cache_dtype: str):
        """``inputs(2, 4)`` with the cache's values as codes of a float8 cache (about 20 in
        magnitude, read as ``code * scale`` with the case's k_scale / v_scale)."""
        make = inputs(2, 4)

        def make_fp8(shape, rng):
            q, kv_pages, *meta = make(shape, rng)
            return (q, Pinned(kv_pages * 20.0, cache_dtype), *meta)

        return make_fp8

    shapes = ((0, 4, 64), (1, 1, 64), (12, 8, 128))
    fp8_options = {"sm_scale": 0.125, "k_scale": 0.0371, "v_scale": 0.043}  # not powers of two
    return [
        OpCase(OP, f"{OP}[mixed,gqa2]", lambda s: RaggedPagedAttention(), inputs(2, 4), shapes,
               options={"sm_scale": 0.125}),
        # mask_value -2 lies among the soft-capped scores: masked positions below kv_len count; the
        # sinks join every row's denominator.
        OpCase(OP, f"{OP}[gqa4,window,soft_cap,mask_value,sinks]", lambda s: RaggedPagedAttention(),
               inputs(4, 8, sinks=True), shapes,
               options={"sm_scale": 0.125, "sliding_window": 5, "soft_cap": 3.0, "mask_value": -2.0}),
        OpCase(OP, f"{OP}[k_scale,v_scale]", lambda s: RaggedPagedAttention(), inputs(1, 4), shapes,
               options={"sm_scale": 0.125, "k_scale": 0.5, "v_scale": 1.5}),
        *(OpCase(OP, f"{OP}[{dtype},k_scale,v_scale]", lambda s: RaggedPagedAttention(), fp8_inputs(dtype), shapes,
                 options=fp8_options) for dtype in FP8_KV_FORMATS),
    ]


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


# --- ragged paged attention: decode over a paged KV cache ----------------------------------------
# Shape (num_seqs, kv_len, 2 * Hkv * D): one query row per sequence (decode), every sequence kv_len
# tokens long, Hkv = 8 KV heads of D = 128 (Llama-3-70B's), Hq = 32, pages of 16 tokens in random
# order. The last two dims are the K/V rows the op must read, so the copy roofline copies exactly
# those bytes. A bench size (R, C) maps to R // 128 sequences of C // 4 tokens (small: 32 x 1024).
_RPA_HEAD_DIM, _RPA_GROUP, _RPA_PAGE = 128, 4, 16


def _rpa_decode_shape(size: tuple[int, ...]) -> tuple[int, int, int]:
    rows, cols = size[0], size[-1]
    return (max(1, rows // 128), max(_RPA_PAGE, cols // 4 // _RPA_PAGE * _RPA_PAGE), 2 * 8 * _RPA_HEAD_DIM)


def _rpa_heads(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(Hq, Hkv, D) of a decode shape."""
    num_kv_heads = shape[2] // (2 * _RPA_HEAD_DIM)
    return _RPA_GROUP * num_kv_heads, num_kv_heads, _RPA_HEAD_DIM


def _rpa_decode_inputs(shape, rng):
    from dualop.ops.attention import paged_batch
    from dualop.testing import Pinned

    num_seqs, kv_len, _ = shape
    num_q_heads, num_kv_heads, head_dim = _rpa_heads(shape)
    arrays = paged_batch(rng, [1] * num_seqs, [kv_len] * num_seqs, num_tokens=num_seqs, num_q_heads=num_q_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=_RPA_PAGE, spare_pages=0,
                         q_scale=head_dim ** -0.5)  # the op's default sm_scale is 1: scale q instead
    return (*arrays[:2], *(Pinned(a, "int32") for a in arrays[2:]))


def _rpa_decode_cost(op, shape, itemsize, window: int | None = None) -> KernelCost:
    """Each decode row reads its sequence's last ``window`` positions (all of them without one)."""
    num_seqs, kv_len, _ = shape
    seen = kv_len if window is None else min(window, kv_len)
    num_q_heads, num_kv_heads, head_dim = _rpa_heads(shape)
    return cost_model.ragged_paged_attention_cost(num_seqs, num_seqs * seen, num_seqs * seen, num_q_heads,
                                                  num_kv_heads, head_dim, itemsize)


def _torch_gather_sdpa(op):
    """What a torch user writes for a decode batch: gather each sequence's pages, then SDPA with a
    length mask (GQA by ``enable_gqa``) and the op's default ``sm_scale`` 1, in float32 (SDPA's
    bfloat16 CPU kernel rounds the probabilities to bfloat16, outside the tolerance table), one
    cast back."""
    import torch
    import torch.nn.functional as F

    def decode(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sliding_window=None):
        num_seqs_, pages_per_seq = page_indices.shape
        _, page_size, combined, head_dim = kv_pages.shape
        kv = kv_pages[page_indices].reshape(num_seqs_, pages_per_seq * page_size, combined, head_dim).float()
        k, v = kv[:, :, 0::2].transpose(1, 2), kv[:, :, 1::2].transpose(1, 2)
        positions = torch.arange(pages_per_seq * page_size)
        mask = positions < kv_lens[:, None]
        if sliding_window is not None:  # the decode row sits at kv_len - 1
            mask &= positions > kv_lens[:, None] - 1 - sliding_window
        out = F.scaled_dot_product_attention(q[:, :, None].float(), k, v, attn_mask=mask[:, None, None], scale=1.0,
                                             enable_gqa=True)  # the op's default sm_scale
        return out[:, :, 0].to(q.dtype)

    return decode


def _jax_paged_decode(op):
    """A hand-written jax.numpy decode: gather pages per sequence, float32 softmax, one cast."""
    import jax
    import jax.numpy as jnp

    def decode(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sliding_window=None):
        num_seqs_, pages_per_seq = page_indices.shape
        _, page_size, combined, head_dim = kv_pages.shape
        num_kv_heads, span = combined // 2, pages_per_seq * page_size
        kv = kv_pages[page_indices].reshape(num_seqs_, span, combined, head_dim).astype(jnp.float32)
        qf = q.astype(jnp.float32).reshape(num_seqs_, num_kv_heads, -1, head_dim)
        scores = jnp.einsum("skgd,slkd->skgl", qf, kv[:, :, 0::2])
        positions = jnp.arange(span)
        seen = positions < kv_lens[:, None]
        if sliding_window is not None:  # the decode row sits at kv_len - 1
            seen &= positions > kv_lens[:, None] - 1 - sliding_window
        scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
        out = jnp.einsum("skgl,slkd->skgd", jax.nn.softmax(scores, axis=-1), kv[:, :, 1::2])
        return out.reshape(q.shape).astype(q.dtype)

    return decode


def _ragged_paged_attention_inputs(shape: tuple[int, ...], cache_dtype: str | None = None,
                                   sinks: bool = False) -> tuple:
    """q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs (and float32 sinks) for one serving
    shape; the cache in ``cache_dtype`` (None: q's)."""
    tokens, seqs, pages, page_size, pages_per_seq, q_heads, kv_heads, head_dim = shape
    return (
        InputSpec((tokens, q_heads, head_dim), None),
        InputSpec((pages, page_size, 2 * kv_heads, head_dim), cache_dtype),
        InputSpec((seqs,), "int32"),
        InputSpec((seqs, pages_per_seq), "int32"),
        InputSpec((seqs + 1,), "int32"),
        InputSpec((1,), "int32"),
        *((InputSpec((q_heads,), "float32"),) if sinks else ()),
    )


def bench_cases():
    """Not run by default: decode over a paged KV cache, without and with a sliding window, against
    gathered pages then SDPA (torch) and a hand-written jax.numpy decode."""
    window = 128
    return [BenchCase("ragged_paged_attention[decode]", "ragged_paged_attention", lambda hidden: RaggedPagedAttention(),
                      _rpa_decode_inputs, _rpa_decode_cost, _torch_gather_sdpa, _jax_paged_decode, default=False,
                      shape_of=_rpa_decode_shape),
            # the same decode with gpt-oss's 128-token window: the kernels read only the window's
            # pages, so the time follows the window, not the context (the cost model's bytes too)
            BenchCase(f"ragged_paged_attention[decode,window{window}]", "ragged_paged_attention",
                      lambda hidden: RaggedPagedAttention(), _rpa_decode_inputs,
                      lambda op, shape, itemsize: _rpa_decode_cost(op, shape, itemsize, window), _torch_gather_sdpa,
                      _jax_paged_decode, default=False, shape_of=_rpa_decode_shape,
                      options={"sliding_window": window})]


def serving():
    """(T, num_seqs, num_pages, page_size, pages_per_seq, Hq, Hkv, D). One mixed serving step of 2048
    query tokens over 256 sequences (prefill chunks and many decodes) and a 2048-page cache,
    Llama-3-8B heads (32 / 8, d 128) at pages of 16 and 128 tokens, then head dims 64 and 256
    (Gemma: 16 / 8 heads); pages_per_seq bounds a sequence at 2048 (4096) positions. Built for two
    of the three float-cache check variants and for an e4m3 cache: the scales of [k_scale,v_scale]
    are two multiplies on the same blocks (its check shapes still build), while the window, soft cap,
    mask value and sinks add code paths, and an fp8 cache halves the page blocks' bytes and adds the
    dequantise (e5m2 differs in the conversion only: its check shapes build); a build at these
    shapes costs seconds each."""
    shapes = ((2048, 256, 2048, 16, 128, 32, 8, 128), (2048, 256, 2048, 128, 32, 32, 8, 128),
              (2048, 256, 2048, 16, 128, 32, 8, 64), (2048, 256, 2048, 16, 128, 16, 8, 256))
    plain = "ragged_paged_attention[mixed,gqa2]"
    options = "ragged_paged_attention[gqa4,window,soft_cap,mask_value,sinks]"
    float_cache = (plain, options)
    fp8 = "ragged_paged_attention[float8_e4m3fn,k_scale,v_scale]"
    inputs = {plain: _ragged_paged_attention_inputs,
              options: lambda shape: _ragged_paged_attention_inputs(shape, sinks=True),
              fp8: lambda shape: _ragged_paged_attention_inputs(shape, "float8_e4m3fn")}
    return {"ragged_paged_attention": Serving(shapes, inputs, cases=(*float_cache, fp8))}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"ragged_paged_attention": {"traits": {"structured_inputs"}},
              **{f"ragged_paged_attention[{dtype},k_scale,v_scale]": {"traits": {"fp8_inputs"}}
                 for dtype in ("float8_e4m3fn", "float8_e5m2")}}
