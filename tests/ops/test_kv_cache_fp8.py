"""The fp8 KV cache (float8_e4m3fn and float8_e5m2 pages with the engine's k_scale / v_scale):
reshape_and_cache writes the same bytes on every path (torch native, the torch CPU path, the Triton
kernel, the jax native body, the Pallas kernel) as an independent numpy / ml_dtypes computation;
ragged_paged_attention reads such a cache on every path (native bodies, the C++ kernel, Triton,
Pallas) as a float64 numpy attention over the dequantised cache does; bad calls are refused before
anything is written."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import jax  # noqa: E402  (both test environments have jax and torch: a broken install fails here)
import torch  # noqa: E402

from conftest import require_frontend
from dualop import OpsConfig, override_platform, set_config, testing
from dualop.ops import RaggedPagedAttention, ReshapeAndCache
from dualop.ops.attention import paged_batch

jnp = jax.numpy

FORMATS = {  # cache dtype -> (kv_cache_dtype, ml_dtypes type, largest finite value)
    "float8_e4m3fn": ("fp8", ml_dtypes.float8_e4m3fn, 448.0),
    "float8_e5m2": ("fp8_e5m2", ml_dtypes.float8_e5m2, 57344.0),
}
K_SCALE, V_SCALE = 0.0371, 2.7  # not powers of two: the reciprocal's rounding matters


# --- numpy statements of the contract ------------------------------------------------------------


def fp8_codes(x, scale, cache_dtype):
    """The bytes an fp8 cache holds for ``x``: ``x * f32(1 / scale)`` as float32 (the float64
    product of two float32 values is exact, then rounded once), clipped to +-max, cast by
    ml_dtypes (round to nearest even)."""
    _, mdt, top = FORMATS[cache_dtype]
    inverse = np.float32(1.0) / np.float32(scale)
    y = (np.asarray(x, np.float32).astype(np.float64) * np.float64(inverse)).astype(np.float32)
    return np.clip(y, -top, top).astype(mdt).view(np.uint8)


def written_cache(key, value, cache_bytes, slots, cache_dtype, k_scale, v_scale):
    """The cache's bytes after the write, one token at a time (later tokens win)."""
    out = cache_bytes.copy()
    num_pages, page_size = out.shape[:2]
    k, v = fp8_codes(key, k_scale, cache_dtype), fp8_codes(value, v_scale, cache_dtype)
    for t, slot in enumerate(slots.tolist()):
        if 0 <= slot < num_pages * page_size:
            page, offset = divmod(slot, page_size)
            out[page, offset, 0::2] = k[t]
            out[page, offset, 1::2] = v[t]
    return out


def decoded(cache_bytes, cache_dtype):
    return cache_bytes.view(FORMATS[cache_dtype][1]).astype(np.float64)


def write_batch(tokens=11, heads=2, head_dim=32, num_pages=5, page_size=4, seed=0, padding=3,
                cache_dtype="float8_e4m3fn"):
    """float32 key and value (wide range: some saturate, some are subnormal codes), the cache's
    random bytes (finite codes) and int32 slots with ``padding`` of them -1 and one slot written
    twice (the later token wins)."""
    rng = np.random.default_rng(seed)
    key = (rng.standard_normal((tokens, heads, head_dim)) * np.exp(rng.uniform(-9, 4, (tokens, heads, 1))))
    value = rng.standard_normal((tokens, heads, head_dim)) * 40.0
    key[0, 0, :4] = [np.inf, -np.inf, 1e9, -0.0]  # saturate to +-max; -0 stays -0
    cache = rng.integers(0, 256, (num_pages, page_size, 2 * heads, head_dim), dtype=np.uint8)
    cache[np.isnan(cache.view(FORMATS[cache_dtype][1]).astype(np.float32))] = 0
    slots = rng.permutation(num_pages * page_size)[:tokens].astype(np.int32)
    slots[rng.choice(tokens - 1, padding, replace=False)] = -1
    slots[-1] = slots[slots >= 0][0]  # a repeated slot: the last token wins
    return key.astype(np.float32), value.astype(np.float32), cache, slots


