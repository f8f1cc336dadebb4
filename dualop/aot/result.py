"""What one kernel build produced, shared by the TPU and GPU compilers of ``dualop compile``."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["KernelResult", "first_line", "STATUSES"]

# ok: the compiler accepted every kernel; refused: it rejected one (its message); n/a: the op
# declines these inputs on this target (NotImplementedError, the reason), so nothing was built;
# unavailable: this machine cannot run that compiler (why).
STATUSES = ("ok", "refused", "n/a", "unavailable")


@dataclasses.dataclass
class KernelResult:
    status: str
    message: str = ""
    seconds: float = 0.0
    cached: bool = False  # an identical kernel was already compiled for this target in this run
    kernels: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # A sharded layer's compiled program's collectives per kind (``collectives.summarize``: kind,
    # count, result and operand bytes per device, result types); [] for per-chip and GPU builds.
    collectives: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def first_line(err: BaseException) -> str:
    """The line of a compiler's message that says what is wrong, prefixed by the exception type.

    Usually the first non-empty line (with the next one when it ends in a colon, as XLA's
    ``RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:`` does). Triton's CompilationError starts with the source location
    and a quoted source line with a caret under it; its message proper is the line after the caret.
    """
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    for i, ln in enumerate(lines[:-1]):
        if set(ln) == {"^"}:
            text = lines[i + 1]
            break
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
