"""The Pallas ragged paged attention kernel against JAX's own ``ref_ragged_paged_attention``
(installed with jax; nobody here wrote it), in both Pallas interpreters: the generic one
(``interpret=True``) and the TPU one (simulated VMEM, DMAs and semaphores). Plus one real-compiler
build of a serving shape for v5e.

Interpreting costs a trace and an XLA compile per static configuration (several seconds each), so
each configuration below serves several batches of the same array shapes: the batches differ only
in the data (lengths, page tables), which the kernel reads at run time. Blocks are forced small
(``BlockSizes``) so a grid has several query blocks and a sequence several KV blocks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from dualop import testing
from dualop.kernels.pallas.common import compile_target, step_vmem_ceiling
from dualop.kernels.pallas.ragged_paged_attention import BlockSizes, choose_block_sizes, ragged_paged_attention

INTERPRETERS = {"generic": lambda: True, "tpu": lambda: pltpu.InterpretParams()}
# A bfloat16 output is a weighted sum of bfloat16-rounded probabilities (the reference rounds them
# too, in another order): its error scales with |v| (about 1 here), not with the output element.
TOLERANCE = {"float32": testing.TOLERANCES["float32"], "bfloat16": testing.Tolerance(atol=2e-2, rtol=1.6e-2)}

@dataclasses.dataclass(frozen=True)
class Layout:
    """The static part of a call: array shapes and dtype (one compile per interpreter)."""

    tokens: int
    max_seqs: int
    num_pages: int
    page_size: int
    pages_per_seq: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str

def make_batch(layout: Layout, q_lens, kv_lens, seed: int):
    """Inputs for sequences with these query and KV lengths (the first ``len(q_lens)`` of
    ``max_seqs`` slots; the rest hold junk the kernel must not read), pages in random order, the
    unused cache (tails of last pages, unreferenced pages) full of NaN, and rows past the last
    sequence left as padding."""
    rng = np.random.default_rng(seed)
    L = layout
    n = len(q_lens)
    assert sum(q_lens) <= L.tokens and n <= L.max_seqs
    q = rng.standard_normal((L.tokens, L.q_heads, L.head_dim), dtype=np.float32)
    kv = np.full((L.num_pages, L.page_size, 2 * L.kv_heads, L.head_dim), np.nan, np.float32)
    order = rng.permutation(L.num_pages)
    page_indices = rng.integers(0, L.num_pages, (L.max_seqs, L.pages_per_seq)).astype(np.int32)
    next_page = 0
    for i, kv_len in enumerate(kv_lens):
        used = -(-kv_len // L.page_size)
        pages = order[next_page: next_page + used]
        next_page += used
        page_indices[i, :used] = pages
        flat = rng.standard_normal((used * L.page_size, 2 * L.kv_heads, L.head_dim), dtype=np.float32)
        flat[kv_len:] = np.nan  # the last page's tail: never part of the sequence
        kv[pages] = flat.reshape(used, L.page_size, 2 * L.kv_heads, L.head_dim)
    assert next_page <= L.num_pages
    cu = np.zeros(L.max_seqs + 1, np.int32)
    cu[1: n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = cu[n]
    lens = np.zeros(L.max_seqs, np.int32)
    lens[:n] = kv_lens
    lens[n:] = L.pages_per_seq * L.page_size + 7  # junk past num_seqs
    dtype = jnp.dtype(L.dtype)
    return (jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.asarray(lens), jnp.asarray(page_indices),
            jnp.asarray(cu), jnp.asarray([n], jnp.int32))

def check_batch(inputs, interpreter: str, blocks: BlockSizes | None, **options):
    """The kernel's rows of real sequences equal the reference's; padding rows are zeros."""
    out = ragged_paged_attention(*inputs, interpret=INTERPRETERS[interpreter](), block_sizes=blocks, **options)
    ref = ref_ragged_paged_attention(*inputs, **options)
    q = inputs[0]
    rows = int(inputs[4][int(inputs[5][0])])
    out = np.asarray(out.astype(jnp.float32))
    assert out.shape == q.shape and not np.isnan(out).any()
    tol = TOLERANCE[str(q.dtype)]
    np.testing.assert_allclose(out[:rows], np.asarray(ref.astype(jnp.float32)), atol=tol.atol, rtol=tol.rtol)
    np.testing.assert_array_equal(out[rows:], 0.0)

# GQA 4, head dim 128, float32: every batch shape the serving loop produces, in one compile.
MIXED = Layout(tokens=40, max_seqs=6, num_pages=64, page_size=4, pages_per_seq=12, q_heads=8, kv_heads=2,
               head_dim=128, dtype="float32")
BATCHES = {
    "decode_only": ([1, 1, 1, 1, 1], [9, 1, 33, 16, 4]),
    "prefill_only": ([11, 6, 17], [11, 6, 17]),
    "chunked_prefill": ([13, 8], [40, 21]),  # second and later chunks: kv_len > q_len
    "mixed_with_empty": ([1, 0, 20, 1, 7, 1], [45, 3, 27, 2, 7, 48]),  # many pages; a q_len of 0
}

@pytest.mark.parametrize("interpreter", sorted(INTERPRETERS))
def test_mixed_batches(interpreter):
    for seed, (q_lens, kv_lens) in enumerate(BATCHES.values()):
        check_batch(make_batch(MIXED, q_lens, kv_lens, seed), interpreter, BlockSizes(8, 2), sm_scale=0.09)

@pytest.mark.parametrize("interpreter", sorted(INTERPRETERS))
def test_gqa8_head_dim_64_bfloat16_window_soft_cap_infinite_mask(interpreter):
    layout = Layout(tokens=32, max_seqs=4, num_pages=48, page_size=8, pages_per_seq=6, q_heads=8, kv_heads=1,
                    head_dim=64, dtype="bfloat16")
    inputs = make_batch(layout, [1, 14, 9], [30, 14, 41], seed=7)
    # mask_value -inf: the last rows see nothing in the first KV block visited (their window starts later)
    check_batch(inputs, interpreter, BlockSizes(16, 1), sm_scale=0.125, sliding_window=5, soft_cap=20.0,
                mask_value=-np.inf)

@pytest.mark.parametrize("interpreter", sorted(INTERPRETERS))
def test_no_gqa_head_dim_256_kv_scales_mask_value(interpreter):
    layout = Layout(tokens=24, max_seqs=3, num_pages=24, page_size=16, pages_per_seq=3, q_heads=2, kv_heads=2,
                    head_dim=256, dtype="float32")
    inputs = make_batch(layout, [5, 1, 12], [20, 47, 12], seed=11)
    check_batch(inputs, interpreter, BlockSizes(8, 2), sm_scale=0.0625, k_scale=0.5, v_scale=1.5,
                mask_value=-1e30)

def test_default_block_sizes():
    """No ``block_sizes``: the VMEM-budget choice, here one query block of all 40 rows and KV blocks
    of every page a sequence may have (the reference's work for this batch is already cached)."""
    assert choose_block_sizes(40, 8, 2, 128, 4, 12, jnp.float32, jnp.float32) == BlockSizes(40, 12)
    check_batch(make_batch(MIXED, *BATCHES["mixed_with_empty"], seed=3), "generic", None, sm_scale=0.09)


@pytest.mark.parametrize("generation", ["v4", "v5e", "tpu7x"])
def test_block_sizes_fit_the_generation_vmem(generation):
    """At a serving shape (32 query heads of 256, float32) the blocks shrink until the step's
    estimate fits what the chip's scoped limit can be raised to: v5e's 128 MiB takes the largest
    blocks, tpu7x's 64 MiB fewer rows, v4's 16 MiB fewer rows and positions."""
    def need(blocks):
        return blocks.vmem_bytes(q_heads=32, kv_heads=8, head_dim=256, page_size=16, q_dtype=jnp.float32,
                                 kv_dtype=jnp.float32)

    largest = BlockSizes(128, 256 // 16)
    with compile_target(generation):
        blocks = choose_block_sizes(2048, 32, 8, 256, 16, 128, jnp.float32, jnp.float32)
        ceiling = step_vmem_ceiling()
    assert need(blocks) <= ceiling
    if generation == "v5e":
        assert blocks == largest
    else:
        assert need(largest) > ceiling and blocks.block_q < 128 and blocks.block_q % 8 == 0
    if generation == "v4":
        assert blocks.block_q < 32 and blocks.pages_per_block < largest.pages_per_block


@pytest.mark.latest_only
def test_compiles_for_v5e_at_a_serving_shape():
    """The real TPU compiler (libtpu's compile-only v5e) accepts the kernel at a serving shape."""
    from dualop.aot.tpu import compile_function, quiet_native_stderr, tpu_available
    from dualop.aot.variants import InputSpec, servings

    missing = tpu_available()
    if missing is not None:
        pytest.skip(f"no TPU compiler in this environment: {missing}")
    serving = servings()["ragged_paged_attention"]
    shape = serving.shapes[0]
    inputs = serving.inputs["ragged_paged_attention[mixed,gqa2]"]
    specs = tuple(InputSpec(s.shape, s.dtype or "bfloat16") for s in inputs(shape))
    with quiet_native_stderr():
        result = compile_function(lambda *a: ragged_paged_attention(*a, sm_scale=0.088), specs, "v5e")
    assert result.status == "ok", result.message
    (kernel,) = result.kernels
    assert kernel["kernel"] == "dualop_ragged_paged_attention" and kernel["grid"][0] > 1
    # The cache stays in HBM (128 MiB here): only the blocks and scratch count as VMEM.
    assert 0 < kernel["vmem_bytes"] < 32 * 2**20
