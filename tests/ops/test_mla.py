"""DeepSeek's multi-head latent attention: the layer ``multi_head_latent_attention`` against
transformers' ``DeepseekV3Attention`` (nobody here wrote it), its two attention forms against each
other, a mixed serving batch against each sequence run alone, tp 2 against tp 1, its platform path
against its native body; the ``ragged_paged_mla_attention`` kernels (Pallas in both interpreters,
Triton's interpreter) against the native body with several query and KV blocks and stale NaN cache
rows; and bad input refused before any kernel launches. (The check cases of both kernel ops run in
every cell through tests/sweeps/test_cells.py.)"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dualop import OpsConfig, override_platform, set_config, testing
from dualop.ops import ConcatAndCacheMLA, MultiHeadLatentAttention, RaggedPagedMLAAttention, get_rope, mla
from dualop.ops.mla import mla_batch

HIDDEN, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD = 64, 4, 32, 32, 16, 8, 16
FACTOR, ORIGINAL, THETA = 4.0, 32, 10000.0
PAGE_SIZE, NUM_PAGES = 4, 24


def _mscale(factor: float, m: float) -> float:
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_parameters(mscale_all_dim: float) -> dict:
    return {"rope_theta": THETA, "factor": FACTOR, "original_max_position_embeddings": ORIGINAL, "mscale": 1.0,
            "mscale_all_dim": mscale_all_dim, "beta_fast": 32, "beta_slow": 1}


def softmax_scale(mscale_all_dim: float) -> float:
    """DeepSeek's rule with YaRN: qk_head_dim ** -0.5 times mscale(factor, mscale_all_dim) squared."""
    return (NOPE + ROPE) ** -0.5 * _mscale(FACTOR, mscale_all_dim) ** 2


def make_layer(q_lora_rank, mscale_all_dim: float = 1.0, tp=None) -> MultiHeadLatentAttention:
    rope = get_rope(ROPE, ORIGINAL * int(FACTOR), False, {"rope_type": "deepseek_yarn", **rope_parameters(mscale_all_dim)})
    return MultiHeadLatentAttention(HIDDEN, HEADS, softmax_scale(mscale_all_dim), NOPE, ROPE, V_HEAD, q_lora_rank,
                                    KV_LORA, rope, eps=1e-6, tp=tp)


def weights_numpy(q_lora_rank, seed: int = 0) -> dict[str, np.ndarray]:
    """One layer's self_attn weights under transformers' names (torch Linear layout)."""
    rng = np.random.default_rng(seed)
    qk = NOPE + ROPE

    def linear(out, inp):
        return (rng.standard_normal((out, inp)) / math.sqrt(inp)).astype(np.float32)

    w = {"kv_a_proj_with_mqa": linear(KV_LORA + ROPE, HIDDEN), "kv_b_proj": linear(HEADS * (NOPE + V_HEAD), KV_LORA),
         "o_proj": linear(HIDDEN, HEADS * V_HEAD),
         "kv_a_layernorm": (1 + 0.2 * rng.standard_normal(KV_LORA)).astype(np.float32)}
    if q_lora_rank is None:
        w["q_proj"] = linear(HEADS * qk, HIDDEN)
    else:
        w.update(q_a_proj=linear(q_lora_rank, HIDDEN), q_b_proj=linear(HEADS * qk, q_lora_rank),
                 q_a_layernorm=(1 + 0.2 * rng.standard_normal(q_lora_rank)).astype(np.float32))
    return w


