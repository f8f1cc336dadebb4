"""transformers_fused_moe's layouts and the FusedMoE layers (no transformers needed: the layouts are
built here from the engine layout with numpy; tests/ops/test_moe_references.py runs the real blocks)."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import torch

from dualop import testing
from dualop.ops import FusedMoE, TransformersFusedMoE, hf_to_engine

jnp = jax.numpy
E, K, H, I, T = 6, 2, 40, 24, 9


def _hf_from_engine(w13, w2, b13, b2, *, gated, is_transposed, is_concatenated, engine_interleaved):
    """transformers' arrays from engine-layout numpy weights (the inverse of hf_to_engine, in numpy)."""
    if gated and is_concatenated == engine_interleaved:  # re-order the gate/up rows
        def reorder(w):
            if engine_interleaved:  # engine interleaved -> transformers concatenated
                return np.concatenate([w[:, 0::2], w[:, 1::2]], axis=1)
            half = w.shape[1] // 2  # engine concatenated -> transformers interleaved
            out = np.empty_like(w)
            out[:, 0::2], out[:, 1::2] = w[:, :half], w[:, half:]
            return out
        w13, b13 = reorder(w13), reorder(b13)
    if is_transposed:
        w13, w2 = np.swapaxes(w13, 1, 2).copy(), np.swapaxes(w2, 1, 2).copy()
    return w13, w2, b13, b2


LAYOUTS = [(t, c) for t in (False, True) for c in (True, False)]


@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("activation", ["silu", "swigluoai", "relu2"])
@pytest.mark.parametrize("is_transposed, is_concatenated", LAYOUTS, ids=lambda v: str(v))
def test_every_layout_matches_fused_moe_on_the_engine_layout(frontend, activation, is_transposed, is_concatenated):
    rng = np.random.default_rng(0)
    rows = I if activation == "relu2" else 2 * I
    w13, w2 = rng.standard_normal((E, rows, H)).astype(np.float32) * H ** -0.5, rng.standard_normal((E, H, I)).astype(np.float32) * I ** -0.5
    b13, b2 = rng.standard_normal((E, rows)).astype(np.float32) * 0.1, rng.standard_normal((E, H)).astype(np.float32) * 0.1
    x, logits = rng.standard_normal((T, H)).astype(np.float32), rng.standard_normal((T, E)).astype(np.float32)
    hf = _hf_from_engine(w13, w2, b13, b2, gated=activation != "relu2", is_transposed=is_transposed,
                         is_concatenated=is_concatenated, engine_interleaved=activation == "swigluoai")
    conv = (lambda a: torch.from_numpy(np.ascontiguousarray(a))) if frontend == "torch" else jnp.asarray
    want = FusedMoE(E, K, H, I, activation=activation, has_bias=True).forward_native(
        *(conv(a) for a in (x, logits, w13, w2, b13, b2)))
    op = TransformersFusedMoE(E, K, H, I, activation=activation, has_bias=True, is_transposed=is_transposed,
                              is_concatenated=is_concatenated)
    got = op.forward_native(conv(x), conv(logits), *(conv(a) for a in hf))
    cmp = testing.compare(testing.to_numpy(got), testing.to_numpy(want), "float32")
    assert cmp.ok, (cmp.max_abs, cmp.max_rel)
    assert op.hf_shapes(E)["gate_up_proj"] == hf[0].shape and op.hf_shapes(E)["down_proj"] == hf[1].shape


def test_views_where_the_layout_is_free():
    """gpt-oss's layout (transposed, interleaved swigluoai) and Mixtral's (as is) reach the kernels
    as views of the given tensors; only a gate/up order that differs from the engine's copies."""
    gate_up, down = torch.randn(E, H, 2 * I), torch.randn(E, I, H)
    w13, w2, _, _ = hf_to_engine(gate_up, down, activation="swigluoai", is_transposed=True, is_concatenated=False)
    assert w13.data_ptr() == gate_up.data_ptr() and w2.data_ptr() == down.data_ptr()
    assert tuple(w13.shape) == (E, 2 * I, H) and tuple(w2.shape) == (E, H, I)
    plain = torch.randn(E, 2 * I, H)
    assert hf_to_engine(plain, down.mT, activation="silu")[0] is plain
    copied = hf_to_engine(plain, down.mT, activation="swigluoai", is_concatenated=True)[0]
    assert copied.data_ptr() != plain.data_ptr()
    assert torch.equal(copied[:, 0::2], plain[:, :I]) and torch.equal(copied[:, 1::2], plain[:, I:])


# ------------------------------------------------------------------------------------ layers


