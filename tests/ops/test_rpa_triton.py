"""The Triton ragged paged attention kernel (``kernels/cuda/ragged_paged_attention.py``) against JAX's
``ref_ragged_paged_attention`` (shipped with jax; nobody here wrote it), run in Triton's CPU
interpreter on mixed batches: decode-only, prefill-only, chunked prefill, sequences over many pages,
page tables in random order, GQA groups 1/4/8 (and 3), head dims 64/128/256 (and 80), sliding
window, soft cap, k/v scales, bfloat16, float16 and float32; padding rows are zeros, out-of-range integers are
clamped as documented, and launches on meta tensors are captured for ``dualop compile``.
Shapes are small: the interpreter runs every program in numpy."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import jax  # noqa: E402  (both test environments have jax: a broken install fails here)
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from dualop.kernels.cuda import ragged_paged_attention as rpa_mod
from dualop.kernels.cuda.ragged_paged_attention import ragged_paged_attention

jnp = jax.numpy

# Kernel vs JAX's reference. float32: both compute exact float32 products (the kernel's dots are
# "ieee"), in different orders. bfloat16: both round p to bfloat16 before p.v, but the kernel
# normalises after the product and JAX before, so outputs differ by a few bfloat16 ulps.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=3e-3, rtol=3e-3)}
_JAX_DTYPES = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}


@dataclasses.dataclass
class Batch:
    """One call's arrays as numpy (float32 values exactly representable in ``dtype``)."""

    q: np.ndarray
    kv_pages: np.ndarray
    kv_lens: np.ndarray
    page_indices: np.ndarray
    cu_q_lens: np.ndarray
    num_seqs: np.ndarray
    dtype: torch.dtype

    @property
    def arrays(self):
        return self.q, self.kv_pages, self.kv_lens, self.page_indices, self.cu_q_lens, self.num_seqs

    @property
    def owned_rows(self) -> int:
        return int(self.cu_q_lens[int(self.num_seqs[0])])