def torch_cache(cache_bytes, cache_dtype):
    return torch.from_numpy(cache_bytes.copy()).view(getattr(torch, cache_dtype))


def jax_cache(cache_bytes, cache_dtype):
    return jnp.asarray(cache_bytes).view(jnp.dtype(cache_dtype))


def bytes_of(cache):
    if isinstance(cache, torch.Tensor):
        return cache.view(torch.uint8).numpy()
    return np.asarray(cache.view(jnp.uint8))


def scale_arg(scale, kind, frontend):
    if kind == "float":
        return scale
    if frontend == "torch":
        return torch.tensor([scale], dtype=torch.float32)
    return jnp.asarray([scale], jnp.float32)


# --- reshape_and_cache --------------------------------------------------------------------------


def test_numpy_codes_are_torch_and_ml_dtypes_casts():
    """The reference itself: ml_dtypes' cast and torch's agree on every byte of both formats'
    rounding midpoints and their float32 neighbours (where a wrong rounding would show)."""
    for cache_dtype, (_, mdt, top) in FORMATS.items():
        grid = np.arange(256, dtype=np.uint8).view(mdt).astype(np.float64)
        grid = np.unique(grid[np.isfinite(grid) & (np.abs(grid) <= top)])
        mid = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
        probes = np.concatenate([mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf))])
        want = probes.astype(mdt).view(np.uint8)
        got = torch.from_numpy(probes).to(getattr(torch, cache_dtype)).view(torch.uint8).numpy()
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(fp8_codes(probes, 1.0, cache_dtype), want)


@pytest.mark.parametrize("cache_dtype", list(FORMATS))
def test_grid_rounding_before_the_xla_cast_is_exact_at_every_midpoint(cache_dtype):
    """``round_to_fp8_grid`` (what the XLA-backed paths apply before their cast, whose rounding
    goes through float16 in some releases) lands on ml_dtypes' value at every midpoint of the grid
    and its float32 neighbours, binade tops included."""
    from dualop.backends import array_namespace
    from dualop.kernels.kv_cache_math import FP8_KV_FORMATS, round_to_fp8_grid

    _, mdt, top = FORMATS[cache_dtype]
    grid = np.arange(256, dtype=np.uint8).view(mdt).astype(np.float64)
    grid = np.unique(grid[np.isfinite(grid) & (np.abs(grid) <= top)])
    mid = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    probes = np.concatenate([mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf)),
                             grid.astype(np.float32)])
    probes = probes[np.abs(probes) <= top]
    x = jnp.asarray(probes)
    got = np.asarray(round_to_fp8_grid(array_namespace(x), x, FP8_KV_FORMATS[cache_dtype]))
    np.testing.assert_array_equal(got, probes.astype(mdt).astype(np.float32))


TORCH_WRITE_PATHS = [("cpu", "forward_cpu"), ("cuda", "forward_cuda"), ("cpu", "forward_native")]


@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
@pytest.mark.parametrize("key_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cache_dtype", list(FORMATS))
@pytest.mark.parametrize("platform, method", TORCH_WRITE_PATHS)
def test_torch_writes_the_numpy_bytes_in_place(platform, method, cache_dtype, key_dtype, scale_kind):
    key, value, cache_bytes, slots = write_batch(cache_dtype=cache_dtype, seed=1)
    tkey, tvalue = (torch.from_numpy(a).to(getattr(torch, key_dtype)) for a in (key, value))
    key, value = tkey.float().numpy(), tvalue.float().numpy()  # the values the op is given
    cache = torch_cache(cache_bytes, cache_dtype)
    op = ReshapeAndCache()
    with override_platform(platform), set_config(OpsConfig(["all"] if method != "forward_native" else ["none"])):
        op.last_fallback = None
        out = op(tkey, tvalue, cache, torch.from_numpy(slots), kv_cache_dtype=FORMATS[cache_dtype][0],
                 k_scale=scale_arg(K_SCALE, scale_kind, "torch"), v_scale=scale_arg(V_SCALE, scale_kind, "torch"))
        assert op.last_run("torch", platform)[0] == method
    assert out is cache
    np.testing.assert_array_equal(bytes_of(cache), written_cache(key, value, cache_bytes, slots, cache_dtype,
                                                                 K_SCALE, V_SCALE))


