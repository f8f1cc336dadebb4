"""``CustomOp``: the base class of every dualop op, its registries and its dispatcher.

An op subclass says *what* it computes in ``forward_native`` (written once, against the array
namespace of whichever frontend the caller uses) and may offer faster *hows* per platform:
``forward_tpu`` (Pallas), ``forward_cuda``/``forward_hip`` (Triton), ``forward_cpu``,
``forward_xpu``, ``forward_oot`` (plugins).

Calling an op instance picks one of those methods from (frontend of the first array argument,
active ``OpsConfig``, platform of that array: a torch tensor's device decides). The choice is
resolved once per (instance, frontend, platform, config) and cached. Each subclass gets a
generated ``__call__`` with ``forward_native``'s own signature whose fast path is a handful of
identity checks (array type, device type for torch tensors, config, platform generation) before
the one bound-method call; see ``_fast_call_source``.

Enabled rules (the reference serving engine's): ``+name`` enables, ``-name`` disables, otherwise
the op follows the default, which is on exactly when the config holds ``all``. An unregistered
subclass follows its parent's registered name. ``enforce_enable=True`` forces one instance's fast
path without changing ``enabled()``.

What ran, honestly: a platform method (``forward_cpu``, ``forward_tpu``, ...) runs an implementation
of its own, distinct from ``forward_native`` (a Pallas, Triton or C++ kernel, or a torch body built
on other torch kernels), which is why ``dualop check`` compares it with ``forward_native``. It never
computes the native body itself: where it has nothing of its own it declines, either once at
resolution (``CustomOp.declines``: this frontend or this instance's variant has no kernel) or per
call (``NotImplementedError(reason)``: an input it does not take, autograd recording). Dispatch then
runs ``forward_native`` and records the reason. So a call ran a kernel exactly when the method that
ran is not ``forward_native``; ``CustomOp.last_run`` says which, and why.

Built inside a function that ``torch.compile`` traces, an op is built by plain Python outside the
trace (``__new__`` hands the construction to ``_build_untraced``, whose result Dynamo takes as a
constant; every ``__init__`` does nothing while traced), so the graph calls an op built exactly as
one built outside the compiled function, whatever its constructor runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import itertools
import logging
import operator
import sys
import threading
import warnings
from typing import Any, ClassVar

from dualop import config as _config
from dualop import ctor_spec
from dualop import platforms as _platforms

__all__ = ["CustomOp", "DEFAULT_SERVES", "PLATFORM_METHOD", "Serves", "dispatch_report", "validates_inputs"]

logger = logging.getLogger("dualop")

# The method each platform dispatches to when the op is enabled.
PLATFORM_METHOD = {
    "cpu": "forward_cpu",
    "cuda": "forward_cuda",
    "rocm": "forward_hip",
    "tpu": "forward_tpu",
    "xpu": "forward_xpu",
    "oot": "forward_oot",
}
# Where a missing (or not-implemented) platform method falls back to, in order.
_FALLBACKS = {
    "forward_hip": ("forward_cuda", "forward_native"),
    "forward_cuda": ("forward_native",),
    "forward_cpu": ("forward_native",),
    "forward_xpu": ("forward_native",),
    "forward_tpu": ("forward_native",),
    "forward_oot": ("forward_native",),
    "forward_native": (),
}



@dataclasses.dataclass(frozen=True)
class Serves:
    """Which callers' arrays a platform method takes: ``frontends`` (names from
    ``platforms.FRONTENDS``), and why it passes over the others (``why_not``, formatted with
    ``frontend``). Declared once per op class (``CustomOp.serves``); the dispatcher reads it when
    it resolves, so a method is never called with arrays it cannot take."""

    frontends: tuple[str, ...]
    why_not: str = "{frontend} arrays are not served here"

    def passes_over(self, frontend: str) -> str | None:
        return None if frontend in self.frontends else self.why_not.format(frontend=frontend)


ALL_FRONTENDS = _platforms.FRONTENDS
_TRITON_TAKES_TORCH = Serves(("torch",), "the Triton kernels take torch tensors ({frontend} arrays would need jax-triton)")
# What a platform method serves unless its op declares otherwise: the C++ CPU kernels and the
# Triton kernels take torch tensors; the Pallas kernels are reached from every frontend (the torch
# ones through their bridges), as are the plugin platforms'.
DEFAULT_SERVES: dict[str, Serves] = {
    "forward_cpu": Serves(("torch",), "no CPU kernel for {frontend} arrays: XLA compiles the native body"),
    "forward_cuda": _TRITON_TAKES_TORCH,
    "forward_hip": _TRITON_TAKES_TORCH,
    "forward_tpu": Serves(ALL_FRONTENDS),
    "forward_xpu": Serves(ALL_FRONTENDS),
    "forward_oot": Serves(ALL_FRONTENDS),
}

# (op class, frontend, platform) -> report row; see dispatch_report().
_report: dict[tuple[type, str, str], dict[str, Any]] = {}
_report_lock = threading.Lock()
# Configs whose +name/-name entries have been checked against the registry.
_checked_configs: set[_config.OpsConfig] = set()


def validates_inputs(method: Any) -> Any:
    """Mark a platform method that checks each call itself: dispatch then skips ``check_inputs``
    before it. The method must still refuse every call ``check_inputs`` refuses, with its words:
    a fast path that takes only calls it has proven valid (in C++, say) and runs
    ``self.check_inputs`` before anything else it does, as ``RMSNorm.forward_cpu``."""
    method.validates_inputs = True
    return method


def dispatch_report() -> list[dict[str, Any]]:
    """One row per (op class, frontend, platform) resolved so far in this process.

    Keys: ``op`` (registered name or None), ``cls``, ``frontend``, ``platform``, ``method`` (the
    method that ran), ``enabled``, ``reason`` (why that method).
    """
    with _report_lock:
        rows = [dict(row) for row in _report.values()]
    return sorted(rows, key=lambda r: (str(r["op"]), r["cls"], r["frontend"], r["platform"]))


def report_row(op_cls: type, frontend: str, platform: str) -> dict[str, Any] | None:
    """The dispatch-report row of one (op class, frontend, platform), or None if not resolved."""
    with _report_lock:
        row = _report.get((op_cls, frontend, platform))
    return dict(row) if row is not None else None


def clear_dispatch_report() -> None:
    with _report_lock:
        _report.clear()


def _check_config_names(cfg: _config.OpsConfig) -> None:
    """Warn once (or raise, if ``cfg.strict``) for ``+name``/``-name`` that name no registered op."""
    if cfg in _checked_configs:
        return
    known = set(CustomOp.op_registry)
    unknown = sorted(n for n in cfg.named_ops if n not in known)
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        msg = f"custom_ops names {name!r}, which is not a registered op{hint}"
        if cfg.strict:
            raise ValueError(f"OpsConfig(strict=True): {msg}")
        warnings.warn(msg, UserWarning, stacklevel=4)
    _checked_configs.add(cfg)


# ``_eager()`` is True when Python runs a call and False while Dynamo traces one: a C builtin that
# _install_torch_support() gives a Dynamo polyfill returning False, so the generated fast path costs
# one builtin call in eager and is never traced (its per-instance state would become graph guards).
_eager = "eager".isidentifier
_current_config = _config._current.get  # the context's config override (None: the process default)
# Mirror of platforms._generation (bumped when platforms, plugins or the process default change).
_generation = _platforms._generation


def _on_invalidate(generation: int) -> None:
    global _generation
    _generation = generation


_platforms.add_invalidation_listener(_on_invalidate)

# torch.compile support, installed once torch is in the process (see _install_torch_support):
# ``_torch_compiling()`` is True only while Dynamo traces, and ``_compile_hook`` is what a call
# becomes then. Until torch is loaded the check is the C builtin ``bool()`` (always False).
_torch_compiling: Any = bool
_compile_hook: Any = None


def _install_torch_support() -> None:
    """Register every op with torch.library and route calls traced by torch.compile there."""
    global _torch_compiling, _compile_hook
    if _compile_hook is not None:
        return
    import torch

    from dualop.backends.torch import library

    for fn in (_torch_support_if_loaded, _build_untraced):
        torch.compiler.assume_constant_result(fn)
    for name in CustomOp.op_registry:
        library.library_op(name)
    library.trace_as_not_eager(_eager)
    _compile_hook = library.compiled_call
    _torch_compiling = library.is_compiling


def _parameter_names(cls: type) -> tuple[str, ...] | None:
    """forward_native's parameter names after self, or None if it takes *args/**kwargs."""
    params = list(inspect.signature(cls.forward_native).parameters.values())[1:]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    return tuple(p.name for p in params)


