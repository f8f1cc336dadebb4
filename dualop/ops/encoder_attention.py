"""Vision-encoder attention: ``MMEncoderAttention`` (registered ``mm_encoder_attn``), the reference
serving engine's non-causal attention for ViT towers.

``op = MMEncoderAttention(num_heads, head_size, scale=None, num_kv_heads=None)``;
``out = op(query, key, value, cu_seqlens=None, max_seqlen=None)``.

- ``query`` ``[B, S, H*D]`` or ``[B, S, H, D]``; ``key``/``value`` the same layout with
  ``num_kv_heads`` heads; ``out`` has ``query``'s shape and dtype. Non-causal.
- GQA: ``num_heads % num_kv_heads == 0``; query head ``h`` reads kv head ``h // (H / Hkv)``.
- ``cu_seqlens`` (int32 ``[n + 1]``, ``0 = c0 <= c1 <= ... <= cn = S``, only with ``B == 1``): the
  tokens are ``n`` packed sequences (images, windows); each attends only to itself.
  ``max_seqlen`` (optional, at least the longest segment) bounds the Triton kernel's loops; it is
  read from ``cu_seqlens`` when not given. An int, or as the reference engine passes it, a
  1-element integer tensor/array (0-d or ``[1]``, e.g. ``(cu[1:] - cu[:-1]).max()``); see
  ``max_seqlen_int`` for where a tensor is read to the host.
- ``scale`` defaults to ``head_size ** -0.5``. Logits, softmax and ``P @ V`` in float32, one cast.
- Non-finite values stay in their segment, on every path: a NaN or inf in a segment's queries,
  keys or values reaches only that segment's rows (another segment's scores are replaced by
  ``where``, never added to). With ``cu_seqlens``, a value channel holding NaN (or both
  infinities) in a segment is NaN in that channel of the segment's rows, one holding a single
  infinity is that infinity there (``isolate_nonfinite_values``; a kernel that sums ``p * inf``
  itself gives NaN instead where a weight underflows to 0).

Bad ``cu_seqlens`` values (decreasing, not from 0 to S) are refused when they can be read (eager
calls); under ``jax.jit`` they cannot: token ``i`` then belongs to segment ``#{j >= 1: c_j <= i}``
(every kernel uses that rule, so they agree; no NaN, since a token is always in its own segment).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import CustomOp, Serves
from dualop.kernels.encoder_attention_math import isolate_nonfinite_values, segment_ids
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import FLOAT_DTYPES, check_array, decline_if_recording, dtype_name
from dualop.platforms import family_of, frontend_of
from dualop.kernels import cost as cost_model
from dualop.kernels.cost import KernelCost
from dualop.spec import BenchCase, InputSpec, Serving, float32_normal as _normal

__all__ = ["MMEncoderAttention"]

_OP = "mm_encoder_attn"
_PALLAS_ENCODER_ATTENTION = KernelRef("dualop.kernels.pallas.encoder_attention", "encoder_attention")
_TRITON_ENCODER_ATTENTION = KernelRef("dualop.kernels.cuda.encoder_attention", "encoder_attention")


_MAX_SEQLEN_DTYPES = frozenset({"int32", "int64"})


def _check_max_seqlen(max_seqlen: Any, query_frontend: str) -> None:
    """``max_seqlen`` is None, a non-negative int (numpy ints too, bools not) or a 1-element integer
    array of the query's frontend family (the engine's tensor); its value is checked with
    ``cu_seqlens``' (``_segment_values``)."""
    if max_seqlen is None:
        return
    if isinstance(max_seqlen, bool):
        raise TypeError(f"{_OP}: argument 'max_seqlen' must be None, an int or a 1-element int tensor, got a bool")
    if isinstance(max_seqlen, (int, np.integer)):
        if max_seqlen < 0:
            raise ValueError(f"{_OP}: argument 'max_seqlen' must be non-negative, got {max_seqlen!r}")
        return
    fe = frontend_of(max_seqlen)
    if fe is None:
        raise TypeError(f"{_OP}: argument 'max_seqlen' must be None, an int or a 1-element int tensor, got "
                        f"{type(max_seqlen).__module__}.{type(max_seqlen).__qualname__}")
    if family_of(fe) != family_of(query_frontend):
        raise TypeError(f"{_OP}: argument 'max_seqlen' is a {family_of(fe)} array but 'query' is a "
                        f"{family_of(query_frontend)} array; pass an int or an array of one frontend")
    if dtype_name(max_seqlen) not in _MAX_SEQLEN_DTYPES:
        raise TypeError(f"{_OP}: argument 'max_seqlen' has dtype {dtype_name(max_seqlen)}; expected int32 or int64")
    if math.prod(max_seqlen.shape) != 1:
        raise ValueError(f"{_OP}: argument 'max_seqlen' must hold one value (shape () or (1,)), got shape "
                         f"{tuple(max_seqlen.shape)}")


