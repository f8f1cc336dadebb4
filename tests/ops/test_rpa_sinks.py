"""ragged_paged_attention's attention sinks (gpt-oss: one learned logit per query head in every
row's softmax denominator): the native body against transformers' gpt-oss attention
(``modeling_gpt_oss.eager_attention_forward``) on the same sequences, sliding-window edges
included; infinite and NaN sinks as the op defines them, on the native body and every kernel;
bad sinks refused before any kernel. The kernels against the native body at finite sinks are
``tests/sweeps/test_cells.py``'s ``[gqa4,window,soft_cap,mask_value,sinks]`` case."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from dualop import OpsConfig, override_platform, set_config, testing
from dualop.ops import RaggedPagedAttention
from dualop.ops import attention
from dualop.ops.attention import paged_batch

gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 4, 2, 32, 4
SM_SCALE = 0.3
# decode, a chunk of a longer prompt, a prefill; contexts end mid-page
Q_LENS, KV_LENS = [1, 3, 5], [11, 9, 5]
# about the scores' size, far below them, far above them (that head's rows near zero), and zero
SINKS = np.array([0.7, -40.0, 25.0, 0.0], np.float32)


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    return paged_batch(rng, Q_LENS, KV_LENS, num_tokens=sum(Q_LENS) + 2, num_q_heads=Q_HEADS, num_kv_heads=KV_HEADS,
                       head_dim=HEAD_DIM, page_size=PAGE, max_seqs=len(Q_LENS) + 1)


def _transformers_rows(arrays, sinks, window):
    """Each sequence's output rows by transformers' gpt-oss attention on its dense K and V (from the
    pages), its causal mask and, with a window, gpt-oss's sliding mask (position p visible from
    query position i iff i - window < p <= i)."""
    q, pages, kv_lens, table, cu, _ = arrays
    module = types.SimpleNamespace(sinks=torch.from_numpy(sinks), num_key_value_groups=Q_HEADS // KV_HEADS,
                                   training=False)
    out = np.zeros_like(q)
    for i, (q_len, kv_len) in enumerate(zip(Q_LENS, KV_LENS)):
        positions = np.arange(kv_len)
        rows = pages[table[i, positions // PAGE], positions % PAGE]  # [kv_len, 2 * Hkv, D]
        key = torch.from_numpy(rows[:, 0::2]).transpose(0, 1)[None]  # [1, Hkv, kv_len, D]
        value = torch.from_numpy(rows[:, 1::2]).transpose(0, 1)[None]
        query = torch.from_numpy(q[cu[i]:cu[i + 1]]).transpose(0, 1)[None]  # [1, Hq, q_len, D]
        at = kv_len - q_len + np.arange(q_len)[:, None]
        visible = positions[None, :] <= at
        if window is not None:
            visible &= positions[None, :] > at - window
        mask = torch.from_numpy(np.where(visible, 0.0, -np.inf).astype(np.float32))[None, None]
        rows_out, _ = gpt_oss.eager_attention_forward(module, query, key, value, mask, scaling=SM_SCALE)
        out[cu[i]:cu[i + 1]] = rows_out[0].numpy()
    return out


@pytest.mark.reference
@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("window", [None, 1, 3, 4, 64], ids=lambda w: f"window{w}")
def test_native_sinks_match_transformers_gpt_oss_attention(window, frontend):
    """Window 1 (each row sees itself alone), 3 and 4 (windows ending mid-page and on a page
    boundary), 64 (longer than every context: the causal mask alone)."""
    arrays = _batch()
    args = [testing.to_frontend(a if a.dtype != np.int32 else testing.Pinned(a, "int32"), frontend, "float32")
            for a in arrays]
    options = {"sm_scale": SM_SCALE} | ({} if window is None else {"sliding_window": window})
    got = testing.to_numpy(RaggedPagedAttention().forward_native(*args, testing.to_frontend(SINKS, frontend, "float32"),
                                                                 **options))
    want = _transformers_rows(arrays, SINKS, window)
    result = testing.compare(got, want, "float32")
    assert result.ok, result
    assert (got[sum(Q_LENS):] == 0).all(), "padding rows must be zeros"
    # the sinks matter: without them the rows differ (the far-above sink's head most)
    plain = testing.to_numpy(RaggedPagedAttention().forward_native(*args, **options))
    assert np.abs(plain - got)[: sum(Q_LENS), 2].min() > 0


EDGE_SINKS = np.array([np.inf, -np.inf, np.nan, 1.5], np.float32)


def _edge_expectations(got, arrays, options):
    """+inf: the head's rows are 0; -inf: the rows without sinks; NaN: NaN; a finite sink: finite."""
    rows = sum(Q_LENS)
    plain = testing.to_numpy(RaggedPagedAttention().forward_native(*[torch.from_numpy(a) for a in arrays], **options))
    assert (got[:rows, 0] == 0).all()
    assert testing.compare(got[:rows, 1], plain[:rows, 1], "float32").ok
    assert np.isnan(got[:rows, 2]).all()
    assert np.isfinite(got[:rows, 3]).all() and (got[rows:] == 0).all()


def test_infinite_and_nan_sinks_on_the_native_body():
    arrays = _batch(1)
    options = {"sm_scale": SM_SCALE, "sliding_window": 3}
    got = RaggedPagedAttention().forward_native(*[torch.from_numpy(a) for a in arrays], torch.from_numpy(EDGE_SINKS),
                                                **options)
    _edge_expectations(got.numpy(), arrays, options)


@pytest.mark.parametrize("frontend, platform", [("torch", "cpu"), ("torch", "cuda"), ("jax", "tpu")])
def test_infinite_and_nan_sinks_on_each_kernel(frontend, platform):
    """The same values through the C++ kernel, the Triton kernel (interpreted) and the Pallas
    kernel (interpreted): each starts its online softmax at the clipped sink."""
    arrays = _batch(1)
    options = {"sm_scale": SM_SCALE, "sliding_window": 3}
    args = [testing.to_frontend(a if a.dtype != np.int32 else testing.Pinned(a, "int32"), frontend, "float32")
            for a in arrays]
    op = RaggedPagedAttention()
    with override_platform(platform), set_config(OpsConfig(["all"])):
        got = op(*args, testing.to_frontend(EDGE_SINKS, frontend, "float32"), **options)
        assert op.last_run(frontend)[0] != "forward_native", op.last_run(frontend)
    _edge_expectations(testing.to_numpy(got), arrays, options)


@pytest.mark.parametrize("sinks, error, words", [
    (torch.zeros(3), ValueError, "argument 'sinks' has shape (3,); expected (4,)"),
    (torch.zeros(4, dtype=torch.int32), TypeError, "argument 'sinks' has dtype int32"),
    (torch.zeros(1, 4), ValueError, "argument 'sinks' has shape (1, 4)"),
    (np.zeros(4, np.float32), TypeError, "'sinks'"),
])
def test_bad_sinks_are_refused_before_any_kernel(sinks, error, words, monkeypatch):
    for kernel in ("_PALLAS_RPA", "_TRITON_RPA", "_CPU_RPA"):
        monkeypatch.setattr(attention, kernel, testing.NoLaunch())
    args = [torch.from_numpy(a) for a in _batch()]
    for platform in ("cpu", "cuda", "tpu"):
        with override_platform(platform), set_config(OpsConfig(["all"])):
            with pytest.raises(error, match="ragged_paged_attention") as info:
                RaggedPagedAttention()(*args, sinks, sm_scale=SM_SCALE)
        assert words in str(info.value), str(info.value)
