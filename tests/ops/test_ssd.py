"""SSDChunkScan (``ssd_chunk_scan``): the op against a float64 numpy recurrence of each sequence
from its cached state; every kernel (torch CPU, Triton, Pallas and the jax.numpy chunked form,
prefill and decode) against
forward_native at T = 1024 with chunk boundaries splitting sequences (once per kernel); results
independent of chunk_size; state continuity (one prefill == a prefill continued == token-by-token
decode from the cache); padding slots; bad input (H % G != 0 among them); jit / vmap / grad in
JAX. The small cell sweep runs in tests/sweeps/test_cells.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dualop import OpsConfig, override_platform, set_config, testing
from dualop.ops import SSDChunkScan
from dualop.ops.ssd import make_ssd_inputs

INTEGER_ARGS = 3  # the last three arguments: cu_seqlens, state_indices, has_initial_state


def _inputs(tokens, heads, seqs, head_dim, state, groups, seed, **kw):
    """Plain numpy arrays (the check case's generator, Pinned unwrapped)."""
    arrays = make_ssd_inputs((tokens, seqs, heads, head_dim, state, groups), np.random.default_rng(seed), **kw)
    return tuple(a.array if isinstance(a, testing.Pinned) else a for a in arrays)


def _torch(arrays, dtype=torch.float32):
    def conv(i, a):
        if a is None:
            return None
        t = torch.from_numpy(a.copy())  # a copy: the cache is updated in place
        return t if i >= len(arrays) - INTEGER_ARGS or i == 2 else t.to(dtype)  # A stays float32

    return tuple(conv(i, a) for i, a in enumerate(arrays))


def _jax(arrays, dtype="float32"):
    import jax.numpy as jnp

    def conv(i, a):
        if a is None:
            return None
        return jnp.asarray(a) if i >= len(arrays) - INTEGER_ARGS or i == 2 else jnp.asarray(a).astype(dtype)

    return tuple(conv(i, a) for i, a in enumerate(arrays))


def _numpy_ssd(x, dt, A, B, C, D, z, dt_bias, cache, cu, slots, init, dt_limit=(0.0, np.inf)):
    """float64 numpy, sequence by sequence: Δ = clip(softplus(dt + dt_bias)); h = exp(ΔA) h + Δ x ⊗ B;
    y = h C + D x, times silu(z)."""
    x, dt, A, B, C, D, z, dt_bias, cache = (np.asarray(a, np.float64) for a in (x, dt, A, B, C, D, z, dt_bias, cache))
    heads, groups = x.shape[1], B.shape[1]
    delta = np.clip(np.logaddexp(0.0, dt + dt_bias), *dt_limit)
    group_of = np.arange(heads) // (heads // groups)
    y = np.zeros_like(x)
    cache = cache.copy()
    for s in range(len(cu) - 1):
        if slots[s] < 0:
            continue
        h = cache[slots[s]].copy() if init[s] else np.zeros(cache.shape[1:])
        for t in range(cu[s], cu[s + 1]):
            h = np.exp(delta[t] * A)[:, None, None] * h + np.einsum("hp,hn->hpn", delta[t][:, None] * x[t],
                                                                    B[t, group_of])
            y[t] = np.einsum("hpn,hn->hp", h, C[t, group_of])
        cache[slots[s]] = h
    y = (y + (D[:, None] if D.ndim == 1 else D) * x) * (z / (1.0 + np.exp(-z)))
    keep = np.repeat(slots >= 0, np.diff(cu))
    return y * keep[:, None, None], cache


def _close(got, want, dtype):
    cmp = testing.compare(testing.to_numpy(got), testing.to_numpy(want), dtype)
    assert cmp.ok, (cmp.max_abs, cmp.max_rel, cmp.detail)


@pytest.mark.reference
def test_native_matches_float64_numpy():
    arrays = _inputs(23, 4, 4, 6, 5, 2, seed=0, per_channel_d=True)
    want_y, want_cache = _numpy_ssd(*arrays)
    op = SSDChunkScan(4, 6, 5, 2)
    args = _torch(arrays)
    y, cache = op.forward_native(*args)
    assert cache is args[8]  # torch: the cache is updated in place
    np.testing.assert_allclose(y.numpy(), want_y, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(cache.numpy(), want_cache, atol=1e-5, rtol=1e-5)
    y, cache = op.forward_native(*_jax(arrays))
    np.testing.assert_allclose(np.asarray(y), want_y, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(cache), want_cache, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ kernels at T = 1024, once each


def _long_case():
    """1024 tokens of 8 sequences (the prefill bench's batch) at small widths (2 heads of 16, 2
    groups of state 16): chunk boundaries (every 256 / 64 tokens) fall inside sequences. float32:
    the chunked form's rounding over long sequences shows there (bfloat16 runs in the cell sweep)."""
    return _inputs(1024, 2, 8, 16, 16, 2, seed=3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_kernel_long_prefill(dtype):
    arrays = _long_case()
    op = SSDChunkScan(2, 16, 16, 2)
    got_args, want_args = _torch(arrays, getattr(torch, dtype)), _torch(arrays, getattr(torch, dtype))
    with override_platform("cpu"), set_config(OpsConfig(["all"])):
        got = op(*got_args)
    assert op.last_run("torch", "cpu")[0] == "forward_cpu"
    want = op.forward_native(*want_args)
    _close(got[0], want[0], dtype)
    _close(got[1], want[1], dtype)


def test_triton_kernel_long_prefill(dtype="float32"):
    from dualop.kernels.cuda import ssd as triton_ssd

    arrays = _long_case()
    got_args, want_args = _torch(arrays, getattr(torch, dtype)), _torch(arrays, getattr(torch, dtype))
    got = triton_ssd.ssd_chunk_scan(*got_args, chunk_size=256)
    want = SSDChunkScan(2, 16, 16, 2).forward_native(*want_args)
    _close(got[0], want[0], dtype)
    _close(got[1], want[1], dtype)


def test_pallas_kernel_long_prefill_and_decode(dtype="float32"):
    from dualop.kernels.pallas import ssd as pallas_ssd
    from dualop.kernels.pallas.common import interpret_mode

    op = SSDChunkScan(2, 16, 16, 2)
    for arrays in (_long_case(), _inputs(64, 2, 64, 16, 16, 2, seed=4)):
        args = _jax(arrays, dtype)
        got = pallas_ssd.ssd_chunk_scan(*args, chunk_size=256, interpret=interpret_mode())
        want = op.forward_native(*args)
        _close(got[0], want[0], dtype)
        _close(got[1], want[1], dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_xla_kernel_long_prefill_and_decode(dtype):
    """The chunked form in jax.numpy (jax arrays on the CPU and GPUs) under jit: eight sequences of
    1024 tokens cut into their own chunks of ``MAX_CHUNK`` tokens (partial last chunks), and the
    decode step."""
    import jax

    from dualop.kernels.xla import ssd as xla_ssd

    op = SSDChunkScan(2, 16, 16, 2)
    for arrays in (_long_case(), _inputs(64, 2, 64, 16, 16, 2, seed=4)):
        args = _jax(arrays, dtype)
        got = jax.jit(lambda *a: xla_ssd.ssd_chunk_scan(*a, chunk_size=256))(*args)
        want = jax.jit(op.forward_native)(*args)
        _close(got[0], want[0], dtype)
        _close(got[1], want[1], dtype)


def test_xla_kernel_chunk_table_bound():
    """The static bound on the logical chunks holds with equality for sequences of one token over
    a chunk's length, and never undercounts (every sequence's chunks, summed, over random splits)."""
    from dualop.kernels.xla.ssd import num_chunks

    assert num_chunks(8 * 65, 8, 64) == 16  # eight sequences of 65 tokens: two chunks each
    assert num_chunks(5, 5, 64) == 5
    rng = np.random.default_rng(0)
    for _ in range(200):
        seqs, length = int(rng.integers(1, 9)), int(rng.integers(1, 70))
        lens = rng.integers(1, 300, seqs)
        assert sum(-(-n // length) for n in lens) <= num_chunks(int(lens.sum()), seqs, length)


# ------------------------------------------------------------------ serving behaviour through the op

PLATFORM_PATHS = [("torch", "cpu"), ("torch", "cuda"), ("jax", "tpu"), ("jax", "cpu")]


def _op_call(frontend, platform, op, arrays):
    conv = _torch if frontend == "torch" else _jax
    with override_platform(platform), set_config(OpsConfig(["all"])):
        y, cache = op(*conv(arrays))
    method, reason = op.last_run(frontend, platform)
    assert method != "forward_native", reason
    return np.asarray(testing.to_numpy(y)), np.asarray(testing.to_numpy(cache))


@pytest.mark.parametrize("frontend, platform", PLATFORM_PATHS)
def test_results_do_not_depend_on_chunk_size(frontend, platform):
    arrays = _inputs(40, 2, 3, 8, 8, 1, seed=10)
    results = [_op_call(frontend, platform, SSDChunkScan(2, 8, 8, 1, chunk_size=c), arrays) for c in (8, 256)]
    want_y, want_cache = _numpy_ssd(*arrays)
    for y, cache in results:
        np.testing.assert_allclose(y, want_y, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(cache, want_cache, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("frontend, platform", PLATFORM_PATHS)
def test_state_continuity(frontend, platform):
    """One prefill of a sequence == its first part then a continued prefill == the first part then
    token-by-token decode steps from the cache, for two sequences in slots 2 and 0."""
    rng = np.random.default_rng(7)
    heads, head_dim, state, lengths, split = 2, 8, 8, (19, 12), (10, 3)
    per_token = [testing.normal((sum(lengths), heads, head_dim), rng), testing.normal((sum(lengths), heads), rng, 0.5),
                 None, testing.normal((sum(lengths), 1, state), rng, 0.5),
                 testing.normal((sum(lengths), 1, state), rng, 0.5), None,
                 testing.normal((sum(lengths), heads, head_dim), rng)]
    a = -rng.uniform(0.5, 2.0, heads).astype(np.float32)
    d, dt_bias = testing.normal((heads,), rng), testing.normal((heads,), rng, 0.5)
    cache0 = testing.normal((3, heads, head_dim, state), rng)
    slots = np.array([2, 0], np.int32)
    op = SSDChunkScan(heads, head_dim, state, chunk_size=8)
    bounds = np.cumsum([0, *lengths])

    def pieces(ranges):  # per-token arrays of the given per-sequence token ranges, packed
        return [None if p is None else np.concatenate([p[bounds[i] + r0:bounds[i] + r1] for i, (r0, r1) in
                                                        enumerate(ranges)]) for p in per_token]

    def run(ranges, cache, init):
        x, dt, _, b, c, _, z = pieces(ranges)
        cu = np.concatenate([[0], np.cumsum([r1 - r0 for r0, r1 in ranges])]).astype(np.int32)
        return _op_call(frontend, platform, op, (x, dt, a, b, c, d, z, dt_bias, cache.copy(), cu, slots,
                                                 np.array(init)))

    whole_y, whole_cache = run([(0, n) for n in lengths], cache0, [True, False])
    first_y, cache = run([(0, s) for s in split], cache0, [True, False])
    rest_y, cont_cache = run([(s, n) for s, n in zip(split, lengths)], cache, [True, True])
    heads_at = np.cumsum([0, *split])
    tails_at = np.cumsum([0, *(n - s for n, s in zip(lengths, split))])
    for i in range(2):
        got = np.concatenate([first_y[heads_at[i]:heads_at[i + 1]], rest_y[tails_at[i]:tails_at[i + 1]]])
        np.testing.assert_allclose(got, whole_y[bounds[i]:bounds[i + 1]], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(cont_cache, whole_cache, atol=1e-4, rtol=1e-4)
    # Decode: one token per sequence per step (T == B), the decode kernels.
    steps = min(n - s for n, s in zip(lengths, split))
    for t in range(min(steps, 2)):
        y, cache = run([(s + t, s + t + 1) for s in split], cache, [True, True])
        for i, s in enumerate(split):
            np.testing.assert_allclose(y[i], whole_y[bounds[i] + s + t], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("frontend, platform", PLATFORM_PATHS)
def test_padding_slot_gives_zeros_and_keeps_the_cache(frontend, platform):
    arrays = list(_inputs(14, 2, 3, 8, 8, 1, seed=5, padding=False))
    arrays[10] = np.array([1, -1, 4], np.int32)
    y, cache = _op_call(frontend, platform, SSDChunkScan(2, 8, 8, chunk_size=8), tuple(arrays))
    cu = arrays[9]
    assert not y[cu[1]:cu[2]].any()
    assert y[cu[0]:cu[1]].any() and y[cu[2]:].any()
    untouched = [s for s in range(arrays[8].shape[0]) if s not in (1, 4)]
    np.testing.assert_array_equal(cache[untouched], arrays[8][untouched])


def test_no_cache_returns_fresh_float32_final_states():
    arrays = _inputs(11, 2, 3, 8, 8, 1, seed=6)
    x, dt, a, b, c, d, z, dt_bias, _, cu, _, _ = arrays
    op = SSDChunkScan(2, 8, 8, chunk_size=8)
    with override_platform("cpu"), set_config(OpsConfig(["all"])):
        y, finals = op(*(torch.from_numpy(v) for v in (x, dt, a, b, c, d, z, dt_bias)), None, torch.from_numpy(cu))
    want_y, want_cache = _numpy_ssd(x, dt, a, b, c, d, z, dt_bias, np.zeros((3, 2, 8, 8), np.float32), cu,
                                    np.arange(3), np.zeros(3, bool))
    assert finals.dtype == torch.float32 and finals.shape == (3, 2, 8, 8)
    np.testing.assert_allclose(y.numpy(), want_y, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(finals.numpy(), want_cache, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ bad input

_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "ssm_state", "cu_seqlens", "state_indices",
          "has_initial_state")


@pytest.mark.parametrize("change, error, match", [
    (lambda a: {**a, "x": a["x"][:, :, :7]}, ValueError, "argument 'x' has shape"),
    (lambda a: {**a, "dt": a["dt"][:5]}, ValueError, "argument 'dt' has shape"),
    (lambda a: {**a, "A": None}, TypeError, "'A' is required"),
    (lambda a: {**a, "B": a["B"][:, :1]}, ValueError, "argument 'B' has shape"),
    (lambda a: {**a, "C": a["C"].to(torch.float16)}, TypeError, "'C'"),
    (lambda a: {**a, "D": a["D"][:1]}, ValueError, "'D'"),
    (lambda a: {**a, "z": a["z"].to(torch.bfloat16)}, TypeError, "'z'"),
    (lambda a: {**a, "ssm_state": a["ssm_state"][..., :3]}, ValueError, "'ssm_state' has shape"),
    (lambda a: {**a, "cu_seqlens": torch.tensor([0, 4, 3, 10], dtype=torch.int32)}, ValueError, "strictly increase"),
    (lambda a: {**a, "state_indices": torch.tensor([0, 0, 1], dtype=torch.int32)}, ValueError, "same slot"),
    (lambda a: {**a, "has_initial_state": a["has_initial_state"].to(torch.int32)}, TypeError, "has_initial_state"),
])
def test_bad_input_names_op_and_argument(change, error, match):
    args = dict(zip(_NAMES, _torch(_inputs(10, 4, 3, 8, 8, 2, seed=8, padding=False))))
    with pytest.raises(error, match=match) as info:
        SSDChunkScan(4, 8, 8, 2)(**change(args))
    assert "ssd_chunk_scan" in str(info.value)


def test_bad_constructor():
    with pytest.raises(ValueError, match="n_groups=3 must divide num_heads=4"):
        SSDChunkScan(4, 8, 8, n_groups=3)
    with pytest.raises(ValueError, match="chunk_size"):
        SSDChunkScan(4, 8, 8, chunk_size=0)
    with pytest.raises(ValueError, match="dt_limit"):
        SSDChunkScan(4, 8, 8, dt_limit=(1.0, 0.5))


# ------------------------------------------------------------------ JAX transforms


def test_jax_jit_vmap_and_grad():
    import jax
    import jax.numpy as jnp

    args = _jax(_inputs(12, 2, 3, 8, 8, 1, seed=9, padding=False))
    x, cache = args[0], args[8]
    op = SSDChunkScan(2, 8, 8, chunk_size=8)
    with override_platform("tpu"), set_config(OpsConfig(["all"])):
        eager = op(*args)
        jitted = jax.jit(lambda *a: op(*a))(*args)
        assert op.last_run("jax", "tpu")[0] == "forward_tpu"
        for g, e in zip(jitted, eager):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-6)
        # vmap over a batch of independent inputs (each with its own cache).
        xs, caches = jnp.stack([x, 2 * x]), jnp.stack([cache, -cache])
        ys, new = jax.vmap(lambda xi, ci: op(xi, *args[1:8], ci, *args[9:]))(xs, caches)
        for i in range(2):
            want = op.forward_native(xs[i], *args[1:8], caches[i], *args[9:])
            np.testing.assert_allclose(np.asarray(ys[i]), np.asarray(want[0]), atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(np.asarray(new[i]), np.asarray(want[1]), atol=1e-5, rtol=1e-5)

    # grad of the native body against finite differences (the kernel path's VJP is this one).
    def loss(x_, dt_):
        x_, dt_ = map(jnp.asarray, (x_, dt_))  # check_grads' finite differences pass numpy
        y, state = op.forward_native(x_, dt_, *args[2:])
        return jnp.sum(y * y) + jnp.sum(state)

    from jax.test_util import check_grads

    check_grads(loss, (x, args[1]), order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-3)
