"""Lazy references to kernel functions, so op modules can name kernels without importing jax,
triton or torch until a call actually takes that path."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(eq=False)
class KernelRef:
    """``module:function`` of a kernel; ``resolve()`` imports it once and returns the function.

    The resolved function is the module-level object itself (torch_xla's ``call_jax`` caches
    compilations by function identity, so it must be stable).
    """

    module: str
    function: str
    _fn: Callable | None = field(default=None, repr=False)

    def resolve(self) -> Callable:
        if self._fn is None:
            try:
                mod = importlib.import_module(self.module)
            except ImportError as err:
                raise NotImplementedError(
                    f"kernel {self.module}.{self.function} cannot be imported ({err}); "
                    "install the extra for this platform (dualop[jax] for Pallas, dualop[triton] for Triton)"
                ) from err
            self._fn = getattr(mod, self.function)
        return self._fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)
