"""Edge cases a fuzz run found in the attention ops, each fixed at its root:

- a NaN or inf in one sequence's (segment's) queries, keys, values or cached rows reaches only
  that sequence's output rows, on every path (``ragged_paged_attention``,
  ``ragged_paged_mla_attention``, ``mm_encoder_attn``);
- cache rows past a sequence's ``kv_len`` (the tail of its last page, pages it does not use: a
  recycled page, a ``torch.empty`` cache) never reach any output, on every path, the native body
  included: with NaN/inf garbage there the native body gives exactly what it gives with zeros;
- the C++ paged attention scores huge queries as the native body does (no NaN from a dot product
  whose partial sums overflow), checked against a float64 numpy reference;
- the latent attention layer refuses positions outside its rope table, before anything runs;
- non-finite or non-positive scales, NaN mask values and soft caps are refused, naming the op and
  the argument;
- the bfloat16 latent attention layer on the TPU path with jax arrays on a CPU host (XLA:CPU has
  no bfloat16 x bfloat16 -> float32 dot).

Each kernel path is compared with ``forward_native``; the platform paths run interpreted (Triton's
interpreter, Pallas's TPU interpreter) or as the C++ CPU kernels.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dualop import OpsConfig, override_platform, set_config, testing
from dualop.kernels.paged_attention_math import DEFAULT_MASK_VALUE
from dualop.ops import MMEncoderAttention, MultiHeadLatentAttention, RaggedPagedAttention, RaggedPagedMLAAttention
from dualop.ops import get_rope
from dualop.ops.attention import paged_batch
from dualop.ops.mla import mla_batch

NAN, INF = float("nan"), float("inf")
# NaN and inf inputs are the point here: numpy's (and Triton's interpreter's) warnings about them are not.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# (frontend, platform): None is the native body called directly; a platform its kernel path.
NATIVE_CELLS = [("torch", None), ("jax", None)]
KERNEL_CELLS = [("torch", "cpu"), ("torch", "cuda"), ("jax", "tpu")]
CELLS = NATIVE_CELLS + KERNEL_CELLS


def _cell_id(cell) -> str:
    frontend, platform = cell
    return f"{frontend}-{platform or 'native'}"


def _skip_without_triton(platform) -> None:
    if platform == "cuda" and testing.prepare_triton() is not None:
        pytest.skip(f"Triton cannot run here: {testing.prepare_triton()}")


def _on(frontend: str, arrays, dtype: str = "float32"):
    return [testing.to_frontend(a if a.dtype != np.int32 else testing.Pinned(a, "int32"), frontend, dtype)
            for a in arrays]


def _run(op, cell, arrays, dtype: str = "float32", **options) -> np.ndarray:
    """``op`` on numpy ``arrays`` in ``cell``: the native body, or the platform's kernel (which
    must be the method that ran)."""
    frontend, platform = cell
    _skip_without_triton(platform)
    args = _on(frontend, arrays, dtype)
    if platform is None:
        return testing.to_numpy(op.forward_native(*args, **options))
    with override_platform(platform), set_config(OpsConfig(["all"])):
        out = op(*args, **options)
        assert op.last_run(frontend, platform)[0] == f"forward_{platform}"
    return testing.to_numpy(out)


def _unread_rows(pages: np.ndarray, kv_lens, table, num_seqs, page_size: int) -> np.ndarray:
    """[num_pages, page_size] True for the cache rows no sequence reads: tails of last pages and
    pages no sequence uses."""
    used = np.zeros(pages.shape[:2], bool)
    for i in range(int(num_seqs[0])):
        for p in range(int(kv_lens[i])):
            used[table[i, p // page_size], p % page_size] = True
    return ~used


def _garbage(pages: np.ndarray, unread: np.ndarray, kind: str) -> np.ndarray:
    """``pages`` with its unread rows zeroed (``clean``) or holding garbage: NaN and infinities of
    both signs, as a recycled page or uninitialised memory may."""
    pages = pages.copy()
    if kind == "clean":
        pages[unread] = 0.0
    else:
        rows = pages[unread]
        rows[..., 0::3] = NAN
        rows[..., 1::3] = INF
        rows[..., 2::3] = -INF
        pages[unread] = rows
    return pages


# --- ragged_paged_attention: a float64 reference ---------------------------------------------------


def rpa_reference(q, kv_pages, kv_lens, table, cu, num_seqs, *, sm_scale, sliding_window=None, soft_cap=None,
                  mask_value=None) -> np.ndarray:
    """The op's rule in float64, sequence by sequence, reading only positions below kv_len."""
    q_heads = q.shape[1]
    page_size, kv_heads = kv_pages.shape[1], kv_pages.shape[2] // 2
    group = q_heads // kv_heads
    fill = DEFAULT_MASK_VALUE if mask_value is None else mask_value
    out = np.zeros(q.shape, np.float64)
    for i in range(int(num_seqs[0])):
        start, end, kv_len = int(cu[i]), int(cu[i + 1]), int(kv_lens[i])
        positions = np.arange(kv_len)
        kv = kv_pages[table[i, positions // page_size], positions % page_size].astype(np.float64)
        for r in range(end - start):
            pos = kv_len - (end - start) + r
            allowed = positions <= pos
            if sliding_window is not None:
                allowed &= positions > pos - sliding_window
            for h in range(q_heads):
                k, v = kv[:, 2 * (h // group)], kv[:, 2 * (h // group) + 1]
                s = (k @ q[start + r, h].astype(np.float64)) * sm_scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                s = np.where(allowed, s, fill)
                p = np.exp(s - s.max())
                out[start + r, h] = (p / p.sum()) @ v
    return out


def _rpa_batch(seed: int, head_dim: int = 16):
    """Three sequences (decode, a chunk, a prefill) with partly used last pages, a spare page
    each, a padding sequence and two padding rows; pages of 4 tokens."""
    rng = np.random.default_rng(seed)
    return paged_batch(rng, [1, 2, 3], [6, 9, 3], num_tokens=8, num_q_heads=4, num_kv_heads=2, head_dim=head_dim,
                       page_size=4, max_seqs=4, spare_pages=1)


RPA_OPTIONS = {
    "plain": {"sm_scale": 0.25},
    "window,soft_cap,mask_value": {"sm_scale": 0.25, "sliding_window": 3, "soft_cap": 2.0, "mask_value": -2.0},
}


def _stale_case(op_name: str, options: str, seed: int):
    """(op, numpy inputs, options, unread cache rows) of a batch whose pages are partly used."""
    if op_name == "ragged_paged_mla_attention":
        rng = np.random.default_rng(seed)
        arrays = mla_batch(rng, [1, 2, 3], [6, 9, 3], num_tokens=8, heads=2, latent=16, rope_dim=8, page_size=4,
                           max_seqs=4)
        op, opts = RaggedPagedMLAAttention(16), {"sm_scale": 0.2}
    else:
        arrays, op, opts = _rpa_batch(seed), RaggedPagedAttention(), RPA_OPTIONS[options]
    q, pages, *meta = arrays
    return op, [q, pages, *meta], opts, _unread_rows(pages, meta[0], meta[1], meta[3], 4)


STALE_CASES = [("ragged_paged_attention", "plain"), ("ragged_paged_attention", "window,soft_cap,mask_value"),
               ("ragged_paged_mla_attention", "plain")]


@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("op_name, options", STALE_CASES)
def test_native_body_ignores_unread_cache_rows(op_name, options, frontend):
    """NaN/inf garbage past kv_len (and in unused pages) gives exactly the output of zeros there."""
    op, (q, pages, *meta), opts, unread = _stale_case(op_name, options, 0)
    clean = _run(op, (frontend, None), [q, _garbage(pages, unread, "clean"), *meta], **opts)
    dirty = _run(op, (frontend, None), [q, _garbage(pages, unread, "garbage"), *meta], **opts)
    assert np.isfinite(dirty).all()
    assert np.array_equal(dirty, clean)


def test_rpa_native_body_matches_a_float64_reference():
    q, pages, *meta = _rpa_batch(1)
    unread = _unread_rows(pages, meta[0], meta[1], meta[3], 4)
    options = RPA_OPTIONS["window,soft_cap,mask_value"]
    got = _run(RaggedPagedAttention(), ("torch", None), [q, _garbage(pages, unread, "garbage"), *meta], **options)
    want = rpa_reference(q, pages, *meta, **options).astype(np.float32)
    assert testing.compare(got, want, "float32").ok, np.abs(got - want).max()


@pytest.mark.parametrize("cell", KERNEL_CELLS, ids=_cell_id)
@pytest.mark.parametrize("op_name, options", STALE_CASES[1:])
def test_kernels_ignore_unread_cache_rows(op_name, options, cell):
    op, (q, pages, *meta), opts, unread = _stale_case(op_name, options, 2)
    want = _run(op, ("torch", None), [q, _garbage(pages, unread, "clean"), *meta], **opts)
    got = _run(op, cell, [q, _garbage(pages, unread, "garbage"), *meta], **opts)
    assert testing.compare(got, want, "float32").ok, np.abs(got - want).max()


@pytest.mark.parametrize("cell", KERNEL_CELLS[:1] + NATIVE_CELLS, ids=_cell_id)
def test_rpa_scores_of_huge_queries_are_never_nan(cell):
    """Queries near float32's max with a soft cap: every score saturates, none is NaN (a dot
    product whose partial sums overflow both ways), as in float64."""
    q, pages, *meta = _rpa_batch(3, head_dim=64)
    q = np.clip(q, -3.0, 3.0) * np.float32(1e38)
    options = RPA_OPTIONS["window,soft_cap,mask_value"]
    got = _run(RaggedPagedAttention(), cell, [q, pages, *meta], **options)
    want = rpa_reference(q, pages, *meta, **options).astype(np.float32)
    assert np.isfinite(got).all()
    assert testing.compare(got, want, "float32").ok, np.abs(got - want).max()


# --- one sequence's non-finite values stay in its rows ----------------------------------------------


def _mla_batch(seed: int):
    """Two sequences (a chunk of 2 rows over 5 positions, a prefill of 3) and a padding row."""
    rng = np.random.default_rng(seed)
    return mla_batch(rng, [2, 3], [5, 3], num_tokens=6, heads=2, latent=16, rope_dim=8, page_size=4, max_seqs=3)


def _poison_first_sequence(arrays, where: str, paged_kv: bool):
    """A NaN in sequence 0's query or in one of its cached rows (position 1, below its kv_len)."""
    q, pages, kv_lens, table, cu, num_seqs = (a.copy() for a in arrays)
    if where == "query":
        q[0, 0, 3] = NAN
    else:
        row = pages[table[0, 0], 1]
        row[..., 2] = NAN if paged_kv else INF
        row[..., 5] = NAN
    return [q, pages, kv_lens, table, cu, num_seqs]


@pytest.mark.parametrize("cell", CELLS, ids=_cell_id)
@pytest.mark.parametrize("where", ["query", "cache"])
@pytest.mark.parametrize("op_name", ["ragged_paged_mla_attention", "ragged_paged_attention"])
def test_a_sequences_nan_stays_in_its_rows(op_name, where, cell):
    """Sequence 0's NaN (or inf) leaves sequence 1's rows and the padding row exactly as they are
    with clean input, on the same path; sequence 0's rows that see it are NaN."""
    if op_name == "ragged_paged_mla_attention":
        arrays, op, options = list(_mla_batch(4)), RaggedPagedMLAAttention(16), {"sm_scale": 0.2}
    else:
        rng = np.random.default_rng(5)
        arrays = list(paged_batch(rng, [2, 3], [5, 3], num_tokens=6, num_q_heads=2, num_kv_heads=1, head_dim=16,
                                  page_size=4, max_seqs=3))
        op, options = RaggedPagedAttention(), {"sm_scale": 0.2}
    poisoned = _poison_first_sequence(arrays, where, op_name == "ragged_paged_attention")
    clean = _run(op, cell, arrays, **options)
    dirty = _run(op, cell, poisoned, **options)
    assert np.array_equal(dirty[2:], clean[2:]), "sequence 1 or the padding row changed"
    assert np.isfinite(clean).all()
    assert np.isnan(dirty[0, 0]).all() if where == "query" else np.isnan(dirty[:2]).all()
    assert testing.compare(dirty, _run(op, ("torch", None), poisoned, **options), "float32").ok


def _encoder_inputs(seed: int):
    """12 tokens packed as segments [0, 4), [4, 4) (empty), [4, 12); 4 query heads on 2 KV heads of 8."""
    rng = np.random.default_rng(seed)
    q, k, v = (testing.normal((1, 12, n * 8), rng) for n in (4, 2, 2))
    return q, k, v, np.array([0, 4, 4, 12], np.int32)


ENCODER_SPECIALS = [("query", NAN), ("key", INF), ("value", -INF), ("value", NAN)]


@pytest.mark.parametrize("cell", CELLS, ids=_cell_id)
@pytest.mark.parametrize("which, special", ENCODER_SPECIALS, ids=lambda v: str(v))
def test_an_images_nonfinite_input_stays_in_its_segment(which, special, cell):
    """A special value in token 2 (segment 0): segment 2's rows are exactly the clean ones, on the
    same path, and the path's NaN and inf positions are the native body's."""
    q, k, v, cu = _encoder_inputs(6)
    arrays = {"query": q.copy(), "key": k.copy(), "value": v.copy()}
    arrays[which][0, 2, 3] = special  # channel 3 of head 0
    op = MMEncoderAttention(4, 8, num_kv_heads=2)
    clean = _run(op, cell, [q, k, v, cu])
    dirty = _run(op, cell, [arrays["query"], arrays["key"], arrays["value"], cu])
    native = _run(op, ("torch", None), [arrays["query"], arrays["key"], arrays["value"], cu])
    assert np.isfinite(clean).all()
    assert np.array_equal(dirty[:, 4:], clean[:, 4:]), "another segment's rows changed"
    assert not np.isfinite(dirty[:, :4]).all()
    assert np.array_equal(np.isposinf(dirty), np.isposinf(native))
    assert np.array_equal(np.isneginf(dirty), np.isneginf(native))
    assert testing.compare(dirty, native, "float32").ok


def encoder_reference(q, k, v, cu, heads: int, kv_heads: int, d: int, scale: float) -> np.ndarray:
    """Per segment, in float64 (infinities propagate as IEEE arithmetic makes them)."""
    s = q.shape[1]
    qh, kh, vh = (a.astype(np.float64).reshape(s, n, d) for a, n in ((q[0], heads), (k[0], kv_heads),
                                                                       (v[0], kv_heads)))
    out = np.zeros((s, heads, d))
    for start, end in zip(cu[:-1], cu[1:]):
        if end == start:
            continue
        for h in range(heads):
            g = h // (heads // kv_heads)
            logits = qh[start:end, h] @ kh[start:end, g].T * scale
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            with np.errstate(invalid="ignore"):
                out[start:end, h] = (p @ vh[start:end, g]) / p.sum(axis=1, keepdims=True)
    return out.reshape(q.shape)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_encoder_native_body_with_infinite_values_matches_a_float64_reference(frontend):
    q, k, v, cu = _encoder_inputs(7)
    v[0, 1, 3], v[0, 9, 8 + 5], v[0, 10, 8 + 5] = INF, INF, -INF  # segment 0 +inf; segment 2 both signs
    got = _run(MMEncoderAttention(4, 8, num_kv_heads=2), (frontend, None), [q, k, v, cu])
    want = encoder_reference(q, k, v, cu, 4, 2, 8, 8**-0.5).astype(np.float32)
    assert np.isinf(want).any() and np.isnan(want).any()
    assert testing.compare(got, want, "float32").ok


# --- the latent attention layer ----------------------------------------------------------------------

HIDDEN, HEADS, KV_LORA, NOPE, ROPE, V_HEAD, MAX_POS = 32, 2, 16, 8, 8, 8, 64
PAGE_SIZE, NUM_PAGES = 4, 8


def _layer() -> MultiHeadLatentAttention:
    rope = get_rope(ROPE, MAX_POS, False)
    return MultiHeadLatentAttention(HIDDEN, HEADS, (NOPE + ROPE) ** -0.5, NOPE, ROPE, V_HEAD, None, KV_LORA, rope)


def _layer_inputs(frontend: str, dtype: str = "float32", positions=(0, 1, 2, 0, 1)):
    """Two sequences of prefill (3 and 2 tokens), their pages 0 and 1, in ``frontend``."""
    rng = np.random.default_rng(8)

    def linear(out, inp):
        return (rng.standard_normal((out, inp)) / math.sqrt(inp)).astype(np.float32)

    weights = {"q_proj": linear(HEADS * (NOPE + ROPE), HIDDEN), "kv_a_proj_with_mqa": linear(KV_LORA + ROPE, HIDDEN),
               "kv_a_layernorm": np.ones(KV_LORA, np.float32),
               "kv_b_proj": linear(HEADS * (NOPE + V_HEAD), KV_LORA), "o_proj": linear(HIDDEN, HEADS * V_HEAD)}
    ints = [np.array(positions, np.int32), np.array([0, 1, 2, 4, 5], np.int32), np.array([3, 2], np.int32),
            np.array([[0], [1]], np.int32), np.array([0, 3, 5], np.int32), np.array([2], np.int32)]
    x = testing.normal((5, HIDDEN), rng)
    cache = np.zeros((NUM_PAGES, PAGE_SIZE, KV_LORA + ROPE), np.float32)
    to = lambda a: testing.to_frontend(a, frontend, dtype)  # noqa: E731
    positions, slots, *meta = (testing.to_frontend(testing.Pinned(a, "int32"), frontend, "int32") for a in ints)
    return [positions, to(x), {k: to(w) for k, w in weights.items()}, to(cache), slots, *meta]


@pytest.mark.parametrize("config, platform", [("none", "cpu"), ("all", "cpu"), ("all", "tpu")])
@pytest.mark.parametrize("bad", [10**6, -1, MAX_POS])
def test_layer_refuses_positions_outside_its_rope_table(bad, config, platform):
    frontend = "jax" if platform == "tpu" else "torch"
    args = _layer_inputs(frontend, positions=(0, 1, bad, 0, 1))
    layer = _layer()
    with override_platform(platform), set_config(OpsConfig([config])):
        with pytest.raises(ValueError, match=r"multi_head_latent_attention: argument 'positions' holds values in "
                                             rf"\[{min(bad, 0)}, {max(bad, 1)}\]; expected 0 <= position < {MAX_POS}"):
            layer(*args)
    assert not testing.to_numpy(args[3]).any(), "the cache was written"


def test_bfloat16_layer_on_the_tpu_path_with_jax_matches_native():
    """The absorbed form (the latent attention op between two per-head products)."""
    mode = "absorbed"
    layer = _layer()
    args = _layer_inputs("jax", "bfloat16")
    want, want_cache = layer.forward_native(*args, mode=mode)
    with override_platform("tpu"), set_config(OpsConfig(["all"])):
        got, got_cache = layer(*args, mode=mode)
        assert layer.last_run("jax", "tpu")[0] == "forward_tpu"
    assert testing.compare(testing.to_numpy(got), testing.to_numpy(want), "bfloat16", normwise=True).ok
    assert testing.compare(testing.to_numpy(got_cache), testing.to_numpy(want_cache), "bfloat16").ok


# --- bad options --------------------------------------------------------------------------------------


def _rpa_call(**options):
    arrays = _on("torch", _rpa_batch(0))
    return lambda: RaggedPagedAttention()(*arrays, **options)


def _mla_call(sm_scale):
    arrays = _on("torch", _mla_batch(0))
    return lambda: RaggedPagedMLAAttention(16)(*arrays, sm_scale=sm_scale)


def _layer_ctor(**kwargs):
    args = dict(hidden_size=HIDDEN, num_heads=HEADS, scale=0.25, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                v_head_dim=V_HEAD, q_lora_rank=None, kv_lora_rank=KV_LORA, rope=get_rope(ROPE, MAX_POS, False))
    return lambda: MultiHeadLatentAttention(**{**args, **kwargs})


BAD_OPTIONS = [
    *[(_rpa_call(sm_scale=v), r"ragged_paged_attention: option 'sm_scale' must be None or a positive, finite float")
      for v in (INF, NAN, 0.0, -0.5)],
    *[(_rpa_call(sm_scale=0.25, soft_cap=v), r"ragged_paged_attention: option 'soft_cap'") for v in (NAN, INF, -1.0)],
    (_rpa_call(sm_scale=0.25, mask_value=NAN), r"ragged_paged_attention: option 'mask_value' must be None or a float"),
    (_rpa_call(sm_scale=0.25, mask_value=INF), r"ragged_paged_attention: option 'mask_value' must be None or a float "
                                               r"below \+inf"),
    *[(_rpa_call(sm_scale=0.25, **{name: v}), rf"ragged_paged_attention: option '{name}' must be None or a positive")
      for name in ("k_scale", "v_scale") for v in (NAN, INF, 0.0, -1.0)],
    *[(_mla_call(v), r"ragged_paged_mla_attention: option 'sm_scale' must be a positive, finite float")
      for v in (INF, NAN, 0.0, -0.5)],
    *[(_layer_ctor(scale=v), r"multi_head_latent_attention: argument 'scale' must be a positive float")
      for v in (INF, NAN, 0.0)],
    *[(_layer_ctor(eps=v), r"multi_head_latent_attention: argument 'eps' must be a positive, finite float")
      for v in (INF, NAN, 0.0)],
    *[(lambda v=v: MMEncoderAttention(2, 8, scale=v), r"mm_encoder_attn: scale must be a positive float or None")
      for v in (NAN, INF, -INF, 0.0)],
]


@pytest.mark.parametrize("call, message", BAD_OPTIONS, ids=[str(i) for i in range(len(BAD_OPTIONS))])
def test_bad_scales_and_mask_values_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_edge_values_that_stay_accepted():
    """-inf is a mask value (masked positions weigh exactly 0); a positive mask value and a tiny
    scale are legal numbers."""
    arrays = _on("torch", _rpa_batch(0))
    for options in ({"mask_value": -INF}, {"mask_value": 1.0}, {"sm_scale": 1e-30}):
        out = RaggedPagedAttention()(*arrays, **{"sm_scale": 0.25, **options})
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_native_body_never_reads_cu_q_lens_past_num_seqs(frontend):
    """Entries of cu_q_lens past num_seqs + 1 mean nothing: a trailing 0 must not take row 0 from
    sequence 0 (the native body counted it as a sequence ending before the row)."""
    rng = np.random.default_rng(5)
    q = rng.normal(size=(1, 2, 8)).astype(np.float32)
    kv_pages = rng.normal(size=(2, 4, 2, 8)).astype(np.float32)
    meta = [np.array(v, np.int32) for v in ([3, 0], [[0], [1]])]
    import jax.numpy as jnp

    conv = (lambda a: torch.from_numpy(np.ascontiguousarray(a))) if frontend == "torch" else jnp.asarray
    op = RaggedPagedAttention()

    def run(cu):
        args = [conv(a) for a in (q, kv_pages, *meta, np.array(cu, np.int32), np.array([1], np.int32))]
        return testing.to_numpy(op.forward_native(*args))

    want = run([0, 1, 1])
    assert np.abs(want).max() > 0
    np.testing.assert_array_equal(run([0, 1, 0]), want)


# --- cu_q_lens the kernels cannot check: past T, negative or out of order ---------------------------

# Each becomes, on every path, cu_q_lens clipped to [0, T] and made non-decreasing (a running max).
DISORDERED_CU = [[0, 5120, 1, 6], [0, 4, 2, 6], [2, 1, 5, 6], [-3, 2, 9, 3]]


def _disordered_batch(op_name: str):
    """Three sequences over 6 rows, each kv_len 8 (longer than any q_len the rule can give), and
    the op with its options."""
    rng = np.random.default_rng(11)
    if op_name == "ragged_paged_mla_attention":
        arrays = mla_batch(rng, [2, 2, 2], [8, 8, 8], num_tokens=6, heads=2, latent=16, rope_dim=8, page_size=4)
        return RaggedPagedMLAAttention(16), arrays, {"sm_scale": 0.2}
    arrays = paged_batch(rng, [2, 2, 2], [8, 8, 8], num_tokens=6, num_q_heads=4, num_kv_heads=2, head_dim=16,
                         page_size=4)
    return RaggedPagedAttention(), arrays, {"sm_scale": 0.25, "sliding_window": 5}


def _kernel_without_checks(op_name: str, path: str):
    """The path's kernel function itself (the op would refuse the metadata where it can read it)."""
    import importlib

    package = {"triton": "cuda", "cpu": "cpu", "pallas": "pallas"}[path]
    module = importlib.import_module(f"dualop.kernels.{package}.{op_name}")
    return getattr(module, op_name)


@pytest.mark.parametrize("path", ["native-jit", "pallas-jit", "triton", "cpu"])
@pytest.mark.parametrize("op_name", ["ragged_paged_attention", "ragged_paged_mla_attention"])
def test_unchecked_cu_q_lens_read_the_same_on_every_path(op_name, path):
    """cu_q_lens past T, negative or out of order, under jax.jit (values not visible, so nothing
    refuses them) or handed to a kernel directly: every path gives the native body's answer for
    the clipped running max, not rows attending with a q_len of 5120 (the Pallas kernel's zeros)
    or one row in two sequences."""
    import jax

    op, (q, pages, kv_lens, table, _, num_seqs), options = _disordered_batch(op_name)
    if path == "triton":
        _skip_without_triton("cuda")
    extra = {"kv_lora_rank": 16} if op_name == "ragged_paged_mla_attention" and path in ("triton", "cpu") else {}
    for bad in DISORDERED_CU:
        bad = np.array(bad, np.int32)
        rule = np.maximum.accumulate(np.clip(bad, 0, q.shape[0])).astype(np.int32)
        want = _run(op, ("torch", None), [q, pages, kv_lens, table, rule, num_seqs], **options)
        arrays = [q, pages, kv_lens, table, bad, num_seqs]
        if path == "native-jit":
            got = jax.jit(lambda *a: op.forward_native(*a, **options))(*_on("jax", arrays))
        elif path == "pallas-jit":
            with override_platform("tpu"), set_config(OpsConfig(["all"])):
                got = jax.jit(lambda *a: op(*a, **options))(*_on("jax", arrays))
                assert op.last_run("jax", "tpu")[0] == "forward_tpu"
        elif path == "triton":
            got = _kernel_without_checks(op_name, path)(*_on("torch", arrays), **options, **extra)
        else:
            kernel = _kernel_without_checks(op_name, path)
            got = kernel(*_on("torch", arrays), **options, **extra)
        got = testing.to_numpy(got)
        assert testing.compare(got, want, "float32").ok, (bad.tolist(), np.abs(got - want).max())
