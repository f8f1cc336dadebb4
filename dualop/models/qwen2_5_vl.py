"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): its vision encoder and its mrope text
decoder, from dualop ops, in both frontends.

The vision encoder (``encode_images``), as transformers' ``Qwen2_5_VisionTransformerPretrainedModel``:

- ``conv3d`` patch embedding of each ``[C, temporal_patch, patch, patch]`` patch (one row of
  ``pixel_values``);
- the patches reordered window by window (``window_index``: windows of
  ``window_size // spatial_merge_size // patch_size`` merged units a side, per frame), so each
  window's tokens are contiguous;
- ``depth`` blocks: ``rms_norm`` -> fused qkv ``replicated_linear`` -> the 2-D rope (height and
  width angles side by side, from a ``get_rope`` table over ``head_dim / 2``) by ``apply_rotary_emb``
  -> ``mm_encoder_attn`` over ``cu_window_seqlens`` (blocks in ``fullatt_block_indexes``: over each
  frame, ``cu_seqlens``) -> projection; ``rms_norm`` -> SwiGLU MLP (``merged_column_parallel_linear``,
  ``silu_and_mul``, ``replicated_linear``), residual adds fused into the norms;
- the patch merger: ``rms_norm``, each ``spatial_merge_size ** 2`` neighbouring patches as one row,
  linear -> exact GELU -> linear to ``out_hidden_size``, rows put back in image order.

The index arithmetic (positions, windows, ``cu_seqlens``) depends only on ``image_grid_thw`` and
runs on the host in numpy; the arrays go to the device with the pixels, so the jax encoder is one
jitted program per image layout. The encoder's weights are replicated at tp > 1 (every rank runs it
whole); the decoder is sharded as ``llama.py``'s.

The text decoder is Qwen2's (q/k/v biases) with the multimodal rope (``MRotaryEmbedding`` from
``rope_parameters["mrope_section"]``): every step's positions are ``[3, T]`` (temporal, height,
width). A text token's three rows are equal, its index for text-only prompts; an image's tokens take
their grid coordinates, as transformers' ``get_rope_index``; tokens after the prompt continue from
its largest position + 1. ``logits(input_ids, pixel_values=, image_grid_thw=)`` puts the encoder's
rows in place of the ``image_token_id`` placeholders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dualop import ops
from dualop.backends import array_namespace
from dualop.models import params as P
from dualop.models.checkpoint import Checkpoint
from dualop.models.engine import ServingConfig, _Sequence
from dualop.models.frontends import Frontend
from dualop.models.llama import LlamaForCausalLM, rope_parameters
from dualop.models.params import _concat
from dualop.ops.activation import gelu

__all__ = ["Qwen2_5_VLForConditionalGeneration", "vision_layout", "mrope_positions"]

# Rows of the vision rope's angle table: the largest image side, in patches, the encoder takes
# (8192 patches of 14 pixels: 114688 pixels). Checked in encode_images.
VISION_MAX_GRID = 8192


