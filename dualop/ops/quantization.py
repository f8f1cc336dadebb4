"""FP8 input quantisation: ``QuantFP8`` (registered ``quant_fp8``), the reference serving engine's
dynamic/static float8 e4m3 activation quantiser, and ``GroupShape``, which says how many elements
share one scale.

``op = QuantFP8(static, group_shape)``; ``x_q, scale = op(x, scale=None, scale_ub=None)``.

- ``x``: float32/bfloat16/float16, 2-D or more; every leading dim is tokens, the last is hidden.
- ``x_q``: ``x``'s shape, in the fp8 format of the platform ``x`` dispatches on (``fp8_format``):
  float8_e4m3fnuz with ``max = 224`` on ROCm MI300-class GPUs (gfx94x), as the reference engine
  does there (240 is fnuz's largest value; the engine keeps 224), else float8_e4m3fn with
  ``max = 448``. Below, 448 stands for ``max``.
- ``scale``: float32, ``x ≈ x_q * scale`` (broadcast per group). Its shape (the reference engine's
  ``forward_native`` shapes; returned in this shape whether computed or given):

  ============================  ===========================  ==========================================
  group shape                   returned scale               static ``scale`` accepted
  ============================  ===========================  ==========================================
  per tensor ``(-1, -1)``       ``(1,)``                     ``(1,)``, ``()`` or ``(1, 1)``
  per token ``(1, -1)``         ``(*x.shape[:-1], 1)``       ``(*x.shape[:-1], 1)``
  group ``(1, g)``              ``(*x.shape[:-1], H // g)``  ``(*x.shape[:-1], H // g)`` (row-major)
  ============================  ===========================  ==========================================

Dynamic (``static=False``): ``amax`` = max ``|x|`` over the tensor / each row / each ``g``
consecutive columns of a row; with ``scale_ub`` (dynamic per-token only, one float32 element, as in
the reference engine) ``amax = min(amax, scale_ub)``; ``scale = max(amax / 448, 1 / (448 * 512))``
(the floor keeps all-zero rows finite). A NaN in ``x`` makes its amax NaN (torch's ``amax``), so
its scale and every value sharing that scale are NaN, on every path. ``scale_ub`` must be a positive
number (not NaN), checked where its value is at hand. Static: the given ``scale`` is used as is.
Then ``x_q = fp8(clip(x * (1 / scale), -448, 448))``, all in float32, the cast rounding to nearest
even. Zero tokens give empty outputs (per tensor: the floor scale).

Reproducible to the bit: each step is a correctly rounded float32 operation, so the torch and XLA
native bodies, torch's CPU body and the Pallas and Triton kernels (interpreted here) agree bit for
bit (the cells check it; on the rocm platform kernel and native body both give fnuz). Compiled
kernels keep that wherever the hardware divides correctly.

- ``amax / 448`` is rounded correctly without a division by a constant (``_div_by_fp8_max``): XLA
  compiles ``a / 448`` as ``a * f32(1/448)``, one ulp off torch's quotient for some ``a``.
- ``x`` is multiplied by the reciprocal of the scale (one correctly rounded ``1 / scale`` per
  scale, one multiply per element), as the reference engine's native body and its per-tensor CUDA
  kernel do. ``x / scale`` would not be reproducible: XLA (jax 0.10) compiles a division by a
  broadcast divisor as that same multiply, while torch divides. A multiply is also far cheaper
  than a divide on TPUs.
- the float8 cast rounds to nearest even; XLA's convert rounds through float16 in some releases,
  so the XLA-backed native body rounds onto the e4m3 grid first (``_round_to_fp8_grid``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import CustomOp
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import check_array, check_optional_like, concrete_values, dtype_name
from dualop.platforms import frontend_of, platform_of
from dualop.spec import Serving

__all__ = ["QuantFP8", "GroupShape", "Fp8Format", "E4M3FN", "E4M3FNUZ", "fp8_format", "FP8_MAX", "FP8_MIN_SCALE"]


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """An fp8 output format: ``dtype`` (the torch/jax dtype name), ``max`` (``x`` is clipped to
    ``+-max`` and the dynamic scale is ``amax / max``) and ``subnormal_step`` (the grid's spacing
    below the smallest normal, ``2**(1 - bias - 3)``)."""

    dtype: str
    max: float
    subnormal_step: float

    @property
    def min_scale(self) -> float:
        """The dynamic scale's floor, the reference engine's ``1 / (max * 512)``."""
        return 1.0 / (self.max * 512.0)


E4M3FN = Fp8Format("float8_e4m3fn", 448.0, 2.0**-9)  # OCP e4m3: bias 7, max 448, NaN 0x7f/0xff
# bias 8, largest value 240, NaN 0x80, no -0; 224 is the reference engine's max on MI300 (gfx94x)
E4M3FNUZ = Fp8Format("float8_e4m3fnuz", 224.0, 2.0**-10)
FP8_MAX = E4M3FN.max  # the e4m3fn figures (every platform but ROCm MI300)
FP8_MIN_SCALE = E4M3FN.min_scale


def fp8_format(x: Any) -> Fp8Format:
    """The fp8 format ``quant_fp8`` gives ``x`` on the platform it dispatches on: float8_e4m3fnuz
    (max 224) on ROCm with a gfx94x (MI300-class) target, and also on ROCm with no known target
    (Triton's CPU interpreter, ``DUALOP_PLATFORM=rocm``, jax arrays): there the reference engine's
    MI300 choice stands in, so the rocm cells check the fnuz path. float8_e4m3fn (max 448)
    everywhere else (CUDA, CPU, TPU, and ROCm GPUs outside gfx94x, such as gfx950, which use OCP
    e4m3). The one place the format is decided: native body, kernels and checks all ask here."""
    if platform_of(x) != "rocm":
        return E4M3FN
    target = None
    if frontend_of(x) == "torch":
        from dualop.kernels.cuda import gpu_target

        target = gpu_target(x.device)
    if target is None or (target.backend == "hip" and str(target.arch).startswith("gfx94")):
        return E4M3FNUZ
    return E4M3FN
# The lane width the TPU kernels tile columns by: a group size must be a multiple of it.
GROUP_MULTIPLE = 128

_PALLAS_QUANT = KernelRef("dualop.kernels.pallas.quant_fp8", "quant_fp8")
_TRITON_QUANT = KernelRef("dualop.kernels.cuda.quant_fp8", "quant_fp8")


def _require_fp8_e4m3_target(device: Any) -> None:
    """Decline (NotImplementedError: dispatch falls back to forward_native and reports why) where
    the Triton kernel cannot give this op's fp8: CUDA GPUs below sm_89 have no e4m3 conversion
    (Triton refuses ``tl.float8e4nv`` there). ROCm GPUs run it (fnuz on gfx94x, see
    ``fp8_format``); so does Triton's CPU interpreter (no target)."""
    from dualop.kernels.cuda import gpu_target

    target = gpu_target(device)
    if target is None:
        return
    if target.backend == "cuda" and int(target.arch) < 89:
        raise NotImplementedError(
            f"quant_fp8: {target.name} has no float8 e4m3 conversion (Triton's fp8e4nv needs sm_89 or newer)"
        )


@dataclasses.dataclass(frozen=True)
class GroupShape:
    """Elements sharing one scale, as (rows, cols) of the 2-D (tokens, hidden) view; ``-1`` means
    the whole extent. ``PER_TENSOR = (-1, -1)``, ``PER_TOKEN = (1, -1)``, a group ``(1, g)``.

    ``GroupShape.parse`` also takes ``"per_tensor"``, ``"per_token"`` and a ``(row, col)`` tuple
    (so the reference engine's ``GroupShape`` named tuples work as they are).
    """

    row: int
    col: int

    PER_TENSOR: ClassVar[GroupShape]
    PER_TOKEN: ClassVar[GroupShape]

    def __post_init__(self) -> None:
        for name in ("row", "col"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not (v == -1 or v >= 1):
                raise ValueError(f"GroupShape: {name} must be -1 (whole extent) or a positive int, got {v!r}")

    @classmethod
    def parse(cls, value: Any) -> GroupShape:
        if isinstance(value, GroupShape):
            return value
        if isinstance(value, str):
            named = {"per_tensor": cls.PER_TENSOR, "per_token": cls.PER_TOKEN}
            if value not in named:
                raise ValueError(f"GroupShape: unknown name {value!r}; expected 'per_tensor', 'per_token' or a (row, col) tuple")
            return named[value]
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return cls(*value)
        raise ValueError(f"GroupShape: expected 'per_tensor', 'per_token', a (row, col) tuple or a GroupShape, got {value!r}")

    def is_per_tensor(self) -> bool:
        return self.row == -1 and self.col == -1

    def is_per_token(self) -> bool:
        return self.row == 1 and self.col == -1

    def is_per_group(self) -> bool:
        return self.row == 1 and self.col >= 1

    def __str__(self) -> str:
        if self.is_per_tensor():
            return "per_tensor"
        if self.is_per_token():
            return "per_token"
        return f"({self.row}, {self.col})"


GroupShape.PER_TENSOR = GroupShape(-1, -1)
GroupShape.PER_TOKEN = GroupShape(1, -1)


def _round_to_fp8_grid_body(xp, y: Any, fmt: Fp8Format = E4M3FN) -> Any:
    """``y`` (float32, |y| <= ``fmt.max``) rounded to the nearest value of ``fmt`` (e4m3fn or
    e4m3fnuz: the same 3-bit significand grid, subnormal steps 2**-9 and 2**-10), ties to even,
    kept in float32, so the cast that follows is exact. Written for e4m3fn below (2**14 =
    2**-9 * 2**23, 2**-10 = half a subnormal step); fnuz uses 2**13 and 2**-11.

    XLA's float32 -> float8_e4m3fn convert rounds twice (through float16) in some releases (seen
    with jax 0.7.1 and torch_xla 2.9: 50.0009765625 became 48, not 52), so the XLA-backed native
    body rounds here first, with array-namespace arithmetic only (no bit casts: torchax 0.0.6 has
    no ``view(dtype)``). With ``big = max(|y| * 2**20, 2**14)``, ``(|y| + big) - big`` rounds |y|
    to a multiple of ulp(big), to nearest even: 2**(e-3) in binade 2**e (the e4m3 quantum), 2**-9
    below 2**-6 (the subnormal quantum). Only where ``|y| + big`` crosses into the next binade
    (|y| within 2**-20 of 2**(e+1)) does it land one quantum low, at 15 * 2**(e-3); that is
    detected (``|y| - r > max(r/16, 2**-10)``, impossible for a correctly rounded ``r``) and
    replaced by ``r + r * f32(1/15)`` = 2**(e+1). ``big`` depends on the data on purpose: XLA
    folds ``(a + C) - C`` to ``a`` for a constant ``C``. Every step is exact or one rounding, also
    if a multiply-add is contracted to an FMA. Checked against torch's cast for every float32 in
    [-448, 448].
    """
    m = xp.abs(y)
    big = xp.maximum(m * 2.0**20, fmt.subnormal_step * 2.0**23)
    r = (m + big) - big
    r = xp.where(m - r > xp.maximum(r * 0.0625, fmt.subnormal_step * 0.5), r + r * (1.0 / 15.0), r)
    r = xp.where(y < 0, -r, r)
    return xp.where(m == 0, y, r)  # keeps the sign of zero (fnuz's cast drops it); NaN stays NaN


def _round_to_fp8_grid(xp, y: Any, fmt: Fp8Format = E4M3FN) -> Any:
    """``_round_to_fp8_grid_body``; for jax arrays one compiled (fused) function rather than a
    dozen eagerly dispatched ops (jax is imported only once a jax array is here)."""
    if xp.name == "jax":
        return _jax_round_to_fp8_grid(xp, fmt)(y)
    return _round_to_fp8_grid_body(xp, y, fmt)


@functools.lru_cache(maxsize=None)
def _jax_round_to_fp8_grid(xp, fmt: Fp8Format):
    import jax

    return jax.jit(functools.partial(_round_to_fp8_grid_body, xp, fmt=fmt))


def _div_by_fp8_max(xp, amax: Any, fp8_max: float = FP8_MAX) -> Any:
    """``amax / fp8_max`` correctly rounded in float32, using only multiplies and adds, for a
    ``fp8_max`` of 7 times a power of two (448 = 7 * 64, 224 = 7 * 32). Told for 448:

    ``q0 = amax * f32(1/448)`` is within 1.5 ulp of the quotient. ``res = amax/64 - 7*q0`` is
    computed exactly (``amax/64`` and ``8*q0`` are exact; both subtractions are exact by Sterbenz's
    lemma), so ``q0 + res * f32(1/7)`` is the quotient plus an error far below the distance from
    any float32 midpoint (which a quotient by 448 keeps, 7 being 3 bits wide): one rounding gives
    the correctly rounded result, also if the last multiply-add is contracted to an FMA. Checked
    against float64 division for every float32 in [2**-10, 2**17] (below, the scale floor
    applies anyway). ``inf`` stays ``inf``.
    """
    if math.frexp(fp8_max / 7.0)[0] != 0.5:
        raise ValueError(f"quant_fp8: fp8 max {fp8_max} is not 7 times a power of two")
    q0 = amax * (1.0 / fp8_max)
    res = (amax * (7.0 / fp8_max) - q0 * 8.0) + q0
    return xp.where(res == res, q0 + res * (1.0 / 7.0), q0)


def _abs_max(xp, xf: Any, axis: int, keepdims: bool, xla: bool) -> Any:
    """``max(|xf|)`` over ``axis``, NaN where a NaN is among the elements, as torch's ``amax``
    gives: a NaN makes its scale NaN and so every value that shares the scale. XLA's max reduction
    may skip a NaN (its CPU backend does in vectorised float32 reductions), so for XLA-backed
    arrays (``xla``) a separate reduction of a NaN flag decides."""
    amax = xp.amax(xp.abs(xf), axis=axis, keepdims=keepdims)
    if not xla:
        return amax
    seen = xp.amax(xp.astype(xf != xf, xp.float32), axis=axis, keepdims=keepdims)
    return xp.where(seen > 0, float("nan"), amax)


def _scale_shapes(group_shape: GroupShape, lead: tuple[int, ...], hidden: int) -> tuple[tuple[int, ...], ...]:
    """The static ``scale`` shapes accepted for ``x`` of shape ``(*lead, hidden)`` (first: canonical)."""
    if group_shape.is_per_tensor():
        return ((1,), (), (1, 1))
    if group_shape.is_per_token():
        return ((*lead, 1),)
    return ((*lead, hidden // group_shape.col),)


def quantize_fp8_native(x: Any, gs: GroupShape, scale: Any = None, scale_ub: Any = None) -> tuple[Any, Any]:
    """``quant_fp8``'s native body (the module docstring's contract) for any group shape ``gs``:
    the op takes groups of multiples of 128 (the engine's kernels); the linear ops' W8A8
    reference (``quantized_weight``) quantizes activations in any block width."""
    xp = array_namespace(x)
    fmt = fp8_format(x)
    lead, hidden = tuple(x.shape[:-1]), x.shape[-1]
    xf = xp.astype(x, xp.float32)
    if gs.is_per_group():
        xf = xf.reshape((*lead, hidden // gs.col, gs.col))  # (..., groups, g)
    if scale is None:
        xla = frontend_of(x) != "torch"
        if gs.is_per_tensor():
            if math.prod(x.shape) == 0:
                amax = xp.asarray([0.0], like=xf, dtype=xp.float32)
            else:
                # a 1-D reduction over axis 0 (torch_xla's amax of no dims reduces none)
                amax = _abs_max(xp, xf.reshape((-1,)), 0, True, xla)
        else:  # per token: (..., 1); group: (..., groups)
            amax = _abs_max(xp, xf, -1, gs.is_per_token(), xla)
            if scale_ub is not None:
                amax = xp.minimum(amax, xp.astype(scale_ub, xp.float32).reshape(()))
        scale = xp.maximum(_div_by_fp8_max(xp, amax, fmt.max), fmt.min_scale)
    else:
        scale = xp.astype(scale, xp.float32).reshape(_scale_shapes(gs, lead, hidden)[0])
    inv = 1.0 / scale
    y = xf * (inv[..., None] if gs.is_per_group() else inv)
    y = xp.clip(y, -fmt.max, fmt.max)
    if frontend_of(x) != "torch":  # XLA-backed arrays (jax, torch_xla, torchax)
        y = _round_to_fp8_grid(xp, y, fmt)
    return xp.astype(y, getattr(xp, fmt.dtype)).reshape(x.shape), scale


@CustomOp.register("quant_fp8")
class QuantFP8(CustomOp):
    """Quantise activations to fp8 (float8_e4m3fn; float8_e4m3fnuz on ROCm MI300, see
    ``fp8_format``) with per-tensor, per-token or per-group (1, g) scales, dynamic (computed from
    ``x``) or static (given). See the module docstring for the contract.

    Fast paths: ``forward_cuda`` a Triton kernel, ``forward_tpu`` a Pallas kernel, ``forward_cpu``
    a torch body of its own for torch tensors (jax arrays run the native body, which XLA fuses).
    """

    parameterless = True  # the layer modules wrap the op as it is (dualop.torch/jax.layers)

    def __init__(self, static: bool, group_shape: Any = GroupShape.PER_TENSOR, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        if not isinstance(static, bool):
            raise TypeError(f"quant_fp8: static must be a bool, got {static!r}")
        try:
            gs = GroupShape.parse(group_shape)
        except ValueError as err:
            raise ValueError(f"quant_fp8: group_shape: {err}") from None
        if not (gs.is_per_tensor() or gs.is_per_token() or (gs.is_per_group() and gs.col % GROUP_MULTIPLE == 0)):
            raise ValueError(
                f"quant_fp8: group_shape {tuple(dataclasses.astuple(gs))} is not supported; expected per_tensor "
                f"(-1, -1), per_token (1, -1) or (1, g) with g a multiple of {GROUP_MULTIPLE}"
            )
        self.static = static
        self.group_shape = gs

    def extra_repr(self) -> str:
        return f"static={self.static}, group_shape={self.group_shape}"

    @property
    def _granularity(self) -> str:
        gs = self.group_shape
        return "tensor" if gs.is_per_tensor() else ("token" if gs.is_per_token() else "group")

    # ------------------------------------------------------------------ validation

    def check_inputs(self, x: Any, scale: Any = None, scale_ub: Any = None) -> None:
        fe = check_array("quant_fp8", "x", x, min_ndim=2)
        lead, hidden = tuple(x.shape[:-1]), x.shape[-1]
        gs = self.group_shape
        if hidden == 0:
            raise ValueError(f"quant_fp8: argument 'x' has an empty last dim (shape {tuple(x.shape)}); expected hidden >= 1")
        if gs.is_per_group() and hidden % gs.col:
            raise ValueError(
                f"quant_fp8: argument 'x' has last dim {hidden}, which group_shape {gs} does not divide; "
                f"expected a multiple of {gs.col}"
            )
        if self.static:
            if scale is None:
                raise ValueError("quant_fp8: argument 'scale' is required for a static op (static=True), got None")
            self._check_scalar_like("scale", scale, x, fe, _scale_shapes(gs, lead, hidden))
        elif scale is not None:
            raise ValueError(
                "quant_fp8: argument 'scale' must be None for a dynamic op (static=False): its scales are computed from x"
            )
        if scale_ub is not None:
            if self.static or not gs.is_per_token():
                raise ValueError(
                    f"quant_fp8: argument 'scale_ub' is supported only by dynamic per-token quantisation; "
                    f"this op is static={self.static}, group_shape={gs}"
                )
            self._check_scalar_like("scale_ub", scale_ub, x, fe, ((), (1,), (1, 1)))
            ub = concrete_values(scale_ub)
            if ub is not None and not float(ub.reshape(())) > 0:
                raise ValueError(f"quant_fp8: argument 'scale_ub' is {float(ub.reshape(()))}; expected a positive "
                                 f"number (an upper bound on each token's amax; NaN would make every scale NaN)")

    @staticmethod
    def _check_scalar_like(arg: str, value: Any, x: Any, fe: str, shapes: tuple[tuple[int, ...], ...]) -> None:
        """Frontend, device, one of ``shapes``, float32."""
        shape = tuple(getattr(value, "shape", ()))
        check_optional_like("quant_fp8", arg, value, "x", x, fe, shape=shape)
        if shape not in shapes:
            expected = " or ".join(str(s) for s in shapes)
            raise ValueError(f"quant_fp8: argument '{arg}' has shape {shape}; expected {expected} for x of shape {tuple(x.shape)}")
        if dtype_name(value) != "float32":
            raise TypeError(f"quant_fp8: argument '{arg}' has dtype {dtype_name(value)}; expected float32 (scales are float32)")

    # ------------------------------------------------------------------ implementations

    def forward_native(self, x: Any, scale: Any = None, scale_ub: Any = None) -> tuple[Any, Any]:
        return quantize_fp8_native(x, self.group_shape, scale, scale_ub)


    def forward_cpu(self, x: Any, scale: Any = None, scale_ub: Any = None) -> Any:
        """torch on the CPU: one min/max pass (``aminmax``, no |x| temporary), the float32 copy
        scaled in place and cast directly (torch's cast already rounds to nearest even). Its own
        implementation (not forward_native's formula), checked against forward_native, so it
        counts as the CPU kernel."""
        import torch

        fmt = fp8_format(x)
        lead, hidden = tuple(x.shape[:-1]), x.shape[-1]
        gs = self.group_shape
        xv = x.reshape((*lead, hidden // gs.col, gs.col)) if gs.is_per_group() else x
        if scale is None:
            if gs.is_per_tensor():
                if x.numel() == 0:
                    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
                else:
                    lo, hi = torch.aminmax(x)
                    amax = torch.maximum(hi, lo.neg()).to(torch.float32).reshape(1)
            else:
                lo, hi = torch.aminmax(xv, dim=-1, keepdim=gs.is_per_token())
                amax = torch.maximum(hi, lo.neg_()).to(torch.float32)
                if scale_ub is not None:
                    amax = torch.minimum(amax, scale_ub.reshape(()))
            scale = amax.div_(fmt.max).clamp_(min=fmt.min_scale)  # torch divides correctly
        else:
            scale = scale.reshape(_scale_shapes(gs, lead, hidden)[0])
        xf = xv.to(torch.float32)
        inv = 1.0 / scale
        inv = inv.unsqueeze(-1) if gs.is_per_group() else inv
        y = xf.mul_(inv) if xf is not xv else xf * inv
        x_q = y.clamp_(-fmt.max, fmt.max).to(getattr(torch, fmt.dtype))
        return x_q.reshape(x.shape), scale

    def forward_cuda(self, x: Any, scale: Any = None, scale_ub: Any = None) -> Any:
        if frontend_of(x) == "torch":
            _require_fp8_e4m3_target(x.device)
        fmt = fp8_format(x)
        return call_triton(
            frontend_of(x), _TRITON_QUANT, x, scale, scale_ub,
            granularity=self._granularity, group_size=max(self.group_shape.col, 0),
            fp8_dtype=fmt.dtype, fp8_max=fmt.max,
        )

    def forward_tpu(self, x: Any, scale: Any = None, scale_ub: Any = None) -> Any:
        return call_jax_function(
            frontend_of(x), _PALLAS_QUANT, x, scale, scale_ub,
            granularity=self._granularity, group_size=max(self.group_shape.col, 0),
            native=self.forward_native,
        )


def check_cases():
    """The shapes and inputs ``dualop check`` and the tests run this family with."""
    import numpy as np

    from dualop.testing import NORM_SHAPES, OpCase, Pinned, normal

    group_shapes = ((0, 128), (1, 256), (13, 384), (2, 3, 256))

    def spread(shape, rng):
        """Rows of very different magnitudes (one all-zero), so per-row scales differ."""
        x = normal(shape, rng, 3.0)
        rows = x.reshape(-1, shape[-1])
        if rows.shape[0] >= 3:
            rows *= np.geomspace(0.05, 20.0, rows.shape[0], dtype=np.float32)[:, None]
            rows[rows.shape[0] // 2] = 0.0
        return x

    def dynamic(shape, rng):
        return (spread(shape, rng),)

    def with_ub(shape, rng):  # an upper bound below the larger rows' amax: those rows saturate
        return (spread(shape, rng), None, Pinned(np.array([8.0], np.float32), "float32"))

    def static_tensor(shape, rng):  # |x| above 448 * 0.03 = 13.4 saturates
        return (normal(shape, rng, 3.0), Pinned(np.array([0.03], np.float32), "float32"))

    return [
        OpCase("quant_fp8", "quant_fp8[dynamic,per_tensor]", lambda s: QuantFP8(False, "per_tensor"), dynamic, NORM_SHAPES),
        OpCase("quant_fp8", "quant_fp8[dynamic,per_token]", lambda s: QuantFP8(False, "per_token"), dynamic, NORM_SHAPES),
        OpCase("quant_fp8", "quant_fp8[dynamic,per_token,scale_ub]", lambda s: QuantFP8(False, "per_token"), with_ub, NORM_SHAPES),
        OpCase("quant_fp8", "quant_fp8[dynamic,group128]", lambda s: QuantFP8(False, (1, 128)), dynamic, group_shapes),
        OpCase("quant_fp8", "quant_fp8[static,per_tensor]", lambda s: QuantFP8(True, "per_tensor"), static_tensor, NORM_SHAPES),
    ]


# --- spec: what dualop compile builds (check_cases above) ----------------------------------


def serving():
    """fp8 quantisation sees the attention input (hidden 8192) in an 8192-token prefill and the down
    projection's input (intermediate 53248) in a 16-token decode batch."""
    return {"quant_fp8": Serving(((8192, 8192), (16, 53248)))}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"quant_fp8": {"traits": {"not_differentiable"}}}
