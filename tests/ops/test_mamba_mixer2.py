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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


@pytest.mark.reference
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


def test_cast_before_weight_kernels_round_as_native():
    """The rms_norm_gated kernels' cast_before_weight flag (what the mixers' norm runs): in bfloat16
    the CPU path, the Triton kernel and the Pallas kernel (interpreted) give forward_native's bits
    (at most 1% of elements a summation-order ulp apart), where the weight-then-cast rounding
    differs in many elements (so the tolerance table, 2 ulp, alone could not tell them apart)."""
    torch = importlib.import_module("torch")
    jnp = importlib.import_module("jax.numpy")
    from dualop.kernels.cuda.rms_norm_gated import rms_norm_gated as triton_kernel
    from dualop.kernels.pallas.rms_norm_gated import rms_norm_gated as pallas_kernel
    from dualop.ops import RMSNormGated

    x, gate, w = _norm_inputs(256, rows=16)
    xt, gt, wt = (torch.from_numpy(a).bfloat16() for a in (x, gate, w))
    want = RMSNormGated(256, 1e-6, group_size=64, cast_before_weight=True).forward_native(xt, wt, gt).float().numpy()
    for flag in (True, False):
        kw = dict(eps=1e-6, group_size=64, cast_before_weight=flag)
        got = {
            "cpu": RMSNormGated(256, 1e-6, group_size=64, cast_before_weight=flag).forward_cpu(xt, wt, gt),
            "triton": triton_kernel(xt, wt, gt, **kw),
            "pallas": pallas_kernel(*(jnp.asarray(a, jnp.bfloat16) for a in (x, w, gate)), interpret=True, **kw),
        }
        for name, out in got.items():
            out = np.asarray(out.float() if hasattr(out, "float") else out.astype(jnp.float32))
            differ = float(np.mean(out != want))
            assert (differ <= 0.01) if flag else (differ >= 0.1), (name, flag, differ)


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

    from dualop.ops import Mixer2RMSNormGated
    from dualop.torch import parallel as tparallel

    with testing.gloo_group(rank, world, port):
        tp = tparallel.init_tensor_parallel_group()
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
    from dualop.parallel import TensorParallel
    from test_mamba_mixer2 import TP_CONFIGS, _norm_inputs

    mesh = tensor_parallel_mesh(2)
    results = []
    for hidden, groups in TP_CONFIGS:
        x, gate, w = _norm_inputs(hidden, seed=groups)
        want = np.asarray(Mixer2RMSNormGated(hidden, groups, tp=TensorParallel()).forward_native(
            jnp.asarray(x), jnp.asarray(gate), jnp.asarray(w)))
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
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, "-c", _JAX_NORM_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    assert [r["mode"] for r in results] == ["all_reduce", "local", "all_gather"]
    assert all(r["ok"] for r in results), results


# --- op 7: mamba_mixer2 -------------------------------------------------------------------------------

# One tiny shape for every mixer test: hidden 16, 8 heads of 4 (intermediate 32), 2 groups of state 8,
# kernel 4; the Nemotron-H config clamps dt from below (its time_step_limit is (time_step_min, inf)).
HIDDEN, HEADS, HEAD_DIM, GROUPS, STATE, KERNEL = 16, 8, 4, 2, 8, 4
WEIGHT_NAMES = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
                "out_proj.weight")


def _hf_mixer(kind: str, seed: int = 0):
    """A transformers mixer of ``kind`` with random weights, and the MambaMixer2 op of its config."""
    import torch

    from dualop.ops import MambaMixer2

    common = dict(hidden_size=HIDDEN, num_hidden_layers=1)
    if kind == "mamba2":
        from transformers import Mamba2Config
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as cls

        cfg = Mamba2Config(expand=2, num_heads=HEADS, head_dim=HEAD_DIM, n_groups=GROUPS, state_size=STATE,
                           conv_kernel=KERNEL, chunk_size=8, use_bias=False, use_conv_bias=True, **common)
        eps, limit = cfg.layer_norm_epsilon, tuple(cfg.time_step_limit)
    elif kind == "bamba":
        from transformers import BambaConfig
        from transformers.models.bamba.modeling_bamba import BambaMixer as cls

        cfg = BambaConfig(mamba_expand=2, mamba_n_heads=HEADS, mamba_d_head=HEAD_DIM, mamba_n_groups=GROUPS,
                          mamba_d_state=STATE, mamba_d_conv=KERNEL, mamba_chunk_size=8, mamba_proj_bias=False,
                          mamba_conv_bias=True, attn_layer_indices=[], **common)
        eps, limit = cfg.rms_norm_eps, tuple(cfg.time_step_limit)
    else:
        from transformers import NemotronHConfig
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer as cls

        cfg = NemotronHConfig(mamba_num_heads=HEADS, mamba_head_dim=HEAD_DIM, n_groups=GROUPS, ssm_state_size=STATE,
                              conv_kernel=KERNEL, chunk_size=8, use_bias=False, use_conv_bias=True,
                              layers_block_type=["mamba"], time_step_min=0.05, **common)
        eps, limit = cfg.layer_norm_epsilon, (cfg.time_step_min, float("inf"))
    torch.manual_seed(seed)
    module = cls(cfg, 0).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        module.A_log.copy_(torch.rand(HEADS).log())
    op = MambaMixer2(HIDDEN, STATE, KERNEL, HEADS * HEAD_DIM, True, False, n_groups=GROUPS, num_heads=HEADS,
                     head_dim=HEAD_DIM, rms_norm_eps=eps, chunk_size=8, time_step_limit=limit)
    return module, op


