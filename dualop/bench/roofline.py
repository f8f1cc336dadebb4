"""Predicted time of each bench case on an accelerator, from the kernel's own cost model and the
device's published peaks: ``dualop bench --roofline-only --device ...``. No timing, no jax needed.

A kernel cannot finish before its bytes cross HBM (``bytes / peak bandwidth``) nor before its flops
are done (``flops / peak FLOP/s``); the larger of the two is the prediction, and names the bound.
The bytes and flops are the ones the Pallas kernels give ``pl.CostEstimate``
(``dualop/kernels/cost.py``); the Triton kernels read and write the same arrays once each, so the
H100 predictions use the same cost functions.

The kernels compute in float32 on vector units whatever the input dtype, except the cases marked
``matrix`` (the MoE experts' matmuls), whose 16-bit inputs go to the matrix units' bf16 peak. H100's float32 (non-tensor)
peak is published and used; TPUs publish only the bf16 peak of their matrix units, which bounds the
vector unit's rate from above, so on TPUs the compute bound is optimistic (and still far below the
memory bound for these ops). Transcendentals (exp, rsqrt, erf) have no published rate; they are
counted, not timed.
"""

from __future__ import annotations

import dataclasses

from dualop.bench.cases import BenchCase

__all__ = ["Device", "DEVICES", "check_device", "predict", "format_roofline"]


@dataclasses.dataclass(frozen=True)
class Device:
    """Published per-chip peaks. hbm_gbps: HBM bandwidth, 1e9 bytes/s. bf16_tflops: dense bf16
    (matrix unit). f32_tflops: float32 on the vector units, None where unpublished. kernel: which
    dualop kernel family runs there."""

    name: str
    hbm_gbps: float
    bf16_tflops: float
    f32_tflops: float | None
    kernel: str
    source: str


# Spec sheets (per chip):
# - TPU v5e: 819 GB/s HBM2, 197 TFLOP/s bf16 (https://cloud.google.com/tpu/docs/v5e, "Key chip
#   specifications"); no float32 peak is published.
# - TPU v6e (Trillium): 1638 GB/s HBM ("1640 GB/s" in Google's launch material), 918 TFLOP/s bf16
#   (https://cloud.google.com/tpu/docs/v6e); no float32 peak is published.
# - H100 SXM5: 3350 GB/s HBM3, 989 TFLOP/s dense bf16 tensor core (1979 with 2:4 sparsity), 67 TFLOP/s
#   float32 non-tensor (NVIDIA H100 Tensor Core GPU datasheet, SXM column).
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device("tpu-v5e", 819.0, 197.0, None, "pallas", "cloud.google.com/tpu/docs/v5e"),
        Device("tpu-v6e", 1638.0, 918.0, None, "pallas", "cloud.google.com/tpu/docs/v6e"),
        Device("h100", 3350.0, 989.0, 67.0, "triton", "NVIDIA H100 datasheet (SXM5)"),
    )
}


def check_device(name: str) -> Device:
    """The device called ``name``; ValueError naming the valid ones otherwise."""
    if name not in DEVICES:
        raise ValueError(f"--device: unknown {name!r}; valid: {', '.join(DEVICES)}")
    return DEVICES[name]


def predict(case: BenchCase, shape: tuple[int, ...], dtype: str, device: str) -> dict:
    """The roofline record of one call of ``case`` on ``x`` of ``shape``/``dtype`` on ``device``."""
    dev = check_device(device)
    shape = case.input_shape(shape)
    cost = case.kernel_cost(tuple(shape), dtype)
    memory_s = cost.bytes_accessed / (dev.hbm_gbps * 1e9)
    if case.matrix and dtype != "float32":  # matmuls on 16-bit operands: the matrix units' peak
        peak_tflops, peak_kind = dev.bf16_tflops, "bf16 matrix"
    elif dev.f32_tflops is not None:
        peak_tflops, peak_kind = dev.f32_tflops, "float32"
    else:
        peak_tflops, peak_kind = dev.bf16_tflops, "bf16 matrix (optimistic)"
    compute_s = cost.flops / (peak_tflops * 1e12)
    predicted_s = max(memory_s, compute_s)
    return {
        "op": case.label,
        "op_name": case.op_name,
        "shape": list(shape),
        "dtype": dtype,
        "device": dev.name,
        "kernel": dev.kernel,
        "bytes": cost.bytes_accessed,
        "flops": cost.flops,
        "transcendentals": cost.transcendentals,
        "peak_gbps": dev.hbm_gbps,
        "peak_tflops": peak_tflops,
        "peak_flops_kind": peak_kind,
        "memory_s": memory_s,
        "compute_s": compute_s,
        "predicted_s": predicted_s,
        "bound": "memory" if memory_s >= compute_s else "compute",
    }


def format_roofline(records: list[dict]) -> str:
    """The terminal table of ``predict`` records."""
    from dualop.bench.report import table

    rows = [
        {
            "device": r["device"],
            "kernel": r["kernel"],
            "case": r["op"],
            "shape": "x".join(map(str, r["shape"])),
            "dtype": r["dtype"],
            "MB": f"{r['bytes'] / 1e6:.4g}",
            "MFLOP": f"{r['flops'] / 1e6:.4g}",
            "M transc.": f"{r['transcendentals'] / 1e6:.4g}",
            "memory us": f"{r['memory_s'] * 1e6:.4g}",
            "compute us": f"{r['compute_s'] * 1e6:.4g}",
            "bound": r["bound"],
            "predicted us": f"{r['predicted_s'] * 1e6:.4g}",
        }
        for r in records
    ]
    notes = sorted({f"{r['device']}: {r['peak_gbps']:g} GB/s, {r['peak_tflops']:g} TFLOP/s {r['peak_flops_kind']}"
                    for r in records})
    return (
        table(rows)
        + "\n\nbytes, flops, transcendentals: the kernels' cost models (dualop/kernels/cost.py, the numbers "
        "given to pl.CostEstimate; the Triton kernels move the same bytes)\npeaks: " + "; ".join(notes)
    )
