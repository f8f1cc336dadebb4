"""Bamba (``BambaForCausalLM``): a hybrid of Mamba-2 mixer layers and Llama attention layers, each
followed by a SwiGLU MLP.

One layer, as transformers' ``BambaDecoderLayer`` computes it: ``rms_norm`` (fused with the
residual add) -> the token mixer -> ``rms_norm`` -> MLP. The mixer is, per
``attn_layer_indices`` (or an explicit ``layers_block_type`` / ``layer_types``):

- attention: llama.py's (``LlamaForCausalLM.attend``: QKV, rope, the paged KV cache,
  ``ragged_paged_attention``); Bamba's rope rotates only the first half of each head
  (``partial_rotary_factor`` 0.5, which transformers' config hard-codes unless ``rope_parameters``
  says otherwise);
- mamba: dualop's ``mamba_mixer2`` op over two state caches, ``conv_state``
  ``[max_num_seqs, conv_dim, K-1]`` (model dtype: it holds the last inputs) and ``ssm_state``
  ``[max_num_seqs, H, P, N]`` (float32 in every model dtype: the state accumulates over all the
  tokens, and transformers' chunked scan hands it on in float32 too), one slot per batch slot,
  read and written at the step's ``state_indices`` and ``has_initial_state``; so one step mixes
  prefills, continued (chunked) prefills and decodes, as the op's serving contract allows.

Tensor parallelism: the mixer op has no sharding of its weights yet (its docstring), so at
``tp > 1`` every rank holds the mamba layers' whole weights and state caches and runs the same
mixer computation on the (replicated) residual stream; attention and MLP are sharded as in
llama.py (heads, intermediate dim, one all-reduce each).
"""

from __future__ import annotations

from typing import Any

from dualop import ops
from dualop.models import params as P
from dualop.models.frontends import CacheSpec
from dualop.models.llama import LlamaForCausalLM
from dualop.ops.mamba_mixer2 import HF_PARAMETER_NAMES

__all__ = ["BambaForCausalLM", "config_float", "mixer_params"]

# the mixer op's weight arguments, in its call order (after hidden_states)
_MIXER_WEIGHTS = ("in_proj_weight", "conv_weight", "conv_bias", "dt_bias", "A_log", "D", "norm_weight",
                  "out_proj_weight", "in_proj_bias", "out_proj_bias")
_ATTENTION = ("attention", "full_attention")
_MAMBA = ("mamba", "linear_attention")


def config_float(name: str, value: Any, model: str) -> float:
    """A float of config.json, also as transformers writes non-finite ones (``{"__float__":
    "Infinity"}``) or as a string."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"from_pretrained: {model} config {name!r} must be a number, got {value!r}") from None


def mixer_params(mixer: Any, i: int, pre: str) -> list[P.Param]:
    """The parameters ``{i}.<weight argument>`` of a ``MambaMixer2`` op from transformers' mixer
    tensors under ``pre`` (``HF_PARAMETER_NAMES``), whole on every rank; ``conv1d.weight`` is
    stored ``[C, 1, K]`` and loaded as the op's ``[C, K]``."""
    shapes = mixer.parameter_shapes()
    plan = []
    for hf, ours in HF_PARAMETER_NAMES.items():
        if ours not in shapes:
            continue
        shape = shapes[ours]
        if ours == "conv_weight":
            plan.append(P.whole(f"{i}.{ours}", pre + hf, (shape[0], 1, shape[1]), lambda w: w[:, 0]))
        else:
            plan.append(P.whole(f"{i}.{ours}", pre + hf, shape))
    return plan