@pytest.mark.parametrize("scale_kind", ["float", "array"])
@pytest.mark.parametrize("cache_dtype", list(FORMATS))
@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_jax_writes_the_numpy_bytes(platform, cache_dtype, scale_kind):
    """The jax native body (cpu) and the Pallas kernel (tpu: interpreted here) give the numpy
    bytes, also under jit with the scales traced."""
    key, value, cache_bytes, slots = write_batch(cache_dtype=cache_dtype, seed=2, tokens=9)
    want = written_cache(key, value, cache_bytes, slots, cache_dtype, K_SCALE, V_SCALE)
    op = ReshapeAndCache()
    kv_cache_dtype = FORMATS[cache_dtype][0]
    scales = dict(k_scale=scale_arg(K_SCALE, scale_kind, "jax"), v_scale=scale_arg(V_SCALE, scale_kind, "jax"))
    args = (jnp.asarray(key), jnp.asarray(value), jax_cache(cache_bytes, cache_dtype), jnp.asarray(slots))
    with override_platform(platform), set_config(OpsConfig(["all"])):
        op.last_fallback = None
        out = op(*args, kv_cache_dtype=kv_cache_dtype, **scales)
        assert op.last_run("jax", platform)[0] == ("forward_tpu" if platform == "tpu" else "forward_native")
        np.testing.assert_array_equal(bytes_of(out), want)
        if scale_kind == "array":
            step = jax.jit(lambda k, v, c, s, ks, vs: op(k, v, c, s, kv_cache_dtype=kv_cache_dtype, k_scale=ks,
                                                          v_scale=vs))
            np.testing.assert_array_equal(bytes_of(step(*args, scales["k_scale"], scales["v_scale"])), want)
    np.testing.assert_array_equal(bytes_of(args[2]), cache_bytes)  # the input cache is unchanged


@pytest.mark.latest_only
@pytest.mark.parametrize("cache_dtype", list(FORMATS))
def test_pallas_kernel_in_tpu_interpret_mode(cache_dtype):
    from dualop.kernels.pallas.common import interpret_mode
    from dualop.kernels.pallas.reshape_and_cache import reshape_and_cache

    mode = interpret_mode("jax")
    if mode is True:
        pytest.skip(f"jax {jax.__version__} has no TPU interpret mode dualop can use (needs 0.8+)")
    key, value, cache_bytes, slots = write_batch(cache_dtype=cache_dtype, seed=3, tokens=40, num_pages=12,
                                                 padding=7)  # two grid steps of 32 tokens
    inverses = [jnp.asarray([np.float32(1) / np.float32(s)]) for s in (K_SCALE, V_SCALE)]
    from dualop.ops.kv_cache import last_writes

    out = reshape_and_cache(jnp.asarray(key), jnp.asarray(value), jax_cache(cache_bytes, cache_dtype),
                            last_writes(jnp.asarray(slots)), *inverses, interpret=mode)
    np.testing.assert_array_equal(bytes_of(out), written_cache(key, value, cache_bytes, slots, cache_dtype,
                                                               K_SCALE, V_SCALE))


