"""mamba_mixer (the Mamba-1 mixer: Mamba, Jamba, Falcon-Mamba): the native body against transformers'
mixers (prefill of one and several packed sequences, each run through transformers alone; decode from
the cache against transformers' cached path), state continuity, padding slots, bad input, the jax
layer under jit, gradients of the native body.

The platform methods compose the kernel ops causal_conv1d and selective_scan: their cells run in
tests/sweeps/test_cells.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dualop import ops

HIDDEN, STATE, KERNEL, INNER, RANK = 16, 4, 4, 32, 3
SEQ_LENS = (5, 1, 7)


def _randomise(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Perturb every parameter (transformers' init leaves biases and norm weights at constants)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.3 if name in ("A_log", "D") or "layernorm" in name or name.endswith("bias") else 0.0
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return module.eval()


def _hf_mixer(family: str, use_bias: bool = False):
    """A tiny transformers mixer of ``family``, float32, with random weights, and the matching
    dualop torch layer loaded from its state dict."""
    from dualop.torch.layers import MambaMixer

    common = dict(hidden_size=HIDDEN, num_hidden_layers=1)
    if family == "mamba":
        from transformers import MambaConfig
        from transformers.models.mamba.modeling_mamba import MambaMixer as HF

        cfg = MambaConfig(state_size=STATE, conv_kernel=KERNEL, intermediate_size=INNER, time_step_rank=RANK,
                          use_bias=use_bias, **common)
        norm = dict(use_rms_norm=False)
    elif family == "falcon_mamba":
        from transformers import FalconMambaConfig
        from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaMixer as HF

        cfg = FalconMambaConfig(state_size=STATE, conv_kernel=KERNEL, intermediate_size=INNER, time_step_rank=RANK,
                                use_bias=use_bias, mixer_rms_eps=1e-6, **common)
        norm = dict(use_rms_norm=True, rms_norm_has_weight=False, rms_norm_eps=1e-6)
    else:
        from transformers import JambaConfig
        from transformers.models.jamba.modeling_jamba import JambaMambaMixer as HF

        cfg = JambaConfig(mamba_d_state=STATE, mamba_d_conv=KERNEL, mamba_expand=INNER // HIDDEN, mamba_dt_rank=RANK,
                          mamba_proj_bias=use_bias, rms_norm_eps=1e-6, use_mamba_kernels=False,
                          attn_layer_period=2, attn_layer_offset=1, num_attention_heads=2, num_key_value_heads=1,
                          **common)
        norm = dict(use_rms_norm=True, rms_norm_has_weight=True, rms_norm_eps=1e-6)
    if family == "falcon_mamba":
        # transformers 5.23's FalconMambaMixer initialises its weights before it creates the norms
        # it initialises, so it is built uninitialised and initialised afterwards
        hf = HF(cfg, layer_idx=0, initialize_mixer_weights=False)
        hf.init_falcon_mamba_weights()
    else:
        hf = HF(cfg, layer_idx=0)
    hf = _randomise(hf, seed=len(family) + 7 * use_bias)
    layer = MambaMixer(HIDDEN, STATE, KERNEL, INNER, RANK, use_conv_bias=True, use_bias=use_bias, **norm)
    layer.load_state_dict(hf.state_dict())
    return hf, cfg, layer


def _hf_run(hf, cfg, x: torch.Tensor, cache=None):
    """transformers on one sequence ``x [L, Hd]`` (a new cache unless given): ``(out [L, Hd],
    conv_state [I, K - 1], ssm_state [I, N], cache)``; its conv cache keeps K inputs, ours K - 1."""
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache(config=cfg)
    with torch.no_grad():
        out = hf(x[None], cache_params=cache)[0]
    conv = cache.get_conv_state(0, state_idx=0)[0, :, 1:]
    ssm = cache.get_recurrent_state(0, state_idx=0)[0]
    return out, conv, ssm, cache


def _packed(lens, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(sum(lens), HIDDEN, generator=gen)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    return x, cu


def _caches(slots, seed=None):
    if seed is None:
        return torch.zeros(slots, INNER, KERNEL - 1), torch.zeros(slots, INNER, STATE)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(slots, INNER, KERNEL - 1, generator=gen), torch.randn(slots, INNER, STATE, generator=gen)


def _assert_close(actual, expected, tol=2e-5):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


FAMILIES = ["mamba", "jamba", "falcon_mamba"]


@pytest.mark.reference
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lens", [(6,), SEQ_LENS], ids=["one", "several"])
def test_prefill_matches_transformers(family, lens):
    """Packed prefill into cache slots in a shuffled order == transformers on each sequence alone
    (outputs and both final states); an unused slot is left as it was."""
    hf, cfg, layer = _hf_mixer(family)
    x, cu = _packed(lens, seed=1)
    slots = [2, 0, 3][: len(lens)]
    conv, ssm = _caches(4, seed=5)
    untouched = [s for s in range(4) if s not in slots]
    conv0, ssm0 = conv.clone(), ssm.clone()
    with torch.no_grad():
        out, conv_out, ssm_out = layer(x, conv, ssm, cu, torch.tensor(slots, dtype=torch.int32),
                                       torch.zeros(len(lens), dtype=torch.bool))
    assert conv_out is conv and ssm_out is ssm  # torch updates the caches in place
    for b, slot in enumerate(slots):
        ref_out, ref_conv, ref_ssm, _ = _hf_run(hf, cfg, x[cu[b]:cu[b + 1]])
        _assert_close(out[cu[b]:cu[b + 1]], ref_out)
        _assert_close(conv[slot], ref_conv)
        _assert_close(ssm[slot], ref_ssm)
    _assert_close(conv[untouched], conv0[untouched], 0)
    _assert_close(ssm[untouched], ssm0[untouched], 0)


@pytest.mark.reference
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_matches_transformers_cached_path(family):
    """After a prefill, two decode steps (one token per sequence, T == B) from our caches ==
    transformers' single-token cached path (causal_conv1d_update, selective_state_update)."""
    hf, cfg, layer = _hf_mixer(family)
    x, cu = _packed(SEQ_LENS, seed=2)
    slots = torch.tensor([1, 0, 2], dtype=torch.int32)
    conv, ssm = _caches(3)
    with torch.no_grad():
        layer(x, conv, ssm, cu, slots, torch.zeros(3, dtype=torch.bool))
    hf_caches = [_hf_run(hf, cfg, x[cu[b]:cu[b + 1]])[3] for b in range(3)]
    for step in range(2):
        tokens, _ = _packed((1, 1, 1), seed=10 + step)
        with torch.no_grad():
            out, _, _ = layer(tokens, conv, ssm, torch.arange(4, dtype=torch.int32), slots,
                              torch.ones(3, dtype=torch.bool))
        for b in range(3):
            ref_out, ref_conv, ref_ssm, _ = _hf_run(hf, cfg, tokens[b:b + 1], hf_caches[b])
            _assert_close(out[b:b + 1], ref_out)
            _assert_close(conv[slots[b]], ref_conv)
            _assert_close(ssm[slots[b]], ref_ssm)


