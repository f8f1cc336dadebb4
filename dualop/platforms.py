"""Which frontend an array belongs to, and which platform that frontend runs on.

This is the one platform detector. It never imports torch or jax itself: it looks only at modules
the caller has already imported (``sys.modules``), so ``import dualop`` stays light and a JAX-only
process never touches torch.

Frontends (how the caller holds its arrays):
  ``torch``      plain ``torch.Tensor`` (CPU, CUDA, ROCm, XPU)
  ``torch_xla``  ``torch.Tensor`` on a torch_xla device
  ``torchax``    ``torchax.tensor.Tensor`` (torch API over jax arrays)
  ``jax``        ``jax.Array`` (and its tracers under jit/vmap/grad)

Platforms: ``cpu``, ``cuda``, ``rocm``, ``tpu``, ``xpu``, ``oot``. ``DUALOP_PLATFORM`` overrides the
platform for every frontend; that is how the tests reach every (frontend, platform) cell on a
machine without accelerators.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

__all__ = [
    "PLATFORMS",
    "FRONTENDS",
    "ENV_PLATFORM",
    "current_platform",
    "frontend_of",
    "family_of",
    "override_platform",
    "dispatch_generation",
]

PLATFORMS = ("cpu", "cuda", "rocm", "tpu", "xpu", "oot")
FRONTENDS = ("torch", "torch_xla", "torchax", "jax")
ENV_PLATFORM = "DUALOP_PLATFORM"

# Bumped whenever something that dispatch depends on (platform override, OOT registry, plugins)
# changes; every op instance keys its dispatch cache on it, so stale resolutions are never used.
_generation = 0
_platform_cache: dict[str, str] = {}
_override: list[str] = []  # stack for override_platform()


def dispatch_generation() -> int:
    return _generation


_listeners: list = []  # called with the new generation (custom_op mirrors it in a module global)


def add_invalidation_listener(fn) -> None:
    """Call ``fn(generation)`` after every ``invalidate()``."""
    _listeners.append(fn)


def invalidate() -> None:
    """Forget cached platforms and every op's cached dispatch."""
    global _generation
    _generation += 1
    _platform_cache.clear()
    for fn in _listeners:
        fn(_generation)


def family_of(frontend: str) -> str:
    """``torch`` for the torch-API frontends, ``jax`` for jax."""
    return "jax" if frontend == "jax" else "torch"


# --- frontend of an array ---------------------------------------------------------------------

_frontend_by_type: dict[type, str | None] = {}


def _classify(x: Any) -> str | None:
    tp = type(x)
    mod = sys.modules.get("torchax.tensor")  # None when absent (or blocked)
    torchax_tensor = getattr(mod, "Tensor", None) if mod is not None else None
    if torchax_tensor is not None and issubclass(tp, torchax_tensor):
        return "torchax"
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(tp, torch.Tensor):
        return "torch"
    jax = sys.modules.get("jax")
    # isinstance, not issubclass: jax tracers are jax.Arrays only through an instance check.
    if jax is not None and isinstance(x, jax.Array):
        return "jax"
    return None


def frontend_of(x: Any) -> str | None:
    """The frontend of one array, or None if ``x`` is not an array of a known frontend."""
    tp = type(x)
    try:
        fe = _frontend_by_type[tp]
    except KeyError:
        fe = _frontend_by_type[tp] = _classify(x)
    if fe == "torch" and sys.modules.get("torch_xla") is not None and x.device.type == "xla":
        return "torch_xla"
    return fe


def frontend_depends_on_device(tp: type) -> bool:
    """True for ``torch.Tensor`` once torch_xla is loaded: its frontend is torch or torch_xla by device."""
    return _frontend_by_type.get(tp) == "torch" and sys.modules.get("torch_xla") is not None


# --- platform of a frontend -------------------------------------------------------------------


def _env_override() -> str | None:
    if _override:
        return _override[-1]
    raw = os.environ.get(ENV_PLATFORM, "").strip().lower()
    if not raw:
        return None
    if raw == "hip":
        raw = "rocm"
    if raw not in PLATFORMS:
        raise ValueError(f"{ENV_PLATFORM}={raw!r} is not a platform; expected one of {PLATFORMS}")
    return raw


def _plugin_platform() -> str | None:
    from dualop import plugins

    return plugins.platform_from_plugins()


def _detect_torch() -> str:
    import torch  # the caller holds torch tensors, so torch is already imported

    if getattr(torch.version, "hip", None):
        return "rocm"
    if torch.cuda.is_available():
        return "cuda"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    if sys.modules.get("torch_xla") is not None:
        return _detect_torch_xla()
    return "cpu"


def _detect_torch_xla() -> str:
    import torch_xla
    import torch_xla.core.xla_model as xm

    try:
        device = torch_xla.device() if hasattr(torch_xla, "device") else xm.xla_device()
        kind = xm.xla_device_hw(device)
    except Exception:  # no XLA device could be opened
        return "cpu"
    return {"TPU": "tpu", "CUDA": "cuda", "GPU": "cuda", "ROCM": "rocm", "NEURON": "oot"}.get(
        str(kind).upper(), "cpu"
    )


def _detect_jax() -> str:
    import jax

    backend = jax.default_backend()
    if backend == "gpu":
        try:
            platform_version = jax.devices()[0].client.platform_version.lower()
        except Exception:
            platform_version = ""
        return "rocm" if "rocm" in platform_version else "cuda"
    if backend in ("cuda", "rocm", "tpu", "cpu"):
        return backend
    return "oot"


_DETECTORS = {
    "torch": _detect_torch,
    "torch_xla": _detect_torch_xla,
    # torchax runs torch code on jax arrays: its platform is jax's.
    "torchax": _detect_jax,
    "jax": _detect_jax,
}


def current_platform(frontend: str = "torch") -> str:
    """The platform ``frontend`` runs on: one of ``cpu cuda rocm tpu xpu oot``.

    Order: ``DUALOP_PLATFORM`` (or an active ``override_platform``), then a platform plugin,
    then the frontend's own devices.
    """
    if frontend not in _DETECTORS:
        raise ValueError(f"current_platform: unknown frontend {frontend!r}; expected one of {FRONTENDS}")
    forced = _env_override()
    if forced is not None:
        return forced
    try:
        return _platform_cache[frontend]
    except KeyError:
        pass
    platform = _plugin_platform() or _DETECTORS[frontend]()
    _platform_cache[frontend] = platform
    return platform


@contextlib.contextmanager
def override_platform(platform: str) -> Iterator[str]:
    """Take ``platform``'s path for every frontend inside a ``with`` block (tests, simulation)."""
    if platform not in PLATFORMS:
        raise ValueError(f"override_platform: {platform!r} is not one of {PLATFORMS}")
    _override.append(platform)
    invalidate()
    try:
        yield platform
    finally:
        _override.pop()
        invalidate()
