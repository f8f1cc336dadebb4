"""What ``dualop check`` and the test suite share: the one tolerance table, the op cases (inputs
and shapes for every registered op), and moving numpy data into and out of each frontend.

Comparison rule: ``|got - want| <= atol + rtol * |want|`` elementwise, NaN only where the
reference has NaN. Kernels and native bodies both compute in float32 and cast once, so the table
allows for summation order in float32 and two units in the last place of a 16-bit result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

__all__ = [
    "NoLaunch",
    "TOLERANCES",
    "Tolerance",
    "OpCase",
    "CASES",
    "cases_for",
    "compare",
    "to_frontend",
    "to_numpy",
    "frontend_available",
    "frontend_context",
    "memory_mappings",
    "release_compiled_code_near_map_limit",
]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# One tolerance table for every comparison of a fast path against forward_native.
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-5, rtol=1e-5),
    "bfloat16": Tolerance(atol=1e-5, rtol=1.6e-2),  # 2 ulp of an 8-bit significand
    "float16": Tolerance(atol=1e-5, rtol=2e-3),  # 2 ulp of an 11-bit significand
    "float8_e4m3fn": Tolerance(atol=2.0**-9, rtol=0.125),  # 1 ulp of a 4-bit significand; 2^-9 = one subnormal step
    "float8_e4m3fnuz": Tolerance(atol=2.0**-10, rtol=0.125),  # the same; fnuz's subnormal step is 2^-10
    # Integer outputs (grouped_topk's expert ids) must be equal.
    "int32": Tolerance(atol=0.0, rtol=0.0),
    "int64": Tolerance(atol=0.0, rtol=0.0),
}
# The input dtypes ops are checked in; outputs are compared under their own dtype's row.
DTYPES = ("float32", "bfloat16", "float16")


def tolerance_for(input_dtype: str, output: Any) -> tuple[str, Tolerance]:
    """The row of TOLERANCES for one output: its own dtype's if listed, else the input dtype's."""
    name = str(output.dtype).removeprefix("torch.")
    key = name if name in TOLERANCES else input_dtype
    return key, TOLERANCES[key]


@dataclasses.dataclass(frozen=True)
class Comparison:
    ok: bool
    max_abs: float
    max_rel: float
    detail: str = ""


def compare(got: np.ndarray, want: np.ndarray, dtype: str, *, normwise: bool = False,
            widened_nonfinite: bool = False) -> Comparison:
    """Compare two float32 numpy arrays under ``TOLERANCES[dtype]``: each element within
    ``atol + rtol * |want|``, or with ``normwise`` within ``atol + rtol * max|want|`` (for sums of
    products of large inputs, where an element's relative error measures cancellation, not the
    kernel: two summation orders of the same float32 terms differ by their sum of magnitudes'
    rounding, not the result's). NaN must sit exactly where ``want`` has NaN, and ``want``'s
    infinities must be matched exactly, unless ``widened_nonfinite``: for kernels that run a scan or a convolution as GEMMs over a masked
    (triangular, banded) matrix, a non-finite input meets the mask's zeros (0 x inf = NaN) and
    turns more outputs of its chunk non-finite than the recurrence does, and the order of summing
    infinities picks NaN or +-inf; then every non-finite ``want`` must be non-finite in ``got``
    (nothing lost) and the outputs finite in both are compared."""
    tol = TOLERANCES[dtype]
    if got.shape != want.shape:
        return Comparison(False, float("inf"), float("inf"), f"shape {got.shape} != {want.shape}")
    if got.size == 0:
        return Comparison(True, 0.0, 0.0)
    if widened_nonfinite:
        lost = ~np.isfinite(want) & np.isfinite(got)
        if lost.any():
            return Comparison(False, float("nan"), float("nan"), "a non-finite output came out finite")
        both = np.isfinite(want) & np.isfinite(got)
        return compare(got[both], want[both], dtype, normwise=normwise)
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    if not np.array_equal(nan_got, nan_want):
        return Comparison(False, float("nan"), float("nan"), "NaN positions differ")
    finite = ~nan_want
    g, w = got[finite], want[finite]
    inf_want = np.isinf(w)  # an infinity is matched exactly (its tolerance would be infinite)
    if np.any(g[inf_want] != w[inf_want]):
        return Comparison(False, float("inf"), float("inf"), "an infinite output differs")
    g, w = g[~inf_want], w[~inf_want]
    diff = np.abs(g - w)
    rel = diff / np.maximum(np.abs(w), np.finfo(np.float32).tiny)
    finite_w = np.abs(w[np.isfinite(w)])
    scale = (finite_w.max() if finite_w.size else 0.0) if normwise else np.abs(w)
    ok = bool(np.all(diff <= tol.atol + tol.rtol * scale))
    max_abs = float(diff.max()) if diff.size else 0.0
    max_rel = float(rel.max()) if rel.size else 0.0
    return Comparison(ok, max_abs, max_rel)


# --- frontends ------------------------------------------------------------------------------


def _ensure_pjrt_device() -> None:
    """torch_xla needs PJRT_DEVICE; with no TPU attached, use its CPU client. Its lazy graphs are
    compiled whole, and XLA's default excess precision then skips the bfloat16 roundings the ops
    spell out, so forward_native (the reference a kernel is checked against) would round where its
    fusions fall: the checks turn that off (``--xla_allow_excess_precision=false``) unless
    ``XLA_FLAGS`` already sets it. (Seen: a mixer's native body 1-2 bf16 ulp away from itself run op
    by op, outside the table at small outputs.)"""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_allow_excess_precision" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_allow_excess_precision=false".strip()
    if "PJRT_DEVICE" not in os.environ:
        from dualop.platforms import tpu_attached

        os.environ["PJRT_DEVICE"] = "TPU" if tpu_attached() else "CPU"


def prepare_triton() -> str | None:
    """Import dualop's Triton package first (it picks the interpreter when there is no GPU);
    return why Triton cannot be used here, or None."""
    try:
        import dualop.kernels.cuda  # noqa: F401
        import triton  # noqa: F401
    except ImportError as err:
        return f"{type(err).__name__}: {err}"
    return None


def frontend_available(frontend: str) -> str | None:
    """None if ``frontend`` can run here, else the reason it cannot."""
    try:
        if frontend == "torch":
            import torch  # noqa: F401
        elif frontend == "jax":
            import jax  # noqa: F401
        elif frontend == "torch_xla":
            _ensure_pjrt_device()
            import torch_xla  # noqa: F401
            import jax  # noqa: F401
        elif frontend == "torchax":
            import torchax  # noqa: F401
            import torchax.interop  # noqa: F401
        elif frontend == "torch_tpu":
            import jax  # noqa: F401
            import torch
            import torch_tpu  # noqa: F401

            if torch._C._get_privateuse1_backend_name() != "tpu":
                return "torch_tpu found no TPU (its tpu device is not registered)"
        else:
            return f"unknown frontend {frontend!r}"
    except Exception as err:  # ImportError, or a broken install
        return f"{type(err).__name__}: {err}"
    return None


def frontend_context(frontend: str):
    """The context torch code on this frontend's tensors must run in (torchax's environment)."""
    import contextlib

    if frontend == "torchax":
        import torchax

        return torchax.default_env()
    return contextlib.nullcontext()


def _torch_dtype(dtype: str):
    import torch

    return getattr(torch, dtype)


@dataclasses.dataclass(frozen=True)
class Pinned:
    """An input whose dtype does not follow the case's dtype (a float32 scale, an int index)."""

    array: np.ndarray
    dtype: str


