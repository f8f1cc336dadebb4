"""Input validation shared by every op: one place for the wording of bad-input errors.

Every check runs before any kernel launches and raises ``TypeError`` (wrong kind or dtype) or
``ValueError`` (wrong shape), naming the op, the argument and what was expected. Under ``jax.jit``
they run once, at trace time, on static shapes and dtypes.
"""

from __future__ import annotations

from typing import Any

from dualop.platforms import family_of, frontend_of

__all__ = [
    "FLOAT_DTYPES", "dtype_name", "check_array", "check_optional_like", "records_grad", "cpu_declines",
    "decline_if_recording", "concrete_values", "check_positive_int", "checked_before", "remember_checked",
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


def records_grad(*tensors: Any) -> bool:
    """Whether torch autograd is recording for any of these (then CPU kernels, which have no
    backward, step aside for the differentiable native body)."""
    import torch

    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def decline_if_recording(op: str, *tensors: Any) -> None:
    """Raise NotImplementedError (dispatch then runs the differentiable native body and reports
    why) when torch autograd is recording for any of ``tensors``: the C++ CPU kernels have no
    backward."""
    if records_grad(*tensors):
        raise NotImplementedError(f"{op}: autograd is recording and the C++ CPU kernel has no backward")


def cpu_declines(method: str, frontend: str) -> str | None:
    """The ops' shared rule for ``CustomOp.declines``: their ``forward_cpu`` serves torch tensors
    only; jax, torchax and torch_xla arrays reach XLA, which compiles the native body itself."""
    if method == "forward_cpu" and frontend != "torch":
        return f"no CPU kernel for {frontend} arrays: XLA compiles the native body"
    return None


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
# the values and a few ints. A model passes the same step's metadata to every layer, so the same
# unchanged arrays reach the same check once per layer; the check remembers the arrays it last
# passed and skips them. "Unchanged": the very same objects (held by weak reference, so a freed
# array's id cannot be mistaken for it), with the same torch version counter (every in-place
# torch write bumps it) and data pointer; jax arrays are immutable. A write that bypasses torch's
# version counter (through a numpy view of the tensor) is not seen: the kernels clamp every index
# they read anyway, so such a change gives wrong numbers, never an out-of-bounds access.
_LAST_CHECKED: dict[str, tuple] = {}


def _identity(arrays: tuple) -> tuple | None:
    import weakref

    out = []
    for a in arrays:
        if getattr(a, "is_inference", None) is not None and a.is_inference():
            return None  # made under torch.inference_mode: no version counter to see a later write
        try:
            ref = weakref.ref(a)
        except TypeError:
            return None
        version = getattr(a, "_version", None)
        pointer = a.data_ptr() if hasattr(a, "data_ptr") else None
        out.append((ref, version, pointer))
    return tuple(out)


def checked_before(check: str, arrays: tuple, params: tuple) -> bool:
    """Whether value check ``check`` last passed on these very ``arrays``, unchanged since, with
    the same ``params`` (see above)."""
    last = _LAST_CHECKED.get(check)
    if last is None or last[1] != params or len(last[0]) != len(arrays):
        return False
    for (ref, version, pointer), a in zip(last[0], arrays):
        if ref() is not a or (version is not None and a._version != version) or (
                pointer is not None and a.data_ptr() != pointer):
            return False
    return True


def remember_checked(check: str, arrays: tuple, params: tuple) -> None:
    """Record that value check ``check`` passed on ``arrays`` with ``params``."""
    identity = _identity(arrays)
    if identity is not None:
        _LAST_CHECKED[check] = (identity, params)
