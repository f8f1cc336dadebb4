"""Every registered op as a ``torch.library`` custom op, for ``torch.compile`` and ``opcheck``.

``dualop::<name>(Tensor? a0, ..., Tensor? a5, float[] scalars, str spec) -> Tensor[]``: ``spec`` is
the op's class and constructor arguments as JSON; the call's arguments go by position, a tensor or
None in ``a<i>`` and a Python number in ``scalars[i]`` (NaN where the argument is not a number;
custom-op schemas have no optional floats in lists). Tensors are separate arguments, not a list,
so autograd sees them. The real kernel builds (and
caches) the op and runs its ordinary eager dispatch (config, platform path, fallbacks); the fake
kernel runs ``forward_native`` on fake tensors; autograd differentiates ``forward_native``.

Under ``torch.compile`` a CustomOp call is traced here instead of through the eager dispatcher
(whose context-variable config Dynamo cannot trace): when the op is enabled under the config
active at trace time, the graph holds the opaque custom op; otherwise it holds ``forward_native``,
which Inductor fuses (the reference engine's rule for ``custom_ops=["none"]`` under Inductor).
The config is read once, at trace time: a compiled graph does not follow later config changes.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
from typing import Any, Optional, Sequence

import torch

from dualop.config import get_config
from dualop.custom_op import CustomOp

__all__ = ["library_op", "compiled_call", "library_args"]

_NAMESPACE = "dualop"
_NOT_A_NUMBER = float("nan")


try:  # a plain function that Dynamo treats as True while it traces (cheaper than torch.compiler's)
    from torch._dynamo.external_utils import is_compiling
except ImportError:  # pragma: no cover - older torch
    is_compiling = torch.compiler.is_compiling


def trace_as_not_eager(eager: Any) -> None:
    """Have Dynamo trace ``eager()`` (a C builtin that returns True) as False, so the generated
    ``CustomOp.__call__`` leaves its fast path, untraced and unguarded, to ``compiled_call``."""
    from torch._dynamo.decorators import substitute_in_graph

    @substitute_in_graph(eager, skip_signature_check=True)
    def _while_tracing() -> bool:
        return False


@functools.lru_cache(maxsize=None)
def _build(spec: str) -> CustomOp:
    """The op a spec names: its class (``module:qualname``) built with its constructor arguments."""
    path, args, kwargs = json.loads(spec)
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        if part == "<locals>":
            raise ValueError(f"dualop: {path} is defined inside a function; torch.library cannot rebuild it")
        obj = getattr(obj, part)
    return obj(*args, **kwargs)


def _no_alias(outputs, inputs) -> list[torch.Tensor]:
    """Custom-op outputs may not alias inputs: copy any output that shares an input's storage."""
    tensors = [a for a in inputs if isinstance(a, torch.Tensor)]
    return [out.clone() if any(torch._C._is_alias_of(out, a) for a in tensors) else out for out in outputs]


MAX_ARGS = 6


def _call_args(op: CustomOp, args: Sequence[Optional[torch.Tensor]], scalars: Sequence[float]) -> list[Any]:
    n = len(type(op)._call_parameters())
    return [a if a is not None or math.isnan(s) else s for a, s in zip(args[:n], scalars[:n])]


def _as_list(result: Any) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple) else [result]


@functools.lru_cache(maxsize=None)
def library_op(name: str):  # noqa: C901 - one op's real, fake and autograd kernels
    """The ``torch.ops.dualop.<name>`` op for a registered op name (defined on first use)."""
    qualname = f"{_NAMESPACE}::{name}"

    def real(
        a0: Optional[torch.Tensor], a1: Optional[torch.Tensor], a2: Optional[torch.Tensor],
        a3: Optional[torch.Tensor], a4: Optional[torch.Tensor], a5: Optional[torch.Tensor],
        scalars: list[float], spec: str,
    ) -> list[torch.Tensor]:
        op = _build(spec)  # at run time this is an eager call: the ordinary dispatch runs
        args = (a0, a1, a2, a3, a4, a5)
        return _no_alias(_as_list(op(*_call_args(op, args, scalars))), args)

    real.__name__ = name
    custom = torch.library.custom_op(qualname, real, mutates_args=())

    @custom.register_fake
    def _fake(a0, a1, a2, a3, a4, a5, scalars, spec):
        op = _build(spec)
        args = (a0, a1, a2, a3, a4, a5)
        return _no_alias(_as_list(op.forward_native(*_call_args(op, args, scalars))), args)

    def setup_context(ctx, inputs, output):
        *args, scalars, spec = inputs
        ctx.spec, ctx.scalars = spec, scalars
        ctx.present = [a is not None for a in args]
        ctx.save_for_backward(*[a for a in args if a is not None])

    def backward(ctx, grads):
        op = _build(ctx.spec)
        saved = iter(ctx.saved_tensors)
        with torch.enable_grad():
            leaves = [
                next(saved).detach().requires_grad_(True) if present else None for present in ctx.present
            ]
            for t in leaves:
                if t is not None and not t.is_floating_point():
                    t.requires_grad_(False)
            outs = _as_list(op.forward_native(*_call_args(op, leaves, ctx.scalars)))
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            wrt = [t for t in leaves if t is not None and t.requires_grad]
            got = (
                torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                if pairs and wrt else ()
            )
        it = iter(got)
        arg_grads = [next(it) if (t is not None and t.requires_grad) else None for t in leaves]
        return (*arg_grads, None, None)

    custom.register_autograd(backward, setup_context=setup_context)
    return custom


def library_args(op: CustomOp, args: tuple, kwargs: dict) -> tuple[list, list, str]:
    """A CustomOp call's arguments in the custom op's calling convention:
    ``torch.ops.dualop.<name>(*tensors, scalars, spec)``."""
    names = type(op)._call_parameters()
    values = list(args)
    for pname in names[len(values):]:
        values.append(kwargs.get(pname))
    unknown = set(kwargs) - set(names)
    if unknown:
        raise TypeError(f"{type(op).name}: unexpected keyword argument(s) {sorted(unknown)}")
    if len(values) > MAX_ARGS:
        raise TypeError(f"{type(op).name}: torch.library ops take at most {MAX_ARGS} call arguments")
    values += [None] * (MAX_ARGS - len(values))
    tensors = [v if isinstance(v, torch.Tensor) else None for v in values]
    scalars = [_NOT_A_NUMBER if isinstance(v, torch.Tensor) or v is None else float(v) for v in values]
    return tensors, scalars, op._ctor


@torch._dynamo.assume_constant_result
def _enabled_now(name: str, enforce: bool) -> bool:
    """The enabled rule under the config active when Dynamo traces (a constant of the graph)."""
    return enforce or get_config().decide(name or None)[0]


def compiled_call(op: CustomOp, args: tuple, kwargs: dict) -> Any:
    """What a CustomOp call becomes inside ``torch.compile`` (traced by Dynamo).

    An op with no registered name, or whose constructor arguments are not JSON, cannot be rebuilt
    by the custom op; it is traced through forward_native."""
    name = type(op).name
    if name is None or op._ctor is None or not _enabled_now(name, op.enforce_enable):
        return op.forward_native(*args, **kwargs)
    tensors, scalars, spec = library_args(op, args, kwargs)
    out = getattr(getattr(torch.ops, _NAMESPACE), name)(*tensors, scalars, spec)
    return out[0] if len(out) == 1 else tuple(out)
