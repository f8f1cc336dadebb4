"""Reach a Pallas kernel (a JAX function) from every frontend that can hold TPU arrays.

- ``jax``: call it (works under ``jit``, ``vmap``, ``shard_map``).
- ``torch_xla``: ``torch_xla.core.xla_builder.call_jax``; on a TPU this lowers to a Mosaic custom
  call inside the torch_xla graph. It caches the traced computation by the function's identity,
  so kernels are passed as module-level functions and static options as keyword arguments.
- ``torchax``: ``torchax.interop.call_jax`` (torchax tensors wrap jax arrays; no copy).

A plain CPU/CUDA ``torch.Tensor`` has no TPU to run on: the bridge raises NotImplementedError,
which the dispatcher turns into a reported fallback to ``forward_native``.
"""

from __future__ import annotations

from typing import Any, Callable

from dualop.kernels.registry import KernelRef

__all__ = ["call_pallas"]


def call_pallas(frontend: str, kernel_ref: KernelRef, *arrays: Any, native: Callable | None = None, **static: Any) -> Any:
    """Run ``kernel(*arrays, interpret=..., **static)`` on the caller's arrays, returning the
    caller's array type. ``arrays`` may hold None for absent optional inputs.

    ``native(*arrays)`` (the op's forward_native, same outputs) gives JAX callers a gradient:
    Pallas kernels have no autodiff rule, so the kernel runs forward and the backward pass is the
    VJP of the native body (``jax.custom_vjp``).
    """
    if frontend not in ("jax", "torch_xla", "torchax"):
        raise NotImplementedError(
            f"Pallas kernels run on jax arrays, torch_xla tensors or torchax tensors; "
            f"a {frontend} tensor has no TPU bridge"
        )
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
