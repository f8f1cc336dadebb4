"""The Pallas quantized GEMM (interpreted here) against the linear ops' reference ``_native_gemm``
for every scheme it takes, in float32 and bfloat16: several K steps and ragged output blocks
(tiles forced small), partial scale blocks (N, K off the block sizes), a packed K off whole words,
AWQ words along N, token counts 0, 1, 5 and a ragged token block, 3-D x and a bias; bfloat16
outputs near zero elementwise (the interpreter runs the TPU's bfloat16 operands, so a weight
rounded to bfloat16 before its products fails there); fp8 W8A8 on fp8 operands (tpu7x's MXU);
the W8A8 activation codes bit for bit the native quantisation; what ``supports`` declines; the
tiles chosen per TPU generation; and real-compiler builds (libtpu's compile-only v5e and tpu7x) at
a serving shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dualop import testing
from dualop.kernels import quant_math
from dualop.kernels.pallas.common import compile_target, interpret_mode
from dualop.kernels.pallas.quantized_matmul import (
    MatmulBlocks,
    _quantize_x,
    _step_vmem,
    _plan,
    matmul_blocks,
    quantized_matmul,
    supports,
)
from dualop.ops.linear import _native_gemm
from dualop.ops.quantization import GroupShape, quantize_fp8_native
from dualop.ops.quantized_weight import QuantizedWeight, WeightQuant, quantize_activations


def _weight(quant: WeightQuant, n: int, k: int, seed: int) -> QuantizedWeight:
    """Random codes over their whole range, scales keeping ``x @ W.T`` near unit size (AWQ's in
    float16, as its checkpoints ship them), zero points and a static input scale where the scheme
    has them."""
    rng = np.random.default_rng(seed)
    awq = quant.layout == "awq"
    if quant.codes == "fp8":  # small integers times powers of two: exact in e4m3
        values = rng.integers(-16, 17, (n, k)) * 2.0 ** rng.integers(-3, 5, (n, k))
        codes = jnp.asarray(values.astype(np.float32)).astype(jnp.float8_e4m3fn)
    elif quant.codes == "int8":
        codes = jnp.asarray(rng.integers(-128, 128, (n, k)).astype(np.int8))
    elif awq:
        codes = jnp.asarray(quant_math.pack_int32(rng.integers(0, 16, (k, n)), 4, 1, quant_math.AWQ_NIBBLE_OF))
    else:
        codes = jnp.asarray(quant_math.pack_int32(rng.integers(0, 16, (n, k)), 4, 1))
    unit = 1.0 / np.sqrt(k) / (4 if quant.codes == "int4" else 64)
    scale = rng.uniform(0.5 * unit, 1.5 * unit, quant.scale_shape(n, k)).astype(np.float16 if awq else np.float32)
    zero = None
    if not quant.symmetric:
        unsigned = rng.integers(0, 16, quant.scale_shape(n, k))
        zero = jnp.asarray(quant_math.pack_int32(unsigned, 4, 1, quant_math.AWQ_NIBBLE_OF) if awq
                           else quant_math.pack_int32(unsigned, 4, 0))
    input_scale = jnp.asarray([0.02], jnp.float32) if quant.activations == "static" else None
    return QuantizedWeight(quant, codes, jnp.asarray(scale), zero, input_scale, shape=(n, k))


def _check(quant, n, k, x_shape, dtype, blocks=None, bias=True, seed=0, normwise=True, fp8_mxu=None):
    weight = _weight(quant, n, k, seed)
    rng = np.random.default_rng(seed + 1)
    x = jnp.asarray(rng.normal(0, 1, (*x_shape, k)).astype(np.float32)).astype(dtype)
    b = jnp.asarray(rng.normal(0, 1, (n,)).astype(np.float32)).astype(dtype) if bias else None
    got = quantized_matmul(x, weight.codes, weight.scale, weight.zero_point, weight.input_scale, b, quant=quant, n=n,
                           k=k, interpret=interpret_mode("jax"), blocks=blocks, fp8_mxu=fp8_mxu)
    want = _native_gemm(x, weight, b)
    assert got.shape == want.shape == (*x_shape, n) and got.dtype == x.dtype
    # sums of K products in another order: within the table relative to the largest output
    result = testing.compare(np.asarray(got, np.float32), np.asarray(want, np.float32), dtype, normwise=normwise)
    assert result.ok, (quant.describe(), result)


SMALL = MatmulBlocks(tokens=32, out=128, depth=128)
# (label, scheme, N, K, tiles): N = 200 ends in a ragged 128-wide block; K = 384 / 256 with 128-deep
# tiles takes several K steps; N = 40, K = 200 leave partial 32x128 blocks (one whole-K tile).
CASES = [
    ("int8_w8a8_channel", WeightQuant("int8", "channel", activations="dynamic"), 200, 384, SMALL),
    ("int8_w8a8_tensor_static", WeightQuant("int8", "tensor", activations="static"), 40, 200, None),
    ("int8_w8a8_block", WeightQuant("int8", "block", block=(64, 128), activations="dynamic"), 200, 256, SMALL),
    ("fp8_block_w8a8", WeightQuant("fp8", "block", block=(128, 128), activations="dynamic"), 200, 384, SMALL),
    ("fp8_block_w8a8_partial", WeightQuant("fp8", "block", block=(32, 128), activations="dynamic"), 40, 256, None),
    ("fp8_tensor_static_w8a8", WeightQuant("fp8", "tensor", activations="static"), 40, 256, None),
    ("fp8_channel_w8a8", WeightQuant("fp8", "channel", activations="dynamic"), 200, 256, SMALL),
    ("fp8_block", WeightQuant("fp8", "block", block=(32, 128)), 40, 200, None),
    ("fp8_block_steps", WeightQuant("fp8", "block", block=(32, 128)), 200, 384, MatmulBlocks(32, 128, 256)),
    ("fp8_channel", WeightQuant("fp8", "channel"), 200, 256, SMALL),
    ("int8_channel", WeightQuant("int8", "channel"), 40, 200, None),
    ("int8_group128", WeightQuant("int8", "group", group_size=128), 200, 384, SMALL),
    ("int4_g128", WeightQuant("int4", "group", group_size=128, layout="packed"), 72, 2048,
     MatmulBlocks(32, 128, 1024)),
    ("int4_g32_zero", WeightQuant("int4", "group", group_size=32, symmetric=False, layout="packed"), 72, 256, None),
    ("int4_g64_odd_k", WeightQuant("int4", "group", group_size=64, layout="packed"), 40, 196, None),
    ("int4_channel_zero", WeightQuant("int4", "channel", symmetric=False, layout="packed"), 200, 196, SMALL),
    # one K tile of 2056 packed columns, unpacked in blocks of 1024, 1024 and 8
    ("int4_channel_long_k", WeightQuant("int4", "channel", layout="packed"), 40, 2052, None),
    # AWQ: 1280 features are 160 words, one 128-word block (1024 features) and a ragged one
    ("awq_g128", WeightQuant("int4", "group", group_size=128, symmetric=False, layout="awq"), 1280, 256,
     MatmulBlocks(32, 512, 128)),
    ("awq_g32_odd_k", WeightQuant("int4", "group", group_size=32, symmetric=False, layout="awq"), 72, 200, None),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("label, quant, n, k, blocks", CASES, ids=[c[0] for c in CASES])
def test_matches_native_gemm(label, quant, n, k, blocks, dtype):
    assert supports(quant, n, k, dtype) is None
    _check(quant, n, k, (2, 3), dtype, blocks, seed=len(label))


# Outputs near zero (sums of products of both signs) in bfloat16: each element within 2 ulp, which
# a weight rounded to bfloat16 before its products (dequantised in the compute dtype instead of
# scaling float32 partial sums) misses. Interpret mode runs the same bfloat16 operands as a TPU.
ELEMENTWISE = ["int4_g32_zero", "int4_channel_zero", "awq_g128", "awq_g32_odd_k", "fp8_block", "fp8_block_w8a8"]


@pytest.mark.parametrize("label", ELEMENTWISE)
def test_bfloat16_elementwise(label):
    _, quant, n, k, blocks = next(c for c in CASES if c[0] == label)
    _check(quant, n, k, (7,), "bfloat16", blocks, seed=len(label) + 7, normwise=False)


@pytest.mark.parametrize("label", ["fp8_block_w8a8", "fp8_channel_w8a8", "fp8_tensor_static_w8a8"])
def test_fp8_codes_on_an_fp8_mxu(label):
    """fp8 W8A8 with both dot operands the fp8 codes themselves (tpu7x's fp8 MXU), elementwise."""
    _, quant, n, k, blocks = next(c for c in CASES if c[0] == label)
    _check(quant, n, k, (7,), "bfloat16", blocks, seed=3, normwise=False, fp8_mxu=True)


@pytest.mark.parametrize("label, tokens", [("int8_w8a8_channel", 0), ("int8_w8a8_channel", 1),
                                           ("int8_w8a8_channel", 40), ("fp8_block_w8a8", 5), ("fp8_block_w8a8", 40),
                                           ("int4_g128", 0), ("int4_g128", 1), ("int4_g128", 40), ("awq_g128", 40)])
def test_token_counts(label, tokens):
    """No tokens, one, a few, and 40 in 32-row blocks (the last one ragged); no bias."""
    _, quant, n, k, blocks = next(c for c in CASES if c[0] == label)
    _check(quant, n, k, (tokens,), "float32", blocks, bias=False, seed=tokens)


def test_activation_codes_are_the_native_quantisation():
    """fp8 groups (per token and group of 128), per token and per tensor, bit for bit
    ``quantize_fp8_native``; int8 codes times scales exactly ``quantize_activations``."""
    quantize_x = jax.jit(_quantize_x, static_argnums=2)
    native_fp8 = jax.jit(quantize_fp8_native, static_argnums=1)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(0, 3, (7, 256)).astype(np.float32)).astype(jnp.bfloat16)
    x = x.at[2].set(0.0)  # an all-zero row
    for quant, group in ((WeightQuant("fp8", "block", block=(128, 128), activations="dynamic"), GroupShape(1, 128)),
                         (WeightQuant("fp8", "channel", activations="dynamic"), GroupShape.PER_TOKEN),
                         (WeightQuant("fp8", "tensor", activations="dynamic"), GroupShape.PER_TENSOR)):
        codes, scale = quantize_x(x, None, quant)
        want_codes, want_scale = native_fp8(x, group)
        np.testing.assert_array_equal(np.asarray(codes).view(np.uint8), np.asarray(want_codes).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(scale), np.broadcast_to(np.asarray(want_scale), scale.shape))
    quant = WeightQuant("int8", "channel", activations="dynamic")
    codes, scale = quantize_x(x, None, quant)
    assert codes.dtype == jnp.int8
    want = quantize_activations(x, _weight(quant, 8, 256, 0))
    np.testing.assert_array_equal(np.asarray(codes, np.float32) * np.asarray(scale), np.asarray(want))