def max_seqlen_int(max_seqlen: Any) -> int | None:
    """``max_seqlen`` as a Python int (None stays None), for the one path that needs it on the host:
    the Triton kernel, whose key-block count is a compile-time constant and part of its grid. A
    tensor on a GPU is read with one device-to-host copy here, unavoidably (a host CPU tensor or a
    numpy/int value costs none); every other path ignores ``max_seqlen`` and reads nothing."""
    if max_seqlen is None or isinstance(max_seqlen, (int, np.integer)):
        return None if max_seqlen is None else int(max_seqlen)
    return int(max_seqlen.reshape(-1)[0])


def _segment_values(cu_seqlens: Any, max_seqlen: Any) -> tuple[Any, int | None]:
    """(``cu_seqlens``' values or None, ``max_seqlen`` as an int or None) for the eager value checks.
    A ``max_seqlen`` array on ``cu_seqlens``' device comes back in the same device-to-host copy as
    ``cu_seqlens`` (one sync, as before it was accepted); values that cannot be read (traced) are
    None."""
    if max_seqlen is None or isinstance(max_seqlen, (int, np.integer)):
        return concrete_values(cu_seqlens), None if max_seqlen is None else int(max_seqlen)
    joined = None
    fe = frontend_of(cu_seqlens)
    if fe == frontend_of(max_seqlen):
        if family_of(fe) == "jax":
            import jax.numpy as jnp

            joined = jnp.concatenate([cu_seqlens.reshape(-1), max_seqlen.reshape(1).astype(cu_seqlens.dtype)])
        elif cu_seqlens.device == max_seqlen.device:
            import torch

            joined = torch.cat([cu_seqlens.reshape(-1), max_seqlen.reshape(1).to(cu_seqlens.dtype)])
    if joined is not None:
        values = concrete_values(joined)
        return (None, None) if values is None else (values[:-1], int(values[-1]))
    limit = concrete_values(max_seqlen)
    return concrete_values(cu_seqlens), None if limit is None else int(limit.reshape(-1)[0])


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{_OP}: {name} must be a positive int, got {value!r}")
    return value


def concrete_values(a: Any):
    """``a``'s values as a numpy array, or None when they cannot be read without tracing
    (jax tracers, torch fake/meta tensors)."""
    import numpy as np

    if family_of(frontend_of(a)) == "jax":
        import jax

        if isinstance(a, jax.core.Tracer):
            return None
        return np.asarray(a)
    if getattr(a, "device", None) is not None and a.device.type == "meta":
        return None
    try:
        if frontend_of(a) == "torchax":
            from torchax.interop import jax_view

            return np.asarray(jax_view(a))
        return a.detach().to("cpu").numpy()
    except Exception:  # a fake tensor under torch.compile, a torchax tensor under a jax trace
        return None


