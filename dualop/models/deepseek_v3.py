"""DeepSeek-V3 (and V2's layout): multi-head latent attention over a paged latent cache, and MoE
layers with grouped top-k sigmoid routing, the score-correction bias and shared experts.

A layer: ``rms_norm`` -> ``multi_head_latent_attention`` (its projections, norms, DeepSeek's YaRN
rope in GPT-J pair order, ``concat_and_cache_mla`` and the attention over the cache, which holds
``kv_lora_rank + qk_rope_head_dim`` values per token; absorbed form whenever the batch holds a
decode) -> ``rms_norm`` -> the dense MLP for the first ``first_k_dense_replace`` layers, else
``fused_moe`` (``grouped_topk``: sigmoid scores, ``n_group`` groups ranked by their top-2 sum,
``topk_group`` kept, ``num_experts_per_tok`` experts picked on score + correction bias, weights the
plain scores renormalised and times ``routed_scaling_factor``) plus the shared experts' MLP. The
router runs in float32 with float32 weights, as transformers keeps them.

Tensor parallelism: attention heads split over the ranks (the op's own shard layout), the latent
cache whole on every rank; routed and shared experts split on their intermediate dim and summed
with one all-reduce.
"""

from __future__ import annotations

from typing import Any

from dualop import ops
from dualop.backends import array_namespace
from dualop.models import params as P
from dualop.models.frontends import CacheSpec
from dualop.models.llama import LlamaForCausalLM
from dualop.ops.rope_scaling import yarn_get_mscale
from dualop.parallel import divide

