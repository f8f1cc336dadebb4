"""logits_processor: the native body against float64 numpy and transformers' Gemma-2 final-logit
soft cap; the Pallas kernel with the hidden dim tiled; tensor parallelism (torch: 2 gloo processes;
JAX: 2 and 4 of 8 host devices, one subprocess) equal to tp 1 from the same full LM-head weight, with
a vocabulary that needs padding and one with added (LoRA) tokens; bad input."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dualop.testing import free_port
from dualop import ops, testing
from dualop.parallel import TensorParallel, vocab_shard, vocab_token_ids

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (vocab_size, org_vocab_size, soft_cap, scale, bias): a vocabulary padded 1000 -> 1024; the engine
# docstring's 1010 base + 16 added tokens (1088 rows; at tp 2 rank 0 holds base 0-511 and the added
# ones); Gemma-2-like cap 30 with no epilogue but the cap; a plain matmul (the vendor's path).
TP_CONFIGS = [(1000, None, 5.0, 0.5, True), (1026, 1010, 4.0, 1.0, True), (1000, None, 30.0, 1.0, False),
              (1026, 1010, None, 1.0, False)]
HIDDEN, TOKENS = 64, 7


def _full_checkpoint(vocab: int, seed: int = 0):
    """The full LM head ``[vocab, H]`` (token-id order), its bias, and hidden states, float32."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((vocab, HIDDEN)).astype(np.float32) * (3.0 / HIDDEN ** 0.5)
    bias = rng.standard_normal(vocab).astype(np.float32)
    return weight, bias, rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)


