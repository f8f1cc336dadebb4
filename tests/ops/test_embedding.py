"""vocab_parallel_embedding / parallel_lm_head: the native body against torch's and jax's own lookups,
bad input, and the layers at tp 2 (two gloo processes) and tp 2 / 4 (8 host devices, one jax
subprocess) against tp 1 from the same full checkpoint. The kernels against forward_native are in
tests/sweeps/test_cells.py (the op's check cases)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dualop.testing import free_port, gloo_group
from dualop import ops, parallel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _full_table(vocab: int, dim: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((vocab, dim)).astype(np.float32)


def _padded_tp1(full: np.ndarray, org: int, padding: int = 64) -> np.ndarray:
    """The tp-1 padded table, built by hand from the engine docstring's layout: base rows, padding
    to a multiple of ``padding``, the added rows, padding."""
    vocab, dim = full.shape
    org_padded = -(-org // padding) * padding
    total = -(-(org_padded + vocab - org) // padding) * padding
    table = np.zeros((total, dim), np.float32)
    table[:org] = full[:org]
    table[org_padded:org_padded + vocab - org] = full[org:]
    return table


# --- the native body against torch's and jax's own lookups -----------------------------------------

@pytest.mark.reference
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_body_equals_torch_embedding(dtype):
    torch = importlib.import_module("torch")
    F = torch.nn.functional
    vocab, org, dim = 1026, 1010, 32
    full = _full_table(vocab, dim)
    op = ops.VocabParallelEmbedding(vocab, dim, org_num_embeddings=org)
    weight = torch.from_numpy(_padded_tp1(full, org)).to(getattr(torch, dtype))
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, vocab, (3, 17))).to(torch.int64)
    got = op.forward_native(ids, weight)
    want = F.embedding(ids, torch.from_numpy(full).to(weight.dtype))
    assert got.dtype == weight.dtype and got.shape == (3, 17, dim)
    assert torch.equal(got, want)


@pytest.mark.reference
def test_native_body_equals_jnp_take_with_a_traced_rank():
    """Two ranks as a traced rank would see them (the bounds row picked by a jit argument): each
    rank's rows are jnp.take of its own slice, and their sum is the full lookup."""
    jax = importlib.import_module("jax")
    jnp = jax.numpy
    vocab, org, dim = 1026, 1010, 16
    full = _full_table(vocab, dim)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, vocab, 64), jnp.int32)

    class TracedRank(parallel.TensorParallel):
        size = 2

        def __init__(self, rank):
            self._rank = rank

        @property
        def rank(self):
            return self._rank

    total = jnp.zeros((64, dim), jnp.float32)
    for r in range(2):
        shard = parallel.vocab_shard(vocab, org, 64, 2, r)
        rows = np.zeros((shard.num_embeddings_per_partition, dim), np.float32)
        for i, token in enumerate(parallel.vocab_token_ids(shard)):
            if token >= 0:
                rows[i] = full[token]
        out = jax.jit(lambda i, w, rank: ops.VocabParallelEmbedding(vocab, dim, org_num_embeddings=org,
                                                                    tp=TracedRank(rank)).forward_native(i, w)
                      )(ids, jnp.asarray(rows), jnp.int32(r))
        held = np.isin(np.asarray(ids), [t for t in parallel.vocab_token_ids(shard) if t >= 0])
        want = np.where(held[:, None], np.asarray(jnp.take(jnp.asarray(full), ids, axis=0)), 0)
        np.testing.assert_array_equal(np.asarray(out), want)
        total = total + out
    np.testing.assert_array_equal(np.asarray(total), np.asarray(jnp.take(jnp.asarray(full), ids, axis=0)))


def test_cpu_path_equals_native_with_added_vocab():
    torch = importlib.import_module("torch")
    op = ops.VocabParallelEmbedding(110, 8, org_num_embeddings=100)
    weight = torch.randn(op.num_embeddings_per_partition, 8)
    ids = torch.arange(110)
    assert torch.equal(op.forward_cpu(ids, weight), op.forward_native(ids, weight))


# --- bad input: one rule each ----------------------------------------------------------------------

