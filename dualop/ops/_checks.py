"""Input validation shared by every op: one place for the wording of bad-input errors.

Every check runs before any kernel launches and raises ``TypeError`` (wrong kind or dtype) or
``ValueError`` (wrong shape), naming the op, the argument and what was expected. Under ``jax.jit``
they run once, at trace time, on static shapes and dtypes.
"""

from __future__ import annotations

from typing import Any

from dualop.backends.torch.recording import decline_if_recording, records_grad  # noqa: F401  (the ops' names)
from dualop.platforms import family_of, frontend_of

__all__ = [
    "FLOAT_DTYPES", "dtype_name", "check_array", "check_optional_like", "records_grad",
    "decline_if_recording", "concrete_values", "check_positive_int", "checked_before", "remember_checked",
    "check_writable_cache", "check_finite_float", "check_not_engine_activation",
]

# The floating dtypes every dualop kernel takes.
FLOAT_DTYPES = frozenset({"float32", "bfloat16", "float16"})


def dtype_name(x: Any) -> str:
    """``float32``, ``bfloat16``, ... for a torch or jax array."""
    return str(x.dtype).removeprefix("torch.")


def check_positive_int(op: str, name: str, value: Any) -> int:
    """A constructor's size argument: a positive int (numpy ints too, bools not)."""
    import numpy as np

    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")
    return int(value)


def check_finite_float(op: str, name: str, value: Any, *, minimum: float | None = None,
                       positive: bool = False) -> float:
    """A constructor's float argument: a finite real number (ints and numpy floats too, bools not),
    ``> 0`` if ``positive``, ``>= minimum`` if given; NaN and infinities are refused."""
    import math

    import numpy as np

    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{op}: {name} must be a finite float, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{op}: {name} must be a finite float, got {value!r}")
    if positive and not number > 0:
        raise ValueError(f"{op}: {name} must be a finite float > 0, got {value!r}")
    if minimum is not None and not number >= minimum:
        raise ValueError(f"{op}: {name} must be a finite float >= {minimum}, got {value!r}")
    return number