class _Missing:
    """Default of a required parameter in a generated ``__call__``: the argument was not given."""

    def __repr__(self) -> str:
        return "<missing argument>"


_MISSING = _Missing()


class _Unarmed:
    """The type no first argument has: an entry whose guard is this fails on its first check."""


# No __slots__: the fast path reads five fields of the last hit, and CPython 3.11 reads a plain
# instance's attributes faster (about 10 ns per call measured here).
@dataclasses.dataclass(frozen=True, eq=False)
class _Resolution:
    """One entry of an op's dispatch cache: what calls from ``frontend`` on ``platform`` under a
    config (``config_key``, its ``dispatch_key``) run in platform ``generation`` (the bound
    ``method``, its ``name`` and why), and the guard under which a later call may reuse it without a
    lookup: the first array's exact type, the context's config override object, and a device probe
    for torch tensors or None. Any array that passes the guard has the entry's frontend, platform
    and config, whichever call set it; an entry resolved without a call has ``array_type``
    ``_Unarmed``, so its guard never passes. Compared by identity: the last hit is one entry."""

    frontend: str
    platform: str
    config_key: str
    generation: int
    method: Any
    name: str
    reason: str
    array_type: type = _Unarmed
    override: Any = None
    probe: Any = None
    checks: bool = True  # whether dispatch runs check_inputs before the method (see validates_inputs)

    @property
    def key(self) -> tuple[str, str, str]:
        """Where the entry lives in the dispatch cache; ``generation`` says whether it is current."""
        return self.frontend, self.platform, self.config_key

    def guarded_by(self, array_type: type, override: Any, probe: Any) -> _Resolution:
        """This entry, its reuse guarded by (first array's type, config override, device probe)."""
        if array_type is self.array_type and override is self.override and probe is self.probe:
            return self
        return dataclasses.replace(self, array_type=array_type, override=override, probe=probe)


