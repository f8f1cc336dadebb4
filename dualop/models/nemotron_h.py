"""Nemotron-H (``NemotronHForCausalLM``): a stack of single-mixer blocks, each Mamba-2, attention
or MLP, as ``layers_block_type`` (or the older ``hybrid_override_pattern``: ``M`` mamba, ``*``
attention, ``-`` MLP) lists them.

One block, as transformers' ``NemotronHBlock`` computes it: ``rms_norm`` (fused with the residual
add) -> the block's one mixer, whose output joins the residual stream:

- mamba: the ``mamba_mixer2`` op over the state caches, as in Bamba (``dualop.models.bamba``), with
  Nemotron-H's settings: intermediate ``mamba_num_heads * mamba_head_dim``, projection biases per
  ``use_bias``, norm eps ``layer_norm_epsilon`` and Δ clipped below at ``time_step_min``
  (transformers' ``(time_step_min, inf)``). dualop clips in every step, decode included, as the
  op's contract says; transformers' PyTorch decode step leaves Δ unclipped, so the two differ only
  where ``softplus(dt + dt_bias)`` falls below ``time_step_min`` in a decode step;
- attention: llama.py's attention without positional embedding (Nemotron-H has no rope) and with
  no biases;
- MLP: ``up_proj`` -> ``relu2`` (dualop's ``ReLUSquaredActivation``) -> ``down_proj``, column- then
  row-parallel.

MoE blocks (``E``, Nemotron-3's) are not supported yet: such a config is refused. Tensor
parallelism as in Bamba: mamba blocks whole on every rank, attention and MLP sharded.
"""

from __future__ import annotations

from typing import Any

from dualop import ops
from dualop.models import params as P
from dualop.models.bamba import BambaForCausalLM, config_float, mixer_params

__all__ = ["NemotronHForCausalLM"]

# transformers' layer types (and the older names and pattern letters) -> dualop's
_TYPES = {"linear_attention": "mamba", "mamba": "mamba", "M": "mamba",
          "full_attention": "attention", "attention": "attention", "*": "attention",
          "mlp": "mlp", "-": "mlp"}
_MOE = ("moe", "E")


