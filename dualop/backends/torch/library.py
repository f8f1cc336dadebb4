"""Every registered op as a typed ``torch.library`` custom op, for ``torch.compile`` and ``opcheck``.

``torch.ops.dualop.<name>`` takes the op's call arguments, typed from ``forward_native``'s signature,
then ``ctor``, the op's constructor call as a string (``dualop.ctor_spec``). For ``RMSNorm``::

    dualop::rms_norm(Tensor x, Tensor? weight, Tensor? residual, str ctor) -> Tensor[]

The rule (``op_signature``, the one place it lives):

- a parameter: an array (annotated ``Any`` or ``torch.Tensor``, or not annotated) is ``Tensor``, or
  ``Tensor?`` when its default is None; ``bool``/``int``/``float``/``str`` (annotated, or the type
  of its default) are ``bool``/``SymInt``/``float``/``str``, with ``?`` when it may be None.
  Anything else is a ``TypeError`` naming the op and the parameter. Every argument is positional
  and explicit in the schema (keyword-only parameters included), so the graph shows the whole call.
- the output, from the return annotation: an array (or none) is ``Tensor``; ``tuple[A, B]`` is
  ``(Tensor, Tensor)``, an item ``Any | None`` (an output that is None when an optional input is,
  as rotary_embedding's key) ``Tensor?``; a union of an array and tuples (the number of outputs depends on the call,
  as rms_norm's residual does) is ``Tensor[]``, or ``Tensor?[]`` when a tuple has an optional item
  (the linear ops' ``(output, output_bias)``, whose bias is None unless ``skip_bias_add``). One variable-length output rather than an overload
  per output count: the count follows from which optional inputs are given, which only the op's
  body knows, and one schema per op keeps ``torch.ops.dualop.<name>`` the single name for it.

An op that updates arguments in place names them in its class attribute ``mutates_args`` (e.g.
``reshape_and_cache``'s ``("kv_pages",)``); its forward_native must return exactly those arguments.
Each becomes ``Tensor(a!)`` (``Tensor(b!)``, ...) in the schema, the custom op is defined with
``mutates_args`` and returns nothing (``-> ()``: a custom op's outputs may not alias its inputs), and
a compiled call returns the mutated argument(s) as the eager call does. It gets no autograd formula
(an in-place cache write has no gradient).

An op that returns outputs AND updates a state argument in place when one is given (the
state-space ops: ``(y, conv_state)``, a fresh state when none is given) also names, in
``mutated_results``, what each item of its result is: None for an output, or the mutated argument
it returns. Its schema returns one ``Tensor`` per result item (functionalization takes no list
output from a mutating op): an output, or for a state item the state the call created (its argument
was None) or an empty placeholder (it was given and updated in place; a custom op's outputs may not
alias its inputs); a compiled call reassembles the eager result (``assemble_result``). Its fake
kernel calls the op's ``forward_fake`` (same arguments, empty results of the right shapes) when it
has one: a native body that loops over the tokens reads metadata values fake tensors do not have.

An op with output arguments (its class's ``output_args``: one keyword argument per result item,
each taking a tensor to write that item into; ``dualop/ops/_outputs.py``) gets two custom ops: the
functional one above, without those arguments (it keeps its autograd formula), and
``torch.ops.dualop.<name>_out``, whose schema adds each output argument as ``Tensor(a!)?`` and
returns one ``Tensor`` per result item as the state-space ops do (a placeholder for an item written
into its argument, or absent: ``output_present`` names, per item, the argument whose None leaves it
out, as RMSNorm's residual sum without a residual). A call that passes an output becomes the
``_out`` op inside ``torch.compile``.

The real kernel rebuilds the op (cached per ``ctor``) and runs its ordinary eager dispatch
(config, platform path, fallbacks); the fake kernel runs ``forward_native`` on fake tensors;
autograd differentiates ``forward_native``.

Under ``torch.compile`` a CustomOp call is traced here instead of through the eager dispatcher
(whose context-variable config Dynamo cannot trace): when the op is enabled under the config
active at trace time, the graph holds the opaque custom op; otherwise it holds ``forward_native``,
which Inductor fuses (the reference engine's rule for ``custom_ops=["none"]`` under Inductor).
The config is read once, at trace time: a compiled graph does not follow later config changes. An
enabled op that cannot be a custom op (its constructor has no encoding, or its signature no
schema) is an error at trace time, never a silent trace of ``forward_native``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from typing import Any, Optional, Sequence

import torch

from dualop import ctor_spec
from dualop.config import get_config
from dualop.custom_op import CustomOp

__all__ = ["library_op", "compiled_call", "library_args", "op_signature", "OpSignature"]

_NAMESPACE = "dualop"
CTOR = "ctor"  # the schema's last argument: the op's constructor call (dualop.ctor_spec)

_SCALAR_TYPES = {bool: "bool", int: "SymInt", float: "float", str: "str"}
_ARRAY_HINTS = (Any, torch.Tensor)


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


# ---------------------------------------------------------------- the schema, from forward_native


@dataclasses.dataclass(frozen=True)
class OpSignature:
    """An op's torch.library calling convention, derived from its forward_native by ``op_signature``."""

    name: str
    params: tuple[tuple[str, str], ...]  # (parameter, schema type) in forward_native's order
    defaults: tuple[Any, ...]  # each parameter's default; inspect.Parameter.empty when required
    keyword_only: frozenset[str]
    returns: str  # "Tensor", "(Tensor, Tensor)", ... or "Tensor[]"; "()" for an op that mutates
    mutated: tuple[str, ...] = ()  # parameters updated in place (the op class's ``mutates_args``)
    mutated_results: tuple[str | None, ...] = ()  # per result item: None (an output) or the argument it is
    present_if: tuple[str | None, ...] = ()  # per result item: the argument whose None leaves it out
    drop_absent: bool = False  # the eager call omits absent items (one left: returned bare), not None them

    @property
    def schema(self) -> str:
        aliases = {param: f"({chr(ord('a') + i)}!)" for i, param in enumerate(self.mutated)}
        args = ", ".join(
            f"{kind[:-1] + aliases[param] + '?' if kind.endswith('?') else kind + aliases[param]} {param}"
            if param in aliases else f"{kind} {param}"
            for param, kind in self.params
        )
        return f"({args}, str {CTOR}) -> {self.returns}"

    @property
    def output_count(self) -> int | None:
        """How many tensors a call returns (None: it depends on the call)."""
        if self.returns in ("Tensor[]", "Tensor?[]"):
            return None
        return self.returns.count("Tensor")  # "Tensor?" included

    def bind(self, values: Sequence[Any]) -> tuple[list, dict]:
        """One value per parameter, as forward_native's positional and keyword arguments."""
        args = [v for (p, _), v in zip(self.params, values) if p not in self.keyword_only]
        kwargs = {p: v for (p, _), v in zip(self.params, values) if p in self.keyword_only}
        return args, kwargs