# The dispatch cache's last hit before any call (its guard fails on the array type, then on the
# generation): cheaper to test in the fast path than None.
_NO_HIT = _Resolution("", "", "", -1, None, "", "no call yet")


def _without_missing(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call as written: positional arguments up to the first one left out, given keywords."""
    for i, a in enumerate(args):
        if a is _MISSING:
            args = args[:i]
            break
    return args, {k: v for k, v in kwargs.items() if v is not _MISSING}


def _fast_call_source(cls: type) -> tuple[str, tuple, dict] | None:
    """Source of a ``__call__`` with forward_native's parameters, and its defaults.

    The fast path: when Python (not Dynamo) runs the call and it passes the guard of the dispatch
    cache's last hit (a ``_Resolution``: the first argument's type, the context's config override,
    the platform generation and, for torch tensors, a device probe such as ``Tensor.is_cpu``, a C
    attribute read), call its bound method directly (after ``check_inputs`` if the class defines
    one). Anything else takes ``_dispatch``, which looks up or resolves, records and re-arms.
    """
    sig = inspect.signature(cls.forward_native)
    params = list(sig.parameters.values())[1:]
    if not params or any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params):
        return None
    names = [p.name for p in params]
    if any(n in ("self", "_args") or n.startswith("__") for n in names):
        return None
    positional = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    keyword = [p for p in params if p.kind is p.KEYWORD_ONLY]
    if not positional:
        return None
    # Every parameter gets a default (required ones the _MISSING sentinel), so a call that leaves
    # one out reaches check_inputs, whose error names the op and the argument, instead of Python's.
    sig_text = ", ".join([f"{p.name}=None" for p in positional] + (["*"] + [f"{p.name}=None" for p in keyword]
                                                                   if keyword else []))
    required = [p.name for p in params[1:] if p.default is p.empty]
    pos_args = ", ".join(p.name for p in positional)
    kw_args = ", ".join(f"{p.name}={p.name}" for p in keyword)
    call_args = ", ".join(x for x in (pos_args, kw_args) if x)
    kw_dict = "{" + ", ".join(f"{p.name!r}: {p.name}" for p in keyword) + "}"
    first = positional[0].name
    has_check = cls.check_inputs is not CustomOp.check_inputs
    present = "".join(f" and {name} is not _MISSING" for name in required)

    def fast_call(args: str, kws: str, indent: str) -> str:
        check = f"{indent}if hit.checks:\n{indent}    self.check_inputs({args})\n" if has_check else ""
        return (f"{check}"
                f"{indent}try:\n"
                f"{indent}    return hit.method({args})\n"
                f"{indent}except NotImplementedError as err:\n"
                f"{indent}    return self._declined(hit.method, err, ({pos_args},), {kws})\n")

    # Output arguments (``output_args``: the written forms) reach the methods only when given, so
    # implementations written without them (an out-of-tree subclass's) serve every plain call.
    outputs = [p.name for p in keyword if p.name in (getattr(cls, "output_args", ()) or ())]
    plain_kw = [p for p in keyword if p.name not in outputs]
    plain_args = ", ".join(x for x in (pos_args, ", ".join(f"{p.name}={p.name}" for p in plain_kw)) if x)
    plain_dict = "{" + ", ".join(f"{p.name!r}: {p.name}" for p in plain_kw) + "}"
    if outputs:
        none_given = " and ".join(f"{name} is None" for name in outputs)
        body = (f"        if {none_given}:\n" + fast_call(plain_args, plain_dict, " " * 12)
                + fast_call(call_args, kw_dict, " " * 8))
        fallback = f"    return self._dispatch(({pos_args},), {plain_dict} if {none_given} else {kw_dict})\n"
    else:
        body = fast_call(call_args, kw_dict, " " * 8)
        fallback = f"    return self._dispatch(({pos_args},), {kw_dict})\n"
    source = (
        f"def __call__(self, {sig_text}):\n"
        f"    hit = self._armed\n"
        f"    if (type({first}) is hit.array_type and _eager() "
        f"and _current_config() is hit.override and hit.generation == _generation "
        f"and (hit.probe is None or hit.probe({first})){present}):\n"
        f"{body}"
        f"{fallback}"
    )
    defaults = tuple(_MISSING if p.default is p.empty else p.default for p in positional)
    kwdefaults = {p.name: _MISSING if p.default is p.empty else p.default for p in keyword}
    return source, defaults, kwdefaults


def _install_fast_call(cls: type) -> None:
    """Give ``cls`` a generated ``__call__`` (and ``forward``) with forward_native's signature."""
    built = _fast_call_source(cls)
    if built is None:
        return  # forward_native takes *args/**kwargs: the generic CustomOp.__call__ serves it
    source, defaults, kwdefaults = built
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<dualop fast call of {cls.__qualname__}>", "exec"), globals(), namespace)
    fn = namespace["__call__"]
    fn.__defaults__ = defaults or None
    fn.__kwdefaults__ = kwdefaults or None
    fn.__qualname__ = f"{cls.__qualname__}.__call__"
    fn.__doc__ = f"Dispatch a call of {cls.__qualname__} (generated: {cls.__qualname__}.forward_native's signature)."
    fn._dualop_generated = True
    cls.__call__ = fn
    cls.forward = fn


