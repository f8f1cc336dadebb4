"""dualop's CPU kernels: C++ row loops (``csrc/``) built once per machine and called with ctypes.

Why hand-written: on the CPU the reference-engine ops are memory-bound row loops, and torch's eager
ops make several passes over memory (one per elementwise op), while ``torch.compile`` of the same
body reaches only about half the copy bandwidth in bfloat16 (see docs/BENCHMARKS.md). These kernels
read each input once and write each output once, a row staying in cache between its statistic and
its output, with OpenMP over rows and GCC-vectorised bodies.

Each C entry point is declared once, as its C prototype, in the kernel module that calls it
(``abi.c_function``); the build force-includes those declarations into every source, so a
definition that differs fails to compile, and the Python side calls the function by parameter name.
Arrays arrive as one ``DualopArray`` each (data, dtype, shape, strides; ``csrc/common.h``), from
which an entry point reads its sizes and which it checks before touching an element. Every ``csrc/*.cc`` is built: a new kernel adds its ``.cc`` and its module, nothing here.

The library is compiled on first use with the system C++ compiler (``$CXX``, else ``g++``/``c++``),
for the host CPU (``-march=native``), into ``$DUALOP_CACHE_DIR`` (default ``~/.cache/dualop``),
keyed by a hash of the sources, the flags, the compiler and the CPU; a build says so on stderr
(``BUILD_MESSAGE``), a cached library loads silently. OpenMP comes from the
``libgomp`` torch already loaded. Without a compiler, ``load()`` raises ``KernelUnavailable`` and
the ops' CPU paths fall back to their native bodies (the dispatch report says why).
``DUALOP_CPU_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from dualop.kernels.cpu import abi

__all__ = ["BUILD_MESSAGE", "KernelUnavailable", "build_library", "load", "library_path", "compile_command",
           "DTYPE_CODES"]

_CSRC = Path(__file__).parent / "csrc"
# -fno-trapping-math lets GCC if-convert (and so vectorise) the branch-free selects; results are
# unchanged (it only assumes no floating-point trap handler is installed). No -ffast-math: NaN,
# infinities and rounding behave as in torch.
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++20",
          "-fPIC", "-shared")
# The floating dtypes the kernels compute in (float32, bfloat16, float16), with their array codes.
DTYPE_CODES = {name: code for name, code in abi.DTYPE_CODES.items() if "float" in name}

# Printed to stderr when (and only when) a build starts: not when the library is already cached.
BUILD_MESSAGE = "dualop: building the C++ CPU kernels (first use, about 10 s)..."

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None


class KernelUnavailable(NotImplementedError):
    """The CPU kernels cannot be built or loaded here (reason in the message)."""


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sources() -> list[Path]:
    return sorted(_CSRC.glob("*.cc"))


def library_path(compiler: str) -> Path:
    """Where the library for these sources, declarations, flags, compiler and CPU lives."""
    digest = hashlib.sha256()
    for path in (*sorted(_CSRC.glob("*.h")), *_sources()):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    for part in (abi.header_text(), " ".join(_FLAGS), compiler, version, _cpu_model()):
        digest.update(part.encode())
    root = Path(os.environ.get("DUALOP_CACHE_DIR") or Path.home() / ".cache" / "dualop")
    return root / "cpu_kernels" / f"dualop_cpu_{digest.hexdigest()[:16]}.so"


def compile_command(compiler: str, sources: list[Path], header: Path, out: Path) -> list[str]:
    """The compiler's command line: every source with the declarations header force-included (it
    includes ``csrc/common.h``, found by ``-I``)."""
    return [compiler, *_FLAGS, "-I", str(_CSRC), "-include", str(header), *(str(src) for src in sources), "-o",
            str(out)]


def build_library(target: Path, command: Callable[[Path, Path], list[str]], message: str, what: str) -> None:
    """Compile a library into ``target`` once per machine, whichever process gets the lock first:
    ``command(header, out)`` is the compiler's command line, given the declarations header
    (``abi.header_text()``, written beside it) and where to write; ``message`` goes to stderr when
    a build starts (the one slow first call), and a failed build raises ``KernelUnavailable``
    naming ``what`` and the compiler's last words."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return
        print(message, file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            header = Path(tmp) / "dualop_api.h"
            header.write_text(abi.header_text())
            out = Path(tmp) / target.name
            cmd = command(header, out)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise KernelUnavailable(f"building {what} failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
            os.replace(out, target)


def _build(compiler: str, target: Path) -> None:
    build_library(target, lambda header, out: compile_command(compiler, _sources(), header, out), BUILD_MESSAGE,
                  "dualop's CPU kernels")


def load() -> ctypes.CDLL:
    """The CPU kernel library, built on first use; raises KernelUnavailable if it cannot be."""
    global _library, _failure
    if _library is not None:
        return _library
    if os.environ.get("DUALOP_CPU_KERNELS", "1") == "0":
        raise KernelUnavailable("DUALOP_CPU_KERNELS=0")
    with _lock:
        if _library is None and _failure is None:
            compiler = _compiler()
            try:
                if compiler is None:
                    raise KernelUnavailable("no C++ compiler found (set CXX, or install g++)")
                import torch  # noqa: F401  (its libgomp must be loaded before ours resolves it)

                target = library_path(compiler)
                if not target.exists():
                    _build(compiler, target)
                _library = ctypes.CDLL(str(target))
            except (KernelUnavailable, OSError) as err:
                _failure = str(err)
        if _library is None:
            raise KernelUnavailable(_failure)
    return _library