@pytest.mark.parametrize("use_rms_norm", [False, True])
def test_state_continuity(use_rms_norm):
    """One sequence in one prefill == its first part, then a continued prefill from the cache ==
    the first part, then token-by-token decode: outputs and final states."""
    op = ops.MambaMixer(HIDDEN, STATE, KERNEL, INNER, RANK, use_rms_norm=use_rms_norm)
    weights = _op_weights(seed=3, use_rms_norm=use_rms_norm)
    x, _ = _packed((11,), seed=4)
    whole = op(x, *weights, *_caches(1))
    first, second = 4, 11
    conv, ssm = _caches(1)
    parts = [op(x[:first], *weights, conv, ssm)[0],
             op(x[first:], *weights, conv, ssm, has_initial_state=torch.ones(1, dtype=torch.bool))[0]]
    _assert_close(torch.cat(parts), whole[0])
    _assert_close(conv, whole[1])
    _assert_close(ssm, whole[2])
    conv, ssm = _caches(1)
    steps = [op(x[:first], *weights, conv, ssm)[0]]
    for t in range(first, second):
        steps.append(op(x[t:t + 1], *weights, conv, ssm, has_initial_state=torch.ones(1, dtype=torch.bool))[0])
    _assert_close(torch.cat(steps), whole[0])
    _assert_close(conv, whole[1])
    _assert_close(ssm, whole[2])


def _op_weights(seed, use_rms_norm=False, use_bias=False):
    """The op's weight arguments (positionally, up to c_norm_weight), random."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.3):
        return scale * torch.randn(*shape, generator=gen)

    norms = (1 + r(RANK), 1 + r(STATE), 1 + r(STATE)) if use_rms_norm else (None, None, None)
    return (r(2 * INNER, HIDDEN), r(INNER, KERNEL), r(INNER), r(RANK + 2 * STATE, INNER), r(INNER, RANK),
            r(INNER), torch.log(torch.arange(1, STATE + 1.0)).expand(INNER, STATE) + r(INNER, STATE), 1 + r(INNER),
            r(HIDDEN, INNER), r(2 * INNER) if use_bias else None, r(HIDDEN) if use_bias else None, *norms)


def test_padding_sequences_give_zeros_and_write_no_state():
    """A sequence with slot -1 (padding) gives zero outputs even with out_proj's bias, writes no
    slot, and the others' results are those of a batch without it."""
    op = ops.MambaMixer(HIDDEN, STATE, KERNEL, INNER, RANK, use_bias=True)
    weights = _op_weights(seed=6, use_bias=True)
    x, cu = _packed((3, 2, 4), seed=7)
    conv, ssm = _caches(3, seed=8)
    conv0, ssm0 = conv.clone(), ssm.clone()
    init = torch.tensor([True, False, True])
    out, _, _ = op(x, *weights, conv, ssm, cu, torch.tensor([2, -1, 0], dtype=torch.int32), init)
    assert bool((out[3:5] == 0).all())
    _assert_close(conv[1], conv0[1], 0)
    _assert_close(ssm[1], ssm0[1], 0)
    keep = torch.cat([x[:3], x[5:]])
    conv_ref, ssm_ref = conv0.clone(), ssm0.clone()
    ref, _, _ = op(keep, *weights, conv_ref, ssm_ref, torch.tensor([0, 3, 7], dtype=torch.int32),
                   torch.tensor([2, 0], dtype=torch.int32), init[[0, 2]])
    _assert_close(torch.cat([out[:3], out[5:]]), ref)  # (other token counts: other GEMM blockings)
    _assert_close(conv, conv_ref)
    _assert_close(ssm, ssm_ref)