__all__ = ["DeepseekV3ForCausalLM"]


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    architectures = ("DeepseekV3ForCausalLM",)

    def parse_config(self, c: dict[str, Any]) -> None:
        super().parse_config(c)
        self.qk_norm = False
        self.q_lora_rank = c.get("q_lora_rank")
        self.kv_lora_rank = int(c["kv_lora_rank"])
        self.qk_nope = int(c["qk_nope_head_dim"])
        self.qk_rope = int(c["qk_rope_head_dim"])
        self.v_head = int(c["v_head_dim"])
        self.num_experts = int(c.get("n_routed_experts") or 0)
        self.top_k = int(c.get("num_experts_per_tok") or 1)
        self.moe_intermediate = int(c.get("moe_intermediate_size") or 0)
        self.n_shared = int(c.get("n_shared_experts") or 0)
        self.first_dense = int(c.get("first_k_dense_replace", 0))
        self.moe_every = int(c.get("moe_layer_freq", 1))
        self.n_group, self.topk_group = int(c.get("n_group") or 1), int(c.get("topk_group") or 1)
        self.norm_topk_prob = bool(c.get("norm_topk_prob", True))
        self.routed_scaling = float(c.get("routed_scaling_factor", 1.0))
        if c.get("topk_method", "noaux_tc") != "noaux_tc" or c.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"from_pretrained: {self.name} with topk_method={c.get('topk_method')!r} / "
                             f"scoring_func={c.get('scoring_func')!r} is not supported (noaux_tc with sigmoid is)")
        if c.get("rope_interleave", True) is False:
            raise ValueError(f"from_pretrained: {self.name} with rope_interleave=False is not supported")

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_dense and layer % self.moe_every == 0

    def _rope_and_scale(self) -> tuple[Any, float]:
        """DeepSeek's rope (YaRN as ``deepseek_yarn``, GPT-J pairs) and softmax scale:
        ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
        params = dict(self.rope_params)
        scale = (self.qk_nope + self.qk_rope) ** -0.5
        if params.get("rope_type", "default") in ("yarn", "deepseek_yarn"):
            params["rope_type"] = "deepseek_yarn"
            mscale_all_dim = params.get("mscale_all_dim", 0)
            if mscale_all_dim:
                scale *= yarn_get_mscale(params["factor"], mscale_all_dim) ** 2
        return ops.get_rope(self.qk_rope, self.max_position, False, params, self.dtype), scale

    def build_ops(self) -> None:
        tp = self.tp
        self.embed = ops.VocabParallelEmbedding(self.vocab_size, self.hidden, tp=tp)
        self.lm_head = ops.ParallelLMHead(self.vocab_size, self.hidden, tp=tp)
        self.logits_processor = ops.LogitsProcessor(self.vocab_size, tp=tp)
        self.norm = ops.RMSNorm(self.hidden, self.eps)
        rope, scale = self._rope_and_scale()
        self.mla = ops.MultiHeadLatentAttention(self.hidden, self.num_heads, scale, self.qk_nope, self.qk_rope,
                                                self.v_head, self.q_lora_rank, self.kv_lora_rank, rope, self.eps, tp=tp)
        self.local_heads = divide(self.num_heads, tp.size, op=self.name, what="num_attention_heads")
        self.gate_up = ops.MergedColumnParallelLinear(self.hidden, [self.intermediate] * 2, bias=False,
                                                      return_bias=False, tp=tp)
        self.down = ops.RowParallelLinear(self.intermediate, self.hidden, bias=False, return_bias=False, tp=tp)
        self.act = ops.SiluAndMul()
        if self.num_experts:
            local = divide(self.moe_intermediate, tp.size, op=self.name, what="moe_intermediate_size")
            self.router = ops.ReplicatedLinear(self.hidden, self.num_experts, bias=False, return_bias=False)
            self.moe = ops.FusedMoE(self.num_experts, self.top_k, self.hidden, local, renormalize=self.norm_topk_prob,
                                    use_grouped_topk=True, num_expert_group=self.n_group, topk_group=self.topk_group,
                                    scoring_func="sigmoid", routed_scaling_factor=self.routed_scaling)
            shared = self.moe_intermediate * self.n_shared
            if shared:
                self.shared_gate_up = ops.MergedColumnParallelLinear(self.hidden, [shared] * 2, bias=False,
                                                                     return_bias=False, tp=tp)
                self.shared_down = ops.RowParallelLinear(shared, self.hidden, bias=False, return_bias=False,
                                                         reduce_results=False, tp=tp)

    def keep_float32(self, name: str) -> bool:
        return name.endswith((".router", ".correction_bias"))

    def layer_params(self, i: int, pre: str) -> list[P.Param]:
        at, tp, h = pre + "self_attn.", self.tp.size, self.hidden
        heads, L, R = self.num_heads, self.kv_lora_rank, self.qk_rope
        q_out = heads * (self.qk_nope + self.qk_rope)
        plan = [P.whole(f"{i}.input_norm", pre + "input_layernorm.weight", (h,)),
                P.whole(f"{i}.post_norm", pre + "post_attention_layernorm.weight", (h,)),
                P.whole(f"{i}.kv_a_proj_with_mqa", at + "kv_a_proj_with_mqa.weight", (L + R, h)),
                P.whole(f"{i}.kv_a_layernorm", at + "kv_a_layernorm.weight", (L,)),
                P.split(f"{i}.kv_b_proj", at + "kv_b_proj.weight", (heads * (self.qk_nope + self.v_head), L), 0, tp),
                P.split(f"{i}.o_proj", at + "o_proj.weight", (h, heads * self.v_head), 1, tp)]
        if self.q_lora_rank is None:
            plan.append(P.split(f"{i}.q_proj", at + "q_proj.weight", (q_out, h), 0, tp))
        else:
            plan += [P.whole(f"{i}.q_a_proj", at + "q_a_proj.weight", (self.q_lora_rank, h)),
                     P.whole(f"{i}.q_a_layernorm", at + "q_a_layernorm.weight", (self.q_lora_rank,)),
                     P.split(f"{i}.q_b_proj", at + "q_b_proj.weight", (q_out, self.q_lora_rank), 0, tp)]
        return plan + self.mlp_params(i, pre + "mlp.")

    def mlp_params(self, i: int, pre: str) -> list[P.Param]:
        if not self.is_moe_layer(i):
            return super().mlp_params(i, pre)
        e, inter, tp, h = range(self.num_experts), self.moe_intermediate, self.tp.size, self.hidden
        plan = [P.whole(f"{i}.router", pre + "gate.weight", (self.num_experts, h)),
                P.whole(f"{i}.correction_bias", pre + "gate.e_score_correction_bias", (self.num_experts,)),
                P.stacked(f"{i}.w13", [[f"{pre}experts.{x}.gate_proj.weight", f"{pre}experts.{x}.up_proj.weight"]
                                       for x in e], [(inter, h)] * 2, 0, tp),
                P.stacked(f"{i}.w2", [[f"{pre}experts.{x}.down_proj.weight"] for x in e], [(h, inter)], 1, tp)]
        if self.n_shared:
            sp = pre + "shared_experts."
            plan += [P.linear(f"{i}.shared_gate_up", self.shared_gate_up,
                              [(sp + "gate_proj.weight", 0), (sp + "up_proj.weight", 1)]),
                     P.linear(f"{i}.shared_down", self.shared_down, [(sp + "down_proj.weight", None)])]
        return plan

    def cache_plan(self) -> list[CacheSpec]:
        s = self.serving
        shape = (s.num_pages, s.page_size, self.kv_lora_rank + self.qk_rope)
        return [CacheSpec(f"latent.{i}", shape, self.dtype) for i in range(self.num_layers)]  # whole on every rank

    _MLA_WEIGHTS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                    "kv_b_proj", "o_proj")

    def attend(self, i: int, params: dict[str, Any], batch: dict[str, Any], cache: Any, h: Any) -> tuple[Any, Any]:
        weights = {name: params[f"{i}.{name}"] for name in self._MLA_WEIGHTS if f"{i}.{name}" in params}
        fp8 = {} if self._fp8_kv is None else self._fp8_kv.latent_options(i)
        return self.mla(batch["positions"], h, weights, cache, batch["slot_mapping"], batch["kv_lens"],
                        batch["page_indices"], batch["cu_q_lens"], batch["num_seqs"], **fp8)

    def mlp(self, i: int, params: dict[str, Any], h: Any) -> Any:
        if not self.is_moe_layer(i):
            return super().mlp(i, params, h)
        xp = array_namespace(h)
        router_logits = self.router(xp.astype(h, xp.float32), params[f"{i}.router"])
        out = self.moe(h, router_logits, params[f"{i}.w13"], params[f"{i}.w2"],
                       e_score_correction_bias=params[f"{i}.correction_bias"])
        if self.n_shared:
            shared = self.shared_down(self.act(self.shared_gate_up(h, params[f"{i}.shared_gate_up"])),
                                      params[f"{i}.shared_down"])
            out = out + shared
        return self.tp.all_reduce(out)
