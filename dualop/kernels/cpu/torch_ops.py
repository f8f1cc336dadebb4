"""torch operators in front of the hottest CPU kernels (``csrc/torch/ops.cc``, namespace ``dualop_cpu``).

Why: an op's eager call on a few tokens (a decode step's norm or rope) costs its kernel plus the
Python around it, and a ctypes call alone packs each array and converts each argument (about 6 µs,
more than the kernel at 16 tokens). A torch operator takes the tensors as they are (about 1.3 µs
through ``torch.ops``) and does the cheap structural tests in C++, so the op's Python path (its
checks and the ctypes wrapper) runs only for calls the operator does not take. Each operator
returns undefined tensors (``None``) for those, having touched nothing; see ``ops.cc``.

The library is compiled on first use against the running torch's headers (only
``torch/library.h`` and ATen's core, a few seconds), linked to the kernel library
(``dualop.kernels.cpu.load``), into ``$DUALOP_CACHE_DIR`` keyed by the sources, the flags, the
compiler, the CPU, the kernel library and torch's version and location. ``DUALOP_CPU_TORCH_OPS=0``
(or ``DUALOP_CPU_KERNELS=0``) turns the operators off: the ops then take their Python path. Without
them nothing is lost but speed; why they are missing is ``unavailable_reason()``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from dualop.kernels.cpu import KernelUnavailable, _CSRC, _compiler, _cpu_model, abi, build_library, load

__all__ = ["TorchOperator", "BUILD_MESSAGE", "library_path", "unavailable_reason"]

_SOURCE = _CSRC / "torch" / "ops.cc"
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-std=c++20", "-fPIC", "-shared")
BUILD_MESSAGE = "dualop: building the torch operators of the CPU kernels (first use with this torch, a few seconds)..."

_lock = threading.Lock()
_loaded = False
_failure: str | None = None


def _torch_dirs() -> tuple[Path, Path]:
    import torch

    root = Path(torch.__file__).parent
    return root / "include", root / "lib"


def library_path(compiler: str, kernels: Path) -> Path:
    """Where the operator library for these sources, this torch and this kernel library lives."""
    import torch

    digest = hashlib.sha256()
    for path in (_SOURCE, _CSRC / "common.h"):
        digest.update(path.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    include, _ = _torch_dirs()
    for part in (abi.header_text(), " ".join(_FLAGS), compiler, version, _cpu_model(), str(kernels),
                 torch.__version__, str(include), str(int(torch._C._GLIBCXX_USE_CXX11_ABI))):
        digest.update(part.encode())
    return kernels.parent.parent / "torch_ops" / f"dualop_cpu_torch_{digest.hexdigest()[:16]}.so"


def compile_command(compiler: str, header: Path, kernels: Path, out: Path) -> list[str]:
    """The compiler's command line: ``ops.cc`` with the kernels' declarations force-included,
    against torch's headers, linked to the kernel library and to torch's ``c10``/``torch_cpu``."""
    import torch

    include, lib = _torch_dirs()
    return [compiler, *_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            "-I", str(include), "-I", str(_CSRC), "-include", str(header), str(_SOURCE), str(kernels),
            f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", f"-Wl,-rpath,{kernels.parent}", "-o", str(out)]


def _load() -> bool:
    """Build (once per machine) and load the operator library; False, with the reason kept, if it cannot be."""
    global _loaded, _failure
    if _loaded or _failure is not None:
        return _loaded
    with _lock:
        if _loaded or _failure is not None:
            return _loaded
        if os.environ.get("DUALOP_CPU_TORCH_OPS", "1") == "0":
            _failure = "DUALOP_CPU_TORCH_OPS=0"
            return False
        try:
            kernels = Path(load()._name)
            compiler = _compiler()
            if compiler is None:
                raise KernelUnavailable("no C++ compiler found (set CXX, or install g++)")
            target = library_path(compiler, kernels)
            if not target.exists():
                build_library(target, lambda header, out: compile_command(compiler, header, kernels, out),
                              BUILD_MESSAGE, "dualop's torch operators")
            import torch

            torch.ops.load_library(str(target))
            _loaded = True
        except (KernelUnavailable, OSError, RuntimeError) as err:
            _failure = str(err)
    return _loaded


def unavailable_reason() -> str | None:
    """Why the operators cannot be used here (building them if not tried yet), or None."""
    _load()
    return _failure


class TorchOperator:
    """One operator of the ``dualop_cpu`` library, as the ops call it: ``op`` is its
    ``OpOverload`` once ``get()`` loaded the library, and ``get()`` returns it, or None where the
    library cannot be built (then the op's Python path serves every call)."""

    __slots__ = ("name", "op", "_call")

    def __init__(self, name: str) -> None:
        self.name = name
        self.op: Any = None
        self._call: Any = None

    def get(self) -> Any:
        if self.op is None and _load():
            import torch

            self.op = getattr(torch.ops.dualop_cpu, self.name).default
            # the overload's C++ callable itself: OpOverload.__call__ is one more Python frame
            # (about 0.2 µs a call) around it
            self._call = getattr(self.op, "_op", self.op)
        return self.op

    def take(self, *args: Any) -> Any:
        """The operator's answer to a call: its result (undefined tensors, ``None``, where it
        declined), or None where the library cannot be built here or torch refuses an argument
        before the operator runs (not a tensor: the op's own checks then name it)."""
        call = self._call
        if call is None:
            if self.get() is None:
                return None
            call = self._call
        try:
            return call(*args)
        except (RuntimeError, TypeError):
            return None
