"""Convolution ops of the vision encoders: ``conv2d`` and ``conv3d`` (the engine's Conv2dLayer and
Conv3dLayer, as ops taking their weights).

``op(x, weight, bias=None)`` on x ``[N, C, *spatial]`` and weight ``[out, C / groups, *kernel]``
(torch's layout, for both frontends). ``forward_native`` is the frontend's convolution
(``F.conv2d``/``F.conv3d`` for torch tensors of any device; ``jax.lax.conv_general_dilated`` for jax
arrays), float32 accumulation and one rounding after the bias.

The platform path (``forward_cpu``, ``forward_cuda``, ``forward_tpu``, for every frontend) is the
engine's patch-embedding fast path: when the kernel equals the stride, with no padding, dilation 1
and groups 1 (every ViT patch embed), the non-overlapping patches are unfolded by a reshape and
permute (free when each item is exactly one patch, as Qwen2.5-VL's ``[L, 3, 2, 14, 14]``) and a
matmul with the weight as ``[out, C * prod(kernel)]`` does the rest, float32 accumulation, bias
fused. The matmul is the vendor's: oneDNN / cuBLAS through torch for torch tensors on the CPU or a
GPU, XLA's dot (``xla_patch_embed``) for jax arrays and, through the Pallas kernels' bridge, for
torch_xla / torchax / torch_tpu tensors. No kernel of dualop's own beats it. Other convolutions
decline the platform path (the report says why) and run the native body.
"""


from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import ALL_FRONTENDS, CustomOp, Serves
from dualop.kernels import cost as cost_model
from dualop.kernels.cost import KernelCost
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import check_array, check_optional_like
from dualop.platforms import family_of, frontend_of
from dualop.spec import BenchCase, InputSpec, Serving, float32_normal as _normal
from dualop.testing import KERNEL_CELLS

__all__ = ["Conv2dLayer", "Conv3dLayer"]

PADDING_STRINGS = ("same", "valid")
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
# padding_mode -> (torch F.pad mode, jnp.pad mode): the same rule under both names.
_PAD_MODE_NAMES = {"reflect": ("reflect", "reflect"), "replicate": ("replicate", "edge"),
                   "circular": ("circular", "wrap")}


def _int_tuple(op: str, name: str, value: Any, num_dim: int, minimum: int) -> tuple[int, ...]:
    """An int or a tuple of ``num_dim`` ints, each >= ``minimum``, as a tuple."""
    items = (value,) * num_dim if isinstance(value, int) and not isinstance(value, bool) else value
    if (
        not isinstance(items, (tuple, list)) or len(items) != num_dim
        or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in items)
    ):
        raise ValueError(f"{op}: {name} must be an int >= {minimum} or a tuple of {num_dim} of them, got {value!r}")
    return tuple(items)


