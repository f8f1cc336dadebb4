"""The weight formats' dequantisation (dualop/kernels/quant_math.py) in torch and jax against
float64 numpy written from each format's definition (codes packed here by the writers' rules);
the libraries that write those formats are the reference in tests/in_vllm/test_quant_formats.py."""

from __future__ import annotations

import numpy as np
import pytest

from dualop.backends import array_namespace
from dualop.kernels import quant_math as qm

FRONTENDS = ["torch", "jax"]


def _array(a: np.ndarray, frontend: str, dtype: str | None = None):
    if frontend == "jax":
        import jax.numpy as jnp

        return jnp.asarray(a if dtype is None else a.astype(np.float32)).astype(dtype or a.dtype)
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if dtype is None else t.float().to(getattr(torch, dtype))


def _numpy(x) -> np.ndarray:
    """A torch or jax array's values as float64 (exact for the codes and float32 results here)."""
    if type(x).__module__.startswith("torch"):
        return x.float().numpy().astype(np.float64)
    return np.asarray(x.astype("float32")).astype(np.float64)


def _fp8_codes(rng, shape, frontend):
    """float8_e4m3fn codes of random values in +-448, as the frontend's array, and their float64 values."""
    x = rng.uniform(-448, 448, shape).astype(np.float32)
    q = _array(x, frontend, "float8_e4m3fn")
    return q, _numpy(array_namespace(q).astype(q, array_namespace(q).float32))


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("shape, block", [((256, 384), (128, 128)), ((200, 300), (128, 128)), ((3, 64, 96), (32, 64))],
                         ids=["whole_blocks", "partial_blocks", "stacked"])
def test_block_scaled_fp8(frontend, shape, block):
    rng = np.random.default_rng(0)
    q, q64 = _fp8_codes(rng, shape, frontend)
    bn, bk = block
    scale = rng.uniform(1e-4, 1e-2, (*shape[:-2], -(-shape[-2] // bn), -(-shape[-1] // bk))).astype(np.float32)
    want = q64 * np.repeat(np.repeat(scale.astype(np.float64), bn, -2), bk, -1)[..., :shape[-2], :shape[-1]]
    got = qm.dequantize_blocks(array_namespace(q), q, _array(scale, frontend), block)
    np.testing.assert_allclose(_numpy(got), want, rtol=1e-6, atol=0)
    as_bf16 = qm.dequantize_blocks(array_namespace(q), q, _array(scale, frontend), block,
                                   dtype=array_namespace(q).bfloat16)
    assert str(as_bf16.dtype).endswith("bfloat16")
    np.testing.assert_allclose(_numpy(as_bf16), want, rtol=2**-8, atol=0)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("scale_shape", [(), (1,), (48,), (48, 1)], ids=["scalar", "tensor", "channel", "channel_col"])
def test_per_tensor_and_per_channel_int8(frontend, scale_shape):
    rng = np.random.default_rng(1)
    codes = rng.integers(-128, 128, (48, 80)).astype(np.int8)
    scale = rng.uniform(1e-3, 1e-1, scale_shape).astype(np.float32)
    s64 = scale.astype(np.float64).reshape(-1, 1) if scale.ndim else np.float64(scale)
    want = codes.astype(np.float64) * (s64 if scale.size != 1 else s64.reshape(()))
    q = _array(codes, frontend)
    got = qm.dequantize_per_channel(array_namespace(q), q, _array(scale, frontend))
    np.testing.assert_allclose(_numpy(got), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("zero_point", [False, True], ids=["symmetric", "zero_point"])
def test_grouped_codes(frontend, zero_point):
    rng = np.random.default_rng(2)
    n, k, g = 24, 256, 64
    codes = rng.integers(-8, 8, (n, k)).astype(np.int8)
    scale = rng.uniform(1e-3, 1e-1, (n, k // g)).astype(np.float32)
    zp = rng.integers(-8, 8, (n, k // g)).astype(np.int8) if zero_point else None
    want = codes.astype(np.float64)
    if zp is not None:
        want = want - np.repeat(zp.astype(np.float64), g, 1)
    want = want * np.repeat(scale.astype(np.float64), g, 1)
    q = _array(codes, frontend)
    got = qm.dequantize_groups(array_namespace(q), q, _array(scale, frontend), g,
                               zero_point=None if zp is None else _array(zp, frontend))
    np.testing.assert_allclose(_numpy(got), want, rtol=1e-6, atol=0)


def _pack_words(unsigned: np.ndarray, num_bits: int, slot_of) -> np.ndarray:
    """Codes ``[rows, cols]`` (unsigned, cols a multiple of the codes per word) packed along the
    last dim, code j of each word into slot ``slot_of[j]``, as int32."""
    per_word = 32 // num_bits
    rows, cols = unsigned.shape
    grouped = unsigned.reshape(rows, cols // per_word, per_word).astype(np.uint64)
    words = np.zeros((rows, cols // per_word), np.uint64)
    for j in range(per_word):
        words |= grouped[:, :, j] << np.uint64(num_bits * slot_of[j])
    return words.astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("num_bits, cols", [(4, 128), (4, 100), (8, 40), (2, 48)], ids=["int4", "int4_padded", "int8", "int2"])
def test_packed_codes_unpack_to_the_signed_values(frontend, num_bits, cols):
    rng = np.random.default_rng(3)
    half = 1 << (num_bits - 1)
    signed = rng.integers(-half, half, (6, cols))
    per_word = 32 // num_bits
    padded = -(-cols // per_word) * per_word
    unsigned = np.zeros((6, padded), np.int64)
    unsigned[:, :cols] = signed + half  # the padding packs as 0
    packed = _pack_words(unsigned, num_bits, list(range(per_word)))
    p = _array(packed, frontend)
    got = qm.unpack_int32(array_namespace(p), p, num_bits, cols)
    assert tuple(got.shape) == (6, cols)
    np.testing.assert_array_equal(np.asarray(_numpy(got)), signed)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_awq_gemm_layout(frontend):
    rng = np.random.default_rng(4)
    k, n, g = 128, 64, 32
    codes = rng.integers(0, 16, (k, n))
    zeros = rng.integers(0, 16, (k // g, n))
    scales = rng.uniform(1e-3, 1e-1, (k // g, n)).astype(np.float16)
    qweight = _pack_words(codes, 4, qm.AWQ_NIBBLE_OF)
    qzeros = _pack_words(zeros, 4, qm.AWQ_NIBBLE_OF)
    want = ((codes - np.repeat(zeros, g, 0)) * np.repeat(scales.astype(np.float64), g, 0)).T
    got = qm.dequantize_awq(array_namespace(_array(qweight, frontend)), _array(qweight, frontend),
                            _array(qzeros, frontend), _array(scales, frontend), g)
    assert tuple(got.shape) == (n, k)
    np.testing.assert_allclose(_numpy(got), want, rtol=1e-6, atol=0)
