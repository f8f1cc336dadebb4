"""Edges of the state-space ops (causal_conv1d, selective_scan, ssd_chunk_scan, short_conv and the
Mamba mixers), each kernel path against forward_native:

- strided views (a transposed ``x``, a column of a ``[B, 2]`` metadata buffer, a strided bias,
  weight or cache) on the Triton and torch CPU paths: the same outputs and cache as contiguous
  inputs, every byte of the cache's buffer outside the written slots untouched;
- traced metadata under ``jax.jit`` that ends before T or holds out-of-range values (the Pallas
  kernels), and the same metadata given to the Triton and C++ kernels directly: no access out of
  bounds (a guard band around the cache stays as it was), rows no sequence owns are zeros, as
  forward_native reads such metadata (``ssm_math.sanitize_metadata``);
- a NaN in one sequence's tokens or cached state, or in a padding row, reaches no other sequence;
- a refused call (a bad ``ssm_state``, a bad cache) writes no cache, and bad arguments are errors
  that name the op and the argument.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from dualop import OpsConfig, override_platform, set_config, testing
from dualop.ops import CausalConv1d, MambaMixer2, SelectiveScan, SSDChunkScan, ShortConv

K = 4  # conv width
T, DIM, N = 12, 8, 4  # tokens, channels, state size
CU = np.array([0, 5, 7, 12], np.int32)  # three sequences: 5, 2 and 5 tokens
SLOTS = np.array([4, 0, 2], np.int32)  # in a cache of 6 slots (1, 3, 5 untouched)
INIT = np.array([True, False, True])
NUM_SLOTS = 6


def _rng(seed):
    return np.random.default_rng(seed)


def _t(a):
    return None if a is None else torch.from_numpy(np.array(a, copy=True))


def _column(t: torch.Tensor, fill=-7) -> torch.Tensor:
    """A view of ``t``'s values with a last-dim stride of 2 (the first column of ``[..., 2]``)."""
    return torch.stack([t, torch.full_like(t, fill)], dim=-1)[..., 0]


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view of ``t``'s values laid out column-major (strides ``(1, rows)``)."""
    return t.T.contiguous().T


