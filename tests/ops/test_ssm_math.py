"""The state-space recurrences of ``dualop.kernels.ssm_math`` (the native bodies of causal_conv1d,
selective_scan and ssd_chunk_scan) against float64 numpy written per sequence, straight from the
papers' equations, on packed batches with cached initial states, fresh sequences and a padding
slot; for torch tensors and jax arrays (eager and under ``jit``)."""

from __future__ import annotations

import numpy as np
import pytest

from dualop.kernels import ssm_math

# Three sequences packed along T; the second starts from its cached state, the third is padding.
CU_SEQLENS = np.array([0, 5, 6, 9], np.int32)
STATE_INDICES = np.array([2, 0, -1], np.int32)
HAS_INITIAL = np.array([False, True, True])
SLOTS = 3


def _softplus(v):
    return np.log1p(np.exp(v))


def _silu(v):
    return v / (1 + np.exp(-v))


def _per_sequence(cache, run):
    """Run ``run(start, end, h0) -> (y_rows, h_final)`` per sequence; padding rows zero, states
    written to their slots."""
    ys, cache = [], cache.copy()
    for b in range(len(STATE_INDICES)):
        start, end, slot = CU_SEQLENS[b], CU_SEQLENS[b + 1], STATE_INDICES[b]
        h0 = cache[slot].copy() if (HAS_INITIAL[b] and slot >= 0) else np.zeros(cache.shape[1:])
        y, h = run(start, end, h0)
        if slot < 0:
            y = np.zeros_like(y)
        else:
            cache[slot] = h
        ys.append(y)
    return np.concatenate(ys), cache


def _numpy_conv(x, w, bias, cache, silu):
    k = w.shape[1]

    def run(start, end, h0):
        seq = np.concatenate([h0.T, x[start:end]])  # [K-1 + L, D]: the window's history, then the inputs
        y = np.stack([np.sum(seq[t:t + k].T * w, axis=1) + bias for t in range(end - start)])
        return (_silu(y) if silu else y), seq[-(k - 1):].T

    return _per_sequence(cache, run)


def _numpy_selective_scan(x, dt, A, B, C, D, z, dt_bias, cache):
    def run(start, end, h):
        ys = []
        for t in range(start, end):
            delta = _softplus(dt[t] + dt_bias)
            h = np.exp(delta[:, None] * A) * h + (delta * x[t])[:, None] * B[t][None, :]
            ys.append((h @ C[t] + D * x[t]) * _silu(z[t]))
        return np.stack(ys), h

    return _per_sequence(cache, run)


def _numpy_ssd(x, dt, A, B, C, D, dt_bias, cache, dt_limit):
    heads, groups = x.shape[1], B.shape[1]

    def run(start, end, h):
        ys = []
        for t in range(start, end):
            delta = np.clip(_softplus(dt[t] + dt_bias), *dt_limit)
            y = np.empty(x.shape[1:])
            for head in range(heads):
                g = head // (heads // groups)
                h[head] = np.exp(delta[head] * A[head]) * h[head] + delta[head] * np.outer(x[t, head], B[t, g])
                y[head] = h[head] @ C[t, g] + D[head] * x[t, head]
            ys.append(y)
        return np.stack(ys), h

    return _per_sequence(cache, run)


def _to(frontend, a):
    if a is None:
        return None
    if frontend == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(a))
    import jax.numpy as jnp

    return jnp.asarray(a)


def _run(frontend, fn, *args, jit=False, **static):
    from dualop.backends import array_namespace

    args = tuple(_to(frontend, a) for a in args)
    xp = array_namespace(args[0])
    if jit:
        import jax

        return jax.jit(lambda *a: fn(xp, *a, **static))(*args)
    return fn(xp, *args, **static)


FRONTENDS = [("torch", False), ("jax", False), ("jax", True)]


def _assert_close(got, want, atol=1e-5):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol)


@pytest.mark.reference
@pytest.mark.parametrize("frontend, jit", FRONTENDS)
def test_causal_conv1d_reference(frontend, jit):
    rng = np.random.default_rng(0)
    t, d, k = int(CU_SEQLENS[-1]), 6, 4
    x, w, bias = rng.standard_normal((t, d)), rng.standard_normal((d, k)), rng.standard_normal(d)
    cache = rng.standard_normal((SLOTS, d, k - 1))
    want_y, want_cache = _numpy_conv(x, w, bias, cache, silu=True)
    y, new_cache = _run(frontend, ssm_math.causal_conv1d_reference, *(a.astype(np.float32) for a in (x, w, bias)),
                        cache.astype(np.float32), CU_SEQLENS, STATE_INDICES, HAS_INITIAL, jit=jit, activation="silu")
    _assert_close(y, want_y)
    _assert_close(new_cache, want_cache)


@pytest.mark.reference
@pytest.mark.parametrize("frontend, jit", FRONTENDS)
def test_selective_scan_reference(frontend, jit):
    rng = np.random.default_rng(1)
    t, i, n = int(CU_SEQLENS[-1]), 5, 3
    x, dt, z = (rng.standard_normal((t, i)) for _ in range(3))
    A = -np.exp(rng.standard_normal((i, n)))
    B, C = rng.standard_normal((t, n)), rng.standard_normal((t, n))
    D, dt_bias = rng.standard_normal(i), rng.standard_normal(i)
    cache = rng.standard_normal((SLOTS, i, n))
    want_y, want_cache = _numpy_selective_scan(x, dt, A, B, C, D, z, dt_bias, cache)
    f32 = [a.astype(np.float32) for a in (x, dt, A, B, C, D, z, dt_bias, cache)]
    y, new_cache = _run(frontend, ssm_math.selective_scan_reference, *f32, CU_SEQLENS, STATE_INDICES, HAS_INITIAL,
                        jit=jit, delta_softplus=True)
    _assert_close(y, want_y, atol=1e-4)
    _assert_close(new_cache, want_cache, atol=1e-4)


