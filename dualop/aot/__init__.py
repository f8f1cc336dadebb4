"""``dualop compile``: build every kernel variant with the real TPU and GPU compilers, run nothing.

A variant is an op case x dtype x shape (``variants.py``: the shapes ``dualop check`` runs plus
serving shapes). For each target it is ``ok`` (the compiler accepted every kernel), ``refused``
(the compiler's first message line), ``n/a`` (the op declines that target, with its reason) or
``unavailable`` (this machine cannot run that compiler). TPU targets compile in this process
(``tpu.py``); GPU targets in a child process with compiled-mode Triton (``gpu.py``).

This proves the real compilers accept the kernels for those chips (tiling, VMEM and shared-memory
limits, supported types and primitives). It cannot show runtime behaviour or speed.
"""

from __future__ import annotations

import collections
from typing import Any

from dualop.aot.result import STATUSES, KernelResult
from dualop.aot.variants import InputSpec, Variant, check_dtypes, servings, variants_for

__all__ = [
    "DEFAULT_TARGETS",
    "TPU_TARGETS",
    "gpu_target_names",
    "check_targets",
    "run_compile",
    "variant_listing",
    "format_matrix",
    "format_details",
    "format_collectives",
    "format_summary",
    "exit_status",
    "servings",
    "STATUSES",
]

DEFAULT_TARGETS = ("v4", "v5e", "v5p", "v6e", "tpu7x", "sm80", "sm90", "gfx942")


def _tpu_names() -> tuple[str, ...]:
    from dualop.aot.tpu import TOPOLOGIES

    return tuple(TOPOLOGIES)


TPU_TARGETS = _tpu_names()


def gpu_target_names() -> tuple[str, ...]:
    """The GPU targets ``dualop.kernels.cuda`` knows. Importing it imports torch, and torch may
    autoload a device backend that imports triton (torch_tpu does); with ``TRITON_INTERPRET`` unset
    that triton is compiled-mode, so this process declares compiled mode before the import (it
    never runs a Triton kernel: the GPU builds happen in a child process, see ``gpu.py``)."""
    import os

    os.environ.setdefault("TRITON_INTERPRET", "0")
    from dualop.kernels.cuda import GPU_TARGETS

    return tuple(GPU_TARGETS)


def check_targets(targets: list[str] | None) -> list[str]:
    """The requested targets (default ``DEFAULT_TARGETS``), or a ValueError naming the unknown ones.
    ``<generation>:<topology>`` (``v6e:2x4``) is a multi-chip target for the sharded layers
    (``sharded.py``)."""
    from dualop.aot.sharded import is_sharded_target

    targets = list(targets or DEFAULT_TARGETS)
    known = TPU_TARGETS + gpu_target_names()
    unknown = [t for t in targets if t not in known and not is_sharded_target(t)]
    if unknown:
        raise ValueError(f"dualop compile: unknown target(s) {unknown}; expected some of {list(known)}, or a TPU "
                         f"topology such as v5e:2x2 or v6e:2x4 for the sharded layers")
    return list(dict.fromkeys(targets))


def _row(variant: Variant, target: str, result: KernelResult) -> dict[str, Any]:
    return {
        "op": variant.case.op,
        "case": variant.case.label,
        "dtype": variant.dtype,
        "shape": list(variant.shape),
        "serving": variant.serving,
        "target": target,
        **result.as_dict(),
    }


def run_compile(ops: list[str] | None = None, targets: list[str] | None = None, dtypes: list[str] | None = None,
                progress: bool = True, sharded_serving: bool = False,
                serving_dtypes: list[str] | None = None,
                serving_targets: list[str] | None = None) -> list[dict[str, Any]]:
    """Compile every variant for every target; one row per (variant, target). Topology targets
    (``v5e:2x2``) build the sharded layers instead, at model sizes too with ``sharded_serving``.
    Serving shapes are built in ``serving_dtypes`` only (default: all of ``dtypes``) and for
    ``serving_targets`` only (default: every target; the check shapes are built for all)."""
    targets = check_targets(targets)
    if serving_targets is not None:
        stray = [t for t in serving_targets if t not in targets]
        if stray:
            raise ValueError(f"dualop compile: --serving-targets {stray} are not among --targets {targets}")
    dtypes = check_dtypes(dtypes)
    if serving_dtypes is not None:
        serving_dtypes = check_dtypes(serving_dtypes)
    variants = variants_for(ops, dtypes, serving_dtypes)  # checks the op names
    rows: list[dict[str, Any]] = []
    from dualop.aot.sharded import is_sharded_target

    sharded = [t for t in targets if is_sharded_target(t)]
    gpu = [t for t in targets if t not in TPU_TARGETS and t not in sharded]
    tpu = [t for t in targets if t in TPU_TARGETS]
    by_key: dict[tuple, KernelResult] = {}
    if gpu:
        from dualop.aot.gpu import compile_in_child

        by_key.update(compile_in_child(ops, dtypes, gpu, progress, serving_dtypes, serving_targets))
    if tpu:
        by_key.update(_compile_tpu(variants, tpu, progress, serving_targets))
    layer_rows = _compile_sharded(ops, dtypes, sharded, progress, sharded_serving) if sharded else {}
    for t in targets:
        if t in sharded:
            rows += layer_rows[t]
            continue
        for v in variants:
            if builds_here(v, t, serving_targets):
                rows.append(_row(v, t, by_key[(*v.key, t)]))
    return rows