def _guarded(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, view)``: ``cache``'s values as a strided view into a larger buffer with a guard
    slot on each side and a guard column: any write out of bounds lands in the buffer."""
    big = torch.full((cache.shape[0] + 2, *cache.shape[1:-1], cache.shape[-1] + 1), 1234.5, dtype=cache.dtype)
    view = big[1:-1, ..., :cache.shape[-1]]
    view.copy_(cache)
    return big, view


def _run(op, platform, *args, **kwargs):
    with override_platform(platform), set_config(OpsConfig(["all"])):
        out = op(*args, **kwargs)
    first = args[0] if args else next(iter(kwargs.values()))
    method, reason = op.last_run("torch" if isinstance(first, torch.Tensor) else "jax", platform)
    assert method != "forward_native", reason
    return out


def _assert_close(got, want, what, dtype="float32"):
    cmp = testing.compare(testing.to_numpy(got), testing.to_numpy(want), dtype)
    assert cmp.ok, f"{what}: max abs {cmp.max_abs}, max rel {cmp.max_rel} {cmp.detail}"


def _assert_written_only(big_before, big_after, view_after, want_cache, slots, what):
    """The cache view equals ``want_cache`` and every byte of the buffer outside the written slots'
    region (guard slots, guard column, untouched slots) is as it was."""
    _assert_close(view_after, want_cache, f"{what} cache")
    written = torch.zeros(big_before.shape, dtype=torch.bool)
    for s in slots:
        if s >= 0:
            written[1 + int(s), ..., :view_after.shape[-1]] = True
    assert torch.equal(big_after[~written], big_before[~written]), f"{what}: bytes outside the written slots changed"


# ------------------------------------------------------------------ 1. strided views (Triton, C++)


def _conv_inputs(seed=0, dim=DIM, tokens=T):
    rng = _rng(seed)
    return (rng.standard_normal((tokens, dim)).astype(np.float32), (0.5 * rng.standard_normal((dim, K))).astype(np.float32),
            rng.standard_normal(dim).astype(np.float32), rng.standard_normal((NUM_SLOTS, dim, K - 1)).astype(np.float32))


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
@pytest.mark.parametrize("view", ["state_indices", "cu_seqlens", "x", "bias", "weight"])
def test_causal_conv1d_strided_views(platform, view):
    """One strided argument at a time (the cache always a strided view into a guarded buffer):
    the Triton kernel read metadata columns with unit stride (it wrote slots {2, 3} for the column
    ``[2, 0]`` of ``[[2, 3], [0, 1]]``), a transposed x and a strided bias as if contiguous."""
    x, w, b, cache = _conv_inputs()
    op = CausalConv1d(DIM, K)
    want_y, want_cache = op.forward_native(_t(x), _t(w), _t(b), _t(cache), _t(CU), _t(SLOTS), _t(INIT))
    args = dict(x=_t(x), weight=_t(w), bias=_t(b), cu_seqlens=_t(CU), state_indices=_t(SLOTS),
                has_initial_state=_t(INIT))
    # the other column holds other valid values: slots 1, 3, 5 (untouched by the batch), boundaries
    others = {"state_indices": torch.tensor([1, 3, 5], dtype=torch.int32), "cu_seqlens": torch.tensor([0, 1, 2, 12])}
    if view in others:
        args[view] = torch.stack([args[view], others[view].to(args[view].dtype)], dim=1)[:, 0]
    elif view == "x":
        args["x"] = _transposed(args["x"])
    else:
        args[view] = _column(args[view])
    assert not args[view].is_contiguous()
    big, view_cache = _guarded(_t(cache))
    before = big.clone()
    y, out_cache = _run(op, platform, conv_state=view_cache, **args)
    assert out_cache is view_cache  # updated in place, not through a copy
    _assert_close(y, want_y, "y")
    _assert_written_only(before, big, view_cache, want_cache, SLOTS, view)


def _scan_inputs(seed=0):
    rng = _rng(seed)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    a = -np.exp(rng.uniform(-1.0, 1.0, (DIM, N))).astype(np.float32)
    return dict(x=f(T, DIM), dt=0.5 * f(T, DIM) - 1.0, A=a, B=f(T, N), C=f(T, N), D=f(DIM), z=f(T, DIM),
                dt_bias=0.5 * f(DIM)), 0.5 * f(NUM_SLOTS, DIM, N)


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
@pytest.mark.parametrize("view", ["metadata", "x", "side"])
def test_selective_scan_strided_views(platform, view):
    """Metadata columns; transposed x, dt, z, B, C; strided D, dt_bias and a transposed A; the
    cache a strided view into a guarded buffer."""
    arrays, cache = _scan_inputs(1)
    op = SelectiveScan(DIM, N)
    meta = dict(cu_seqlens=_t(CU), state_indices=_t(SLOTS), has_initial_state=_t(INIT))
    want_y, want_cache = op.forward_native(**{k: _t(v) for k, v in arrays.items()}, ssm_state=_t(cache), **meta)
    args = {k: _t(v) for k, v in arrays.items()}
    if view == "metadata":
        meta = dict(cu_seqlens=torch.stack([meta["cu_seqlens"], torch.tensor([0, 1, 2, 12], dtype=torch.int32)], 1)[:, 0],
                    state_indices=torch.stack([meta["state_indices"], torch.tensor([1, 3, 5], dtype=torch.int32)], 1)[:, 0],
                    has_initial_state=_column(meta["has_initial_state"], False))
    elif view == "x":
        args.update({k: _transposed(args[k]) for k in ("x", "dt", "z", "B", "C")})
    else:
        args.update(D=_column(args["D"]), dt_bias=_column(args["dt_bias"]), A=_transposed(args["A"]))
    big, view_cache = _guarded(_t(cache))
    before = big.clone()
    y, out_cache = _run(op, platform, ssm_state=view_cache, **args, **meta)
    assert out_cache is view_cache
    _assert_close(y, want_y, "y")
    _assert_written_only(before, big, view_cache, want_cache, SLOTS, view)


def _mixer_case(label):
    """A mixer check case's op and its arguments by name (numpy / Pinned), at a packed prefill."""
    case = next(c for c in testing.cases_for(None) if c.label == label)
    shape = max(case.shapes, key=lambda s: (s[0] > s[1] > 1, s[1]))
    op = case.make_op(shape)
    names = list(inspect.signature(op.forward_native).parameters)
    return op, dict(zip(names, case.make_inputs(shape, _rng(3))))


