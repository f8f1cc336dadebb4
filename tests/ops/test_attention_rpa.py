"""ragged_paged_attention: the native body (torch and jax) and the torch CPU path (C++) against JAX's
``ref_ragged_paged_attention`` (from the jax install; nobody here wrote it) on mixed batches; jit with
traced metadata; the clamp under jit; every bad input refused before any kernel launches.

The reference runs on the inputs upcast to float32: it rounds the softmax probabilities to the
value dtype before ``p . v``, where the op keeps float32 until its one cast. It returns only the
sequences' rows; the op's padding rows are checked to be zeros.

vmap is not meaningful for this op: a batch is already the ragged sequences of one call (a vmapped
axis would be a batch of page tables, which no caller has), so it is not tested.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import jax
import jax.numpy as jnp
import torch
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from dualop import OpsConfig, override_platform, set_config, testing
from dualop.ops import RaggedPagedAttention
from dualop.ops import attention
from dualop.ops.attention import paged_batch

# (q_lens, kv_lens) per layout
LAYOUTS = {
    "decode": ([1, 1, 1, 1], [5, 17, 1, 9]),
    "prefill": ([6, 3, 1], [6, 3, 1]),
    "chunked": ([4, 5], [13, 7]),
    "many_pages": ([2, 1], [61, 40]),
    "mixed": ([1, 3, 0, 1, 4], [9, 3, 6, 14, 11]),
}
GQA = {1: (4, 4), 4: (8, 2), 8: (8, 1)}  # group -> (Hq, Hkv)


def _batch(layout: str, group: int = 4, head_dim: int = 64, page_size: int = 4, seed: int = 0, pad_rows: int = 2):
    q_lens, kv_lens = LAYOUTS[layout]
    hq, hkv = GQA[group]
    rng = np.random.default_rng(seed)
    return paged_batch(rng, q_lens, kv_lens, num_tokens=sum(q_lens) + pad_rows, num_q_heads=hq, num_kv_heads=hkv,
                       head_dim=head_dim, page_size=page_size, max_seqs=len(q_lens) + 1)


def _on(frontend: str, arrays, dtype: str):
    return tuple(testing.to_frontend(a if a.dtype != np.int32 else testing.Pinned(a, "int32"), frontend, dtype)
                 for a in arrays)


_REFERENCES: dict[tuple, np.ndarray] = {}


def _reference(arrays, dtype: str, options: dict) -> np.ndarray:
    """JAX's reference on the float32 values of the inputs as the op sees them in ``dtype``
    (memoised: the torch and jax tests of one batch share it; it runs eagerly, slowly)."""
    key = (tuple(hashlib.sha256(a.tobytes()).hexdigest() + str(a.shape) for a in arrays), dtype,
           tuple(sorted(options.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = _run_reference(arrays, dtype, options)
    return _REFERENCES[key]


def _run_reference(arrays, dtype: str, options: dict) -> np.ndarray:
    rounded = [testing.to_numpy(testing.to_frontend(a, "jax", dtype)) if a.dtype == np.float32 else a for a in arrays]
    return np.asarray(ref_ragged_paged_attention(*(jnp.asarray(a) for a in rounded), **options))


def _assert_matches(got, arrays, dtype: str, options: dict) -> None:
    want = _reference(arrays, dtype, options)
    got = testing.to_numpy(got)
    rows = want.shape[0]
    cmp = testing.compare(got[:rows], want, dtype)
    assert cmp.ok, cmp
    assert not np.isnan(got).any()
    assert (got[rows:] == 0).all(), "padding rows must be zeros"


def _scale(head_dim: int) -> float:
    return head_dim ** -0.5


@pytest.mark.reference
@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_native_matches_jax_reference_on_layouts(layout, dtype, frontend):
    arrays = _batch(layout, group=4, head_dim=64)
    options = {"sm_scale": _scale(64)}
    got = RaggedPagedAttention().forward_native(*_on(frontend, arrays, dtype), **options)
    assert str(got.dtype).removeprefix("torch.") == dtype
    _assert_matches(got, arrays, dtype, options)


@pytest.mark.reference
@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("group, head_dim", [(1, 128), (4, 256), (8, 64), (8, 128)])
def test_native_matches_jax_reference_gqa_and_head_dims(group, head_dim, frontend):
    arrays = _batch("mixed", group=group, head_dim=head_dim, page_size=8)
    options = {"sm_scale": _scale(head_dim)}
    _assert_matches(RaggedPagedAttention().forward_native(*_on(frontend, arrays, "float32"), **options), arrays,
                    "float32", options)


OPTIONS = {
    "window": {"sliding_window": 4},
    "soft_cap": {"soft_cap": 2.5},
    "window_soft_cap": {"sliding_window": 3, "soft_cap": 5.0},
    "k_v_scale": {"k_scale": 0.25, "v_scale": 3.0},
    "mask_value": {"mask_value": -1e30},  # far below every score: adding or replacing agree
}


@pytest.mark.reference
@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_native_matches_jax_reference_with_options(name, dtype, frontend):
    arrays = _batch("mixed", group=4, head_dim=128, page_size=4, seed=3)
    options = {"sm_scale": 0.3, **OPTIONS[name]}  # large scores, so the soft cap bites
    got = RaggedPagedAttention().forward_native(*_on(frontend, arrays, dtype), **options)
    _assert_matches(got, arrays, dtype, options)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout, group, options", [
    ("decode", 8, {}),
    ("mixed", 4, {}),
    ("mixed", 1, {"sliding_window": 4}),
    ("chunked", 4, {"soft_cap": 2.5}),
    ("many_pages", 8, {"k_scale": 0.5, "v_scale": 2.0}),
    ("mixed", 4, {"mask_value": -50.0}),  # a mask value not effectively -inf: masked keys are visited
    ("decode", 4, {"mask_value": 0.5}),  # near the scores: positions past a kv_len still never count
    ("mixed", 4, {"mask_value": 0.5}),  # near the scores: causally masked positions take it
])
def test_torch_cpu_path_matches_reference_and_native(layout, group, options, dtype):
    arrays = _batch(layout, group=group, head_dim=64)
    options = {"sm_scale": 0.3, **options}
    args = _on("torch", arrays, dtype)
    op = RaggedPagedAttention()
    with override_platform("cpu"), set_config(OpsConfig(["all"])):
        got = op(*args, **options)
        assert op.last_run("torch")[0] == "forward_cpu"
    want = op.forward_native(*args, **options)
    cmp = testing.compare(testing.to_numpy(got), testing.to_numpy(want), dtype)
    assert cmp.ok, cmp
    if "mask_value" not in options:  # JAX's reference adds the mask value; the op replaces scores by it
        _assert_matches(got, arrays, dtype, options)


# decode contexts: 1 position, ends mid-page (pages of 16 and 32), mid-block (the C++ kernel's blocks
# of 16 positions), on a page boundary, and several pages long
DECODE_KV_LENS = [1, 7, 23, 37, 48, 100, 261]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_torch_cpu_decode_matches_native(head_dim, group, page_size, dtype):
    """The C++ kernel's decode path (query vectors in chunks of 4, 2 and 1 per KV head, head dims
    read 32 elements at a time with a masked tail) against the native body."""
    hkv = 2 if group < 8 else 1
    rng = np.random.default_rng(head_dim * 100 + group * 10 + page_size)
    arrays = paged_batch(rng, [1] * len(DECODE_KV_LENS), DECODE_KV_LENS, num_tokens=len(DECODE_KV_LENS) + 1,
                         num_q_heads=hkv * group, num_kv_heads=hkv, head_dim=head_dim, page_size=page_size,
                         max_seqs=len(DECODE_KV_LENS) + 1)
    args = _on("torch", arrays, dtype)
    options = {"sm_scale": _scale(head_dim)}
    op = RaggedPagedAttention()
    with override_platform("cpu"), set_config(OpsConfig(["all"])):
        got = op(*args, **options)
        assert op.last_run("torch")[0] == "forward_cpu"
    want = op.forward_native(*args, **options)
    cmp = testing.compare(testing.to_numpy(got), testing.to_numpy(want), dtype)
    assert cmp.ok, cmp
    assert (testing.to_numpy(got)[len(DECODE_KV_LENS):] == 0).all()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("q_lens, kv_lens", [([1], [300]), ([1, 1], [45, 300]), ([3, 1, 9], [40, 77, 9])])
def test_torch_cpu_few_sequences_across_threads(q_lens, kv_lens, threads):
    """Few sequences for the threads: the C++ kernel splits a sequence's KV heads across tasks (and
    prefill rows take chunks of 3 query vectors: 2 + 1); the result does not depend on it."""
    rng = np.random.default_rng(sum(kv_lens))
    arrays = paged_batch(rng, q_lens, kv_lens, num_tokens=sum(q_lens) + 2, num_q_heads=12, num_kv_heads=4,
                         head_dim=128, page_size=16, max_seqs=len(q_lens) + 1)
    args = _on("torch", arrays, "bfloat16")
    options = {"sm_scale": 0.1, "sliding_window": 64}
    op = RaggedPagedAttention()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with override_platform("cpu"), set_config(OpsConfig(["all"])):
            got = op(*args, **options)
            assert op.last_run("torch")[0] == "forward_cpu"
    finally:
        torch.set_num_threads(before)
    cmp = testing.compare(testing.to_numpy(got), testing.to_numpy(op.forward_native(*args, **options)), "bfloat16")
    assert cmp.ok, cmp


def test_torch_cpu_path_steps_aside_while_autograd_records():
    args = list(_on("torch", _batch("mixed"), "float32"))
    args[0].requires_grad_()
    op = RaggedPagedAttention()
    with override_platform("cpu"), set_config(OpsConfig(["all"])):
        op.last_fallback = None
        op(*args).sum().backward()
        method, reason = op.last_run("torch")
    assert method == "forward_native" and "autograd is recording" in reason
    assert args[0].grad is not None and torch.isfinite(args[0].grad).all()


def test_jit_with_traced_metadata_compiles_once():
    """Metadata is traced: other sequence layouts of the same shapes reuse the compiled program."""
    op = RaggedPagedAttention()
    fn = jax.jit(lambda *a: op(*a, sm_scale=0.125))
    for seed, (q_lens, kv_lens) in enumerate([([1, 3, 0, 1, 4], [9, 3, 6, 14, 11]), ([4, 1, 1, 2, 1], [4, 20, 2, 9, 1]),
                                              ([1, 1], [3, 7])]):
        arrays = paged_batch(np.random.default_rng(seed), q_lens, kv_lens, num_tokens=12, num_q_heads=8,
                             num_kv_heads=2, head_dim=64, page_size=4, max_seqs=6)
        # the same array shapes every time: pad the page table and pages to one size
        arrays = _pad_to(arrays, num_pages=40, pages_per_seq=6)
        got = fn(*(jnp.asarray(a) for a in arrays))
        _assert_matches(got, arrays, "float32", {"sm_scale": 0.125})
    assert fn._cache_size() == 1


def _pad_to(arrays, num_pages: int, pages_per_seq: int):
    q, kv_pages, kv_lens, page_indices, cu, num_seqs = arrays
    pages = np.zeros((num_pages, *kv_pages.shape[1:]), np.float32)
    pages[: kv_pages.shape[0]] = kv_pages
    table = np.zeros((page_indices.shape[0], pages_per_seq), np.int32)
    table[:, : page_indices.shape[1]] = page_indices
    return q, pages, kv_lens, table, cu, num_seqs


def test_bad_metadata_under_jit_is_clamped_not_a_fault():
    """Under jit the values are not visible: out-of-range metadata gives finite numbers (the clamp
    the module docstring documents), never an error or NaN."""
    q, kv_pages, kv_lens, page_indices, cu, num_seqs = _batch("mixed")
    bad = (q, kv_pages, kv_lens * 100, page_indices + 1000, cu[::-1].copy(), num_seqs + 50)
    out = jax.jit(lambda *a: RaggedPagedAttention()(*a))(*(jnp.asarray(a) for a in bad))
    assert np.isfinite(np.asarray(out)).all()


def test_jax_on_gpu_declines_with_its_reason():
    op = RaggedPagedAttention()
    assert "jax-triton" in op.passes_over("forward_cuda", "jax")
    assert "dot_product_attention" in op.passes_over("forward_cuda", "jax")
    assert op.passes_over("forward_cuda", "torch") is None
    assert op.passes_over("forward_cpu", "torch") is None and op.passes_over("forward_cpu", "jax") is not None


# --- bad input: refused before any kernel launches ---------------------------------------------------


def _edit(name: str):
    """A mutation of a good batch's numpy arrays (index: q 0, kv_pages 1, kv_lens 2, page_indices 3,
    cu_q_lens 4, num_seqs 5) and the words the error must contain."""

    def set_value(i, fn):
        def edit(arrays):
            arrays = [a.copy() for a in arrays]
            arrays[i] = fn(arrays[i])
            return arrays

        return edit

    def item(i, index, value):
        def fn(a):
            a[index] = value
            return a

        return set_value(i, fn)

    return {
        "q_2d": (set_value(0, lambda a: a[:, 0]), ValueError, "'q'"),
        "head_dim": (set_value(1, lambda a: a[..., :32]), ValueError, "head dim"),
        "odd_combined_heads": (set_value(1, lambda a: a[:, :, :3]), ValueError, "combined"),
        "heads_not_divisible": (set_value(0, lambda a: np.concatenate([a, a[:, :1]], axis=1)), ValueError,
                                "num_q_heads % num_kv_heads"),
        "kv_pages_3d": (set_value(1, lambda a: a[:, 0]), ValueError, "'kv_pages'"),
        "kv_lens_float": (set_value(2, lambda a: a.astype(np.float32)), TypeError, "'kv_lens'"),
        "kv_lens_shape": (set_value(2, lambda a: a[:-1]), ValueError, "'kv_lens'"),
        "cu_q_lens_length": (set_value(4, lambda a: a[:-1]), ValueError, "'cu_q_lens'"),
        "num_seqs_shape": (set_value(5, lambda a: np.array([1, 1], np.int32)), ValueError, "'num_seqs'"),
        "cu_q_lens_decreasing": (item(4, 2, 0), ValueError, "not non-decreasing"),
        "cu_q_lens_start": (item(4, 0, 1), ValueError, "starts at 1"),
        "cu_q_lens_past_rows": (set_value(4, lambda a: a * 10), ValueError, "q's rows"),
        "num_seqs_too_many": (item(5, 0, 99), ValueError, "'num_seqs'"),
        "num_seqs_negative": (item(5, 0, -1), ValueError, "'num_seqs'"),
        "kv_len_below_q_len": (item(2, 1, 2), ValueError, "kv_len >= q_len"),
        "kv_len_zero_with_queries": (item(2, 0, 0), ValueError, "kv_len >= q_len"),
        "kv_len_past_pages": (item(2, 0, 10_000), ValueError, "pages_per_seq * page_size"),
        "page_out_of_range": (item(3, (1, 0), 10_000), ValueError, "'page_indices'"),
        "page_negative": (item(3, (0, 0), -1), ValueError, "'page_indices'"),
    }[name]


BAD = ["q_2d", "head_dim", "odd_combined_heads", "heads_not_divisible", "kv_pages_3d", "kv_lens_float",
       "kv_lens_shape", "cu_q_lens_length", "num_seqs_shape", "cu_q_lens_decreasing", "cu_q_lens_start",
       "cu_q_lens_past_rows", "num_seqs_too_many", "num_seqs_negative", "kv_len_below_q_len",
       "kv_len_zero_with_queries", "kv_len_past_pages", "page_out_of_range", "page_negative"]


def _to(frontend: str, arrays):
    """numpy -> frontend arrays, keeping each array's own dtype (the bad ones included)."""
    if frontend == "jax":
        return [jnp.asarray(a) for a in arrays]
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