@pytest.mark.reference
@pytest.mark.parametrize("frontend, jit", FRONTENDS)
def test_ssd_reference(frontend, jit):
    rng = np.random.default_rng(2)
    t, heads, p, groups, n = int(CU_SEQLENS[-1]), 4, 3, 2, 5
    x = rng.standard_normal((t, heads, p))
    dt = rng.standard_normal((t, heads))
    A = -np.exp(rng.standard_normal(heads))
    B, C = rng.standard_normal((t, groups, n)), rng.standard_normal((t, groups, n))
    D, dt_bias = rng.standard_normal(heads), rng.standard_normal(heads)
    cache = rng.standard_normal((SLOTS, heads, p, n))
    dt_limit = (0.05, 2.0)
    want_y, want_cache = _numpy_ssd(x, dt, A, B, C, D, dt_bias, cache, dt_limit)
    f32 = [a.astype(np.float32) for a in (x, dt, A, B, C, D)]
    y, new_cache = _run(frontend, ssm_math.ssd_reference, *f32, None, dt_bias.astype(np.float32),
                        cache.astype(np.float32), CU_SEQLENS, STATE_INDICES, HAS_INITIAL, jit=jit,
                        delta_softplus=True, dt_limit=dt_limit)
    _assert_close(y, want_y, atol=1e-4)
    _assert_close(new_cache, want_cache, atol=1e-4)


# --- the serving batch's defaults and checks (dualop.ops.ssm_batch) --------------------------------


def _batch(frontend="torch", t=9, cu=CU_SEQLENS, idx=STATE_INDICES, init=HAS_INITIAL, state_shape=(4, 2),
           slots=SLOTS, state=True):
    from dualop.ops.ssm_batch import ssm_batch

    x = _to(frontend, np.zeros((t, 4), np.float32))
    cache = _to(frontend, np.zeros((slots, *state_shape), np.float32)) if state else None
    return ssm_batch("mamba_op", x, _to(frontend, cu), _to(frontend, idx), _to(frontend, init), cache, "ssm_state",
                     state_shape)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_batch_defaults(frontend):
    from dualop.ops.ssm_batch import ssm_batch

    x = _to(frontend, np.zeros((5, 4), np.float32))
    fresh = ssm_batch("mamba_op", x, None, None, None, None, "ssm_state", (4, 2))
    assert (fresh.num_seqs, fresh.num_tokens, fresh.state_given, fresh.decode) == (1, 5, False, False)
    assert np.asarray(fresh.cu_seqlens).tolist() == [0, 5] and not np.asarray(fresh.has_initial_state).any()
    assert tuple(fresh.state.shape) == (1, 4, 2)
    cached = _batch(frontend, init=None)
    assert np.asarray(cached.has_initial_state).all() and cached.state_given
    decode = _batch(frontend, t=3, cu=np.array([0, 1, 2, 3], np.int32))
    assert decode.decode


@pytest.mark.parametrize("kwargs, error, match", [
    ({"cu": np.array([0, 5, 5, 9], np.int32)}, ValueError, r"'cu_seqlens' must strictly increase .* entries 1 and 2"),
    ({"cu": np.array([1, 5, 6, 9], np.int32)}, ValueError, r"'cu_seqlens' must start at 0 and end at the token count 9"),
    ({"cu": np.array([0, 5, 6, 9], np.float32)}, TypeError, r"'cu_seqlens' has dtype float32"),
    ({"idx": np.array([2, 3, -1], np.int32)}, ValueError, r"'state_indices' holds slot 3; expected -1 .* \[0, 3\)"),
    ({"idx": np.array([2, 2, -1], np.int32)}, ValueError, r"two sequences the same slot"),
    ({"idx": np.array([2, 0], np.int32)}, ValueError, r"'state_indices' has shape \(2,\); expected \[3\]"),
    ({"state_shape": (4, 3)}, None, None),
    ({"state": False}, ValueError, r"'has_initial_state' is True for a sequence but no 'ssm_state' cache"),
    ({"init": np.array([0, 1, 1], np.int32)}, TypeError, r"'has_initial_state' has dtype int32; expected bool"),
])
def test_batch_refuses_bad_metadata(kwargs, error, match):
    if "state_shape" in kwargs:  # a cache of the wrong shape for the layer
        from dualop.ops.ssm_batch import ssm_batch

        x, cache = _to("torch", np.zeros((9, 4), np.float32)), _to("torch", np.zeros((3, 4, 3), np.float32))
        with pytest.raises(ValueError, match=r"mamba_op: argument 'ssm_state' has shape \(3, 4, 3\); expected "
                                             r"\[slots, 4, 2\] for this layer"):
            ssm_batch("mamba_op", x, None, None, None, cache, "ssm_state", (4, 2))
        return
    with pytest.raises(error, match="mamba_op: .*" + match):
        _batch(**kwargs)