@pytest.mark.parametrize("frontend", ["torch_xla", "torchax"])
def test_torch_on_xla_devices_writes_the_numpy_bytes(frontend):
    require_frontend(frontend)
    cache_dtype = "float8_e4m3fn"
    key, value, cache_bytes, slots = write_batch(cache_dtype=cache_dtype, seed=4)
    with testing.frontend_context(frontend):
        cache = testing.to_frontend(testing.Pinned(decoded(cache_bytes, cache_dtype).astype(np.float32),
                                                   cache_dtype), frontend, cache_dtype)
        args = [testing.to_frontend(a, frontend, "float32") for a in (key, value)]
        op = ReshapeAndCache()
        with override_platform("tpu"), set_config(OpsConfig(["all"])):
            out = op(*args, cache, testing.to_frontend(testing.Pinned(slots, "int32"), frontend, "int32"),
                     kv_cache_dtype="fp8", k_scale=K_SCALE, v_scale=V_SCALE)
            assert op.last_run(frontend, "tpu")[0] == "forward_tpu"
        assert out is cache
        got = testing.to_numpy(cache).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(got, written_cache(key, value, cache_bytes, slots, cache_dtype, K_SCALE, V_SCALE))


def _bad_write(change):
    key, value, cache_bytes, slots = write_batch()
    args = dict(key=torch.from_numpy(key), value=torch.from_numpy(value),
                kv_pages=torch_cache(cache_bytes, "float8_e4m3fn"), slot_mapping=torch.from_numpy(slots),
                kv_cache_dtype="fp8", k_scale=K_SCALE, v_scale=V_SCALE)
    change(args)
    return args


@pytest.mark.parametrize("change, error, message", [
    (lambda a: a.update(kv_cache_dtype="auto"), ValueError, "'kv_cache_dtype' is 'auto'.*float8_e4m3fn"),
    (lambda a: a.update(kv_cache_dtype="fp8_e5m2"), ValueError, "'kv_cache_dtype' is 'fp8_e5m2'.*float8_e4m3fn"),
    (lambda a: a.update(kv_cache_dtype="int8"), ValueError, "'kv_cache_dtype' is 'int8'; expected one of"),
    (lambda a: a.update(kv_pages=a["kv_pages"].float(), kv_cache_dtype="fp8"), ValueError,
     "'kv_cache_dtype' is 'fp8'.*'kv_pages' has dtype float32"),
    (lambda a: a.update(k_scale=0.0), ValueError, "'k_scale' is 0.0; expected a positive, finite scale"),
    (lambda a: a.update(v_scale=float("nan")), ValueError, "'v_scale' is nan"),
    (lambda a: a.update(k_scale=torch.tensor([-1.0])), ValueError, "'k_scale' is -1.0"),
    (lambda a: a.update(v_scale=torch.tensor([float("inf")])), ValueError, "'v_scale' is inf"),
    (lambda a: a.update(k_scale=torch.tensor([1.0, 2.0])), ValueError, r"'k_scale' has shape \(2,\); expected one"),
    (lambda a: a.update(k_scale=torch.tensor([1.0], dtype=torch.float64)), TypeError, "'k_scale' has dtype float64"),
    (lambda a: a.update(k_scale=True), TypeError, "'k_scale' must be None, a number"),
])
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_bad_fp8_writes_are_refused_with_the_cache_untouched(platform, change, error, message, monkeypatch):
    from dualop.kernels.cuda import reshape_and_cache as triton_kernel

    def never(*args, **kwargs):
        raise AssertionError("the kernel ran on bad input")

    monkeypatch.setattr(triton_kernel, "reshape_and_cache", never)
    args = _bad_write(change)
    before = bytes_of(args["kv_pages"]).copy() if args["kv_pages"].dtype != torch.float32 else None
    with override_platform(platform), set_config(OpsConfig(["all"])):
        with pytest.raises(error, match=f"reshape_and_cache: .*{message}"):
            ReshapeAndCache()(**args)
    if before is not None:
        np.testing.assert_array_equal(bytes_of(args["kv_pages"]), before)