def shard_rows(full: np.ndarray, vocab: int, org: int | None, tp: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s rows of ``full`` (weight or bias) in the vocabulary-parallel layout, padding zero."""
    ids = vocab_token_ids(vocab_shard(vocab, org, 64, tp, rank))
    out = np.zeros((len(ids), *full.shape[1:]), np.float32)
    real = [i for i, t in enumerate(ids) if t >= 0]
    out[real] = full[[ids[i] for i in real]]
    return out


def _float64_logits(weight, bias, hidden, org, soft_cap, scale):
    logits = hidden.astype(np.float64) @ weight[:org].astype(np.float64).T
    if bias is not None:
        logits = logits + bias[:org]
    if soft_cap is not None:
        logits = np.tanh(logits / soft_cap) * soft_cap
    return logits * scale


# --- the native body against float64 numpy --------------------------------------------------------


@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("vocab, org, soft_cap, scale, has_bias", TP_CONFIGS)
def test_native_matches_float64_numpy(frontend, vocab, org, soft_cap, scale, has_bias):
    weight, bias, hidden = _full_checkpoint(vocab)
    op = ops.LogitsProcessor(vocab, org, scale, soft_cap=soft_cap)
    args = [shard_rows(weight, vocab, org, 1, 0), hidden, shard_rows(bias, vocab, org, 1, 0) if has_bias else None]
    got = op.forward_native(*(testing.to_frontend(a, frontend, "float32") for a in args))
    want = _float64_logits(weight, bias if has_bias else None, hidden, org or vocab, soft_cap, scale)
    assert tuple(got.shape) == (TOKENS, org or vocab)
    cmp = testing.compare(testing.to_numpy(got), want.astype(np.float32), "float32")
    assert cmp.ok, (cmp.max_abs, cmp.max_rel)


def test_logits_as_input_caps_and_scales_only():
    x = np.random.default_rng(3).standard_normal((4, 50)).astype(np.float32) * 8
    logits = testing.to_frontend(x, "torch", "float32")
    got = ops.LogitsProcessor(50, scale=0.25, logits_as_input=True, soft_cap=3.0)(logits, logits)
    assert testing.compare(testing.to_numpy(got), (np.tanh(x / 3.0) * 3.0 * 0.25).astype(np.float32), "float32").ok


def test_layers_on_one_device_call_the_op():
    """The torch layer takes the LM-head module (``nn.Linear``'s weight is ``[V, H]``) or its
    weight; the jax layer with no mesh, an nnx.Linear-like holder or the array."""
    import jax.numpy as jnp
    import torch

    from dualop.jax import layers as jax_layers
    from dualop.torch import layers as torch_layers

    weight, bias, hidden = _full_checkpoint(1000)
    shard = shard_rows(weight, 1000, None, 1, 0)
    want = ops.LogitsProcessor(1000, scale=0.5, soft_cap=5.0).forward_native(torch.from_numpy(shard),
                                                                              torch.from_numpy(hidden))
    head = torch.nn.Linear(HIDDEN, shard.shape[0], bias=False).requires_grad_(False)
    head.weight.copy_(torch.from_numpy(shard))
    layer = torch_layers.LogitsProcessor(1000, scale=0.5, soft_cap=5.0)
    for got in (layer(head, torch.from_numpy(hidden)), layer(head.weight, torch.from_numpy(hidden)),
                jax_layers.LogitsProcessor(1000, scale=0.5, soft_cap=5.0)(jnp.asarray(shard), jnp.asarray(hidden))):
        assert testing.compare(testing.to_numpy(got), want.numpy(), "float32").ok

# --- transformers' Gemma-2 final-logit soft cap ---------------------------------------------------


@pytest.mark.reference
def test_matches_gemma2_final_logit_softcapping():
    """A tiny Gemma2ForCausalLM with ``final_logit_softcapping``: its logits equal the op's, given
    its LM-head weight (padded into the vocabulary-parallel layout) and its final hidden states."""
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")

    vocab = 1000
    config = transformers.Gemma2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                       final_logit_softcapping=2.0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits of a few units, so a cap of 2 bends them
        out = model(torch.randint(0, vocab, (1, 9)), output_hidden_states=True)
    final_hidden = out.hidden_states[-1][0]  # after the final norm: what lm_head multiplies
    weight = torch.from_numpy(shard_rows(model.lm_head.weight.detach().numpy(), vocab, None, 1, 0))
    op = ops.LogitsProcessor(vocab, soft_cap=config.final_logit_softcapping)
    for got in (op(weight, final_hidden), op.forward_native(weight, final_hidden)):
        cmp = testing.compare(got.numpy(), out.logits[0].numpy(), "float32")
        assert cmp.ok, (cmp.max_abs, cmp.max_rel)
    assert float(out.logits.abs().max()) > 1.5  # the cap was reached, not a linear regime


# --- the Pallas kernel with the hidden dim tiled ----------------------------------------------------


def test_pallas_kernel_tiles_the_hidden_dim():
    """H 1024 in float32 exceeds one step's VMEM budget: the kernel accumulates over hidden blocks."""
    import jax.numpy as jnp

    from dualop.kernels.pallas.common import interpret_mode
    from dualop.kernels.pallas.logits_processor import logits_blocks, logits_processor

    tokens, hidden, vocab = 16, 1024, 512
    blocks = logits_blocks(tokens, hidden, vocab, vocab, 4)
    assert blocks.hidden < hidden and hidden % blocks.hidden == 0
    rng = np.random.default_rng(1)
    weight = jnp.asarray(rng.standard_normal((vocab, hidden)).astype(np.float32) * 0.1)
    h = jnp.asarray(rng.standard_normal((tokens, hidden)).astype(np.float32))
    bias = jnp.asarray(rng.standard_normal(vocab).astype(np.float32))
    op = ops.LogitsProcessor(vocab, scale=0.5, soft_cap=4.0)
    got = logits_processor(weight, h, bias, spec=op.spec, rows=vocab, interpret=interpret_mode())
    cmp = testing.compare(np.asarray(got), np.asarray(op.forward_native(weight, h, bias)), "float32")
    assert cmp.ok, (cmp.max_abs, cmp.max_rel)


def test_serving_blocks_fit_the_budget():
    """Llama-3-70B's LM head (H 8192, a 1/8 vocab shard) and Gemma-2-27B's (H 4608, vocab 256000)."""
    from dualop.kernels.pallas.common import block_budget
    from dualop.kernels.pallas.logits_processor import logits_blocks

    for tokens, hidden, rows in ((16, 8192, 16032), (8192, 8192, 128256), (16, 4608, 256000), (8192, 4608, 256000)):
        blocks = logits_blocks(tokens, hidden, rows, rows, 2)
        assert blocks.vmem_bytes <= block_budget() and hidden % blocks.hidden == 0, (tokens, hidden, blocks)


# --- bad input ------------------------------------------------------------------------------------


class _TwoRanks(TensorParallel):
    size = 2


def _args(vocab=1000, hidden=HIDDEN, tokens=3, rows=None, bias_rows=None):
    import torch

    rows = rows or vocab_shard(vocab, None, 64, 1, 0).num_embeddings_per_partition
    bias = None if bias_rows is None else torch.zeros(bias_rows)
    return torch.zeros(rows, HIDDEN), torch.zeros(tokens, hidden), bias


def test_bad_hidden_width():
    with pytest.raises(ValueError, match=r"logits_processor: argument 'lm_head_weight' has shape \(1024, 64\); "
                                         r"expected \[rows, 32\]"):
        ops.LogitsProcessor(1000, soft_cap=5.0)(*_args(hidden=32))


def test_bad_soft_cap():
    with pytest.raises(ValueError, match="logits_processor: argument 'soft_cap' must be None or a float > 0, got 0"):
        ops.LogitsProcessor(1000, soft_cap=0)


def test_weight_rows_not_this_ranks_shard():
    with pytest.raises(ValueError, match="'lm_head_weight' has 1024 rows; expected 512: one rank's shard of "
                                         "vocab_size=1000 .* over tensor-parallel size 2"):
        ops.LogitsProcessor(1000, soft_cap=5.0, tp=_TwoRanks())(*_args())


def test_org_vocab_larger_than_vocab():
    with pytest.raises(ValueError, match="logits_processor: argument 'org_vocab_size' is 1001; expected at most "
                                         "vocab_size=1000"):
        ops.LogitsProcessor(1000, 1001)


def test_bad_bias_shape():
    with pytest.raises(ValueError, match=r"logits_processor: argument 'embedding_bias' has shape \(1000,\); "
                                         r"expected \(1024,\)"):
        ops.LogitsProcessor(1000, soft_cap=5.0)(*_args(bias_rows=1000))


def test_tp_not_dividing_the_padded_vocab():
    with pytest.raises(ValueError, match="logits_processor: the padded base vocabulary .* is 64, which the "
                                         "tensor-parallel size 3 does not divide"):
        ops.LogitsProcessor(50, tp=type("Three", (TensorParallel,), {"size": 3})())


def test_bias_with_logits_as_input():
    import torch

    logits = torch.zeros(2, 50)
    with pytest.raises(ValueError, match="logits_processor: argument 'embedding_bias' must be None with "
                                         "logits_as_input=True"):
        ops.LogitsProcessor(50, logits_as_input=True, soft_cap=3.0)(logits, logits, torch.zeros(50))


# --- torch: 2 gloo processes ------------------------------------------------------------------------


def _torch_tp_worker(rank: int, world: int, port: int) -> None:
    import torch

    from dualop import parallel
    from dualop.torch import layers
    from dualop.torch import parallel as tparallel

    with testing.gloo_group(rank, world, port):
        tparallel.init_tensor_parallel_group()
        for vocab, org, soft_cap, scale, has_bias in TP_CONFIGS:
            weight, bias, hidden = _full_checkpoint(vocab)
            h = torch.from_numpy(hidden)

            def run(op_or_layer, size, r, lm_head=None):
                w = torch.from_numpy(shard_rows(weight, vocab, org, size, r))
                b = torch.from_numpy(shard_rows(bias, vocab, org, size, r)) if has_bias else None
                return op_or_layer(w if lm_head is None else lm_head(w), h, b)

            one = run(ops.LogitsProcessor(vocab, org, scale, soft_cap=soft_cap, tp=parallel.TensorParallel()), 1, 0)
            many = run(ops.LogitsProcessor(vocab, org, scale, soft_cap=soft_cap), world, rank)  # the current group
            layer_out = run(layers.LogitsProcessor(vocab, org, scale, soft_cap=soft_cap), world, rank, _with_weight)
            for got in (many, layer_out):
                assert got.shape == (TOKENS, org or vocab)
                cmp = testing.compare(got.numpy(), one.numpy(), "float32")
                assert cmp.ok, (vocab, org, soft_cap, cmp.max_abs, cmp.max_rel)


def _with_weight(w):
    """An LM-head stand-in: a module whose ``weight`` is the shard (as ParallelLMHead holds it)."""
    import torch

    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(w, requires_grad=False)
    return module


def test_torch_tensor_parallel_equals_tp1_over_two_processes():
    torch = importlib.import_module("torch")
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    mp.spawn(_torch_tp_worker, args=(2, free_port()), nprocs=2, join=True)


# --- jax: 2 and 4 of 8 host devices, one subprocess --------------------------------------------------

_JAX_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    sys.path.insert(0, os.path.join(sys.argv[1], "tests", "ops"))
    from test_logits_processor import TP_CONFIGS, _full_checkpoint, shard_rows
    from dualop import ops, override_platform, testing
    from dualop.jax import layers
    from dualop.jax.parallel import tensor_parallel_mesh
    from dualop.parallel import TensorParallel
    out = []
    for vocab, org, soft_cap, scale, has_bias in TP_CONFIGS:
        weight, bias, hidden = _full_checkpoint(vocab)
        one = ops.LogitsProcessor(vocab, org, scale, soft_cap=soft_cap, tp=TensorParallel())(
            jnp.asarray(shard_rows(weight, vocab, org, 1, 0)), jnp.asarray(hidden),
            jnp.asarray(shard_rows(bias, vocab, org, 1, 0)) if has_bias else None)
        for n in (2, 4):
            mesh = tensor_parallel_mesh(n)
            place = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh, P("tp", *(None,) * (a.ndim - 1))))
            # rank-major global arrays: shard r of the vocab dim is rank r's vocab_shard rows
            w = place(np.concatenate([shard_rows(weight, vocab, org, n, r) for r in range(n)]))
            b = place(np.concatenate([shard_rows(bias, vocab, org, n, r) for r in range(n)])) if has_bias else None
            layer = layers.LogitsProcessor(vocab, org, scale, soft_cap=soft_cap, mesh=mesh)
            got = jax.jit(lambda w, h, b: layer(w, h, b))(w, jnp.asarray(hidden), b)
            cmp = testing.compare(np.asarray(got), np.asarray(one), "float32")
            out.append(dict(vocab=vocab, org=org, n=n, shape=list(got.shape), ok=cmp.ok, max_abs=cmp.max_abs))
            if n == 2 and soft_cap == 5.0:  # the Pallas kernel (interpreted) inside shard_map
                with override_platform("tpu"):
                    got = layer(w, jnp.asarray(hidden), b)
                cmp = testing.compare(np.asarray(got), np.asarray(one), "float32")
                out.append(dict(vocab=vocab, org=org, n=n, pallas=layer.op.last_run("jax", "tpu")[0],
                                shape=list(got.shape), ok=cmp.ok, max_abs=cmp.max_abs))
    print("RESULTS " + json.dumps(out))