def _union_members(hint: Any) -> tuple | None:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else None


def _param_type(op: str, param: inspect.Parameter, hint: Any) -> str:
    optional = param.default is None
    members = _union_members(hint)
    if members is not None:
        present = [m for m in members if m is not type(None)]
        optional = optional or len(present) < len(members)
        if len(present) != 1:
            raise TypeError(
                f"{op}: forward_native parameter {param.name!r} is annotated {hint}, which is not one schema "
                f"type; annotate it Any (an array), bool, int, float or str, each optionally | None"
            )
        hint = present[0]
    if hint in _ARRAY_HINTS and param.default not in (None, param.empty):
        hint = type(param.default)  # an unannotated number, bool or str: its default says which
    if hint in _ARRAY_HINTS:
        return "Tensor?" if optional else "Tensor"
    if hint in _SCALAR_TYPES:
        return _SCALAR_TYPES[hint] + ("?" if optional else "")
    raise TypeError(
        f"{op}: forward_native parameter {param.name!r} ({hint!r}) has no torch.library schema type; "
        f"annotate it Any (an array), bool, int, float or str, each optionally | None"
    )


def _return_type(op: str, hint: Any) -> str:
    def is_tuple(h: Any) -> bool:
        return typing.get_origin(h) is tuple

    def item_type(h: Any) -> str | None:
        """``Tensor`` for an array, ``Tensor?`` for an array or None, else None."""
        if h in _ARRAY_HINTS:
            return "Tensor"
        present = [m for m in _union_members(h) or () if m is not type(None)]
        if len(present) == 1 and present[0] in _ARRAY_HINTS and len(_union_members(h)) == 2:
            return "Tensor?"
        return None

    def fixed_tuple(h: Any) -> list[str] | None:
        items = typing.get_args(h)
        if len(items) >= 2 and Ellipsis not in items and all(item_type(i) for i in items):
            return [item_type(i) for i in items]
        return None

    members = _union_members(hint)
    if hint in _ARRAY_HINTS:
        return "Tensor"
    if is_tuple(hint) and fixed_tuple(hint):
        return "(" + ", ".join(fixed_tuple(hint)) + ")"
    if is_tuple(hint) and typing.get_args(hint)[1:] == (Ellipsis,):
        return "Tensor[]"
    if members and all(m in _ARRAY_HINTS or (is_tuple(m) and fixed_tuple(m)) for m in members):
        optional = any(is_tuple(m) and "Tensor?" in fixed_tuple(m) for m in members)
        return "Tensor?[]" if optional else "Tensor[]"
    raise TypeError(
        f"{op}: forward_native's return annotation {hint!r} has no torch.library output type; annotate it "
        f"Any (one array), tuple[Any, Any] (a fixed number), or Any | tuple[Any, Any] (depends on the call)"
    )