def test_float_cache_ignores_scales_as_the_engine_does():
    key, value, _, slots = write_batch()
    cache = torch.zeros((5, 4, 4, 32))
    out = ReshapeAndCache()(torch.from_numpy(key), torch.from_numpy(value), cache.clone(), torch.from_numpy(slots),
                            k_scale=0.5, v_scale=torch.tensor([3.0]))
    want = ReshapeAndCache()(torch.from_numpy(key), torch.from_numpy(value), cache.clone(), torch.from_numpy(slots))
    assert torch.equal(out, want)


# --- ragged_paged_attention over an fp8 cache ------------------------------------------------------

# (q_len, kv_len) per sequence: decode, prefill, a chunk of a longer prompt (partial last pages of 4)
MIXED_Q, MIXED_KV = [1, 3, 4, 1], [9, 3, 14, 6]


def fp8_attention_batch(cache_dtype, *, group=2, head_dim=32, num_kv_heads=2, page_size=4, seed=0):
    """A mixed batch (two padding rows, a padding sequence) whose cache holds the fp8 codes of
    normal values written with K_SCALE / V_SCALE; returns (float32 q, cache bytes, int32 metadata)."""
    rng = np.random.default_rng(seed)
    q, kv, lens, pages, cu, count = paged_batch(rng, MIXED_Q, MIXED_KV, num_tokens=sum(MIXED_Q) + 2,
                                                num_q_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                                                head_dim=head_dim, page_size=page_size, max_seqs=len(MIXED_Q) + 1)
    codes = np.empty(kv.shape, np.uint8)
    codes[:, :, 0::2] = fp8_codes(kv[:, :, 0::2] * 3.0, K_SCALE, cache_dtype)  # K beyond a unit scale
    codes[:, :, 1::2] = fp8_codes(kv[:, :, 1::2], V_SCALE, cache_dtype)
    return q * 0.3, codes, (lens, pages, cu, count)