class NemotronHForCausalLM(BambaForCausalLM):
    """Nemotron-H: Mamba-2, attention and MLP blocks (see the module docstring)."""

    architectures = ("NemotronHForCausalLM",)
    # the names transformers writes (and Nemotron-H checkpoints have): "backbone.", not "model."
    embed_tensor = "backbone.embeddings.weight"
    final_norm_tensor = "backbone.norm_f.weight"
    layers_prefix = "backbone.layers."

    # -- config ---------------------------------------------------------------------------------

    def parse_config(self, c: dict[str, Any]) -> None:
        name = self.name = c.get("architectures", ["?"])[0]
        self.layer_types = self._block_types(c)
        self.num_layers = len(self.layer_types)
        self.hidden = int(c["hidden_size"])
        self.num_heads = int(c["num_attention_heads"])
        self.num_kv_heads = int(c.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(c.get("head_dim") or self.hidden // self.num_heads)
        self.intermediate = int(c["intermediate_size"])
        self.eps = float(c.get("layer_norm_epsilon", 1e-5))
        self.max_position = int(c.get("max_position_embeddings", 4096))
        # transformers never ties Nemotron-H's LM head to the embedding (no tied-weight keys)
        self.tie, self.qk_norm, self.qkv_bias, self.o_bias = False, False, False, False
        self.mlp_bias = bool(c.get("mlp_bias", False))
        self.rope_params = None  # no positional embedding
        act = c.get("mlp_hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"from_pretrained: {name} with mlp_hidden_act={act!r} is not supported (relu2 is)")
        heads, head_dim = int(c.get("mamba_num_heads", 128)), int(c.get("mamba_head_dim", 64))
        self.mixer_config = dict(
            hidden_size=self.hidden, ssm_state_size=int(c.get("ssm_state_size", 128)),
            conv_kernel_size=int(c.get("conv_kernel", 4)), intermediate_size=heads * head_dim,
            use_conv_bias=bool(c.get("use_conv_bias", True)), use_bias=bool(c.get("use_bias", False)),
            n_groups=int(c.get("n_groups", 8)), num_heads=heads, head_dim=head_dim, rms_norm_eps=self.eps,
            activation=c.get("mamba_hidden_act", "silu"), chunk_size=int(c.get("chunk_size", 128)),
            time_step_limit=(config_float("time_step_min", c.get("time_step_min", 0.001), name), float("inf")))

    def _block_types(self, c: dict[str, Any]) -> list[str]:
        name = self.name
        kinds = c.get("layers_block_type") or c.get("layer_types")
        key = "layers_block_type"
        if kinds is None and isinstance(c.get("hybrid_override_pattern"), str):
            kinds, key = list(c["hybrid_override_pattern"]), "hybrid_override_pattern"
        if not isinstance(kinds, list) or not kinds:
            raise ValueError(f"from_pretrained: {name} config needs 'layers_block_type' (a list of layer types) or "
                             f"'hybrid_override_pattern' (a string of M, *, -), got {kinds!r}")
        for kind in kinds:
            if kind in _MOE:
                raise ValueError(f"from_pretrained: {name} config {key!r} has a MoE layer ({kind!r}); Nemotron-H's "
                                 "MoE blocks are not supported yet (mamba, attention and MLP blocks are)")
            if kind not in _TYPES:
                raise ValueError(f"from_pretrained: {name} config {key!r} holds {kind!r}; expected one of "
                                 f"{', '.join(_TYPES)}")
        return [_TYPES[kind] for kind in kinds]

    # -- ops and parameters ---------------------------------------------------------------------

    def build_mlp_ops(self) -> None:
        """The MLP blocks' ops: up (column-parallel), ``relu2``, down (row-parallel)."""
        tp = self.tp
        self.up = ops.ColumnParallelLinear(self.hidden, self.intermediate, bias=self.mlp_bias, return_bias=False,
                                           tp=tp)
        self.down = ops.RowParallelLinear(self.intermediate, self.hidden, bias=self.mlp_bias, return_bias=False, tp=tp)
        self.act = ops.ReLUSquaredActivation()

    def layer_params(self, i: int, pre: str) -> list[P.Param]:
        plan = [P.whole(f"{i}.input_norm", pre + "norm.weight", (self.hidden,))]
        kind, at = self.layer_types[i], pre + "mixer."
        if kind == "attention":
            return plan + self.attention_params(i, at)
        if kind == "mamba":
            return plan + mixer_params(self.mixer, i, at)
        plan += [P.linear(f"{i}.up", self.up, [(at + "up_proj.weight", None)]),
                 P.linear(f"{i}.down", self.down, [(at + "down_proj.weight", None)])]
        if self.mlp_bias:
            plan += [P.linear(f"{i}.up_bias", self.up, [(at + "up_proj.bias", None)], "bias"),
                     P.whole(f"{i}.down_bias", at + "down_proj.bias", (self.hidden,))]
        return plan

    # -- the step ---------------------------------------------------------------------------------

    def layer(self, i: int, params: dict[str, Any], batch: dict[str, Any], caches: list[Any], x: Any,
              residual: Any) -> tuple[Any, Any]:
        """Block ``i``: the fused residual add and norm, then its one mixer."""
        h, residual = self.add_norm(x, params[f"{i}.input_norm"], residual)
        if self.layer_types[i] == "mlp":
            return self.mlp(i, params, h), residual
        return self.mix(i, params, batch, caches, h), residual

    def mlp(self, i: int, params: dict[str, Any], h: Any) -> Any:
        out = self.down(self.act(self.up(h, params[f"{i}.up"], params.get(f"{i}.up_bias"))), params[f"{i}.down"])
        if self.mlp_bias:
            out = out + params[f"{i}.down_bias"]
        return out