def output_args(cls: type) -> tuple[str, ...]:
    """The op class's output arguments (``output_args``), one per result item; () for none."""
    return tuple(getattr(cls, "output_args", ()) or ())


@functools.lru_cache(maxsize=None)
def op_signature(cls: type, written: bool = False) -> OpSignature:
    """The typed calling convention of an op class's forward_native (see the module docstring):
    without its output arguments, or (``written``) the ``<name>_out`` op's, with them."""
    op = cls.name or cls.__qualname__
    fn = cls.forward_native
    outputs = output_args(cls)
    if written and not outputs:
        raise TypeError(f"{op}: has no output arguments (output_args), so no written form")
    params = [p for p in list(inspect.signature(fn).parameters.values())[1:] if written or p.name not in outputs]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params) or not params:
        raise TypeError(f"{op}: forward_native must name its parameters (no *args/**kwargs) to get a schema")
    if any(p.name == CTOR for p in params):
        raise TypeError(f"{op}: forward_native parameter {CTOR!r} collides with the schema's constructor argument")
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError, AttributeError) as err:
        raise TypeError(f"{op}: forward_native's annotations do not resolve ({err})") from None
    typed = tuple((p.name, _param_type(op, p, hints.get(p.name, Any))) for p in params)
    mutated = tuple(getattr(cls, "mutates_args", ()) or ())
    results = tuple(getattr(cls, "mutated_results", ()) or ())
    present: tuple[str | None, ...] = ()
    if written:
        if mutated:
            raise TypeError(f"{op}: an op with output_args declares no mutates_args (its _out op mutates the outputs)")
        mutated = results = outputs
        present = tuple(getattr(cls, "output_present", ()) or ()) or (None,) * len(outputs)
        if len(present) != len(outputs) or any(p is not None and p not in dict(typed) for p in present):
            raise TypeError(f"{op}: output_present {present} must name, per output argument {outputs}, a "
                            f"parameter or None")
    for name in mutated:
        if dict(typed).get(name, "").rstrip("?") != "Tensor":
            raise TypeError(f"{op}: mutates_args names {name!r}, which is not an array parameter of forward_native")
    if any(r is not None and r not in mutated for r in results):
        raise TypeError(f"{op}: mutated_results {results} names an argument not in mutates_args {mutated}")
    returns = _return_type(op, hints.get("return", Any))
    return OpSignature(
        name=op + "_out" if written else op,
        params=typed,
        defaults=tuple(p.default for p in params),
        keyword_only=frozenset(p.name for p in params if p.kind is p.KEYWORD_ONLY),
        returns=("Tensor" if len(results) == 1 else "(" + ", ".join(["Tensor"] * len(results)) + ")" if results
                 else "()" if mutated else returns),
        mutated=mutated,
        mutated_results=results,
        present_if=present,
        drop_absent=written and returns in ("Tensor[]", "Tensor?[]"),
    )


# ---------------------------------------------------------------- the custom op


