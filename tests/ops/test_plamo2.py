"""plamo2_mamba_mixer (PLaMo 2's Mamba-2 mixer): the native body against (a) float64 numpy written
from the engine's equations token by token (independent of ``ssm_math``) and (b) transformers' own
Mamba-2 functions wired as PLaMo 2 wires them; state continuity, padding slots, bad input, jax
``jit``, gradients of the native body, the layers' checkpoint loading.

(b), the equivalence used: PLaMo 2's mixer is Mamba-2's conv and SSD scan with a different source
for B, C and dt and FalconH1's un-normalised gate (``y * silu(gate)``). No weight setting makes a
whole transformers Mamba-2 mixer compute it (there B and C are ``silu(conv(in_proj(h)))`` channels
and ``Mamba2Mixer`` always RMS-normalises its output), so the reference composes the functions
transformers' ``Mamba2Mixer`` itself calls (``causal_conv1d_fn``/``causal_conv1d_update``,
``mamba2_chunk_scan``/``mamba2_selective_state_update``, their torch fallbacks) with
``torch.nn.functional.rms_norm``/``linear`` in the engine's order. The chunked scan (chunk 4 over 11
tokens) is a different algorithm from the op's token loop.

The platform methods compose the kernel ops causal_conv1d and ssd_chunk_scan (their cells run in
tests/sweeps/test_cells.py); their wiring is also checked against forward_native with the kernel ops
replaced by the references.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from dualop import ops, testing
from dualop.ops.plamo2 import (CHECK_SHAPES, Plamo2MambaMixer, check_case_inputs,
                               in_proj_from_checkpoint, in_proj_to_checkpoint)

EPS = 1e-6
# (tokens, sequences, hidden, heads, head_dim, state, rank): packed prefill with a padding sequence
# and a continuing one, and a decode step (see CHECK_SHAPES).
SHAPES = (CHECK_SHAPES[1], CHECK_SHAPES[2], CHECK_SHAPES[3])


def _op(shape) -> Plamo2MambaMixer:
    _, _, hidden, heads, head_dim, state, rank = shape
    return Plamo2MambaMixer(hidden, state, 4, heads, head_dim, time_step_rank=rank, rms_norm_eps=EPS, chunk_size=4)


def _numpy_args(shape, seed=0):
    """The check case's inputs as numpy (Pinned metadata unwrapped)."""
    args = check_case_inputs(shape, np.random.default_rng(seed))
    return [a.array if isinstance(a, testing.Pinned) else a for a in args]


def _frontend_args(shape, frontend, seed=0, dtype="float32"):
    args = check_case_inputs(shape, np.random.default_rng(seed))
    return [testing.to_frontend(a, frontend, dtype) for a in args]


# --- (a) float64 numpy, token by token, from the engine's equations ---------------------------------


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _rms(v, w):
    return v / np.sqrt(np.mean(v * v) + EPS) * w


