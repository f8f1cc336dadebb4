"""Frontend-neutral op definitions, one module per family (its op classes, native bodies, platform
methods and spec). Importing this package imports every module in it, which registers its ops, and
re-exports each module's ``__all__``: a new op module needs no line here. It imports no torch or jax.

Module names follow the reference serving engine's where it has one (``layernorm.py`` holds its
RMS norms, as the engine's ``layernorm.py`` does; ``activation.py`` its gated activations)."""

from __future__ import annotations

import importlib
import pkgutil

__all__: list[str] = []

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
    if _info.name.startswith("_"):
        continue  # shared helpers (_checks, _mixer), no ops of their own to export
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    for _name in getattr(_module, "__all__", ()):
        globals()[_name] = getattr(_module, _name)
        __all__.append(_name)

# Ops that hold no parameters (class attribute ``parameterless``): the layer modules wrap each as it
# is (dualop.torch/jax.layers).
PARAMETERLESS_OPS = tuple(dict.fromkeys(
    obj for obj in (globals()[name] for name in __all__)
    if isinstance(obj, type) and getattr(obj, "parameterless", False)))

del _info, _module, _name