def to_frontend(a: Any, frontend: str, dtype: str) -> Any:
    """float32 numpy -> an array of ``frontend`` in ``dtype``. None and Python scalars pass through;
    a ``Pinned`` input keeps its own dtype; a structured input (one with ``map_arrays``, such as a
    ``QuantizedWeight``) has each of its arrays converted."""
    if a is None or isinstance(a, (bool, int, float)):
        return a
    if hasattr(a, "map_arrays"):
        return a.map_arrays(lambda v: to_frontend(v, frontend, dtype))
    if isinstance(a, Pinned):
        a, dtype = a.array, a.dtype
    if frontend == "jax":
        import jax.numpy as jnp

        return jnp.asarray(a).astype(dtype)
    import torch

    # A copy even in the numpy array's own dtype: an op that updates an input in place (a state
    # cache) must not change the numpy inputs the native body is then run on.
    t = torch.from_numpy(np.ascontiguousarray(a)).to(_torch_dtype(dtype), copy=True)
    if frontend == "torch":
        return t
    if frontend == "torch_xla":
        import torch_xla

        return t.to(torch_xla.device())
    if frontend == "torchax":
        import torchax

        return torchax.default_env().to_xla(t)
    if frontend == "torch_tpu":
        return t.to("tpu")
    raise ValueError(f"unknown frontend {frontend!r}")