def numpy_attention(q, k, v, meta, sm_scale):
    """float64 causal GQA attention of each sequence's rows over its K/V positions (k, v:
    ``[num_pages, page_size, Hkv, D]``, already dequantised); padding rows zero."""
    lens, pages, cu, count = meta
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    out = np.zeros((num_tokens, num_q_heads, head_dim))
    for i in range(int(count[0])):
        kv_len, start, end = int(lens[i]), int(cu[i]), int(cu[i + 1])
        positions = np.arange(kv_len)
        ks = k[pages[i, positions // page_size], positions % page_size]  # [kv_len, Hkv, D]
        vs = v[pages[i, positions // page_size], positions % page_size]
        for r in range(start, end):
            seen = positions <= kv_len - (end - start) + (r - start)
            for h in range(num_q_heads):
                s = ks[seen, h // group] @ q[r, h].astype(np.float64) * sm_scale
                w = np.exp(s - s.max())
                out[r, h] = (w / w.sum()) @ vs[seen, h // group]
    return out


RPA_OPTIONS = dict(sm_scale=0.25, k_scale=K_SCALE, v_scale=V_SCALE)


def _run_paged(op, options, frontend, platform, method, q, cache, meta, q_dtype, cache_dtype):
    """``op(q, cache, *meta, **options)`` on ``frontend`` by ``method`` (checked to be what ran):
    (the output as float32 numpy, the arguments)."""
    if frontend == "torch":
        args = (torch.from_numpy(q).to(getattr(torch, q_dtype)), torch_cache(cache, cache_dtype),
                *(torch.from_numpy(a) for a in meta))
    else:
        args = (jnp.asarray(q).astype(q_dtype), jax_cache(cache, cache_dtype), *(jnp.asarray(a) for a in meta))
    with override_platform(platform), set_config(OpsConfig(["all"] if method != "forward_native" else ["none"])):
        op.last_fallback = None
        out = op(*args, **options)
        assert op.last_run(frontend, platform)[0] == method, op.last_fallback
    return testing.to_numpy(out), args


def _rpa(frontend, platform, method, q, cache, meta, q_dtype, cache_dtype):
    return _run_paged(RaggedPagedAttention(), RPA_OPTIONS, frontend, platform, method, q, cache, meta, q_dtype,
                      cache_dtype)


RPA_PATHS = [("torch", "cpu", "forward_cpu"), ("torch", "cuda", "forward_cuda"), ("torch", "cpu", "forward_native"),
             ("jax", "tpu", "forward_tpu"), ("jax", "cpu", "forward_native")]


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cache_dtype", list(FORMATS))
@pytest.mark.parametrize("frontend, platform, method", RPA_PATHS)
def test_attention_over_an_fp8_cache_matches_numpy_and_the_native_body(frontend, platform, method, cache_dtype,
                                                                        q_dtype):
    q, cache, meta = fp8_attention_batch(cache_dtype, seed=5)
    if q_dtype == "bfloat16":
        q = torch.from_numpy(q).bfloat16().float().numpy()  # the values the op is given
    got, _ = _rpa(frontend, platform, method, q, cache, meta, q_dtype, cache_dtype)
    values = decoded(cache, cache_dtype)
    want = numpy_attention(q, values[:, :, 0::2] * np.float32(K_SCALE), values[:, :, 1::2] * np.float32(V_SCALE),
                           meta, RPA_OPTIONS["sm_scale"])
    tol = testing.TOLERANCES[q_dtype]
    np.testing.assert_allclose(got, want, atol=tol.atol + 1e-5, rtol=tol.rtol)
    native, _ = _rpa(frontend, "cpu", "forward_native", q, cache, meta, q_dtype, cache_dtype)
    assert testing.compare(got, native, q_dtype).ok
    assert not got[sum(MIXED_Q):].any()  # padding rows


def test_the_cpu_kernel_decodes_every_code_of_both_formats():
    """One KV position per code: a query against a one-hot K row picks out each V row's decoded
    value exactly (softmax over a single position), NaN codes included."""
    from dualop.kernels.cpu.ragged_paged_attention import ragged_paged_attention as cpu_kernel

    for cache_dtype in FORMATS:
        codes = np.arange(256, dtype=np.uint8)
        cache = np.zeros((256, 1, 2, 8), np.uint8)
        cache[:, 0, 1, :] = codes[:, None]  # V rows hold every code; K rows are zeros
        lens, cu = np.ones(256, np.int32), np.arange(257, dtype=np.int32)
        pages = np.arange(256, dtype=np.int32)[:, None]
        out = cpu_kernel(torch.zeros((256, 1, 8)), torch_cache(cache, cache_dtype), torch.from_numpy(lens),
                         torch.from_numpy(pages), torch.from_numpy(cu), torch.tensor([256], dtype=torch.int32))
        want = codes.view(FORMATS[cache_dtype][1]).astype(np.float32)
        np.testing.assert_array_equal(out[:, 0, 0].numpy(), want)


@pytest.mark.parametrize("cache_dtype", list(FORMATS))
def test_the_triton_kernel_decodes_every_code_of_both_formats(cache_dtype):
    from dualop.kernels.cuda.ragged_paged_attention import ragged_paged_attention as triton_kernel

    codes = np.arange(256, dtype=np.uint8)
    cache = np.zeros((64, 4, 2, 16), np.uint8)
    cache[:, :, 1, :] = codes.reshape(64, 4)[:, :, None]
    out = triton_kernel(torch.zeros((256, 1, 16)), torch_cache(cache, cache_dtype),
                        torch.tensor([1] * 256, dtype=torch.int32),
                        torch.from_numpy(np.repeat(np.arange(64, dtype=np.int32), 4)[:, None]),
                        torch.from_numpy(np.arange(257, dtype=np.int32)), torch.tensor([256], dtype=torch.int32))
    # sequence i reads position 0 of page i // 4: code 4 * (i // 4)
    want = codes.view(FORMATS[cache_dtype][1]).astype(np.float32)[4 * (np.arange(256) // 4)]
    np.testing.assert_array_equal(out[:, 0, 0].numpy(), want)


def test_a_cache_in_another_float_dtype_is_still_refused():
    q, cache, meta = fp8_attention_batch("float8_e4m3fn")
    with pytest.raises(TypeError, match="ragged_paged_attention: argument 'kv_pages' has dtype bfloat16"):
        RaggedPagedAttention()(torch.from_numpy(q), torch.zeros((cache.shape), dtype=torch.bfloat16),
                               *(torch.from_numpy(a) for a in meta))
    with pytest.raises(ValueError, match="ragged_paged_attention: option 'k_scale' must be None or a positive"):
        RaggedPagedAttention()(torch.from_numpy(q), torch_cache(cache, "float8_e4m3fn"),
                               *(torch.from_numpy(a) for a in meta), k_scale=torch.tensor([1.0]))


# --- the MLA latent cache in fp8 (one scale) --------------------------------------------------------

MLA_LATENT, MLA_ROPE, MLA_SCALE = 24, 8, 0.043


def fp8_mla_batch(cache_dtype, *, heads=2, page_size=16, seed=0):
    """A mixed MLA batch (two padding rows, a padding sequence) whose latent cache holds the fp8
    codes of normal values written with MLA_SCALE; returns (float32 q_latent, cache bytes, metadata)."""
    from dualop.ops.mla import mla_batch

    rng = np.random.default_rng(seed)
    q, pages, *meta = mla_batch(rng, MIXED_Q, MIXED_KV, num_tokens=sum(MIXED_Q) + 2, heads=heads,
                                latent=MLA_LATENT, rope_dim=MLA_ROPE, page_size=page_size, max_seqs=len(MIXED_Q) + 1)
    return q * 0.5, fp8_codes(pages, MLA_SCALE, cache_dtype), tuple(meta)


def _mla(frontend, platform, method, q, cache, meta, q_dtype, cache_dtype):
    from dualop.ops import RaggedPagedMLAAttention

    return _run_paged(RaggedPagedMLAAttention(MLA_LATENT), dict(sm_scale=0.2, k_scale=MLA_SCALE), frontend, platform,
                      method, q, cache, meta, q_dtype, cache_dtype)[0]


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cache_dtype", list(FORMATS))
@pytest.mark.parametrize("frontend, platform, method", RPA_PATHS)
def test_mla_over_an_fp8_latent_cache_matches_numpy_and_the_native_body(frontend, platform, method, cache_dtype,
                                                                         q_dtype):
    """Absorbed MLA reads ``code * k_scale`` on every path (the C++ decode kernel declines fp8 pages:
    torch's CPU path is its GEMMs on the decoded rows): against float64 numpy attention with K = the
    whole dequantised latent row and V = its first L channels, and against the native body."""
    if q_dtype == "bfloat16" and frontend == "jax" and platform == "cpu":
        pytest.skip("the jax native body is the reference of the other paths; float32 covers it")
    q, cache, meta = fp8_mla_batch(cache_dtype, seed=6)
    if q_dtype == "bfloat16":
        q = torch.from_numpy(q).bfloat16().float().numpy()  # the values the op is given
    got = _mla(frontend, platform, method, q, cache, meta, q_dtype, cache_dtype)
    rows = decoded(cache, cache_dtype)[:, :, None, :] * np.float32(MLA_SCALE)  # one latent head
    values = rows.copy()
    values[..., MLA_LATENT:] = 0.0  # V: the first L channels
    want = numpy_attention(q, rows, values, meta, 0.2)[..., :MLA_LATENT]
    tol = testing.TOLERANCES[q_dtype]
    np.testing.assert_allclose(got, want, atol=tol.atol + 1e-5, rtol=tol.rtol)
    native = _mla(frontend, "cpu", "forward_native", q, cache, meta, q_dtype, cache_dtype)
    assert testing.compare(got, native, q_dtype).ok
    assert not got[sum(MIXED_Q):].any()  # padding rows


@pytest.mark.parametrize("cache_dtype", list(FORMATS))
@pytest.mark.parametrize("frontend, platform, method", [
    ("torch", "cpu", "forward_cpu"), ("torch", "cuda", "forward_cuda"), ("torch", "cpu", "forward_native"),
    ("jax", "tpu", "forward_tpu"), ("jax", "cpu", "forward_native")])
def test_concat_and_cache_mla_writes_the_numpy_codes_of_one_scale(frontend, platform, method, cache_dtype):
    """``concat_and_cache_mla(..., kv_cache_dtype, scale)``: row ``[kv_c | k_pe]``'s codes under the
    one scale, at the token's slot (padding skipped, a repeated slot's last token wins)."""
    from dualop.ops import ConcatAndCacheMLA

    key, _, cache_bytes, slots = write_batch(tokens=9, heads=1, head_dim=32, cache_dtype=cache_dtype, seed=7)
    kv_c, k_pe = key[:, 0, :24], key[:, 0, 24:]
    cache_bytes = cache_bytes.reshape(5, 4, 64)[:, :, :32]
    want = cache_bytes.copy()
    codes = fp8_codes(key[:, 0], MLA_SCALE, cache_dtype)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[slot // 4, slot % 4] = codes[t]
    op = ConcatAndCacheMLA()
    if frontend == "torch":
        args = (torch.from_numpy(kv_c), torch.from_numpy(k_pe), torch_cache(np.ascontiguousarray(cache_bytes),
                                                                            cache_dtype), torch.from_numpy(slots))
    else:
        args = (jnp.asarray(kv_c), jnp.asarray(k_pe), jax_cache(np.ascontiguousarray(cache_bytes), cache_dtype),
                jnp.asarray(slots))
    with override_platform(platform), set_config(OpsConfig(["all"] if method != "forward_native" else ["none"])):
        op.last_fallback = None
        out = op(*args, kv_cache_dtype=FORMATS[cache_dtype][0], scale=MLA_SCALE)
        assert op.last_run(frontend, platform)[0] == method, op.last_fallback
    np.testing.assert_array_equal(bytes_of(out), want)


def test_bad_fp8_mla_calls_are_refused():
    from dualop.ops import ConcatAndCacheMLA, RaggedPagedMLAAttention

    q, cache, meta = fp8_mla_batch("float8_e4m3fn")
    args = (torch.from_numpy(q), torch_cache(cache, "float8_e4m3fn"), *(torch.from_numpy(a) for a in meta))
    with pytest.raises(ValueError, match="ragged_paged_mla_attention: option 'k_scale' must be None or a positive"):
        RaggedPagedMLAAttention(MLA_LATENT)(*args, k_scale=0.0)
    with pytest.raises(TypeError, match="ragged_paged_mla_attention: argument 'latent_pages' has dtype float16"):
        RaggedPagedMLAAttention(MLA_LATENT)(args[0], args[1].view(torch.uint8).to(torch.float16), *args[2:])
    kv_c, k_pe = torch.zeros((2, 24)), torch.zeros((2, 8))
    with pytest.raises(ValueError, match="concat_and_cache_mla: argument 'kv_cache_dtype' is 'auto'.*'latent_pages'"):
        ConcatAndCacheMLA()(kv_c, k_pe, torch.zeros((3, 4, 32), dtype=torch.float8_e4m3fn), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="concat_and_cache_mla: argument 'scale' is -1.0"):
        ConcatAndCacheMLA()(kv_c, k_pe, torch.zeros((3, 4, 32), dtype=torch.float8_e4m3fn), torch.tensor([0, 1]),
                            kv_cache_dtype="fp8", scale=-1.0)