def _torch_args(raw):
    return {k: testing.to_frontend(v, "torch", "float32") for k, v in raw.items()}


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_mamba_mixer_strided_views(platform):
    """The mixer with transposed hidden states, metadata columns and both caches strided views."""
    op, raw = _mixer_case("mamba_mixer")
    want = op.forward_native(**_torch_args(raw))
    args = _torch_args(raw)
    args["hidden_states"] = _transposed(args["hidden_states"])
    args["cu_seqlens"] = _column(args["cu_seqlens"], 1)
    args["state_indices"] = _column(args["state_indices"], 0)
    slots = args["state_indices"].tolist()
    (conv_big, args["conv_state"]), (ssm_big, args["ssm_state"]) = _guarded(args["conv_state"]), _guarded(args["ssm_state"])
    conv_before, ssm_before = conv_big.clone(), ssm_big.clone()
    out, conv, ssm = _run(op, platform, **args)
    _assert_close(out, want[0], "out")
    _assert_written_only(conv_before, conv_big, conv, want[1], slots, "conv_state")
    _assert_written_only(ssm_before, ssm_big, ssm, want[2], slots, "ssm_state")


# ------------------------------------------------------------------ 2. bad traced metadata, 3. NaN

# The batch of sections 2 and 3: five sequences over 12 tokens (chunks of 8 tokens split it after
# token 7). In section 3, sequence 0 has a NaN token, 1 is clean, 2 is padding with NaN tokens, 3
# starts from a cached state holding a NaN and 4 is clean: 1 shares a chunk with 0 and 2, 4 with 3.
NAN_CU = np.array([0, 3, 5, 7, 9, 12], np.int32)
NAN_SLOTS = np.array([3, 1, -1, 0, 5], np.int32)
NAN_INIT = np.array([False, True, True, True, True])
CLEAN, NAN_SEQS = (1, 4), (0, 3)

# (cu_seqlens, state_indices) of that batch's shapes that break the contract, as a trace passes
# them: ending before T (the last rows belong to no sequence); out of range, with slots past the
# cache; decreasing (sequences 1 to 3 read as empty).
BAD_METADATA = [
    ([0, 2, 4, 6, 8, 9], [3, 1, -1, 0, 5]),
    ([0, -3, 4, 40, 9, 12], [3, 9, -5, 0, 5]),
    ([3, 9, 5, 7, 9, 12], [3, 1, -1, 0, 5]),
]


def _no_sequence_rows(cu):
    """The rows past the metadata's end (where ``ssm_math.sanitize_metadata`` puts it)."""
    return slice(int(np.maximum.accumulate(np.clip(cu, 0, T)[1:])[-1]), T)


def _kernel_op(op_name):
    """``(op, arrays before the cache, cache)`` in numpy for the batch above."""
    rng = _rng(11)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    if op_name == "causal_conv1d":
        return CausalConv1d(DIM, K), [f(T, DIM), 0.5 * f(DIM, K), f(DIM)], f(NUM_SLOTS, DIM, K - 1)
    if op_name == "selective_scan":
        a = -np.exp(rng.uniform(-1.0, 1.0, (DIM, N))).astype(np.float32)
        return (SelectiveScan(DIM, N), [f(T, DIM), 0.5 * f(T, DIM) - 1, a, f(T, N), f(T, N), f(DIM), f(T, DIM),
                                        0.5 * f(DIM)], 0.5 * f(NUM_SLOTS, DIM, N))
    return (SSDChunkScan(2, 4, N, chunk_size=8),
            [f(T, 2, 4), 0.5 * f(T, 2), np.array([-0.5, -1.5], np.float32), 0.5 * f(T, 1, N), 0.5 * f(T, 1, N),
             f(2), f(T, 2, 4), 0.5 * f(2)], f(NUM_SLOTS, 2, 4, N))