def materialize(values: Any) -> None:
    """Run the pending lazy work behind ``values`` as one graph before they are read. torch_xla
    otherwise compiles and runs a graph per tensor read, each holding everything the tensor
    depends on (a mixer's three outputs: its interpreted kernels compiled three times)."""
    torch = sys.modules.get("torch")
    if torch is None or not any(isinstance(v, torch.Tensor) and v.device.type == "xla" for v in values):
        return
    import torch_xla

    torch_xla.sync()


def to_numpy(x: Any) -> np.ndarray:
    """Any frontend's array -> float32 numpy (float8 and bfloat16 values are exact in float32)."""
    mod = type(x).__module__
    if mod.startswith("torchax"):
        from torchax.interop import jax_view

        return np.asarray(jax_view(x)).astype(np.float32)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().to("cpu").to(torch.float32).numpy()
    return np.asarray(x).astype(np.float32)


# --- op cases -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpCase:
    """One way to call a registered op, with the shapes ``dualop check`` and the tests use.

    ``make_op(shape)`` builds the op for inputs of ``shape``; ``make_inputs(shape, rng)`` returns
    float32 numpy positional arguments (None for absent optional ones); ``options`` are the call's
    keyword arguments (static options such as attention's ``sm_scale``), the same for every shape.
    ``traits`` name what the shared test sweeps must know about the case (``TRAITS`` says each
    one's meaning). ``native_cells``: ``{(frontend, platform): reason}`` for kernel cells where
    this case runs the native body (a part of the reason the cell reports); ``native_dtypes`` the
    same per ``(frontend, platform, dtype)`` for a kernel that declines one dtype at run time;
    ``kernel_in_native_cells``: ``{(frontend, platform): method}`` where the op has a kernel in a
    cell that is native for other ops (``NATIVE_CELLS``).
    """

    op: str
    label: str
    make_op: Callable[[tuple[int, ...]], Any]
    make_inputs: Callable[[tuple[int, ...], np.random.Generator], tuple]
    shapes: tuple[tuple[int, ...], ...]
    options: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    traits: frozenset[str] = frozenset()
    native_cells: Mapping[tuple[str, str], str] = dataclasses.field(default_factory=dict, hash=False)
    native_dtypes: Mapping[tuple[str, str, str], str] = dataclasses.field(default_factory=dict, hash=False)
    kernel_in_native_cells: Mapping[tuple[str, str], str] = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "traits", frozenset(self.traits))
        unknown = sorted(self.traits - TRAITS.keys())
        if unknown:
            raise ValueError(f"OpCase {self.label}: unknown trait(s) {unknown}; known: {sorted(TRAITS)}")
        cells = {(f, p) for f, p, _ in KERNEL_CELLS} | set(self.kernel_in_native_cells)
        for where, field in ((self.native_cells, "native_cells"), (self.native_dtypes, "native_dtypes")):
            stray = sorted(str(k) for k in where if tuple(k[:2]) not in cells)
            if stray:
                raise ValueError(f"OpCase {self.label}: {field} names no kernel cell: {stray}; cells: {sorted(cells)}")
        stray = sorted(str(k) for k in self.kernel_in_native_cells if k not in NATIVE_CELLS)
        if stray:
            raise ValueError(f"OpCase {self.label}: kernel_in_native_cells names no native cell: {stray}")


# The (frontend, platform) cells that run a kernel, with the method that runs there: every case
# passes them against forward_native, except where its ``native_cells`` says it has no kernel
# (ROCm runs the same Triton kernels as CUDA).
KERNEL_CELLS: tuple[tuple[str, str, str], ...] = (
    ("torch", "cpu", "forward_cpu"),
    ("torch", "cuda", "forward_cuda"),
    ("jax", "tpu", "forward_tpu"),
    ("torch_xla", "tpu", "forward_tpu"),
    ("torchax", "tpu", "forward_tpu"),
)
# Cells where ops have no kernel, with (a part of) the reason each reports; a case's
# ``kernel_in_native_cells`` names the method of an op that does have one there.
NATIVE_CELLS: dict[tuple[str, str], str] = {
    ("jax", "cpu"): "no CPU kernel for jax arrays: XLA compiles the native body",
    ("jax", "cuda"): "would need jax-triton",
}

