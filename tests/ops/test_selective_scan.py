"""SelectiveScan (``selective_scan``): the C++ CPU, Triton (interpreted) and Pallas (interpreted)
kernels against forward_native in float32 and bfloat16 (a packed prefill with a padding sequence,
a decode step, and once T = 1024 with sequences split across the kernels' chunks), state
continuity (one prefill == a prefill then its continuation == step-by-step decode), bad input,
and jit / vmap / grad of the native body in JAX. The native body itself is checked against
float64 numpy in tests/ops/test_ssm_math.py; the (frontend, platform) cells in tests/sweeps/test_cells.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dualop import testing
from dualop.ops import SelectiveScan
from dualop.ops.selective_scan import make_scan_inputs

# kernel -> (frontend, method)
KERNELS = {"cpu": ("torch", "forward_cpu"), "triton": ("torch", "forward_cuda"), "pallas": ("jax", "forward_tpu")}
PREFILL = (20, 3, 40, 8)  # (T, B, I, N): three packed sequences, the second padding
DECODE = (6, 6, 136, 16)  # one token per sequence: the step kernels


def _inputs(shape, frontend, dtype, seed=0, **kw):
    arrays = make_scan_inputs(shape, np.random.default_rng(seed), **kw)
    return [testing.to_frontend(a, frontend, dtype) for a in arrays]


def _copy(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _run(kernel, op, args):
    """The kernel's ``(y, cache)`` and forward_native's, on separate copies (torch updates in place)."""
    method = KERNELS[kernel][1]
    op.check_inputs(*args)
    return getattr(op, method)(*_copy(args)), op.forward_native(*_copy(args))


def _assert_close(got, want, dtype, what):
    result = testing.compare(testing.to_numpy(got), testing.to_numpy(want), dtype)
    assert result.ok, f"{what}: max abs {result.max_abs}, max rel {result.max_rel} {result.detail}"


def _check(kernel, shape, dtype, **kw):
    frontend = KERNELS[kernel][0]
    args = _inputs(shape, frontend, dtype, **kw)
    op = SelectiveScan(shape[2], shape[3])
    (y, cache), (y_ref, cache_ref) = _run(kernel, op, args)
    _assert_close(y, y_ref, dtype, f"{kernel} y")
    _assert_close(cache, cache_ref, dtype, f"{kernel} cache")
    return args, y, cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", ["cpu", "triton"])
def test_kernel_matches_native(kernel, dtype):
    """A packed prefill with a padding sequence (zero outputs, its slot untouched) and a decode step.
    The Pallas kernels run these shapes in the jax/tpu cells of tests/sweeps/test_cells.py (interpreted
    Pallas is slow: not twice)."""
    args, y, cache = _check(kernel, PREFILL, dtype, padding=(1,))
    cu, slots = testing.to_numpy(args[9]).astype(int), testing.to_numpy(args[10]).astype(int)
    assert not np.any(testing.to_numpy(y)[cu[1]:cu[2]]), "padding sequence gave non-zero outputs"
    untouched = sorted(set(range(cache.shape[0])) - set(slots[slots >= 0]))
    np.testing.assert_array_equal(testing.to_numpy(cache)[untouched], testing.to_numpy(args[8])[untouched])
    _check(kernel, DECODE, dtype)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_long_prefill_across_chunks(kernel):
    """T = 1024 in float32, four sequences whose boundaries fall inside the Pallas kernel's
    256-token chunks (one sequence spans three chunks, one has a single token)."""
    _check(kernel, (1024, 4, 8, 4), "float32", seq_lens=[300, 1, 450, 273], has_initial=[True, False, True, True])


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_state_continuity(kernel):
    """One sequence of 4 tokens: a single prefill == 2 tokens then a continued prefill of 2 ==
    four decode steps, each from the state the previous call cached."""
    frontend, method = KERNELS[kernel]
    tokens, dim, n = 4, 24, 4
    x, dt, a, b, c, d, z, bias, cache, *_ = _inputs((tokens, 1, dim, n), frontend, "float32", seed=3)
    op = SelectiveScan(dim, n)
    call = getattr(op, method)
    xp_cat = torch.cat if frontend == "torch" else jnp.concatenate

    def ints(values, dtype="int32"):
        return testing.to_frontend(testing.Pinned(np.asarray(values), dtype), frontend, dtype)

    slot, yes, no = ints([2]), ints([True], "bool"), ints([False], "bool")

    def run(lo, hi, state, initial):
        rows = slice(lo, hi)
        args = (x[rows], dt[rows], a, b[rows], c[rows], d, z[rows], bias, state, ints([0, hi - lo]), slot, initial)
        op.check_inputs(*args)
        return call(*args)

    whole_y, whole_state = run(0, tokens, _copy([cache])[0], no)
    first_y, state = run(0, 2, _copy([cache])[0], no)
    rest_y, state = run(2, tokens, state, yes)
    _assert_close(xp_cat([first_y, rest_y]), whole_y, "float32", "prefill then continue")
    _assert_close(state, whole_state, "float32", "state after continuing")
    step_state, step_ys = _copy([cache])[0], []
    for t in range(tokens):
        y_t, step_state = run(t, t + 1, step_state, no if t == 0 else yes)
        step_ys.append(y_t)
    _assert_close(xp_cat(step_ys), whole_y, "float32", "step-by-step decode")
    _assert_close(step_state, whole_state, "float32", "state after decode")


@pytest.mark.parametrize("cache_dtype", ["float32", "float16"])
def test_cpu_kernel_writes_a_strided_cache_of_another_dtype_in_place(cache_dtype):
    """The C++ loop reads and writes the cache slots itself: a cache that is a strided view (one
    layer's half of a wider buffer) in a dtype other than the activations' (bfloat16) is updated
    in place, as forward_native updates it; the rest of the buffer is left alone."""
    args = _inputs(PREFILL, "torch", "bfloat16", padding=(1,))
    slots, dim, n = args[8].shape
    buffer = torch.randn(slots, dim, 2 * n).to(getattr(torch, cache_dtype))
    args[8] = buffer[:, :, :n]
    assert not args[8].is_contiguous()
    op = SelectiveScan(dim, n)
    op.check_inputs(*args)
    reference_args = _copy(args)
    reference_args[8] = args[8].contiguous()
    y_ref, cache_ref = op.forward_native(*reference_args)
    other_half = buffer[:, :, n:].clone()
    y, cache = op.forward_cpu(*args)
    assert cache.data_ptr() == buffer.data_ptr() and cache.dtype == buffer.dtype
    _assert_close(y, y_ref, "bfloat16", "y")
    _assert_close(buffer[:, :, :n], cache_ref, cache_dtype if cache_dtype != "float32" else "bfloat16", "cache")
    torch.testing.assert_close(buffer[:, :, n:], other_half, rtol=0, atol=0)


def _bad(index, value, match, error=ValueError):
    def make(args):
        args = list(args)
        args[index] = value(args)
        return args

    return make, match, error


BAD = {
    "x shape": _bad(0, lambda a: a[0][:, :-1], "argument 'x' has shape"),
    "dt dtype": _bad(1, lambda a: a[1].to(torch.float16), "argument 'dt' has dtype", TypeError),
    "A dtype": _bad(2, lambda a: a[2].to(torch.bfloat16), "argument 'A' has dtype", TypeError),
    "B shape": _bad(3, lambda a: a[3][:-1], "argument 'B' has shape"),
    "C dtype": _bad(4, lambda a: a[4].to(torch.float16), "argument 'C' has dtype", TypeError),
    "D shape": _bad(5, lambda a: a[5][:-1], "argument 'D' has shape"),
    "cache shape": _bad(8, lambda a: a[8][:, :, :-1], "argument 'ssm_state' has shape"),
    "cu_seqlens end": _bad(9, lambda a: a[9] - 1, "argument 'cu_seqlens' must start at 0"),
    "shared slot": _bad(10, lambda a: torch.zeros_like(a[10]), "same slot"),
    "slot range": _bad(10, lambda a: a[10] + 100, "argument 'state_indices' holds slot"),
    "initial flags": _bad(11, lambda a: a[11].to(torch.int32), "argument 'has_initial_state' has dtype", TypeError),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case):
    make, match, error = BAD[case]
    args = make(_inputs(PREFILL, "torch", "bfloat16"))
    with pytest.raises(error, match=f"selective_scan: .*{match}|selective_scan: {match}"):
        SelectiveScan(PREFILL[2], PREFILL[3])(*args)


def test_bad_constructor():
    with pytest.raises(ValueError, match="selective_scan: state_size"):
        SelectiveScan(8, 0)


def test_jax_native_jit_vmap_grad():
    """jit == eager; vmap over two independent calls (no cache: fresh states) == each call; the
    gradient of sum(y) wrt x matches a central finite difference along a random direction."""
    shape = (5, 2, 16, 4)
    args = _inputs(shape, "jax", "float32", seed=5)
    op = SelectiveScan(shape[2], shape[3])
    y, state = op.forward_native(*args)
    y_jit, state_jit = jax.jit(op.forward_native)(*args)
    np.testing.assert_allclose(y_jit, y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state_jit, state, rtol=1e-5, atol=1e-6)

    x, dt, a, b, c, d, z, bias = args[:8]

    def fresh(x, dt, b, c, z):
        return op.forward_native(x, dt, a, b, c, d, z, bias)

    stacked = [jnp.stack([v, v[::-1] * 0.5]) for v in (x, dt, b, c, z)]
    y_v, state_v = jax.vmap(fresh)(*stacked)
    for k in range(2):
        y_k, state_k = fresh(*(v[k] for v in stacked))
        np.testing.assert_allclose(y_v[k], y_k, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state_v[k], state_k, rtol=1e-5, atol=1e-6)

    def loss(x):
        y, state = fresh(x, dt, b, c, z)
        return jnp.sum(y) + jnp.sum(state)

    direction = jnp.asarray(np.random.default_rng(6).standard_normal(x.shape).astype(np.float32))
    grad = jax.grad(loss)(x)
    eps = 1e-2
    numeric = (loss(x + eps * direction) - loss(x - eps * direction)) / (2 * eps)
    np.testing.assert_allclose(float(jnp.vdot(grad, direction)), float(numeric), rtol=2e-3)
