"""Compile Triton kernels for real GPUs on a host with no GPU.

Each variant's ``forward_cuda`` (``forward_hip`` for ROCm targets, if the op has one) runs on
torch ``meta`` tensors inside ``dualop.kernels.cuda.compile_target(target)``; every Triton launch
it makes is captured instead of run (``capture_launches``), then specialised exactly as Triton's
own launcher would (its binder and ``_pack_args``: argument types, constexprs, divisibility
attributes, options such as ``num_warps``) and handed to ``triton.compile`` for the target:
LLVM and ptxas for CUDA, LLVM and the AMDGPU backend for ROCm.

Triton decides between compiler and interpreter when a ``@triton.jit`` function is defined, and a
host with no GPU runs dualop's kernels in the interpreter. So compiling happens in a child process
started with ``TRITON_INTERPRET=0`` (``compile_in_child``; its entry point is this module's
``main``), whatever state the calling process is in. The child also gets a fresh Triton cache, so
every kernel is really compiled (and timed), never loaded from an earlier run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

from dualop.aot.result import KernelResult, first_line
from dualop.aot.variants import Variant, check_dtypes, variants_for

__all__ = ["Launch", "capture_launches", "compile_launch", "compile_variant", "compile_in_child", "main",
           "triton_available"]


@dataclasses.dataclass
class Launch:
    """One ``kernel[grid](*args, **kwargs)`` a launch wrapper made."""

    fn: Any  # triton.runtime.jit.JITFunction
    args: tuple
    kwargs: dict
    grid: Any


@contextlib.contextmanager
def capture_launches() -> Iterator[list[Launch]]:
    """Record every Triton kernel launch in the block instead of running it."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs, grid))
        return None

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def _triton_target(target):
    from triton.backends.compiler import GPUTarget

    return GPUTarget(target.backend, target.arch, target.warp_size)


# The ``knobs.compilation`` settings ``JITFunction.run`` passes to its binder as keywords, in the
# triton releases that have them.
LAUNCH_COMPILATION_KNOBS = ("instrumentation_mode", "fpsan_homomorphic_casts")


def _source_and_options(launch: Launch, target):
    """The ``ASTSource`` and options Triton's launcher would compile this launch with on ``target``."""
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    backend = make_backend(_triton_target(target))
    kwargs = dict(launch.kwargs)
    # What JITFunction.run adds before binding: the debug flag, and each compilation knob this
    # triton has (3.8 added instrumentation_mode, 3.9 fpsan_homomorphic_casts; a triton without the
    # knob neither passes it nor accepts it as a keyword).
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    for name in LAUNCH_COMPILATION_KNOBS:
        if hasattr(knobs.compilation, name):
            kwargs[name] = getattr(knobs.compilation, name)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(fn, signature, constexprs, attrs), options


def _register_use(target, compiled, log: str) -> dict[str, Any]:
    """Registers and spills as the backend reports them: ptxas ``-v`` for CUDA, the AMDGCN
    assembly's metadata for ROCm. Missing numbers stay None."""
    out: dict[str, Any] = {"registers": None, "spills": None}
    if target.backend == "cuda":
        regs = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        out["registers"] = int(regs.group(1)) if regs else None
        out["spills"] = f"{spill.group(1)}B st/{spill.group(2)}B ld" if spill else None
    else:
        asm = compiled.asm.get("amdgcn", "")
        if isinstance(asm, bytes):
            asm = asm.decode(errors="replace")
        vgprs = re.search(r"NumVgprs:\s*(\d+)", asm)
        counts = [int(n) for n in re.findall(r"\.[sv]gpr_spill_count:\s*(\d+)", asm)]
        out["registers"] = int(vgprs.group(1)) if vgprs else None
        out["spills"] = str(sum(counts)) if counts else None
    return out


# Kernels already compiled in this process: (target, source hash, options) -> (details, error).
_DONE: dict[tuple, tuple[dict[str, Any], str | None]] = {}