# What an OpCase's ``traits`` may say, and what each means to the shared test sweeps.
TRAITS: dict[str, str] = {
    "structured_inputs": "inputs are not rows of one hidden size (attention over a paged cache, a mixer's packed "
                         "sequences and state caches): the property sweep leaves the case to its op's own tests",
    "case_shapes_only": "the shape tuple is structured (experts, packed sequences, images, a vocabulary): the "
                        "property sweep draws only the case's own shapes",
    "contraction": "outputs sum products over an input dim (GEMMs, convolutions, scans, attention): at large "
                   "magnitudes compared against the output's scale (compare(normwise=True))",
    "cancelling": "outputs cancel large terms element by element (a tanh GELU's 1 + tanh(z), a sparse gate's "
                  "g - (mean + k std)): at large magnitudes compared against the output's scale",
    "soft_capped": "logits under a soft cap: drawn at unit scale only (the cap saturates large ones)",
    "widens_nonfinite": "kernels run a scan or a causal convolution as GEMMs over a masked matrix: a non-finite "
                        "input widens to the rest of its chunk (compare(widened_nonfinite=True))",
    "spatial": "the shape tuple is x's [N, C, *spatial] (a convolution)",
    "image_grid": "the shape tuple is x's [B, H, W, dim], an image's grid of tokens (SAM's attention)",
    "token_table": "the shape tuple is (tokens, vocab, org_vocab, dim), not an input's shape",
    "packed_sequences": "the shape tuple is (tokens, sequences, widths...) of a packed serving batch",
    "mixer": "a whole Mamba mixer: its kernel ops have cells of their own, it interprets several Pallas kernels "
             "per shape",
    "fp8_inputs": "an input in a float8 dtype (an fp8 KV cache): torch.library's opcheck cannot run the case (its "
                  "schema test does arithmetic on every input, and torch has no float8 multiply on the CPU), so "
                  "the opcheck sweep leaves it out; its library op is still checked against the eager call",
    "untyped_inputs": "an input a torch.library schema cannot type (a QuantizedWeight): inside torch.compile the "
                      "enabled op is refused at trace time naming the argument, and torch.library's opcheck does "
                      "not apply (the torch.library sweeps check that refusal instead)",
    "not_differentiable": "no gradient to check: a rounding op, one writing a cache in place, or a GEMM on a "
                          "quantized weight (served, not trained: its kernels have no backward)",
}


# Shapes most cases use: a hidden size off the 128-lane grid, a single token, zero tokens, 3-D.
NORM_SHAPES = ((0, 128), (1, 200), (13, 384), (2, 3, 136))
GATED_SHAPES = ((0, 256), (1, 200), (13, 768), (2, 3, 272))