@CustomOp.register(_OP)
class MMEncoderAttention(CustomOp):
    """Non-causal multi-head attention of a vision encoder, with GQA and packed sequences
    (``cu_seqlens``); see the module docstring for the contract."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float | None = None,
        num_kv_heads: int | None = None,
        *,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.num_heads = _positive_int("num_heads", num_heads)
        self.head_size = _positive_int("head_size", head_size)
        self.num_kv_heads = num_heads if num_kv_heads is None else _positive_int("num_kv_heads", num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{_OP}: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}"
            )
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0
                                  or not math.isfinite(scale)):
            raise ValueError(f"{_OP}: scale must be a positive float or None, got {scale!r}; expected a finite "
                             f"number > 0")
        self.scale = float(head_size**-0.5 if scale is None else scale)

    # ---------------------------------------------------------------- validation

    def _check_layout(self, name: str, a: Any, heads: int, ref: Any | None) -> None:
        d = self.head_size
        if a.ndim == 3:
            if a.shape[-1] != heads * d:
                raise ValueError(
                    f"{_OP}: argument '{name}' has last dim {a.shape[-1]}; expected {heads} heads x "
                    f"head_size {d} = {heads * d} ([B, S, H*D] layout)"
                )
        elif a.ndim == 4:
            if tuple(a.shape[2:]) != (heads, d):
                raise ValueError(
                    f"{_OP}: argument '{name}' has heads x head_size {tuple(a.shape[2:])}; expected "
                    f"({heads}, {d}) ([B, S, H, D] layout)"
                )
        else:
            raise ValueError(f"{_OP}: argument '{name}' must be [B, S, H*D] or [B, S, H, D], got shape {tuple(a.shape)}")
        if ref is None:
            return
        if a.ndim != ref.ndim:
            raise ValueError(f"{_OP}: argument '{name}' has {a.ndim} dims but 'query' has {ref.ndim}; use one layout")
        if tuple(a.shape[:2]) != tuple(ref.shape[:2]):
            raise ValueError(
                f"{_OP}: argument '{name}' has [B, S] = {tuple(a.shape[:2])}; expected {tuple(ref.shape[:2])} (as 'query')"
            )
        if frontend_of(a) != frontend_of(ref) or (family_of(frontend_of(a)) == "torch" and a.device != ref.device):
            raise ValueError(f"{_OP}: argument '{name}' is on another frontend or device than 'query'")
        if dtype_name(a) != dtype_name(ref):
            raise TypeError(f"{_OP}: argument '{name}' has dtype {dtype_name(a)}; expected {dtype_name(ref)} (as 'query')")

    def check_inputs(self, query: Any, key: Any, value: Any, cu_seqlens: Any = None, max_seqlen: Any = None) -> None:
        fe = check_array(_OP, "query", query, min_ndim=3, dtypes=FLOAT_DTYPES)
        check_array(_OP, "key", key, min_ndim=3)
        check_array(_OP, "value", value, min_ndim=3)
        self._check_layout("query", query, self.num_heads, None)
        self._check_layout("key", key, self.num_kv_heads, query)
        self._check_layout("value", value, self.num_kv_heads, query)
        _check_max_seqlen(max_seqlen, fe)
        if cu_seqlens is None:
            return
        if frontend_of(cu_seqlens) is None or family_of(frontend_of(cu_seqlens)) != family_of(fe):
            raise TypeError(f"{_OP}: argument 'cu_seqlens' must be a {family_of(fe)} int32 array like 'query'")
        if dtype_name(cu_seqlens) != "int32":
            raise TypeError(f"{_OP}: argument 'cu_seqlens' has dtype {dtype_name(cu_seqlens)}; expected int32")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"{_OP}: argument 'cu_seqlens' must be 1-D [n + 1] with n >= 1, got shape {tuple(cu_seqlens.shape)}")
        if query.shape[0] != 1:
            raise ValueError(f"{_OP}: argument 'cu_seqlens' needs packed sequences (B == 1); 'query' has B = {query.shape[0]}")
        values, limit = _segment_values(cu_seqlens, max_seqlen)
        if values is None:
            return  # traced: see the module docstring for what bad values do
        seq_len = query.shape[1]
        if values[0] != 0 or values[-1] != seq_len:
            raise ValueError(f"{_OP}: argument 'cu_seqlens' must start at 0 and end at S = {seq_len}, got {values.tolist()}")
        lengths = values[1:] - values[:-1]
        if (lengths < 0).any():
            raise ValueError(f"{_OP}: argument 'cu_seqlens' must be non-decreasing, got {values.tolist()}")
        if limit is not None and limit < lengths.max():
            raise ValueError(
                f"{_OP}: argument 'max_seqlen' = {limit} is below the longest segment ({int(lengths.max())})"
            )

    # ---------------------------------------------------------------- bodies

    # max_seqlen is annotated int for torch.compile's schema (SymInt?: a compiled call passes an int);
    # eager calls take the engine's 1-element tensor too (check_inputs), which only forward_cuda reads.
    def forward_native(self, query: Any, key: Any, value: Any, cu_seqlens: Any = None,
                       max_seqlen: int | None = None) -> Any:
        xp = array_namespace(query)
        b, s = query.shape[0], query.shape[1]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        g = h // hkv
        if b * s == 0:
            return query * 0  # nothing to attend; a new array, as every other call returns
        # [B, S, Hkv, G, D] -> [B, Hkv, G, S, D]; K, V [B, S, Hkv, D] -> [B, Hkv, 1, S, D]
        q = xp.astype(query, xp.float32).reshape(b, s, hkv, g, d).swapaxes(1, 3).swapaxes(1, 2)
        k = xp.astype(key, xp.float32).reshape(b, s, hkv, 1, d).swapaxes(1, 3).swapaxes(1, 2)
        v = xp.astype(value, xp.float32).reshape(b, s, hkv, 1, d).swapaxes(1, 3).swapaxes(1, 2)
        logits = (q @ k.swapaxes(-1, -2)) * self.scale  # [B, Hkv, G, S, S]
        if cu_seqlens is not None:
            seg = segment_ids(xp, cu_seqlens, s, query)
            logits = xp.where(seg[:, None] == seg[None, :], logits, float("-inf"))
            v = xp.where(xp.abs(v) < math.inf, v, 0.0)  # restored per segment below (isolate_nonfinite_values)
        p = xp.exp(logits - xp.amax(logits, axis=-1, keepdims=True))
        out = (p @ v) / xp.sum(p, axis=-1, keepdims=True)  # [B, Hkv, G, S, D]
        out = out.swapaxes(1, 2).swapaxes(1, 3)  # [B, S, Hkv, G, D]
        if cu_seqlens is not None:
            value_f32 = xp.astype(value, xp.float32).reshape(b, s, hkv, d)
            out = isolate_nonfinite_values(xp, out, value_f32, seg[None, :], cu_seqlens.shape[0])
        out = out.reshape(b, s, h * d).reshape(query.shape)  # contiguous
        return xp.astype(out, query.dtype)

    def _static(self) -> dict[str, Any]:
        return dict(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                    scale=self.scale)

    # On a GPU, torch tensors take the Triton kernel and jax arrays cuDNN's flash attention.
    serves = {"forward_cuda": Serves(("torch", "jax"))}

    def library_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Inside ``torch.compile`` a tensor ``max_seqlen`` (the engine's) is passed as None: the
        schema takes an int, reading the tensor would break the graph, and it only bounds the Triton
        kernel's loops, which then take the longest segment from ``cu_seqlens`` in the opaque op."""
        if len(args) > 4 and not isinstance(args[4], (int, type(None))):
            args = (*args[:4], None, *args[5:])
        if not isinstance(kwargs.get("max_seqlen"), (int, type(None))):
            kwargs = {**kwargs, "max_seqlen": None}
        return args, kwargs

    def declines(self, method: str, frontend: str) -> str | None:
        if method == "forward_cuda" and frontend == "jax":
            from dualop.kernels.xla.cudnn_attention import cudnn_declines

            return cudnn_declines(frontend)
        return None

    def forward_cpu(self, query: Any, key: Any, value: Any, cu_seqlens: Any = None,
                    max_seqlen: Any = None) -> Any:
        """torch on the CPU: ``F.scaled_dot_product_attention`` (torch's fused CPU flash attention)
        in float32, once per segment of ``cu_seqlens`` (no wasted cross-segment work), one cast."""
        decline_if_recording(_OP, query, key, value)
        from dualop.kernels.cpu.encoder_attention import encoder_attention

        return encoder_attention(query, key, value, cu_seqlens, **self._static())

    def forward_cuda(self, query: Any, key: Any, value: Any, cu_seqlens: Any = None,
                     max_seqlen: Any = None) -> Any:
        """torch on CUDA/ROCm: the Triton flash-attention kernel. jax arrays on a GPU: cuDNN's flash
        attention through ``jax.nn.dot_product_attention`` (no jax-triton for Python 3.11)."""
        fe = frontend_of(query)
        if family_of(fe) == "jax":
            from dualop.kernels.xla.cudnn_attention import cudnn_encoder_attention

            return cudnn_encoder_attention(query, key, value, cu_seqlens, **self._static())
        limit = None if cu_seqlens is None else max_seqlen_int(max_seqlen)  # unused without cu_seqlens
        return call_triton(fe, _TRITON_ENCODER_ATTENTION, query, key, value, cu_seqlens,
                           max_seqlen=limit, **self._static())

    def forward_tpu(self, query: Any, key: Any, value: Any, cu_seqlens: Any = None,
                    max_seqlen: Any = None) -> Any:
        return call_jax_function(frontend_of(query), _PALLAS_ENCODER_ATTENTION, query, key, value, cu_seqlens,
                           native=self.forward_native, **self._static())

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_size={self.head_size}, scale={self.scale}, "
                f"num_kv_heads={self.num_kv_heads}")