def _rows(seqs):
    return np.concatenate([np.arange(NAN_CU[s], NAN_CU[s + 1]) for s in seqs])


def _poison(tokens: np.ndarray, caches: list[np.ndarray], dt: np.ndarray | None = None,
            b: np.ndarray | None = None) -> None:
    """NaN into sequence 0's second token (and its first token's B), the padding sequence's tokens
    (and its dt) and slot 0 (sequence 3's starting state), in place."""
    tokens[NAN_CU[0] + 1] = np.nan
    tokens[NAN_CU[2]:NAN_CU[3]] = np.nan
    if dt is not None:
        dt[NAN_CU[2]:NAN_CU[3]] = np.nan
    if b is not None:
        b[NAN_CU[0]] = np.nan
    for cache in caches:
        cache[0].flat[0] = np.nan


def _check_isolated(got, want, caches_before, what):
    """Clean sequences and their slots: finite and as native; padding rows zero; a non-finite
    output of the NaN sequences stays non-finite (a chunked kernel may widen it in its sequence);
    slots no sequence writes untouched."""
    y, y_ref = testing.to_numpy(got[0]), testing.to_numpy(want[0])
    clean = _rows(CLEAN)
    assert np.isfinite(y[clean]).all(), f"{what}: a NaN reached another sequence's outputs"
    _assert_close(y[clean], y_ref[clean], f"{what} clean rows")
    assert not y[_rows([2])].any() and np.isfinite(y[_rows([2])]).all(), f"{what}: padding rows are not zeros"
    bad = _rows(NAN_SEQS)
    assert (~np.isfinite(y[bad]) | np.isfinite(y_ref[bad])).all(), f"{what}: a non-finite output came out finite"
    for k, before in enumerate(caches_before, start=1):
        cache, cache_ref = testing.to_numpy(got[k]), testing.to_numpy(want[k])
        for s in (NAN_SLOTS[c] for c in CLEAN):
            assert np.isfinite(cache[s]).all(), f"{what}: a NaN reached slot {s} of cache {k}"
            _assert_close(cache[s], cache_ref[s], f"{what} slot {s}")
        untouched = [s for s in range(before.shape[0]) if s not in NAN_SLOTS]
        np.testing.assert_array_equal(cache[untouched], before[untouched])