def _no_alias(outputs: list, inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Custom-op outputs may not alias inputs: copy any output that shares an input's storage."""
    tensors = [a for a in inputs if isinstance(a, torch.Tensor)]
    return [
        out.clone() if out is not None and any(torch._C._is_alias_of(out, a) for a in tensors) else out
        for out in outputs
    ]


def _as_declared(sig: OpSignature, result: Any, inputs: Sequence[Any]) -> Any:
    """An op's result in the form its schema declares (a tensor, a tuple or a list)."""
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    count = sig.output_count
    if count is not None and (len(outputs) != count or (count == 1 and isinstance(result, (tuple, list)))):
        raise TypeError(
            f"{sig.name}: the call returned {'a ' + type(result).__name__ + ' of ' if count == 1 else ''}"
            f"{len(outputs)} array(s), but forward_native's return annotation declares {sig.returns}"
        )
    outputs = _no_alias(outputs, inputs)
    if count is None:
        return outputs
    return outputs[0] if count == 1 else tuple(outputs)


_DEFINED: dict[str, OpSignature] = {}  # the signature each torch.ops.dualop.<name> was defined with
_OUTPUTS: dict[str, tuple[str, ...]] = {}  # a registered op's output arguments, where it has a written form


@functools.lru_cache(maxsize=None)
def library_op(name: str):
    """The ``torch.ops.dualop.<name>`` op for a registered op name (defined on first use), or None
    when its forward_native has no schema (``compiled_call`` then raises ``op_signature``'s error).
    An op with output arguments also gets its ``<name>_out`` op (``written_op``)."""
    cls = CustomOp.op_registry[name]
    try:
        sig = op_signature(cls)
    except TypeError:
        return None
    if output_args(cls):
        _define(op_signature(cls, written=True))
        _OUTPUTS[name] = output_args(cls)
    return _define(sig)


def written_op(name: str):
    """The ``torch.ops.dualop.<name>_out`` op of a registered op with output arguments."""
    library_op(name)
    return getattr(getattr(torch.ops, _NAMESPACE), name + "_out")


def _define(sig: OpSignature):  # noqa: C901 - one op's real, fake and autograd kernels
    """Define ``torch.ops.dualop.<sig.name>`` with its real, fake and (functional ops) autograd kernels."""
    name = sig.name
    outputs = sig.mutated if sig.present_if else ()  # a written form: its output arguments

    def real(*values: Any) -> Any:
        *call, ctor = values
        op = ctor_spec.build(ctor)  # at run time this is an eager call: the ordinary dispatch runs
        args, kwargs = sig.bind(call)
        result = op(*args, **kwargs)
        if sig.mutated_results:
            return _declared_results(sig, _no_alias(_created_results(sig, call, result, into=True), call))
        if sig.mutated:
            _into_mutated(sig, call, result)
            return None
        return _as_declared(sig, result, call)

    real.__name__ = name
    custom = torch.library.custom_op(f"{_NAMESPACE}::{name}", real, mutates_args=sig.mutated, schema=sig.schema)

    @custom.register_fake
    def _fake(*values: Any) -> Any:
        *call, ctor = values
        if sig.mutated_results:
            args, kwargs = sig.bind(call)
            op = ctor_spec.build(ctor)
            for param in outputs:  # a written form's fake computes its results out of place
                kwargs.pop(param, None)
            # A sequential native body (a token loop reading its metadata) cannot run on fake
            # tensors: such an op gives its results' shapes by ``forward_fake``.
            result = getattr(op, "forward_fake", op.forward_native)(*args, **kwargs)
            return _declared_results(sig, _no_alias(_created_results(sig, call, result, into=False), call))
        if sig.mutated:
            return None  # the mutated arguments keep their shapes; nothing is returned
        args, kwargs = sig.bind(call)
        return _as_declared(sig, ctor_spec.build(ctor).forward_native(*args, **kwargs), call)

    if sig.mutated:
        _DEFINED[name] = sig
        return custom

    def setup_context(ctx, inputs, output):
        *call, ctx.ctor = inputs
        ctx.present = [isinstance(a, torch.Tensor) for a in call]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in call]
        ctx.save_for_backward(*[a for a in call if isinstance(a, torch.Tensor)])

    def backward(ctx, *grads):
        grads = grads[0] if sig.output_count is None else grads
        op = ctor_spec.build(ctx.ctor)
        saved = iter(ctx.saved_tensors)
        with torch.enable_grad():
            # integer inputs (ids, positions) cannot require gradients: only floating ones are leaves
            leaves = [
                _grad_leaf(next(saved)) if present else other
                for present, other in zip(ctx.present, ctx.others)
            ]
            args, kwargs = sig.bind(leaves)
            result = op.forward_native(*args, **kwargs)
            outs = list(result) if isinstance(result, tuple) else [result]
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o is not None and o.requires_grad]
            wrt = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            got = (
                torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                if pairs and wrt else ()
            )
        it = iter(got)
        arg_grads = [next(it) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in leaves]
        return (*arg_grads, None)

    custom.register_autograd(backward, setup_context=setup_context)
    _DEFINED[name] = sig
    return custom