@pytest.fixture
def no_kernels(monkeypatch):
    monkeypatch.setattr(attention, "_PALLAS_RPA", testing.NoLaunch())
    monkeypatch.setattr(attention, "_TRITON_RPA", testing.NoLaunch())
    monkeypatch.setattr(attention, "_CPU_RPA", testing.NoLaunch())


@pytest.mark.parametrize("frontend, platform", [("torch", "cpu"), ("torch", "cuda"), ("jax", "tpu")])
@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_refused_before_launch(name, frontend, platform, no_kernels):
    edit, error, words = _edit(name)
    args = _to(frontend, edit(list(_batch("mixed", group=4))))
    with override_platform(platform), set_config(OpsConfig(["all"])):
        with pytest.raises(error, match="ragged_paged_attention") as info:
            RaggedPagedAttention()(*args, sm_scale=0.1)
    assert words in str(info.value), str(info.value)


def test_metadata_checked_once_is_checked_again_after_an_in_place_write():
    """The value checks remember the metadata they last passed (a model's layers share one step's
    metadata); an in-place write to it (torch's version counter) or new arrays are read again."""
    args = _to("torch", list(_batch("mixed", group=4)))
    op = RaggedPagedAttention()
    with override_platform("cpu"), set_config(OpsConfig(["all"])):
        op(*args, sm_scale=0.1)
        op(*args, sm_scale=0.1)  # the same arrays: passes without reading them again
        kv_lens = args[2]
        kv_lens[0] = 10 ** 6  # past the page table's span
        with pytest.raises(ValueError, match="argument 'kv_lens' has kv_lens\\[0\\] = 1000000"):
            op(*args, sm_scale=0.1)
        with torch.inference_mode():  # made in inference mode (no version counter): never remembered
            fresh = [a.clone() for a in _to("torch", list(_batch("mixed", group=4)))]
            op(*fresh, sm_scale=0.1)
            fresh[2][0] = 10 ** 6
            with pytest.raises(ValueError, match="kv_lens\\[0\\] = 1000000"):
                op(*fresh, sm_scale=0.1)


