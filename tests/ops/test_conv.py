"""conv2d / conv3d: the native bodies against torch.nn.Conv2d/Conv3d, float64 numpy and transformers'
patch embeddings (Qwen2.5-VL, CLIP); the patch-embedding fast path runs exactly for kernel ==
stride, no padding, dilation 1, groups 1, and says why otherwise; bad input; the layers of both
frontends load a torch Conv state dict. tests/sweeps/test_cells.py checks the fast path against the native
body in every (frontend, platform) cell."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from dualop import OpsConfig, set_config, testing
from dualop.ops import Conv2dLayer, Conv3dLayer
from dualop.ops.conv import check_cases

# Constructor arguments of torch.nn.ConvNd and the op alike, with x's shape.
CONFIGS_2D = [
    ({"kernel_size": 4, "stride": 4}, (2, 3, 9, 14)),
    ({"kernel_size": (3, 2), "stride": (2, 1), "padding": (1, 2), "dilation": (1, 2), "groups": 2}, (2, 4, 7, 9)),
    ({"kernel_size": 4, "padding": "same", "dilation": 2}, (1, 4, 9, 8)),  # even kernel: uneven padding
    ({"kernel_size": 3, "padding": "valid", "bias": False}, (2, 4, 6, 5)),
    ({"kernel_size": 3, "padding": 2, "padding_mode": "reflect"}, (1, 4, 6, 7)),
    ({"kernel_size": (2, 3), "padding": "same", "padding_mode": "replicate"}, (1, 4, 5, 6)),
    ({"kernel_size": 3, "padding": 1, "padding_mode": "circular", "groups": 4}, (1, 4, 5, 6)),
]
CONFIGS_3D = [
    ({"kernel_size": (2, 4, 4), "stride": (2, 4, 4), "bias": False}, (5, 3, 2, 4, 4)),
    ({"kernel_size": (2, 3, 3), "stride": (2, 3, 3)}, (2, 3, 5, 7, 6)),
    ({"kernel_size": 3, "stride": (1, 2, 2), "padding": 1, "dilation": (2, 1, 1), "groups": 2}, (2, 4, 5, 6, 7)),
    ({"kernel_size": 3, "padding": "same", "padding_mode": "reflect"}, (1, 4, 4, 5, 6)),
]
CONFIGS = [(2, kw, shape) for kw, shape in CONFIGS_2D] + [(3, kw, shape) for kw, shape in CONFIGS_3D]


def _op_class(num_dim: int):
    return Conv2dLayer if num_dim == 2 else Conv3dLayer


def _torch_module(num_dim: int, in_channels: int, out_channels: int, kwargs: dict, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    cls = torch.nn.Conv2d if num_dim == 2 else torch.nn.Conv3d
    return cls(in_channels, out_channels, **kwargs).requires_grad_(False)


def _jax(a):
    import jax.numpy as jnp

    return None if a is None else jnp.asarray(a.detach().numpy() if hasattr(a, "detach") else a)


def _close(got, want, dtype: str = "float32"):
    result = testing.compare(testing.to_numpy(got), testing.to_numpy(want), dtype)
    assert result.ok, (result.detail, result.max_abs, result.max_rel)


@pytest.mark.reference
@pytest.mark.parametrize("num_dim, kwargs, shape", CONFIGS, ids=[f"{n}d-{i}" for i, (n, _, _) in enumerate(CONFIGS)])
def test_native_bodies_equal_torch_nn_conv(num_dim, kwargs, shape):
    """Both frontends' native bodies give torch.nn.Conv2d/Conv3d's output for the same weights."""
    import torch

    module = _torch_module(num_dim, shape[1], 8, kwargs)
    op = _op_class(num_dim)(shape[1], 8, **kwargs)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    want = module(x)
    _close(op.forward_native(x, module.weight, module.bias), want)
    _close(op.forward_native(_jax(x), _jax(module.weight), _jax(module.bias)), want)


def _numpy_conv2d(x, w, b, stride, padding, dilation, groups):
    """Direct float64 convolution: every output element as its sum over the window."""
    n, c, h, wd = x.shape
    out, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), padding[0], padding[1]))
    oh = (xp.shape[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (xp.shape[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    y = np.zeros((n, out, oh, ow))
    per_group = out // groups
    for b_, o, i, j in itertools.product(range(n), range(out), range(oh), range(ow)):
        g = o // per_group
        window = xp[b_, g * cg:(g + 1) * cg, i * stride[0]:i * stride[0] + dilation[0] * (kh - 1) + 1:dilation[0],
                    j * stride[1]:j * stride[1] + dilation[1] * (kw - 1) + 1:dilation[1]]
        y[b_, o, i, j] = np.sum(window * w[o]) + (0.0 if b is None else b[o])
    return y


@pytest.mark.reference
@pytest.mark.parametrize("kwargs", [
    {"kernel_size": (3, 2), "stride": (2, 1), "padding": (1, 2), "dilation": (1, 2), "groups": 2},
    {"kernel_size": 2, "stride": 2},
])
def test_native_bodies_equal_float64_numpy(kwargs):
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(0)
    op = Conv2dLayer(4, 6, **kwargs)
    x, w, b = rng.standard_normal((2, 4, 5, 7)), rng.standard_normal(op.weight_shape), rng.standard_normal(6)
    want = _numpy_conv2d(x, w, b, op.stride, op.padding, op.dilation, op.groups)
    got_torch = op.forward_native(*(torch.from_numpy(a) for a in (x, w, b)))
    assert np.allclose(got_torch.numpy(), want, rtol=1e-12, atol=1e-12)
    got_jax = op.forward_native(*(jnp.asarray(a, jnp.float32) for a in (x, w, b)))
    assert np.allclose(np.asarray(got_jax), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_dim, kwargs, shape", CONFIGS, ids=[f"{n}d-{i}" for i, (n, _, _) in enumerate(CONFIGS)])
@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_fast_path_runs_exactly_for_patch_embeddings(num_dim, kwargs, shape, frontend):
    """kernel == stride, no padding, dilation 1, groups 1: forward_cpu's matmul, equal to the native
    conv; anything else: the native conv, with the reason in the report."""
    import torch

    module = _torch_module(num_dim, shape[1], 8, kwargs)
    op = _op_class(num_dim)(shape[1], 8, **kwargs)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    args = (x, module.weight, module.bias)
    if frontend == "jax":
        args = tuple(_jax(a) for a in args)
    with set_config(OpsConfig(["all"])):
        got = op(*args)
        method, reason = op.last_run(frontend)
        patch = op.kernel_size == op.stride and not any(map(any, op.padding)) and op.groups == 1
        if patch and frontend == "torch" and num_dim == 2:
            # float32 conv2d with several patches per item: oneDNN's own conv is the CPU's faster path
            assert method == "forward_native" and "oneDNN's strided convolution" in reason, reason
            half = tuple(a.bfloat16() for a in args)
            op.last_fallback = None  # last_run reports a decline until this is cleared
            _close(op(*half), op.forward_native(*half), "bfloat16")
            method, reason = op.last_run(frontend)
            assert method == "forward_cpu", reason
        else:
            assert method == ("forward_cpu" if patch else "forward_native"), reason
    if not patch:
        assert "the patch-embedding matmul needs kernel_size == stride" in reason
    _close(got, op.forward_native(*args))


def test_dilated_kernel_equal_to_stride_is_not_a_patch_embedding():
    op = Conv2dLayer(3, 4, kernel_size=2, stride=2, dilation=2)
    assert "dilation (2, 2)" in op.why_not_patch_embed


def test_check_case_shapes_cover_no_item_one_item_and_ragged_sizes():
    """test_cells.py's row-shape coverage rule does not fit x's [N, C, *spatial]; its analogue here."""
    for case in check_cases():
        op = case.make_op(case.shapes[-1])
        assert any(s[0] == 0 for s in case.shapes), case.label
        assert any(s[0] == 1 for s in case.shapes), case.label
        assert any(s[0] > 1 for s in case.shapes), case.label
        if op.why_not_patch_embed is None:  # spatial sizes off the kernel's multiple: trailing rows dropped
            assert any(any(d % k for d, k in zip(s[2:], op.kernel_size)) for s in case.shapes), case.label
    assert {c.op for c in check_cases()} == {"conv2d", "conv3d"}


# --- transformers' patch embeddings ---------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_qwen2_5_vl_patch_embed(frontend):
    """Qwen2.5-VL's Qwen2_5_VisionPatchEmbed (tiny width): our Conv3dLayer layer, loaded from its
    ``proj`` state dict, on its [L, 3, 2, p, p] view of the patches, with the fast path."""
    import torch
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionPatchEmbed

    from dualop.jax import layers as jax_layers
    from dualop.torch import layers as torch_layers

    patch, temporal, channels, width = 4, 2, 3, 40
    torch.manual_seed(0)
    ref = Qwen2_5_VisionPatchEmbed(patch_size=patch, temporal_patch_size=temporal, in_channels=channels,
                                   embed_dim=width).eval()
    flat = torch.randn(6, channels * temporal * patch * patch)
    with torch.no_grad():
        want = ref(flat)
    kernel = (temporal, patch, patch)
    layer_cls = torch_layers.Conv3dLayer if frontend == "torch" else jax_layers.Conv3dLayer
    layer = layer_cls(channels, width, kernel, stride=kernel, bias=False)
    layer.load_state_dict(ref.proj.state_dict())
    x = flat.view(-1, channels, *kernel)
    with set_config(OpsConfig(["all"])):
        got = layer(x if frontend == "torch" else _jax(x))
        assert layer.op.last_run(frontend)[0] == "forward_cpu"
    _close(got.reshape(-1, width), want)


@pytest.mark.reference
@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_clip_and_siglip_patch_embedding(family, frontend):
    """CLIP's and SigLIP's vision embeddings' ``patch_embedding`` Conv2d (tiny sizes, an image size
    that is not a multiple of the patch), loaded into our Conv2dLayer layer."""
    import torch
    from transformers import CLIPVisionConfig, SiglipVisionConfig
    from transformers.models.clip.modeling_clip import CLIPVisionEmbeddings
    from transformers.models.siglip.modeling_siglip import SiglipVisionEmbeddings

    from dualop.jax import layers as jax_layers
    from dualop.torch import layers as torch_layers

    config_cls, embeddings_cls = ((CLIPVisionConfig, CLIPVisionEmbeddings) if family == "clip"
                                  else (SiglipVisionConfig, SiglipVisionEmbeddings))
    config = config_cls(hidden_size=32, num_attention_heads=4, image_size=18, patch_size=4, num_channels=3)
    torch.manual_seed(0)
    ref = embeddings_cls(config).patch_embedding.eval()
    x = torch.randn(2, 3, 18, 18)
    with torch.no_grad():
        want = ref(x)
    layer_cls = torch_layers.Conv2dLayer if frontend == "torch" else jax_layers.Conv2dLayer
    layer = layer_cls(3, 32, 4, stride=4, bias=ref.bias is not None)
    layer.load_state_dict(ref.state_dict())
    with set_config(OpsConfig(["all"])):
        got = layer(x if frontend == "torch" else _jax(x))
        # float32 torch on the CPU declines to oneDNN's conv (its faster path); bfloat16 takes the matmul
        assert layer.op.last_run(frontend)[0] == ("forward_native" if frontend == "torch" else "forward_cpu")
        _close(got, want)
        if frontend == "torch":
            ref16, layer16 = ref.to(torch.bfloat16), layer.to(torch.bfloat16)
            layer16.op.last_fallback = None  # last_run reports a decline until this is cleared
            with torch.no_grad():
                got16, want16 = layer16(x.bfloat16()), ref16(x.bfloat16())
            assert layer16.op.last_run(frontend)[0] == "forward_cpu"
            _close(got16, want16, "bfloat16")


# --- layers ---------------------------------------------------------------------------------------


def test_torch_layers_initialise_as_torch_conv_and_take_its_state_dict():
    import torch

    from dualop.torch.layers import Conv2dLayer as Layer2d, Conv3dLayer as Layer3d

    layer = Layer3d(3, 16, (2, 4, 4), stride=(2, 4, 4), params_dtype=torch.bfloat16)
    assert layer.weight.shape == (16, 3, 2, 4, 4) and layer.weight.dtype == torch.bfloat16
    bound = 1 / math.sqrt(3 * 2 * 4 * 4)
    weight = layer.weight.detach().float()
    assert float(weight.abs().max()) <= bound and float(weight.std()) > bound / 3
    module = torch.nn.Conv2d(4, 6, 3, padding=1, groups=2)
    layer = Layer2d(4, 6, 3, padding=1, groups=2)
    layer.load_state_dict(module.state_dict())
    x = torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        _close(layer(x), module(x))
    assert Layer2d(4, 6, 3, bias=False).bias is None


def test_jax_layer_under_jit_equals_torch_module():
    import jax
    import torch

    from dualop.jax.layers import Conv2dLayer as JaxLayer2d

    module = torch.nn.Conv2d(3, 8, 4, stride=4)
    layer = JaxLayer2d(3, 8, 4, stride=4)
    w0 = np.asarray(layer.weight[...])
    assert w0.shape == (8, 3, 4, 4) and np.abs(w0).max() <= 1 / math.sqrt(48)
    layer.load_state_dict(module.state_dict())
    x = torch.randn(2, 3, 8, 10)
    with torch.no_grad():
        want = module(x)
    _close(jax.jit(lambda a: layer(a))(_jax(x)), want)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_weight_loader_refuses_a_tensor_of_another_shape(frontend):
    import torch

    from dualop.jax import layers as jax_layers
    from dualop.torch import layers as torch_layers

    if frontend == "torch":
        layer = torch_layers.Conv2dLayer(3, 8, 4, stride=4)
        with pytest.raises(ValueError, match=r"Conv2dLayer.weight_loader: 'weight' has shape \(8, 3, 4, 4\)"):
            layer.weight.weight_loader(layer.weight, torch.zeros(8, 3, 4, 5))
    else:
        layer = jax_layers.Conv2dLayer(3, 8, 4, stride=4)
        with pytest.raises(ValueError, match=r"Conv2dLayer.weight_loader: 'weight' has shape \(8, 3, 4, 4\)"):
            layer.weight_loader("weight", np.zeros((8, 3, 4, 5), np.float32))


# --- bad input ------------------------------------------------------------------------------------


def test_unknown_padding_string():
    with pytest.raises(ValueError, match=r"conv2d: padding string 'full' is not one of \('same', 'valid'\)"):
        Conv2dLayer(3, 4, 3, padding="full")


def test_same_padding_with_a_stride():
    with pytest.raises(ValueError, match="conv3d: padding='same' is not supported for strided convolutions"):
        Conv3dLayer(3, 4, 3, stride=(1, 2, 1), padding="same")


def test_unknown_padding_mode():
    with pytest.raises(ValueError, match="conv2d: padding_mode 'mirror' is not one of"):
        Conv2dLayer(3, 4, 3, padding_mode="mirror")


def test_groups_must_divide_the_channels():
    with pytest.raises(ValueError, match="conv2d: groups=2 must divide in_channels=3 and out_channels=4"):
        Conv2dLayer(3, 4, 3, groups=2)


def test_kernel_size_of_the_wrong_length():
    with pytest.raises(ValueError, match="conv3d: kernel_size must be an int >= 1 or a tuple of 3 of them"):
        Conv3dLayer(3, 4, (2, 14))


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_channel_count_mismatch(frontend):
    x = testing.to_frontend(np.zeros((1, 4, 8, 8), np.float32), frontend, "float32")
    w = testing.to_frontend(np.zeros((8, 3, 4, 4), np.float32), frontend, "float32")
    with pytest.raises(ValueError, match=r"conv2d: argument 'x' has 4 channels .*expected in_channels=3"):
        Conv2dLayer(3, 8, 4, stride=4)(x, w)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_wrong_rank_of_x(frontend):
    x = testing.to_frontend(np.zeros((3, 2, 4, 4), np.float32), frontend, "float32")
    w = testing.to_frontend(np.zeros((8, 3, 2, 4, 4), np.float32), frontend, "float32")
    with pytest.raises(ValueError, match=r"conv3d: argument 'x' must be \[N, C, D, H, W\] \(5 dims\)"):
        Conv3dLayer(3, 8, (2, 4, 4), stride=(2, 4, 4))(x, w)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_weight_shape_mismatch(frontend):
    x = testing.to_frontend(np.zeros((1, 3, 8, 8), np.float32), frontend, "float32")
    w = testing.to_frontend(np.zeros((8, 3, 4, 2), np.float32), frontend, "float32")
    expected = r"conv2d: argument 'weight' has shape \(8, 3, 4, 2\); expected \(8, 3, 4, 4\)"
    with pytest.raises(ValueError, match=expected):
        Conv2dLayer(3, 8, 4, stride=4)(x, w)


def test_bias_for_an_op_built_without_one():
    import torch

    with pytest.raises(ValueError, match="conv2d: argument 'bias' must be None for an op built with bias=False"):
        Conv2dLayer(3, 8, 4, stride=4, bias=False)(torch.zeros(1, 3, 8, 8), torch.zeros(8, 3, 4, 4), torch.zeros(8))


def test_input_smaller_than_the_kernel():
    import torch

    with pytest.raises(ValueError, match=r"conv2d: argument 'x' has spatial size \(3, 8\).*dilated kernel \(4, 4\)"):
        Conv2dLayer(3, 8, 4, stride=4)(torch.zeros(1, 3, 3, 8), torch.zeros(8, 3, 4, 4))


def test_dualop_check_names_the_vendor_matmul_not_a_dualop_kernel():
    from dualop import check

    case = next(c for c in check_cases() if c.label == "conv2d[patch]")
    result = check._run_cell(case, "torch", "cpu", "bfloat16", seed=0)
    assert (result.status, result.path) == ("pass", Conv2dLayer.kernel_description)


@pytest.mark.parametrize("frontend", ["torch_xla", "torchax"])
def test_xla_device_tensors_round_once_after_the_bias(frontend):
    """bfloat16 on torch_xla / torchax: torch's conv and addmm lower there to a bfloat16 product
    plus a bfloat16 bias add (two roundings); the native body (float32, one cast) and the fast path
    (XLA's dot with float32 accumulation) round once, as oneDNN's conv on the CPU does."""
    from conftest import require_frontend

    require_frontend(frontend)
    import torch

    rng = np.random.default_rng(3)
    op = Conv2dLayer(3, 40, 4, stride=4)
    x, w, b = (testing.normal(s, rng, scale) for s, scale in (((3, 3, 10, 13), 1.0), (op.weight_shape, 0.15),
                                                                ((40,), 0.5)))
    want = op.forward_native(*(torch.from_numpy(a).to(torch.bfloat16) for a in (x, w, b)))  # torch CPU: oneDNN
    with testing.frontend_context(frontend):
        args = tuple(testing.to_frontend(a, frontend, "bfloat16") for a in (x, w, b))
        native, fast = op.forward_native(*args), op.forward_tpu(*args)
    _close(native, want, "bfloat16")
    _close(fast, want, "bfloat16")