def plamo2_numpy(shape, h, w_in, w_conv, w_bcdt, w_dt, dt_bias, a_log, d, w_dtn, w_bn, w_cn, w_out, conv_cache,
                 ssm_cache, cu, slots, init):
    """The engine's Plamo2MambaMixer per token in float64: in_proj -> [gate | x]; depthwise causal
    conv (window = the slot's last K-1 inputs) + silu; bcdt_proj -> [B | C | t]; RMS norms; dt =
    softplus(dt_proj(t) + dt_bias); h = exp(dt A) h + dt x B; y = h C + D x; y * silu(gate);
    out_proj. Padding slots (-1): zero outputs, nothing written."""
    _, _, hidden, heads, head_dim, n, r = shape
    inner = heads * head_dim
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    h, w_in, w_conv, w_bcdt, w_dt, w_out = map(f, (h, w_in, w_conv, w_bcdt, w_dt, w_out))
    dt_bias, a, d, w_dtn, w_bn, w_cn = f(dt_bias), -np.exp(f(a_log)), f(d), f(w_dtn), f(w_bn), f(w_cn)
    conv_cache, ssm_cache = f(conv_cache).copy(), f(ssm_cache).copy()
    out = np.zeros((h.shape[0], hidden))
    for b, slot in enumerate(slots):
        if slot < 0:
            continue
        window = conv_cache[slot].copy() if init[b] else np.zeros(conv_cache.shape[1:])
        state = ssm_cache[slot].copy() if init[b] else np.zeros(ssm_cache.shape[1:])
        for t in range(cu[b], cu[b + 1]):
            proj = w_in @ h[t]
            gate, x = proj[:inner], proj[inner:]
            full = np.concatenate([window, x[:, None]], axis=1)
            window = full[:, 1:]
            xc = _silu(np.sum(full * w_conv, axis=1))
            bcdt = w_bcdt @ xc
            bv, cv, tv = _rms(bcdt[:n], w_bn), _rms(bcdt[n:2 * n], w_cn), _rms(bcdt[2 * n:], w_dtn)
            dt = np.log1p(np.exp(w_dt @ tv + dt_bias))
            xh = xc.reshape(heads, head_dim)
            state = np.exp(dt * a)[:, None, None] * state + (dt[:, None] * xh)[:, :, None] * bv[None, None, :]
            y = state @ cv + d[:, None] * xh
            y = y * _silu(gate.reshape(heads, head_dim))
            out[t] = w_out @ y.reshape(inner)
        conv_cache[slot], ssm_cache[slot] = window, state
    return out, conv_cache, ssm_cache


@pytest.mark.reference
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}B{s[1]}")
def test_native_matches_float64_numpy(shape):
    """torch here; jax's native body against the same reference under jit below."""
    want = plamo2_numpy(shape, *_numpy_args(shape))
    got = _op(shape).forward_native(*_frontend_args(shape, "torch"))
    for g, w, name in zip(got, want, ("out", "conv_state", "ssm_state")):
        np.testing.assert_allclose(testing.to_numpy(g), w, rtol=2e-4, atol=2e-5, err_msg=name)