def vision_layout(grid_thw: np.ndarray, spatial_merge_size: int, window_size: int,
                  patch_size: int) -> dict[str, np.ndarray]:
    """The encoder's index arrays for images of ``grid_thw`` ``[n, 3]`` (patches per side), as
    transformers computes them (``get_vision_position_ids``, ``get_vision_attention_seqlens``,
    ``get_vision_window_index``):

    - ``patch_order`` ``[N]``: the patch rows in window order (each merged unit's
      ``spatial_merge_size ** 2`` patches stay together);
    - ``rope_positions`` ``[N, 2]``: each patch's (row, column) in its frame, in window order;
    - ``cu_seqlens`` (one segment per frame) and ``cu_window_seqlens`` (one per non-empty window),
      int32 boundaries in the window-ordered sequence;
    - ``merge_order`` ``[N / merge ** 2]``: the merged rows back in image order."""
    m = spatial_merge_size
    unit = m * m
    side = window_size // m // patch_size  # merged units per window side
    window_index, positions = [], []
    cu_window, cu_full = [0], [0]
    offset = 0
    for t, h, w in (tuple(int(v) for v in row) for row in grid_thw):
        gh, gw = h // m, w // m
        # (row, column) of every patch, merged unit by merged unit (m x m blocks, row-major)
        rows = np.arange(h)[:, None].repeat(w, 1).reshape(gh, m, gw, m).transpose(0, 2, 1, 3).reshape(-1)
        cols = np.arange(w)[None, :].repeat(h, 0).reshape(gh, m, gw, m).transpose(0, 2, 1, 3).reshape(-1)
        positions.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
        # merged units grouped window by window; the grid padded to whole windows (transformers pads a
        # full empty window when a side divides evenly; empty windows drop out below)
        pad_h, pad_w = side - gh % side, side - gw % side
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        padded = np.full((t, gh + pad_h, gw + pad_w), -1, np.int64)
        padded[:, :gh, :gw] = np.arange(t * gh * gw).reshape(t, gh, gw)
        windows = padded.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, side * side)
        lengths = (windows >= 0).sum(-1).reshape(-1)
        flat = windows.reshape(-1)
        window_index.append(flat[flat >= 0] + offset)
        cu_window.extend((np.cumsum(lengths) * unit + cu_window[-1]).tolist())
        cu_full.extend(cu_full[-1] + h * w * np.arange(1, t + 1))
        offset += t * gh * gw
    window_index = np.concatenate(window_index)
    patch_order = (window_index[:, None] * unit + np.arange(unit)).reshape(-1)
    cu_window = np.asarray(cu_window, np.int64)
    keep = np.concatenate([[True], cu_window[1:] != cu_window[:-1]])  # unique_consecutive
    return dict(patch_order=patch_order, rope_positions=np.concatenate(positions)[patch_order],
                cu_seqlens=np.asarray(cu_full, np.int64), cu_window_seqlens=cu_window[keep],
                merge_order=np.argsort(window_index, kind="stable"))