def _result_items(sig: OpSignature, given: dict, result: Any) -> list:
    """An eager result as one item per ``mutated_results`` entry, None for an absent one."""
    if len(sig.mutated_results) == 1:
        return [result]
    if not sig.drop_absent:
        return list(result)
    found = iter(result if isinstance(result, tuple) else (result,))
    return [None if p is not None and given.get(p) is None else next(found) for p in sig.present_if]


def _created_results(sig: OpSignature, call: Sequence[Any], result: Any, *, into: bool) -> list:
    """The library op's outputs for an op with ``mutated_results``: each output, each state it
    created (its argument was None), an empty placeholder for each given state and each absent
    item. A given state the path returned as a new tensor is copied into the argument when
    ``into`` (so the declared in-place update holds)."""
    given = dict(zip((p for p, _ in sig.params), call))
    placeholder = next(a for a in call if isinstance(a, torch.Tensor)).new_empty((0,))
    outputs = []
    for item, name in zip(_result_items(sig, given, result), sig.mutated_results, strict=True):
        target = given.get(name) if name is not None else None
        if target is None:
            outputs.append(placeholder if item is None else item)
            continue
        if into and item is not target:
            target.copy_(item)
        outputs.append(target.new_empty((0,)))
    return outputs


def _declared_results(sig: OpSignature, outputs: list) -> Any:
    """The outputs as the schema returns them: one ``Tensor``, or a tuple."""
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def assemble_result(sig: OpSignature, call: Sequence[Any], outputs: Any) -> Any:
    """An op with ``mutated_results``: its eager result from the library op's outputs and the call's
    values (a given state or output argument is returned itself, updated in place; an absent item
    is None, or left out where the eager call leaves it out)."""
    given = dict(zip((p for p, _ in sig.params), call))
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
    present = sig.present_if or (None,) * len(sig.mutated_results)
    items = [None if when is not None and given.get(when) is None
             else out if name is None or given.get(name) is None else given[name]
             for out, name, when in zip(outputs, sig.mutated_results, present, strict=True)]
    if sig.drop_absent:
        items = [item for item in items if item is not None]
    return items[0] if len(items) == 1 else tuple(items)


def _into_mutated(sig: OpSignature, call: Sequence[Any], result: Any) -> None:
    """After a mutating op ran: its result must be its mutated argument(s), updated in place; a
    path that returned new tensors instead has them copied in (so the declared mutation holds)."""
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    targets = [value for (param, _), value in zip(sig.params, call) if param in sig.mutated]
    if len(results) != len(targets):
        raise TypeError(f"{sig.name}: a mutating op must return its mutated argument(s) {list(sig.mutated)}, "
                        f"got {len(results)} array(s)")
    for target, out in zip(targets, results):
        if out is not target:
            target.copy_(out)


# ---------------------------------------------------------------- calls


def _check_value(sig: OpSignature, param: str, kind: str, value: Any) -> None:
    """A TypeError naming the op and the argument when ``value`` does not fit its schema type."""
    if value is None and kind.endswith("?"):
        return
    base = kind.rstrip("?")
    fits = {
        "Tensor": lambda v: isinstance(v, torch.Tensor),
        "bool": lambda v: isinstance(v, (bool, torch.SymBool)),
        "SymInt": lambda v: isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
    }[base]
    if not fits(value):
        expected = {"Tensor": "a torch.Tensor", "SymInt": "an int"}.get(base, f"a {base}")
        raise TypeError(
            f"{sig.name}: argument {param!r} must be {expected}{' or None' if kind.endswith('?') else ''} "
            f"(its torch.library schema type is {kind}), got {type(value).__qualname__}"
        )


