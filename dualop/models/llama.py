"""Decoder-only transformers with grouped-query attention over the paged KV cache: Llama
(llama3 rope), Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMS norms) and Qwen3-MoE (their MoE
layers: a router and ``fused_moe``).

One layer, as the reference engine runs it (every step an op of dualop's):
``rms_norm`` (fused with the residual add) -> ``qkv_parallel_linear`` -> [q/k ``rms_norm`` per
head] -> ``rotary_embedding`` (the config's ``rope_parameters`` through ``get_rope``) ->
``reshape_and_cache`` -> ``ragged_paged_attention`` -> ``row_parallel_linear`` -> ``rms_norm`` ->
MLP (``merged_column_parallel_linear`` -> ``silu_and_mul`` -> ``row_parallel_linear``) or MoE
(``replicated_linear`` router -> ``fused_moe``, experts split over the ranks on their
intermediate dim, one all-reduce). Then the final ``rms_norm``, the rows whose logits are wanted,
and ``logits_processor`` over the vocabulary-parallel LM head (tied to the embedding when the
config says so).
"""

from __future__ import annotations

from typing import Any

from dualop import ops
from dualop.backends import array_namespace
from dualop.models import params as P
from dualop.models.engine import CausalLM
from dualop.models.frontends import CacheSpec
from dualop.parallel import divide, qkv_layout

__all__ = ["LlamaForCausalLM", "Qwen3MoeForCausalLM"]


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """A config's rope settings as ``get_rope`` takes them: transformers 5's ``rope_parameters``,
    or the older ``rope_theta`` + ``rope_scaling``."""
    params = dict(config.get("rope_parameters") or {})
    if not params:
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in config and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = config["partial_rotary_factor"]
    return params


