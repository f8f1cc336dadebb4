"""Make the C allocator keep and reuse freed memory, so a benchmark times kernels, not page faults.

Why: glibc serves every allocation above its mmap threshold (128 KiB at first, at most 32 MiB)
with a fresh ``mmap`` and gives it back with ``munmap`` on free. A fresh 64 MB output then costs
16,384 first-touch page faults, about 30 ms on the development VM, six times the copy itself: every
implementation that returns a new array (every op here) is fault-bound and the numbers say nothing
about the kernels. Serving engines avoid this by running on tcmalloc or jemalloc (the reference
engine's CPU docs preload one with ``LD_PRELOAD``), which keep freed memory for reuse.

What: three ``mallopt`` calls give glibc the same behaviour in-process. ``M_MMAP_MAX = 0`` serves
large blocks from the heap instead of ``mmap``; ``M_TRIM_THRESHOLD = 2**31 - 1`` never returns the
heap's free top to the kernel; ``M_ARENA_MAX = 1`` puts every thread on that one heap, since a
thread's own arena still maps any block above its 64 MiB heap size afresh (XLA allocates its
outputs on its worker threads: without this, a jax output of 64 MB faults on every call). A freed
block is then reused by the next allocation of its size without faulting, once the heap has grown
to the working set (the bench's warm-up rounds). It applies to the whole process, for torch, XLA and
numpy alike, which is what a benchmark that compares them needs, and cannot be undone. Call it
before torch or jax start their thread pools: a thread that already has its own arena keeps it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["reuse_freed_memory", "ALLOCATOR_REUSE", "ALLOCATOR_SYSTEM"]

# The ``allocator`` field of bench records.
ALLOCATOR_REUSE = "glibc-reuse"
ALLOCATOR_SYSTEM = "system"

# <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_NEVER_TRIM = 2**31 - 1


def reuse_freed_memory() -> bool:
    """Set glibc's malloc to keep and reuse freed blocks (see the module docstring).

    Returns True when all three options were set; False on a platform whose C library is not glibc
    (macOS, musl, Windows), where nothing is changed and allocations keep their platform's default
    behaviour. Idempotent.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on error
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM))
    return all([bool(mallopt(param, value)) for param, value in settings])