def test_without_caches_returns_fresh_float32_states():
    op = ops.MambaMixer(HIDDEN, STATE, KERNEL, INNER, RANK)
    weights = _op_weights(seed=9)
    x, cu = _packed((2, 3), seed=1)
    out, conv, ssm = op(x, *weights, cu_seqlens=cu)
    assert conv.shape == (2, INNER, KERNEL - 1) and ssm.shape == (2, INNER, STATE)
    assert conv.dtype == ssm.dtype == torch.float32
    conv_c, ssm_c = _caches(2)
    out_c, _, _ = op(x, *weights, conv_c, ssm_c, cu)
    _assert_close(out, out_c, 0)
    _assert_close(conv, conv_c, 0)
    _assert_close(ssm, ssm_c, 0)


@pytest.mark.parametrize("change, error, match", [
    (lambda a: a.update(hidden_states=torch.zeros(3, HIDDEN + 1)), ValueError, "'hidden_states'.*hidden_size=16"),
    (lambda a: a.update(in_proj_weight=torch.zeros(INNER, HIDDEN)), ValueError, "'in_proj_weight' has shape"),
    (lambda a: a.update(conv_bias=None), ValueError, "'conv_bias' is required"),
    (lambda a: a.update(x_proj_weight=None), ValueError, "'x_proj_weight' is required"),
    (lambda a: a.update(conv_state=torch.zeros(2, INNER, KERNEL)), ValueError, "'conv_state' has shape"),
    (lambda a: a.update(ssm_state=torch.zeros(2, INNER, STATE + 1)), ValueError, "'ssm_state' has shape"),
    (lambda a: a.update(ssm_state=torch.zeros(3, INNER, STATE)), ValueError, "3 slots but 'conv_state' has 2"),
    (lambda a: a.update(ssm_state=None), ValueError, "'conv_state' is given but 'ssm_state' is None"),
    (lambda a: a.update(conv_state=torch.zeros(2, INNER, KERNEL - 1, dtype=torch.int32)), TypeError,
     "'conv_state' has dtype int32"),
    (lambda a: a.update(dt_norm_weight=torch.ones(RANK)), ValueError, "'dt_norm_weight' must be None"),
    (lambda a: a.update(out_proj_bias=torch.zeros(HIDDEN)), ValueError, "'out_proj_bias' must be None"),
    (lambda a: a.update(state_indices=torch.tensor([0, 2], dtype=torch.int32)), ValueError, "slot 2"),
    (lambda a: a.update(cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32)), ValueError, "end at the token count"),
    (lambda a: a.update(A_log=np.zeros((INNER, STATE), np.float32)), TypeError, "'A_log' must be None, a torch"),
], ids=["hidden", "in_proj", "conv_bias", "x_proj", "conv_state_k", "ssm_state_n", "slot_counts", "one_cache",
        "cache_dtype", "norm_without_rms", "bias_without_use_bias", "slot_out_of_range", "cu_seqlens_end",
        "numpy_weight"])
def test_bad_input_names_the_op_and_argument(change, error, match):
    op = ops.MambaMixer(HIDDEN, STATE, KERNEL, INNER, RANK)
    names = ("in_proj_weight", "conv_weight", "conv_bias", "x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log",
             "D", "out_proj_weight")
    args = dict(zip(names, _op_weights(seed=0)))
    conv, ssm = _caches(2)
    args.update(hidden_states=torch.zeros(5, HIDDEN), conv_state=conv, ssm_state=ssm,
                cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32))
    change(args)
    hidden = args.pop("hidden_states")
    with pytest.raises(error, match=f"mamba_mixer: .*{match}"):
        op(hidden, **args)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="mamba_mixer: time_step_rank must be a positive int"):
        ops.MambaMixer(HIDDEN, STATE, KERNEL, INNER, 0)
    with pytest.raises(ValueError, match="mamba_mixer: activation must be 'silu' or None"):
        ops.MambaMixer(HIDDEN, STATE, KERNEL, INNER, RANK, activation="gelu")


