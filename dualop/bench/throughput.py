"""Throughput of each op against the peers a user would pick instead, with the copy roofline.

For each case x shape x dtype x frontend, every implementation is first called once and checked
against ``op.forward_native`` (eager for torch, jitted for jax) on the same inputs under the
tolerance table (``dualop.testing``); one
that disagrees or fails becomes an error record and is not timed. The rest, plus a copy of the
input's size in the same frontend, run interleaved in balanced orders (``timing.measure``): the
copy's bandwidth, measured in the same rounds, is the roofline.

Implementations. torch: ``dualop-default`` (``op(*args)`` under the active config: whatever dualop
dispatches to here), ``dualop-native`` (``op(*args)`` with ``custom_ops=["none"]``),
``torch-eager`` (``op.forward_native`` called directly), ``torch-compile``
(``torch.compile(op.forward_native)``; its first call, the compilation, is ``warmup_s``),
``torch-builtin`` (``torch.nn.functional``, where the case has one), ``vllm-kernel`` (vLLM's own
compiled kernel, where vLLM is installed and has one: ``dualop.bench.vllm_peers``). jax: ``dualop-default``
(``jax.jit`` of ``op(*args)``) and ``jax-handwritten`` (``jax.jit`` of a plain ``jax.numpy``
version). Peers are the non-dualop implementations.
"""

from __future__ import annotations

import functools
import gc
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from dualop.bench.cases import ITEMSIZE, BenchCase
from dualop.bench.memory import ALLOCATOR_REUSE
from dualop.bench.roofline import check_device, predict
from dualop.bench.timing import COPY_ENTRY, check_counts, copy_fn, measure, median, paired_ratio, relative_range
from dualop.config import OpsConfig, set_config

__all__ = [
    "IMPLS",
    "FRONTEND_IMPLS",
    "SIZES",
    "FRONTENDS",
    "parse_sizes",
    "check_dtypes",
    "check_impls",
    "check_frontends",
    "run_throughput",
]

IMPLS: tuple[str, ...] = (
    "dualop-default",
    "dualop-native",
    "torch-eager",
    "torch-compile",
    "torch-builtin",
    "vllm-kernel",
    "jax-handwritten",
)
FRONTEND_IMPLS: dict[str, tuple[str, ...]] = {
    "torch": ("dualop-default", "dualop-native", "torch-eager", "torch-compile", "torch-builtin", "vllm-kernel"),
    "jax": ("dualop-default", "jax-handwritten"),
}
FRONTENDS: tuple[str, ...] = tuple(FRONTEND_IMPLS)
# Named sizes of x: (tokens, hidden) for norms, (tokens, 2 * d) for gated activations.
SIZES: dict[str, tuple[int, int]] = {"small": (4096, 4096), "large": (16384, 4096)}
# ``dualop-native``: every op takes forward_native.
NATIVE_CONFIG = OpsConfig(["none"])
# With freed memory reused, up to this many extra warm-up rounds while the heap still grows (page
# faults) to the case's working set; with the system allocator every round faults, so none.
SETTLE_ROUNDS = 12
_EXPLICIT_SIZE = re.compile(r"([1-9][0-9]*)x([1-9][0-9]*)")


def _is_peer(impl: str) -> bool:
    return not impl.startswith("dualop-")