def library_args(op: CustomOp, args: tuple, kwargs: dict, *, written: bool = False) -> list:
    """A CustomOp call's arguments in its custom op's calling convention:
    ``torch.ops.dualop.<name>(*library_args(op, args, kwargs))`` (``written``: its ``<name>_out``
    op's). Traced by Dynamo, so it reads the signature the op was defined with (a plain dict lookup;
    ``compiled_call`` has checked that the op's class has that signature) rather than deriving one."""
    sig = _DEFINED[type(op).name + ("_out" if written else "")]
    if len(args) > len(sig.params):
        raise TypeError(f"{sig.name}: takes {len(sig.params)} call arguments, got {len(args)}")
    names = [p for p, _ in sig.params]
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise TypeError(f"{sig.name}: unexpected keyword argument(s) {unknown}")
    values = []
    for i, ((param, kind), default) in enumerate(zip(sig.params, sig.defaults)):
        if i < len(args):
            value = args[i]
        elif param in kwargs:
            value = kwargs[param]
        elif default is not inspect.Parameter.empty:
            value = default
        else:
            raise TypeError(f"{sig.name}: argument {param!r} is required")
        _check_value(sig, param, kind, value)
        values.append(value)
    return [*values, op._ctor]


@functools.lru_cache(maxsize=None)
def _library_call_error(name: str, ctor: str) -> Optional[str]:
    """Why a call of the registered op ``name`` by the op ``ctor`` builds cannot be the custom op
    (None when it can): the op's class (a subclass or an OOT replacement, perhaps) must have the
    schema the custom op was defined with."""
    cls = ctor_spec.op_class(ctor)
    try:
        mine = op_signature(cls)
        library_op(name)
        theirs = _DEFINED.get(name) or op_signature(CustomOp.op_registry[name])
    except TypeError as err:
        return str(err)
    if mine.schema != theirs.schema:
        return (
            f"{name}: {cls.__qualname__}.forward_native gives the schema {mine.schema}, but "
            f"torch.ops.{_NAMESPACE}.{name} was defined as {theirs.schema}"
        )
    return None


@torch._dynamo.assume_constant_result
def _check_library_call(name: str, ctor: str, ctor_error: str) -> bool:
    """Raise (while Dynamo traces) why an enabled op cannot be its custom op; True otherwise."""
    error = ctor_error or _library_call_error(name, ctor)
    if error:
        raise TypeError(error)
    return True


@torch._dynamo.assume_constant_result
def _enabled_now(name: str, enforce: bool) -> bool:
    """The enabled rule under the config active when Dynamo traces (a constant of the graph)."""
    return enforce or get_config().decide(name or None)[0]


def compiled_call(op: CustomOp, args: tuple, kwargs: dict) -> Any:
    """What a CustomOp call becomes inside ``torch.compile`` (traced by Dynamo).

    An op with no registered name has no custom op and is traced through forward_native, as is a
    disabled op; an enabled op becomes ``torch.ops.dualop.<name>``, or the trace fails saying why
    it cannot."""
    name = type(op).name
    if name is None or not _enabled_now(name, op.enforce_enable):
        return op.forward_native(*args, **kwargs)
    _check_library_call(name, op._ctor or "", op._ctor_error or "")
    args, kwargs = op.library_arguments(args, kwargs)
    written = False
    for param in _OUTPUTS.get(name, ()):  # an output argument given: the written form
        if kwargs.get(param) is not None:
            written = True
        elif param in kwargs:
            del kwargs[param]
    values = library_args(op, args, kwargs, written=written)
    name = name + "_out" if written else name
    out = getattr(getattr(torch.ops, _NAMESPACE), name)(*values)
    sig = _DEFINED[name]
    if sig.mutated_results:
        return assemble_result(sig, values[:-1], out)
    if sig.mutated:  # the call's result is its mutated argument(s), as in eager
        mutated = [v for (param, _), v in zip(sig.params, values) if param in sig.mutated]
        return mutated[0] if len(mutated) == 1 else tuple(mutated)
    if isinstance(out, list):  # Tensor[]: as the op's own call returns it, one array or a tuple
        return out[0] if len(out) == 1 else tuple(out)
    return out


def _grad_leaf(t: Any) -> Any:
    """A detached copy of a saved input for the backward's re-run; floating ones require grad."""
    return t.detach().requires_grad_(t.is_floating_point())