def _torch_op_and_weight(vocab=100, dim=8):
    torch = importlib.import_module("torch")
    op = ops.VocabParallelEmbedding(vocab, dim)
    return torch, op, torch.zeros(op.num_embeddings_per_partition, dim)


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
@pytest.mark.parametrize("ops_config", ["all", "none"])
def test_ids_at_or_past_the_vocabulary_are_refused(platform, ops_config):
    """Torch CPU ids are checked by whichever method runs (the C++ kernel in its first pass, the
    others by a min/max read), before any row is written."""
    from dualop.config import OpsConfig, set_config
    from dualop.platforms import override_platform

    torch, op, weight = _torch_op_and_weight()
    with override_platform(platform), set_config(OpsConfig([ops_config])):
        for ids, bad in ((torch.tensor([3, 100]), 100), (torch.tensor([[-2, 5]], dtype=torch.int32), -2)):
            with pytest.raises(ValueError, match=rf"vocab_parallel_embedding: argument 'input_ids' holds id {bad}; "
                                                 r"expected ids in \[0, num_embeddings = 100\)"):
                op(ids, weight)


def test_negative_ids_are_refused_for_jax_arrays_too():
    jnp = importlib.import_module("jax.numpy")
    op = ops.VocabParallelEmbedding(100, 8)
    with pytest.raises(ValueError, match="argument 'input_ids' holds id -1"):
        op(jnp.asarray([-1, 5], jnp.int32), jnp.zeros((128, 8)))


def test_padding_the_tp_size_does_not_divide_is_refused():
    class Three(parallel.TensorParallel):
        size = 3

    with pytest.raises(ValueError, match="vocab_parallel_embedding: the padded base vocabulary .* is 128, which the "
                                         "tensor-parallel size 3 does not divide"):
        ops.VocabParallelEmbedding(100, 8, tp=Three())


def test_weight_shard_of_the_wrong_shape_is_refused():
    torch, op, _ = _torch_op_and_weight()
    with pytest.raises(ValueError, match=r"argument 'weight_shard' has shape \(100, 8\); expected \(128, 8\)"):
        op(torch.tensor([1]), torch.zeros(100, 8))


def test_non_integer_ids_are_refused():
    torch, op, weight = _torch_op_and_weight()
    with pytest.raises(TypeError, match="argument 'input_ids' has dtype float32; expected int32 or int64"):
        op(torch.tensor([1.0]), weight)


def test_weight_loader_refuses_a_full_tensor_of_the_wrong_shape():
    torch = importlib.import_module("torch")
    from dualop.torch.layers import VocabParallelEmbedding

    layer = VocabParallelEmbedding(110, 8, org_num_embeddings=100)
    with pytest.raises(ValueError, match=r"VocabParallelEmbedding.weight_loader: the full tensor for parameter "
                                         r"'weight' has 105 vocabulary rows; expected shape \(100, 8\) or \(110, 8\)"):
        layer.weight_loader(layer.weight, torch.zeros(105, 8))


def test_lm_head_has_no_forward_and_says_to_use_the_logits_processor():
    torch = importlib.import_module("torch")
    from dualop.torch.layers import ParallelLMHead

    head = ParallelLMHead(100, 8)
    with pytest.raises(RuntimeError, match=r"parallel_lm_head: the LM head has no forward.*LogitsProcessor"):
        head(torch.tensor([1]))


# --- torch: two gloo processes ---------------------------------------------------------------------


# (num_embeddings, org_num_embeddings, dim): the engine docstring's example, and no added vocabulary
_TP_SIZES = ((1026, 1010, 32), (300, 300, 16))


def _torch_tp_ranks(rank: int, world: int, port: int) -> None:
    import torch

    from dualop.torch import layers
    from dualop.torch import parallel as tparallel

    with gloo_group(rank, world, port):
        group = tparallel.init_tensor_parallel_group()
        for vocab, org, dim in _TP_SIZES:
            for dtype in (torch.float32, torch.bfloat16):
                full = torch.from_numpy(_full_table(vocab, dim)).to(dtype)
                ids = torch.from_numpy(np.random.default_rng(3).permutation(vocab)[:200].reshape(4, 50))
                one = layers.VocabParallelEmbedding(vocab, dim, dtype, org, tp=parallel.TensorParallel())
                one.weight_loader(one.weight, full)
                sharded = layers.VocabParallelEmbedding(vocab, dim, dtype, org)  # the current group
                assert sharded.tp is group and sharded.weight.shape[0] * world == one.weight.shape[0]
                sharded.weight_loader(sharded.weight, full)
                want = torch.nn.functional.embedding(ids, full)
                with torch.no_grad():
                    assert torch.equal(one(ids), want)
                    assert torch.equal(sharded(ids), want), (vocab, dtype)
                head = layers.ParallelLMHead(vocab, dim, bias=True, params_dtype=dtype, org_num_embeddings=org)
                head.weight_loader(head.bias, full[:, 0])
                assert torch.equal(head.tie_weights(sharded).weight, sharded.weight)
                shard = sharded.op.shard()
                tokens = parallel.vocab_token_ids(shard)
                held = torch.tensor([t >= 0 for t in tokens])
                assert torch.equal(head.bias[held], full[[t for t in tokens if t >= 0], 0])
                assert not head.bias[~held].any()
        # the docstring example at tp 2: rank 0 holds 512 base + 16 added rows, rank 1 498 base rows
        emb = layers.VocabParallelEmbedding(1026, 4, org_num_embeddings=1010)
        assert emb.weight.shape == (544, 4)