def compile_launch(launch: Launch, target) -> tuple[dict[str, Any], str | None]:
    """Compile one captured launch for ``target`` (a ``GpuTarget``). Returns the kernel's details
    (grid, num_warps, num_stages, shared memory, registers, spills, seconds) and None, or the
    details so far and the compiler's refusal (its first line)."""
    import triton
    from triton import knobs

    src, options = _source_and_options(launch, target)
    grid = launch.grid if isinstance(launch.grid, tuple) else tuple(launch.grid)
    details: dict[str, Any] = {"kernel": launch.fn.__name__, "grid": grid}
    key = (target.name, src.hash(), json.dumps(options.__dict__, sort_keys=True, default=str))
    if key in _DONE:
        done, error = _DONE[key]
        return dict(done, grid=grid, cached=True), error
    start = time.perf_counter()
    log = io.StringIO()
    saved = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report (registers, spills) is printed: keep it
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=_triton_target(target), options=options.__dict__)
    except Exception as err:
        error = first_line(err)
        details["error"] = error
        details["seconds"] = time.perf_counter() - start
        _DONE[key] = (details, error)
        return details, error
    finally:
        knobs.nvidia.dump_ptxas_log = saved
    md = compiled.metadata
    details.update(num_warps=md.num_warps, num_stages=md.num_stages, shared_bytes=md.shared)
    details.update(_register_use(target, compiled, log.getvalue()))
    details["seconds"] = time.perf_counter() - start
    _DONE[key] = (details, None)
    return details, None


def _meta_inputs(variant: Variant) -> list[Any]:
    import torch

    from dualop.aot.variants import map_specs

    return [map_specs(s, lambda s: torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="meta"))
            for s in variant.inputs]


def compile_variant(variant: Variant, target_name: str) -> KernelResult:
    """Capture ``variant``'s Triton launches for the target and compile each. ``n/a`` when the op
    declines the target (``NotImplementedError``, e.g. fp8 below sm_89) or launches nothing."""
    from dualop.kernels import cuda
    from dualop.platforms import override_platform

    target = cuda.GPU_TARGETS[target_name]
    start = time.perf_counter()
    op = variant.make_op()
    hip = target.backend == "hip"
    method = op.forward_hip if hip and type(op)._implements("forward_hip") else op.forward_cuda
    result = KernelResult(status="ok")
    with override_platform("rocm" if hip else "cuda"), cuda.compile_target(target), capture_launches() as launches:
        try:
            method(*_meta_inputs(variant), **variant.case.options)
        except NotImplementedError as err:
            result.status, result.message = "n/a", first_line(err)
        except Exception as err:
            result.status, result.message = "refused", f"launch wrapper: {first_line(err)}"
    if result.status == "ok" and not launches:
        result.status, result.message = "n/a", f"{method.__name__} launched no Triton kernel"
    if result.status == "ok":
        for launch in launches:
            details, error = compile_launch(launch, target)
            result.kernels.append(details)
            if error is not None and result.status == "ok":
                result.status, result.message = "refused", f"{details['kernel']}: {error}"
        result.cached = all(k.get("cached") for k in result.kernels)
    result.seconds = time.perf_counter() - start
    return result


def child_environment(cache_dir: str) -> dict[str, str]:
    """The environment of the compiling child: compiled-mode Triton, a fresh kernel cache, and no
    autoloaded torch device backends (torch_tpu would start libtpu for nothing)."""
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "0"
    env["TRITON_CACHE_DIR"] = cache_dir
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    return env


def triton_available() -> str | None:
    """None if the GPU builds can run here (triton and torch are installed: the child captures
    launches on torch meta tensors and compiles them with triton), else why not and which extra
    installs them. Looks the packages up without importing them."""
    import importlib.util

    missing = [name for name in ("triton", "torch") if importlib.util.find_spec(name) is None]
    if missing:
        return (f"the GPU targets need triton and torch (not installed: {', '.join(missing)}): "
                "pip install 'dualop[torch,triton]'")
    return None