def _constant_while_traced(fn: Any) -> Any:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does, without importing torch (the
    mark must be there before torch support is installed): while Dynamo traces, a call of ``fn``
    runs in plain Python on its arguments' trace-time values and its result is a constant of the
    graph. ``_install_torch_support`` also applies torch's own decorator, which marks the same way."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_while_traced
def _torch_support_if_loaded() -> None:
    """Install the torch support once torch is in the process. Constant while traced, so the install
    (torch.library definitions) runs in plain Python even when the process's first op is built
    inside a function that ``torch.compile`` traces."""
    if _compile_hook is None and sys.modules.get("torch") is not None:
        _install_torch_support()


# Ops built by plain Python for constructions that Dynamo traced (``_build_untraced``), by the key
# the trace holds as a constant. The graph reads its op from here, a source Dynamo can guard, as
# it reads an op built outside the compiled function; kept while the process runs, as graphs are.
_untraced_builds: dict[int, CustomOp] = {}
_untraced_keys = itertools.count()


@_constant_while_traced
def _build_untraced(cls: type, args: tuple, kwargs: dict) -> int:
    """Build ``cls(*args, **kwargs)`` by plain Python for a construction Dynamo traces, and return
    its key in ``_untraced_builds``. The op is built exactly as in eager (its constructor spec, its
    ``__init__``, whatever that runs; Dynamo traces none of it). The arguments must be values
    Dynamo knows while tracing (numbers, strings, enum members, dataclass instances, tuples of
    those, ...), as every encodable constructor argument is."""
    key = next(_untraced_keys)
    _untraced_builds[key] = cls(*args, **kwargs)
    return key


def _known_while_traced(value: Any) -> Any:
    """A constructor argument as a value Dynamo knows while tracing: an int that is symbolic (a
    size read from a dynamic shape; Dynamo gives it the type ``int``) becomes the number it is in
    this trace, in tuples and lists too. The op is built for that number and the graph is guarded
    on it: another number traces again."""
    if type(value) is int:
        return operator.index(value)  # Dynamo specializes a symbolic int's __index__, with a guard
    if type(value) in (tuple, list):
        return type(value)(_known_while_traced(item) for item in value)
    return value