def builds_here(variant: Variant, target: str, serving_targets: list[str] | None) -> bool:
    """Whether ``variant`` is built for ``target``: check shapes everywhere, serving shapes on the
    serving targets (every target when None)."""
    return not variant.serving or serving_targets is None or target in serving_targets


def _spec_text(spec: Any) -> str:
    """An input of a variant as the listing prints it: ``dtype[shape]``, through a structured input's arrays."""
    if isinstance(spec, InputSpec):
        return f"{spec.dtype}{list(spec.shape)}"
    if hasattr(spec, "map_arrays"):
        arrays = ", ".join(f"{k}={_spec_text(v)}" for k, v in spec.arrays().items())
        return f"{type(spec).__name__}({arrays})"
    return repr(spec)


def variant_listing(ops: list[str] | None = None, dtypes: list[str] | None = None,
                    serving_dtypes: list[str] | None = None) -> list[str]:
    """``dualop compile --list``: one sorted line per build, the same on every target: each kernel
    variant (case, dtype, shape, check or serving shape, the op built for it, its abstract inputs)
    and each sharded layer a topology target builds (small shapes always, model sizes with
    ``--sharded-serving``)."""
    from dualop import testing
    from dualop.aot.sharded import layers_for

    dtypes = check_dtypes(dtypes)
    lines = []
    for v in variants_for(ops, dtypes, None if serving_dtypes is None else check_dtypes(serving_dtypes)):
        inputs = ", ".join(_spec_text(s) for s in v.inputs)
        lines.append(f"kernel | {v.case.label} | {v.dtype} | {'serving' if v.serving else 'check'} {v.shape} | "
                     f"{testing.listing_text(v.make_op())} | options {testing.listing_text(v.case.options)} | "
                     f"inputs ({inputs})")
    for layer in layers_for(ops):
        for dtype in dtypes:
            for shape in layer.shapes:
                lines.append(f"sharded | {layer.label} | op {layer.op} | {dtype} | check {tuple(shape)}")
            for shape in layer.serving_shapes:
                lines.append(f"sharded | {layer.label} | op {layer.op} | {dtype} | serving {tuple(shape)}")
    return sorted(lines)


def _compile_sharded(ops: list[str] | None, dtypes: list[str], targets: list[str], progress: bool,
                     serving: bool) -> dict[str, list[dict[str, Any]]]:
    """The sharded layers (``sharded.py``) on each multi-chip target: rows keyed by target."""
    from tqdm import tqdm

    from dualop.aot import sharded, tpu

    work = [(layer, shape, dtype, t) for t in targets for layer in sharded.layers_for(ops)
            for dtype in dtypes for shape in layer.shapes + (layer.serving_shapes if serving else ())]
    why = tpu.tpu_available(layers=True)
    out: dict[str, list[dict[str, Any]]] = {t: [] for t in targets}
    with tpu.quiet_native_stderr() as visible:
        for layer, shape, dtype, t in tqdm(work, desc="dualop compile (sharded layers)", unit="layer",
                                           disable=not progress, file=visible, dynamic_ncols=True):
            result = (KernelResult(status="unavailable", message=why) if why is not None
                      else sharded.compile_layer(layer, shape, dtype, t))
            out[t].append({"op": layer.op, "case": layer.label, "dtype": dtype, "shape": list(shape),
                           "serving": shape in layer.serving_shapes, "target": t, **result.as_dict()})
    return out


def _compile_tpu(variants: list[Variant], targets: list[str], progress: bool,
                 serving_targets: list[str] | None = None) -> dict[tuple, KernelResult]:
    from tqdm import tqdm

    from dualop.aot import tpu

    why = tpu.tpu_available()
    if why is not None:
        return {(*v.key, t): KernelResult(status="unavailable", message=why) for v in variants for t in targets}
    out = {}
    with tpu.quiet_native_stderr() as visible:
        work = [(v, t) for t in targets for v in variants if builds_here(v, t, serving_targets)]
        for v, t in tqdm(work, desc="dualop compile (Pallas)", unit="kernel", disable=not progress,
                         file=visible, dynamic_ncols=True):
            out[(*v.key, t)] = tpu.compile_variant(v, t)
    return out


# --- output ------------------------------------------------------------------------------


def _shape(row: dict[str, Any]) -> str:
    return "x".join(map(str, row["shape"]))


