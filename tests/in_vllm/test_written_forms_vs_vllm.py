"""dualop's written forms against vLLM's own compiled CPU kernels on the same tensors (in the 'vllm'
environment): the in-place fused add-norm and rope, ``out=`` norm and activation, and paged decode
attention (through the bench's peer, which fills vLLM's cache with vLLM's own write), within the
tolerance table; the same pairs ``dualop bench`` times."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.vllm_env

pytest.importorskip("vllm", reason="vLLM is installed in the 'vllm' environment (scripts/env.sh vllm)")
import torch  # noqa: E402  (vLLM brings it)

from dualop import testing  # noqa: E402
from dualop.bench.vllm_peers import VLLM_PEER_CASES, vllm_kernels_available  # noqa: E402
from dualop.ops import RMSNorm, RotaryEmbedding, SiluAndMul  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    why = vllm_kernels_available()
    assert why is None, why  # the 'vllm' environment has vLLM's compiled CPU ops


def _same(got, want):
    key, _ = testing.tolerance_for(str(want.dtype).removeprefix("torch."), want)
    cmp = testing.compare(testing.to_numpy(got), testing.to_numpy(want), key)
    assert cmp.ok, cmp


def _randn(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).mul(2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_norm_in_place_is_vllms(dtype):
    x, r, w = _randn((9, 256), dtype, 0), _randn((9, 256), dtype, 1), 1 + _randn((256,), dtype, 2) / 4
    vx, vr = x.clone(), r.clone()
    torch.ops._C.fused_add_rms_norm(vx, vr, w, 1e-6)
    RMSNorm(256, 1e-6)(x, w, r, out=x, residual_out=r)
    _same(r, vr)
    _same(x, vx)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_and_activation_into_out_are_vllms(dtype):
    x, w = _randn((9, 256), dtype, 0), _randn((256,), dtype, 1)
    want, got = torch.empty_like(x), torch.empty_like(x)
    torch.ops._C.rms_norm(want, x, w, 1e-6)
    RMSNorm(256, 1e-6)(x, w, out=got)
    _same(got, want)
    want, got = torch.empty(9, 128, dtype=dtype), torch.empty(9, 128, dtype=dtype)
    torch.ops._C.silu_and_mul(want, x)
    SiluAndMul()(x, out=got)
    _same(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("neox", [True, False])
def test_rope_in_place_is_vllms(dtype, neox):
    op = RotaryEmbedding(64, 64, 512, 10000.0, neox)
    positions = torch.from_numpy(np.random.default_rng(0).integers(0, 512, 7))
    q, k = _randn((7, 4 * 64), dtype, 1), _randn((7, 2 * 64), dtype, 2)
    vq, vk = q.clone(), k.clone()
    torch.ops._C.rotary_embedding(positions, vq, vk, 64, torch.from_numpy(op.cos_sin_cache).to(dtype), neox)
    op(positions, q, k, query_out=q, key_out=k)
    _same(q, vq)
    _same(k, vk)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_decode_is_vllms(dtype):
    from dualop.bench.cases import CASES

    case = next(c for c in CASES if c.label == "ragged_paged_attention[decode]")
    shape = case.input_shape((256, 1024))  # 2 sequences of 256 cached tokens
    args = case.inputs(shape, str(dtype).removeprefix("torch."), "torch", np.random.default_rng(0))
    op = case.make_op(shape[-1])
    _same(op(*args), VLLM_PEER_CASES["ragged_paged_attention[decode]"](op)(*args))