def _untraced_init(init: Any) -> Any:
    """An op class's own ``__init__``, doing nothing while Dynamo traces: there ``__new__`` has
    built the whole op (``_build_untraced``), and Dynamo calls ``__init__`` on it again."""

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if _eager():
            init(self, *args, **kwargs)

    return __init__


def _ctor_spec(cls: type, args: tuple, kwargs: dict) -> tuple[str | None, str | None]:
    """The constructor call as a stable string (how torch.library rebuilds the op; see
    ``dualop.ctor_spec``) and None, or None and why it has none (raised if torch.compile needs it)."""
    try:
        return ctor_spec.encode(cls, args, kwargs), None
    except TypeError as err:
        return None, str(err)


def _fresh(cls: type, args: tuple = (), kwargs: dict | None = None) -> CustomOp:
    """A new instance with empty dispatch state (so subclasses that skip __init__ still work)."""
    obj = object.__new__(cls)
    obj._resolutions = {}  # the dispatch cache: _Resolution.key -> _Resolution
    obj._armed = _NO_HIT  # its last hit (one of its entries), reused by a call that passes its guard
    obj.last_fallback = None
    obj.enforce_enable = False
    obj._ctor, obj._ctor_error = _ctor_spec(cls, args, kwargs or {})
    return obj