def normal(shape, rng, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def x_only(scale: float = 3.0):
    """``make_inputs`` for ops called as ``op(x)``."""

    def make(shape, rng):
        return (normal(shape, rng, scale),)

    return make


class NoLaunch:
    """Stands in for a kernel entry (a ``KernelRef``): a launch fails the test. Tests put it in
    place of an op's kernels to show bad input is refused before any kernel runs."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a kernel launched on bad input")

    def resolve(self) -> NoLaunch:
        return self


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now: the rendezvous of a ``torch.distributed`` group a test spawns."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int) -> Iterator[None]:
    """One rank of a test's ``torch.multiprocessing.spawn``: the default process group, gloo, of
    ``world`` ranks meeting at 127.0.0.1:``port`` (``free_port``). On a clean exit the ranks meet at a
    barrier and then destroy the group together, as ``destroy_process_group`` asks of every rank:
    a rank that tears down its connections while a peer still talks on them can abort that peer's
    process. On an error the group is destroyed at once (the error is the report; ``spawn``
    terminates the other ranks). The current tensor-parallel group is cleared either way."""
    import torch.distributed as dist

    from dualop import parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()
    finally:
        parallel.set_tensor_parallel(None)
        dist.destroy_process_group()


def memory_mappings() -> int | None:
    """How many memory mappings this process has (``/proc/self/maps`` lines; None off Linux)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def release_compiled_code_near_map_limit(fraction: float = 0.5) -> bool:
    """Clear jax's caches when this process holds more than ``fraction`` of the kernel's mapping
    limit (``vm.max_map_count``, 65530 by default); True if it did.

    XLA:CPU maps each executable's machine code into the process (about three mappings each) and
    keeps it while jax's caches hold the executable. A long run that compiles tens of thousands of
    programs (the test suite, with Pallas kernels interpreted) reaches the limit; then LLVM's JIT
    fails with "Cannot allocate memory" and the process aborts. Clearing the caches unmaps them;
    later calls compile again what they need."""
    jax = sys.modules.get("jax")
    count = memory_mappings()
    if jax is None or count is None:
        return False
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        limit = 65530
    if count < fraction * limit:
        return False
    import gc

    jax.clear_caches()
    gc.collect()
    return True


def _build_cases() -> list[OpCase]:
    """Every op module's ``check_cases()``, in registry order (an op family defines its own), with
    the module's ``CASE_NOTES`` applied: ``{op name or case label: {OpCase field: value}}`` (traits
    and cell expectations; an op's notes go to each of its cases, a label's to that case, traits
    adding up)."""
    import importlib

    from dualop.spec import op_modules

    cases: list[OpCase] = []
    for name in op_modules():
        module = importlib.import_module(name)
        provider = getattr(module, "check_cases", None)
        if provider is not None:
            cases.extend(with_notes(case, getattr(module, "CASE_NOTES", {})) for case in provider())
    return cases


def with_notes(case: OpCase, notes: Mapping[str, Mapping[str, Any]]) -> OpCase:
    """``case`` with the notes for its op, then for its label (see ``_build_cases``)."""
    fields: dict[str, Any] = {}
    for key in (case.op, case.label):
        for field, value in notes.get(key, {}).items():
            if field not in ("traits", "native_cells", "native_dtypes", "kernel_in_native_cells"):
                raise ValueError(f"CASE_NOTES[{key!r}]: {field!r} is not a note an OpCase takes")
            if field == "traits":
                fields[field] = frozenset(fields.get(field, case.traits)) | frozenset(value)
            else:
                fields[field] = {**fields.get(field, getattr(case, field)), **value}
    return dataclasses.replace(case, **fields) if fields else case


CASES: list[OpCase] = []


def check_op_names(names: list[str] | None, command: str) -> None:
    """A command's ``--ops``: every name must be a registered op (``ValueError`` naming the command)."""
    from dualop.custom_op import CustomOp

    unknown = [n for n in names or () if n not in CustomOp.op_registry]
    if unknown:
        raise ValueError(f"{command}: unknown op(s) {unknown}; registered: {sorted(CustomOp.op_registry)}")


def listing_text(value: Any) -> str:
    """``value`` as the ``--list`` listings of ``dualop check``, ``compile`` and ``bench`` print it:
    arrays by shape, dtype and a digest of their bytes; ops by class name and constructor
    arguments; without module paths, so that moving code changes no listing."""
    import hashlib
    import re

    if isinstance(value, Pinned):
        return f"pinned({value.dtype}, {listing_text(value.array)})"
    if hasattr(value, "map_arrays"):  # a structured input: its kind and its arrays
        return f"{type(value).__name__}({listing_text(getattr(value, 'quant', ''))}, {listing_text(value.arrays())})"
    if isinstance(value, np.ndarray):
        digest = hashlib.sha1(np.ascontiguousarray(value).tobytes()).hexdigest()[:12]
        return f"{value.dtype}{list(value.shape)}#{digest}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(listing_text(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {listing_text(v)}" for k, v in sorted(value.items())) + "}"
    ctor = getattr(value, "_ctor", None)
    if isinstance(ctor, str):
        return re.sub(r'"[\w.]+:([\w.]+)"', r"\1", ctor)
    if hasattr(value, "forward_native"):
        return type(value).__qualname__
    return re.sub(r"\b[\w.]+\.(\w+) object at 0x[0-9a-f]+", r"\1", repr(value))


def cases_for(names: list[str] | None = None) -> Iterator[OpCase]:
    """The cases of the named ops (all registered ops with a case when None)."""
    if not CASES:
        CASES.extend(_build_cases())
    for case in CASES:
        if names is None or case.op in names or case.label in names:
            yield case