def _clip(text: str, width: int = 160) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def format_matrix(rows: list[dict[str, Any]]) -> str:
    """Op case x target: ``ok N``, ``refused K/N``, ``n/a N``; then one note per distinct message
    saying which variants it covers."""
    from dualop.bench.report import table

    targets = list(dict.fromkeys(r["target"] for r in rows))
    cells: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for r in rows:
        cells[(r["case"], r["target"])].append(r)
    notes: dict[tuple[str, str, str, str], list[str]] = {}
    table_rows = []
    for case in dict.fromkeys(r["case"] for r in rows):
        line = {"case": case}
        for t in targets:
            group = cells[(case, t)]
            counts = collections.Counter(r["status"] for r in group)
            parts = []
            for status in ("refused", "unavailable", "ok", "n/a"):
                if counts[status]:
                    parts.append(f"{status} {counts[status]}" + (f"/{len(group)}" if status == "refused" else ""))
            for r in group:
                if r["status"] != "ok":
                    note = (case, t, r["status"], _clip(r["message"]))  # dtypes with one message share a note
                    notes.setdefault(note, []).append(f"{r['dtype']} {_shape(r)}")
            line[t] = ", ".join(parts)
        table_rows.append(line)
    out = [table(table_rows, ["case", *targets])]
    if notes:
        out.append("")
        for (case, t, status, message), where in notes.items():
            out.append(f"{status}: {case} on {t} ({', '.join(where)}): {message}")
    return "\n".join(out)


def _kib(n: int | None) -> str:
    return "" if n is None else f"{n / 1024:.0f}K"


def format_details(rows: list[dict[str, Any]]) -> str:
    """Per kernel: grid, blocks and the VMEM it asks for (TPU); warps, stages, shared memory,
    registers and spills (GPU); compile seconds (``=`` when an identical kernel was reused)."""
    from dualop.aot.sharded import is_sharded_target
    from dualop.bench.report import table

    tpu_rows, gpu_rows = [], []
    for r in rows:
        for k in r["kernels"]:
            base = {"case": r["case"], "dtype": r["dtype"], "shape": _shape(r), "target": r["target"],
                    "kernel": k.get("kernel", ""), "grid": "x".join(map(str, k.get("grid", ())))}
            if r["target"] in TPU_TARGETS or is_sharded_target(r["target"]):
                limit = k.get("vmem_limit_bytes")
                tpu_rows.append({**base, "blocks": " ".join(k.get("blocks", ())),
                                 "VMEM (2 buffers)": _kib(k.get("vmem_bytes")),
                                 "vmem_limit": _kib(limit) if limit else "default",
                                 "status": r["status"],
                                 "s": "=" if r["cached"] else f"{r['seconds']:.2f}"})
            else:
                gpu_rows.append({**base, "warps": k.get("num_warps", ""), "stages": k.get("num_stages", ""),
                                 "smem": k.get("shared_bytes", ""), "regs": k.get("registers") or "",
                                 "spills": k.get("spills") or "", "status": "refused" if k.get("error") else "ok",
                                 "s": "=" if k.get("cached") else f"{k.get('seconds', 0.0):.2f}"})
    parts = []
    if tpu_rows:
        parts.append("Pallas kernels (TPU):\n" + table(tpu_rows))
    if gpu_rows:
        parts.append("Triton kernels (GPU):\n" + table(gpu_rows))
    return "\n\n".join(parts)


def format_collectives(rows: list[dict[str, Any]]) -> str:
    """Per sharded-layer row: the collectives of its compiled program, one line each
    (``all-reduce 2x 64 KiB, all-gather 1x 2 MiB -> 8 MiB``: ``collectives.describe``); "" when no
    row is a sharded layer's."""
    from dualop.aot.collectives import describe
    from dualop.aot.sharded import is_sharded_target
    from dualop.bench.report import table

    column = "collectives (count, bytes per device: operands -> results)"
    lines = [{"case": r["case"], "dtype": r["dtype"], "shape": _shape(r), "target": r["target"],
              column: describe(r["collectives"]) if r["status"] == "ok" else "", "status": r["status"]}
             for r in rows if is_sharded_target(r["target"])]
    return "Collectives (sharded layers, compiled program):\n" + table(lines) if lines else ""


def format_summary(rows: list[dict[str, Any]], seconds: float) -> str:
    counts = collections.Counter(r["status"] for r in rows)
    per_target = collections.defaultdict(float)
    for r in rows:
        per_target[r["target"]] += r["seconds"]
    times = ", ".join(f"{t} {s:.0f}s" for t, s in per_target.items())
    status = ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s])
    return f"{len(rows)} builds ({status}) in {seconds:.0f}s; compile time per target: {times}"


def exit_status(rows: list[dict[str, Any]]) -> int:
    """1 if any build was refused, 2 if none was but a compiler was unavailable, else 0."""
    statuses = {r["status"] for r in rows}
    if "refused" in statuses:
        return 1
    return 2 if "unavailable" in statuses else 0