def test_torch_layers_at_tp2_equal_tp1_and_f_embedding():
    torch = importlib.import_module("torch")
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    mp.spawn(_torch_tp_ranks, args=(2, free_port()), nprocs=2, join=True)


# --- jax: 2 and 4 of 8 host devices, one subprocess ------------------------------------------------

_JAX_SCRIPT = textwrap.dedent("""
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import numpy as np, jax, jax.numpy as jnp
    import dualop
    from dualop.jax import layers
    from dualop.jax.parallel import tensor_parallel_mesh

    out = []
    for vocab, org, dim in SIZES:
        full = np.random.default_rng(0).standard_normal((vocab, dim)).astype(np.float32)
        ids = jnp.asarray(np.random.default_rng(3).permutation(vocab)[:200].reshape(4, 50), jnp.int32)
        for dtype in ("float32", "bfloat16"):
            one = layers.VocabParallelEmbedding(vocab, dim, dtype, org)
            one.weight_loader("weight", full)
            want = np.asarray(jnp.take(jnp.asarray(full, dtype), ids, axis=0).astype(jnp.float32))
            base = np.asarray(one(ids).astype(jnp.float32))
            row = dict(vocab=vocab, dtype=dtype, tp1=bool(np.array_equal(base, want)))
            for n in (2, 4):
                if (-(-org // 64) * 64) % n:
                    continue
                layer = layers.VocabParallelEmbedding(vocab, dim, dtype, org, mesh=tensor_parallel_mesh(n))
                layer.weight_loader("weight", full)
                got = jax.jit(lambda i: layer(i))(ids)
                row[f"tp{n}"] = bool(np.array_equal(np.asarray(got.astype(jnp.float32)), base))
                row[f"shard{n}"] = [int(s.data.shape[0]) for s in layer.weight[...].addressable_shards]
                if vocab == 1026:  # the Pallas kernel (interpreted) per rank, the rank traced in shard_map
                    with dualop.override_platform("tpu"):
                        got = jax.jit(lambda i: layer(i))(ids)
                    row[f"pallas{n}"] = (bool(np.array_equal(np.asarray(got.astype(jnp.float32)), base))
                                         and layer.op.last_run("jax", "tpu")[0] == "forward_tpu")
            out.append(row)
    head = layers.ParallelLMHead(1026, 8, bias=True, org_num_embeddings=1010, mesh=tensor_parallel_mesh(2))
    emb = layers.VocabParallelEmbedding(1026, 8, org_num_embeddings=1010, mesh=tensor_parallel_mesh(2))
    out.append(dict(tied=head.tie_weights(emb).weight is emb.weight, bias=list(head.bias[...].shape)))
    print("RESULTS " + json.dumps(out))
""").replace("SIZES", repr(_TP_SIZES))


def test_jax_layers_at_tp2_and_tp4_equal_tp1_and_jnp_take():
    """Native bodies and (1026-id vocabulary) the interpreted Pallas kernel per rank."""
    importlib.import_module("jax")
    importlib.import_module("flax")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, "-c", _JAX_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")).removeprefix("RESULTS "))
    *embeddings, head = rows
    assert len(embeddings) == 4
    for row in embeddings:
        assert row["tp1"] and row["tp2"] and row["tp4"], row
    docstring = embeddings[0]  # 1010 + 16 added, padding 64: 1088 rows, 544 per rank at tp 2
    assert docstring["shard2"] == [544, 544] and docstring["shard4"] == [272] * 4
    for row in embeddings[:2]:  # float32 and bfloat16 through the Pallas kernel inside shard_map
        assert row["pallas2"] and row["pallas4"], row
    assert head == dict(tied=True, bias=[1088])
