"""The logits processor's epilogue, one statement for every path: ``LogitsSpec`` (soft cap and
scale, hashable so kernels take it as a static argument) and ``cap_and_scale``, the float32 formula
the native body and the Pallas kernel apply after the matmul (the Triton kernel and the torch CPU
path write the same steps in their own languages: ``l / c``, ``tanh``, ``* c``, then ``* scale``)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["LogitsSpec", "cap_and_scale"]


@dataclasses.dataclass(frozen=True)
class LogitsSpec:
    """``soft_cap``: None, or c > 0 for ``tanh(l / c) * c``; ``scale``: the final multiplier."""

    soft_cap: float | None = None
    scale: float = 1.0

    @property
    def has_epilogue(self) -> bool:
        """Whether anything follows the matmul (else the logits are the plain matmul)."""
        return self.soft_cap is not None or self.scale != 1.0


def cap_and_scale(xp: Any, logits: Any, spec: LogitsSpec) -> Any:
    """``tanh(logits / c) * c`` when soft-capped, then ``* scale`` (the engine's order), on float32
    ``logits``; returns float32."""
    if spec.soft_cap is not None:
        logits = xp.tanh(logits / spec.soft_cap) * spec.soft_cap
    if spec.scale != 1.0:
        logits = logits * spec.scale
    return logits
