"""Edge cases a fuzz run found, each refused or defined at its root:

- cache writes (``reshape_and_cache``, ``concat_and_cache_mla``) refuse a torch cache torch would
  not let them write (an inference tensor outside inference mode, a leaf that requires grad, an
  expanded tensor) before anything is written, on every path; two tokens with one slot: the last
  in token order wins, on every path;
- the value-check memo skips only values equal to the ones it checked (a write through numpy or
  DLPack changes values without a torch version bump);
- constructor floats (NaN, inf), conv padding larger than reflect / circular can take, unhashable
  ``get_rope`` parameters, ``logits_processor``'s unused ``lm_head_weight``, ``scale_ub`` NaN,
  and a NaN in ``quant_fp8``'s input (its scale NaN on every path, as torch's amax gives);
- ``from_pretrained`` refuses a quantized checkpoint before reading any tensor.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import jax
import torch

from dualop import OpsConfig, override_platform, set_config
from dualop.ops import (
    ConcatAndCacheMLA, Conv2dLayer, FatreluAndMul, GemmaRMSNorm, LogitsProcessor, QuantFP8, ReshapeAndCache,
    RMSNorm, RMSNormGated, RotaryEmbedding, SwigluOAIAndMul, get_rope, kv_cache,
)
from dualop.ops import rope_scaling

jnp = jax.numpy

# (platform, config) -> the torch method that must run: the native body, the C++/torch CPU path,
# the Triton kernel (interpreted), and the tpu platform, where a plain torch tensor has no Pallas
# bridge and falls back to the native body.
TORCH_PATHS = {
    ("cpu", "none"): "forward_native",
    ("cpu", "all"): "forward_cpu",
    ("cuda", "all"): "forward_cuda",
    ("tpu", "all"): "forward_native",
}


def _run(op, platform, config, *args):
    """``op(*args)`` on ``platform`` under config ``[config]``; ``op.ran`` is the method that ran."""
    from dualop.platforms import frontend_of

    with override_platform(platform), set_config(OpsConfig([config])):
        op.last_fallback = None
        out = op(*args)
        op.ran = op.last_run(frontend_of(args[0]), platform)[0]
    return out


def _kv_args(tokens=4, heads=1, head_dim=8, num_pages=2, page_size=4, slots=None, seed=0):
    rng = np.random.default_rng(seed)
    key = torch.from_numpy(rng.standard_normal((tokens, heads, head_dim)).astype(np.float32))
    value = torch.from_numpy(rng.standard_normal((tokens, heads, head_dim)).astype(np.float32))
    cache = torch.from_numpy(rng.standard_normal((num_pages, page_size, 2 * heads, head_dim)).astype(np.float32))
    slot_mapping = torch.tensor(list(range(tokens)) if slots is None else slots, dtype=torch.int32)
    return key, value, cache, slot_mapping


def _mla_args(tokens=4, latent=6, rope=2, num_pages=2, page_size=4, slots=None, seed=0):
    rng = np.random.default_rng(seed)
    kv_c = torch.from_numpy(rng.standard_normal((tokens, latent)).astype(np.float32))
    k_pe = torch.from_numpy(rng.standard_normal((tokens, rope)).astype(np.float32))
    cache = torch.from_numpy(rng.standard_normal((num_pages, page_size, latent + rope)).astype(np.float32))
    slot_mapping = torch.tensor(list(range(tokens)) if slots is None else slots, dtype=torch.int32)
    return kv_c, k_pe, cache, slot_mapping


# --- 1. cache writes: refused before any write; duplicate slots ------------------------------------

def _inference_cache(cache):
    with torch.inference_mode():
        return cache.clone()


def _leaf_that_requires_grad(cache):
    return cache.clone().requires_grad_(True)


def _view_of_such_a_leaf(cache):
    return cache.clone().requires_grad_(True)[:]


def _expanded(cache):
    return cache[:1].expand(cache.shape)


UNWRITABLE = {
    "inference tensor": (_inference_cache, r"is an inference tensor .* outside inference mode"),
    "leaf requiring grad": (_leaf_that_requires_grad, r"is a leaf tensor that requires grad"),
    "view of such a leaf": (_view_of_such_a_leaf, r"is a view of a leaf tensor that requires grad"),
    "expanded": (_expanded, r"has overlapping elements \(stride 0"),
}


@pytest.mark.parametrize("kind", list(UNWRITABLE))
@pytest.mark.parametrize("path", list(TORCH_PATHS), ids=lambda p: "-".join(p))
def test_reshape_and_cache_refuses_an_unwritable_cache_before_writing(path, kind):
    make, message = UNWRITABLE[kind]
    key, value, cache, slots = _kv_args()
    cache = make(cache)
    before = cache.detach().clone()
    with pytest.raises(ValueError, match=rf"reshape_and_cache: argument 'kv_pages' {message}"):
        _run(ReshapeAndCache(), *path, key, value, cache, slots)
    assert torch.equal(cache.detach(), before)  # byte-identical: nothing was written


@pytest.mark.parametrize("kind", list(UNWRITABLE))
@pytest.mark.parametrize("path", list(TORCH_PATHS), ids=lambda p: "-".join(p))
def test_concat_and_cache_mla_refuses_an_unwritable_cache_before_writing(path, kind):
    make, message = UNWRITABLE[kind]
    kv_c, k_pe, cache, slots = _mla_args()
    cache = make(cache)  # (the kernels write latent rows of even width: 6 + 2)
    before = cache.detach().clone()
    with pytest.raises(ValueError, match=rf"concat_and_cache_mla: argument 'latent_pages' {message}"):
        _run(ConcatAndCacheMLA(), *path, kv_c, k_pe, cache, slots)
    assert torch.equal(cache.detach(), before)


@pytest.mark.parametrize("path", list(TORCH_PATHS), ids=lambda p: "-".join(p))
def test_writable_caches_of_those_kinds_are_still_written(path):
    """Inside inference mode an inference cache is writable; under no_grad a leaf that requires grad."""
    key, value, cache, slots = _kv_args()
    with torch.inference_mode():
        inference = cache.clone()
        _run(ReshapeAndCache(), *path, key, value, inference, slots)
    leaf = cache.clone().requires_grad_(True)
    with torch.no_grad():
        _run(ReshapeAndCache(), *path, key, value, leaf, slots)
    for written in (inference, leaf.detach()):
        assert torch.equal(written[0, :, 0], key[:, 0]) and torch.equal(written[0, :, 1], value[:, 0])


# Slot 3 is written by tokens 0, 2 and 3 (token 3 wins), slot 5 by tokens 1 and 4 (token 4 wins);
# token 6 is padding, which the torch native body once made rewrite the first kept token's row (token
# 0's, slot 3) after the others.
DUPLICATE_SLOTS = [3, 5, 3, 3, 5, 0, -1]
WINNERS = {3: 3, 5: 4, 0: 5}


def _winner_rows(cache, row_of):
    flat = np.asarray(cache, np.float32).reshape(-1, *np.asarray(cache).shape[2:])
    return {slot: flat[slot] for slot in WINNERS}, {slot: row_of(t) for slot, t in WINNERS.items()}


@pytest.mark.parametrize("path", list(TORCH_PATHS), ids=lambda p: "-".join(p))
def test_duplicate_slots_last_token_wins_on_every_torch_path(path):
    key, value, cache, slots = _kv_args(tokens=7, slots=DUPLICATE_SLOTS)
    op = ReshapeAndCache()
    _run(op, *path, key, value, cache, slots)
    assert op.ran == TORCH_PATHS[path]
    got, want = _winner_rows(cache, lambda t: torch.stack([key[t], value[t]], 1).reshape(-1, key.shape[-1]).numpy())
    for slot in WINNERS:
        np.testing.assert_array_equal(got[slot], want[slot], err_msg=f"slot {slot}")


@pytest.mark.parametrize("platform, method", [("cpu", "forward_native"), ("tpu", "forward_tpu")])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_duplicate_slots_last_token_wins_in_jax(platform, method, jit):
    """The jax native body and the Pallas kernel (interpreted); under jit the slots are not read,
    so the sort runs in the trace."""
    key, value, cache, slots = (jnp.asarray(a.numpy()) for a in _kv_args(tokens=7, slots=DUPLICATE_SLOTS))
    op = ReshapeAndCache()
    call = jax.jit(lambda *a: op(*a)) if jit else op
    with override_platform(platform), set_config(OpsConfig(["all"])):
        out = call(key, value, cache, slots)
        assert op.last_run("jax", platform)[0] == method
    got, want = _winner_rows(out, lambda t: np.stack([key[t], value[t]], 1).reshape(-1, key.shape[-1]))
    for slot in WINNERS:
        np.testing.assert_array_equal(got[slot], want[slot], err_msg=f"slot {slot}")


@pytest.mark.parametrize("frontend", ["torch_xla", "torchax"])
def test_duplicate_slots_last_token_wins_on_xla_devices(frontend):
    """Lazy tensors: the slots are not read, the sort runs on the device, then the Pallas kernel."""
    from conftest import require_frontend
    from dualop import testing

    require_frontend(frontend)
    arrays = [a.numpy() for a in _kv_args(tokens=7, slots=DUPLICATE_SLOTS)]
    with testing.frontend_context(frontend):
        key, value, cache, slots = [testing.to_frontend(a if i < 3 else testing.Pinned(a, "int32"), frontend, "float32")
                                    for i, a in enumerate(arrays)]
        op = ReshapeAndCache()
        _run(op, "tpu", "all", key, value, cache, slots)
        assert op.ran == "forward_tpu"
        got, want = _winner_rows(testing.to_numpy(cache),
                                 lambda t: np.stack([arrays[0][t], arrays[1][t]], 1).reshape(-1, arrays[0].shape[-1]))
    for slot in WINNERS:
        np.testing.assert_array_equal(got[slot], want[slot], err_msg=f"slot {slot}")


@pytest.mark.parametrize("path", list(TORCH_PATHS), ids=lambda p: "-".join(p))
def test_duplicate_slots_last_token_wins_in_the_latent_cache(path):
    kv_c, k_pe, cache, slots = _mla_args(tokens=7, slots=DUPLICATE_SLOTS)
    op = ConcatAndCacheMLA()
    _run(op, *path, kv_c, k_pe, cache, slots)
    assert op.ran == TORCH_PATHS[path]
    got, want = _winner_rows(cache, lambda t: torch.cat([kv_c[t], k_pe[t]]).numpy())
    for slot in WINNERS:
        np.testing.assert_array_equal(got[slot], want[slot], err_msg=f"slot {slot}")


@pytest.mark.parametrize("kernel, frontend, platform", [
    ("_TRITON_RESHAPE_AND_CACHE", "torch", "cuda"), ("_PALLAS_RESHAPE_AND_CACHE", "jax", "tpu")])
def test_kernels_never_see_two_writers_of_one_slot(kernel, frontend, platform, monkeypatch):
    """The race is the kernels' (parallel programs, concurrent DMAs): the op hands them distinct
    kept slots, and distinct slots untouched (no sort when the check saw none repeat)."""
    ref = getattr(kv_cache, kernel)
    real = ref.resolve()
    seen = []

    def spy(key, value, cache, slot_mapping, **kw):
        seen.append(slot_mapping)
        return real(key, value, cache, slot_mapping, **kw)

    monkeypatch.setattr(ref, "resolve", lambda: spy)
    for slots in (DUPLICATE_SLOTS, [6, 2, -1, 0, 1, 7, 3]):
        args = _kv_args(tokens=7, slots=slots)
        if frontend == "jax":
            args = tuple(jnp.asarray(a.numpy()) for a in args)
        _run(ReshapeAndCache(), platform, "all", *args)
        kept = [s for s in np.asarray(seen[-1]).tolist() if s >= 0]
        assert len(kept) == len(set(kept)), kept
        assert set(kept) == {s for s in slots if s >= 0}
    assert seen[-1] is args[3]  # distinct slots: passed as given


# --- 2. the value-check memo ----------------------------------------------------------------------

def test_positions_written_through_numpy_are_checked_again():
    rope = RotaryEmbedding(16, 16, 32, 10000.0)
    array = np.arange(4, dtype=np.int64)
    positions = torch.from_numpy(array)
    query = torch.zeros(4, 16)
    rope(positions, query)
    array[2] = 99  # no torch version bump
    with pytest.raises(ValueError, match=r"rotary_embedding: argument 'positions' holds values in \[0, 99\]"):
        rope(positions, query)


def test_slots_written_through_numpy_are_checked_again():
    key, value, cache, _ = _kv_args()
    array = np.arange(4, dtype=np.int32)
    slots = torch.from_numpy(array)
    op = ReshapeAndCache()
    op(key, value, cache, slots)
    before = cache.clone()
    array[1] = 8  # capacity 2 * 4
    with pytest.raises(ValueError, match=r"reshape_and_cache: argument 'slot_mapping' holds slot 8"):
        op(key, value, cache, slots)
    assert torch.equal(cache, before)


def test_page_tables_written_through_numpy_are_checked_again():
    from dualop.ops.attention import check_metadata_values

    pages = np.array([[0, 1], [2, 3]], np.int32)
    arrays = [torch.from_numpy(a) for a in (np.array([5, 3], np.int32), pages, np.array([0, 2, 4], np.int32),
                                            np.array([2], np.int32))]
    check_metadata_values("ragged_paged_attention", 4, 4, 4, *arrays)
    pages[1, 0] = 9  # a page past num_pages = 4
    with pytest.raises(ValueError, match=r"argument 'page_indices' has page_indices\[1, 0\] = 9"):
        check_metadata_values("ragged_paged_attention", 4, 4, 4, *arrays)


def test_a_jax_array_sharing_a_torch_tensor_is_checked_again():
    """jax arrays are immutable, but one made by DLPack shares the torch tensor's memory."""
    tensor = torch.arange(4, dtype=torch.int32)
    positions = jax.dlpack.from_dlpack(tensor)
    if int(positions[0]) != 0 or not _shares_memory(tensor, positions):
        pytest.skip("this jax copies on from_dlpack")
    rope = RotaryEmbedding(16, 16, 32, 10000.0)
    query = jnp.zeros((4, 16))
    rope(positions, query)
    tensor[3] = 40
    with pytest.raises(ValueError, match=r"argument 'positions' holds values in \[0, 40\]"):
        rope(positions, query)


