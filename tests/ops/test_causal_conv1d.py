"""CausalConv1d (``causal_conv1d``): the op against a float64 numpy convolution of each sequence
behind its cached history; every kernel (torch CPU, Triton, Pallas prefill and decode) against
forward_native at T = 1024 with T blocks splitting sequences (once per kernel); state continuity
(one prefill == a prefill continued == token-by-token decode from the cache); padding slots; bad
input; jit / vmap / grad in JAX. The small cell sweep runs in tests/sweeps/test_cells.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dualop import OpsConfig, override_platform, set_config, testing
from dualop.ops import CausalConv1d
from dualop.ops.ssm_batch import random_serving_batch

K = 4


def _inputs(tokens, dim, seqs, seed, *, padding=True, bias=True):
    rng = np.random.default_rng(seed)
    cu, slots, init, num_slots = random_serving_batch(tokens, seqs, rng, padding=padding)
    x = rng.standard_normal((tokens, dim)).astype(np.float32)
    w = (0.5 * rng.standard_normal((dim, K))).astype(np.float32)
    b = rng.standard_normal(dim).astype(np.float32) if bias else None
    cache = rng.standard_normal((num_slots, dim, K - 1)).astype(np.float32)
    return x, w, b, cache, cu, slots, init


def _numpy_conv(x, w, b, cache, cu, slots, init, silu=True):
    """float64 numpy: each sequence convolved (np.convolve) behind its K - 1 history inputs."""
    x, w, cache = (np.asarray(a, np.float64) for a in (x, w, cache))
    y = np.zeros_like(x)
    cache = cache.copy()
    for s in range(len(cu) - 1):
        start, end, slot = cu[s], cu[s + 1], slots[s]
        if slot < 0:
            continue
        hist = cache[slot] if init[s] else np.zeros((x.shape[1], K - 1))
        seq = np.concatenate([hist, x[start:end].T], axis=1)  # [D, K - 1 + L]
        for d in range(x.shape[1]):
            y[start:end, d] = np.convolve(seq[d], w[d, ::-1], mode="valid")
        if b is not None:
            y[start:end] += b
        cache[slot] = seq[:, -(K - 1):]
    if silu:
        y = y / (1.0 + np.exp(-y))
    return y, cache


def _torch(arrays, dtype=torch.float32):
    x, w, b, cache, cu, slots, init = arrays
    f = lambda a: None if a is None else torch.from_numpy(a.copy()).to(dtype)  # noqa: E731 (no shared memory)
    return f(x), f(w), f(b), f(cache), *(torch.from_numpy(a.copy()) for a in (cu, slots, init))


def _jax(arrays, dtype="float32"):
    import jax.numpy as jnp

    x, w, b, cache, cu, slots, init = arrays
    f = lambda a: None if a is None else jnp.asarray(a).astype(dtype)  # noqa: E731
    return f(x), f(w), f(b), f(cache), jnp.asarray(cu), jnp.asarray(slots), jnp.asarray(init)


def _close(got, want, dtype):
    cmp = testing.compare(testing.to_numpy(got), testing.to_numpy(want), dtype)
    assert cmp.ok, (cmp.max_abs, cmp.max_rel, cmp.detail)


@pytest.mark.reference
def test_native_matches_float64_numpy():
    arrays = _inputs(23, 12, 4, seed=0)
    want_y, want_cache = _numpy_conv(*arrays)
    args = _torch(arrays)
    y, cache = CausalConv1d(12, K).forward_native(*args)
    assert cache is args[3]  # torch: the cache is updated in place
    np.testing.assert_allclose(y.numpy(), want_y, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(cache.numpy(), want_cache, atol=1e-6)
    y, cache = CausalConv1d(12, K).forward_native(*_jax(arrays))
    np.testing.assert_allclose(np.asarray(y), want_y, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(cache), want_cache, atol=1e-6)


# ------------------------------------------------------------------ kernels at T = 1024, once each


def _long_case():
    """1024 tokens of 8 sequences (the prefill bench's shape) at 128 channels: every 256-token
    Pallas block and 64-token Triton block boundary falls inside a sequence."""
    return _inputs(1024, 128, 8, seed=3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_kernel_long_prefill(dtype):
    arrays = _long_case()
    op = CausalConv1d(128, K)
    got_args, want_args = _torch(arrays, getattr(torch, dtype)), _torch(arrays, getattr(torch, dtype))
    with override_platform("cpu"), set_config(OpsConfig(["all"])):
        got = op(*got_args)
    assert op.last_run("torch", "cpu")[0] == "forward_cpu"
    want = op.forward_native(*want_args)
    _close(got[0], want[0], dtype)
    _close(got[1], want[1], dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_kernel_long_prefill(dtype):
    from dualop.kernels.cuda import causal_conv1d as triton_conv

    arrays = _long_case()
    got_args, want_args = _torch(arrays, getattr(torch, dtype)), _torch(arrays, getattr(torch, dtype))
    got = triton_conv.causal_conv1d(*(a.to(torch.int32) if a.dtype == torch.int64 else a for a in got_args),
                                    activation="silu")
    want = CausalConv1d(128, K).forward_native(*want_args)
    _close(got[0], want[0], dtype)
    _close(got[1], want[1], dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_kernel_long_prefill_and_decode(dtype):
    from dualop.kernels.pallas import causal_conv1d as pallas_conv

    op = CausalConv1d(128, K)
    for arrays, decode in ((_long_case(), False), (_inputs(64, 128, 64, seed=4), True)):
        args = _jax(arrays, dtype)
        got = pallas_conv.causal_conv1d(*args, activation="silu", decode=decode, interpret=True)
        want = op.forward_native(*args)
        _close(got[0], want[0], dtype)
        _close(got[1], want[1], dtype)


# ------------------------------------------------------------------ serving behaviour through the op

PLATFORM_PATHS = [("torch", "cpu"), ("torch", "cuda"), ("jax", "tpu")]


def _op_call(frontend, platform, op, arrays):
    conv = _torch if frontend == "torch" else _jax
    with override_platform(platform), set_config(OpsConfig(["all"])):
        y, cache = op(*conv(arrays))
    method, reason = op.last_run(frontend, platform)
    assert method != "forward_native", reason
    return np.asarray(testing.to_numpy(y)), np.asarray(testing.to_numpy(cache))


@pytest.mark.parametrize("frontend, platform", PLATFORM_PATHS)
def test_state_continuity(frontend, platform):
    """One prefill of a sequence == its first part then a continued prefill == the first part then
    token-by-token decode steps from the cache, for two sequences in slots 2 and 0."""
    rng = np.random.default_rng(7)
    dim, lengths, split = 16, (9, 6), (5, 2)
    xs = [rng.standard_normal((n, dim)).astype(np.float32) for n in lengths]
    w = (0.5 * rng.standard_normal((dim, K))).astype(np.float32)
    b = rng.standard_normal(dim).astype(np.float32)
    cache0 = rng.standard_normal((3, dim, K - 1)).astype(np.float32)
    slots = np.array([2, 0], np.int32)
    op = CausalConv1d(dim, K)

    def run(parts, cache, init):
        cu = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int32)
        return _op_call(frontend, platform, op, (np.concatenate(parts), w, b, cache.copy(), cu, slots,
                                                 np.array(init)))

    whole_y, whole_cache = run(xs, cache0, [True, False])
    first_y, cache = run([x[:s] for x, s in zip(xs, split)], cache0, [True, False])
    rest_y, cont_cache = run([x[s:] for x, s in zip(xs, split)], cache, [True, True])
    heads = np.cumsum([0, *split])
    tails = np.cumsum([0, *(n - s for n, s in zip(lengths, split))])
    for i, s in enumerate(split):
        got = np.concatenate([first_y[heads[i]:heads[i + 1]], rest_y[tails[i]:tails[i + 1]]])
        np.testing.assert_allclose(got, whole_y[sum(lengths[:i]):sum(lengths[:i + 1])], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(cont_cache, whole_cache, atol=1e-6)
    # Decode: one token per sequence per step (T == B).
    steps = []
    for t in range(max(n - s for n, s in zip(lengths, split))):
        live = [i for i in range(2) if split[i] + t < lengths[i]]
        if len(live) < 2:
            break
        y, cache = _op_call(frontend, platform, op, (np.stack([xs[i][split[i] + t] for i in live]), w, b, cache,
                                                     np.arange(3, dtype=np.int32), slots, np.array([True, True])))
        steps.append(y)
    decoded = np.stack(steps)  # [steps, 2, D]
    for i, s in enumerate(split):
        want = whole_y[sum(lengths[:i]) + s:sum(lengths[:i]) + s + len(steps)]
        np.testing.assert_allclose(decoded[:, i], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("frontend, platform", PLATFORM_PATHS)
def test_padding_slot_gives_zeros_and_keeps_the_cache(frontend, platform):
    arrays = list(_inputs(10, 8, 3, seed=5, padding=False))
    arrays[5] = np.array([1, -1, 4], np.int32)
    y, cache = _op_call(frontend, platform, CausalConv1d(8, K), tuple(arrays))
    cu = arrays[4]
    assert not y[cu[1]:cu[2]].any()
    assert y[cu[0]:cu[1]].any() and y[cu[2]:].any()
    untouched = [s for s in range(arrays[3].shape[0]) if s not in (1, 4)]
    np.testing.assert_array_equal(cache[untouched], arrays[3][untouched])


def test_no_cache_returns_fresh_float32_final_states():
    x, w, b, _, cu, _, _ = _inputs(11, 8, 3, seed=6)
    op = CausalConv1d(8, K)
    with override_platform("cpu"), set_config(OpsConfig(["all"])):
        y, finals = op(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), None, torch.from_numpy(cu))
    want_y, want_cache = _numpy_conv(x, w, b, np.zeros((3, 8, K - 1), np.float32), cu, np.arange(3),
                                     np.zeros(3, bool))
    assert finals.dtype == torch.float32 and finals.shape == (3, 8, K - 1)
    np.testing.assert_allclose(y.numpy(), want_y, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(finals.numpy(), want_cache, atol=1e-6)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("change, error, match", [
    (lambda a: {**a, "x": a["x"][:, :7]}, ValueError, "argument 'x' has shape"),
    (lambda a: {**a, "weight": a["weight"][:, :3]}, ValueError, "'weight'"),
    (lambda a: {**a, "weight": None}, TypeError, "'weight' is required"),
    (lambda a: {**a, "bias": a["bias"].to(torch.float16)}, TypeError, "'bias'"),
    (lambda a: {**a, "conv_state": a["conv_state"][:, :, :2]}, ValueError, "'conv_state' has shape"),
    (lambda a: {**a, "cu_seqlens": torch.tensor([0, 4, 3, 10], dtype=torch.int32)}, ValueError, "strictly increase"),
    (lambda a: {**a, "state_indices": torch.tensor([0, 0, 1], dtype=torch.int32)}, ValueError, "same slot"),
    (lambda a: {**a, "has_initial_state": a["has_initial_state"].to(torch.int32)}, TypeError, "has_initial_state"),
])
def test_bad_input_names_op_and_argument(change, error, match):
    x, w, b, cache, cu, slots, init = _torch(_inputs(10, 8, 3, seed=8, padding=False))
    args = change(dict(x=x, weight=w, bias=b, conv_state=cache, cu_seqlens=cu, state_indices=slots,
                       has_initial_state=init))
    with pytest.raises(error, match=match) as info:
        CausalConv1d(8, K)(**args)
    assert "causal_conv1d" in str(info.value)


def test_bad_constructor():
    with pytest.raises(ValueError, match="kernel_size"):
        CausalConv1d(8, 1)
    with pytest.raises(ValueError, match="activation"):
        CausalConv1d(8, 4, activation="gelu")


# ------------------------------------------------------------------ JAX transforms


def test_jax_jit_vmap_and_grad():
    import jax
    import jax.numpy as jnp

    x, w, b, cache, cu, slots, init = _jax(_inputs(7, 8, 2, seed=9, padding=False))
    op = CausalConv1d(8, K)
    with override_platform("tpu"), set_config(OpsConfig(["all"])):
        eager = op(x, w, b, cache, cu, slots, init)
        jitted = jax.jit(lambda *a: op(*a))(x, w, b, cache, cu, slots, init)
        assert op.last_run("jax", "tpu")[0] == "forward_tpu"
        for g, e in zip(jitted, eager):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-6)
        # vmap over a batch of independent inputs (each with its own cache).
        xs, caches = jnp.stack([x, 2 * x]), jnp.stack([cache, -cache])
        ys, new = jax.vmap(lambda xi, ci: op(xi, w, b, ci, cu, slots, init))(xs, caches)
        for i in range(2):
            want = op.forward_native(xs[i], w, b, caches[i], cu, slots, init)
            np.testing.assert_allclose(np.asarray(ys[i]), np.asarray(want[0]), atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(np.asarray(new[i]), np.asarray(want[1]), atol=1e-6)

    # grad of the native body against finite differences (the kernel path's VJP is this one).
    def loss(x_, w_, b_):
        x_, w_, b_ = map(jnp.asarray, (x_, w_, b_))  # check_grads' finite differences pass numpy
        y, state = op.forward_native(x_, w_, b_, cache, cu, slots, init)
        return jnp.sum(y * y) + jnp.sum(state)

    from jax.test_util import check_grads

    check_grads(loss, (x, w, b), order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-3)
