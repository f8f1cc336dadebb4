"""The Mamba-2 mixer family (dualop.ops.mamba_mixer2): the gated norm against transformers' gated
norms (Mamba-2, Bamba, Nemotron-H) and at tp 2 (two gloo processes; two of eight jax host devices
under shard_map) equal to tp 1; the mixer against transformers' Mamba2Mixer / BambaMixer /
NemotronHMamba2Mixer, its serving-state behaviour and its bad input."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dualop import testing
from dualop.parallel import TensorParallel
from dualop.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))

# --- op 6: mixer2_gated_rms_norm --------------------------------------------------------------------

# (transformers module, class) of the three gated norms the mixers use; in transformers 5.23 all
# three normalise in float32, cast to the input dtype, THEN multiply by the weight (the rounding
# the op's cast_before_weight reproduces).
HF_NORMS = [
    ("mamba2", "MambaRMSNormGated"),
    ("bamba", "BambaRMSNormGated"),
    ("nemotron_h", "NemotronHRMSNormGated"),
]
# (full hidden, full groups) for tp 2: one group split (all-reduce), whole groups per rank
# (local), groups cut by the rank boundary (all-gather).
TP_CONFIGS = [(48, 1), (48, 4), (48, 3)]


def _norm_inputs(hidden: int, seed: int = 0, rows: int = 5):
    rng = np.random.default_rng(seed)
    return (testing.normal((rows, hidden), rng, 3.0), testing.normal((rows, hidden), rng, 2.0),
            1.0 + 0.5 * testing.normal((hidden,), rng))


@pytest.mark.parametrize("module,cls", HF_NORMS)
@pytest.mark.parametrize("n_groups", [1, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_norm_matches_transformers(module, cls, n_groups, dtype):
    torch = importlib.import_module("torch")
    hf = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)
    from dualop.ops import Mixer2RMSNormGated

    hidden = 80
    x, gate, w = _norm_inputs(hidden)
    tdt = getattr(torch, dtype)
    ref_mod = hf(hidden, group_size=hidden // n_groups, eps=1e-5).to(tdt)
    with torch.no_grad():
        ref_mod.weight.copy_(torch.from_numpy(w))
        xt, gt, wt = (torch.from_numpy(a).to(tdt) for a in (x, gate, w))
        want = ref_mod(xt, gt).float().numpy()
    op = Mixer2RMSNormGated(hidden, n_groups, eps=1e-5)
    for got in (op.forward_native(xt, gt, wt), op(xt, gt, wt)):  # native, then the CPU kernel
        assert got.dtype == tdt
        cmp = testing.compare(got.float().numpy(), want, dtype)
        assert cmp.ok, cmp
    jnp = importlib.import_module("jax.numpy")
    jdt = getattr(jnp, dtype)
    got = op(*(jnp.asarray(a, jdt) for a in (x, gate, w)))
    cmp = testing.compare(np.asarray(got.astype(jnp.float32)), want, dtype)
    assert cmp.ok, cmp


def test_gated_norm_without_rms_norm_is_the_gate_alone():
    torch = importlib.import_module("torch")
    from dualop.ops import Mixer2RMSNormGated

    x, gate, _ = _norm_inputs(32)
    op = Mixer2RMSNormGated(32, 1, use_rms_norm=False)
    xt, gt = torch.from_numpy(x), torch.from_numpy(gate)
    got = op(xt, gt)
    assert torch.allclose(got, xt * torch.nn.functional.silu(gt), rtol=1e-6, atol=1e-6)
    assert op.resolution("torch", "cpu")[0] == "forward_native"


def test_gated_norm_bad_input():
    torch = importlib.import_module("torch")
    from dualop.ops import Mixer2RMSNormGated

    x, gate, w = (torch.from_numpy(a) for a in _norm_inputs(32))
    op = Mixer2RMSNormGated(32, 2)
    with pytest.raises(ValueError, match="mixer2_gated_rms_norm: argument 'x' has last dim 16"):
        op(x[:, :16], gate[:, :16], w[:16])
    with pytest.raises(TypeError, match="mixer2_gated_rms_norm: argument 'gate' is required"):
        op(x, None, w)
    with pytest.raises(TypeError, match="'weight' is required"):
        op(x, gate)
    with pytest.raises(TypeError, match="'gate'.*dtype"):
        op(x, gate.double(), w)
    with pytest.raises(ValueError, match="'weight' must be None with use_rms_norm=False"):
        Mixer2RMSNormGated(32, 2, use_rms_norm=False)(x, gate, w)
    with pytest.raises(ValueError, match="full_hidden_size.*full_n_groups"):
        Mixer2RMSNormGated(32, 3)

    class Three(TensorParallel):
        size = 3

    with pytest.raises(ValueError, match="mixer2_gated_rms_norm: .*tensor-parallel size 3 does not divide"):
        Mixer2RMSNormGated(32, 1, tp=Three())


def _tp1_norm(hidden, groups, x, gate, w):
    import torch

    from dualop.ops import Mixer2RMSNormGated

    op = Mixer2RMSNormGated(hidden, groups, tp=TensorParallel())
    return op.forward_native(*(torch.from_numpy(a) for a in (x, gate, w))).numpy()


def _torch_norm_at_tp(rank: int, world: int, port: int) -> None:
    import torch

    from dualop import parallel
    from dualop.ops import Mixer2RMSNormGated
    from dualop.torch import parallel as tparallel

    tp = tparallel.init_tensor_parallel_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                              world_size=world)
    try:
        for hidden, groups in TP_CONFIGS:
            x, gate, w = _norm_inputs(hidden, seed=groups)
            want = _tp1_norm(hidden, groups, x, gate, w)
            part = slice(rank * hidden // world, (rank + 1) * hidden // world)
            op = Mixer2RMSNormGated(hidden, groups, eps=1e-6)
            got = op(*(torch.from_numpy(np.ascontiguousarray(a[..., part])) for a in (x, gate, w)))
            cmp = testing.compare(got.numpy(), want[:, part], "float32")
            assert cmp.ok, (hidden, groups, rank, op.tp_mode, cmp)
            method = op.last_run("torch", "cpu")[0]
            assert method == ("forward_cpu" if op.tp_mode == "local" else "forward_native"), (op.tp_mode, method)
        assert tp.size == world
    finally:
        parallel.set_tensor_parallel(None)
        torch.distributed.destroy_process_group()


def test_gated_norm_torch_tp2_equals_tp1():
    torch = importlib.import_module("torch")
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    mp.spawn(_torch_norm_at_tp, args=(2, free_port()), nprocs=2, join=True)


_JAX_NORM_SCRIPT = textwrap.dedent("""
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from dualop import testing
    from dualop.ops import Mixer2RMSNormGated
    from dualop.jax.parallel import AxisTensorParallel, shard_map, tensor_parallel_mesh
    from test_mamba_mixer2 import TP_CONFIGS, _norm_inputs, _tp1_norm

    mesh = tensor_parallel_mesh(2)
    results = []
    for hidden, groups in TP_CONFIGS:
        x, gate, w = _norm_inputs(hidden, seed=groups)
        want = _tp1_norm(hidden, groups, x, gate, w)
        op = Mixer2RMSNormGated(hidden, groups, tp=AxisTensorParallel("tp", 2))
        run = jax.jit(shard_map(op, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp")),
                                out_specs=P(None, "tp")))
        got = np.asarray(run(jnp.asarray(x), jnp.asarray(gate), jnp.asarray(w)))
        cmp = testing.compare(got, want, "float32")
        results.append(dict(groups=groups, mode=op.tp_mode, ok=bool(cmp.ok), max_abs=cmp.max_abs))
    print("RESULTS " + json.dumps(results))
""")


def test_gated_norm_jax_tp2_of_8_devices_equals_tp1():
    importlib.import_module("jax")
    importlib.import_module("torch")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, "-c", _JAX_NORM_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    assert [r["mode"] for r in results] == ["all_reduce", "local", "all_gather"]
    assert all(r["ok"] for r in results), results