class Server:
    """A paged latent cache and each sequence's page table, as a serving engine keeps them: pages
    handed out in random order, a step's metadata built from (sequence, new tokens) pairs."""

    def __init__(self, max_seqs: int, pages_per_seq: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.table = rng.permutation(NUM_PAGES)[: max_seqs * pages_per_seq].reshape(max_seqs, pages_per_seq)
        self.table = self.table.astype(np.int32)
        self.lens = [0] * max_seqs
        self.cache = np.zeros((NUM_PAGES, PAGE_SIZE, KV_LORA + ROPE), np.float32)

    def step(self, seqs: list[int], q_lens: list[int], pad_rows: int = 1):
        """Metadata for ``q_lens[i]`` new tokens of sequence ``seqs[i]`` (then ``pad_rows`` padding
        rows, slot -1): positions, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs."""
        positions, slots = [], []
        for s, n in zip(seqs, q_lens):
            for p in range(self.lens[s], self.lens[s] + n):
                positions.append(p)
                slots.append(int(self.table[s, p // PAGE_SIZE]) * PAGE_SIZE + p % PAGE_SIZE)
            self.lens[s] += n
        positions += [0] * pad_rows
        slots += [-1] * pad_rows
        k = len(seqs)
        kv_lens = np.zeros(len(self.lens), np.int32)
        kv_lens[:k] = [self.lens[s] for s in seqs]
        table = np.zeros_like(self.table)
        table[:k] = self.table[seqs]
        cu = np.zeros(len(self.lens) + 1, np.int32)
        cu[1: k + 1] = np.cumsum(q_lens)
        cu[k + 1:] = cu[k]
        return (np.array(positions, np.int32), np.array(slots, np.int32), kv_lens, table, cu,
                np.array([k], np.int32))


def run_layer(layer, frontend, x, weights, cache, meta, *, mode="auto", native=True, dtype="float32"):
    """The layer on numpy inputs in ``frontend``; returns (out, cache) as float32 numpy."""
    positions, slots, kv_lens, table, cu, num_seqs = meta
    to = lambda a: testing.to_frontend(a, frontend, dtype)  # noqa: E731
    ints = [testing.to_frontend(testing.Pinned(a, "int32"), frontend, "int32") for a in meta]
    w = {k: to(v) for k, v in weights.items()}
    args = (ints[0], to(x), w, to(cache), *ints[1:])
    if native:
        out, pages = layer.forward_native(*args, mode=mode)
    else:
        out, pages = layer(*args, mode=mode)
    return testing.to_numpy(out), testing.to_numpy(pages)


# --- (b) against transformers' DeepseekV3Attention ---------------------------------------------------


def hf_attention(q_lora_rank, mscale_all_dim, weights):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    config = DeepseekV3Config(
        vocab_size=32, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=q_lora_rank, kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_HEAD, max_position_embeddings=int(ORIGINAL * FACTOR),
        rope_parameters={"rope_type": "yarn", **rope_parameters(mscale_all_dim)}, rope_interleave=True,
        attention_bias=False, rms_norm_eps=1e-6)
    config._attn_implementation = "eager"
    attn = DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, value in weights.items():
            getattr(attn, name).weight.copy_(torch.from_numpy(value))
    assert abs(attn.scaling - softmax_scale(mscale_all_dim)) < 1e-12  # the mscale-squared rule
    return attn, DeepseekV3RotaryEmbedding(config)


def hf_sequence(attn, rotary, x: np.ndarray) -> np.ndarray:
    """transformers on one whole sequence (causal mask), float32."""
    s = x.shape[0]
    h = torch.from_numpy(x)[None]
    cos_sin = rotary(h, torch.arange(s)[None])
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out, _ = attn(h, cos_sin, mask)
    return out[0].numpy()


@pytest.mark.reference
@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("q_lora_rank, mscale_all_dim", [(Q_LORA, 1.0), (None, 0.8)])
def test_native_matches_transformers_prefill_then_decode(q_lora_rank, mscale_all_dim, frontend):
    """Two sequences prefilled in one call (auto: expanded), then one decode step of each (auto:
    absorbed) over the paged cache, against transformers on each whole sequence. ``mscale_all_dim``
    0.8 with ``mscale`` 1 makes the cos/sin attention factor differ from 1, and both scale the softmax."""
    weights = weights_numpy(q_lora_rank)
    attn, rotary = hf_attention(q_lora_rank, mscale_all_dim, weights)
    layer = make_layer(q_lora_rank, mscale_all_dim)
    rng = np.random.default_rng(1)
    lens = [5, 3]
    xs = [rng.standard_normal((n + 1, HIDDEN)).astype(np.float32) for n in lens]  # + one decode token
    server = Server(max_seqs=3, pages_per_seq=3)
    meta = server.step([0, 1], lens)
    x = np.concatenate([xs[0][:5], xs[1][:3], np.zeros((1, HIDDEN), np.float32)])
    out, cache = run_layer(layer, frontend, x, weights, server.cache, meta)
    want = [hf_sequence(attn, rotary, xi) for xi in xs]
    np.testing.assert_allclose(out[:5], want[0][:5], rtol=1e-4, atol=2e-6)
    np.testing.assert_allclose(out[5:8], want[1][:3], rtol=1e-4, atol=2e-6)
    assert (out[8:] == 0).all()
    meta = server.step([1, 0], [1, 1])
    x = np.stack([xs[1][3], xs[0][5], np.zeros(HIDDEN, np.float32)])
    out, _ = run_layer(layer, frontend, x, weights, cache, meta)
    np.testing.assert_allclose(out[0], want[1][3], rtol=1e-4, atol=2e-6)
    np.testing.assert_allclose(out[1], want[0][5], rtol=1e-4, atol=2e-6)


@pytest.mark.reference
@pytest.mark.parametrize("q_lora_rank", [Q_LORA, None])
def test_torch_layer_loads_transformers_and_takes_the_engine_call(q_lora_rank):
    """``dualop.torch.layers.MultiHeadLatentAttention`` loads ``DeepseekV3Attention``'s state dict as
    it is and, called the engine's way, matches transformers: ``mla(positions, hidden_states)`` with no
    forward context (one sequence), then a prefill of two sequences and a decode step of each in
    forward contexts over the bound latent cache."""
    from dualop.torch import layers as tlayers
    from dualop.torch.forward_context import forward_context

    weights = weights_numpy(q_lora_rank, seed=7)
    attn, rotary = hf_attention(q_lora_rank, 0.8, weights)
    rope = get_rope(ROPE, ORIGINAL * int(FACTOR), False, {"rope_type": "deepseek_yarn", **rope_parameters(0.8)})
    layer = tlayers.MultiHeadLatentAttention(HIDDEN, HEADS, softmax_scale(0.8), NOPE, ROPE, V_HEAD, q_lora_rank,
                                             KV_LORA, rope)
    layer.load_state_dict(attn.state_dict(), strict=True)
    rng = np.random.default_rng(8)
    xs = [rng.standard_normal((n + 1, HIDDEN)).astype(np.float32) for n in (6, 2)]  # + one decode token
    want = [hf_sequence(attn, rotary, x) for x in xs]
    with torch.no_grad():
        alone = layer(torch.arange(7), torch.from_numpy(xs[0][:6 + 1]))
        np.testing.assert_allclose(alone.numpy(), want[0], rtol=1e-4, atol=2e-6)

        server = Server(max_seqs=2, pages_per_seq=3, seed=9)
        layer.kv_cache = torch.from_numpy(server.cache.copy())
        cache = layer.kv_cache
        for rows, (positions, *meta) in ((slice(0, -1), server.step([0, 1], [6, 2])),
                                         (slice(-1, None), server.step([0, 1], [1, 1]))):
            x = np.concatenate([xs[0][rows], xs[1][rows], np.zeros((1, HIDDEN), np.float32)])
            names = ("slot_mapping", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")
            with forward_context(**{k: torch.from_numpy(v) for k, v in zip(names, meta)}):
                out = layer(torch.from_numpy(positions), torch.from_numpy(x)).numpy()
            n0 = len(range(*rows.indices(7)))
            np.testing.assert_allclose(out[:n0], want[0][rows], rtol=1e-4, atol=2e-6)
            np.testing.assert_allclose(out[n0:-1], want[1][rows], rtol=1e-4, atol=2e-6)
        assert layer.kv_cache is cache and bool(cache.abs().sum() > 0)  # updated in place


# --- (c) the two attention forms; a mixed batch against each sequence alone ------------------------


@pytest.mark.parametrize("q_lora_rank", [Q_LORA, None])
def test_absorbed_equals_expanded_on_a_prefill_batch(q_lora_rank):
    weights = weights_numpy(q_lora_rank, seed=2)
    layer = make_layer(q_lora_rank)
    server = Server(max_seqs=3, pages_per_seq=3, seed=2)
    meta = server.step([0, 1, 2], [6, 1, 4])
    x = np.random.default_rng(3).standard_normal((12, HIDDEN)).astype(np.float32)
    absorbed, cache_a = run_layer(layer, "torch", x, weights, server.cache, meta, mode="absorbed")
    expanded, cache_e = run_layer(layer, "torch", x, weights, server.cache, meta, mode="expanded")
    auto, _ = run_layer(layer, "torch", x, weights, server.cache, meta)
    np.testing.assert_allclose(absorbed, expanded, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(auto, expanded)  # every sequence is prefill-only: auto expands
    np.testing.assert_array_equal(cache_a, cache_e)  # the same projections: the same cache


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_fp8_latent_cache_both_forms_agree_and_follow_the_float_cache(frontend):
    """An fp8 latent cache (the engine's fp8 MLA cache, one ``k_scale``): the write stores
    ``e4m3(row / k_scale)``; the absorbed form (reading codes) and the expanded form (dequantising
    the gathered rows first) agree, and both stay within e4m3's elementwise error (2**-4) of the
    float cache's result, normwise."""
    import ml_dtypes

    weights = weights_numpy(Q_LORA, seed=2)
    layer = make_layer(Q_LORA)
    server = Server(max_seqs=3, pages_per_seq=3, seed=2)
    meta = server.step([0, 1, 2], [6, 1, 4])
    x = np.random.default_rng(3).standard_normal((12, HIDDEN)).astype(np.float32)
    want, float_cache = run_layer(layer, frontend, x, weights, server.cache, meta)
    k_scale = 0.25
    positions, slots, *rest = (testing.to_frontend(testing.Pinned(a, "int32"), frontend, "int32") for a in meta)
    w = {k: testing.to_frontend(v, frontend, "float32") for k, v in weights.items()}
    outs = {}
    for mode in ("absorbed", "expanded"):
        cache = testing.to_frontend(server.cache, frontend, "float8_e4m3fn")  # zeros
        out, pages = layer.forward_native(positions, testing.to_frontend(x, frontend, "float32"), w, cache, slots,
                                          *rest, mode=mode, kv_cache_dtype="fp8", k_scale=k_scale)
        outs[mode] = testing.to_numpy(out)
        codes = (float_cache / k_scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        np.testing.assert_array_equal(testing.to_numpy(pages).astype(np.float32), codes)
    np.testing.assert_allclose(outs["absorbed"], outs["expanded"], rtol=2e-5, atol=1e-6)
    error = np.abs(outs["absorbed"] - want).max() / np.abs(want).max()
    assert 0 < error < 2.0 ** -4, error


def test_mixed_batch_equals_each_sequence_alone():
    """A batch mixing a decode, a prefill and a later chunk of a prompt, over one paged cache, gives
    each sequence's rows (and cache rows) as the same steps run one sequence at a time."""
    weights = weights_numpy(Q_LORA, seed=4)
    layer = make_layer(Q_LORA)
    rng = np.random.default_rng(5)
    first = {0: 7, 2: 3}  # sequences with a first chunk already cached
    steps = {0: 1, 1: 5, 2: 4}  # this step's new tokens: decode, prefill, second chunk
    x_first = {s: rng.standard_normal((n, HIDDEN)).astype(np.float32) for s, n in first.items()}
    x_step = {s: rng.standard_normal((n, HIDDEN)).astype(np.float32) for s, n in steps.items()}

    together = Server(max_seqs=3, pages_per_seq=3, seed=6)
    _, cache = run_layer(layer, "torch", np.concatenate([x_first[0], x_first[2], np.zeros((1, HIDDEN), np.float32)]),
                         weights, together.cache, together.step([0, 2], [7, 3]))
    order = [2, 0, 1]
    x = np.concatenate([x_step[s] for s in order] + [np.zeros((2, HIDDEN), np.float32)])
    out, cache = run_layer(layer, "torch", x, weights, cache, together.step(order, [steps[s] for s in order], 2))

    alone = Server(max_seqs=3, pages_per_seq=3, seed=6)  # the same page tables
    cache_alone = alone.cache
    rows = {}
    for s in (0, 2):
        _, cache_alone = run_layer(layer, "torch", x_first[s], weights, cache_alone, alone.step([s], [first[s]], 0))
    for s in order:
        rows[s], cache_alone = run_layer(layer, "torch", x_step[s], weights, cache_alone, alone.step([s], [steps[s]], 0))
    np.testing.assert_allclose(out[:-2], np.concatenate([rows[s] for s in order]), rtol=2e-5, atol=1e-6)
    assert (out[-2:] == 0).all()
    np.testing.assert_allclose(cache, cache_alone, rtol=1e-5, atol=1e-6)  # GEMMs of other row counts


def test_jit_with_traced_metadata_runs_absorbed_and_equals_eager():
    """Under jax.jit the metadata is traced, so auto runs the absorbed form; it equals the eager call
    (expanded, every sequence being prefill-only), and one program serves other batches of the shapes."""
    weights = weights_numpy(Q_LORA, seed=7)
    layer = make_layer(Q_LORA)
    server = Server(max_seqs=3, pages_per_seq=3, seed=7)
    meta = server.step([0, 1], [4, 3])
    x = np.random.default_rng(8).standard_normal((8, HIDDEN)).astype(np.float32)
    eager, cache_eager = run_layer(layer, "jax", x, weights, server.cache, meta)
    fn = jax.jit(lambda *a: layer(*a))
    w = {k: jnp.asarray(v) for k, v in weights.items()}
    got, cache = fn(jnp.asarray(meta[0]), jnp.asarray(x), w, jnp.asarray(server.cache), *map(jnp.asarray, meta[1:]))
    np.testing.assert_allclose(np.asarray(got), eager, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(cache), cache_eager, rtol=1e-5, atol=1e-6)
    meta2 = server.step([1, 0], [1, 1], pad_rows=6)
    fn(jnp.asarray(meta2[0]), jnp.asarray(x), w, cache, *map(jnp.asarray, meta2[1:]))
    assert fn._cache_size() == 1


# --- the layer's platform path (each op's kernel) against its native body ------------------------


@pytest.mark.parametrize("frontend, platform", [("torch", "cpu"), ("torch", "cuda"), ("jax", "tpu")])
@pytest.mark.parametrize("mode", ["absorbed", "expanded"])
def test_platform_path_matches_native(frontend, platform, mode):
    weights = weights_numpy(Q_LORA, seed=9)
    layer = make_layer(Q_LORA)
    server = Server(max_seqs=3, pages_per_seq=3, seed=9)
    _, cache = run_layer(layer, "torch", np.random.default_rng(9).standard_normal((6, HIDDEN)).astype(np.float32),
                         weights, server.cache, server.step([0], [5]))
    meta = server.step([1, 0], [3, 1])
    x = np.random.default_rng(10).standard_normal((5, HIDDEN)).astype(np.float32)
    want, want_cache = run_layer(layer, frontend, x, weights, cache, meta, mode=mode)
    with override_platform(platform), set_config(OpsConfig(["all"])):
        got, got_cache = run_layer(layer, frontend, x, weights, cache, meta, mode=mode, native=False)
        assert layer.last_run(frontend)[0] == f"forward_{platform}"
        attention = layer.rpa if mode == "expanded" else layer.mla  # the kernel op each form runs
        assert attention.last_run(frontend)[0] == f"forward_{platform}"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_cache, want_cache, rtol=1e-5, atol=1e-6)  # vendor GEMMs, other sums


# --- (d) tensor parallel: tp 2 over two host devices (shard_map) == tp 1 -----------------------------

_TP_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import json
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    from dualop.jax.expert_parallel import shard_map
    from dualop.jax.parallel import AxisTensorParallel
    from test_mla import HEADS, NOPE, ROPE, V_HEAD, Q_LORA, HIDDEN, Server, make_layer, weights_numpy

    results = {}
    for q_lora_rank in (Q_LORA, None):
        full = weights_numpy(q_lora_rank, seed=11)
        server = Server(max_seqs=3, pages_per_seq=3, seed=11)
        meta = [jnp.asarray(a) for a in server.step([0, 1, 2], [4, 1, 2])]
        x = jnp.asarray(np.random.default_rng(12).standard_normal((8, HIDDEN)).astype(np.float32))
        cache = jnp.asarray(server.cache)
        one = make_layer(q_lora_rank)
        want, want_cache = one(meta[0], x, {k: jnp.asarray(v) for k, v in full.items()}, cache, *meta[1:])
        half = HEADS // 2
        def split_rows(w, per_head):
            return np.stack([w[r * half * per_head:(r + 1) * half * per_head] for r in range(2)])
        sharded = {k: np.stack([v, v]) for k, v in full.items()}  # replicated, one copy per rank
        for name in ("q_b_proj", "q_proj"):
            if name in full:
                sharded[name] = split_rows(full[name], NOPE + ROPE)
        sharded["kv_b_proj"] = split_rows(full["kv_b_proj"], NOPE + V_HEAD)
        sharded["o_proj"] = np.stack([full["o_proj"][:, r * half * V_HEAD:(r + 1) * half * V_HEAD] for r in range(2)])
        two = make_layer(q_lora_rank, tp=AxisTensorParallel("tp", 2))
        mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
        names = sorted(sharded)

        def rank(*arrays):
            w = {k: a[0] for k, a in zip(names, arrays[:len(names)])}
            out, pages = two(meta[0], x, w, cache, *meta[1:])
            return out, pages[None]

        fn = shard_map(rank, mesh=mesh, in_specs=tuple(P("tp") for _ in names), out_specs=(P(), P("tp")))
        got, caches = jax.jit(fn)(*(jnp.asarray(sharded[k]) for k in names))
        results[str(q_lora_rank)] = dict(
            max_abs=float(np.abs(np.asarray(got) - np.asarray(want)).max()),
            scale=float(np.abs(np.asarray(want)).max()),
            cache_max_abs=max(float(np.abs(np.asarray(c) - np.asarray(want_cache)).max()) for c in caches),
            cache_scale=float(np.abs(np.asarray(want_cache)).max()))
    print("RESULTS " + json.dumps(results))
""")


def test_tp2_over_a_jax_mesh_equals_tp1():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                                                       os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")).split(" ", 1)[1])
    assert set(results) == {str(Q_LORA), "None"}
    for r in results.values():
        # float32 sums in another order (jit under shard_map against eager), each rank's cache whole
        assert r["cache_max_abs"] <= 1e-5 * max(1.0, r["cache_scale"]), r
        assert r["max_abs"] <= 1e-5 * max(1.0, r["scale"]), r


# --- (a) the kernels with several blocks and stale NaN cache rows ------------------------------------


def _nan_tails(q, pages, kv_lens, table, cu, num_seqs, page_size):
    """Cache rows no sequence reaches (tails of last pages, unused pages) set to NaN: a kernel that
    reads one leaks it into the output."""
    used = np.zeros(pages.shape[:2], bool)
    for i in range(int(num_seqs[0])):
        for p in range(int(kv_lens[i])):
            used[table[i, p // page_size], p % page_size] = True
    pages = pages.copy()
    pages[~used] = np.nan
    return q, pages, kv_lens, table, cu, num_seqs


def _kernel_batch(latent: int, rope: int, heads: int, page_size: int, seed: int):
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = [1, 9, 0, 1, 5], [30, 9, 4, 17, 40]
    arrays = mla_batch(rng, q_lens, kv_lens, num_tokens=18, heads=heads, latent=latent, rope_dim=rope,
                       page_size=page_size, max_seqs=6)
    return _nan_tails(*arrays, page_size)


@pytest.mark.parametrize("interpreter", ["generic", "tpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_kernel_several_blocks_matches_native(interpreter, dtype):
    from jax.experimental.pallas import tpu as pltpu

    from dualop.kernels.pallas.ragged_paged_mla_attention import MlaBlocks, ragged_paged_mla_attention

    arrays = _kernel_batch(64, 16, 4, 16, seed=1)
    q, pages, *meta = (jnp.asarray(a, dtype if a.dtype == np.float32 else None) for a in arrays)
    interpret = True if interpreter == "generic" else pltpu.InterpretParams()
    got = ragged_paged_mla_attention(q, pages, *meta, kv_lora_rank=64, sm_scale=0.1, blocks=MlaBlocks(4, 1),
                                     interpret=interpret)
    want = RaggedPagedMLAAttention(64).forward_native(q, jnp.nan_to_num(pages), *meta, sm_scale=0.1)
    got, want = testing.to_numpy(got), testing.to_numpy(want)
    assert not np.isnan(got).any()
    assert testing.compare(got, want, dtype).ok, np.abs(got - want).max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_kernel_wide_latent_matches_native(dtype):
    from dualop.kernels.cuda.ragged_paged_mla_attention import ragged_paged_mla_attention

    arrays = _kernel_batch(128, 16, 20, 8, seed=2)  # 20 heads: two head blocks, the second partial
    tdtype = getattr(torch, dtype)
    q, pages, *meta = (torch.from_numpy(a).to(tdtype) if a.dtype == np.float32 else torch.from_numpy(a)
                       for a in arrays)
    got = ragged_paged_mla_attention(q, pages, *meta, kv_lora_rank=128, sm_scale=0.1)
    want = RaggedPagedMLAAttention(128).forward_native(q, torch.nan_to_num(pages), *meta, sm_scale=0.1)
    got, want = testing.to_numpy(got), testing.to_numpy(want)
    assert not np.isnan(got).any()
    assert testing.compare(got, want, dtype).ok, np.abs(got - want).max()


def test_cpu_path_runs_long_sequences_in_query_chunks(monkeypatch):
    """Prefill rows in several score chunks and decode groups of several batches give the native rows."""
    from dualop.kernels.cpu import ragged_paged_mla_attention as cpu

    monkeypatch.setattr(cpu, "SCORE_BYTES", 4 * 4 * 48 * 3)  # three query rows per chunk
    monkeypatch.setattr(cpu, "DECODE_BATCH", 1)
    arrays = _kernel_batch(32, 8, 4, 4, seed=3)
    q, pages, *meta = (torch.from_numpy(a) for a in arrays)
    got = cpu.ragged_paged_mla_attention(q, pages, *meta, kv_lora_rank=32, sm_scale=0.2)
    want = RaggedPagedMLAAttention(32).forward_native(q, torch.nan_to_num(pages), *meta, sm_scale=0.2)
    assert testing.compare(got.numpy(), want.numpy(), "float32").ok


# --- (e) bad input: refused before any kernel launches ------------------------------------------------


@pytest.fixture
def no_kernels(monkeypatch):
    for name in ("_PALLAS_MLA", "_TRITON_MLA", "_CPU_MLA", "_PALLAS_CACHE", "_TRITON_CACHE"):
        monkeypatch.setattr(mla, name, testing.NoLaunch())


def _kernel_args():
    arrays = mla_batch(np.random.default_rng(0), [1, 3], [5, 3], num_tokens=5, heads=2, latent=16, rope_dim=8,
                       page_size=4, max_seqs=3)
    return [torch.from_numpy(a) for a in arrays]


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
@pytest.mark.parametrize("edit, words", [
    (lambda a: a.__setitem__(0, a[0][:, :, :16]), "kv_lora_rank"),  # no rope channels
    (lambda a: a.__setitem__(1, a[1][:, :, :20]), "'latent_pages'"),
    (lambda a: a.__setitem__(0, a[0].to(torch.bfloat16)), "'latent_pages'"),
    (lambda a: a[4].__setitem__(2, 0), "not non-decreasing"),
    (lambda a: a[2].__setitem__(1, 1), "kv_len >= q_len"),
    (lambda a: a[3].__setitem__((0, 0), 99), "'page_indices'"),
    (lambda a: a.__setitem__(2, a[2].to(torch.int64)), "'kv_lens'"),
])
def test_bad_kernel_input_is_refused_before_launch(edit, words, platform, no_kernels):
    args = _kernel_args()
    edit(args)
    with override_platform(platform), set_config(OpsConfig(["all"])):
        with pytest.raises((ValueError, TypeError), match="ragged_paged_mla_attention") as info:
            RaggedPagedMLAAttention(16)(*args, sm_scale=0.1)
    assert words in str(info.value), str(info.value)


def test_bad_options_and_constructor_arguments():
    args = _kernel_args()
    with pytest.raises(ValueError, match="'sm_scale'"):
        RaggedPagedMLAAttention(16)(*args, sm_scale=float("nan"))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        RaggedPagedMLAAttention(0)
    rope = get_rope(ROPE, 128, False, {"rope_type": "deepseek_yarn", **rope_parameters(1.0)})
    with pytest.raises(ValueError, match="'rope'"):
        MultiHeadLatentAttention(HIDDEN, HEADS, 0.1, NOPE, 16, V_HEAD, None, KV_LORA, rope)
    with pytest.raises(TypeError, match="'rope'"):
        MultiHeadLatentAttention(HIDDEN, HEADS, 0.1, NOPE, ROPE, V_HEAD, None, KV_LORA, object())
    with pytest.raises(ValueError, match="'scale'"):
        MultiHeadLatentAttention(HIDDEN, HEADS, 0.0, NOPE, ROPE, V_HEAD, None, KV_LORA, rope)
    from dualop.parallel import TensorParallel

    class Three(TensorParallel):
        size = 3

    with pytest.raises(ValueError, match="num_heads"):
        MultiHeadLatentAttention(HIDDEN, HEADS, 0.1, NOPE, ROPE, V_HEAD, None, KV_LORA, rope, tp=Three())


def test_bad_cache_write_input(no_kernels):
    kv_c, k_pe = torch.zeros(3, 16), torch.zeros(3, 8)
    cache = torch.zeros(4, 4, 24)
    slots = torch.tensor([0, 5, -1], dtype=torch.int32)
    op = ConcatAndCacheMLA()
    with override_platform("cuda"), set_config(OpsConfig(["all"])):
        with pytest.raises(ValueError, match="concat_and_cache_mla: argument 'k_pe'"):
            op(kv_c, k_pe[:2], cache, slots)
        with pytest.raises(ValueError, match="'latent_pages'"):
            op(kv_c, k_pe, cache[:, :, :20], slots)
        with pytest.raises(ValueError, match="slot 99"):
            op(kv_c, k_pe, cache, torch.tensor([0, 99, -1], dtype=torch.int32))


def test_odd_latent_row_cache_write_runs_native_and_says_why():
    op = ConcatAndCacheMLA()
    kv_c, k_pe, cache = torch.randn(2, 16), torch.randn(2, 7), torch.zeros(2, 4, 23)
    with override_platform("cpu"), set_config(OpsConfig(["all"])):
        op.last_fallback = None
        out = op(kv_c, k_pe, cache, torch.tensor([1, 6], dtype=torch.int32))
        method, reason = op.last_run("torch")
    assert method == "forward_native" and "odd" in reason
    assert torch.equal(out[0, 1], torch.cat([kv_c[0], k_pe[0]])) and torch.equal(out[1, 2], torch.cat([kv_c[1], k_pe[1]]))


@pytest.mark.parametrize("edit, error, words", [
    (lambda w, a: w.pop("kv_b_proj"), ValueError, "missing ['kv_b_proj']"),
    (lambda w, a: w.__setitem__("q_proj", w["q_b_proj"]), ValueError, "unexpected ['q_proj']"),
    (lambda w, a: w.__setitem__("o_proj", w["o_proj"][:, :8]), ValueError, "weights['o_proj']"),
    (lambda w, a: w.__setitem__("kv_a_layernorm", w["kv_a_layernorm"].to(torch.bfloat16)), TypeError,
     "weights['kv_a_layernorm']"),
    (lambda w, a: a.__setitem__(3, a[3][:, :, :30]), ValueError, "'latent_pages'"),
    (lambda w, a: a.__setitem__(1, a[1][:, :60]), ValueError, "'hidden_states'"),
    (lambda w, a: a.__setitem__(0, a[0][:-1]), ValueError, "'positions'"),
    (lambda w, a: a.__setitem__(2, list(w.values())), TypeError, "'weights' must be a dict"),
    (lambda w, a: a[7].__setitem__(2, 0), ValueError, "not non-decreasing"),
])
def test_bad_layer_input_is_refused_before_launch(edit, error, words, no_kernels):
    weights = {k: torch.from_numpy(v) for k, v in weights_numpy(Q_LORA).items()}
    server = Server(max_seqs=3, pages_per_seq=3)
    positions, slots, *meta = (torch.from_numpy(a) for a in server.step([0, 1], [3, 2]))
    args = [positions, torch.zeros(6, HIDDEN), weights, torch.zeros(NUM_PAGES, PAGE_SIZE, KV_LORA + ROPE), slots,
            *meta]
    edit(weights, args)
    layer = make_layer(Q_LORA)
    with override_platform("cpu"), set_config(OpsConfig(["all"])):
        with pytest.raises(error, match="multi_head_latent_attention") as info:
            layer(*args)
    assert words in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="'mode'"):
        make_layer(Q_LORA)(positions, torch.zeros(6, HIDDEN), {k: torch.from_numpy(v) for k, v in
                                                               weights_numpy(Q_LORA).items()},
                           torch.zeros(NUM_PAGES, PAGE_SIZE, KV_LORA + ROPE), slots, *meta, mode="flash")


@pytest.mark.parametrize("cache_dtype, options, words", [
    (torch.float32, dict(kv_cache_dtype="fp8"), "'kv_cache_dtype' is 'fp8' (a float8_e4m3fn cache) but 'latent_pages'"),
    (torch.float8_e4m3fn, {}, "'kv_cache_dtype' is 'auto'"),
    (torch.float8_e5m2, dict(kv_cache_dtype="fp8_e4m3"), "'latent_pages' has dtype float8_e5m2"),
    (torch.float8_e4m3fn, dict(kv_cache_dtype="fp8", k_scale=0.0), "'k_scale'"),
    (torch.float8_e4m3fn, dict(kv_cache_dtype="int8"), "'kv_cache_dtype' is 'int8'"),
])
def test_bad_fp8_cache_options_are_refused_before_the_write(cache_dtype, options, words, no_kernels):
    weights = {k: torch.from_numpy(v) for k, v in weights_numpy(Q_LORA).items()}
    positions, slots, *meta = (torch.from_numpy(a) for a in Server(max_seqs=3, pages_per_seq=3).step([0], [3]))
    cache = torch.zeros(NUM_PAGES, PAGE_SIZE, KV_LORA + ROPE).to(cache_dtype)
    with override_platform("cpu"), set_config(OpsConfig(["all"])):
        with pytest.raises(ValueError, match="multi_head_latent_attention") as info:
            make_layer(Q_LORA)(positions, torch.ones(4, HIDDEN), weights, cache, slots, *meta, **options)
    assert words in str(info.value), str(info.value)
    assert not cache.float().any()  # refused before the cache write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("page_size", [4, 16])  # 16: float32 rows are read in their pages
def test_cpu_decode_kernel_takes_the_short_sequences_and_matches_native(dtype, page_size, monkeypatch, cpu_kernels):
    """The C++ decode kernel (kernels/cpu/ragged_paged_mla_attention.py) serves every sequence of
    1-4 query rows, a prefill chunk beside them takes the GEMM path, and stale rows past kv_len
    (NaN here) are never read."""
    from dualop.kernels.cpu import ragged_paged_mla_attention as cpu_mla
    taken = []
    real = cpu_mla._decode_in_kernel
    monkeypatch.setattr(cpu_mla, "_decode_in_kernel", lambda *a: taken.append((list(a[5]), real(*a))) or taken[-1][1])
    q_lens, kv_lens = [1, 3, 9, 1, 4], [5, 17, 20, 33, 4]
    q, pages, *meta = mla_batch(np.random.default_rng(7), q_lens, kv_lens, num_tokens=20, heads=4, latent=32,
                                rope_dim=8, page_size=page_size)
    q, pages = torch.from_numpy(q).to(dtype), torch.from_numpy(pages).to(dtype)
    meta = [torch.from_numpy(m) for m in meta]
    table = meta[1]
    for i, kv_len in enumerate(kv_lens):  # NaN in the slots past kv_len of each sequence's last page
        for pos in range(kv_len, -(-kv_len // page_size) * page_size):
            pages[table[i, pos // page_size], pos % page_size] = float("nan")
    op = RaggedPagedMLAAttention(32)
    got = op.forward_cpu(q, pages, *meta, sm_scale=0.2)
    want = op.forward_native(q, pages, *meta, sm_scale=0.2)
    assert taken == [([0, 1, 3, 4], True)]  # the kernel ran for the four short sequences
    assert torch.isfinite(got).all()
    key, _ = testing.tolerance_for(str(dtype).removeprefix("torch."), want)
    assert testing.compare(testing.to_numpy(got), testing.to_numpy(want), key).ok