@pytest.mark.parametrize("quant, dtype, reason", [
    (WeightQuant("int4", "group", group_size=12, layout="packed"), "bfloat16", "int4 groups of 12"),
    (WeightQuant("int8", "group", group_size=64), "bfloat16", "groups of 64"),
    (WeightQuant("int8", "channel", layout="packed"), "bfloat16", "int8 codes packed"),
    (WeightQuant("int8", "channel", symmetric=False), "float32", "zero points on plain"),
    (WeightQuant("fp8", "block", block=(128, 128), activations="static"), "bfloat16", "static activation"),
    (WeightQuant("fp8", "channel"), "int8", "x of int8"),
])
def test_supports_declines_with_a_reason(quant, dtype, reason):
    why = supports(quant, 256, 1024, dtype)
    assert why is not None and reason in why


@pytest.mark.parametrize("generation", ["v5e", "v6e", "tpu7x"])
def test_tiles_fit_each_generation(generation):
    """At serving shapes the tiles are TPU-legal (tokens a multiple of 32 or all of them, outputs a
    multiple of 128, K tiles dividing K in whole groups) and their estimate within half the
    generation's default scoped VMEM; decode takes one token block, prefill 512-row ones."""
    from dualop.kernels.pallas.common import vmem_spec

    schemes = [WeightQuant("fp8", "block", block=(128, 128), activations="dynamic"),
               WeightQuant("int8", "channel", activations="dynamic"),
               WeightQuant("int4", "group", group_size=128, layout="packed"),
               WeightQuant("int4", "group", group_size=128, symmetric=False, layout="awq")]
    with compile_target(generation):
        budget = vmem_spec().scoped_default // 2
        for quant in schemes:
            for m, k, n in ((16, 8192, 1280), (8192, 8192, 7168), (1, 7168, 4608), (8192, 2304, 7168)):
                b = matmul_blocks(m, n, k, quant, jnp.bfloat16)
                assert b.tokens == m if m <= 128 else b.tokens == 512
                assert b.out % 128 == 0 and k % b.depth == 0 and b.depth % 128 == 0
                if quant.layout == "packed":  # whole 128-lane tiles of words, or all of K
                    assert b.depth % 1024 == 0 or b.depth == k
                if quant.layout == "awq":  # whole 128-lane tiles of words, or all of N
                    assert b.out % 1024 == 0 or b.out == n
                plan = _plan(quant)
                x_bytes = 1 if plan.x_codes else 2
                assert _step_vmem(b, plan, x_bytes, 2, -(-k // plan.group) if plan.group else 1) <= budget


@pytest.mark.latest_only
@pytest.mark.parametrize("generation, quant", [
    ("v5e", WeightQuant("fp8", "block", block=(128, 128), activations="dynamic")),
    ("tpu7x", WeightQuant("fp8", "block", block=(128, 128), activations="dynamic")),  # fp8 codes on the MXU
    ("v5e", WeightQuant("int4", "group", group_size=128, symmetric=False, layout="awq")),
], ids=["v5e-fp8_block_w8a8", "tpu7x-fp8_block_w8a8", "v5e-awq_g128"])
def test_compiles_at_a_serving_shape(generation, quant):
    """The real TPU compiler (libtpu's compile-only topologies) accepts the kernel at a decode shape
    of a 7168-wide model, over several output and K blocks."""
    from dualop.aot.tpu import compile_function, quiet_native_stderr, tpu_available
    from dualop.spec import InputSpec

    missing = tpu_available()
    if missing is not None:
        pytest.skip(f"no TPU compiler in this environment: {missing}")
    m, k, n = 16, 7168, 2112 if quant.layout != "awq" else 4608
    zero = quant.zero_point_shape(n, k)
    specs = (InputSpec((m, k), "bfloat16"), InputSpec(quant.codes_shape(n, k), quant.codes_dtype()),
             InputSpec(quant.scale_shape(n, k), "float16" if quant.layout == "awq" else "float32"),
             InputSpec(zero, "int32") if zero else None, None, InputSpec((n,), "bfloat16"))
    with quiet_native_stderr():
        result = compile_function(lambda *a: quantized_matmul(*a, quant=quant, n=n, k=k), specs, generation)
    assert result.status == "ok", result.message
    (kernel,) = result.kernels
    assert kernel["kernel"] == "dualop_quantized_matmul" and kernel["grid"][1] > 1 and kernel["grid"][2] > 1