def _shares_memory(tensor, array):
    tensor[0] = 1
    shared = int(array[0]) == 1
    tensor[0] = 0
    return shared


def test_equal_values_still_skip_the_check(monkeypatch):
    """The memo still works: the same values (a new tensor even) are not read again."""
    from dualop.ops import rotary

    rope = RotaryEmbedding(16, 16, 32, 10000.0)
    query = torch.zeros(4, 16)
    rope(torch.arange(4), query)
    monkeypatch.setattr(rotary, "concrete_values", lambda a: pytest.fail("the values were read again"))
    rope(torch.arange(4), query)


# --- 3. constructor values and other refusals -----------------------------------------------------

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("make, message", [
    (lambda: RMSNorm(8, eps=INF), r"rms_norm: eps must be a non-negative float, got inf; expected a finite value"),
    (lambda: RMSNorm(8, eps=NAN), r"rms_norm: eps must be a non-negative float, got nan"),
    (lambda: RMSNorm(8, eps=-1e-6), r"rms_norm: eps must be a non-negative float, got -1e-06"),
    (lambda: GemmaRMSNorm(8, eps=INF), r"gemma_rms_norm: eps must be a non-negative float, got inf"),
    (lambda: RMSNormGated(8, eps=INF), r"rms_norm_gated: eps must be a non-negative float, got inf"),
    (lambda: RMSNormGated(8, eps=NAN), r"rms_norm_gated: eps must be a non-negative float, got nan"),
    (lambda: FatreluAndMul(NAN), r"fatrelu_and_mul: threshold must be a finite float, got nan"),
    (lambda: FatreluAndMul(-INF), r"fatrelu_and_mul: threshold must be a finite float, got -inf"),
    (lambda: SwigluOAIAndMul(alpha=NAN), r"swigluoai_and_mul: alpha must be a finite float, got nan"),
    (lambda: SwigluOAIAndMul(limit=INF), r"swigluoai_and_mul: limit must be a finite float, got inf"),
    (lambda: SwigluOAIAndMul(limit=NAN), r"swigluoai_and_mul: limit must be a finite float, got nan"),
    (lambda: LogitsProcessor(32, scale=INF), r"logits_processor: argument 'scale' must be a finite float, got inf"),
    (lambda: LogitsProcessor(32, soft_cap=INF), r"logits_processor: argument 'soft_cap' .* got inf; expected a finite"),
    (lambda: RotaryEmbedding(16, 16, 32, INF), r"rotary_embedding: base must be a positive number, got inf"),
    (lambda: get_rope(16, 32, True, {"rope_type": "linear", "factor": INF}), r"scaling_factors must be a positive"),
    (lambda: rope_scaling.YaRNScalingRotaryEmbedding(16, 16, 32, 1e4, True, 2.0, extrapolation_factor=NAN),
     r"YaRNScalingRotaryEmbedding\): extrapolation_factor must be a finite float, got nan"),
    (lambda: rope_scaling.YaRNScalingRotaryEmbedding(16, 16, 32, 1e4, True, 2.0, mscale=NAN, mscale_all_dim=1.0),
     r"YaRNScalingRotaryEmbedding\): mscale must be a finite float, got nan"),
    (lambda: rope_scaling.DeepseekScalingRotaryEmbedding(16, 16, 32, 1e4, True, 2.0, mscale_all_dim=INF),
     r"DeepseekScalingRotaryEmbedding\): mscale_all_dim must be a finite float, got inf"),
    (lambda: rope_scaling.MRotaryEmbedding(16, 16, 32, 1e4, True, None, [2, 3, 3], attn_factor=NAN),
     r"MRotaryEmbedding\): attn_factor must be a finite float, got nan"),
    (lambda: rope_scaling.Phi3LongRoPEScaledRotaryEmbedding(16, 16, 64, 32, 1e4, True, None, [1.0] * 8, [1.0] * 8,
                                                             short_mscale=NAN),
     r"Phi3LongRoPEScaledRotaryEmbedding\): short_mscale must be a finite float, got nan"),
])
def test_non_finite_constructor_floats_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("bad", [NAN, 0.0, -1.0])
def test_scale_ub_must_be_a_positive_number(frontend, bad):
    x, ub = np.ones((2, 128), np.float32), np.array([bad], np.float32)
    as_array = torch.from_numpy if frontend == "torch" else jnp.asarray
    with pytest.raises(ValueError, match=rf"quant_fp8: argument 'scale_ub' is {bad}; expected a positive number"):
        QuantFP8(False, "per_token")(as_array(x), None, as_array(ub))


