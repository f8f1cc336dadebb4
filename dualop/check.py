"""``dualop check``: run every registered op through every implementation reachable here and
compare each against ``forward_native`` on the same inputs.

A cell is (op case, frontend, platform); within it every dtype and every shape of the case runs.
It is a *kernel* cell when a kernel ran for every shape (the rule is ``CustomOp``'s: a kernel ran
exactly when the method that ran is not ``forward_native``; see ``dualop.custom_op``). Statuses:
``pass``/``fail`` (a kernel ran and did / did not match forward_native within the tolerance table),
``native`` (forward_native ran, so nothing was checked; ``detail`` says why), ``error`` (an
exception), ``unavailable`` (the frontend is not installed here; a frontend that is installed but
fails to import is an ``error``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from dualop import testing
from dualop.config import OpsConfig, set_config
from dualop.custom_op import CustomOp
from dualop.platforms import override_platform

__all__ = ["CellResult", "DEFAULT_CELLS", "MODEL_PATHS", "ModelResult", "STATUSES", "case_listing", "run_check",
           "run_model_check", "default_cells", "format_model_table", "frontend_missing"]

# (frontend, platform) pairs that take a distinct path.
DEFAULT_CELLS: tuple[tuple[str, str], ...] = (
    ("torch", "cpu"),
    ("torch", "cuda"),
    ("torch", "rocm"),
    ("jax", "cpu"),
    ("jax", "tpu"),
    ("jax", "cuda"),
    ("torch_xla", "tpu"),
    ("torchax", "tpu"),
)
# Every status a cell can have, worst first (the matrix shows the worst over dtypes).
STATUSES = ("error", "fail", "native", "pass", "unavailable")


@dataclasses.dataclass
class CellResult:
    op: str
    case: str
    frontend: str
    platform: str
    dtype: str
    status: str
    method: str = ""
    path: str = ""
    max_abs: float = 0.0
    max_rel: float = 0.0
    atol: float = 0.0
    rtol: float = 0.0
    shapes: int = 0
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def default_cells(frontends: Iterable[str] | None = None, platforms: Iterable[str] | None = None):
    fr = set(frontends) if frontends else None
    pl = set(platforms) if platforms else None
    return [
        (f, p) for f, p in DEFAULT_CELLS if (fr is None or f in fr) and (pl is None or p in pl)
    ]


# The packages each frontend needs, as installed distributions import them.
_FRONTEND_PACKAGES = {"torch": ("torch",), "jax": ("jax",), "torch_xla": ("torch_xla", "jax"), "torchax": ("torchax",)}


def frontend_missing(frontend: str) -> bool:
    """Whether a package ``frontend`` needs is not installed at all (then its cells are
    unavailable); an installed one that fails to import is a broken install, not an absence."""
    import importlib.util

    return any(importlib.util.find_spec(p) is None for p in _FRONTEND_PACKAGES.get(frontend, (frontend,)))


def _path(method: str, frontend: str, op: Any = None) -> str:
    """Human description of what a method ran on this machine. An op whose platform methods run
    no dualop kernel (the vendor matmul does the work) says what they run instead in its class's
    ``kernel_description``."""
    own = getattr(type(op), "kernel_description", None)
    if own:
        return own
    if method in ("forward_tpu",):
        from dualop.kernels.pallas.common import interpret_mode

        mode = interpret_mode(frontend)
        kind = "compiled" if mode is False else ("interpret" if mode is True else "tpu-interpret")
        bridge = {"jax": "", "torch_xla": " via torch_xla call_jax", "torchax": " via torchax call_jax"}[frontend]
        return f"pallas ({kind}){bridge}"
    if method in ("forward_cpu", "forward_cuda", "forward_hip") and frontend == "jax":
        return "xla (jax kernel path: ragged_dot experts, cuDNN attention)"  # the jax-array kernels off TPUs
    if method in ("forward_cuda", "forward_hip"):
        from dualop.kernels.cuda import interpreting

        return "triton (interpreter)" if interpreting() else "triton"
    if method == "forward_cpu":
        return "torch cpu"
    return method.removeprefix("forward_")


def _outputs(result: Any) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _run_cell(case: testing.OpCase, frontend: str, platform: str, dtype: str, seed: int,
              max_shapes: int | None = None) -> CellResult:
    tol = testing.TOLERANCES[dtype]
    res = CellResult(case.op, case.label, frontend, platform, dtype, "pass", atol=tol.atol, rtol=tol.rtol)
    rng = np.random.default_rng(seed)
    with override_platform(platform), set_config(OpsConfig(["all"])), testing.frontend_context(frontend):
        for shape in case.shapes[:max_shapes]:
            op = case.make_op(shape)
            inputs = case.make_inputs(shape, rng)
            args = tuple(testing.to_frontend(a, frontend, dtype) for a in inputs)
            op.last_fallback = None
            got = _outputs(op(*args, **case.options))
            res.method, reason = op.last_run(frontend, platform)
            if res.method == "forward_native":
                res.status, res.detail, res.path = "native", reason, "native"
                return res
            res.path = _path(res.method, frontend, op)
            # Fresh inputs: an op that updates an argument in place (reshape_and_cache) must be
            # compared with the native body run on the untouched originals, not its own result.
            want = _outputs(op.forward_native(*(testing.to_frontend(a, frontend, dtype) for a in inputs), **case.options))
            testing.materialize([*got, *want])
            for g, w in zip(got, want, strict=True):
                if g is None or w is None:  # an output that is None when an optional input is (rope's key)
                    if (g is None) != (w is None) and res.status != "fail":
                        res.status = "fail"
                        res.detail = f"shape {shape}: an output is None in only one of the kernel and forward_native"
                    continue
                key, out_tol = testing.tolerance_for(dtype, w)
                if key != dtype:
                    res.detail = res.detail or f"outputs in {key} compared with atol={out_tol.atol}, rtol={out_tol.rtol}"
                cmp = testing.compare(testing.to_numpy(g), testing.to_numpy(w), key)
                res.max_abs = max(res.max_abs, cmp.max_abs)
                res.max_rel = max(res.max_rel, cmp.max_rel)
                if not cmp.ok and res.status != "fail":
                    res.status = "fail"
                    res.detail = f"shape {shape}: {cmp.detail or 'outside tolerance'}"
            res.shapes += 1
    return res


def case_listing(ops: list[str] | None = None) -> list[str]:
    """``dualop check --list``: one sorted line per (case, shape): the op, the op built for the
    shape, the call's options and its inputs (shapes, dtypes, digests of the values); the same
    for every cell and dtype."""
    testing.check_op_names(ops, "dualop check")
    lines = []
    for case in testing.cases_for(ops):
        for shape in case.shapes:
            inputs = case.make_inputs(tuple(shape), np.random.default_rng(0))
            lines.append(f"{case.label} | op {case.op} | shape {tuple(shape)} | "
                         f"{testing.listing_text(case.make_op(tuple(shape)))} | options "
                         f"{testing.listing_text(case.options)} | inputs {testing.listing_text(inputs)}")
    return sorted(lines)


def run_check(
    ops: list[str] | None = None,
    frontends: list[str] | None = None,
    platforms: list[str] | None = None,
    dtypes: list[str] | None = None,
    progress: bool = True,
    seed: int = 0,
    max_shapes: int | None = None,
) -> list[CellResult]:
    """Run the check matrix; return one result per (case, frontend, platform, dtype). With
    ``max_shapes`` each case runs only its first shapes (the quick sweep: 1)."""
    from tqdm import tqdm

    dtypes = list(dtypes or ("float32", "bfloat16"))
    for d in dtypes:
        if d not in testing.DTYPES:
            raise ValueError(f"dualop check: unknown dtype {d!r}; expected one of {list(testing.DTYPES)}")
    testing.check_op_names(ops, "dualop check")
    cells = default_cells(frontends, platforms)
    if any(p in ("cuda", "rocm") for _, p in cells):
        testing.prepare_triton()  # before torch_xla can import triton in compiled mode
    cases = list(testing.cases_for(ops))
    results: list[CellResult] = []
    unavailable, broken = {}, {}
    for fe in {f for f, _ in cells}:
        why = testing.frontend_available(fe)
        if why is not None:
            (unavailable if frontend_missing(fe) else broken)[fe] = why
    work = [(c, f, p, d) for c in cases for f, p in cells for d in dtypes]
    bar = tqdm(work, desc="dualop check", unit="cell", disable=not progress, dynamic_ncols=True)
    for case, fe, platform, dtype in bar:
        bar.set_postfix_str(f"{case.label} {fe}/{platform} {dtype}", refresh=False)
        if fe in unavailable or fe in broken:
            status = "unavailable" if fe in unavailable else "error"
            results.append(CellResult(case.op, case.label, fe, platform, dtype, status,
                                      detail=unavailable.get(fe) or f"{fe} is installed but does not import: {broken[fe]}"))
            continue
        # thousands of interpreted programs in one process: unmap jax's compiled code before the
        # mapping limit (testing.release_compiled_code_near_map_limit says why; seen in 'xla')
        testing.release_compiled_code_near_map_limit()
        try:
            results.append(_run_cell(case, fe, platform, dtype, seed, max_shapes))
        except Exception as err:  # reported as a failing cell, never swallowed
            _reset_pallas_interpreter()
            results.append(
                CellResult(case.op, case.label, fe, platform, dtype, "error", detail=f"{type(err).__name__}: {err}")
            )
    return results


def _reset_pallas_interpreter() -> None:
    """After an exception inside a TPU-interpreted kernel, its simulated state must be reset."""
    import sys

    pltpu = sys.modules.get("jax.experimental.pallas.tpu")
    reset = getattr(pltpu, "reset_tpu_interpret_mode_state", None) if pltpu else None
    if reset is not None:
        try:
            reset()
        except Exception:
            pass


def registered_without_case() -> list[str]:
    covered = {c.op for c in testing.cases_for(None)}
    return sorted(set(CustomOp.op_registry) - covered)


def failed(results: list[CellResult]) -> bool:
    return any(r.status in ("fail", "error") for r in results)


def format_table(results: list[CellResult]) -> str:
    """Long table (one line per cell and dtype) followed by a compact op x cell matrix."""
    head = ("op case", "frontend", "platform", "path", "dtype", "status", "max_abs", "max_rel", "atol", "rtol")
    rows = [head]
    for r in results:
        if r.status == "unavailable":
            continue
        checked = r.status in ("pass", "fail")
        rows.append((
            r.case, r.frontend, r.platform, r.path or "-", r.dtype, r.status.upper(),
            f"{r.max_abs:.2e}" if checked else "-", f"{r.max_rel:.2e}" if checked else "-",
            f"{r.atol:.0e}", f"{r.rtol:.1e}",
        ))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))

    # matrix: one line per case, one column per (frontend, platform); worst status over dtypes.
    # A native cell names its reason by a footnote number: the reasons are too long for a column.
    order = {status: i for i, status in enumerate(STATUSES)}
    cells = list(dict.fromkeys((r.frontend, r.platform) for r in results))
    cases = list(dict.fromkeys(r.case for r in results))
    worst: dict[tuple, CellResult] = {}
    for r in results:
        key = (r.case, r.frontend, r.platform)
        if key not in worst or order[r.status] < order[worst[key].status]:
            worst[key] = r
    reasons = list(dict.fromkeys(r.detail for r in worst.values() if r.status == "native"))
    mark = {"pass": "ok", "fail": "FAIL", "error": "ERROR", "unavailable": "n/a"}

    def cell_mark(r: CellResult) -> str:
        return f"native ({reasons.index(r.detail) + 1})" if r.status == "native" else mark[r.status]

    col_names = [f"{f}/{p}" for f, p in cells]
    case_w = max(len(c) for c in cases + ["op case"])
    col_w = [max(len(n), 10) for n in col_names]
    lines += ["", "matrix (worst over dtypes; ok/FAIL: a kernel ran and was checked; native (n): forward_native "
                  "ran, for reason n below):",
              "  ".join(["op case".ljust(case_w)] + [n.ljust(w) for n, w in zip(col_names, col_w)])]
    for c in cases:
        lines.append("  ".join([c.ljust(case_w)] + [cell_mark(worst[(c, f, p)]).ljust(w)
                                                     for (f, p), w in zip(cells, col_w)]).rstrip())
    if reasons:
        lines += ["", "native reasons:"] + [f"  ({i}) {reason}" for i, reason in enumerate(reasons, 1)]

    grouped: dict[tuple[str, str, str], list[str]] = {}
    for r in results:
        if r.status in ("fail", "error") and r.detail:
            grouped.setdefault((f"{r.frontend}/{r.platform}", r.status, r.detail), []).append(r.case)
    notes = [
        f"{cell} {status} ({', '.join(dict.fromkeys(cases))}): {detail}"
        for (cell, status, detail), cases in grouped.items()
    ]
    unavailable = sorted({(r.frontend, r.detail) for r in results if r.status == "unavailable"})
    if unavailable:
        notes += [f"frontend {f} unavailable here: {d}" for f, d in unavailable]
    # Only a run over every op names the ops it cannot reach: a run filtered with --ops is about its own.
    covers_every_op = {r.op for r in results} >= {c.op for c in testing.cases_for(None)}
    missing = registered_without_case() if covers_every_op else []
    if missing:
        notes.append(f"registered ops with no check case: {', '.join(missing)}")
    if notes:
        lines += ["", "notes:"] + [f"  {n}" for n in dict.fromkeys(notes)]
    lines += ["", summary(results)]
    return "\n".join(lines)


def summary(results: list[CellResult]) -> str:
    """One line: kernel cells (passed, failed) apart from native, error and unavailable ones;
    a cell here is one (op case, frontend, platform, dtype)."""
    count = {status: sum(r.status == status for r in results) for status in STATUSES}
    return (
        f"kernel cells: {count['pass']} passed, {count['fail']} failed; "
        f"{count['native']} native (no kernel ran; reasons above); {count['error']} errors; "
        f"{count['unavailable']} unavailable"
    )


# --- a whole model through the kernel paths ------------------------------------------------------

# (frontend, platform) paths a model runs on: the C++ CPU kernels, Triton (interpreted off a GPU),
# XLA for jax arrays on the CPU, Pallas (interpreted off a TPU).
MODEL_PATHS: tuple[tuple[str, str], ...] = (("torch", "cpu"), ("torch", "cuda"), ("jax", "cpu"), ("jax", "tpu"))
# A Llama small enough to run every path in seconds, interpreted kernels included.
QUICK_LLAMA = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)
QUICK_PROMPTS = ([1, 17, 42, 7, 99], [3, 5, 8])


@dataclasses.dataclass
class ModelResult:
    """One path of the model check: ``pass`` when its greedy tokens equal transformers'."""

    frontend: str
    platform: str
    status: str
    tokens: list = dataclasses.field(default_factory=list)
    want: list = dataclasses.field(default_factory=list)
    kernel_ops: list = dataclasses.field(default_factory=list)  # ops that ran a kernel: "op (method)"
    native_ops: list = dataclasses.field(default_factory=list)  # ops that ran forward_native: "op (reason)"
    seconds: float = 0.0
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def run_model_check(frontends: list[str] | None = None, platforms: list[str] | None = None,
                    new_tokens: int = 4, progress: bool = True) -> list[ModelResult]:
    """A tiny random Llama (saved by transformers) loaded by ``dualop.models`` on each of
    ``MODEL_PATHS`` (filtered): its greedy tokens against transformers' ``generate`` on the same
    checkpoint, and which ops ran a kernel there (the dispatch report)."""
    import importlib.util
    import tempfile
    import time

    from tqdm import tqdm

    from dualop import models
    from dualop.custom_op import clear_dispatch_report, dispatch_report

    paths = [(f, p) for f, p in MODEL_PATHS if (not frontends or f in frontends) and (not platforms or p in platforms)]
    missing = [m for m in ("torch", "transformers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        why = f"needs {', '.join(missing)} (the reference and the checkpoint): pip install 'dualop[models]'"
        return [ModelResult(f, p, "unavailable", detail=why) for f, p in paths]
    import torch
    import transformers

    results = []
    with tempfile.TemporaryDirectory(prefix="dualop-check-model-") as tmp:
        torch.manual_seed(0)
        reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**QUICK_LLAMA)).eval()
        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()  # its "Writing model shards" bar, for a 2 MB file
        try:
            reference.save_pretrained(tmp)
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
        with torch.no_grad():
            want = [reference.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                                       pad_token_id=0)[0, len(p):].tolist() for p in QUICK_PROMPTS]
        bar = tqdm(paths, desc="dualop check: model", unit="path", disable=not progress, dynamic_ncols=True)
        for frontend, platform in bar:
            bar.set_postfix_str(f"{frontend}/{platform}", refresh=False)
            why = testing.frontend_available(frontend)
            if why is not None:
                results.append(ModelResult(frontend, platform, "unavailable" if frontend_missing(frontend) else "error",
                                           want=want, detail=why))
                continue
            if platform in ("cuda", "rocm"):
                triton_why = testing.prepare_triton()
                if triton_why is not None:
                    results.append(ModelResult(frontend, platform, "unavailable", want=want, detail=triton_why))
                    continue
            clear_dispatch_report()
            start = time.perf_counter()
            try:
                with override_platform(platform), set_config(OpsConfig(["all"])):
                    model = models.from_pretrained(tmp, frontend=frontend, dtype="float32", max_model_len=64,
                                                   max_num_seqs=2, max_num_batched_tokens=16)
                    tokens = model.generate([list(p) for p in QUICK_PROMPTS], new_tokens, stop_at_eos=False)
            except Exception as err:  # reported as the path's error, never swallowed
                _reset_pallas_interpreter()
                results.append(ModelResult(frontend, platform, "error", want=want,
                                           seconds=time.perf_counter() - start, detail=f"{type(err).__name__}: {err}"))
                continue
            rows = [r for r in dispatch_report() if r["frontend"] == frontend and r["platform"] == platform]
            kernels = sorted({f"{r['op'] or r['cls']} ({r['method']})" for r in rows if r["method"] != "forward_native"})
            native = sorted({f"{r['op'] or r['cls']}: {r['reason']}" for r in rows if r["method"] == "forward_native"})
            ok = tokens == want
            results.append(ModelResult(frontend, platform, "pass" if ok else "fail", tokens, want, kernels, native,
                                       time.perf_counter() - start,
                                       "" if ok else "greedy tokens differ from transformers' generate"))
    return results


def format_model_table(results: list[ModelResult]) -> str:
    """One line per path: status, seconds, how many ops ran a kernel; then the ops per path."""
    if not results:
        return ""
    lines = ["model: a 2-layer random Llama, greedy tokens against transformers' generate "
             f"({len(QUICK_PROMPTS)} prompts)"]
    for r in results:
        head = f"  {r.frontend}/{r.platform}: {r.status.upper()}"
        if r.status in ("pass", "fail"):
            head += f" in {r.seconds:.1f} s; kernels ran for {len(r.kernel_ops)} ops, forward_native for {len(r.native_ops)}"
        lines.append(head + (f" ({r.detail})" if r.detail and r.status != "pass" else ""))
        if r.status in ("pass", "fail"):
            if r.kernel_ops:
                lines.append(f"    kernels: {', '.join(r.kernel_ops)}")
            lines += [f"    native: {n}" for n in r.native_ops]
            if r.status == "fail":
                lines.append(f"    tokens {r.tokens}, transformers {r.want}")
    return "\n".join(lines)


def model_failed(results: list[ModelResult]) -> bool:
    return any(r.status in ("fail", "error") for r in results)