def mrope_positions(ids: Sequence[int], image_token_id: int, grid_thw: np.ndarray, spatial_merge_size: int,
                    who: str = "mrope_positions") -> np.ndarray:
    """``[3, L]`` rope positions of a prompt with images (transformers' ``get_rope_index``): text
    tokens count up on all three rows; image k's ``t * (h/m) * (w/m)`` placeholder tokens (a
    contiguous run of ``image_token_id``) take ``start + (frame, row, column)`` of its merged grid,
    and the text after it continues at ``start + max(h, w) / m``. A ValueError when the runs and
    the grids disagree."""
    ids = np.asarray(ids)
    out = np.zeros((3, len(ids)), np.int64)
    m = spatial_merge_size
    pos = i = image = 0
    while i < len(ids):
        if ids[i] != image_token_id:
            out[:, i] = pos
            pos, i = pos + 1, i + 1
            continue
        if image >= len(grid_thw):
            raise ValueError(f"{who}: input_ids has more image_token_id={image_token_id} placeholders than "
                             f"image_grid_thw has images ({len(grid_thw)})")
        t, h, w = (int(v) for v in grid_thw[image])
        n = t * (h // m) * (w // m)
        run = ids[i:i + n]
        if len(run) < n or (run != image_token_id).any():
            got = int(np.argmax(np.append(run != image_token_id, True)))
            raise ValueError(f"{who}: image {image} (image_grid_thw {[t, h, w]}) needs {n} consecutive "
                             f"image_token_id={image_token_id} placeholders at input_ids[{i}:], found {got}")
        frame, row, col = np.meshgrid(np.arange(t), np.arange(h // m), np.arange(w // m), indexing="ij")
        out[:, i:i + n] = np.stack([frame, row, col]).reshape(3, n) + pos
        pos += max(h, w) // m
        i += n
        image += 1
    if image != len(grid_thw):
        raise ValueError(f"{who}: image_grid_thw has {len(grid_thw)} images but input_ids has placeholders for "
                         f"{image} (runs of image_token_id={image_token_id})")
    return out


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """Qwen2.5-VL: ``encode_images``, ``logits`` and ``generate`` (text, or text with images); see
    the module docstring."""

    architectures = ("Qwen2_5_VLForConditionalGeneration",)
    position_rows = 3

    def __init__(self, ckpt: Checkpoint, frontend: Frontend, dtype: str, serving: ServingConfig,
                 progress: Callable[[str], None] | None = None, *, weight_only: bool = False) -> None:
        # transformers >= 4.52 saved ``model.language_model.*`` / ``model.visual.*``; 5.x writes the
        # original layout (``model.*``, ``visual.*``) back, as the hub checkpoints have it.
        nested = "model.language_model.embed_tokens.weight" in ckpt.shapes
        decoder = "model.language_model." if nested else "model."
        self.embed_tensor, self.final_norm_tensor = f"{decoder}embed_tokens.weight", f"{decoder}norm.weight"
        self.layers_prefix = f"{decoder}layers."
        self.visual_prefix = "model.visual." if nested else "visual."
        super().__init__(ckpt, frontend, dtype, serving, progress, weight_only=weight_only)
        text_eos = self.text_config.get("eos_token_id")
        if not self.eos_token_ids and text_eos is not None:
            self.eos_token_ids = self._eos_ids(text_eos)
        self.visual_params = {k: v for k, v in self.params.items() if k.startswith("visual.")}
        self._encode = frontend.compile(self.encoder_forward, {k: None for k in self.visual_params}, [])

    # -- config ---------------------------------------------------------------------------------

    def parse_config(self, c: dict[str, Any]) -> None:
        name = "Qwen2_5_VLForConditionalGeneration"
        text = dict(c.get("text_config") or c)  # older checkpoints keep the text keys at the top
        text["architectures"] = c.get("architectures") or [name]
        params = rope_parameters(text)
        if params.get("rope_type", params.get("type")) == "mrope":  # the older name of default + sections
            params.pop("type", None)
            params["rope_type"] = "default"
        params.setdefault("mrope_section", [16, 24, 24])  # transformers' default
        text["rope_parameters"] = params
        text.pop("rope_scaling", None)
        super().parse_config(text)
        self.text_config = text
        self.qkv_bias, self.o_bias, self.mlp_bias = True, False, False
        self.tie = bool(c.get("tie_word_embeddings", False) or text.get("tie_word_embeddings", False))
        self.image_token_id = int(c.get("image_token_id", 151655))

        v = c.get("vision_config") or {}
        try:
            self.v_depth = int(v.get("depth", 32))
            self.v_hidden = int(v.get("hidden_size", 3584))
            self.v_intermediate = int(v.get("intermediate_size", 3420))
            self.v_heads = int(v.get("num_heads", 16))
            self.v_channels = int(v.get("in_channels", 3))
            self.v_patch = int(v.get("patch_size", 14))
            self.v_temporal = int(v.get("temporal_patch_size", 2))
            self.v_merge = int(v.get("spatial_merge_size", 2))
            self.v_window = int(v.get("window_size", 112))
            self.v_out = int(v.get("out_hidden_size", 3584))
            self.v_full = frozenset(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31)))
            self.v_theta = float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        except (TypeError, ValueError) as e:
            raise ValueError(f"from_pretrained: {name}: vision_config has a value of the wrong type ({e}); "
                             "expected ints (patch_size, temporal_patch_size as one int each)") from None
        act = v.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"from_pretrained: {name} with vision_config.hidden_act={act!r} is not supported "
                             "(silu is)")
        rope_type = (v.get("rope_parameters") or {}).get("rope_type", "axial")
        if rope_type != "axial":
            raise ValueError(f"from_pretrained: {name}: vision rope_type {rope_type!r} is not supported (axial is)")
        if self.v_hidden % self.v_heads or (self.v_hidden // self.v_heads) % 4:
            raise ValueError(f"from_pretrained: {name}: vision hidden_size={self.v_hidden} must be num_heads="
                             f"{self.v_heads} heads of a head size divisible by 4 (the 2-D rope's halves)")
        self.v_head_dim = self.v_hidden // self.v_heads
        if self.v_window // self.v_merge // self.v_patch < 1:
            raise ValueError(f"from_pretrained: {name}: vision window_size={self.v_window} is smaller than one merged "
                             f"unit (spatial_merge_size * patch_size = {self.v_merge * self.v_patch} pixels)")
        if self.v_out != self.hidden:
            raise ValueError(f"from_pretrained: {name}: vision out_hidden_size={self.v_out} must equal the text "
                             f"hidden_size={self.hidden} (the image rows replace token embeddings)")

    @property
    def vocab_size(self) -> int:
        return int(self.text_config["vocab_size"])

    @property
    def patch_features(self) -> int:
        """Values per patch: one row of ``pixel_values`` (channels x temporal x patch x patch)."""
        return self.v_channels * self.v_temporal * self.v_patch * self.v_patch

    # -- ops --------------------------------------------------------------------------------------

    def build_ops(self) -> None:
        super().build_ops()
        hid, kernel = self.v_hidden, (self.v_temporal, self.v_patch, self.v_patch)
        merged = hid * self.v_merge ** 2
        self.patch_embed = ops.Conv3dLayer(self.v_channels, hid, kernel_size=kernel, stride=kernel, bias=False)
        self.v_norm = ops.RMSNorm(hid, 1e-6)
        self.v_qkv = ops.ReplicatedLinear(hid, 3 * hid, bias=True, return_bias=False)
        self.v_rotary = ops.ApplyRotaryEmb(is_neox_style=True, enable_fp32_compute=True)
        # the 2-D rope's angles: height then width, each over head_dim / 4 frequencies of head_dim / 2
        self.v_rope = ops.get_rope(self.v_head_dim // 2, VISION_MAX_GRID, True, {"rope_theta": self.v_theta}, "float32")
        self.v_attention = ops.MMEncoderAttention(self.v_heads, self.v_head_dim)
        self.v_proj = ops.ReplicatedLinear(hid, hid, bias=True, return_bias=False)
        self.v_gate_up = ops.MergedColumnParallelLinear(hid, [self.v_intermediate] * 2, bias=True, return_bias=False,
                                                        disable_tp=True)
        self.v_down = ops.ReplicatedLinear(self.v_intermediate, hid, bias=True, return_bias=False)
        self.v_act = ops.SiluAndMul()
        self.merger_fc1 = ops.ReplicatedLinear(merged, merged, bias=True, return_bias=False)
        self.merger_fc2 = ops.ReplicatedLinear(merged, self.v_out, bias=True, return_bias=False)

    # -- parameters -------------------------------------------------------------------------------

    def param_plan(self) -> list[P.Param]:
        return super().param_plan() + self.vision_params()

    def vision_params(self) -> list[P.Param]:
        pre, hid = self.visual_prefix, self.v_hidden
        merged = hid * self.v_merge ** 2
        plan = [P.whole("visual.patch_embed", pre + "patch_embed.proj.weight", self.patch_embed.weight_shape),
                P.whole("visual.merger.norm", pre + "merger.ln_q.weight", (hid,)),
                P.whole("visual.merger.fc1", pre + "merger.mlp.0.weight", (merged, merged)),
                P.whole("visual.merger.fc1_bias", pre + "merger.mlp.0.bias", (merged,)),
                P.whole("visual.merger.fc2", pre + "merger.mlp.2.weight", (self.v_out, merged)),
                P.whole("visual.merger.fc2_bias", pre + "merger.mlp.2.bias", (self.v_out,))]
        for i in range(self.v_depth):
            b, name = f"{pre}blocks.{i}.", f"visual.{i}."
            plan += [P.whole(name + "norm1", b + "norm1.weight", (hid,)),
                     P.whole(name + "norm2", b + "norm2.weight", (hid,)),
                     P.whole(name + "qkv", b + "attn.qkv.weight", (3 * hid, hid)),
                     P.whole(name + "qkv_bias", b + "attn.qkv.bias", (3 * hid,)),
                     P.whole(name + "proj", b + "attn.proj.weight", (hid, hid)),
                     P.whole(name + "proj_bias", b + "attn.proj.bias", (hid,)),
                     P.linear(name + "gate_up", self.v_gate_up, [(b + "mlp.gate_proj.weight", 0),
                                                                 (b + "mlp.up_proj.weight", 1)]),
                     P.linear(name + "gate_up_bias", self.v_gate_up, [(b + "mlp.gate_proj.bias", 0),
                                                                      (b + "mlp.up_proj.bias", 1)], "bias"),
                     P.whole(name + "down", b + "mlp.down_proj.weight", (hid, self.v_intermediate)),
                     P.whole(name + "down_bias", b + "mlp.down_proj.bias", (hid,))]
        return plan

    # -- the vision encoder -----------------------------------------------------------------------

    def _check_grid(self, image_grid_thw: Any, who: str) -> np.ndarray:
        """``image_grid_thw`` as an int64 ``[n, 3]`` numpy array, or a ValueError saying what is wrong."""
        try:
            grid = np.asarray(image_grid_thw)
        except Exception:  # a device array numpy cannot read
            grid = np.asarray(self.frontend.to_numpy(image_grid_thw))
        if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] < 1:
            raise ValueError(f"{who}: argument 'image_grid_thw' must be [num_images, 3] (t, h, w patches per image), "
                             f"got shape {tuple(grid.shape)}")
        if not np.issubdtype(grid.dtype, np.integer):
            if not (np.issubdtype(grid.dtype, np.floating) and np.all(grid == np.round(grid))):
                raise ValueError(f"{who}: argument 'image_grid_thw' must hold integers, got dtype {grid.dtype}")
        grid = grid.astype(np.int64)
        m = self.v_merge
        bad = [row.tolist() for row in grid if row.min() < 1 or row[1] % m or row[2] % m
               or max(row[1], row[2]) > VISION_MAX_GRID]
        if bad:
            raise ValueError(f"{who}: argument 'image_grid_thw' has rows {bad[:4]}; expected t >= 1 and h, w positive "
                             f"multiples of spatial_merge_size={m}, at most {VISION_MAX_GRID}")
        return grid

    def _pixels(self, pixel_values: Any, grid: np.ndarray, who: str) -> Any:
        """``pixel_values`` checked against the grid and made the frontend's array in the model dtype."""
        fe = self.frontend
        module = type(pixel_values).__module__
        other = ("jax", "jaxlib") if fe.name == "torch" else ("torch",)
        if module.startswith(other):
            raise TypeError(f"{who}: argument 'pixel_values' is a {module.split('.')[0]} array; this model runs in "
                            f"frontend {fe.name!r} (pass its arrays or numpy)")
        shape = tuple(getattr(pixel_values, "shape", np.shape(pixel_values)))
        want = (int(grid.prod(-1).sum()), self.patch_features)
        if shape != want:
            raise ValueError(f"{who}: argument 'pixel_values' has shape {shape}; expected {want} (one row of "
                             f"channels x temporal_patch_size x patch_size**2 = {self.patch_features} values per patch, "
                             f"sum(t*h*w) = {want[0]} patches for image_grid_thw {grid.tolist()})")
        if fe.name == "torch" and not module.startswith("torch"):
            import torch

            pixel_values = torch.from_numpy(np.ascontiguousarray(pixel_values))
        return fe.cast(pixel_values, self.dtype)

    def encode_images(self, pixel_values: Any, image_grid_thw: Any) -> Any:
        """The image embeddings ``[sum(t*h*w) / spatial_merge_size**2, out_hidden_size]`` of images
        given as transformers' processor gives them: ``pixel_values`` ``[sum(t*h*w), C*T*P*P]``
        (this frontend's array or numpy) and ``image_grid_thw`` ``[num_images, 3]``. The result is
        the frontend's array in the model dtype, rows image by image in merged raster order
        (transformers' ``model.model.visual(...).pooler_output``)."""
        who = f"{self.architectures[0]}.encode_images"
        grid = self._check_grid(image_grid_thw, who)
        pixels = self._pixels(pixel_values, grid, who)
        return self._encode_checked(pixels, grid)

    def _encode_checked(self, pixels: Any, grid: np.ndarray) -> Any:
        layout = vision_layout(grid, self.v_merge, self.v_window, self.v_patch)
        batch = {k: self.frontend.int_array(v) for k, v in layout.items()}
        batch["pixel_values"] = pixels
        out, _ = self._encode(self.visual_params, batch, [])
        return out

    def encoder_forward(self, params: dict[str, Any], batch: dict[str, Any],
                        caches: list[Any]) -> tuple[Any, list[Any]]:
        """The encoder on one batch of ``vision_layout`` arrays and ``pixel_values``; the frontend
        compiles it (``caches`` is empty: the encoder keeps none)."""
        pixels = batch["pixel_values"]
        xp = array_namespace(pixels)
        n, hid, d = pixels.shape[0], self.v_hidden, self.v_head_dim
        x = pixels.reshape(n, self.v_channels, self.v_temporal, self.v_patch, self.v_patch)
        x = self.patch_embed(x, params["visual.patch_embed"]).reshape(n, hid)
        x = xp.take(x, batch["patch_order"], axis=0)
        cos, sin = self.v_rope.cos_sin(batch["rope_positions"], xp.float32)  # rows h0, w0, h1, w1, ...
        cos, sin = cos.reshape(n, d // 2), sin.reshape(n, d // 2)  # [height angles | width angles]
        residual = None
        for i in range(self.v_depth):
            p = f"visual.{i}."
            if residual is None:
                residual, h = x, self.v_norm(x, params[p + "norm1"])
            else:
                h, residual = self.v_norm(x, params[p + "norm1"], residual)
            cu = batch["cu_seqlens"] if i in self.v_full else batch["cu_window_seqlens"]
            x = self.vision_attend(p, params, h, cos, sin, cu)
            h, residual = self.v_norm(x, params[p + "norm2"], residual)
            gu = self.v_gate_up(h, params[p + "gate_up"], params[p + "gate_up_bias"])
            x = self.v_down(self.v_act(gu), params[p + "down"], params[p + "down_bias"])
        h, _ = self.v_norm(x, params["visual.merger.norm"], residual)
        h = h.reshape(n // self.v_merge ** 2, hid * self.v_merge ** 2)
        h = self.merger_fc1(h, params["visual.merger.fc1"], params["visual.merger.fc1_bias"])
        h = xp.astype(gelu(xp, xp.astype(h, xp.float32)), h.dtype)  # nn.GELU(): erf, one rounding
        h = self.merger_fc2(h, params["visual.merger.fc2"], params["visual.merger.fc2_bias"])
        return xp.take(h, batch["merge_order"], axis=0), caches

    def vision_attend(self, p: str, params: dict[str, Any], h: Any, cos: Any, sin: Any, cu_seqlens: Any) -> Any:
        """One encoder attention: fused qkv, the 2-D rope on q and k (one call), attention within
        the segments of ``cu_seqlens``, the output projection."""
        n, heads, d = h.shape[0], self.v_heads, self.v_head_dim
        qkv = self.v_qkv(h, params[p + "qkv"], params[p + "qkv_bias"])
        qk = self.v_rotary(qkv[:, :2 * heads * d].reshape(n, 2 * heads, d), cos, sin)
        q, k = qk[:, :heads].reshape(1, n, heads, d), qk[:, heads:].reshape(1, n, heads, d)
        v = qkv[:, 2 * heads * d:].reshape(1, n, heads, d)
        o = self.v_attention(q, k, v, cu_seqlens)
        return self.v_proj(o.reshape(n, heads * d), params[p + "proj"], params[p + "proj_bias"])

    # -- text with images -------------------------------------------------------------------------

    def input_embeddings(self, params: dict[str, Any], batch: dict[str, Any]) -> Any:
        x = super().input_embeddings(params, batch)
        if "mm_index" not in batch:
            return x
        xp = array_namespace(x)
        index = batch["mm_index"]  # the image row of each token, -1 for text
        rows = xp.take(batch["mm_embeds"], xp.clip(index, 0, None), axis=0)
        return xp.where((index >= 0)[:, None], rows, x)

    def token_positions(self, seq: _Sequence, start: int, n: int) -> np.ndarray:
        table = seq.extra.get("mrope_positions")
        if table is None:
            return super().token_positions(seq, start, n)
        index = np.arange(start, start + n)
        inside = index < table.shape[1]
        out = np.empty((3, n), np.int64)
        out[:, inside] = table[:, index[inside]]
        out[:, ~inside] = index[~inside] + seq.extra["mrope_delta"]  # after the prompt: from its max + 1
        return out

    def step_inputs(self, entries: list[tuple[_Sequence, int]], t_pad: int) -> dict[str, Any]:
        """A step with image placeholders gets ``mm_embeds`` (its sequences' encoder rows, stacked)
        and ``mm_index`` ``[t_pad]`` (each token's row, -1 for text); other steps get nothing, so
        text-only steps keep their programs (jax compiles one more per distinct image-row count)."""
        index = np.full(t_pad, -1, np.int32)
        tables, row, offset = [], 0, 0
        for seq, n in entries:
            rows = seq.extra.get("image_rows")
            part = None if rows is None else rows[seq.computed:seq.computed + n]
            if part is not None and (part >= 0).any():
                index[row:row + n] = np.where(part >= 0, part + offset, -1)
                tables.append(seq.extra["image_embeds"])
                offset += int(seq.extra["image_embeds"].shape[0])
            row += n
        if not tables:
            return {}
        return {"mm_index": self.frontend.int_array(index), "mm_embeds": _concat(tables, 0)}

    def logits(self, input_ids: Any, pixel_values: Any = None, image_grid_thw: Any = None) -> Any:
        """``[T, vocab]`` logits of one sequence; with ``pixel_values`` and ``image_grid_thw``
        (as ``encode_images`` takes them) the ``image_token_id`` placeholders of ``input_ids`` (one
        contiguous run of ``t*h*w / spatial_merge_size**2`` per image, in order) take the images'
        embeddings and their 3-D rope positions. Placeholders without images are refused (their
        rows would be the placeholder's embedding, not an image)."""
        who = f"{self.architectures[0]}.logits"
        ids = self._prompt_ids(input_ids)
        if pixel_values is None and image_grid_thw is None:
            if self.image_token_id in ids:
                raise ValueError(f"{who}: input_ids holds image_token_id={self.image_token_id} placeholders but no "
                                 "pixel_values / image_grid_thw were given")
            return self._sequence_logits(ids)
        if pixel_values is None or image_grid_thw is None:
            missing = "pixel_values" if pixel_values is None else "image_grid_thw"
            raise ValueError(f"{who}: argument '{missing}' is required with images (give both pixel_values and "
                             "image_grid_thw, or neither)")
        return self._sequence_logits(ids, self._encoded(ids, self._checked_images(ids, pixel_values, image_grid_thw,
                                                                                     who)))

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, *,
                 images: Sequence[tuple[Any, Any] | None] | None = None, stop_at_eos: bool = True) -> list[list[int]]:
        """Greedy decoding (``CausalLM.generate``); ``images``, when given, has one entry per prompt:
        None (text only) or ``(pixel_values, image_grid_thw)`` for that prompt's placeholders (as
        ``logits`` takes them). Every prompt and image is checked before the encoder runs."""
        name = f"{self.architectures[0]}.generate"
        seqs = self._new_sequences(prompts, max_new_tokens)
        if images is None:
            images = [None] * len(seqs)
        elif isinstance(images, (str, bytes)) or not isinstance(images, Sequence) or len(images) != len(seqs):
            raise ValueError(f"{name}: argument 'images' must be a list with one entry per prompt ({len(seqs)}), "
                             f"each None or (pixel_values, image_grid_thw); got {type(images).__name__}"
                             + (f" of length {len(images)}" if isinstance(images, Sequence) else ""))
        checked = []
        for i, (seq, image) in enumerate(zip(seqs, images)):
            who = f"{name}: prompt {i}"
            if image is None:
                if self.image_token_id in seq.tokens:
                    raise ValueError(f"{who} holds image_token_id={self.image_token_id} placeholders but images[{i}] "
                                     "is None")
                checked.append(None)
                continue
            if isinstance(image, (str, bytes)) or not isinstance(image, Sequence) or len(image) != 2:
                raise TypeError(f"{name}: images[{i}] must be None or a pair (pixel_values, image_grid_thw), got "
                                f"{type(image).__name__}")
            checked.append(self._checked_images(seq.tokens, image[0], image[1], who))
        for seq, c in zip(seqs, checked):
            if c is not None:
                seq.extra = self._encoded(seq.tokens, c)
        return self._generate(seqs, stop_at_eos)

    def _checked_images(self, ids: list[int], pixel_values: Any, image_grid_thw: Any, who: str) -> dict[str, Any]:
        """A prompt's images checked against its placeholders (nothing runs yet): the grid, the
        pixels as the frontend's array and the prompt's ``[3, L]`` positions."""
        grid = self._check_grid(image_grid_thw, who)
        pixels = self._pixels(pixel_values, grid, who)
        positions = mrope_positions(ids, self.image_token_id, grid, self.v_merge, who)
        return dict(grid=grid, pixels=pixels, positions=positions)

    def _encoded(self, ids: list[int], checked: dict[str, Any]) -> dict[str, Any]:
        """A prompt's per-sequence inputs (``_Sequence.extra``): its positions (and the offset of
        the tokens after it), the encoder's rows and which token takes which row."""
        positions = checked["positions"]
        is_image = np.asarray(ids) == self.image_token_id
        return dict(mrope_positions=positions, mrope_delta=int(positions.max()) + 1 - len(ids),
                    image_rows=np.where(is_image, np.cumsum(is_image) - 1, -1),
                    image_embeds=self._encode_checked(checked["pixels"], checked["grid"]))