@pytest.mark.parametrize("mode, size, pad, limit", [
    ("reflect", 3, 3, "padding < the input's size, here at most 2"),
    ("reflect", 1, 1, "padding < the input's size, here at most 0"),
    ("circular", 3, 4, "padding <= the input's size, here at most 3"),
])
@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_conv_padding_beyond_what_the_mode_can_take_is_refused(mode, size, pad, limit, frontend):
    op = Conv2dLayer(1, 2, 3, padding=pad, padding_mode=mode)
    x = np.ones((1, 1, size, 8), np.float32)
    w = np.ones((2, 1, 3, 3), np.float32)
    as_array = torch.from_numpy if frontend == "torch" else jnp.asarray
    with pytest.raises(ValueError, match=rf"conv2d: argument 'x' has spatial size {size} in dim 2 .* padding {pad} "
                                         rf"with padding_mode='{mode}'; expected {limit}"):
        op(as_array(x), as_array(w))


@pytest.mark.parametrize("mode, pad", [("reflect", 2), ("circular", 3)])
def test_conv_padding_at_the_limit_runs_the_same_in_both_frontends(mode, pad):
    op = Conv2dLayer(1, 2, 3, padding=pad, padding_mode=mode)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, 3, 5)).astype(np.float32)
    w = rng.standard_normal((2, 1, 3, 3)).astype(np.float32)
    want = op(torch.from_numpy(x), torch.from_numpy(w)).numpy()
    np.testing.assert_allclose(np.asarray(op(jnp.asarray(x), jnp.asarray(w))), want, rtol=1e-5, atol=1e-5)