def _weights(module, convert=None):
    """The op's weight arguments from a transformers mixer's state dict (conv1d.weight [C, 1, K] -> [C, K])."""
    sd = module.state_dict()
    ws = [sd[name] for name in WEIGHT_NAMES]
    ws[1] = ws[1][:, 0]
    return [w if convert is None else convert(w) for w in ws]


@pytest.mark.reference
@pytest.mark.parametrize("kind", ["mamba2", "bamba", "nemotron_h"])
def test_mixer_matches_transformers(kind):
    """Several sequences packed in one call == each run alone through transformers' mixer."""
    torch = importlib.import_module("torch")
    module, op = _hf_mixer(kind)
    lengths = (5, 1, 9)
    xs = [torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(n)) for n in lengths]
    with torch.no_grad():
        want = torch.cat([module(x[None])[0] for x in xs])
    cu = torch.tensor(np.cumsum((0,) + lengths), dtype=torch.int32)
    out, conv_state, ssm_state = op(torch.cat(xs), *_weights(module), cu_seqlens=cu)
    cmp = testing.compare(out.numpy(), want.numpy(), "float32")
    assert cmp.ok, cmp
    assert conv_state.shape == (3, op.conv_dim, KERNEL - 1) and ssm_state.shape == (3, HEADS, HEAD_DIM, STATE)


def test_mixer_state_continuity_and_padding():
    """Prefill of a whole sequence == its first part, then continued prefill, then decode steps
    from the cached state; a padding slot (-1) gives zeros and writes nothing."""
    torch = importlib.import_module("torch")
    module, op = _hf_mixer("mamba2")
    ws = _weights(module)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(1))
    slots = 3
    conv = torch.zeros(slots, op.conv_dim, KERNEL - 1)
    ssm = torch.zeros(slots, HEADS, HEAD_DIM, STATE)
    whole, conv_whole, ssm_whole = op(x, *ws)
    idx, no, yes = torch.tensor([2]), torch.tensor([False]), torch.tensor([True])
    first, _, _ = op(x[:4], *ws, conv_state=conv, ssm_state=ssm, state_indices=idx, has_initial_state=no)
    parts = [first, op(x[4:7], *ws, conv_state=conv, ssm_state=ssm, state_indices=idx, has_initial_state=yes)[0]]
    for t in (7, 8):  # decode: one token, plus a padding sequence beside it
        step, _, _ = op(torch.stack([x[t], x[t]]), *ws, conv_state=conv, ssm_state=ssm,
                        state_indices=torch.tensor([-1, 2]), has_initial_state=torch.tensor([True, True]),
                        cu_seqlens=torch.tensor([0, 1, 2], dtype=torch.int32))
        assert torch.count_nonzero(step[0]) == 0
        parts.append(step[1:])
    cmp = testing.compare(torch.cat(parts).numpy(), whole.numpy(), "float32")
    assert cmp.ok, cmp
    for got, want in ((conv[2], conv_whole[0]), (ssm[2], ssm_whole[0])):
        assert testing.compare(got.numpy(), want.numpy(), "float32").ok
    assert torch.count_nonzero(conv[:2]) == 0 and torch.count_nonzero(ssm[:2]) == 0  # untouched slots