def test_native_without_caches_returns_fresh_float32_states():
    shape = CHECK_SHAPES[1]
    args = _numpy_args(shape)
    args[16] = np.zeros_like(args[16])  # nothing cached: every sequence starts from zeros
    args[15] = np.arange(shape[1], dtype=np.int32)  # slot b, no padding
    out_ref, conv_ref, ssm_ref = plamo2_numpy(shape, *args)
    targs = [None if a is None else torch.from_numpy(np.asarray(a)) for a in args]
    out, conv, ssm = _op(shape).forward_native(*targs[:12], None, None, targs[14], None, None)
    assert conv.dtype == ssm.dtype == torch.float32 and conv.shape[0] == ssm.shape[0] == shape[1]
    np.testing.assert_allclose(out.numpy(), out_ref, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(ssm.numpy(), ssm_ref[: shape[1]], rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(conv.numpy(), conv_ref[: shape[1]], rtol=2e-4, atol=2e-5)


# --- (b) transformers' Mamba-2 functions in PLaMo 2's wiring --------------------------------------


@pytest.mark.reference
def test_native_matches_transformers_mamba2_functions():
    """Two sequences of 11 tokens continuing from their cached states (slots 2 and 0), then one
    decode step each: outputs and both caches against the transformers composition (the bench's
    peer, ``dualop.ops.plamo2._torch_transformers_plamo2``: chunked scan with chunk 4, then
    transformers' single-step update functions)."""
    from dualop.ops.plamo2 import _torch_transformers_plamo2

    shape = (22, 2, 24, 3, 8, 8, 8)
    length = 11
    weights = [torch.from_numpy(np.asarray(a)) for a in _numpy_args(shape, seed=3)[:12]]
    rng = np.random.default_rng(4)
    conv_cache = torch.from_numpy(testing.normal((3, 24, 3), rng))
    ssm_cache = torch.from_numpy(testing.normal((3, 3, 8, 8), rng, 0.5))
    hf_conv, hf_ssm = conv_cache.clone(), ssm_cache.clone()
    meta = (torch.tensor([0, length, 2 * length], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32),
            torch.tensor([True, True]))
    op = _op(shape)
    hf = _torch_transformers_plamo2(op)
    step = torch.from_numpy(testing.normal((2, 24), rng))
    for h, cu in ((weights[0], meta[0]), (step, torch.tensor([0, 1, 2], dtype=torch.int32))):
        want, hf_conv, hf_ssm = hf(h, *weights[1:], hf_conv, hf_ssm, cu, *meta[1:])
        got, conv_cache, ssm_cache = op.forward_native(h, *weights[1:], conv_cache, ssm_cache, cu, *meta[1:])
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(conv_cache.numpy(), hf_conv.numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(ssm_cache.numpy(), hf_ssm.numpy(), rtol=1e-4, atol=1e-5)


# --- serving: continuity, padding ---------------------------------------------------------------------


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_state_continuity(frontend):
    """One sequence of 8 tokens from a cached state: one prefill == 4 tokens then a continued
    prefill of 4 == 4 tokens then 4 decode steps (one token each), outputs and final caches."""
    shape = (8, 1, 16, 2, 8, 4, 8)
    args = _frontend_args(shape, frontend, seed=5)
    weights, conv0, ssm0 = args[1:12], args[12], args[13]
    h = args[0]
    op = _op(shape)
    slot = testing.to_frontend(testing.Pinned(np.array([1], np.int32), "int32"), frontend, "float32")
    yes = testing.to_frontend(testing.Pinned(np.array([True]), "bool"), frontend, "float32")

    def cu(n):
        return testing.to_frontend(testing.Pinned(np.array([0, n], np.int32), "int32"), frontend, "float32")

    def clone(a):
        return a.clone() if frontend == "torch" else a

    if frontend == "jax":  # one compiled body per token count (eager lax.scan retraces every call)
        import jax

        run = jax.jit(op.forward_native)
    else:
        run = op.forward_native
    whole, conv_w, ssm_w = run(h, *weights, clone(conv0), clone(ssm0), cu(8), slot, yes)
    first, conv_c, ssm_c = run(h[:4], *weights, clone(conv0), clone(ssm0), cu(4), slot, yes)
    rest, conv_p, ssm_p = run(h[4:], *weights, clone(conv_c), clone(ssm_c), cu(4), slot, yes)
    steps = []
    conv_d, ssm_d = conv_c, ssm_c
    for t in range(4, 8):
        y, conv_d, ssm_d = run(h[t:t + 1], *weights, clone(conv_d), clone(ssm_d), cu(1), slot, yes)
        steps.append(testing.to_numpy(y))
    np_whole = testing.to_numpy(whole)
    for got in (np.concatenate([testing.to_numpy(first), testing.to_numpy(rest)]),
                np.concatenate([testing.to_numpy(first), *steps])):
        np.testing.assert_allclose(got, np_whole, rtol=1e-5, atol=1e-6)
    for conv, ssm in ((conv_p, ssm_p), (conv_d, ssm_d)):
        np.testing.assert_allclose(testing.to_numpy(conv), testing.to_numpy(conv_w), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(testing.to_numpy(ssm), testing.to_numpy(ssm_w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_padding_slot_gives_zeros_and_writes_nothing(frontend):
    """A padding sequence (slot -1): zero output rows; every slot no live sequence owns keeps its
    contents (torch updates the cache in place)."""
    shape = CHECK_SHAPES[1]  # 3 sequences in 4 slots, one of them padding
    args = _frontend_args(shape, frontend, seed=7)
    slots = testing.to_numpy(args[15]).astype(int)
    cu = testing.to_numpy(args[14]).astype(int)
    pad = int(np.flatnonzero(slots < 0)[0])
    conv_before, ssm_before = testing.to_numpy(args[12]).copy(), testing.to_numpy(args[13]).copy()
    op = _op(shape)
    if frontend == "jax":
        import jax

        out, conv, ssm = jax.jit(op.forward_native)(*args)
    else:
        out, conv, ssm = op.forward_native(*args)
    out = testing.to_numpy(out)
    assert not out[cu[pad]:cu[pad + 1]].any()
    assert np.abs(np.delete(out, np.arange(cu[pad], cu[pad + 1]), axis=0)).min(axis=1).all()
    untouched = sorted(set(range(conv_before.shape[0])) - set(slots[slots >= 0].tolist()))
    assert untouched
    np.testing.assert_array_equal(testing.to_numpy(conv)[untouched], conv_before[untouched])
    np.testing.assert_array_equal(testing.to_numpy(ssm)[untouched], ssm_before[untouched])
    if frontend == "torch":
        assert conv is args[12] and ssm is args[13]


# --- bad input ---------------------------------------------------------------------------------------------


def _bad(index, value):
    def edit(args):
        args = list(args)
        args[index] = value(args) if callable(value) else value
        return args

    return edit


BAD = [
    ("hidden_states", ValueError, _bad(0, lambda a: a[0][:, :-1])),
    ("hidden_states", TypeError, _bad(0, lambda a: a[0].to(torch.int32))),
    ("in_proj_weight", ValueError, _bad(1, lambda a: a[1][:-1])),
    ("conv_weight", ValueError, _bad(2, lambda a: a[2][:, :-1])),
    ("bcdt_proj_weight", ValueError, _bad(3, None)),
    ("A_log", ValueError, _bad(6, lambda a: a[6][:-1])),
    ("B_norm_weight", TypeError, _bad(9, lambda a: a[9].to(torch.int64))),
    ("conv_state", ValueError, _bad(12, lambda a: a[12][:, :, :-1])),
    ("ssm_state", ValueError, _bad(13, lambda a: a[13][:-1])),  # one slot count for both caches
    ("ssm_state", ValueError, _bad(13, None)),  # both caches or neither
    ("cu_seqlens", ValueError, _bad(14, lambda a: a[14].flip(0))),
    ("state_indices", ValueError, _bad(15, lambda a: torch.full_like(a[15], 7))),
    ("has_initial_state", TypeError, _bad(16, lambda a: a[16].int())),
]


@pytest.mark.parametrize("arg, error, edit", BAD, ids=[f"{a}-{e.__name__}" for a, e, _ in BAD])
def test_bad_input_names_the_op_and_argument(arg, error, edit):
    shape = CHECK_SHAPES[1]
    args = edit(_frontend_args(shape, "torch"))
    op = _op(shape)
    with pytest.raises(error, match=f"plamo2_mamba_mixer: .*'{arg}'"):
        op(*args)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="plamo2_mamba_mixer: num_heads"):
        Plamo2MambaMixer(16, 4, 4, 0, 8)
    with pytest.raises(ValueError, match="plamo2_mamba_mixer: rms_norm_eps"):
        Plamo2MambaMixer(16, 4, 4, 2, 8, rms_norm_eps=-1.0)
    assert Plamo2MambaMixer(2048, 64, 4, 32, 128).time_step_rank == 128  # the engine's max(64, hidden // 16)
    assert Plamo2MambaMixer(512, 64, 4, 8, 64).time_step_rank == 64


# --- jax: jit; gradients of the native body ------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("shape", (CHECK_SHAPES[2], CHECK_SHAPES[3]), ids=("decode", "prefill"))
def test_jax_native_under_jit_matches_numpy(shape):
    import jax

    want = plamo2_numpy(shape, *_numpy_args(shape, seed=9))
    op = _op(shape)
    got = jax.jit(lambda *a: op.forward_native(*a))(*_frontend_args(shape, "jax", seed=9))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-5)


def test_jax_dispatch_under_jit_matches_numpy():
    """The dispatched op (checks, then the method the registry picks) traces under jit."""
    import jax

    shape = CHECK_SHAPES[1]
    want = plamo2_numpy(shape, *_numpy_args(shape, seed=2))
    op = _op(shape)
    got = jax.jit(lambda *a: op(*a))(*_frontend_args(shape, "jax", seed=2))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-5)


def test_grad_of_native_jax_matches_torch_autograd():
    """d(sum(out * cotangent)) / d(hidden_states, in_proj_weight, bcdt_proj_weight, A_log, the
    B norm weight) by jax.grad and by torch autograd through the same native body (from a cached
    state, two sequences)."""
    import jax
    import jax.numpy as jnp

    shape = (9, 2, 16, 2, 8, 4, 8)
    args = _numpy_args(shape, seed=11)
    args[16] = np.array([True, False])
    args[15] = np.array([0, 1], np.int32)
    cot = testing.normal((9, 16), np.random.default_rng(12))
    wrt = (0, 1, 3, 6, 9)
    op = _op(shape)

    def jax_loss(*diff):
        full = [jnp.asarray(a) for a in args]
        for i, v in zip(wrt, diff):
            full[i] = v
        return jnp.sum(op.forward_native(*full)[0] * cot)

    jax_grads = jax.jit(jax.grad(jax_loss, argnums=tuple(range(len(wrt)))))(*(jnp.asarray(args[i]) for i in wrt))
    targs = [torch.from_numpy(np.asarray(a)) for a in args]
    for i in wrt:
        targs[i].requires_grad_(True)
    (op.forward_native(*targs)[0] * torch.from_numpy(cot)).sum().backward()
    for i, g in zip(wrt, jax_grads):
        assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0
        np.testing.assert_allclose(np.asarray(g), targs[i].grad.numpy(), rtol=2e-4, atol=2e-5)


# --- the platform body --------------------------------------------------------------------------------------


def test_platform_methods_decline_only_where_no_kernel_serves():
    op = _op(CHECK_SHAPES[1])
    for method, frontend in (("forward_cpu", "torch"), ("forward_cuda", "torch"), ("forward_tpu", "jax"),
                             ("forward_tpu", "torch_xla")):
        assert op.passes_over(method, frontend) is None
    assert op.passes_over("forward_cpu", "jax") is not None
    assert "jax-triton" in op.passes_over("forward_cuda", "jax")


class _ReferenceConv:
    """Stands in for CausalConv1d (the interface's call) with the reference."""

    def __init__(self, op):
        self.op = op

    def __call__(self, x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state):
        from dualop.backends import array_namespace
        from dualop.kernels import ssm_math
        from dualop.ops.ssm_batch import ssm_batch

        b = ssm_batch("causal_conv1d", x, cu_seqlens, state_indices, has_initial_state, conv_state, "conv_state",
                      self.op.conv_state_shape)
        return ssm_math.causal_conv1d_reference(array_namespace(x), x, weight, bias, b.state, b.cu_seqlens,
                                                b.state_indices, b.has_initial_state, "silu")


class _ReferenceSSD:
    """Stands in for SSDChunkScan (the interface's call) with the reference."""

    def __init__(self, op):
        self.op = op

    def __call__(self, x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state):
        from dualop.backends import array_namespace
        from dualop.kernels import ssm_math
        from dualop.ops.ssm_batch import ssm_batch

        b = ssm_batch("ssd_chunk_scan", x, cu_seqlens, state_indices, has_initial_state, ssm_state, "ssm_state",
                      self.op.ssm_state_shape)
        return ssm_math.ssd_reference(array_namespace(x), x, dt, A, B, C, D, z, dt_bias, b.state, b.cu_seqlens,
                                      b.state_indices, b.has_initial_state, True)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_platform_body_wiring_matches_native(frontend):
    """The platform body (vendor matmuls around the kernel ops' interface calls), with the kernel
    ops stood in for by the references, equals forward_native."""
    shape = CHECK_SHAPES[3] if frontend == "torch" else CHECK_SHAPES[1]
    op = _op(shape)
    op._kernel_op_instances = (_ReferenceConv(op), _ReferenceSSD(op))
    method = "forward_cpu" if frontend == "torch" else "forward_tpu"
    native, platform = op.forward_native, functools.partial(op._forward_kernels, method)
    if frontend == "jax":
        import jax

        native, platform = jax.jit(native), jax.jit(platform)
    want = native(*_frontend_args(shape, frontend, seed=13))
    got = platform(*_frontend_args(shape, frontend, seed=13))
    for g, w in zip(got, want):
        np.testing.assert_allclose(testing.to_numpy(g), testing.to_numpy(w), rtol=1e-5, atol=1e-6)


# --- layers ------------------------------------------------------------------------------------------------------


def _engine_in_proj_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """The engine loader's reorder, restated: [Hd, H, 2P] halves per head -> [gate | x] rows."""
    w = weight.T.reshape(weight.shape[1], heads, -1)
    gate, x = np.split(w, 2, axis=-1)
    return np.concatenate([gate.reshape(weight.shape[1], -1), x.reshape(weight.shape[1], -1)], axis=-1).T


def _checkpoint(shape, seed=21):
    """A mixer's weights as a PLaMo 2 checkpoint stores them (in_proj interleaved per head,
    conv1d [I, 1, K]), and the op's arguments they mean."""
    _, _, _, heads, *_ = shape
    args = _numpy_args(shape, seed=seed)[1:12]
    names = list(ops.plamo2.CHECKPOINT_KEYS.items())
    ckpt = {}
    for (name, key), value in zip(names, args):
        ckpt[key] = value
    inter = np.empty_like(args[0])
    # invert the engine's order: rows [gate | x] -> per head [gate_h | x_h]
    p = args[0].shape[0] // (2 * heads)
    for h in range(heads):
        inter[2 * h * p:(2 * h + 1) * p] = args[0][h * p:(h + 1) * p]
        inter[(2 * h + 1) * p:(2 * h + 2) * p] = args[0][heads * p + h * p:heads * p + (h + 1) * p]
    np.testing.assert_array_equal(_engine_in_proj_order(inter, heads), args[0])
    ckpt["in_proj.weight"] = inter
    ckpt["conv1d.weight"] = args[1][:, None, :]
    return ckpt, args


def test_in_proj_reorder_matches_the_engines_and_inverts():
    w = testing.normal((2 * 3 * 4, 5), np.random.default_rng(0))
    np.testing.assert_array_equal(in_proj_from_checkpoint(w, 3), _engine_in_proj_order(w, 3))
    np.testing.assert_array_equal(in_proj_to_checkpoint(in_proj_from_checkpoint(w, 3), 3), w)


def test_torch_layer_loads_a_checkpoint_and_round_trips():
    from dualop.torch.layers import Plamo2MambaMixer as Layer

    shape = CHECK_SHAPES[1]
    _, _, hidden, heads, head_dim, state, rank = shape
    ckpt, op_args = _checkpoint(shape)
    layer = Layer(hidden, state, 4, heads, head_dim, time_step_rank=rank, rms_norm_eps=EPS, chunk_size=4)
    layer.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in ckpt.items()})
    np.testing.assert_array_equal(layer.in_proj.weight.detach().numpy(), op_args[0])
    saved = layer.state_dict()
    assert set(saved) == set(ckpt)
    for key, value in ckpt.items():
        np.testing.assert_array_equal(saved[key].numpy(), value, err_msg=key)

    args = _frontend_args(shape, "torch")
    want = _op(shape).forward_native(args[0], *(torch.from_numpy(np.asarray(a)) for a in op_args),
                                     *(a.clone() for a in args[12:14]), *args[14:])
    with torch.no_grad():
        got = layer(args[0], *args[12:])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6, atol=1e-6)


