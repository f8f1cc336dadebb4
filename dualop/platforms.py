"""Which frontend an array belongs to, and which platform that frontend runs on.

This is the one platform detector. It never imports torch or jax itself: it looks only at modules
the caller has already imported (``sys.modules``), so ``import dualop`` stays light and a JAX-only
process never touches torch.

Frontends (how the caller holds its arrays):
  ``torch``      plain ``torch.Tensor`` (CPU, CUDA, ROCm, XPU)
  ``torch_xla``  ``torch.Tensor`` on a torch_xla device (``xla``)
  ``torch_tpu``  ``torch.Tensor`` on PyTorch's native TPU device (``tpu``, the torch_tpu package)
  ``torchax``    ``torchax.tensor.Tensor`` (torch API over jax arrays)
  ``jax``        ``jax.Array`` (and its tracers under jit/vmap/grad)

Platforms: ``cpu``, ``cuda``, ``rocm``, ``tpu``, ``xpu``, ``oot``. The platform of one array
(``platform_of``) is, in order: ``DUALOP_PLATFORM`` (or ``override_platform``), a platform plugin,
then the array itself: a torch tensor's device (a CPU tensor on a CUDA host is ``cpu``), the XLA
device's kind for torch_xla, ``tpu`` for torch_tpu, jax's default backend for jax and torchax.
``current_platform(frontend)`` is the process-wide answer (what a new torch tensor's default device
would be). ``DUALOP_PLATFORM`` is how the tests reach every (frontend, platform) cell on a machine
without accelerators.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import operator
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "PLATFORMS",
    "FRONTENDS",
    "ENV_PLATFORM",
    "current_platform",
    "platform_of",
    "frontend_of",
    "frontend_depends_on_device",
    "device_probe",
    "reuse_guard",
    "family_of",
    "override_platform",
    "dispatch_generation",
]

PLATFORMS = ("cpu", "cuda", "rocm", "tpu", "xpu", "oot")
FRONTENDS = ("torch", "torch_xla", "torch_tpu", "torchax", "jax")
ENV_PLATFORM = "DUALOP_PLATFORM"

# Bumped whenever something that dispatch depends on (platform override, OOT registry, plugins)
# changes; every op instance keys its dispatch cache on it, so stale resolutions are never used.
_generation = 0
_platform_cache: dict[str, Any] = {}  # frontend -> platform, and a few memoised host facts
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


# torch device types that make a torch.Tensor another frontend's (the bridges differ). "jax" is torchax
# tensors that are not torchax.tensor.Tensor instances: the views torchax hands out for slices.
_FRONTEND_OF_DEVICE = {"xla": "torch_xla", "tpu": "torch_tpu", "jax": "torchax"}


def frontend_of(x: Any) -> str | None:
    """The frontend of one array, or None if ``x`` is not an array of a known frontend."""
    tp = type(x)
    try:
        fe = _frontend_by_type[tp]
    except KeyError:
        fe = _frontend_by_type[tp] = _classify(x)
    # CPU tensors answer from one C attribute read, CUDA tensors from two; only other devices pay
    # for ``x.device.type`` (a few hundred ns).
    if fe == "torch" and not (x.is_cpu or x.is_cuda):
        return _FRONTEND_OF_DEVICE.get(x.device.type, "torch")
    return fe


def frontend_depends_on_device(frontend: str) -> bool:
    """True for the frontends whose tensors carry a torch device: their frontend and platform
    follow that device, so a cached dispatch is valid only for tensors on the same device type."""
    return frontend in ("torch", "torch_xla", "torch_tpu")


# Device types torch gives a C-level ``Tensor.is_<type>`` flag (a 40-80 ns read; ``x.device.type``
# costs several times that).
_DEVICE_PROBES: dict[str, Callable[[Any], bool]] = {
    name: operator.attrgetter(f"is_{name}") for name in ("cpu", "cuda", "xpu", "xla", "meta", "mps")
}


def device_probe(x: Any) -> Callable[[Any], bool] | None:
    """A cheap test true exactly for torch tensors on ``x``'s device type (``Tensor.is_cuda``, ...),
    or None when that device type has no such flag (torch_tpu's ``tpu``)."""
    if x.is_cpu:
        return _DEVICE_PROBES["cpu"]
    if x.is_cuda:
        return _DEVICE_PROBES["cuda"]
    return _DEVICE_PROBES.get(x.device.type)


def reuse_guard(x: Any, frontend: str) -> tuple[bool, Callable[[Any], bool] | None]:
    """May a dispatch resolved for ``x`` be reused for later arrays of the same type, and which
    check must they pass (None: none)? The dispatcher's fast path keys on the array type; a torch
    tensor's frontend and platform also follow its device type, so where devices can differ the
    fast path checks a ``device_probe`` too, and is not armed for a device type without one.
    Where every plain tensor dispatches as a CPU tensor does (no GPU, no XPU, torch_xla not
    imported, no TPU for torch_tpu) the type alone decides, at no extra cost; tensor subclasses
    (fake tensors, which may claim any device) are always checked."""
    if not frontend_depends_on_device(frontend):
        return True, None
    torch = sys.modules["torch"]
    if type(x) in (torch.Tensor, torch.nn.Parameter) and not _torch_devices_vary():
        return True, None
    probe = device_probe(x)
    return probe is not None, probe


def _torch_devices_vary() -> bool:
    """Whether this process can hold torch tensors whose dispatch differs from a CPU tensor's.
    Memoised until ``invalidate()``."""
    try:
        return _platform_cache["torch:devices vary"]
    except KeyError:
        pass
    torch = sys.modules["torch"]
    xpu = getattr(torch, "xpu", None)
    vary = bool(
        getattr(torch.version, "hip", None)
        or torch.cuda.is_available()
        or (xpu is not None and xpu.is_available())
        or sys.modules.get("torch_xla") is not None
        or torch._C._get_privateuse1_backend_name() == "tpu"  # torch_tpu found a TPU
        or (_installed("torch_tpu") and tpu_attached())
    )
    if not vary and _installed("torch_xla"):
        _watch_import("torch_xla")  # XLA tensors can appear once it is imported
    _platform_cache["torch:devices vary"] = vary
    return vary


@functools.lru_cache(maxsize=None)
def _installed(name: str) -> bool:
    """Whether ``name`` is importable (asked once per process)."""
    return sys.modules.get(name) is not None or importlib.util.find_spec(name) is not None


class _ImportWatch(importlib.abc.MetaPathFinder):
    """Calls ``invalidate()`` whenever the import system looks for a watched top-level module (it
    finds nothing itself), so fast paths armed before, e.g., torch_xla was imported are re-resolved
    before any XLA tensor can reach them. It costs nothing per dispatch; a stray lookup (an
    availability probe) only costs one re-resolution per op."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname in self.names:
            invalidate()
        return None


_import_watch = _ImportWatch()


def _watch_import(name: str) -> None:
    """Invalidate dispatch when ``name`` is imported (see ``_ImportWatch``)."""
    _import_watch.names.add(name)
    if _import_watch not in sys.meta_path:
        sys.meta_path.insert(0, _import_watch)


def tpu_attached() -> bool:
    """Whether this machine has TPU chips (their device files), without initialising any runtime."""
    import glob

    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def keep_tpu_runtimes_off_without_tpu() -> None:
    """On a host with no TPU, keep torch_tpu and libtpu (the ``torch-tpu`` and ``tpu`` extras) from
    starting where nobody asked for them. Each variable is set only if the caller has not set it:

    - ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` when torch_tpu is installed and torch not yet imported:
      otherwise every ``import torch`` loads torch_tpu (seconds, a tcmalloc warning, absl log
      lines, and an import of triton before ``TRITON_INTERPRET`` can be chosen); dualop imports
      torch_tpu itself when a ``tpu`` tensor appears.
    - ``TPU_SKIP_MDS_QUERY=1``: a loaded libtpu otherwise retries a cloud metadata server for minutes.
    - ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``: libtpu's host-wide lock is for sharing a real TPU; compile-only
      use (``dualop compile``, the tests) may load it in several processes.
    - ``JAX_PLATFORMS=cpu`` when libtpu is installed and no jax GPU plugin is: otherwise every jax
      start logs libtpu's failed TPU initialisation (``TPU_WORKER_HOSTNAMES``). Compile-only
      topology devices work either way. If jax was imported first (it has read its environment)
      but has started no backend, its ``jax_platforms`` setting is set to ``cpu`` instead, unless set.

    Runs when dualop is imported (the end of this module), so ``import dualop`` before torch or
    jax keeps a script quiet; the ``dualop`` command and the test suite call it again, harmlessly.
    """
    if tpu_attached():
        return
    if "torch" not in sys.modules and _installed("torch_tpu"):
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if "JAX_PLATFORMS" in os.environ or not _installed("libtpu"):
        return
    gpu_plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")
    if any(_installed(name) for name in gpu_plugins):
        return
    jax = sys.modules.get("jax")
    if jax is None:
        os.environ["JAX_PLATFORMS"] = "cpu"
        return
    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # a jax without this probe: leave it as it is
        return
    if not started and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")


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


def _detect_torch_tpu() -> str:
    return "tpu"  # torch_tpu's device is a TPU; its tensors reach the Pallas kernels via jax_op


def _cuda_platform() -> str:
    """``rocm`` on a ROCm build of torch (its GPUs are ``cuda`` devices), else ``cuda``."""
    torch = sys.modules["torch"]
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def _torch_device_platform(x: Any) -> str:
    """The platform of a plain torch tensor's device. Devices dualop has no kernels for (meta,
    mps, ...) take the CPU path, whose kernels take CPU tensors only and otherwise run the
    native body."""
    if x.is_cpu:
        return "cpu"
    if x.is_cuda:
        try:
            return _platform_cache["torch:cuda"]
        except KeyError:
            platform = _platform_cache["torch:cuda"] = _cuda_platform()
            return platform
    if x.is_xpu:
        return "xpu"
    return "cpu"


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
    "torch_tpu": _detect_torch_tpu,
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


def platform_of(x: Any, frontend: str | None = None) -> str:
    """The platform one array runs on (``frontend`` is ``frontend_of(x)`` when the caller has it).

    Order: ``DUALOP_PLATFORM`` (or an active ``override_platform``), then a platform plugin, then
    the array: a plain torch tensor's device (CPU -> ``cpu``, CUDA -> ``cuda`` or ``rocm``, XPU ->
    ``xpu``), otherwise its frontend's platform (``current_platform``).
    """
    if frontend is None:
        frontend = frontend_of(x)
    if frontend != "torch":
        return current_platform(frontend)
    forced = _env_override()
    if forced is not None:
        return forced
    try:
        plugin = _platform_cache["plugin"]
    except KeyError:
        plugin = _platform_cache["plugin"] = _plugin_platform()
    return plugin if plugin is not None else _torch_device_platform(x)


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


keep_tpu_runtimes_off_without_tpu()  # see its docstring: quiet imports on a host with no TPU