def test_mixer_bad_input():
    torch = importlib.import_module("torch")
    from dualop.ops import MambaMixer2

    module, op = _hf_mixer("mamba2")
    ws = _weights(module)
    x = torch.randn(4, HIDDEN)
    with pytest.raises(ValueError, match="mamba_mixer2: num_heads \\* head_dim"):
        MambaMixer2(HIDDEN, STATE, KERNEL, 32, True, False, num_heads=8, head_dim=3)
    with pytest.raises(ValueError, match="mamba_mixer2: n_groups 3 must divide num_heads 8"):
        MambaMixer2(HIDDEN, STATE, KERNEL, 32, True, False, n_groups=3, num_heads=8, head_dim=4)
    with pytest.raises(ValueError, match="mamba_mixer2: argument 'hidden_states' has shape"):
        op(x[:, :8], *ws)
    with pytest.raises(ValueError, match="mamba_mixer2: argument 'conv_weight' has shape"):
        op(x, ws[0], ws[1][:, :2], *ws[2:])
    with pytest.raises(ValueError, match="mamba_mixer2: argument 'conv_bias' must be an array"):
        op(x, ws[0], ws[1], None, *ws[3:])
    conv_cache, ssm_cache = torch.zeros(2, op.conv_dim, KERNEL - 1), torch.zeros(2, HEADS, HEAD_DIM, STATE)
    with pytest.raises(ValueError, match="mamba_mixer2: argument 'ssm_state'"):
        op(x, *ws, conv_state=conv_cache, ssm_state=torch.zeros(2, HEADS, HEAD_DIM, STATE + 1))
    with pytest.raises(ValueError, match="mamba_mixer2: argument 'conv_state'"):
        op(x, *ws, conv_state=torch.zeros(2, op.conv_dim, KERNEL), ssm_state=ssm_cache)
    with pytest.raises(ValueError, match="mamba_mixer2: argument 'ssm_state' is given but 'conv_state' is None"):
        op(x, *ws, ssm_state=ssm_cache)
    with pytest.raises(ValueError, match="mamba_mixer2: argument 'ssm_state' has 3 slots but 'conv_state' has 2"):
        op(x, *ws, conv_state=conv_cache, ssm_state=torch.zeros(3, HEADS, HEAD_DIM, STATE))
    with pytest.raises(ValueError, match="mamba_mixer2: argument 'cu_seqlens'"):
        op(x, *ws, cu_seqlens=torch.tensor([0, 3], dtype=torch.int32))


@pytest.mark.reference
def test_mixer_jax_under_jit_and_grad_of_native():
    """jax: the native body under jit equals torch's; jax.grad of the native body through the
    scans equals torch autograd through transformers' mixer."""
    torch = importlib.import_module("torch")
    jax = importlib.import_module("jax")
    jnp = importlib.import_module("jax.numpy")
    module, op = _hf_mixer("nemotron_h")
    ws_t = _weights(module)
    x_t = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(2))
    cu_t = torch.tensor([0, 2, 6], dtype=torch.int32)
    want, _, ssm_want = op.forward_native(x_t, *ws_t, cu_seqlens=cu_t)
    ws = [jnp.asarray(w.detach().numpy()) for w in ws_t]
    x, cu = jnp.asarray(x_t.numpy()), jnp.asarray(cu_t.numpy())
    out, _, ssm = jax.jit(lambda x, ws, cu: op(x, *ws, cu_seqlens=cu))(x, ws, cu)
    assert testing.compare(np.asarray(out), want.numpy(), "float32").ok
    assert testing.compare(np.asarray(ssm), ssm_want.numpy(), "float32").ok

    def loss(x):
        return jnp.sum(op.forward_native(x, *ws, cu_seqlens=cu)[0] ** 2)

    grad = np.asarray(jax.grad(loss)(x))
    x_ref = x_t.clone().requires_grad_(True)
    ref_loss = sum(torch.sum(module(x_ref[None, a:b])[0] ** 2) for a, b in ((0, 2), (2, 6)))
    ref_loss.backward()  # transformers' torch path, through torch autograd
    cmp = testing.compare(grad, x_ref.grad.numpy(), "float32")
    assert cmp.ok, cmp


@pytest.mark.reference
def test_mixer_layers_load_transformers_state_dict():
    """The torch and jax MambaMixer2 layers, loaded from a transformers Mamba2Mixer's state dict,
    give its output (jax under nnx.jit); a state dict with a stray key is refused."""
    torch = importlib.import_module("torch")
    nnx = importlib.import_module("flax.nnx")
    jnp = importlib.import_module("jax.numpy")
    from dualop.jax import layers as jlayers
    from dualop.torch import layers as tlayers

    module, op = _hf_mixer("mamba2")
    args = (HIDDEN, STATE, KERNEL, HEADS * HEAD_DIM, True, False)
    kwargs = dict(n_groups=GROUPS, num_heads=HEADS, head_dim=HEAD_DIM, rms_norm_eps=op.norm.eps, chunk_size=8)
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = module(x[None])[0].numpy()
    sd = {f"mixer.{k}": v for k, v in module.state_dict().items()}
    layer = tlayers.MambaMixer2(*args, **kwargs)
    layer.load_hf_state_dict(sd, prefix="mixer.")
    with torch.no_grad():
        out, _, ssm = layer(x)
    assert testing.compare(out.numpy(), want, "float32").ok
    jlayer = jlayers.MambaMixer2(*args, **kwargs)
    jlayer.load_hf_state_dict(sd, prefix="mixer.")
    jout, _, jssm = nnx.jit(lambda m, x: m(x))(jlayer, jnp.asarray(x.numpy()))
    assert testing.compare(np.asarray(jout), want, "float32").ok
    assert testing.compare(np.asarray(jssm), ssm.numpy(), "float32").ok
    with pytest.raises(ValueError, match="MambaMixer2.load_hf_state_dict: unexpected \\['mixer.out_proj.bias'\\]"):
        layer.load_hf_state_dict({**sd, "mixer.out_proj.bias": torch.zeros(HIDDEN)}, prefix="mixer.")