class CustomOp:
    """Base class of every op. Subclass, register, implement ``forward_native`` and fast paths."""

    op_registry: ClassVar[dict[str, type[CustomOp]]] = {}
    op_registry_oot: ClassVar[dict[str, type[CustomOp]]] = {}
    name: ClassVar[str | None] = None
    # Platform method -> the frontends it serves, where that differs from DEFAULT_SERVES (a
    # subclass inherits its parents' entries and may override any of them).
    serves: ClassVar[dict[str, Serves]] = {}

    # ---------------------------------------------------------------- construction

    def __new__(cls, *args: Any, **kwargs: Any) -> CustomOp:
        _torch_support_if_loaded()
        if not _eager():  # Dynamo traces this construction: the op is built outside the trace
            known = {name: _known_while_traced(value) for name, value in kwargs.items()}
            return _untraced_builds[_build_untraced(cls, _known_while_traced(args), known)]
        replacement = CustomOp.op_registry_oot.get(cls.__name__)
        if replacement is None or replacement is cls:
            return _fresh(cls, args, kwargs)
        logger.debug("dualop: building OOT %s in place of %s", replacement.__qualname__, cls.__qualname__)
        obj = _fresh(replacement, args, kwargs)
        if not isinstance(obj, cls):
            # Python only runs __init__ itself when the object is an instance of cls.
            obj.__init__(*args, **kwargs)
        return obj

    def __init__(self, *, enforce_enable: bool = False) -> None:
        if not _eager():  # Dynamo traces a construction: __new__ built the op whole (_build_untraced)
            return
        self.enforce_enable = bool(enforce_enable)
        self._resolutions.clear()
        self._armed = _NO_HIT

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._call_parameter_names = _parameter_names(cls)
        if "__init__" in cls.__dict__:
            cls.__init__ = _untraced_init(cls.__dict__["__init__"])
        overridden = [attr for attr in ("__call__", "forward") if attr in cls.__dict__]
        if not overridden:
            _install_fast_call(cls)
        for attr in overridden:
            if attr in cls.__dict__:
                warnings.warn(
                    f"{cls.__module__}.{cls.__qualname__} overrides {attr}, which bypasses dualop's "
                    f"dispatch (config, platform paths, report). Override forward_native / "
                    f"forward_<platform> instead.",
                    UserWarning,
                    stacklevel=2,
                )

    # ---------------------------------------------------------------- registries

    @classmethod
    def register(cls, name: str):
        """Class decorator: register an in-tree op under ``name`` and set ``op_cls.name``."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"CustomOp.register: name must be a non-empty string, got {name!r}")

        def decorator(op_cls: type[CustomOp]) -> type[CustomOp]:
            if not (isinstance(op_cls, type) and issubclass(op_cls, CustomOp)):
                raise TypeError(f"CustomOp.register({name!r}): {op_cls!r} is not a CustomOp subclass")
            existing = CustomOp.op_registry.get(name)
            if existing is not None and existing is not op_cls:
                raise ValueError(
                    f"CustomOp.register: duplicate op name {name!r}: already registered to "
                    f"{existing.__module__}.{existing.__qualname__}"
                )
            op_cls.name = name
            CustomOp.op_registry[name] = op_cls
            if _compile_hook is not None:
                from dualop.backends.torch.library import library_op

                library_op(name)
            return op_cls

        return decorator

    @classmethod
    def register_oot(cls, _decorated_op_cls: Any = None, name: str | None = None):
        """Register an out-of-tree replacement for an in-tree op class.

        Forms: ``@CustomOp.register_oot("ClassName")``, ``@CustomOp.register_oot(name="ClassName")``,
        ``CustomOp.register_oot(_decorated_op_cls=C, name="ClassName")``, and bare
        ``@SomeOp.register_oot`` on a subclass of ``SomeOp`` (keyed by ``"SomeOp"``). Constructing
        the in-tree class afterwards builds the replacement.
        """
        if isinstance(_decorated_op_cls, str):  # @CustomOp.register_oot("ClassName")
            if name is not None:
                raise TypeError("CustomOp.register_oot: give the name once, positionally or as name=")
            name, _decorated_op_cls = _decorated_op_cls, None
        if name is None:
            if cls is CustomOp:
                if _decorated_op_cls is None:
                    raise TypeError("CustomOp.register_oot: name the in-tree class to replace")
                raise TypeError(
                    "CustomOp.register_oot: bare use needs the in-tree class "
                    "(@SomeOp.register_oot) or a name (@CustomOp.register_oot('SomeOp'))"
                )
            name = cls.__name__
        if not isinstance(name, str) or not name:
            raise TypeError(f"CustomOp.register_oot: name must be a non-empty string, got {name!r}")

        def decorator(op_cls: type[CustomOp]) -> type[CustomOp]:
            if not (isinstance(op_cls, type) and issubclass(op_cls, CustomOp)):
                raise TypeError(f"CustomOp.register_oot({name!r}): {op_cls!r} is not a CustomOp subclass")
            existing = CustomOp.op_registry_oot.get(name)
            if existing is op_cls:
                return op_cls
            if existing is not None:
                raise ValueError(
                    f"CustomOp.register_oot: {name!r} is already replaced by "
                    f"{existing.__module__}.{existing.__qualname__}; cannot also register "
                    f"{op_cls.__module__}.{op_cls.__qualname__}"
                )
            CustomOp.op_registry_oot[name] = op_cls
            _platforms.invalidate()
            return op_cls

        if _decorated_op_cls is not None:
            return decorator(_decorated_op_cls)
        return decorator

    # ---------------------------------------------------------------- enabled rules

    @classmethod
    def enabled(cls) -> bool:
        """Whether this op class takes its platform path under the active config."""
        return _config.get_config().decide(cls.name)[0]

    @staticmethod
    def default_on() -> bool:
        """Whether ops not named by ``+``/``-`` are on: exactly when the config holds ``all``."""
        return _config.get_config().default_on

    # ---------------------------------------------------------------- the implementations

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """The reference body, written once for both frontends. Every op must implement it."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement forward_native")

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_hip(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_xpu(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_tpu(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_oot(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def check_inputs(self, *args: Any, **kwargs: Any) -> None:
        """Validate arguments before any path runs; raise ValueError/TypeError naming the op."""

    def library_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call's arguments as the op's ``torch.library`` schema takes them, inside
        ``torch.compile``: as given, unless an op's eager call takes a form its schema cannot type."""
        return args, kwargs

    def declines(self, method: str, frontend: str) -> str | None:
        """Why ``method`` has no kernel on this instance, or None if it has: override it for a
        constructor variant with no kernel. Which frontends a method serves is declared in
        ``serves`` instead, and checked first (``passes_over``).

        Asked once when dispatch resolves (never per call): a method that declines is passed over
        for its fallback, and the reason goes into the report. A decline that depends on the
        call's arguments is the method's own ``NotImplementedError(reason)``.
        """
        return None

    @classmethod
    def served_by(cls, method: str) -> Serves:
        """What ``method`` serves on this class: the nearest class's ``serves`` entry, else the default."""
        for klass in cls.__mro__:
            entry = vars(klass).get("serves", {}).get(method)
            if entry is not None:
                return entry
        return DEFAULT_SERVES.get(method, Serves(ALL_FRONTENDS))

    def passes_over(self, method: str, frontend: str) -> str | None:
        """Why dispatch passes ``method`` over for ``frontend``'s arrays on this instance (the
        frontends it serves, then ``declines``), or None."""
        return type(self).served_by(method).passes_over(frontend) or self.declines(method, frontend)

    # ---------------------------------------------------------------- dispatch

    @classmethod
    def validates_own_inputs(cls, method: str) -> bool:
        """Whether ``method`` checks its calls itself (``validates_inputs``), so dispatch does not run
        ``check_inputs`` before it: only while the class's ``check_inputs`` is the one beside that
        method (a subclass that adds checks gets them run by dispatch)."""
        fn = getattr(cls, method, None)
        if not getattr(fn, "validates_inputs", False):
            return False
        owner = next(klass for klass in cls.__mro__ if method in vars(klass))
        return cls.check_inputs is owner.check_inputs

    @classmethod
    def _implements(cls, method: str) -> bool:
        return getattr(cls, method) is not getattr(CustomOp, method)

    def _resolve(self, frontend: str, cfg: _config.OpsConfig, generation: int, platform: str | None = None):
        """Choose the method for (frontend, cfg, platform) and record why. ``platform`` is the
        calling array's (``platforms.platform_of``); None means the frontend's process-wide one."""
        _check_config_names(cfg)
        cls = type(self)
        if platform is None:
            platform = _platforms.current_platform(frontend)
        if self.enforce_enable:
            enabled, reason = True, "enforce_enable=True"
        else:
            enabled, reason = cfg.decide(cls.name)
        method = PLATFORM_METHOD[platform] if enabled else "forward_native"
        if not enabled:
            reason += " (disabled, so forward_native)"
        for candidate in (method, *_FALLBACKS[method]):
            if candidate == "forward_native":
                break
            if not cls._implements(candidate):
                reason += f"; {candidate} not implemented"
                continue
            why = self.passes_over(candidate, frontend)
            if why is None:
                break
            reason += f"; {candidate}: {why}"
        if candidate != method:
            reason += f", so {candidate}"
        entry = _Resolution(
            frontend, platform, cfg.dispatch_key, generation, getattr(self, candidate), candidate, reason,
            checks=not cls.validates_own_inputs(candidate),
        )
        self._resolutions[entry.key] = entry
        self._record(frontend, platform, candidate, enabled, reason)
        return entry

    def _record(self, frontend: str, platform: str, method: str, enabled: bool, reason: str) -> None:
        cls = type(self)
        row = {
            "op": cls.name,
            "cls": f"{cls.__module__}.{cls.__qualname__}",
            "frontend": frontend,
            "platform": platform,
            "method": method,
            "enabled": enabled,
            "reason": reason,
        }
        with _report_lock:
            _report[(cls, frontend, platform)] = row

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Generic entry (for forward_native(*args, **kwargs)); subclasses get a generated one."""
        return self._dispatch(args, kwargs)

    def _dispatch(self, args: tuple, kwargs: dict) -> Any:
        """The full dispatch: torch.compile hook, cached resolution, validation, the call, fallback."""
        incomplete = any(a is _MISSING for a in args) or any(v is _MISSING for v in kwargs.values())
        if incomplete:
            args, kwargs = _without_missing(args, kwargs)
        if _torch_compiling():  # Dynamo is tracing: see dualop/backends/torch/library.py
            return _compile_hook(self, args, kwargs)
        first = args[0] if args else next(iter(kwargs.values()), None)
        override = _current_config()
        # The generated fast path's guard: same array type and device type, same config override,
        # nothing re-registered or reconfigured since.
        hit = self._armed
        if (
            type(first) is hit.array_type and override is hit.override
            and hit.generation == _platforms._generation and (hit.probe is None or hit.probe(first))
        ):
            method = hit.method
        else:
            method = self._lookup(first, override)
        if incomplete or not type(self).validates_own_inputs(method.__name__):
            self.check_inputs(*args, **kwargs)  # a call missing an argument: its error names it
        try:
            return method(*args, **kwargs)
        except NotImplementedError as err:
            return self._declined(method, err, args, kwargs)

    def _declined(self, method: Any, err: NotImplementedError, args: tuple, kwargs: dict) -> Any:
        if method.__name__ == "forward_native":
            raise err
        first = args[0] if args else next(iter(kwargs.values()), None)
        return self._fall_back(method.__name__, _platforms.frontend_of(first), err, args, kwargs)

    def _lookup(self, first: Any, override: _config.OpsConfig | None) -> Any:
        """The method for (frontend and platform of ``first``, the active config), from the dispatch
        cache or resolved on a miss; that entry becomes the last hit, guarded for reuse where
        ``first`` allows a cheap guard. ``override`` is the context's raw config value (None without
        one), what the guard compares by identity."""
        frontend = _platforms.frontend_of(first)
        if frontend is None:
            raise TypeError(
                f"{type(self).name or type(self).__qualname__}: expected a torch.Tensor or jax.Array as the "
                f"first argument, got {type(first).__module__}.{type(first).__qualname__}"
            )
        platform = _platforms.platform_of(first, frontend)
        entry = self._current_entry(frontend, platform, override or _config._process_default)
        if _compile_hook is None and frontend != "jax":
            _install_torch_support()
        # A torch tensor's frontend and platform follow its device type: where devices can
        # differ, the guard holds a probe for it (and there is none without a cheap probe).
        reusable, probe = _platforms.reuse_guard(first, frontend)
        if reusable:
            entry = entry.guarded_by(type(first), override, probe)
            self._resolutions[entry.key] = entry
        self._armed = entry
        return entry.method

    def _current_entry(self, frontend: str, platform: str, cfg: _config.OpsConfig) -> _Resolution:
        """The dispatch cache's entry for (frontend, platform, cfg) in the current platform
        generation, resolved now if it is missing or stale."""
        generation = _platforms._generation
        entry = self._resolutions.get((frontend, platform, cfg.dispatch_key))
        if entry is None or entry.generation != generation:
            entry = self._resolve(frontend, cfg, generation, platform)
        return entry

    forward = __call__

    def _fall_back(self, method: str, frontend: str, err: NotImplementedError, args, kwargs):
        """A platform method declined this call: run forward_native, say so in the report and in
        ``last_fallback``."""
        self.note_decline(method, err, args[0] if args else next(iter(kwargs.values()), None))
        return self.forward_native(*args, **kwargs)

    def note_decline(self, method: str, err: NotImplementedError, first: Any) -> None:
        """Record that ``method`` declined a call whose first array is ``first`` (in the report and
        ``last_fallback``), for an op that finishes the call natively itself (``modular_fused_moe``
        keeps its collectives out of the retry)."""
        frontend = _platforms.frontend_of(first)
        detail = str(err) or "NotImplementedError"
        platform = _platforms.platform_of(first, frontend)
        enabled = self.enforce_enable or self.enabled()
        reason = f"{method} declined this call ({detail}), so forward_native"
        self.last_fallback = reason
        self._record(frontend, platform, "forward_native", enabled, reason)

    @classmethod
    def _call_parameters(cls) -> tuple[str, ...]:
        """Names of the call's parameters (those of forward_native), in order; set at class creation
        so torch.compile never traces its computation."""
        names = cls.__dict__.get("_call_parameter_names") or _parameter_names(cls)
        if names is None:
            raise TypeError(f"{cls.__qualname__}.forward_native must name its parameters for torch.compile")
        return names

    def resolution(self, frontend: str, platform: str | None = None) -> tuple[str, str]:
        """``(method, reason)``: what a call from ``frontend`` on ``platform`` (None: that frontend's
        process-wide platform, ``current_platform``) resolves to under the active config, resolving
        now if no call has; per-call declines are ``last_run``'s."""
        if platform is None:
            platform = _platforms.current_platform(frontend)
        entry = self._current_entry(frontend, platform, _config.get_config())
        return entry.name, entry.reason

    def dispatched_method(self, frontend: str) -> str:
        """Name of the method a call from ``frontend`` resolves to under the active config, on that
        frontend's process-wide platform (``current_platform``)."""
        return self.resolution(frontend)[0]

    def last_run(self, frontend: str, platform: str | None = None) -> tuple[str, str]:
        """``(method, reason)`` of what this instance ran for ``frontend`` on ``platform`` (None: the
        process-wide one) under the active config since ``last_fallback`` was cleared:
        ``forward_native`` and the decline's reason if a platform method declined a call, else the
        resolution. ``last_fallback`` is set only on that declining path (the kernel path does no
        extra work), so clear it before the calls to observe (``op.last_fallback = None``). A kernel
        ran exactly when the method is not ``forward_native``."""
        if self.last_fallback is not None:
            return "forward_native", self.last_fallback
        return self.resolution(frontend, platform)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}({self.extra_repr()})"
