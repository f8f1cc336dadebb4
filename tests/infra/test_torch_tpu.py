"""The torch_tpu bridge: torch tensors on PyTorch's native ``tpu`` device reach the Pallas kernels
through ``torch.tpu.pallas.jax_op``.

This machine has no TPU, so no kernel runs here. What is checked is everything short of that:
torch_tpu imports and stays unimported until a ``tpu`` tensor is seen; every op case dispatches a
fake ``tpu`` tensor to ``forward_tpu`` and from there to a registered ``dualop::pallas_*`` op; that
op's fake kernel (a ``jax.export`` of the kernel for the TPU, so Mosaic's Python-side lowering
runs) infers the shapes and dtypes ``forward_native`` gives, on fake and on ``meta`` tensors; and
``make_fx`` and ``torch.compile`` traces show the registered op. The torch_tpu wheel needs
torch >= 2.11: the xla environment (torch 2.9) has none, and these tests skip there.
"""

from __future__ import annotations

import math

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import NATIVE_CASES
from dualop import dispatch_report, platforms, testing
from dualop.custom_op import report_row

# torch_tpu is installed in the latest environment only.
pytestmark = pytest.mark.latest_only

CASES = list(testing.cases_for(None))
TRACE_DTYPES = ("float32", "bfloat16")


def _why_no_torch_tpu() -> str | None:
    try:
        import torch_tpu  # noqa: F401
        from torch.tpu.pallas import jax_op  # noqa: F401
    except ImportError as err:
        return f"{type(err).__name__}: {err}"
    return None


@pytest.fixture(scope="module")
def tpu_device():
    """The name of torch_tpu's device, ``tpu``, usable for fake and meta tensors.

    On a TPU host torch_tpu names PyTorch's PrivateUse1 device ``tpu`` when it loads; with no TPU
    it leaves it unnamed, so this does the same renaming (process-wide and permanent, as on a TPU
    host). Fake tensors on that device need no TPU."""
    why = _why_no_torch_tpu()
    if why is not None:
        pytest.skip(f"torch_tpu is not installed here ({why}); it needs torch >= 2.11, so only the latest environment has it")
    name = torch._C._get_privateuse1_backend_name()
    if name == "privateuseone":
        torch.utils.rename_privateuse1_backend("tpu")
        platforms.invalidate()  # the process can now hold tensors that dispatch apart
    elif name != "tpu":
        pytest.skip(f"PyTorch's PrivateUse1 device is already named {name!r} in this process")
    return "tpu"


def _fake_tpu(a):
    """A fake tensor on the tpu device with ``a``'s shape and dtype (a structured input, such as a
    quantized weight, each of its arrays; non-tensors pass through)."""
    if hasattr(a, "map_arrays"):
        return a.map_arrays(_fake_tpu)
    if not isinstance(a, torch.Tensor):
        return a
    return torch.empty(tuple(a.shape), dtype=a.dtype, device="tpu")


# Ops whose forward_tpu launches its kernel more than once (dual chunk rope: the key's angles,
# then five query angle sets).
KERNEL_LAUNCHES = {"dual_chunk_rotary_embedding": 6}
# transformers_fused_moe: the routing kernel, then the experts' (as fused_moe).
KERNEL_LAUNCHES["transformers_fused_moe"] = 2
KERNEL_LAUNCHES["fused_moe"] = 2  # the router's kernel (grouped_topk), then the experts'


def _structure(out) -> list[tuple[tuple[int, ...], str]]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [(tuple(o.shape), str(o.dtype)) for o in outs if o is not None]  # None: an absent optional output


def _bridge_nodes(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("dualop.pallas_")]