@pytest.mark.parametrize("op_name", ["causal_conv1d", "selective_scan", "ssd_chunk_scan"])
def test_pallas_kernels_under_jit_bad_traced_metadata_and_nan(op_name):
    """Traced metadata is not checked: the Pallas prefill kernels DMA'd state row B of a [B, ...]
    buffer for rows past ``cu_seqlens[B]`` (the interpreter's "Out-of-bounds read") and read SMEM
    past the end for out-of-range boundaries. A NaN in the rows no sequence owns reaches nothing;
    results are forward_native's under the same jit. Then, through the same compiled kernel, the
    NaN batch: the chunked SSD multiplied other sequences' rows by a zero mask (0 x NaN = NaN), and
    the conv zeroed padding rows by a product, leaving NaN there."""
    import jax
    import jax.numpy as jnp

    op, arrays, cache = _kernel_op(op_name)
    kernel, native = jax.jit(lambda *a: op(*a)), jax.jit(lambda *a: op.forward_native(*a))  # one trace each
    init = jnp.asarray(NAN_INIT)
    for cu, slots in BAD_METADATA:
        x = arrays[0].copy()
        x[_no_sequence_rows(np.asarray(cu))] = np.nan
        args = (jnp.asarray(x), *map(jnp.asarray, arrays[1:]), jnp.asarray(cache),
                jnp.asarray(np.asarray(cu, np.int32)), jnp.asarray(np.asarray(slots, np.int32)), init)
        with override_platform("tpu"), set_config(OpsConfig(["all"])):
            y, new_cache = kernel(*args)
        assert op.last_run("jax", "tpu")[0] == "forward_tpu"
        want_y, want_cache = native(*args)
        rows = _no_sequence_rows(np.asarray(cu))
        assert not np.asarray(y)[rows].any() and not np.asarray(want_y)[rows].any(), (cu, "rows of no sequence")
        _assert_close(y, want_y, f"{op_name} y {cu}")
        _assert_close(new_cache, want_cache, f"{op_name} cache {cu}")
        untouched = [s for s in range(NUM_SLOTS) if s not in slots]
        np.testing.assert_array_equal(np.asarray(new_cache)[untouched], cache[untouched])
    arrays, cache = [a.copy() for a in arrays], cache.copy()
    _poison(arrays[0], [cache], *((arrays[1], arrays[3]) if op_name != "causal_conv1d" else ()))
    args = (*map(jnp.asarray, arrays), jnp.asarray(cache), jnp.asarray(NAN_CU), jnp.asarray(NAN_SLOTS), init)
    with override_platform("tpu"), set_config(OpsConfig(["all"])):
        got = kernel(*args)
    _check_isolated(got, native(*args), [cache], f"{op_name} jax/tpu")


def _torch_kernel(op_name, platform):
    """The Triton (``cuda``) or C++ / torch CPU (``cpu``) kernel entry of an op, and the native
    reference, as functions of the native arguments after ``ssm_batch`` (torch)."""
    from dualop.backends.torch import array_api as xp
    from dualop.kernels import ssm_math

    if op_name == "causal_conv1d":
        from dualop.kernels.cpu import causal_conv1d as cpu
        from dualop.kernels.cuda import causal_conv1d as cuda

        return (lambda *a: (cuda if platform == "cuda" else cpu).causal_conv1d(*a, activation="silu"),
                lambda *a: ssm_math.causal_conv1d_reference(xp, *a, "silu"))
    if op_name == "selective_scan":
        from dualop.kernels.cpu import selective_scan as cpu
        from dualop.kernels.cuda import selective_scan as cuda

        return (lambda *a: (cuda if platform == "cuda" else cpu).selective_scan(*a, delta_softplus=True),
                lambda *a: ssm_math.selective_scan_reference(xp, *a, True))
    from dualop.kernels.cpu import ssd as cpu
    from dualop.kernels.cuda import ssd as cuda

    return (lambda *a: (cuda if platform == "cuda" else cpu).ssd_chunk_scan(*a, chunk_size=8),
            lambda *a: ssm_math.ssd_reference(xp, *a, True))


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
@pytest.mark.parametrize("op_name", ["causal_conv1d", "selective_scan", "ssd_chunk_scan"])
def test_triton_and_cpu_kernels_clamp_bad_metadata(op_name, platform):
    """The Triton and C++ / torch CPU kernels given bad metadata directly (as a CUDA-graph capture
    or torch.compile passes it unchecked): nothing out of bounds is read or written (the C++ loop
    wrote slot 9 of a 6-slot cache; the guard band around the cache stays as it was). Given the
    metadata as ``ssm_batch`` reads it (``sanitize_metadata``), the kernels match the native body:
    rows past ``cu_seqlens[B]`` are zeros, an empty sequence's slot keeps its starting state."""
    from dualop.backends.torch import array_api as xp
    from dualop.kernels import ssm_math

    kernel, reference = _torch_kernel(op_name, platform)
    _, arrays, cache = _kernel_op(op_name)
    arrays, cache, init = [_t(a) for a in arrays], _t(cache), _t(NAN_INIT)
    for cu, slots in BAD_METADATA:
        cu, slots = torch.tensor(cu, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32)
        big, view = _guarded(cache)  # raw: nothing out of bounds
        before = big.clone()
        kernel(*arrays, view, cu, slots, init)
        _assert_written_only(before, big, view, view, [s for s in slots.tolist() if 0 <= s < NUM_SLOTS], "raw")
        cu_s, slots_s = ssm_math.sanitize_metadata(xp, cu, slots, T, NUM_SLOTS)  # as every path reads it
        big, view = _guarded(cache)
        before = big.clone()
        y, _ = kernel(*arrays, view, cu_s, slots_s, init)
        want_y, want_cache = reference(*arrays, cache.clone(), cu_s, slots_s, init)
        assert not y[_no_sequence_rows(cu.numpy())].any()
        _assert_close(y, want_y, f"{op_name} y {cu.tolist()}")
        _assert_written_only(before, big, view, want_cache, slots_s.tolist(), f"{op_name} {cu.tolist()}")


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
@pytest.mark.parametrize("op_name", ["causal_conv1d", "selective_scan", "ssd_chunk_scan"])
def test_nan_stays_in_its_sequence_kernel_ops(op_name, platform):
    """The Triton and torch CPU SSD kernels spread a NaN token to the later sequences of its chunk
    and a NaN cached state to the chunk's other rows (products with a zero mask), and left NaN in
    padding rows. (The Pallas kernels: the jit test above.)"""
    op, arrays, cache = _kernel_op(op_name)
    _poison(arrays[0], [cache], *((arrays[1], arrays[3]) if op_name != "causal_conv1d" else ()))
    meta = [testing.Pinned(NAN_CU, "int32"), testing.Pinned(NAN_SLOTS, "int32"), testing.Pinned(NAN_INIT, "bool")]
    raw = [*arrays, cache, *meta]
    got = _run(op, platform, *(testing.to_frontend(a, "torch", "float32") for a in raw))
    want = op.forward_native(*(testing.to_frontend(a, "torch", "float32") for a in raw))
    _check_isolated(got, want, [cache], f"{op_name} torch/{platform}")