def _mixtral_like_state(rng, prefix="model.layers.0.mlp."):
    """A transformers-style state dict of one block (Mixtral's names and layout) plus noise."""
    return {
        f"{prefix}gate.weight": rng.standard_normal((E, H)).astype(np.float32),
        f"{prefix}experts.gate_up_proj": rng.standard_normal((E, 2 * I, H)).astype(np.float32) * H ** -0.5,
        f"{prefix}experts.down_proj": rng.standard_normal((E, H, I)).astype(np.float32) * I ** -0.5,
        "model.layers.1.mlp.experts.gate_up_proj": np.zeros((E, 2 * I, H), np.float32),
    }


def test_torch_layer_owns_frozen_engine_weights_and_loads_a_state_dict():
    from dualop.torch.layers import FusedMoE as Layer

    layer = Layer(E, K, H, I, has_bias=True, params_dtype=torch.bfloat16)
    shapes = {n: (tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters()}
    assert shapes == {"w13_weight": ((E, 2 * I, H), torch.bfloat16, False), "w2_weight": ((E, H, I), torch.bfloat16, False),
                      "w13_bias": ((E, 2 * I), torch.bfloat16, False), "w2_bias": ((E, H), torch.bfloat16, False)}
    rng = np.random.default_rng(1)
    state = {k: torch.from_numpy(v) for k, v in _mixtral_like_state(rng).items()}
    layer = Layer(E, K, H, I)
    with pytest.raises(ValueError, match="several entries named 'gate_up_proj'"):
        layer.load_hf_experts(state)
    layer.load_hf_experts(state, prefix="model.layers.0.mlp.")
    assert torch.equal(layer.w13_weight, state["model.layers.0.mlp.experts.gate_up_proj"])
    with pytest.raises(ValueError, match="the block has no expert biases but the layer was built with has_bias=True"):
        Layer(E, K, H, I, has_bias=True).load_hf_experts(state, prefix="model.layers.0.mlp.")
    x = torch.from_numpy(rng.standard_normal((2, 3, H)).astype(np.float32))
    logits = x @ state["model.layers.0.mlp.gate.weight"].T
    want = FusedMoE(E, K, H, I).forward_native(x.reshape(6, H), logits.reshape(6, E), layer.w13_weight,
                                               layer.w2_weight)
    got = layer(x, logits)
    assert got.shape == x.shape
    assert testing.compare(got.reshape(6, H).numpy(), want.numpy(), "float32").ok


def test_expert_maps_keep_the_local_experts_in_local_order():
    from dualop.torch.layers import FusedMoE as Layer

    rng = np.random.default_rng(2)
    state = {k: torch.from_numpy(v) for k, v in _mixtral_like_state(rng, prefix="").items() if "layers" not in k}
    mapping = [-1, 1, -1, 0, 2, -1]  # global 3 -> local 0, global 1 -> local 1, global 4 -> local 2
    layer = Layer(E, K, H, I, expert_map=mapping).load_hf_experts(state)
    assert layer.num_local_experts == 3 and layer.w13_weight.shape[0] == 3
    for local, global_id in enumerate((3, 1, 4)):
        assert torch.equal(layer.w13_weight[local], state["experts.gate_up_proj"][global_id])
        assert torch.equal(layer.w2_weight[local], state["experts.down_proj"][global_id])


def test_jax_layer_is_a_pytree_and_runs_under_nnx_jit():
    from flax import nnx

    from dualop.jax.layers import FusedMoE as Layer

    rng = np.random.default_rng(3)
    layer = Layer(E, K, H, I).load_hf_experts(_mixtral_like_state(rng), prefix="model.layers.0.mlp.")
    _, state = nnx.split(layer)
    leaves = {tuple(str(p) for p in path): v for path, v in nnx.to_flat_state(state)}
    assert any("w13_weight" in path for path in leaves) and any("w2_weight" in path for path in leaves)
    assert not nnx.state(layer, nnx.Param)  # frozen: no nnx.Param
    x = jnp.asarray(rng.standard_normal((2, 4, H)).astype(np.float32))
    logits = jnp.asarray(rng.standard_normal((2, 4, E)).astype(np.float32))
    got = nnx.jit(lambda m, a, b: m(a, b))(layer, x, logits)
    want = FusedMoE(E, K, H, I).forward_native(x.reshape(8, H), logits.reshape(8, E), layer.w13_weight,
                                               layer.w2_weight)
    assert got.shape == x.shape
    assert testing.compare(np.asarray(got).reshape(8, H), np.asarray(want), "float32").ok