def test_get_rope_keys_numpy_values_and_mixed_keys_and_names_what_cannot_key():
    section = get_rope(16, 32, True, {"rope_type": "default", "mrope_section": np.array([2, 3, 3])})
    assert type(section) is rope_scaling.MRotaryEmbedding and section.mrope_section == [2, 3, 3]
    assert get_rope(16, 32, True, {"rope_type": "default", "mrope_section": [2, 3, 3]}) is section
    factors = {"rope_type": "longrope", "original_max_position_embeddings": 16, "short_factor": np.ones(8),
               "long_factor": np.full(8, 2.0)}
    assert type(get_rope(16, 64, True, factors)) is rope_scaling.Phi3LongRoPEScaledRotaryEmbedding
    assert type(get_rope(16, 32, True, {"rope_type": "default", 1: 2})) is RotaryEmbedding
    with pytest.raises(TypeError, match=r"get_rope: rope_parameters\['mrope_section'\] is a set, which cannot key"):
        get_rope(16, 32, True, {"rope_type": "default", "mrope_section": {2, 3}})
    with pytest.raises(TypeError, match=r"get_rope: dual_chunk_attention_config\['x'\]\[0\] is a bytearray"):
        get_rope(16, 32, True, None, None, {"chunk_size": 8, "local_size": 2, "x": [bytearray(b"a")]})
    with pytest.raises(TypeError, match=r"get_rope: dtype must be None, a dtype name or a torch / jax / numpy dtype"):
        get_rope(16, 32, True, None, {"a": 1})
    with pytest.raises(TypeError, match=r"get_rope: rope_parameters must be a dict or None, got list"):
        get_rope(16, 32, True, [("rope_type", "default")])
    with pytest.raises(ValueError, match=r"get_rope: head_size must be a positive int, got \[16\]"):
        get_rope([16], 32)
    with pytest.raises(ValueError, match=r"get_rope: dual_chunk_attention_config needs 'local_size'"):
        get_rope(16, 32, True, None, None, {"chunk_size": 8})