CELLS = [("torch", "cpu"), ("torch", "cuda"), ("jax", "tpu")]


def _mixer(label):
    """``(op, arguments by name)`` of a mixer for the 12-token batch above: the check case's
    weights, random caches of ``NUM_SLOTS`` slots, the batch's metadata (numpy)."""
    rng = _rng(13)
    if label == "mamba_mixer2":
        from dualop.ops.mamba_mixer2 import _CASE_MIXER, mixer_case_inputs

        op = MambaMixer2(**_CASE_MIXER)
        names = list(inspect.signature(op.forward_native).parameters)
        raw = dict(zip(names, mixer_case_inputs(op, T, rng)))
    else:
        case = next(c for c in testing.cases_for(None) if c.label == label)
        shape = {"plamo2_mamba_mixer": (T, 3, 16, 2, 8, 4, 8), "mamba_mixer": (T, 3, 16, 32, 4)}[label]
        op = case.make_op(shape)
        names = list(inspect.signature(op.forward_native).parameters)
        raw = dict(zip(names, case.make_inputs(shape, rng)))
    raw.update(conv_state=rng.standard_normal((NUM_SLOTS, *op.conv_state_shape)).astype(np.float32),
               ssm_state=(0.5 * rng.standard_normal((NUM_SLOTS, *op.ssm_state_shape))).astype(np.float32),
               cu_seqlens=testing.Pinned(NAN_CU, "int32"), state_indices=testing.Pinned(NAN_SLOTS, "int32"),
               has_initial_state=testing.Pinned(NAN_INIT, "bool"))
    return op, raw


@pytest.mark.parametrize("label, frontend, platform", [
    *(("plamo2_mamba_mixer", fe, pf) for fe, pf in CELLS), ("mamba_mixer2", "jax", "tpu"),
])
def test_nan_stays_in_its_sequence_mixers(label, frontend, platform):
    """PLaMo 2's mixer on the Pallas path: a NaN in a padding token came out of the conv (a masked
    product) and the SSD chunk spread it to the next sequences and their slots."""
    op, raw = _mixer(label)
    _poison(raw["hidden_states"], [raw["conv_state"], raw["ssm_state"]])
    conv_before, ssm_before = raw["conv_state"].copy(), raw["ssm_state"].copy()
    got = _run(op, platform, **{k: testing.to_frontend(v, frontend, "float32") for k, v in raw.items()})
    want = op.forward_native(**{k: testing.to_frontend(v, frontend, "float32") for k, v in raw.items()})
    _check_isolated(got, want, [conv_before, ssm_before], f"{label} {frontend}/{platform}")