""")


def test_jax_tensor_parallel_equals_tp1_on_2_and_4_host_devices():
    importlib.import_module("jax")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("JAX_CPU_ENABLE_ASYNC_DISPATCH", "false")
    proc = subprocess.run([sys.executable, "-c", _JAX_SCRIPT, ROOT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    assert len(results) == 2 * len(TP_CONFIGS) + 1
    for r in results:
        assert r["ok"] and r["shape"] == [TOKENS, r["org"] or r["vocab"]], r
    assert [r["pallas"] for r in results if "pallas" in r] == ["forward_tpu"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_compiled_epilogue_matches_native(dtype):
    """Logits above COMPILED_MIN_ELEMENTS take the compiled one-pass epilogue (the check cases are
    below it and take the eager steps)."""
    import torch

    from dualop.kernels.cpu import logits_processor as cpu_logits

    weight, bias, hidden = _full_checkpoint(1000)
    tokens = cpu_logits.COMPILED_MIN_ELEMENTS // 1000 + 1
    hidden_states = np.random.default_rng(2).standard_normal((tokens, HIDDEN)).astype(np.float32)
    h = testing.to_frontend(hidden_states, "torch", dtype)
    w = testing.to_frontend(shard_rows(weight, 1000, None, 1, 0), "torch", dtype)
    b = testing.to_frontend(shard_rows(bias, 1000, None, 1, 0), "torch", dtype)
    op = ops.LogitsProcessor(1000, scale=0.5, soft_cap=5.0)
    with torch.no_grad():
        got = op.forward_cpu(w, h, b)
    assert not cpu_logits._compile_failed, cpu_logits._compile_failed
    cmp = testing.compare(testing.to_numpy(got), testing.to_numpy(op.forward_native(w, h, b)), dtype)
    assert cmp.ok, (cmp.max_abs, cmp.max_rel)