def _positive(op: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")
    return value


def _padding_pairs(op: str, padding: Any, kernel: tuple, stride: tuple, dilation: tuple) -> tuple:
    """``(low, high)`` zero padding per spatial dim. ``"same"`` is torch's rule: total
    ``dilation * (kernel - 1)``, the odd one on the high side, refused for strided convolutions."""
    num_dim = len(kernel)
    if isinstance(padding, str):
        if padding not in PADDING_STRINGS:
            raise ValueError(f"{op}: padding string {padding!r} is not one of {PADDING_STRINGS}")
        if padding == "valid":
            return ((0, 0),) * num_dim
        if any(s != 1 for s in stride):
            raise ValueError(f"{op}: padding='same' is not supported for strided convolutions (stride={stride})")
        totals = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return tuple((t // 2, t - t // 2) for t in totals)
    return tuple((p, p) for p in _int_tuple(op, "padding", padding, num_dim, 0))


def _split_shape(shape: tuple, kernel: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The output's spatial size for x of ``shape`` and a kernel equal to the stride, and x's shape
    with each spatial dim split into (patches, kernel); trailing rows that fill no whole patch are
    dropped, as the strided convolution drops them."""
    outs = tuple(s // k for s, k in zip(shape[2:], kernel))
    return outs, (shape[0], shape[1], *(v for o, k in zip(outs, kernel) for v in (o, k)))


def _features_first(num_dim: int) -> tuple[int, ...]:
    """``[N, C, o1, k1, o2, k2, ...]`` -> ``[N, C, k1, k2, ..., o1, o2, ...]``: each patch's
    features in the weight's ``(C, k1, k2, ...)`` order, then the patches."""
    return (0, 1, *range(3, 3 + 2 * num_dim, 2), *range(2, 2 + 2 * num_dim, 2))


def xla_patch_embed(x: Any, weight: Any, bias: Any, *, kernel_size: tuple[int, ...], interpret: Any = None) -> Any:
    """The patch embedding for jax arrays (and, through the bridge, torch_xla / torchax / torch_tpu
    tensors): the ``[N, C·k, patches]`` unfold, one ``dot_general`` per item with float32
    accumulation giving ``[N, out, patches]`` (XLA's dot: the MXU on a TPU), the bias added in
    float32, one cast. ``interpret`` is the bridge's argument for Pallas kernels; no Pallas here."""
    import jax
    import jax.numpy as jnp

    num_dim = len(kernel_size)
    outs, split = _split_shape(x.shape, kernel_size)
    x = x[(slice(None), slice(None), *(slice(0, o * k) for o, k in zip(outs, kernel_size)))]
    items, out_channels, patch_size = x.shape[0], weight.shape[0], x.shape[1] * math.prod(kernel_size)
    cols = jnp.transpose(x.reshape(split), _features_first(num_dim)).reshape(items, patch_size, math.prod(outs))
    w = weight.reshape(out_channels, patch_size)
    y = jax.lax.dot_general(w, cols, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [out, N, P]
    if bias is not None:
        y = y + bias.astype(jnp.float32)[:, None, None]
    return jnp.transpose(y.astype(x.dtype), (1, 0, 2)).reshape(items, out_channels, *outs)


_XLA_PATCH_EMBED = KernelRef("dualop.ops.conv", "xla_patch_embed")


class _ConvNd(CustomOp):
    """Shared body of ``conv2d`` and ``conv3d``; ``num_dim`` is the count of spatial dims."""

    num_dim: int
    # What the platform methods run (``dualop check``'s path column): no kernel of dualop's own.
    kernel_description = "patch unfold + vendor matmul (torch CPU/GPU: oneDNN/cuBLAS GEMM; XLA: dot)"

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] | str = 0,
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        *,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(enforce_enable=enforce_enable)
        op, n = type(self).name, self.num_dim
        self.in_channels = _positive(op, "in_channels", in_channels)
        self.out_channels = _positive(op, "out_channels", out_channels)
        self.groups = _positive(op, "groups", groups)
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"{op}: groups={groups} must divide in_channels={in_channels} and out_channels={out_channels}"
            )
        self.kernel_size = _int_tuple(op, "kernel_size", kernel_size, n, 1)
        self.stride = _int_tuple(op, "stride", stride, n, 1)
        self.dilation = _int_tuple(op, "dilation", dilation, n, 1)
        self.padding = _padding_pairs(op, padding, self.kernel_size, self.stride, self.dilation)
        self.padding_string = padding if isinstance(padding, str) else None
        if padding_mode not in PADDING_MODES:
            raise ValueError(f"{op}: padding_mode {padding_mode!r} is not one of {PADDING_MODES}")
        self.padding_mode = padding_mode
        self.has_bias = bool(bias)
        self.weight_shape = (out_channels, in_channels // groups, *self.kernel_size)
        self.patch_size = in_channels * math.prod(self.kernel_size)
        self.why_not_patch_embed = self._why_not_patch_embed()

    def _why_not_patch_embed(self) -> str | None:
        """Why the fast path (non-overlapping patches, one matmul) does not apply, or None."""
        reasons = []
        if self.kernel_size != self.stride:
            reasons.append(f"kernel_size {self.kernel_size} != stride {self.stride}")
        if any(p for pair in self.padding for p in pair):
            reasons.append(f"padding {self.padding}")
        if any(d != 1 for d in self.dilation):
            reasons.append(f"dilation {self.dilation}")
        if self.groups != 1:
            reasons.append(f"groups {self.groups}")
        if not reasons:
            return None
        return ("the patch-embedding matmul needs kernel_size == stride, no padding, dilation 1 and groups 1; "
                f"this conv has {', '.join(reasons)}: the frontend's convolution runs")

    # ---------------------------------------------------------------- validation

    def check_inputs(self, x: Any, weight: Any = None, bias: Any = None) -> None:
        op, n = type(self).name, self.num_dim
        fe = check_array(op, "x", x)
        layout = "[N, C, H, W]" if n == 2 else "[N, C, D, H, W]"
        if x.ndim != n + 2:
            raise ValueError(f"{op}: argument 'x' must be {layout} ({n + 2} dims), got shape {tuple(x.shape)}")
        if x.shape[1] != self.in_channels:
            raise ValueError(
                f"{op}: argument 'x' has {x.shape[1]} channels (dim 1, shape {tuple(x.shape)}); "
                f"expected in_channels={self.in_channels}"
            )
        if weight is None:
            raise ValueError(f"{op}: argument 'weight' is required (shape {self.weight_shape})")
        check_optional_like(op, "weight", weight, "x", x, fe, shape=self.weight_shape, same_dtype=True)
        if bias is not None and not self.has_bias:
            raise ValueError(f"{op}: argument 'bias' must be None for an op built with bias=False")
        check_optional_like(op, "bias", bias, "x", x, fe, shape=(self.out_channels,), same_dtype=True)
        self._check_padding_fits(op, x)
        padded = [s + lo + hi for s, (lo, hi) in zip(x.shape[2:], self.padding)]
        spans = [d * (k - 1) + 1 for k, d in zip(self.kernel_size, self.dilation)]
        if any(p < span for p, span in zip(padded, spans)):
            raise ValueError(
                f"{op}: argument 'x' has spatial size {tuple(x.shape[2:])}, padded {tuple(padded)}, smaller than "
                f"the dilated kernel {tuple(spans)}"
            )

    def _check_padding_fits(self, op: str, x: Any) -> None:
        """Reflect, circular and replicate padding read x's own rows, so each pad has a limit in x's
        spatial size: reflect ``pad < size`` (the edge row is not repeated), circular ``pad <= size``
        (one wrap), replicate ``size >= 1``; torch's ``F.pad`` refuses more (and jnp.pad would
        reflect or wrap again, a different answer), so both frontends are refused here."""
        if self.padding_mode == "zeros":
            return
        for dim, (size, (lo, hi)) in enumerate(zip(x.shape[2:], self.padding)):
            pad = max(lo, hi)
            if pad == 0:
                continue
            if self.padding_mode == "reflect" and pad >= size:
                limit = f"padding < the input's size, here at most {size - 1}"
            elif self.padding_mode == "circular" and pad > size:
                limit = f"padding <= the input's size, here at most {size}"
            elif self.padding_mode == "replicate" and size == 0:
                limit = "a non-empty input to replicate"
            else:
                continue
            raise ValueError(
                f"{op}: argument 'x' has spatial size {size} in dim {dim + 2} (shape {tuple(x.shape)}), too small for "
                f"padding {pad} with padding_mode={self.padding_mode!r}; expected {limit}"
            )

    # ---------------------------------------------------------------- the reference

    def forward_native(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """The frontend's convolution, float32 accumulation and one rounding after the bias:
        torch's ``F.conv{n}d`` (any torch device; in float32 for 16-bit inputs off the CPU) or
        ``lax.conv_general_dilated``."""
        if family_of(frontend_of(x)) == "jax":
            return self._jax_conv(x, weight, bias)
        return self._torch_conv(x, weight, bias)

    def _torch_conv(self, x: Any, weight: Any, bias: Any) -> Any:
        import torch
        import torch.nn.functional as F

        conv = F.conv2d if self.num_dim == 2 else F.conv3d
        padding: Any = tuple(lo for lo, _ in self.padding)
        if self.padding_mode != "zeros":
            # F.pad's pairs run from the last dim back
            pads = [p for lo, hi in reversed(self.padding) for p in (lo, hi)]
            x, padding = F.pad(x, pads, mode=_PAD_MODE_NAMES[self.padding_mode][0]), 0
        elif any(lo != hi for lo, hi in self.padding):  # "same" with an even dilated kernel
            padding = "same"
        if x.device.type == "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
            return conv(x, weight, bias, self.stride, padding, self.dilation, self.groups)
        # 16-bit off the CPU: XLA's lowering of torch's conv (torch_xla, torchax) and cuDNN's bias
        # add round the product before adding the bias; float32 and one cast, as the CPU's oneDNN
        # and the jax body compute.
        y = conv(x.float(), weight.float(), None if bias is None else bias.float(), self.stride, padding,
                 self.dilation, self.groups)
        return y.to(x.dtype)

    def _jax_conv(self, x: Any, weight: Any, bias: Any) -> Any:
        import jax
        import jax.numpy as jnp

        padding = list(self.padding)
        if self.padding_mode != "zeros":
            x = jnp.pad(x, [(0, 0), (0, 0), *padding], mode=_PAD_MODE_NAMES[self.padding_mode][1])
            padding = [(0, 0)] * self.num_dim
        spec = ("NCHW", "OIHW", "NCHW") if self.num_dim == 2 else ("NCDHW", "OIDHW", "NCDHW")
        y = jax.lax.conv_general_dilated(
            x, weight, self.stride, padding, rhs_dilation=self.dilation, dimension_numbers=spec,
            feature_group_count=self.groups, preferred_element_type=jnp.float32,
        )
        if bias is not None:
            y = y + bias.astype(jnp.float32).reshape(-1, *(1,) * self.num_dim)
        return y.astype(x.dtype)

    # ---------------------------------------------------------------- the fast path

    # The patch-embedding path serves every frontend on every platform (torch's GEMM for torch
    # tensors, XLA's dot through the Pallas bridge for the others).
    serves = {m: Serves(ALL_FRONTENDS) for m in ("forward_cpu", "forward_cuda", "forward_hip")}

    def declines(self, method: str, frontend: str) -> str | None:
        """Only patch embeddings have a path of their own."""
        return self.why_not_patch_embed

    def _patch_embed(self, x: Any, weight: Any, bias: Any, on_cpu: bool = False) -> Any:
        """The fast path: torch's GEMM for torch tensors on the CPU or a GPU; for jax arrays and
        XLA-device tensors (torch_xla, torchax, torch_tpu), ``xla_patch_embed`` (XLA's dot), reached
        through the same bridge as the Pallas kernels."""
        if self.why_not_patch_embed is not None:
            raise NotImplementedError(self.why_not_patch_embed)
        frontend = frontend_of(x)
        if frontend == "torch":
            return self._torch_patch_embed(x, weight, bias, on_cpu)
        return call_jax_function(frontend, _XLA_PATCH_EMBED, x, weight, bias, native=self.forward_native,
                           kernel_size=self.kernel_size)

    def _torch_patch_embed(self, x: Any, weight: Any, bias: Any, on_cpu: bool) -> Any:
        """torch on the CPU or a GPU: the vendor GEMM (oneDNN / cuBLAS accumulate 16-bit inputs in
        float32 and add the bias before the one rounding). One patch per item (Qwen2.5-VL's):
        ``rows @ Wᵀ`` on x viewed as ``[N, C·k]``, no copy. Several per item: every item's patches
        as the rows of one ``[N·patches, C·k]`` GEMM (one copy of x), the output then laid out as
        the convolution's contiguous ``[N, out, *patches]`` (one copy of it). A 2-D convolution on the
        CPU in float32 with several patches per item declines to the native body: oneDNN's strided
        conv2d reads x in place and is as fast or faster there (docs/BENCHMARKS.md; its conv3d is not)."""
        import torch

        outs, split = _split_shape(x.shape, self.kernel_size)
        items, patches = x.shape[0], math.prod(outs)
        if on_cpu and self.num_dim == 2 and patches > 1 and x.dtype == torch.float32:
            raise NotImplementedError(
                "float32 with several patches per item on the CPU: oneDNN's strided convolution (the native "
                "body) reads x in place and is as fast as or faster than unfold + GEMM for conv2d")
        for dim, (o, k) in enumerate(zip(outs, self.kernel_size), start=2):
            if x.shape[dim] != o * k:
                x = x.narrow(dim, 0, o * k)
        w = weight.reshape(self.out_channels, self.patch_size)
        if patches == 1:
            rows = x.reshape(items, self.patch_size)
            y = rows @ w.t() if bias is None else torch.addmm(bias, rows, w.t())
            return y.view(items, self.out_channels, *outs)
        # [N, C, o1, k1, o2, k2, ...] -> [N, o1, o2, ..., C, k1, k2, ...]: one patch's features per row.
        n = self.num_dim
        rows = x.reshape(split).permute(0, *range(2, 2 + 2 * n, 2), 1, *range(3, 3 + 2 * n, 2))
        rows = rows.reshape(items * patches, self.patch_size)
        y = rows @ w.t() if bias is None else torch.addmm(bias, rows, w.t())
        return y.view(items, patches, self.out_channels).transpose(1, 2).contiguous().view(items, self.out_channels, *outs)

    def forward_cpu(self, x: Any, weight: Any, bias: Any = None) -> Any:
        return self._patch_embed(x, weight, bias, on_cpu=True)

    def forward_cuda(self, x: Any, weight: Any, bias: Any = None) -> Any:
        return self._patch_embed(x, weight, bias)

    def forward_tpu(self, x: Any, weight: Any, bias: Any = None) -> Any:
        return self._patch_embed(x, weight, bias)

    def extra_repr(self) -> str:
        padding = self.padding_string or tuple(lo for lo, _ in self.padding)
        return (f"in_channels={self.in_channels}, out_channels={self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={padding}, dilation={self.dilation}, groups={self.groups}, "
                f"bias={self.has_bias}, padding_mode={self.padding_mode!r}")


@CustomOp.register("conv2d")
class Conv2dLayer(_ConvNd):
    """2-D convolution ``op(x [N, C, H, W], weight [out, C/groups, kh, kw], bias [out] | None)``,
    torch.nn.Conv2d's value; ``padding`` an int, a pair, ``"valid"`` or ``"same"`` (stride 1 only)."""

    num_dim = 2


@CustomOp.register("conv3d")
class Conv3dLayer(_ConvNd):
    """3-D convolution ``op(x [N, C, D, H, W], weight [out, C/groups, kd, kh, kw], bias [out] | None)``,
    torch.nn.Conv3d's value (Qwen2.5-VL's patch embed: kernel = stride = (2, 14, 14))."""

    num_dim = 3


# --- check cases --------------------------------------------------------------------------------
# Shapes are x's shape [N, C, *spatial]: no items, one item, several, spatial sizes that are not a
# multiple of the kernel (the strided conv drops the rest).
PATCH_2D_SHAPES = ((0, 3, 8, 8), (1, 3, 8, 8), (3, 3, 10, 13))
PATCH_3D_SHAPES = ((0, 3, 2, 4, 4), (1, 3, 2, 4, 4), (7, 3, 2, 4, 4), (2, 3, 4, 9, 8))
GENERAL_2D_SHAPES = ((0, 4, 5, 6), (1, 4, 5, 6), (2, 4, 7, 9))
GENERAL_3D_SHAPES = ((0, 4, 3, 5, 6), (1, 4, 3, 5, 6), (2, 4, 5, 6, 7))


def check_cases():
    """One general convolution per op (padding, stride, dilation, groups: the native convolution,
    with the reason), then tiny patch embeddings (the fast path) in 2-D and 3-D. The patch cases
    come last: the per-op checks (tests/sweeps/test_cells.py's ROCm cell) take an op's last case."""
    from dualop.testing import OpCase, normal

    def inputs(op_kwargs: dict, out_channels: int, with_bias: bool):
        def make(shape, rng):
            op = make_op(op_kwargs, out_channels, with_bias)(shape)
            fan_in = math.prod(op.weight_shape[1:])
            w = normal(op.weight_shape, rng, fan_in ** -0.5)
            b = normal((out_channels,), rng, 0.5) if with_bias else None
            return (normal(shape, rng), w, b)

        return make

    def make_op(op_kwargs: dict, out_channels: int, with_bias: bool):
        def make(shape):
            cls = Conv2dLayer if len(shape) == 4 else Conv3dLayer
            return cls(shape[1], out_channels, bias=with_bias, **op_kwargs)

        return make

    cases = []
    for op, label, kwargs, out, with_bias, shapes in (
        ("conv2d", "conv2d[general]", {"kernel_size": (3, 2), "stride": (2, 1), "padding": (1, 2),
                                       "dilation": (1, 2), "groups": 2}, 6, True, GENERAL_2D_SHAPES),
        ("conv3d", "conv3d[general]", {"kernel_size": 3, "stride": (1, 2, 2), "padding": 1, "dilation": (2, 1, 1),
                                       "groups": 2}, 6, True, GENERAL_3D_SHAPES),
        ("conv2d", "conv2d[patch]", {"kernel_size": 4, "stride": 4}, 40, True, PATCH_2D_SHAPES),
        ("conv3d", "conv3d[patch]", {"kernel_size": (2, 4, 4), "stride": (2, 4, 4)}, 40, False, PATCH_3D_SHAPES),
    ):
        cases.append(OpCase(op, label, make_op(kwargs, out, with_bias), inputs(kwargs, out, with_bias), shapes))
    return cases


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


# --- patch embeddings (conv2d / conv3d) ------------------------------------------------------------
# x is a batch of images (or Qwen2.5-VL's patches) for a size ROWSxCOLS: ROWS items, COLS ignored.
# Qwen2.5-VL's vision tower: Conv3d(3, 1280, (2, 14, 14), stride = kernel, no bias) on x [L, 3, 2, 14,
# 14], one patch per item (``--sizes 1024x1280``); a CLIP-like ViT-B/16: Conv2d(3, 768, 16, stride
# 16) on [N, 3, 224, 224] (``--sizes 1x768``). Peers: F.conv3d / F.conv2d, and the jax user's
# ``lax.conv_general_dilated`` (float32 accumulation, one cast).
PATCH_EMBEDS: dict[str, tuple[int, int, tuple[int, ...], tuple[int, ...], bool]] = {
    # label: (in_channels, out_channels, kernel, item spatial size, bias)
    "conv3d[qwen2.5-vl]": (3, 1280, (2, 14, 14), (2, 14, 14), False),
    "conv2d[clip-b16]": (3, 768, (16, 16), (224, 224), True),
}


def _patch_embed(label: str) -> Callable[[int], Any]:
    def make(_hidden: int):
        from dualop.ops import Conv2dLayer, Conv3dLayer

        c, out, kernel, _, bias = PATCH_EMBEDS[label]
        return (Conv2dLayer if len(kernel) == 2 else Conv3dLayer)(c, out, kernel, stride=kernel, bias=bias)

    return make


def _patch_embed_shape(label: str) -> Callable[[tuple[int, ...]], tuple[int, ...]]:
    c, _, _, spatial, _ = PATCH_EMBEDS[label]
    return lambda size: (size[0], c, *spatial)


def _patch_embed_inputs(shape, rng):
    label = next(k for k, v in PATCH_EMBEDS.items() if len(v[2]) == len(shape) - 2)
    c, out, kernel, _, bias = PATCH_EMBEDS[label]
    fan_in = c * math.prod(kernel)
    w = _normal((out, c, *kernel), rng, fan_in ** -0.5)
    return (_normal(shape, rng), w, _normal((out,), rng) if bias else None)


def _patch_embed_cost(op, shape, itemsize) -> KernelCost:
    patches = shape[0] * math.prod(s // k for s, k in zip(shape[2:], op.kernel_size))
    return cost_model.patch_embed_cost(patches, op.patch_size, op.out_channels, itemsize, op.has_bias,
                                       math.prod(shape))


def _torch_conv(op):
    """torch's own strided convolution (oneDNN / cuDNN)."""
    import torch.nn.functional as F

    conv = F.conv2d if op.num_dim == 2 else F.conv3d
    return lambda x, weight, bias=None: conv(x, weight, bias, op.stride)


def _jax_conv(op):
    """What a jax user writes (flax's Conv does the same): ``lax.conv_general_dilated`` in NCHW with
    float32 accumulation, the bias, one cast."""
    import jax
    import jax.numpy as jnp

    spec = ("NCHW", "OIHW", "NCHW") if op.num_dim == 2 else ("NCDHW", "OIDHW", "NCDHW")

    def conv(x, weight, bias=None):
        y = jax.lax.conv_general_dilated(x, weight, op.stride, "VALID", dimension_numbers=spec,
                                         preferred_element_type=jnp.float32)
        if bias is not None:
            y = y + bias.astype(jnp.float32).reshape(-1, *(1,) * op.num_dim)
        return y.astype(x.dtype)

    return conv


def _patch_embed_parts(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """x's shape, out_channels and the kernel of one conv serving shape."""
    num_dim = (len(shape) - 3) // 2
    return shape[:num_dim + 2], shape[num_dim + 2], shape[num_dim + 3:]


def _serving_patch_embed_inputs(shape: tuple[int, ...]) -> tuple:
    x_shape, out_channels, kernel = _patch_embed_parts(shape)
    bias = InputSpec((out_channels,), None) if len(kernel) == 2 else None
    return (InputSpec(x_shape, None), InputSpec((out_channels, x_shape[1], *kernel), None), bias)


def _serving_patch_embed_op(shape: tuple[int, ...]):
    from dualop.ops import Conv2dLayer, Conv3dLayer

    x_shape, out_channels, kernel = _patch_embed_parts(shape)
    cls = Conv2dLayer if len(kernel) == 2 else Conv3dLayer
    return cls(x_shape[1], out_channels, kernel, stride=kernel, bias=len(kernel) == 2)  # Qwen2.5-VL's has none


def bench_cases():
    """Not run by default: the patch embeddings against F.conv2d/F.conv3d and lax.conv_general_dilated."""
    return [BenchCase(label, label.split("[")[0], _patch_embed(label), _patch_embed_inputs, _patch_embed_cost,
                      _torch_conv, _jax_conv, default=False, shape_of=_patch_embed_shape(label), matrix=True)
            for label in PATCH_EMBEDS]


def serving():
    """(N, C, *spatial, out_channels, *kernel) for x [N, C, *spatial] and a kernel equal to the
    stride: Qwen2.5-VL's Conv3d(3, 1280, (2, 14, 14), bias=False) on 16384 patches, one per item as
    its vision tower calls it ([L, 3, 2, 14, 14]); SigLIP-so400m's Conv2d(3, 1152, 14, stride 14)
    on a batch of 8 384 x 384 images (27 x 27 patches; the last 6 pixel rows and columns fill no
    patch). The fast path is a reshape and XLA's dot; vision encoders are served in 16-bit."""
    make_op = {"conv2d[patch]": _serving_patch_embed_op, "conv3d[patch]": _serving_patch_embed_op}
    return {
        "conv3d": Serving(((16384, 3, 2, 14, 14, 1280, 2, 14, 14),), _serving_patch_embed_inputs, make_op,
                          ("bfloat16",), ("conv3d[patch]",)),
        "conv2d": Serving(((8, 3, 384, 384, 1152, 14, 14),), _serving_patch_embed_inputs, make_op,
                          ("bfloat16",), ("conv2d[patch]",)),
    }

# jax arrays on the CPU and GPUs: XLA's own kernels (dot, ragged_dot) are the platform path
JAX_XLA = {("jax", "cpu"): "forward_cpu", ("jax", "cuda"): "forward_cuda"}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {
    **{op: {"traits": {"case_shapes_only", "contraction", "spatial"}, "kernel_in_native_cells": JAX_XLA}
       for op in ("conv2d", "conv3d")},
    # a convolution that is not a patch embedding runs the frontend's own convolution in every cell
    **{label: {"native_cells": {cell: "the patch-embedding matmul needs kernel_size == stride"
                                for cell in (*((f, p) for f, p, _ in KERNEL_CELLS), *JAX_XLA)}}
       for label in ("conv2d[general]", "conv3d[general]")},
    "conv2d[patch]": {"native_dtypes": {("torch", "cpu", "float32"): "oneDNN's strided convolution"}},
}