def test_logits_as_input_validates_the_unused_lm_head_weight():
    op = LogitsProcessor(32, logits_as_input=True, soft_cap=5.0)
    logits = torch.randn(2, 32)
    np.testing.assert_allclose(op(logits, logits).numpy(), (torch.tanh(logits / 5.0) * 5.0).numpy(), rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(TypeError, match=r"logits_processor: argument 'lm_head_weight' is a jax array but "
                                        r"'hidden_states' is a torch array"):
        op(jnp.asarray(logits.numpy()), logits)
    with pytest.raises(TypeError, match=r"logits_processor: argument 'lm_head_weight' has dtype int32"):
        op(torch.zeros(3, dtype=torch.int32), logits)


def _nan_pattern(q):
    return np.isnan(np.asarray(q.astype(jnp.float32)) if hasattr(q, "at") else q.float().numpy())


@pytest.mark.parametrize("group_shape, dtype", [("per_tensor", "float32"), ("per_tensor", "bfloat16"),
                                               ("per_token", "bfloat16"), ((1, 128), "float32")])
def test_a_nan_makes_its_scale_nan_on_every_path(group_shape, dtype):
    """Rows of 256 (long enough that XLA's CPU max reduction skips a NaN): the NaN's tensor / row
    / group of 128 is NaN, everything else finite, the same on every path."""
    from dualop.kernels.cuda.quant_fp8 import quant_fp8 as triton_quant
    from dualop.kernels.pallas.quant_fp8 import quant_fp8 as pallas_quant

    x = np.linspace(-3.0, 3.0, 16 * 256, dtype=np.float32).reshape(16, 256)
    x[5, 200] = np.nan
    want = np.zeros(x.shape, bool)
    want[{"per_tensor": slice(None)}.get(group_shape, 5), {(1, 128): slice(128, 256)}.get(group_shape, slice(None))] = True
    op = QuantFP8(False, group_shape)
    t, j = torch.from_numpy(x).to(getattr(torch, dtype)), jnp.asarray(x, dtype)
    granularity = {"per_tensor": "tensor", "per_token": "token"}.get(group_shape, "group")
    results = {
        "torch native": op.forward_native(t)[0],
        "torch cpu": op.forward_cpu(t)[0],
        "jax native": op.forward_native(j)[0],
        "pallas": pallas_quant(j, granularity=granularity, group_size=128, interpret=True)[0],
        "pallas, column blocks": pallas_quant(j, granularity=granularity, group_size=128, interpret=True,
                                              block_cols=128)[0],
        "triton": triton_quant(t, granularity=granularity, group_size=128)[0],
    }
    for name, q in results.items():
        np.testing.assert_array_equal(_nan_pattern(q), want, err_msg=name)


# --- 4. quantized checkpoints ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A one-layer transformers Llama saved with save_pretrained; returns its directory."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _no_tensor_may_load(monkeypatch):
    from dualop.models.checkpoint import Checkpoint

    monkeypatch.setattr(Checkpoint, "get", lambda *a, **k: pytest.fail("a tensor was read"))


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_a_quantization_config_is_refused_before_any_tensor_loads(tiny_llama, tmp_path, frontend, monkeypatch):
    import shutil

    import dualop.models as dm

    path = tmp_path / "fp8"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(config))
    _no_tensor_may_load(monkeypatch)
    with pytest.raises(dm.CheckpointError, match=r"the 'fp8' quantized checkpoint .* does not match its "
                                                 r"quantization_config; nothing was loaded\n  the config names a "
                                                 r"quantization but no layer holds quantized tensors"):
        dm.from_pretrained(str(path), frontend=frontend)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_float8_tensors_without_a_quantization_config_are_refused(tiny_llama, tmp_path, frontend, monkeypatch):
    import shutil

    from safetensors.torch import load_file, save_file

    import dualop.models as dm

    path = tmp_path / "f8"
    shutil.copytree(tiny_llama, path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    _no_tensor_may_load(monkeypatch)
    with pytest.raises(dm.CheckpointError, match=rf"holds tensors of quantized dtypes \(1: {name} \(F8_E4M3\)\)"):
        dm.from_pretrained(str(path), frontend=frontend)


def test_the_tiny_float_checkpoint_itself_loads(tiny_llama):
    """The refusals above are the quantization's, not the checkpoint's."""
    import dualop.models as dm

    model = dm.from_pretrained(str(tiny_llama), frontend="torch", max_model_len=16, max_num_seqs=1,
                               max_num_batched_tokens=8, page_size=4)
    assert math.isfinite(float(np.asarray(model.logits([1, 2, 3])).sum()))