# The mixers: each projection is the linear op's XLA dot (dualop.ops._mixer), then the kernel ops.
# mamba_mixer: in_proj, x_proj, dt_proj, out_proj, the conv and the selective scan.
KERNEL_LAUNCHES["mamba_mixer"] = 6
# mamba_mixer2: in_proj, out_proj, the conv, the SSD scan and the gated norm.
KERNEL_LAUNCHES["mamba_mixer2"] = 5
# plamo2_mamba_mixer: in_proj, bcdt_proj, dt_proj, out_proj, the conv and the SSD scan.
KERNEL_LAUNCHES["plamo2_mamba_mixer"] = 6


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_every_op_case_reaches_a_registered_pallas_op_on_tpu_tensors(tpu_device, case):
    """Per shape and dtype: the op, called on fake tpu tensors, resolves to forward_tpu (no
    fallback), its trace holds exactly one ``dualop::pallas_*`` op, and the shapes and dtypes that
    op infers, on fake tensors and again on meta tensors, are forward_native's on CPU tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    # Cases with no Pallas kernel (conftest NATIVE_CASES for the TPU bridges): native, with the reason.
    native_reason = NATIVE_CASES.get((case.label, "torch_xla", "tpu"))
    rng = np.random.default_rng(0)
    for shape in case.shapes:
        op = case.make_op(shape)
        for dtype in TRACE_DTYPES:
            cpu_inputs = [testing.to_frontend(a, "torch", dtype) for a in case.make_inputs(shape, rng)]
            want = _structure(op.forward_native(*cpu_inputs, **case.options))
            where = f"{case.label} {shape} {dtype}"
            with FakeTensorMode():
                fake = [_fake_tpu(a) for a in cpu_inputs]
                got = op(*fake, **case.options)
                gm = make_fx(lambda *a: op(*a, **case.options))(*fake)
            assert _structure(got) == want, where
            outs = got if isinstance(got, (tuple, list)) else (got,)
            assert all(o.device.type == "tpu" for o in outs if o is not None), where
            row = report_row(type(op), "torch_tpu", "tpu")
            if native_reason is not None:
                assert row["method"] == "forward_native" and native_reason in row["reason"], (where, row)
                assert not _bridge_nodes(gm), (where, gm.code)
                continue
            assert row is not None and row["method"] == "forward_tpu", (where, row)
            assert "declined" not in row["reason"], (where, row)

            nodes = _bridge_nodes(gm)
            assert len(nodes) == KERNEL_LAUNCHES.get(case.op, 1), (where, gm.code)
            for node in nodes:  # each registered op infers, on meta tensors, what it gave in the trace
                meta_args = [
                    torch.empty(tuple(a.meta["val"].shape), dtype=a.meta["val"].dtype, device="meta")
                    if isinstance(a, torch.fx.Node) else a
                    for a in node.args
                ]
                assert _structure(node.target(*meta_args)) == _structure(node.meta["val"]), where
            if len(nodes) == 1 and _structure(nodes[0].meta["val"]) != want:
                # the kernel's outputs are views of the op's (rope rotates [T, H, D] views of [T, H*D])
                assert [math.prod(s) for s, _ in _structure(nodes[0].meta["val"])] == [math.prod(s) for s, _ in want], where


def test_one_registered_op_per_kernel_inputs_and_static_options(tpu_device):
    """Calls that differ only in shape or dtype share one op; another optional input present or
    another static option is another op; names are ``dualop::pallas_<kernel>_<hash>``."""
    from dualop.backends.xla.jax_bridge import torch_tpu_op
    from dualop.kernels.norm_math import NormSpec
    from dualop.ops.layernorm import _PALLAS_RMS_NORM

    def meta(*shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device="meta")

    spec = NormSpec(eps=1e-6)
    base = torch_tpu_op(_PALLAS_RMS_NORM, (meta(4, 128), meta(128), None), {"spec": spec})
    assert torch_tpu_op(_PALLAS_RMS_NORM, (meta(2, 3, 256, dtype=torch.bfloat16), meta(256), None), {"spec": spec}) is base
    with_residual = torch_tpu_op(_PALLAS_RMS_NORM, (meta(4, 128), meta(128), meta(4, 128)), {"spec": spec})
    other_eps = torch_tpu_op(_PALLAS_RMS_NORM, (meta(4, 128), meta(128), None), {"spec": NormSpec(eps=1e-5)})
    names = {op._qualname for op in (base, with_residual, other_eps)}
    assert len(names) == 3
    assert all(n.startswith("dualop::pallas_rms_norm_") for n in names)
    assert str(with_residual._opoverload._schema).endswith("(Tensor x, Tensor weight, Tensor residual) -> (Tensor, Tensor)")
    y, r = with_residual(meta(5, 128), meta(128), meta(5, 128))
    assert y.shape == r.shape == (5, 128)


def test_torch_compile_graph_holds_the_registered_op(tpu_device):
    """A graph captured by torch.compile (a backend that only records it) keeps the registered
    op opaque; meta inputs, so nothing runs on a device."""
    from dualop.backends.xla.jax_bridge import torch_tpu_op
    from dualop.kernels.gate_math import GateSpec
    from dualop.ops.activation import _PALLAS_GATED

    x = torch.empty(8, 256, dtype=torch.bfloat16, device="meta")
    bridge_op = torch_tpu_op(_PALLAS_GATED, (x,), {"spec": GateSpec("silu")})
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(lambda a: bridge_op(a) * 2, backend=record, fullgraph=True)(x)
    assert out.shape == (8, 128) and out.dtype == torch.bfloat16
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert f"dualop.{bridge_op._name}.default" in targets, targets


def test_recording_autograd_declines_so_the_native_body_runs(tpu_device):
    """jax_op registers no backward pass: with autograd recording, the bridge raises
    NotImplementedError before registering or calling anything, which the dispatcher turns into
    a reported run of forward_native (that torch differentiates). Meta tensors: autograd on fake
    ``tpu`` tensors would make torch_tpu try to open a TPU runtime."""
    from dualop.backends.xla.jax_bridge import call_jax_function
    from dualop.kernels.gate_math import GateSpec
    from dualop.ops.activation import _PALLAS_GATED

    x = torch.empty(4, 256, device="meta", requires_grad=True)
    with pytest.raises(NotImplementedError, match="no backward pass"):
        call_jax_function("torch_tpu", _PALLAS_GATED, x, spec=GateSpec("silu"))
    with torch.no_grad():
        assert call_jax_function("torch_tpu", _PALLAS_GATED, x, spec=GateSpec("silu")).shape == (4, 128)


def test_bridge_imports_torch_tpu_only_for_tpu_tensors():
    """``import dualop`` and a CPU call leave torch_tpu unimported (torch's own backend autoload
    is turned off, as it would be without torch_tpu installed)."""
    code = (
        "import sys, dualop\n"
        "from dualop.ops import RMSNorm\n"
        "assert not {'torch', 'jax', 'torch_tpu'} & set(sys.modules), sorted({'torch', 'jax', 'torch_tpu'} & set(sys.modules))\n"
        "import torch\n"
        "RMSNorm(8)(torch.ones(2, 8), torch.ones(8))\n"
        "print('torch_tpu' in sys.modules)\n"
    )
    env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "DUALOP_CPU_KERNELS": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"


def test_dispatch_report_names_the_torch_tpu_frontend(tpu_device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dualop.ops import QuickGELU

    with FakeTensorMode():
        QuickGELU()(torch.empty(3, 5, device="tpu"))
    rows = [r for r in dispatch_report() if r["op"] == "quick_gelu"]
    assert [(r["frontend"], r["platform"], r["method"]) for r in rows] == [("torch_tpu", "tpu", "forward_tpu")]


def test_registered_names_are_the_same_in_every_process(tpu_device):
    """A compiled graph or a cache keyed by op name must find the same op in the next process."""
    code = (
        "import torch\n"
        "from dualop.backends.xla.jax_bridge import torch_tpu_op\n"
        "from dualop.kernels.norm_math import NormSpec\n"
        "from dualop.ops.layernorm import _PALLAS_RMS_NORM\n"
        "x = torch.empty(4, 128, device='meta')\n"
        "print(torch_tpu_op(_PALLAS_RMS_NORM, (x, None, x), {'spec': NormSpec(eps=1e-6)})._qualname)\n"
    )
    from dualop.backends.xla.jax_bridge import torch_tpu_op
    from dualop.kernels.norm_math import NormSpec
    from dualop.ops.layernorm import _PALLAS_RMS_NORM

    x = torch.empty(4, 128, device="meta")
    here = torch_tpu_op(_PALLAS_RMS_NORM, (x, None, x), {"spec": NormSpec(eps=1e-6)})._qualname
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == here