class _StandInConv:
    """A stand-in for the causal_conv1d op (its module is another branch's): the reference through
    the interface's signature, so the mixer's platform body is checked before the kernels merge."""

    def __init__(self, dim, kernel_size, activation="silu"):
        self.activation = activation

    def __call__(self, x, weight, bias=None, conv_state=None, cu_seqlens=None, state_indices=None,
                 has_initial_state=None):
        from dualop.backends import array_namespace
        from dualop.kernels import ssm_math
        from dualop.ops.ssm_batch import ssm_batch

        xp = array_namespace(x)
        b = ssm_batch("causal_conv1d", x, cu_seqlens, state_indices, has_initial_state, conv_state, "conv_state",
                      (x.shape[1], weight.shape[1] - 1))
        return ssm_math.causal_conv1d_reference(xp, x, weight, bias, b.state, b.cu_seqlens, b.state_indices,
                                                b.has_initial_state, self.activation)


class _StandInSSD:
    """A stand-in for the ssd_chunk_scan op (see ``_StandInConv``)."""

    def __init__(self, num_heads, head_dim, state_size, n_groups=1, chunk_size=256, delta_softplus=True,
                 dt_limit=(0.0, float("inf"))):
        self.shape, self.softplus, self.dt_limit = (num_heads, head_dim, state_size), delta_softplus, dt_limit

    def __call__(self, x, dt, A, B, C, D=None, z=None, dt_bias=None, ssm_state=None, cu_seqlens=None,
                 state_indices=None, has_initial_state=None):
        from dualop.backends import array_namespace
        from dualop.kernels import ssm_math
        from dualop.ops.ssm_batch import ssm_batch

        xp = array_namespace(x)
        b = ssm_batch("ssd_chunk_scan", x, cu_seqlens, state_indices, has_initial_state, ssm_state, "ssm_state",
                      self.shape)
        return ssm_math.ssd_reference(xp, x, dt, A, B, C, D, z, dt_bias, b.state, b.cu_seqlens, b.state_indices,
                                      b.has_initial_state, self.softplus, self.dt_limit)


def test_mixer_platform_body_with_stand_in_kernel_ops(monkeypatch):
    """The platform methods' one body (vendor GEMMs, the kernel ops, the gated-norm kernel), run as
    forward_cpu with the kernel ops stood in by their references, equals forward_native on the
    check case's inputs, caches (a padding slot, a fresh and a continued sequence) included."""
    torch = importlib.import_module("torch")
    import types

    from dualop.ops import MambaMixer2, mamba_mixer2

    monkeypatch.setitem(sys.modules, "dualop.ops.causal_conv1d", types.SimpleNamespace(CausalConv1d=_StandInConv))
    monkeypatch.setitem(sys.modules, "dualop.ops.ssd", types.SimpleNamespace(SSDChunkScan=_StandInSSD))
    op = MambaMixer2(**mamba_mixer2._CASE_MIXER)
    assert op.passes_over("forward_cpu", "torch") is None
    rng = np.random.default_rng(5)
    args = mamba_mixer2.mixer_case_inputs(op, 12, rng, (5, 1, 6))
    for dtype in ("float32", "bfloat16"):
        t_args = [testing.to_frontend(a, "torch", dtype) for a in args]
        ws = t_args[1:11]
        slots = 4
        caches = [torch.randn(slots, *op.conv_state_shape), torch.randn(slots, *op.ssm_state_shape)]
        meta = dict(cu_seqlens=t_args[13], state_indices=torch.tensor([3, -1, 0]),
                    has_initial_state=torch.tensor([True, False, False]))
        want_caches = [c.clone() for c in caches]
        want, _, _ = op.forward_native(t_args[0], *ws, *want_caches, **meta)
        got, _, _ = op.forward_cpu(t_args[0], *ws, *caches, **meta)
        cmp = testing.compare(got.float().numpy(), want.float().numpy(), dtype)
        assert cmp.ok, (dtype, cmp)
        for c, w in zip(caches, want_caches):
            assert testing.compare(c.numpy(), w.numpy(), "float32").ok
        assert torch.count_nonzero(got[5]) == 0  # the padding sequence's token