class BambaForCausalLM(LlamaForCausalLM):
    """Bamba: Mamba-2 and attention layers (see the module docstring)."""

    architectures = ("BambaForCausalLM",)
    has_state_cache = True
    final_norm_tensor = "model.final_layernorm.weight"

    # -- config ---------------------------------------------------------------------------------

    def parse_config(self, c: dict[str, Any]) -> None:
        super().parse_config(c)
        name = self.name
        self.rope_params.setdefault("partial_rotary_factor", 0.5)
        self.layer_types = self._layer_types(c)
        self.mamba_heads = int(c.get("mamba_n_heads", 128))
        expand = int(c.get("mamba_expand", 2))
        self.mamba_intermediate = expand * self.hidden
        head = c.get("mamba_d_head", "auto")
        self.mamba_head_dim = self.mamba_intermediate // self.mamba_heads if head in (None, "auto") else int(head)
        if self.mamba_heads * self.mamba_head_dim != self.mamba_intermediate:
            raise ValueError(f"from_pretrained: {name} config: mamba_n_heads * mamba_d_head = {self.mamba_heads} * "
                             f"{self.mamba_head_dim} must equal mamba_expand * hidden_size = {self.mamba_intermediate}")
        limit = c.get("time_step_limit") or (0.0, float("inf"))
        if not isinstance(limit, (list, tuple)) or len(limit) != 2:
            raise ValueError(f"from_pretrained: {name} config 'time_step_limit' must be a pair [min, max], got "
                             f"{limit!r}")
        self.mixer_config = dict(
            hidden_size=self.hidden, ssm_state_size=int(c.get("mamba_d_state", 256)),
            conv_kernel_size=int(c.get("mamba_d_conv", 4)), intermediate_size=self.mamba_intermediate,
            use_conv_bias=bool(c.get("mamba_conv_bias", True)), use_bias=bool(c.get("mamba_proj_bias", False)),
            n_groups=int(c.get("mamba_n_groups", 1)), num_heads=self.mamba_heads, head_dim=self.mamba_head_dim,
            rms_norm_eps=self.eps, activation=c.get("hidden_act", "silu"),
            chunk_size=int(c.get("mamba_chunk_size", 256)),
            time_step_limit=tuple(config_float("time_step_limit", v, name) for v in limit))

    def _layer_types(self, c: dict[str, Any]) -> list[str]:
        """Each layer's kind, "attention" or "mamba": an explicit ``layers_block_type`` /
        ``layer_types`` list, else ``attn_layer_indices`` (transformers 5 derives the list from it)."""
        name = self.name
        explicit = c.get("layers_block_type") or c.get("layer_types")
        if explicit is not None:
            if not isinstance(explicit, list) or len(explicit) != self.num_layers:
                raise ValueError(f"from_pretrained: {name} config 'layers_block_type' must list one type per layer "
                                 f"({self.num_layers}), got {explicit!r}")
            bad = [t for t in explicit if t not in _ATTENTION + _MAMBA]
            if bad:
                raise ValueError(f"from_pretrained: {name} config 'layers_block_type' holds {bad[0]!r}; expected "
                                 f"one of {', '.join(_ATTENTION + _MAMBA)}")
            return ["attention" if t in _ATTENTION else "mamba" for t in explicit]
        indices = c.get("attn_layer_indices") or []
        bad = [i for i in indices if not (isinstance(i, int) and 0 <= i < self.num_layers)]
        if bad:
            raise ValueError(f"from_pretrained: {name} config 'attn_layer_indices' holds {bad[0]!r}; expected layer "
                             f"indices in [0, {self.num_layers})")
        return ["attention" if i in indices else "mamba" for i in range(self.num_layers)]

    def is_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == "attention"

    # -- ops and parameters ---------------------------------------------------------------------

    def build_ops(self) -> None:
        super().build_ops()
        self.mixer = ops.MambaMixer2(**self.mixer_config)

    def layer_params(self, i: int, pre: str) -> list[P.Param]:
        plan = [P.whole(f"{i}.input_norm", pre + "input_layernorm.weight", (self.hidden,)),
                P.whole(f"{i}.post_norm", pre + "pre_ff_layernorm.weight", (self.hidden,))]
        if self.is_attention(i):
            plan += self.attention_params(i, pre + "self_attn.")
        else:
            plan += mixer_params(self.mixer, i, pre + "mamba.")
        return plan + self.mlp_params(i, pre + "feed_forward.")

    def cache_plan(self) -> list[CacheSpec]:
        """Per layer in order: an attention layer's paged KV cache (split over the ranks on its
        heads), a mamba layer's conv and SSM state caches (whole on every rank), nothing for a
        layer without a cache; ``cache_index[i]`` says where layer i's are."""
        kv = super().cache_plan()
        slots = self.serving.max_num_seqs
        specs: list[CacheSpec] = []
        self.cache_index: list[tuple[int, ...]] = []
        for i in range(self.num_layers):
            if self.layer_types[i] == "attention":
                self.cache_index.append((len(specs),))
                specs.append(kv[i])
            elif self.layer_types[i] == "mamba":
                self.cache_index.append((len(specs), len(specs) + 1))
                specs += [CacheSpec(f"conv.{i}", (slots, *self.mixer.conv_state_shape), self.dtype),
                          CacheSpec(f"ssm.{i}", (slots, *self.mixer.ssm_state_shape), "float32")]
            else:  # a layer without a cache (Nemotron-H's MLP layers)
                self.cache_index.append(())
        return specs

    # -- the step ---------------------------------------------------------------------------------

    def forward(self, params: dict[str, Any], batch: dict[str, Any], caches: list[Any]) -> tuple[Any, list[Any]]:
        # the engine's int32 flags as the mixer op takes them (bool), once per step
        batch = dict(batch, has_initial_state=batch["has_initial_state"] != 0)
        return super().forward(params, batch, caches)

    def mix(self, i: int, params: dict[str, Any], batch: dict[str, Any], caches: list[Any], h: Any) -> Any:
        """Layer ``i``'s mixer: attention over its KV cache, or the Mamba-2 mixer over its state
        caches at the batch's slots."""
        if self.is_attention(i):
            (k,) = self.cache_index[i]
            h, caches[k] = self.attend(i, params, batch, caches[k], h)
            return h
        c, s = self.cache_index[i]
        weights = [params.get(f"{i}.{name}") for name in _MIXER_WEIGHTS]
        h, caches[c], caches[s] = self.mixer(h, *weights, conv_state=caches[c], ssm_state=caches[s],
                                             cu_seqlens=batch["cu_q_lens"], state_indices=batch["state_indices"],
                                             has_initial_state=batch["has_initial_state"])
        return h