@pytest.mark.parametrize("options, words", [
    ({"sliding_window": 0}, "'sliding_window'"),
    ({"sliding_window": 2.5}, "'sliding_window'"),
    ({"soft_cap": 0.0}, "'soft_cap'"),
    ({"soft_cap": float("nan")}, "'soft_cap'"),
    ({"sm_scale": None}, "'sm_scale'"),
    ({"sm_scale": "0.1"}, "'sm_scale'"),
    ({"k_scale": True}, "'k_scale'"),
    ({"mask_value": "low"}, "'mask_value'"),
])
def test_bad_options_are_refused(options, words, no_kernels):
    args = _to("torch", _batch("mixed"))
    with pytest.raises(ValueError, match="ragged_paged_attention") as info:
        RaggedPagedAttention()(*args, **options)
    assert words in str(info.value)


def test_wrong_kinds_are_type_errors(no_kernels):
    q, kv_pages, *meta = _to("torch", _batch("mixed"))
    op = RaggedPagedAttention()
    with pytest.raises(TypeError, match="'kv_pages'.*dtype"):
        op(q, kv_pages.to(torch.bfloat16), *meta)
    with pytest.raises(TypeError, match="'q' has dtype int32"):
        op(q.to(torch.int32), kv_pages, *meta)
    with pytest.raises(TypeError, match="'page_indices' is a jax array"):
        op(q, kv_pages, meta[0], jnp.asarray(meta[1].numpy()), *meta[2:])
    with pytest.raises(TypeError, match="'num_seqs' is required"):
        op(q, kv_pages, *meta[:3])