# --- check cases ---------------------------------------------------------------------------------

# (B, S, H*D) per case: zero tokens, a single token, a ragged batch; the [B, S, H, D] case builds
# 4-D inputs from the same tuple. Head sizes 80 and 72 are the ViTs' (off the 128-lane grid).
_SHAPES_80 = ((1, 0, 160), (1, 1, 160), (2, 37, 160))
_SHAPES_72 = ((1, 0, 288), (1, 1, 288), (2, 21, 288))


def packed_cu_seqlens(seq_len: int):
    """Segment boundaries used by the check case: an empty segment, a one-token one, ragged ones."""
    import numpy as np

    if seq_len <= 1:
        return np.array([0, seq_len], np.int32)
    cuts = sorted({0, 1, seq_len // 3, seq_len // 3, (2 * seq_len) // 3, seq_len})
    cuts.insert(2, cuts[1])  # an empty segment
    return np.array(cuts, np.int32)


def check_cases():
    """The shapes and inputs ``dualop check`` and the tests run this op with."""
    from dualop.testing import OpCase, Pinned, normal

    def inputs(heads: int, kv_heads: int, four_d: bool, packed: bool):
        def make(shape, rng):
            b, s, hd = shape
            d = hd // heads
            qs = (b, s, heads, d) if four_d else (b, s, heads * d)
            ks = (b, s, kv_heads, d) if four_d else (b, s, kv_heads * d)
            cu = Pinned(packed_cu_seqlens(s), "int32") if packed else None
            return (normal(qs, rng, 2.0), normal(ks, rng, 2.0), normal(ks, rng), cu, None)

        return make

    return [
        OpCase(_OP, "mm_encoder_attn", lambda s: MMEncoderAttention(2, s[-1] // 2),
               inputs(2, 2, False, False), _SHAPES_80),
        OpCase(_OP, "mm_encoder_attn[gqa,bshd]", lambda s: MMEncoderAttention(4, s[-1] // 4, num_kv_heads=2),
               inputs(4, 2, True, False), _SHAPES_72),
        OpCase(_OP, "mm_encoder_attn[cu_seqlens]", lambda s: MMEncoderAttention(2, s[-1] // 2, scale=0.07),
               inputs(2, 2, False, True), tuple((1, *s[1:]) for s in _SHAPES_80)),
    ]


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


# --- mm_encoder_attn: a ViT's attention over packed images ---------------------------------------
# The bench shape (tokens, hidden) is a packed batch of images, ``hidden = heads x 80`` (Qwen2.5-VL's
# vision tower: 16 heads of 80 at hidden 1280; one head of ``hidden`` when 80 does not divide it),
# each image ``ENCODER_IMAGE_TOKENS`` patches long (the last one shorter), as ``cu_seqlens``. Not run by default: its cost grows with tokens x image
# size, not with the row sizes the other cases use; ask with ``--ops mm_encoder_attn --sizes 1024x1280``.
ENCODER_HEAD_SIZE = 80


ENCODER_IMAGE_TOKENS = 256


def _encoder_segments(tokens: int) -> list[int]:
    full, rest = divmod(tokens, ENCODER_IMAGE_TOKENS)
    return [ENCODER_IMAGE_TOKENS] * full + ([rest] if rest else [])


def _encoder_attention(hidden: int):
    from dualop.ops import MMEncoderAttention

    head_size = ENCODER_HEAD_SIZE if hidden % ENCODER_HEAD_SIZE == 0 else hidden
    return MMEncoderAttention(hidden // head_size, head_size)


def _encoder_inputs(shape, rng):
    from dualop.testing import Pinned

    tokens, hidden = shape
    cu = np.cumsum([0, *_encoder_segments(tokens)]).astype(np.int32)
    x = [_normal((1, tokens, hidden), rng) for _ in range(3)]
    return (*x, Pinned(cu, "int32"), None)


def _encoder_cost(op, shape, itemsize) -> KernelCost:
    return cost_model.encoder_attention_cost(_encoder_segments(shape[0]), op.num_heads, op.num_kv_heads,
                                             op.head_size, itemsize)


def _torch_encoder_attention(op):
    """What a user writes: ``F.scaled_dot_product_attention`` per image, in the input dtype."""
    import torch
    import torch.nn.functional as F

    h, hkv, d = op.num_heads, op.num_kv_heads, op.head_size

    def sdpa(q, k, v, cu_seqlens, max_seqlen=None):
        s = q.shape[1]
        qh, kh, vh = (t.reshape(s, n, d).transpose(0, 1) for t, n in ((q, h), (k, hkv), (v, hkv)))
        bounds = cu_seqlens.tolist()
        outs = [F.scaled_dot_product_attention(qh[:, a:b], kh[:, a:b], vh[:, a:b], scale=op.scale,
                                               enable_gqa=h != hkv) for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(outs, dim=1).transpose(0, 1).reshape(q.shape)

    return sdpa


def _jax_encoder_attention(op):
    """What a user writes in jax.numpy: float32 logits over the packed sequence with a
    block-diagonal mask from the segment ids, softmax, ``P @ V``, one cast."""
    import jax
    import jax.numpy as jnp

    h, hkv, d = op.num_heads, op.num_kv_heads, op.head_size

    def attention(q, k, v, cu_seqlens, max_seqlen=None):
        s = q.shape[1]
        seg = jnp.searchsorted(cu_seqlens[1:], jnp.arange(s), side="right")
        qf = q.reshape(s, hkv, h // hkv, d).astype(jnp.float32)
        kf, vf = (t.reshape(s, hkv, d).astype(jnp.float32) for t in (k, v))
        logits = jnp.einsum("qkgd,tkd->kgqt", qf, kf) * op.scale
        logits = jnp.where(seg[:, None] == seg[None, :], logits, -jnp.inf)
        out = jnp.einsum("kgqt,tkd->qkgd", jax.nn.softmax(logits, axis=-1), vf)
        return out.reshape(q.shape).astype(q.dtype)

    return attention


def _encoder_attention_inputs(shape: tuple[int, ...]) -> tuple:
    b, s, heads, head_size, segments = shape
    x = InputSpec((b, s, heads * head_size), None)
    cu = InputSpec((segments + 1,), "int32") if segments else None
    return (x, x, x, cu, s // segments if segments else None)


def _encoder_attention_op(shape: tuple[int, ...]):
    from dualop.ops import MMEncoderAttention

    return MMEncoderAttention(shape[2], shape[3])


def bench_cases():
    """Not run by default (its cost grows with tokens x image size): against SDPA per image (torch)
    and a hand-written jax.numpy attention; ask with ``--ops mm_encoder_attn --sizes 1024x1280``."""
    return [BenchCase("mm_encoder_attn", "mm_encoder_attn", _encoder_attention, _encoder_inputs, _encoder_cost,
                      _torch_encoder_attention, _jax_encoder_attention, default=False)]


def serving():
    """(B, S, heads, head size, packed segments; 0 = none): Qwen2.5-VL's vision tower (16 heads of
    80; 4096 patches packed as 16 windows of 256 via cu_seqlens), SigLIP-so400m at 384 px (16 heads
    of 72, 729 patches) and SigLIP at 512 px (16 heads of 64, 1024 patches), a batch of 8 images each."""
    make_op = {label: _encoder_attention_op
               for label in ("mm_encoder_attn", "mm_encoder_attn[gqa,bshd]", "mm_encoder_attn[cu_seqlens]")}
    return {"mm_encoder_attn": Serving(((1, 4096, 16, 80, 16), (8, 729, 16, 72, 0), (8, 1024, 16, 64, 0)),
                                       _encoder_attention_inputs, make_op)}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"mm_encoder_attn": {"traits": {"contraction"}}}