class LlamaForCausalLM(CausalLM):
    """Llama / Qwen2 / Qwen3 (dense) and, as ``Qwen3MoeForCausalLM``, Qwen3-MoE."""

    architectures = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
    qk_norm = False
    # checkpoint names: the embedding, the final norm, the prefix of layer i's tensors (other
    # families and multimodal wrappers keep the decoder elsewhere)
    embed_tensor = "model.embed_tokens.weight"
    final_norm_tensor = "model.norm.weight"
    layers_prefix = "model.layers."

    # -- config ---------------------------------------------------------------------------------

    def parse_config(self, c: dict[str, Any]) -> None:
        name = c.get("architectures", ["?"])[0]
        self.name = name
        self.hidden = int(c["hidden_size"])
        self.num_layers = int(c["num_hidden_layers"])
        self.num_heads = int(c["num_attention_heads"])
        self.num_kv_heads = int(c.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(c.get("head_dim") or self.hidden // self.num_heads)
        self.intermediate = int(c["intermediate_size"])
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        self.max_position = int(c.get("max_position_embeddings", 4096))
        self.tie = bool(c.get("tie_word_embeddings", False))
        self.qk_norm = name.startswith("Qwen3")
        self.qkv_bias = bool(c.get("attention_bias", False)) or name == "Qwen2ForCausalLM"
        self.o_bias = bool(c.get("attention_bias", False))
        self.mlp_bias = bool(c.get("mlp_bias", False))
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"from_pretrained: {name} with hidden_act={act!r} is not supported (silu is)")
        if c.get("use_sliding_window") and c.get("sliding_window"):
            raise ValueError(f"from_pretrained: {name} with use_sliding_window is not supported")
        self.rope_params = rope_parameters(c)

    def is_moe_layer(self, layer: int) -> bool:
        return False

    # -- ops --------------------------------------------------------------------------------------

    def build_ops(self) -> None:
        tp, dtype = self.tp, self.dtype
        self.embed = ops.VocabParallelEmbedding(self.vocab_size, self.hidden, tp=tp)
        self.lm_head = ops.ParallelLMHead(self.vocab_size, self.hidden, tp=tp)
        self.logits_processor = ops.LogitsProcessor(self.vocab_size, tp=tp)
        self.norm = ops.RMSNorm(self.hidden, self.eps)
        self.head_norm = ops.RMSNorm(self.head_dim, self.eps)
        self.qkv = ops.QKVParallelLinear(self.hidden, self.head_dim, self.num_heads, self.num_kv_heads,
                                         bias=self.qkv_bias, return_bias=False, tp=tp)
        layout = qkv_layout(self.num_heads, self.num_kv_heads, self.head_dim, tp.size)
        self.local_heads, self.local_kv_heads = layout.num_heads, layout.num_kv_heads
        self.o_proj = ops.RowParallelLinear(self.num_heads * self.head_dim, self.hidden, bias=self.o_bias,
                                            return_bias=False, tp=tp)
        # rope_params None: attention without positional embedding (Nemotron-H's)
        self.rope = None if self.rope_params is None else \
            ops.get_rope(self.head_dim, self.max_position, True, self.rope_params, dtype)
        self.cache_write = ops.ReshapeAndCache()
        self.attention = ops.RaggedPagedAttention()
        self.sm_scale = self.head_dim ** -0.5
        self.build_mlp_ops()

    def build_mlp_ops(self) -> None:
        """The dense MLP's ops: gate/up (one column-parallel GEMM), SiLU-and-mul, down (row-parallel)."""
        tp = self.tp
        self.gate_up = ops.MergedColumnParallelLinear(self.hidden, [self.intermediate] * 2, bias=self.mlp_bias,
                                                      return_bias=False, tp=tp)
        self.down = ops.RowParallelLinear(self.intermediate, self.hidden, bias=self.mlp_bias, return_bias=False, tp=tp)
        self.act = ops.SiluAndMul()

    # -- parameters -------------------------------------------------------------------------------

    def param_plan(self) -> list[P.Param]:
        plan = [P.vocab("embed", self.embed_tensor, self.embed),
                P.whole("norm", self.final_norm_tensor, (self.hidden,))]
        if not self.tie:
            plan.append(P.vocab("lm_head", "lm_head.weight", self.lm_head, packable=True))
        for i in range(self.num_layers):
            plan += self.layer_params(i, f"{self.layers_prefix}{i}.")
        return plan

    def layer_params(self, i: int, pre: str) -> list[P.Param]:
        plan = [P.whole(f"{i}.input_norm", pre + "input_layernorm.weight", (self.hidden,)),
                P.whole(f"{i}.post_norm", pre + "post_attention_layernorm.weight", (self.hidden,))]
        plan += self.attention_params(i, pre + "self_attn.")
        plan += self.mlp_params(i, pre + "mlp.")
        return plan

    def attention_params(self, i: int, at: str) -> list[P.Param]:
        """Layer ``i``'s attention parameters from the checkpoint tensors under ``at``."""
        plan = [P.linear(f"{i}.qkv", self.qkv, [(at + f"{x}_proj.weight", x) for x in "qkv"], packable=True),
                P.linear(f"{i}.o_proj", self.o_proj, [(at + "o_proj.weight", None)], packable=True)]
        if self.qkv_bias:
            plan.append(P.linear(f"{i}.qkv_bias", self.qkv, [(at + f"{x}_proj.bias", x) for x in "qkv"], "bias"))
        if self.o_bias:
            plan.append(P.whole(f"{i}.o_bias", at + "o_proj.bias", (self.hidden,)))
        if self.qk_norm:
            plan += [P.whole(f"{i}.q_norm", at + "q_norm.weight", (self.head_dim,)),
                     P.whole(f"{i}.k_norm", at + "k_norm.weight", (self.head_dim,))]
        return plan

    def mlp_params(self, i: int, pre: str) -> list[P.Param]:
        plan = [P.linear(f"{i}.gate_up", self.gate_up, [(pre + "gate_proj.weight", 0), (pre + "up_proj.weight", 1)],
                         packable=True),
                P.linear(f"{i}.down", self.down, [(pre + "down_proj.weight", None)], packable=True)]
        if self.mlp_bias:
            plan += [P.linear(f"{i}.gate_up_bias", self.gate_up, [(pre + "gate_proj.bias", 0), (pre + "up_proj.bias", 1)],
                              "bias"),
                     P.whole(f"{i}.down_bias", pre + "down_proj.bias", (self.hidden,))]
        return plan

    def cache_plan(self) -> list[CacheSpec]:
        s = self.serving
        shape = (s.num_pages, s.page_size, 2 * self.local_kv_heads, self.head_dim)
        return [CacheSpec(f"kv.{i}", shape, self.dtype, split_dim=2) for i in range(self.num_layers)]

    # -- the step ---------------------------------------------------------------------------------

    def forward(self, params: dict[str, Any], batch: dict[str, Any], caches: list[Any]) -> tuple[Any, list[Any]]:
        x = self.input_embeddings(params, batch)
        residual = None
        caches = list(caches)
        for i in range(self.num_layers):
            x, residual = self.layer(i, params, batch, caches, x, residual)
        x, _ = self.norm(x, params["norm"], residual)
        xp = array_namespace(x)
        rows = xp.take(x, batch["logits_indices"], axis=0)
        return self.logits_processor(params["embed" if self.tie else "lm_head"], rows), caches

    def input_embeddings(self, params: dict[str, Any], batch: dict[str, Any]) -> Any:
        """The step's ``[T, hidden]`` input rows: the token embeddings (multimodal models also
        place their encoders' outputs here)."""
        return self.embed(batch["input_ids"], params["embed"])

    def layer(self, i: int, params: dict[str, Any], batch: dict[str, Any], caches: list[Any], x: Any,
              residual: Any) -> tuple[Any, Any]:
        """Decoder layer ``i`` on the previous layer's output ``x`` and the residual stream (None
        before the first layer): ``(output, residual)``, the residual add fused into the norms."""
        h, residual = self.add_norm(x, params[f"{i}.input_norm"], residual)
        h = self.mix(i, params, batch, caches, h)
        h, residual = self.norm(h, params[f"{i}.post_norm"], residual)
        return self.mlp(i, params, h), residual

    def add_norm(self, x: Any, weight: Any, residual: Any) -> tuple[Any, Any]:
        """``(rms_norm(x + residual), x + residual)``; the first layer's residual is ``x`` itself."""
        if residual is None:
            return self.norm(x, weight), x
        return self.norm(x, weight, residual)

    def mix(self, i: int, params: dict[str, Any], batch: dict[str, Any], caches: list[Any], h: Any) -> Any:
        """Layer ``i``'s token mixer on the normed ``h`` (here attention over the layer's KV cache,
        ``caches[i]``); stores the layer's new caches in the list ``caches``."""
        h, caches[i] = self.attend(i, params, batch, caches[i], h)
        return h

    def attend(self, i: int, params: dict[str, Any], batch: dict[str, Any], cache: Any, h: Any) -> tuple[Any, Any]:
        t = h.shape[0]
        hq, hkv, d = self.local_heads, self.local_kv_heads, self.head_dim
        qkv = self.qkv(h, params[f"{i}.qkv"], params.get(f"{i}.qkv_bias"))
        q, k, v = qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d], qkv[:, (hq + hkv) * d:]
        if self.qk_norm:
            q = self.head_norm(q.reshape(t * hq, d), params[f"{i}.q_norm"]).reshape(t, hq * d)
            k = self.head_norm(k.reshape(t * hkv, d), params[f"{i}.k_norm"]).reshape(t, hkv * d)
        if self.rope is not None:
            q, k = self.rope(batch["positions"], q, k)
        write_options, read_options = self.kv_cache_options(i)
        cache = self.cache_write(k.reshape(t, hkv, d), v.reshape(t, hkv, d), cache, batch["slot_mapping"],
                                 **write_options)
        o = self.attention(q.reshape(t, hq, d), cache, batch["kv_lens"], batch["page_indices"], batch["cu_q_lens"],
                           batch["num_seqs"], sm_scale=self.sm_scale, **read_options)
        out = self.o_proj(o.reshape(t, hq * d), params[f"{i}.o_proj"])
        if self.o_bias:
            out = out + params[f"{i}.o_bias"]
        return out, cache

    def mlp(self, i: int, params: dict[str, Any], h: Any) -> Any:
        gu = self.gate_up(h, params[f"{i}.gate_up"], params.get(f"{i}.gate_up_bias"))
        out = self.down(self.act(gu), params[f"{i}.down"])
        if self.mlp_bias:
            out = out + params[f"{i}.down_bias"]
        return out


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE: Qwen3's attention; MoE layers (every ``decoder_sparse_step``-th, except
    ``mlp_only_layers``) route each token to ``num_experts_per_tok`` of ``num_experts`` experts
    (softmax, renormalised when ``norm_topk_prob``)."""

    architectures = ("Qwen3MoeForCausalLM",)

    def parse_config(self, c: dict[str, Any]) -> None:
        super().parse_config(c)
        self.num_experts = int(c.get("num_experts") or c["num_local_experts"])
        self.top_k = int(c["num_experts_per_tok"])
        self.moe_intermediate = int(c["moe_intermediate_size"])
        self.norm_topk_prob = bool(c.get("norm_topk_prob", False))
        self.sparse_step = int(c.get("decoder_sparse_step", 1))
        self.mlp_only = set(c.get("mlp_only_layers") or [])

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only and self.num_experts > 0 and (layer + 1) % self.sparse_step == 0

    def build_ops(self) -> None:
        super().build_ops()
        local = divide(self.moe_intermediate, self.tp.size, op="Qwen3MoeForCausalLM", what="moe_intermediate_size")
        self.router = ops.ReplicatedLinear(self.hidden, self.num_experts, bias=False, return_bias=False)
        self.moe = ops.FusedMoE(self.num_experts, self.top_k, self.hidden, local, renormalize=self.norm_topk_prob)

    def mlp_params(self, i: int, pre: str) -> list[P.Param]:
        if not self.is_moe_layer(i):
            return super().mlp_params(i, pre)
        e, inter, tp = range(self.num_experts), self.moe_intermediate, self.tp.size
        return [P.whole(f"{i}.router", pre + "gate.weight", (self.num_experts, self.hidden)),
                P.stacked(f"{i}.w13", [[f"{pre}experts.{x}.gate_proj.weight", f"{pre}experts.{x}.up_proj.weight"]
                                       for x in e], [(inter, self.hidden)] * 2, 0, tp),
                P.stacked(f"{i}.w2", [[f"{pre}experts.{x}.down_proj.weight"] for x in e], [(self.hidden, inter)], 1, tp)]

    def mlp(self, i: int, params: dict[str, Any], h: Any) -> Any:
        if not self.is_moe_layer(i):
            return super().mlp(i, params, h)
        router_logits = self.router(h, params[f"{i}.router"])
        return self.tp.all_reduce(self.moe(h, router_logits, params[f"{i}.w13"], params[f"{i}.w2"]))