# ------------------------------------------------------------------ 4. a refused call writes nothing


def _bad_cache(kind: str, cache: torch.Tensor):
    if kind == "shape":
        return cache[:, :-1]
    if kind == "slots":
        return cache[:-1]
    if kind == "dtype":
        return cache.double()
    if kind == "int":
        return cache.int()
    if kind == "overlapping":
        return cache[:1].expand(cache.shape)
    if kind == "grad_leaf":
        return cache.clone().requires_grad_()
    if kind == "device":
        return cache.to("meta")
    return cache.tolist()  # "list"


BAD_CACHES = ["shape", "slots", "dtype", "int", "overlapping", "grad_leaf", "device", "list"]


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
@pytest.mark.parametrize("kind", BAD_CACHES)
@pytest.mark.parametrize("label", ["mamba_mixer", "mamba_mixer2", "plamo2_mamba_mixer"])
def test_bad_ssm_state_leaves_every_cache_as_it_was(label, kind, platform):
    """Every check runs before any write: the mixers wrote conv_state, then failed on an
    overlapping ssm_state or a leaf that requires grad (torch's raw RuntimeError), and
    mamba_mixer2 on one on another device."""
    op, raw = _mixer(label)
    args = {k: testing.to_frontend(v, "torch", "float32") for k, v in raw.items()}
    conv_before = args["conv_state"].clone()
    args["ssm_state"] = _bad_cache(kind, args["ssm_state"])
    with pytest.raises((ValueError, TypeError)) as info, override_platform(platform), set_config(OpsConfig(["all"])):
        op(**args)
    assert label in str(info.value) and "'ssm_state'" in str(info.value), str(info.value)
    assert torch.equal(args["conv_state"], conv_before)


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
@pytest.mark.parametrize("kind", ["overlapping", "grad_leaf", "device", "list"])
@pytest.mark.parametrize("label", ["causal_conv1d", "short_conv"])
def test_bad_conv_state_is_refused(label, kind, platform):
    """An overlapping conv cache (the Triton kernel wrote its overlapping elements in turn), a leaf
    that requires grad, one on another device, a list (an AttributeError before): a named error."""
    x, w, b, cache = map(_t, _conv_inputs(17))
    meta = dict(cu_seqlens=_t(CU), state_indices=_t(SLOTS), has_initial_state=_t(INIT))
    if label == "causal_conv1d":
        op, args = CausalConv1d(DIM, K), dict(x=x, weight=w, bias=b)
    else:
        rng = _rng(17)
        op = ShortConv(DIM, K)
        args = dict(hidden_states=x, in_proj_weight=_t(rng.standard_normal((3 * DIM, DIM)).astype(np.float32)),
                    conv_weight=w, out_proj_weight=_t(rng.standard_normal((DIM, DIM)).astype(np.float32)))
    bad = _bad_cache(kind, cache)
    with pytest.raises((ValueError, TypeError)) as info, override_platform(platform), set_config(OpsConfig(["all"])):
        op(**args, conv_state=bad, **meta)
    assert label in str(info.value) and "'conv_state'" in str(info.value), str(info.value)
    if isinstance(bad, torch.Tensor) and bad.device.type == "cpu":
        assert torch.equal(bad, _bad_cache(kind, cache))


# ------------------------------------------------------------------ other bad input


