"""The logits processor on the torch CPU: the vendor matmul (``F.linear``: oneDNN/MKL, float32
accumulation), then the soft cap and scale over the logits it wrote.

The epilogue is elementwise over ``[T, V]`` (V up to 256k), so its cost is passes over memory:
torch's eager ops make one per step (``div_``, ``tanh_``, ``mul_``, plus a float32 copy and a cast
back for 16-bit logits). For logits of ``COMPILED_MIN_ELEMENTS`` and more it runs as one pass
compiled by ``torch.compile`` (Inductor's C++ loop: read, float32 math, one write; measured here
as the fastest CPU form, see the op's report), compiled once per (soft cap, scale) with dynamic
shapes; smaller logits, or a host where compiling fails, take the eager in-place steps. Both
compute ``tanh(l / c) * c`` then ``* scale`` in float32 (``kernels/logits_math``) and round once to
the logits' dtype.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from dualop.kernels.logits_math import LogitsSpec, cap_and_scale

__all__ = ["logits_processor", "COMPILED_MIN_ELEMENTS"]

logger = logging.getLogger(__name__)

# Below this many logits the eager steps cost less than a compiled call's overhead (a decode step
# at a 32000 vocabulary has 16 x 32000 = 512k).
COMPILED_MIN_ELEMENTS = 1 << 16
_compile_failed: list[str] = []
_lock = threading.Lock()


def _epilogue_body(logits: Any, spec: LogitsSpec) -> Any:
    import torch

    from dualop.backends.torch import array_api as xp

    return cap_and_scale(xp, logits.to(torch.float32), spec).to(logits.dtype)


@functools.lru_cache(maxsize=None)
def _compiled_epilogue(spec: LogitsSpec):
    import torch

    return torch.compile(functools.partial(_epilogue_body, spec=spec), dynamic=True, fullgraph=True)


def _eager_epilogue(logits: Any, spec: LogitsSpec) -> Any:
    """In place on float32 logits; 16-bit logits through one float32 copy and one cast back."""
    import torch

    work = logits if logits.dtype == torch.float32 else logits.float()
    if spec.soft_cap is not None:
        work.div_(spec.soft_cap).tanh_()
    factor = spec.scale * (1.0 if spec.soft_cap is None else spec.soft_cap)
    if factor != 1.0:
        work.mul_(factor)
    return work if work is logits else work.to(logits.dtype)


def cap_and_scale_logits(logits: Any, spec: LogitsSpec) -> Any:
    """``spec``'s epilogue on torch CPU ``logits`` (the compiled pass or the eager steps)."""
    if logits.numel() >= COMPILED_MIN_ELEMENTS and not _compile_failed:
        try:
            return _compiled_epilogue(spec)(logits)
        except Exception as err:  # no working C++ toolchain for Inductor here: eager from now on
            with _lock:
                _compile_failed.append(f"{type(err).__name__}: {err}")
            logger.warning("dualop logits_processor: torch.compile of the CPU epilogue failed (%s); "
                           "using eager in-place ops", _compile_failed[0].splitlines()[0])
    return _eager_epilogue(logits, spec)


def logits_processor(weight: Any, hidden: Any, bias: Any = None, *, spec: LogitsSpec = LogitsSpec(),
                     rows: int | None = None) -> Any:
    """``[..., rows]`` logits of ``hidden`` against the first ``rows`` rows of ``weight`` (default
    all), plus ``bias[:rows]``, with ``spec``'s epilogue."""
    import torch.nn.functional as F

    rows = weight.shape[0] if rows is None else rows
    logits = F.linear(hidden, weight[:rows], None if bias is None else bias[:rows])
    return cap_and_scale_logits(logits, spec) if spec.has_epilogue else logits