def _check_names(flag: str, names: Iterable[str], valid: Iterable[str]) -> list[str]:
    if isinstance(names, str):
        raise TypeError(f"{flag}: expected a list of names, got the string {names!r}")
    names, valid = list(names), list(valid)
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(f"{flag}: unknown {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
    if not names:
        raise ValueError(f"{flag}: no names given; valid: {', '.join(valid)}")
    return names


def parse_sizes(names: Iterable[str]) -> list[tuple[int, int]]:
    """``small``, ``large`` or ``RxC`` (e.g. ``64x256``) -> shapes of x."""
    if isinstance(names, str):
        raise TypeError(f"--sizes: expected a list of sizes, got the string {names!r}")
    shapes = []
    for name in names:
        m = _EXPLICIT_SIZE.fullmatch(name)
        if name in SIZES:
            shapes.append(SIZES[name])
        elif m:
            shapes.append((int(m.group(1)), int(m.group(2))))
        else:
            raise ValueError(f"--sizes: unknown {name!r}; valid: {', '.join(SIZES)}, or ROWSxCOLS such as 64x256")
    if not shapes:
        raise ValueError(f"--sizes: no sizes given; valid: {', '.join(SIZES)}, or ROWSxCOLS")
    return shapes


def check_dtypes(names: Iterable[str]) -> list[str]:
    return _check_names("--dtypes", names, ITEMSIZE)


def check_impls(names: Iterable[str]) -> list[str]:
    return _check_names("--impls", names, IMPLS)


def check_frontends(names: Iterable[str]) -> list[str]:
    return _check_names("--frontends", names, FRONTENDS)


# --- implementations ---------------------------------------------------------------------------


def _bound(fn: Callable[..., Any] | None, options: dict[str, Any]) -> Callable[..., Any] | None:
    """``fn`` with the case's keyword options bound (static: before any ``jit`` sees them)."""
    return functools.partial(fn, **options) if fn is not None and options else fn


def _torch_impls(case: BenchCase, op: Any, wanted: Iterable[str]) -> dict[str, Callable[..., Any]]:
    import torch

    from dualop.bench.vllm_peers import vllm_peer

    def dualop_native(*args: Any, **kwargs: Any) -> Any:
        with set_config(NATIVE_CONFIG):
            return op(*args, **kwargs)

    def compiled() -> Callable[..., Any]:
        torch._dynamo.reset()  # a fresh compilation per case: no recompile limit, honest warm-up
        return torch.compile(_bound(op.forward_native, dict(case.options)), dynamic=False)

    makers: dict[str, Callable[[], Callable[..., Any] | None]] = {
        "dualop-default": lambda: op,
        "dualop-native": lambda: dualop_native,
        "torch-eager": lambda: op.forward_native,
        "torch-compile": compiled,
        "torch-builtin": lambda: case.torch_builtin(op) if case.torch_builtin else None,
        "vllm-kernel": lambda: vllm_peer(case.label, op),
    }
    fns = {name: makers[name]() for name in FRONTEND_IMPLS["torch"] if name in wanted}
    options = {} if case.written is not None else dict(case.options)
    return {name: fn if name == "torch-compile" else _bound(fn, options) for name, fn in fns.items() if fn is not None}


def _jax_impls(case: BenchCase, op: Any, wanted: Iterable[str]) -> dict[str, Callable[..., Any]]:
    import jax

    fns: dict[str, Callable[..., Any]] = {}
    options = dict(case.options)
    if "dualop-default" in wanted:
        fns["dualop-default"] = jax.jit(lambda *args: op(*args, **options))
    if "jax-handwritten" in wanted and case.jax_handwritten is not None:
        fns["jax-handwritten"] = jax.jit(_bound(case.jax_handwritten(op), options))
    return fns


# Implementations whose first call compiles (jax: every jit); their first call is reported.
def _compiles(frontend: str, impl: str) -> bool:
    return frontend == "jax" or impl == "torch-compile"


def _method(op: Any, frontend: str, impl: str) -> str | None:
    """The method dualop's dispatcher picks for a dualop implementation (None for peers)."""
    if impl == "dualop-default":
        return op.dispatched_method(frontend)
    if impl == "dualop-native":
        with set_config(NATIVE_CONFIG):
            return op.dispatched_method(frontend)
    return None


def _call_of(case: BenchCase, impl: str, args: tuple) -> tuple[tuple, dict]:
    """The arguments ``impl`` takes: a written form's split into the op's positional and keyword
    arguments (outputs by keyword), except for a vLLM kernel, which takes its outputs positionally."""
    if case.written is None or impl == "vllm-kernel":
        return args, {}
    return case.written(args)


def _copies(case: BenchCase, args: tuple) -> tuple:
    """Fresh copies of a written form's inputs (a check must not see an earlier call's writes)."""
    if case.written is None:
        return args
    return tuple(a.clone() if hasattr(a, "clone") else a for a in args)


# --- checking ----------------------------------------------------------------------------------


def _leaves(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _disagreement(got: Any, want: Any, dtype: str, normwise: bool = False) -> str | None:
    """Why ``got`` does not match the native body's ``want`` under the tolerance table, or None.
    ``normwise``: against the output's scale, as the tests compare sums of products (a ``matrix``
    case: GEMMs whose peers may round their operands at other points)."""
    from dualop.testing import compare, to_numpy, tolerance_for

    g_leaves, w_leaves = _leaves(got), _leaves(want)
    if len(g_leaves) != len(w_leaves):
        return f"returns {len(g_leaves)} arrays, forward_native returns {len(w_leaves)}"
    for i, (g, w) in enumerate(zip(g_leaves, w_leaves)):
        if str(g.dtype) != str(w.dtype):
            return f"output {i} has dtype {g.dtype}, forward_native's has {w.dtype}"
        key, tol = tolerance_for(dtype, w)
        res = compare(to_numpy(g), to_numpy(w), key, normwise=normwise)
        if not res.ok:
            detail = res.detail or f"max abs {res.max_abs:.3g}, max rel {res.max_rel:.3g}"
            return (f"output {i} disagrees with forward_native: {detail} "
                    f"(tolerance {key}: atol {tol.atol:g}, rtol {tol.rtol:g})")
    return None


# --- one case ----------------------------------------------------------------------------------


def _run_case(
    case: BenchCase,
    shape: tuple[int, int],
    dtype: str,
    frontend: str,
    wanted: list[str],
    rounds: int,
    warmup: int,
    allocator: str,
    rng: np.random.Generator,
    on_step: Callable[[str], None],
) -> list[dict]:
    shape = case.input_shape(shape)
    base = {"op": case.label, "op_name": case.op_name, "frontend": frontend, "shape": list(shape), "dtype": dtype}
    sync = None
    if frontend == "jax":
        import jax

        sync = jax.block_until_ready

    def finish(out: Any) -> Any:
        return out if sync is None else sync(out)

    def error(impl: str, why: str) -> dict:
        return {**base, "impl": impl, "error": why, "median_s": None, "gbps": None,
                "roofline_fraction": None, "allocator": allocator}

    on_step("inputs")
    try:
        op = case.make_op(shape[-1])
        args = case.inputs(shape, dtype, frontend, rng)
        # The reference runs as the frontend runs code: eager for torch, jit for jax (XLA fuses
        # and reassociates under jit, which moves ill-conditioned spots such as gelu's 1 + erf(x)
        # for x < -3 by more than the tolerance table allows between eager and jit).
        native = _bound(op.forward_native, dict(case.options))
        if frontend == "jax":
            import jax

            native = jax.jit(native)
        native_args, native_kwargs = _call_of(case, "torch-eager", _copies(case, args))
        want = finish(native(*native_args, **native_kwargs))
        fns = (_torch_impls if frontend == "torch" else _jax_impls)(case, op, wanted)
    except Exception as err:  # bad shape for this op, a missing frontend piece
        return [error(impl, f"{type(err).__name__}: {err}") for impl in FRONTEND_IMPLS[frontend] if impl in wanted]

    records: list[dict] = []
    ready: dict[str, Callable[..., Any]] = {}
    first_call_s: dict[str, float] = {}
    for impl, fn in fns.items():
        on_step(f"check {impl}")
        try:
            call_args, call_kwargs = _call_of(case, impl, _copies(case, args))
            t0 = time.perf_counter()
            got = finish(fn(*call_args, **call_kwargs))
            first_call_s[impl] = time.perf_counter() - t0
            why = _disagreement(got, want, dtype, normwise=case.matrix)
            del got
        except Exception as err:
            why = f"{type(err).__name__}: {err}"
        if why is None:
            ready[impl] = fn
        else:
            records.append(error(impl, why))
    del want
    if not ready:
        return records

    on_step(f"time {len(ready)} impls")
    copy, copy_bytes = copy_fn(shape, dtype, frontend)
    thunks: dict[str, Callable[[], Any]] = {}
    for impl, fn in ready.items():
        call_args, call_kwargs = _call_of(case, impl, args)
        thunks[impl] = functools.partial(fn, *call_args, **call_kwargs)
    thunks[COPY_ENTRY] = copy
    try:
        samples = measure(thunks, rounds, warmup, sync, settle=SETTLE_ROUNDS if allocator == ALLOCATOR_REUSE else 0)
    except Exception as err:
        return records + [error(impl, f"failed while timed: {type(err).__name__}: {err}") for impl in ready]
    finally:
        del thunks, copy

    times = samples.times
    copy_gbps = copy_bytes / median(times[COPY_ENTRY]) / 1e9
    moved = case.bytes_moved(shape, ITEMSIZE[dtype])
    peers = [impl for impl in ready if _is_peer(impl)]
    best_peer = min(peers, key=lambda p: median(times[p])) if peers else None
    for impl in ready:
        t = times[impl]
        gbps = moved / median(t) / 1e9
        rec = {
            **base,
            "impl": impl,
            "method": _method(op, frontend, impl),
            "median_s": median(t),
            "spread": relative_range(t),
            "times_s": t,
            "rounds": len(t),
            "warmup_rounds": samples.warmup_rounds,
            "bytes": moved,
            "gbps": gbps,
            "copy_gbps": copy_gbps,
            "copy_spread": relative_range(times[COPY_ENTRY]),
            "roofline_fraction": gbps / copy_gbps,
            "best_peer": best_peer,
            "vs_best_peer": paired_ratio(t, times[best_peer]) if best_peer else None,
            "minor_faults": median(samples.faults[impl]) if samples.faults is not None else None,
            "allocator": allocator,
        }
        if _compiles(frontend, impl):
            rec["warmup_s"] = first_call_s[impl]
        if frontend == "jax" and impl == "dualop-default" and "jax-handwritten" in ready:
            rec["same_hlo_as_handwritten"] = _compiled_hlo(ready[impl], args) == _compiled_hlo(
                ready["jax-handwritten"], args)
        records.append(rec)
    return records


def _compiled_hlo(fn: Any, args: tuple) -> list[str]:
    """The optimised HLO XLA compiles ``fn`` (a ``jax.jit`` function) to, without what differs
    between two spellings of one computation: names, source metadata, the stack-frame tables.
    Equal lists mean the dispatch and the op's body cost nothing after tracing."""
    text = fn.lower(*args).compile().as_text()
    body = text[text.find("\n%"):]  # the computations, after the module's header tables
    body = re.sub(r", metadata=\{[^}]*\}", "", body)
    body = re.sub(r"%[\w.\-]+", "%v", body)
    body = re.sub(r"^ENTRY %v \([^)]*\)", "ENTRY", body, flags=re.M)
    body = re.sub(r"parameter\((\d+)\).*$", r"parameter(\1)", body, flags=re.M)
    return sorted(line.strip() for line in body.splitlines() if line.strip())


def run_throughput(
    cases: list[BenchCase],
    shapes: list[tuple[int, int]],
    dtypes: list[str],
    frontends: list[str],
    impls: list[str] | None = None,
    rounds: int = 7,
    warmup: int = 2,
    allocator: str = "system",
    progress: bool = True,
    seed: int = 0,
    device: str | None = None,
) -> list[dict]:
    """Time every case x shape x dtype x frontend (see the module docstring); one record per
    implementation. ``allocator`` is recorded as given (``dualop.bench.memory`` says which).
    ``device`` (a ``roofline.DEVICES`` name): add that device's predicted time (``predicted_s``) and
    ``vs_predicted`` = median / predicted, for runs on that hardware."""
    from tqdm import tqdm

    check_dtypes(dtypes)
    check_frontends(frontends)
    wanted = check_impls(IMPLS if impls is None else impls)
    check_counts(rounds, warmup)
    if device is not None:
        check_device(device)
    combos = [(c, s, d, f) for c in cases for s in shapes for d in dtypes for f in frontends
              if any(i in wanted for i in FRONTEND_IMPLS[f]) and (c.written is None or f == "torch")]
    rng = np.random.default_rng(seed)
    records: list[dict] = []
    bar = tqdm(combos, desc="throughput", unit="case", disable=not progress, leave=False)
    for case, shape, dtype, frontend in bar:
        label = f"{case.label} {shape[0]}x{shape[1]} {dtype} {frontend}"

        def on_step(step: str, label: str = label) -> None:
            bar.set_postfix_str(f"{label}: {step}", refresh=True)

        found = _run_case(case, shape, dtype, frontend, wanted, rounds, warmup, allocator, rng, on_step)
        if device is not None:
            predicted = predict(case, shape, dtype, device)["predicted_s"]
            for rec in found:
                if rec.get("median_s") is not None:
                    rec.update(device=device, predicted_s=predicted, vs_predicted=rec["median_s"] / predicted)
        records.extend(found)
        gc.collect()  # the case's inputs and outputs, before the next case allocates its own
    bar.close()
    if "torch-compile" in wanted and "torch" in frontends:
        import torch

        torch._dynamo.reset()
    return records