def _in_dtype(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float32 ``x`` rounded to ``dtype`` (torch's round to nearest even), back in float32."""
    return torch.from_numpy(x).to(dtype).to(torch.float32).numpy()


def make_batch(q_lens, kv_lens, *, hq, hkv, d, page_size, dtype=torch.float32, pages_per_seq=None,
               pad_tokens=0, pad_seqs=0, seed=0) -> Batch:
    """A batch whose sequence i has ``q_lens[i]`` queries and ``kv_lens[i]`` KV positions, each
    sequence's pages drawn from a shuffled pool (random page order), K/V heads interleaved.
    ``pad_tokens`` query rows and ``pad_seqs`` table rows past ``num_seqs`` hold junk."""
    rng = np.random.default_rng(seed)
    n = len(q_lens)
    need = max(-(-k // page_size) for k in kv_lens)
    pages_per_seq = pages_per_seq or need
    seqs = n + pad_seqs
    num_pages = seqs * pages_per_seq + 3
    t = sum(q_lens) + pad_tokens
    q = _in_dtype(rng.standard_normal((t, hq, d)).astype(np.float32), dtype)
    kv = _in_dtype(rng.standard_normal((num_pages, page_size, 2 * hkv, d)).astype(np.float32), dtype)
    page_indices = rng.permutation(num_pages)[: seqs * pages_per_seq].reshape(seqs, pages_per_seq).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    junk_cu = rng.integers(0, t + 1, size=pad_seqs).astype(np.int32)
    junk_kv = rng.integers(1, pages_per_seq * page_size + 1, size=pad_seqs).astype(np.int32)
    return Batch(q, kv, np.concatenate([np.asarray(kv_lens, np.int32), junk_kv]), page_indices,
                 np.concatenate([cu, junk_cu]), np.array([n], np.int32), dtype)


def run_kernel(batch: Batch, **options) -> np.ndarray:
    q, kv, *ints = batch.arrays
    out = ragged_paged_attention(torch.from_numpy(q).to(batch.dtype), torch.from_numpy(kv).to(batch.dtype),
                                 *(torch.from_numpy(a) for a in ints), **options)
    assert out.dtype == batch.dtype and out.shape == q.shape
    return out.to(torch.float32).numpy()


def run_reference(batch: Batch, **options) -> np.ndarray:
    """JAX's reference under one ``jit``: the lengths stay concrete numpy values (its Python loop
    and slices need them), so XLA compiles one program per batch instead of every eager op per
    sequence shape (about 20 s per batch on this machine)."""
    jdtype = _JAX_DTYPES[batch.dtype]

    def reference(q, kv_pages, page_indices):
        return ref_ragged_paged_attention(q, kv_pages, batch.kv_lens, page_indices, batch.cu_q_lens,
                                          batch.num_seqs, **options)

    out = jax.jit(reference)(jnp.asarray(batch.q, jdtype), jnp.asarray(batch.kv_pages, jdtype),
                             jnp.asarray(batch.page_indices))
    return np.asarray(out.astype(jnp.float32))


def check_against_reference(batch: Batch, **options) -> np.ndarray:
    got = run_kernel(batch, **options)
    want = run_reference(batch, **options)
    rows = batch.owned_rows
    assert want.shape[0] == rows
    np.testing.assert_allclose(got[:rows], want, **TOL[batch.dtype])
    assert np.all(got[rows:] == 0.0), "rows no sequence owns must be zeros"
    assert np.isfinite(got).all()
    return got


# (q_lens, kv_lens, hq, hkv, d, page_size, dtype, options)
CASES = {
    "decode_only_gqa4_d128": ([1, 1, 1, 1], [5, 17, 32, 1], 8, 2, 128, 8, torch.float32, {}),
    "prefill_only_gqa1_d64_bf16": ([7, 16, 3], [7, 16, 3], 2, 2, 64, 8, torch.bfloat16, {}),
    "chunked_prefill_gqa8": ([1, 12, 5, 0, 2], [20, 30, 5, 9, 2], 8, 1, 64, 8, torch.float32, {"sm_scale": 0.125}),
    "many_pages_random_order_bf16": ([9, 2], [37, 3], 8, 2, 64, 4, torch.bfloat16, {"sm_scale": 0.125}),
    "head_dim_256": ([1, 6], [11, 6], 2, 2, 256, 8, torch.float32, {"sm_scale": 0.0625}),
    "head_dim_80_group3": ([4, 1], [9, 13], 6, 2, 80, 8, torch.float32, {"sm_scale": 0.1}),
    "sliding_window": ([1, 10, 3], [25, 18, 7], 4, 2, 64, 4, torch.float32, {"sliding_window": 5}),
    "sliding_window_bf16": ([6, 1], [30, 9], 4, 1, 64, 8, torch.bfloat16, {"sliding_window": 8, "sm_scale": 0.125}),
    "soft_cap_bf16": ([5, 1], [12, 20], 4, 1, 128, 8, torch.bfloat16, {"soft_cap": 2.0, "sm_scale": 0.5}),
    "soft_cap_f32": ([3, 2], [3, 15], 2, 1, 64, 8, torch.float32, {"soft_cap": 1.5}),
    "kv_scales_f32": ([4, 1], [10, 7], 4, 2, 64, 8, torch.float32, {"k_scale": 0.5, "v_scale": 1.75, "sm_scale": 0.2}),
    "kv_scales_bf16": ([3, 2], [8, 14], 4, 1, 64, 8, torch.bfloat16, {"k_scale": 0.3, "v_scale": 2.5}),
    "mixed_f16": ([1, 5], [9, 12], 4, 2, 64, 8, torch.float16, {"sm_scale": 0.125, "sliding_window": 7}),
    "everything_gqa4_bf16": ([1, 7, 2], [19, 7, 26], 8, 2, 128, 4, torch.bfloat16,
                             {"sliding_window": 6, "soft_cap": 3.0, "k_scale": 0.75, "v_scale": 1.25, "sm_scale": 0.1,
                              "mask_value": -1e30}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_jax_reference(name):
    q_lens, kv_lens, hq, hkv, d, page_size, dtype, options = CASES[name]
    batch = make_batch(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page_size=page_size, dtype=dtype,
                       seed=len(name))
    check_against_reference(batch, **options)


@pytest.mark.latest_only
def test_the_compiled_runtime_bounded_kv_loop_matches(monkeypatch):
    """GPUs run the KV loop over exactly the reachable tiles (runtime bounds); Triton 3.9's
    interpreter can run that loop too, so the compiled branch is checked here as well."""
    import triton

    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"triton {triton.__version__}'s interpreter cannot loop to a runtime bound under numpy 2 "
                    "(the latest environment's 3.9 runs this)")
    monkeypatch.setattr(rpa_mod, "runtime_kv_loop", lambda: True)
    batch = make_batch([1, 9, 4], [30, 21, 4], hq=4, hkv=2, d=64, page_size=4, pad_tokens=2, seed=13)
    check_against_reference(batch, sliding_window=6, sm_scale=0.125)


def test_padding_rows_and_sequences_past_num_seqs_are_ignored():
    """Query rows past cu_q_lens[num_seqs] and table rows past num_seqs hold junk (junk kv_lens,
    cu_q_lens, page ids): the owned rows still match and the rest are exact zeros, never NaN."""
    batch = make_batch([3, 1, 4], [3, 9, 12], hq=4, hkv=2, d=64, page_size=4, pad_tokens=5, pad_seqs=2,
                       pages_per_seq=4, seed=7)
    batch.q[batch.owned_rows:] = np.nan  # padding queries are never read into an owned row
    got = check_against_reference(batch, sm_scale=0.125)
    assert got.shape[0] == batch.owned_rows + 5


def test_zero_sequences_and_empty_queries_give_zeros():
    batch = make_batch([2, 3], [4, 5], hq=2, hkv=1, d=64, page_size=4, seed=3)
    batch.num_seqs[0] = 0
    assert np.all(run_kernel(batch) == 0.0)
    empty = make_batch([0, 0], [4, 5], hq=2, hkv=1, d=64, page_size=4, pad_tokens=3, seed=3)
    assert np.all(run_kernel(empty) == 0.0)


def test_padding_heads_and_rows_of_a_block_do_not_leak():
    """Many short sequences share the grid's block arithmetic (BLOCK_Q > q_len everywhere)."""
    q_lens = [1, 2, 1, 3, 1, 1, 2, 1]
    batch = make_batch(q_lens, [2, 5, 1, 3, 7, 4, 2, 6], hq=4, hkv=4, d=64, page_size=2, pad_tokens=2, seed=11)
    check_against_reference(batch, sm_scale=0.3)


def test_strided_query_is_read_through_its_strides():
    batch = make_batch([3, 2], [6, 9], hq=4, hkv=2, d=64, page_size=4, seed=5)
    wide = torch.zeros((batch.q.shape[0], batch.q.shape[1], 2 * batch.q.shape[2]))
    wide[..., ::2] = torch.from_numpy(batch.q)
    strided = wide[..., ::2]
    assert not strided.is_contiguous()
    q, kv, *ints = batch.arrays
    got = ragged_paged_attention(strided, torch.from_numpy(kv), *(torch.from_numpy(a) for a in ints))
    np.testing.assert_allclose(got.numpy()[: batch.owned_rows], run_reference(batch), **TOL[torch.float32])


def test_out_of_range_integers_are_clamped_as_documented():
    """The kernel never reads out of bounds: page ids clamp to [0, num_pages-1], kv_lens to
    [0, pages_per_seq * page_size], num_seqs to [0, S], cu_q_lens to [0, T]. Each junk value gives
    exactly the result of its clamped value."""
    batch = make_batch([2, 3], [5, 8], hq=2, hkv=1, d=64, page_size=4, seed=9)
    num_pages = batch.kv_pages.shape[0]
    junk = dataclasses.replace(batch, page_indices=batch.page_indices.copy(), kv_lens=batch.kv_lens.copy(),
                               num_seqs=np.array([7], np.int32), cu_q_lens=batch.cu_q_lens.copy())
    clamped = dataclasses.replace(batch, page_indices=batch.page_indices.copy(), kv_lens=batch.kv_lens.copy(),
                                  cu_q_lens=batch.cu_q_lens.copy())
    junk.page_indices[0, 0], clamped.page_indices[0, 0] = 10**6, num_pages - 1
    junk.page_indices[1, 1], clamped.page_indices[1, 1] = -50, 0
    junk.kv_lens[1] = 10**4
    clamped.kv_lens[1] = batch.page_indices.shape[1] * 4
    junk.cu_q_lens[2] = 10**5
    clamped.cu_q_lens[2] = batch.q.shape[0]
    np.testing.assert_array_equal(run_kernel(junk), run_kernel(clamped))
    assert np.isfinite(run_kernel(junk)).all()


@pytest.mark.parametrize("tokens,seqs,group,d,want", [
    (64, 8, 1, 128, (64, 64, 8)), (8, 8, 1, 128, (16, 64, 4)), (64, 8, 8, 128, (8, 64, 8)),
    (64, 8, 4, 256, (8, 32, 8)), (8, 8, 16, 64, (1, 64, 4)),
])
def test_block_shape(tokens, seqs, group, d, want):
    assert rpa_mod.block_shape(tokens, seqs, group, d, 2) == want


# Compiled mode needs its own process (the interpreter is chosen when kernels are defined).
_COMPILE_PROBE = """
import json, sys
import torch
from dualop.aot import gpu
from dualop.kernels import cuda
from dualop.kernels.cuda import ragged_paged_attention as rpa

def meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")

# serving shapes: 2048 tokens of 256 sequences, 2048 pages of 16, 32 query / 8 KV heads, head dim 128
t, s, hq, hkv, d = 2048, 256, 32, 8, 128
out = {}
for name in sys.argv[1:]:
    # every option on: the superset of the kernel's code paths
    for label, options in (("all", dict(sliding_window=128, soft_cap=30.0, k_scale=0.5, v_scale=0.5)),):
        with cuda.compile_target(cuda.GPU_TARGETS[name]), gpu.capture_launches() as launches:
            o = rpa.ragged_paged_attention(
                meta((t, hq, d), torch.bfloat16), meta((2048, 16, 2 * hkv, d), torch.bfloat16),
                meta((s,), torch.int32), meta((s, 128), torch.int32), meta((s + 1,), torch.int32),
                meta((1,), torch.int32), sm_scale=d ** -0.5, **options)
        assert o.device.type == "meta" and tuple(o.shape) == (t, hq, d)
        (launch,) = launches
        details, error = gpu.compile_launch(launch, cuda.GPU_TARGETS[name])
        out[name + "/" + label] = {"grid": list(launch.grid), "runtime_loop": launch.kwargs["RUNTIME_LOOP"],
                                   "details": details, "error": error}
print(json.dumps(out, default=str))
"""


@pytest.mark.latest_only
def test_serving_launch_on_meta_tensors_compiles_for_sm80_sm90_gfx942(tmp_path):
    """Inside ``compile_target`` the wrapper takes meta tensors (``dualop compile``): the grid comes
    from shapes only, (T // BLOCK_Q + S, Hkv), nothing reads a value, the KV loop has runtime
    bounds, and Triton compiles the launch for each GPU target."""
    import triton

    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"dualop compile's launch specialisation follows triton 3.9 (installed: {triton.__version__}; "
                    "the latest environment has 3.9)")
    from dualop.aot.gpu import child_environment

    script = tmp_path / "rpa_probe.py"
    script.write_text(_COMPILE_PROBE)
    env = child_environment(str(tmp_path / "triton-cache"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    targets = ("sm80", "sm90", "gfx942")
    proc = subprocess.run([sys.executable, str(script), *targets], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    block_q, _, _ = rpa_mod.block_shape(2048, 256, 4, 128, 2)
    for name in targets:
        result = out[f"{name}/all"]
        assert result["error"] is None, (name, result)
        assert result["grid"] == [2048 // block_q + 256, 8]
        assert result["runtime_loop"] is True
        assert result["details"]["registers"] > 0