def test_under_jit_only_static_checks_run():
    """Traced metadata cannot be read, so only shapes/dtypes are refused under jit; a bad value
    passes the checks (and the kernels clamp it; see test_bad_metadata_under_jit_is_clamped...)."""
    arrays = _batch("mixed")
    op = RaggedPagedAttention()
    bad_shape = list(arrays)
    bad_shape[2] = bad_shape[2][:-1]
    with pytest.raises(ValueError, match="'kv_lens'"):
        jax.jit(lambda *a: op(*a))(*(jnp.asarray(a) for a in bad_shape))
    jax.jit(lambda *a: op(*a))(*(jnp.asarray(a) for a in _edit("cu_q_lens_decreasing")[0](list(arrays))))


def test_cpu_kernel_clamps_metadata_it_is_not_given_validated():
    """The C++ kernel, called past the op's checks with out-of-range metadata, reads nothing out of
    bounds (it clamps, as the module docstring says) and writes finite values."""
    from dualop.kernels.cpu.ragged_paged_attention import ragged_paged_attention as cpu_kernel

    q, kv_pages, kv_lens, page_indices, cu, num_seqs = _to("torch", _batch("mixed"))
    bad = [(kv_lens * 1000, page_indices, cu, num_seqs), (kv_lens, page_indices * 0 + 10**6, cu, num_seqs),
           (kv_lens, page_indices * 0 - 7, cu, num_seqs), (kv_lens, page_indices, cu.flip(0), num_seqs),
           (kv_lens, page_indices, cu, num_seqs + 100)]
    for meta in bad:
        out = cpu_kernel(q, kv_pages, *meta, sm_scale=0.1)
        assert torch.isfinite(out).all()
