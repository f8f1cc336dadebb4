"""The frontend-neutral tensor-parallel arithmetic (dualop.parallel) and the two engines'
collectives (dualop.torch.parallel over gloo processes, dualop.jax.parallel over host devices)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from dualop.testing import free_port, gloo_group
from dualop import parallel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- the vocabulary layout: the engine docstring's worked example ---------------------------------

def test_vocab_layout_matches_the_engine_docstring_example():
    """vocab 1010 + 16 added, padding 64: 1088 rows; at tp 2 each rank holds 544 rows."""
    one = parallel.vocab_shard(1026, 1010, 64, tp_size=1, tp_rank=0)
    assert one.num_embeddings_padded == 1088 and one.org_vocab_size_padded == 1024
    ids = parallel.vocab_token_ids(one)
    assert ids == list(range(1010)) + [-1] * 14 + list(range(1010, 1026)) + [-1] * 48  # indices 0..1087

    rank0, rank1 = (parallel.vocab_shard(1026, 1010, 64, tp_size=2, tp_rank=r) for r in (0, 1))
    assert rank0.num_embeddings_per_partition == rank1.num_embeddings_per_partition == 544
    assert parallel.vocab_token_ids(rank0) == list(range(512)) + list(range(1010, 1026)) + [-1] * 16
    assert parallel.vocab_token_ids(rank1) == list(range(512, 1010)) + [-1] * 14 + [-1] * 32
    assert (rank1.org_vocab_start, rank1.org_vocab_end, rank1.num_org_vocab_padding) == (512, 1010, 14)
    assert (rank1.added_vocab_start, rank1.added_vocab_end) == (1026, 1026)


@pytest.mark.parametrize("vocab,org,pad,tp", [(32000, None, 64, 4), (151936, None, 64, 8), (1000, 990, 64, 4),
                                              (7, None, 8, 8)])
def test_every_token_id_has_exactly_one_row(vocab, org, pad, tp):
    ids = [i for r in range(tp) for i in parallel.vocab_token_ids(parallel.vocab_shard(vocab, org, pad, tp, r))]
    real = [i for i in ids if i >= 0]
    assert sorted(real) == list(range(vocab)) and len(ids) == parallel.vocab_shard(vocab, org, pad, tp, 0).num_embeddings_padded


def test_vocab_and_divide_errors_name_the_op_and_argument():
    with pytest.raises(ValueError, match="vocab_parallel_embedding: the padded base vocabulary .* is 64, which the "
                                         "tensor-parallel size 3 does not divide"):
        parallel.vocab_shard(50, tp_size=3, tp_rank=0)
    with pytest.raises(ValueError, match="parallel_lm_head: argument 'num_embeddings' must be a positive int"):
        parallel.vocab_shard(0, op="parallel_lm_head")
    with pytest.raises(ValueError, match="tp_rank 2 is outside"):
        parallel.vocab_shard(64, tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match="column_parallel_linear: argument 'output_size' is 10, which the "
                                         "tensor-parallel size 4 does not divide"):
        parallel.divide(10, 4, op="column_parallel_linear", what="argument 'output_size'")
    assert parallel.pad_vocab_size(128256, 64) == 128256 and parallel.pad_vocab_size(151655, 64) == 151680


def test_qkv_layout_splits_and_replicates_kv_heads():
    # Llama-3-8B: 32 q heads, 8 kv heads
    four = [parallel.qkv_layout(32, 8, 128, 4, r) for r in range(4)]
    assert [(l.q_head_start, l.num_heads, l.kv_head_start, l.num_kv_heads, l.kv_replicas) for l in four] == [
        (0, 8, 0, 2, 1), (8, 8, 2, 2, 1), (16, 8, 4, 2, 1), (24, 8, 6, 2, 1)]
    # 2 kv heads over 8 ranks: each kv head on 4 ranks
    eight = [parallel.qkv_layout(16, 2, 64, 8, r) for r in range(8)]
    assert [l.kv_head_start for l in eight] == [0, 0, 0, 0, 1, 1, 1, 1] and {l.kv_replicas for l in eight} == {4}
    assert eight[0].output_size_per_partition == (2 + 2) * 64
    with pytest.raises(ValueError, match="qkv_parallel_linear: total_num_heads is 12, which the tensor-parallel "
                                         "size 8 does not divide"):
        parallel.qkv_layout(12, 4, 64, 8, 0)
    with pytest.raises(ValueError, match="replicating 3 kv heads"):
        parallel.qkv_layout(12, 3, 64, 4, 0)


def test_current_group_defaults_to_one_device():
    tp = parallel.current_tensor_parallel()
    assert tp.size == 1 and tp.rank == 0 and tp.all_reduce(5) == 5
    other = parallel.TensorParallel()
    with parallel.use_tensor_parallel(other) as inside:
        assert inside is other and parallel.current_tensor_parallel() is other
    assert parallel.current_tensor_parallel() is tp
    with pytest.raises(TypeError, match="expected a dualop.parallel.TensorParallel"):
        parallel.set_tensor_parallel(object())


# --- torch: a gloo group of 2 processes ------------------------------------------------------------


def _torch_collectives(rank: int, world: int, port: int) -> None:
    import torch

    from dualop.torch import parallel as tparallel

    with gloo_group(rank, world, port):
        tp = tparallel.init_tensor_parallel_group()
        assert parallel.current_tensor_parallel() is tp
        assert (tparallel.tp_rank(), tparallel.tp_size()) == (rank, world)
        x = torch.arange(6.0).reshape(2, 3) + 10 * rank
        summed = tp.all_reduce(x)
        assert torch.equal(x, torch.arange(6.0).reshape(2, 3) + 10 * rank)  # the input is left alone
        want = sum(torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(world))
        assert torch.equal(summed, want)
        gathered = tp.all_gather(x, dim=-1)
        assert torch.equal(gathered, torch.cat([torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(world)], -1))
        assert torch.equal(tp.all_gather(x, dim=0), torch.cat([torch.arange(6.0).reshape(2, 3) + 10 * r
                                                               for r in range(world)], 0))


def test_torch_group_collectives_over_two_processes():
    torch = importlib.import_module("torch")
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    mp.spawn(_torch_collectives, args=(2, free_port()), nprocs=2, join=True)


# --- jax: a tp axis over 2 and 4 of 8 host devices -------------------------------------------------

_JAX_SCRIPT = textwrap.dedent("""
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from dualop.jax.parallel import AxisTensorParallel, shard_map, tensor_parallel_mesh

    out = []
    for n in (2, 4):
        mesh = tensor_parallel_mesh(n)
        tp = AxisTensorParallel("tp", n)
        x = jnp.arange(n * 2 * 3, dtype=jnp.float32).reshape(n * 2, 3)

        def body(local):
            return tp.all_reduce(local), tp.all_gather(local, dim=1), jnp.full((1,), tp.rank)

        red, gat, ranks = jax.jit(shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=(P("tp"), P("tp"), P("tp"))))(x)
        blocks = np.asarray(x).reshape(n, 2, 3)
        out.append(dict(n=n, reduce=bool(np.array_equal(np.asarray(red)[:2], blocks.sum(0))),
                        gather=bool(np.array_equal(np.asarray(gat)[:2], np.concatenate(list(blocks), axis=1))),
                        ranks=np.asarray(ranks).tolist()))
    try:
        tensor_parallel_mesh(16)
    except ValueError as err:
        out.append(dict(error=str(err)))
    print("RESULTS " + json.dumps(out))
""")


def test_jax_axis_collectives_over_host_devices():
    importlib.import_module("jax")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, "-c", _JAX_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    two, four, error = json.loads(line.removeprefix("RESULTS "))
    assert two == dict(n=2, reduce=True, gather=True, ranks=[0, 1])
    assert four == dict(n=4, reduce=True, gather=True, ranks=[0, 1, 2, 3])
    assert "tp 16 needs 16 devices; 8 available" in error["error"]