@pytest.mark.parametrize("arg", ["cu_seqlens", "state_indices", "has_initial_state"])
def test_metadata_on_another_device_is_refused(arg):
    """A metadata tensor on another device than the tokens (a Triton kernel would read a host
    pointer): a ValueError naming it, before any write."""
    x, w, b, cache = map(_t, _conv_inputs(19))
    meta = dict(cu_seqlens=_t(CU), state_indices=_t(SLOTS), has_initial_state=_t(INIT))
    meta[arg] = meta[arg].to("meta")
    before = cache.clone()
    with pytest.raises(ValueError, match=f"causal_conv1d: argument '{arg}' is on meta"), \
            override_platform("cuda"), set_config(OpsConfig(["all"])):
        CausalConv1d(DIM, K)(x, w, b, cache, **meta)
    assert torch.equal(cache, before)


def test_list_arguments_name_op_and_argument():
    """A list where an optional array goes: a TypeError naming the op and the argument (an
    AttributeError on ``.shape`` before)."""
    arrays, cache = _scan_inputs(21)
    args = {k: _t(v) for k, v in arrays.items()}
    with pytest.raises(TypeError, match="selective_scan: argument 'ssm_state'"):
        SelectiveScan(DIM, N)(**args, ssm_state=cache.tolist())
    _, ssd_arrays, _ = _kernel_op("ssd_chunk_scan")
    ssd_args = [_t(a) for a in ssd_arrays]
    ssd_args[5] = [1.0, 2.0]  # D
    with pytest.raises(TypeError, match="ssd_chunk_scan: argument 'D'"):
        SSDChunkScan(2, 4, N, chunk_size=8)(*ssd_args)


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_mixer_weights_of_another_dtype_run_as_native(platform):
    """The native bodies take a weight or bias of another float dtype (float32 math); the platform
    bodies cast it to the tokens' dtype as the projections' weights are, instead of the conv op's
    TypeError (conv_weight) or torch's raw RuntimeError after both caches were written
    (out_proj_bias of the Falcon-Mamba variant)."""
    case = next(c for c in testing.cases_for(None) if c.label == "mamba_mixer[falcon_mamba,bias]")
    shape = (9, 3, 24, 40, 8)
    op = case.make_op(shape)
    raw = dict(zip(inspect.signature(op.forward_native).parameters, case.make_inputs(shape, _rng(23))))
    for name in ("conv_weight", "conv_bias", "in_proj_bias", "out_proj_bias"):
        raw[name] = raw[name].astype(np.float16).astype(np.float32)  # exact in float16

    def args():
        out = {k: testing.to_frontend(v, "torch", "float32") for k, v in raw.items()}
        for name in ("conv_weight", "conv_bias", "in_proj_bias", "out_proj_bias"):
            out[name] = out[name].half()
        return out

    got = _run(op, platform, **args())
    want = op.forward_native(**args())
    for g, w, what in zip(got, want, ("out", "conv_state", "ssm_state")):
        _assert_close(g, w, what)


def test_mixer_projection_casts_a_bias_of_another_dtype_alone():
    """A bias in another dtype than x and its (same-dtype) weight is cast on its own: the vendor
    GEMM saw a float32 bias with bfloat16 operands and raised torch's raw dtype error."""
    from dualop.ops._mixer import project, projection

    rng = _rng(31)
    x, w, b = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in ((3, 8), (4, 8), (4,)))
    linear = projection(8, 4, bias=True)
    got = project(linear, "forward_cpu", x.bfloat16(), w.bfloat16(), b)
    want = project(linear, "forward_native", x.bfloat16(), w.bfloat16(), b)
    assert got.dtype == want.dtype == torch.bfloat16
    assert testing.compare(got.float().numpy(), want.float().numpy(), "bfloat16").ok


@pytest.mark.parametrize("eps", [float("nan"), float("inf"), -1.0])
def test_mamba_mixer2_refuses_a_bad_rms_norm_eps_by_its_own_name(eps):
    """The error names the mixer and its argument, not the inner gated norm's ``eps``."""
    with pytest.raises(ValueError, match=r"^mamba_mixer2: rms_norm_eps must be a finite float"):
        MambaMixer2(64, 16, 4, 128, True, False, n_groups=1, num_heads=8, head_dim=16, rms_norm_eps=eps)