def test_jax_layer_loads_the_same_checkpoint_and_matches_torch_under_jit():
    import jax
    from flax import nnx

    from dualop.jax.layers import Plamo2MambaMixer as JaxLayer
    from dualop.torch.layers import Plamo2MambaMixer as TorchLayer

    shape = CHECK_SHAPES[3]
    _, _, hidden, heads, head_dim, state, rank = shape
    ckpt, _ = _checkpoint(shape, seed=22)
    jl = JaxLayer(hidden, state, 4, heads, head_dim, time_step_rank=rank, rms_norm_eps=EPS, chunk_size=4)
    jl.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in ckpt.items()}, prefix="")
    tl = TorchLayer(hidden, state, 4, heads, head_dim, time_step_rank=rank, rms_norm_eps=EPS, chunk_size=4)
    tl.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in ckpt.items()})
    with torch.no_grad():
        want = tl(*_frontend_args(shape, "torch", seed=23)[:1], *_frontend_args(shape, "torch", seed=23)[12:])
    jargs = _frontend_args(shape, "jax", seed=23)
    got = nnx.jit(lambda layer, *a: layer(*a))(jl, jargs[0], *jargs[12:])
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w.numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="'mixer.D' is missing"):
        jl.load_state_dict({"mixer." + k: v for k, v in ckpt.items() if k != "D"}, prefix="mixer.")
    del jax