def compile_in_child(ops: list[str] | None, dtypes: list[str], targets: list[str],
                     progress: bool, serving_dtypes: list[str] | None = None,
                     serving_targets: list[str] | None = None) -> dict[tuple, KernelResult]:
    """Run ``python -m dualop.aot.gpu`` for ``targets``; results keyed by (case label, dtype,
    shape, target). Without triton or torch, or if the child dies, every cell is ``unavailable``
    with the reason (``triton_available``) or the child's last error line."""

    def unavailable(why: str) -> dict[tuple, KernelResult]:
        return {(v.case.label, v.dtype, v.shape, t): KernelResult(status="unavailable", message=why)
                for v in variants_for(ops, dtypes, serving_dtypes) for t in targets}

    why = triton_available()
    if why is not None:
        return unavailable(why)
    with tempfile.TemporaryDirectory(prefix="dualop-compile-") as tmp:
        out = os.path.join(tmp, "results.json")
        cmd = [sys.executable, "-m", "dualop.aot.gpu", "--targets", ",".join(targets),
               "--dtypes", ",".join(dtypes), "--out", out]
        if ops:
            cmd += ["--ops", ",".join(ops)]
        if serving_dtypes is not None:
            cmd += ["--serving-dtypes", ",".join(serving_dtypes)]
        gpu_serving = None if serving_targets is None else [t for t in serving_targets if t in targets]
        if gpu_serving is not None:
            cmd += ["--serving-targets", ",".join(gpu_serving)]
        if not progress:
            cmd.append("--no-progress")
        proc = subprocess.run(cmd, env=child_environment(os.path.join(tmp, "triton-cache")),
                              stderr=None if progress else subprocess.PIPE, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = ([ln for ln in (proc.stderr or "").splitlines() if ln.strip()][-1:]
                    or [f"exit status {proc.returncode} (its messages are above)"])
            return unavailable(f"the Triton compiling process failed: {tail[0]}")
        with open(out) as fh:
            rows = json.load(fh)
    return {(r["case"], r["dtype"], tuple(r["shape"]), r["target"]): KernelResult(**r["result"]) for r in rows}


def _csv(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def main(argv: list[str] | None = None) -> int:
    """The child: compile every variant for every GPU target named, write JSON rows to ``--out``."""
    p = argparse.ArgumentParser(prog="python -m dualop.aot.gpu")
    p.add_argument("--targets", required=True)
    p.add_argument("--dtypes")
    p.add_argument("--ops")
    p.add_argument("--serving-dtypes")
    p.add_argument("--serving-targets")
    p.add_argument("--out", required=True)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("dualop.aot.gpu: needs TRITON_INTERPRET=0 (compiled-mode Triton)", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    from tqdm import tqdm

    from dualop.kernels.cuda import GPU_TARGETS

    targets = _csv(args.targets) or []
    unknown = [t for t in targets if t not in GPU_TARGETS]
    if unknown:
        print(f"dualop.aot.gpu: unknown GPU target(s) {unknown}", file=sys.stderr)
        return 2
    serving = _csv(args.serving_dtypes)
    variants = variants_for(_csv(args.ops), check_dtypes(_csv(args.dtypes)), None if serving is None else check_dtypes(serving))
    from dualop.aot import builds_here

    serving_targets = None if args.serving_targets is None else _csv(args.serving_targets) or []
    work = [(v, t) for t in targets for v in variants if builds_here(v, t, serving_targets)]
    rows = []
    for v, t in tqdm(work, desc="dualop compile (Triton)", unit="kernel", disable=args.no_progress,
                     dynamic_ncols=True):
        rows.append({"case": v.case.label, "dtype": v.dtype, "shape": list(v.shape), "target": t,
                     "result": compile_variant(v, t).as_dict()})
    with open(args.out, "w") as fh:
        json.dump(rows, fh, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