def test_jamba_norm_weights_come_together():
    op = ops.MambaMixer(HIDDEN, STATE, KERNEL, INNER, RANK, use_rms_norm=True)
    weights = list(_op_weights(seed=0, use_rms_norm=True))
    weights[-1] = None
    with pytest.raises(ValueError, match="mamba_mixer: argument 'c_norm_weight' is None but 'dt_norm_weight'"):
        op(torch.zeros(2, HIDDEN), *weights)


@pytest.mark.reference
def test_native_gradients_match_transformers():
    """Gradients of the native body (torch autograd) w.r.t. the tokens and every weight == those of
    transformers' mixer on the same single sequence."""
    hf, cfg, layer = _hf_mixer("jamba")
    x, _ = _packed((6,), seed=12)
    probe = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(13))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (layer(xa)[0] * probe).sum().backward()
    (hf(xb[None])[0] * probe).sum().backward()
    _assert_close(xa.grad, xb.grad, 1e-4)
    ours = dict(layer.named_parameters())
    for name, p in hf.named_parameters():
        _assert_close(ours[name].grad, p.grad, 1e-4)


def _jax_layer_from(hf_layer, family):
    from dualop.jax.layers import MambaMixer

    norm = {"mamba": dict(use_rms_norm=False), "jamba": dict(use_rms_norm=True),
            "falcon_mamba": dict(use_rms_norm=True, rms_norm_has_weight=False)}[family]
    layer = MambaMixer(HIDDEN, STATE, KERNEL, INNER, RANK, **norm)
    layer.load_state_dict(hf_layer.state_dict())
    return layer


@pytest.mark.parametrize("family", ["jamba", "falcon_mamba"])
def test_jax_layer_under_jit_matches_torch(family):
    """The jax layer (loaded from the same transformers state dict) under jit: the torch layer's
    outputs and new caches; jax returns new caches and leaves its inputs alone."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    _, _, torch_layer = _hf_mixer(family)
    layer = _jax_layer_from(torch_layer, family)
    x, cu = _packed(SEQ_LENS, seed=14)
    conv, ssm = _caches(4, seed=15)
    slots = torch.tensor([3, -1, 1], dtype=torch.int32)
    init = torch.tensor([True, False, False])
    j = [jnp.asarray(a.numpy()) for a in (x, conv, ssm, cu, slots, init)]

    @nnx.jit
    def run(layer, *args):
        return layer(*args)

    out, conv_j, ssm_j = run(layer, *j)
    with torch.no_grad():
        ref = torch_layer(x, conv.clone(), ssm.clone(), cu, slots, init)
    for got, want in zip((out, conv_j, ssm_j), ref):
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(j[1]), conv.numpy())  # the input cache is unchanged
    assert isinstance(out, jax.Array)


def test_jax_native_gradient_matches_torch():
    """jax.grad of the native body (through lax.scan) w.r.t. the tokens and in_proj == torch's."""
    import jax
    import jax.numpy as jnp

    op = ops.MambaMixer(HIDDEN, STATE, KERNEL, INNER, RANK, use_rms_norm=True)
    weights = _op_weights(seed=16, use_rms_norm=True)
    x, cu = _packed((4, 3), seed=17)
    probe = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(18))
    xt, wt = x.clone().requires_grad_(), weights[0].clone().requires_grad_()
    (op.forward_native(xt, wt, *weights[1:], cu_seqlens=cu)[0] * probe).sum().backward()
    jw = [None if w is None else jnp.asarray(w.numpy()) for w in weights]

    def loss(xj, w0):
        out = op.forward_native(xj, w0, *jw[1:], cu_seqlens=jnp.asarray(cu.numpy()))[0]
        return (out * jnp.asarray(probe.numpy())).sum()

    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(x.numpy()), jw[0])
    np.testing.assert_allclose(np.asarray(gx), xt.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(gw), wt.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_jax_layer_load_state_dict_rejects_mismatches():
    from dualop.jax.layers import MambaMixer

    _, _, torch_layer = _hf_mixer("mamba")
    state = torch_layer.state_dict()
    layer = MambaMixer(HIDDEN, STATE, KERNEL, INNER, RANK, use_bias=True)
    with pytest.raises(ValueError, match="MambaMixer.load_state_dict: 'in_proj.bias' is missing"):
        layer.load_state_dict(state)
    layer = MambaMixer(HIDDEN, STATE, KERNEL + 1, INNER, RANK)
    with pytest.raises(ValueError, match="'conv1d.weight' has shape"):
        layer.load_state_dict(state)