def _describe(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def check_array(op: str, arg: str, x: Any, *, min_ndim: int = 1, dtypes: frozenset[str] = FLOAT_DTYPES) -> str:
    """Check one required array argument; return its frontend."""
    fe = frontend_of(x)
    if fe is None:
        raise TypeError(f"{op}: argument '{arg}' must be a torch.Tensor or jax.Array, got {_describe(x)}")
    if x.ndim < min_ndim:
        raise ValueError(f"{op}: argument '{arg}' must have at least {min_ndim} dimension(s), got shape {tuple(x.shape)}")
    name = dtype_name(x)
    if name not in dtypes:
        raise TypeError(f"{op}: argument '{arg}' has dtype {name}; expected one of {', '.join(sorted(dtypes))}")
    return fe


def check_optional_like(
    op: str,
    arg: str,
    value: Any,
    ref_arg: str,
    ref: Any,
    ref_frontend: str,
    *,
    shape: tuple[int, ...] | None = None,
    same_dtype: bool = False,
    dtypes: frozenset[str] = FLOAT_DTYPES,
) -> None:
    """Check an optional array that must live with ``ref``: same frontend family and device, the
    given ``shape`` (default: ``ref``'s), optionally ``ref``'s dtype, and one of ``dtypes``."""
    if value is None:
        return
    fe = frontend_of(value)
    if fe is None:
        raise TypeError(f"{op}: argument '{arg}' must be None, a torch.Tensor or a jax.Array, got {_describe(value)}")
    if family_of(fe) != family_of(ref_frontend):
        raise TypeError(
            f"{op}: argument '{arg}' is a {family_of(fe)} array but '{ref_arg}' is a "
            f"{family_of(ref_frontend)} array; pass arrays of one frontend"
        )
    if fe != ref_frontend or (family_of(fe) == "torch" and value.device != ref.device):
        raise ValueError(
            f"{op}: argument '{arg}' is on {getattr(value, 'device', fe)} but '{ref_arg}' is on "
            f"{getattr(ref, 'device', ref_frontend)}; expected the same device"
        )
    expected = tuple(ref.shape) if shape is None else shape
    if tuple(value.shape) != expected:
        raise ValueError(f"{op}: argument '{arg}' has shape {tuple(value.shape)}; expected {expected}")
    name = dtype_name(value)
    if same_dtype and name != dtype_name(ref):
        raise TypeError(f"{op}: argument '{arg}' has dtype {name}; expected {dtype_name(ref)} (the dtype of '{ref_arg}')")
    if name not in dtypes:
        raise TypeError(f"{op}: argument '{arg}' has dtype {name}; expected one of {', '.join(sorted(dtypes))}")


def check_not_engine_activation(op: str, arg: str, value: Any, x_name: str, x: Any, expected: tuple[int, ...],
                                engine_call: str, dualop_call: str, remedy: str) -> None:
    """Refuse, with the way out, an activation where an op takes a parameter: the engine's modules
    own their parameters, so its positional call (``norm(x, residual)``) puts the next activation
    (``x_name``'s shape) where a dualop op takes a parameter (``op(x, weight, residual)``).
    ``remedy`` names what takes the engine's call (the layer owning the parameter). A value of the
    parameter's own shape cannot be told apart (a 1-D ``x``, or a mixer's token count equal to a
    weight's rows) and is taken as the parameter."""
    if value is None or x.ndim < 2 or getattr(value, "ndim", None) != x.ndim or tuple(value.shape) != tuple(x.shape):
        return  # the cheap tests first: this runs on every call of a norm
    if tuple(value.shape) == tuple(expected):
        return  # the parameter's own shape, which x happens to have too
    raise ValueError(
        f"{op}: argument '{arg}' has shape {tuple(value.shape)}; expected {tuple(expected)}. That is '{x_name}''s "
        f"shape: the engine's call {engine_call} passes an activation where this op takes a parameter; call "
        f"{dualop_call}, or {remedy}"
    )


def concrete_values(x: Any):
    """``x``'s values as a numpy array when they can be read without tracing or capturing: torch
    tensors on the CPU or a GPU (not while a CUDA graph is being captured), jax arrays outside a
    trace. None for jax tracers, torch_xla / torchax tensors (reading them would force the lazy
    graph or leave jit) and meta tensors: there, kernels clamp indices instead (each op says how).
    """
    import numpy as np

    fe = frontend_of(x)
    if fe == "jax":
        import jax

        return None if isinstance(x, jax.core.Tracer) else np.asarray(x)
    if fe == "torch":
        import torch

        if x.device.type == "meta" or (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return None
        return x.detach().cpu().numpy()
    return None


# --- value checks already passed --------------------------------------------------------------------
# A value check (one that reads an array's values: metadata, slots, positions) is a pure function of
# the values, their shapes and dtypes and a few ints. A model passes the same step's metadata to every
# layer, so the same values reach the same check once per layer; the check remembers a copy of the
# values it last passed (torch: a clone on the tensor's device; jax: a numpy copy) and skips only
# when the current values equal it, one comparison pass, cheaper than the check. Identity and
# torch's version counter would not do: a write through numpy (``torch.from_numpy``, ``.numpy()``),
# DLPack (a jax array sharing a torch tensor's memory) or ``.data`` changes the values without a
# version bump. Arrays whose values cannot be read (tracers, lazy and fake tensors, a CUDA graph
# being captured) are never remembered, so they never skip.
_LAST_CHECKED: dict[str, tuple] = {}


def _readable_torch(a: Any) -> bool:
    """Whether a plain torch tensor's values can be compared now (not meta or fake, not inside
    torch.compile's trace or a CUDA graph capture)."""
    import torch

    if a.device.type == "meta" or torch.compiler.is_compiling():
        return False
    if isinstance(a, torch._subclasses.FakeTensor):
        return False
    return not (a.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _snapshot(a: Any) -> Any:
    """A private copy of ``a``'s values to compare later, or None where they cannot be read."""
    fe = frontend_of(a)
    if fe == "torch":
        return a.detach().clone() if _readable_torch(a) else None
    if fe == "jax":
        import numpy as np

        values = concrete_values(a)
        return None if values is None else np.array(values, copy=True)
    return None


def _same_values(snapshot: Any, a: Any) -> bool:
    """Whether ``a`` holds exactly ``snapshot``'s values (same shape and dtype)."""
    fe = frontend_of(a)
    if fe == "torch":
        import torch

        if not isinstance(snapshot, torch.Tensor) or not _readable_torch(a):
            return False
        if a.dtype != snapshot.dtype or a.shape != snapshot.shape or a.device != snapshot.device:
            return False
        return bool(torch.equal(a.detach(), snapshot))
    if fe == "jax":
        import numpy as np

        values = concrete_values(a)
        return (isinstance(snapshot, np.ndarray) and values is not None and values.dtype == snapshot.dtype
                and values.shape == snapshot.shape and bool(np.array_equal(values, snapshot)))
    return False


def checked_before(check: str, arrays: tuple, params: tuple) -> bool:
    """Whether value check ``check`` last passed with the same ``params`` on arrays holding exactly
    the values ``arrays`` hold now (see above)."""
    last = _LAST_CHECKED.get(check)
    if last is None or last[0] != params or len(last[1]) != len(arrays):
        return False
    return all(_same_values(snapshot, a) for snapshot, a in zip(last[1], arrays))


def remember_checked(check: str, arrays: tuple, params: tuple) -> None:
    """Record that value check ``check`` passed on ``arrays``' current values with ``params``."""
    snapshots = tuple(_snapshot(a) for a in arrays)
    if any(s is None for s in snapshots):
        _LAST_CHECKED.pop(check, None)
        return
    _LAST_CHECKED[check] = (params, snapshots)


# --- caches written in place ------------------------------------------------------------------------


def check_writable_cache(op: str, arg: str, cache: Any) -> None:
    """Refuse, before anything is written, a torch cache that an in-place write would fail on (or
    corrupt) partway: an inference tensor outside ``torch.inference_mode()``, a leaf tensor (or a
    view of one) that requires grad while grad mode is on, or a tensor whose elements overlap in
    memory (an ``expand``-ed one). torch raises on the first two only after a kernel of dualop's
    own (Triton, Pallas, C++) has written the rows, or not at all. jax arrays are never written in
    place: nothing to check."""
    if frontend_of(cache) is None or family_of(frontend_of(cache)) != "torch":
        return
    import torch

    if cache.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            f"{op}: argument '{arg}' is an inference tensor (made under torch.inference_mode()) and this call is "
            f"outside inference mode, where torch forbids writing it in place; call the op inside "
            f"torch.inference_mode(), or allocate the cache outside it"
        )
    if torch.is_grad_enabled() and cache.requires_grad:
        base = cache._base if cache._base is not None else cache
        if base.is_leaf and base.requires_grad:
            raise ValueError(
                f"{op}: argument '{arg}' is {'a view of ' if base is not cache else ''}a leaf tensor that requires "
                f"grad, which autograd forbids writing in place; a cache is state, not a parameter: allocate it "
                f"with requires_grad=False (or call under torch.no_grad())"
            )
    if any(stride == 0 and size > 1 for stride, size in zip(cache.stride(), cache.shape)):
        raise ValueError(
            f"{op}: argument '{arg}' has overlapping elements (stride 0 in shape {tuple(cache.shape)}, strides "
            f"{tuple(cache.stride())}: an expanded tensor); expected a cache with one memory location per element "
            f"(pass .contiguous() or allocate it whole)"
        )
