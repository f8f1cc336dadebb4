"""Call a JAX function, a Pallas kernel or a plain XLA program (``kernels/pallas/``,
``kernels/xla/``), from every frontend that can hold TPU arrays.

- ``jax``: call it (works under ``jit``, ``vmap``, ``shard_map``).
- ``torch_xla``: ``torch_xla.core.xla_builder.call_jax``; on a TPU this lowers to a Mosaic custom
  call inside the torch_xla graph. It caches the traced computation by the function's identity,
  so kernels are passed as module-level functions and static options as keyword arguments.
- ``torchax``: ``torchax.interop.call_jax`` (torchax tensors wrap jax arrays; no copy).
- ``torch_tpu``: tensors on PyTorch's native ``tpu`` device. ``torch.tpu.pallas.jax_op`` registers
  the kernel, with its static options bound, as a ``torch.library`` op (``dualop::pallas_...``)
  whose real kernel is exported for the TPU and whose fake kernel infers shapes by the same export.

A plain CPU/CUDA ``torch.Tensor`` has no TPU to run on: the bridge raises NotImplementedError,
which the dispatcher turns into a reported fallback to ``forward_native``.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
import warnings
from typing import Any, Callable

from dualop.kernels.registry import KernelRef

__all__ = ["call_jax_function", "torch_tpu_op"]

_BRIDGED_FRONTENDS = ("jax", "torch_xla", "torchax", "torch_tpu")


def call_jax_function(frontend: str, kernel_ref: KernelRef, *arrays: Any, native: Callable | None = None, **static: Any) -> Any:
    """Run ``kernel(*arrays, interpret=..., **static)`` on the caller's arrays, returning the
    caller's array type. ``arrays`` may hold None for absent optional inputs.

    ``native(*arrays)`` (the op's forward_native, same outputs) gives JAX callers a gradient:
    Pallas kernels have no autodiff rule, so the kernel runs forward and the backward pass is the
    VJP of the native body (``jax.custom_vjp``).
    """
    if frontend not in _BRIDGED_FRONTENDS:
        raise NotImplementedError(
            f"Pallas kernels run on jax arrays, torch_xla, torch_tpu or torchax tensors; "
            f"a {frontend} tensor has no TPU bridge"
        )
    if frontend == "torch_tpu":
        given = [a for a in arrays if a is not None]
        import torch

        if torch.is_grad_enabled() and any(a.requires_grad for a in given):
            # jax_op registers no autograd formula; the native body gives torch's gradients.
            raise NotImplementedError("the torch_tpu bridge has no backward pass; autograd is recording")
        return torch_tpu_op(kernel_ref, arrays, static)(*given)
    if frontend == "torch_xla":
        # torch_xla must own the TPU before JAX is imported, or the process can hang on a TPU host.
        from torch_xla._internal.jax_workarounds import jax_import_guard

        jax_import_guard()
    kernel = kernel_ref.resolve()
    from dualop.kernels.pallas.common import interpret_mode

    interpret = interpret_mode(frontend)
    if frontend == "jax":
        if native is None:
            return kernel(*arrays, interpret=interpret, **static)
        return _with_native_vjp(kernel, native, interpret, static)(*arrays)
    if frontend == "torch_xla":
        from torch_xla.core.xla_builder import call_jax

        return call_jax(kernel, arrays, dict(static, interpret=interpret))
    if frontend == "torchax":
        from torchax.interop import call_jax

        return call_jax(kernel, *arrays, interpret=interpret, **static)
    raise AssertionError(frontend)


# --- torch_tpu: one torch.library op per (kernel, optional inputs present, static options) -------

_torch_tpu_ops: dict[tuple, Any] = {}
_torch_tpu_lock = threading.Lock()


def torch_tpu_op(kernel_ref: KernelRef, arrays: tuple, static: dict[str, Any]) -> Any:
    """The ``torch.library`` op that runs ``kernel_ref`` with ``static`` on torch_tpu tensors,
    registered on first use. ``arrays`` are the call's inputs (None for absent optional ones); the
    op takes the present ones, in order.

    One op per (kernel, which optional inputs are present, static options): a torch schema has a
    fixed argument list and output count, and JAX needs the static options at trace time. The
    name, ``dualop::pallas_<kernel>_<hash of the rest>``, is the same in every process.
    """
    present = tuple(a is not None for a in arrays)
    key = (kernel_ref.module, kernel_ref.function, present, tuple(sorted(static.items())))
    op = _torch_tpu_ops.get(key)
    if op is None:
        with _torch_tpu_lock:
            op = _torch_tpu_ops.get(key)
            if op is None:
                op = _torch_tpu_ops[key] = _register_torch_tpu_op(kernel_ref, arrays, static, key)
    return op


def _register_torch_tpu_op(kernel_ref: KernelRef, arrays: tuple, static: dict[str, Any], key: tuple) -> Any:
    import jax

    try:
        import torch_tpu  # noqa: F401  (installs torch.tpu)
        from torch.tpu.pallas import jax_op
    except ImportError as err:  # a tpu tensor exists, so this is a broken torch_tpu install
        raise NotImplementedError(f"torch_tpu cannot be imported ({err}); pip install 'dualop[torch-tpu]'") from err

    kernel = kernel_ref.resolve()
    names = _array_parameter_names(kernel, len(arrays))
    present = [name for name, a in zip(names, arrays) if a is not None]

    def run(*given):
        # Rebuild the kernel's full argument list; torch_tpu tensors live on a TPU, so the kernel
        # is compiled (interpret=False), never interpreted.
        it = iter(given)
        full = [next(it) if a is not None else None for a in arrays]
        return kernel(*full, interpret=False, **static)

    # The output structure (one array or a tuple) fixes the op's schema; a trace finds it.
    specs = [jax.ShapeDtypeStruct(tuple(a.shape), _jax_dtype(a)) for a in arrays if a is not None]
    outputs = jax.eval_shape(run, *specs)
    returns = jax.Array if not isinstance(outputs, tuple) else tuple[(jax.Array,) * len(outputs)]
    run.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=jax.Array) for n in present],
        return_annotation=returns,
    )
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:12]
    name = f"dualop::pallas_{kernel_ref.function}_{digest}"
    run.__name__ = run.__qualname__ = name.split("::")[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jax_op warns that it is experimental on every registration
        return jax_op(name, run)


def _array_parameter_names(kernel: Callable, count: int) -> list[str]:
    """The names of the kernel's first ``count`` parameters (its array inputs)."""
    params = list(inspect.signature(kernel).parameters)
    return params[:count] if len(params) >= count else [f"input{i}" for i in range(count)]


def _jax_dtype(t: Any) -> Any:
    """The jax dtype of a torch tensor (``torch.bfloat16`` -> ``bfloat16``)."""
    import jax.numpy as jnp

    return jnp.dtype(str(t.dtype).removeprefix("torch."))


def _with_native_vjp(kernel: Callable, native: Callable, interpret: Any, static: dict) -> Callable:
    """``kernel`` forward, the VJP of ``native`` backward."""
    import jax

    @jax.custom_vjp
    def fn(*arrays):
        return kernel(*arrays, interpret=interpret, **static)

    def fwd(*arrays):
        return fn(*arrays), arrays

    def bwd(arrays, cotangent):
        _, vjp = jax.vjp(native, *arrays)
        return vjp(cotangent)

    fn.defvjp(fwd, bwd)
    return fn
