"""Frontend backends: the array namespace each frontend gives to frontend-neutral op bodies, and
the bridges that carry a caller's arrays to a kernel written for the other world.

``backends/torch``: torch namespace, Triton launch.
``backends/xla``:   jax namespace, Pallas launch from JAX, torch_xla and torchax bridges.

Nothing here imports torch or jax until an array of that frontend is seen.
"""

from __future__ import annotations

from typing import Any

from dualop.platforms import family_of, frontend_of

__all__ = ["array_namespace"]


def array_namespace(x: Any):
    """The array namespace (``xp``) for ``x``'s frontend: torch's for torch tensors of any device
    (including torch_xla and torchax tensors), jax's for ``jax.Array``s and tracers."""
    fe = frontend_of(x)
    if fe is None:
        raise TypeError(
            f"dualop: expected a torch.Tensor or jax.Array, got {type(x).__module__}.{type(x).__qualname__}"
        )
    if family_of(fe) == "jax":
        from dualop.backends.xla import array_api
    else:
        from dualop.backends.torch import array_api
    return array_api
