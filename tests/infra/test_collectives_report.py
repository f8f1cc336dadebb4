"""``dualop compile``'s collectives report (``dualop/aot/collectives.py``): the HLO parser on
hand-written programs (sync and async forms, tuples, XLA:TPU's async collective chains, loops), then
on programs XLA:TPU compiled for four v5e chips: the expert-parallel layers through ``dualop compile``
and a small tensor-parallel function (psum and a tiled all_gather), each byte count against what the
shapes say. The compiles need libtpu (the latest environment); elsewhere those tests skip saying so.
"""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from dualop import cli
from dualop.aot import sharded
from dualop.aot.collectives import Collective, collectives, describe, format_bytes, summarize


def _hlo(text: str) -> str:
    return textwrap.dedent(text).strip() + "\n"


_ADD = """
%add.f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}
"""

SYNC = _hlo(_ADD + """
%never_called (q: f32[8,16]) -> f32[8,16] {
  %q = f32[8,16]{1,0} parameter(0)
  ROOT %unused = f32[8,16]{1,0} all-reduce(%q), channel_id=9, replica_groups={{0,1,2,3}}, to_apply=%add.f32
}

ENTRY %main (p0: f32[8,16], p1: bf16[4,32], p2: s32[4,8]) -> f32[8,16] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = bf16[4,32]{1,0:T(8,128)(2,1)} parameter(1)
  %p2 = s32[4,8]{1,0} parameter(2)
  %ar = f32[8,16]{1,0:T(8,128)} all-reduce(%p0), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add.f32, metadata={op_name="jit(f)/psum"}
  %folded = bf16[8,16]{1,0} all-reduce(%p0), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%add.f32
  %combined = (f32[8,16]{1,0}, /*index=1*/bf16[4,32]{1,0:T(8,128)(2,1)}) all-reduce(%p0, %p1), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%add.f32
  %ag = bf16[16,32]{1,0} all-gather(%p1), channel_id=4, replica_groups={{0,1,2,3}}, dimensions={0}
  %rs = f32[2,16]{1,0} reduce-scatter(%p0), channel_id=5, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add.f32
  %a2a = (s32[4,8]{1,0}, bf16[4,32]{1,0}) all-to-all(%p2, %p1), channel_id=6, replica_groups={{0,1,2,3}}
  %cp = s32[4,8]{1,0} collective-permute(%p2), channel_id=7, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  ROOT %out = f32[8,16]{1,0} add(%ar, %ar)
}
""")


def test_sync_collectives_tuples_and_element_types():
    """Each kind with its result type (layouts dropped) and result and operand bytes per device:
    f32 4 bytes, bf16 2, s32 4; a tuple adds its elements; a computation nothing calls is not run."""
    found = collectives(SYNC)
    assert found == [
        Collective("all-reduce", "f32[8,16]", 512, 512),
        Collective("all-reduce", "bf16[8,16]", 256, 512),  # a convert folded in: f32 operand, bf16 result
        Collective("all-reduce", "(f32[8,16], bf16[4,32])", 512 + 256, 512 + 256),
        Collective("all-gather", "bf16[16,32]", 1024, 256),
        Collective("reduce-scatter", "f32[2,16]", 128, 512),
        Collective("all-to-all", "(s32[4,8], bf16[4,32])", 128 + 256, 128 + 256),
        Collective("collective-permute", "s32[4,8]", 128, 128),
    ]
    summary = summarize(found)
    assert [s["kind"] for s in summary] == ["all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                                            "collective-permute"]
    assert summary[0] == {"kind": "all-reduce", "count": 3, "bytes": 1536, "operand_bytes": 1792, "per_iteration": 0,
                          "results": ["f32[8,16]", "bf16[8,16]", "(f32[8,16], bf16[4,32])"]}
    assert describe(summary) == ("all-reduce 3x 1.75 KiB -> 1.5 KiB, all-gather 1x 256 B -> 1 KiB, "
                                 "reduce-scatter 1x 512 B -> 128 B, all-to-all 1x 384 B, collective-permute 1x 128 B")


ASYNC = _hlo(_ADD + """
%wrapped_reduce_scatter (param: f32[8,16]) -> f32[4,16] {
  %param = f32[8,16]{1,0} parameter(0)
  ROOT %rs = f32[4,16]{1,0} reduce-scatter(%param), channel_id=4, replica_groups={{0,1}}, dimensions={0}, to_apply=%add.f32
}

ENTRY %main (p0: f32[8,16], p1: bf16[4,32]) -> f32[8,16] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = bf16[4,32]{1,0} parameter(1)
  %ars = f32[8,16]{1,0} all-reduce-start(%p0), channel_id=1, replica_groups={{0,1}}, to_apply=%add.f32
  %ard = f32[8,16]{1,0} all-reduce-done(%ars)
  %ags = (bf16[4,32]{1,0}, bf16[8,32]{1,0}) all-gather-start(bf16[4,32]{1,0} %p1), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  %agd = bf16[8,32]{1,0} all-gather-done((bf16[4,32]{1,0}, bf16[8,32]{1,0}) %ags)
  %cps = (bf16[4,32]{1,0}, bf16[4,32]{1,0}, u32[], u32[]) collective-permute-start(%p1), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cpd = bf16[4,32]{1,0} collective-permute-done(%cps)
  %rss = ((f32[8,16]{1,0}), f32[4,16]{1,0}) async-start(%p0), calls=%wrapped_reduce_scatter
  %rsu = ((f32[8,16]{1,0}), f32[4,16]{1,0}) async-update(%rss), calls=%wrapped_reduce_scatter
  %rsd = f32[4,16]{1,0} async-done(%rsu), calls=%wrapped_reduce_scatter
  ROOT %out = f32[8,16]{1,0} add(%ard, %ard)
}
""")


def test_async_pairs_count_once_with_the_done_result():
    """``<kind>-start``/``-done`` count once, sized by the done's result (the start's is a tuple with
    the operand) and the start's operands; ``async-start`` counts the collective it wraps (its
    update and done name the same computation); operands printed with their types parse too."""
    assert collectives(ASYNC) == [
        Collective("all-reduce", "f32[8,16]", 512, 512),
        Collective("all-gather", "bf16[8,32]", 512, 256),
        Collective("collective-permute", "bf16[4,32]", 256, 256),
        Collective("reduce-scatter", "f32[4,16]", 256, 512),
    ]


def _tpu_chain(chain: str, operand: str, result: str, dims: str) -> str:
    """XLA:TPU's async collective fusion: one all-gather copied into its start, a continuation
    fusion (compute overlapping it) and its done, all with the chain's ``chain_id``."""
    gather = (f"all-gather(%param_0), channel_id=1, replica_groups={{{{0,1,2,3}}}}, dimensions={{{dims}}}, "
              f'use_global_device_ids=true, frontend_attributes={{chain_id="{chain}"}}, '
              f'metadata={{op_name="jit(f)/shard_map/all_gather"}}')
    return f"""
%start.{chain} (param_0: {operand}) -> ({operand}, {result}, s32[2]) {{
  %param_0 = {operand}{{1,0:T(8,128)S(1)}} parameter(0)
  %all-gather.{chain}0 = {result}{{1,0:T(8,128)}} {gather}
  ROOT %custom-call.{chain}0 = ({operand}{{1,0:T(8,128)S(1)}}, {result}{{1,0:T(8,128)S(1)}}, s32[2]{{0:S(4)}}) custom-call(%all-gather.{chain}0), custom_call_target="AsyncCollectiveStart"
}}

%continuation.{chain} (param_0: {operand}, param_1: f32[16,32]) -> (f32[16,16], {result}) {{
  %param_1 = f32[16,32]{{1,0:T(8,128)}} parameter(1)
  %convolution.{chain} = f32[16,16]{{1,0:T(8,128)}} convolution(%param_1, %param_1), dim_labels=bf_oi->bf
  %param_0 = {operand}{{1,0:T(8,128)S(1)}} parameter(0)
  %all-gather.{chain}1 = {result}{{1,0:T(8,128)S(1)}} {gather}
  ROOT %tuple.{chain} = (f32[16,16]{{1,0:T(8,128)}}, {result}{{1,0:T(8,128)S(1)}}) tuple(%convolution.{chain}, %all-gather.{chain}1)
}}

%done.{chain} (param_0: {operand}) -> {result} {{
  %param_0 = {operand}{{1,0:T(8,128)S(1)}} parameter(0)
  %all-gather.{chain}2 = {result}{{1,0:T(8,128)}} {gather}
  ROOT %custom-call.{chain}2 = {result}{{1,0:T(8,128)S(1)}} custom-call(%all-gather.{chain}2), custom_call_target="AsyncCollectiveDone"
}}
"""


TPU_CHAINS = _hlo(_tpu_chain("0", "bf16[8,128]", "bf16[8,512]", "1") + _tpu_chain("1", "f32[64,128]", "f32[256,128]", "0")
                  + """
ENTRY %main.0_spmd (p0: bf16[8,128], p1: f32[64,128], p2: f32[16,32]) -> (f32[16,16], bf16[8,512], f32[256,128]) {
  %p0 = bf16[8,128]{1,0:T(8,128)} parameter(0)
  %p1 = f32[64,128]{1,0:T(8,128)} parameter(1)
  %p2 = f32[16,32]{1,0:T(8,128)} parameter(2)
  %async-collective-start = (bf16[8,128]{1,0:T(8,128)S(1)}, bf16[8,512]{1,0:T(8,128)S(1)}, s32[2]{0:S(4)}) fusion(%p0), kind=kCustom, calls=%start.0
  %async-collective-start.1 = (f32[64,128]{1,0:T(8,128)S(1)}, f32[256,128]{1,0:T(8,128)S(1)}, s32[2]{0:S(4)}) fusion(%p1), kind=kCustom, calls=%start.1
  %get-tuple-element.0 = bf16[8,128]{1,0:T(8,128)S(1)} get-tuple-element(%async-collective-start), index=0
  %fusion.4 = (f32[16,16]{1,0:T(8,128)}, bf16[8,512]{1,0:T(8,128)S(1)}) fusion(%get-tuple-element.0, %p2), kind=kOutput, calls=%continuation.0, backend_config={"continuation_config":{"operand_original_start":"16"}}
  %fusion.5 = (f32[16,16]{1,0:T(8,128)}, f32[256,128]{1,0:T(8,128)S(1)}) fusion(%p1, %p2), kind=kOutput, calls=%continuation.1
  %get-tuple-element.1 = f32[16,16]{1,0:T(8,128)} get-tuple-element(%fusion.4), index=0
  %async-collective-done = bf16[8,512]{1,0:T(8,128)S(1)} fusion(%get-tuple-element.0), kind=kCustom, calls=%done.0
  %async-collective-done.1 = f32[256,128]{1,0:T(8,128)S(1)} fusion(%p1), kind=kCustom, calls=%done.1
  ROOT %tuple.10 = (f32[16,16]{1,0:T(8,128)}, bf16[8,512]{1,0:T(8,128)}, f32[256,128]{1,0:T(8,128)}) tuple(%get-tuple-element.1, %async-collective-done, %async-collective-done.1)
}
""")


def test_an_xla_tpu_async_collective_chain_counts_once():
    """Two chains, each an all-gather copied into three fused computations: two all-gathers."""
    assert collectives(TPU_CHAINS) == [
        Collective("all-gather", "bf16[8,512]", 8 * 512 * 2, 8 * 128 * 2),
        Collective("all-gather", "f32[256,128]", 256 * 128 * 4, 64 * 128 * 4),
    ]


LOOPS = _hlo(_ADD + """
%body.known (t: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %t = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%t), index=1
  %psum = f32[8,16]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1}}, to_apply=%add.f32
  ROOT %next = (s32[], f32[8,16]{1,0}) tuple(%i, %psum)
}

%cond (t: (s32[], f32[8,16])) -> pred[] {
  %t = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body.unknown (t: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %t = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%t), index=1
  %a2a = f32[8,16]{1,0} all-to-all(%x), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  ROOT %next = (s32[], f32[8,16]{1,0}) tuple(%i, %a2a)
}

ENTRY %main (t0: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %t0 = (s32[], f32[8,16]{1,0}) parameter(0)
  %w0 = (s32[], f32[8,16]{1,0}) while(%t0), condition=%cond, body=%body.known, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %w1 = (s32[], f32[8,16]{1,0}) while(%w0), condition=%cond, body=%body.unknown
}
""")


def test_a_loop_counts_its_stated_trips_else_marks_per_iteration():
    found = collectives(LOOPS)
    assert found == [Collective("all-reduce", "f32[8,16]", 512, 512, count=3),
                     Collective("all-to-all", "f32[8,16]", 512, 512, count=1, per_iteration=True)]
    summary = summarize(found)
    assert summary[0]["count"] == 3 and summary[0]["bytes"] == 3 * 512 and summary[0]["results"] == ["f32[8,16]"] * 3
    assert describe(summary) == "all-reduce 3x 1.5 KiB, all-to-all 1x 512 B (1 per loop iteration)"


def test_format_bytes_and_an_empty_program():
    assert [format_bytes(n) for n in (0, 512, 1024, 1536, 64 << 10, 6299648, 3 << 30)] == [
        "0 B", "512 B", "1 KiB", "1.5 KiB", "64 KiB", "6.01 MiB", "3 GiB"]
    assert collectives("HloModule empty\n\nENTRY %main (p: f32[4]) -> f32[4] {\n  ROOT %p = f32[4]{0} parameter(0)\n}\n") == []
    assert describe([]) == "none"


# --- programs XLA:TPU compiled for v5e:2x2 (four chips) -------------------------------------------


def _require_tpu_compiler():
    from dualop.aot import tpu

    why = tpu.tpu_available()
    if why is not None:
        pytest.skip(f"TPU compiles need libtpu, installed in the latest environment only: {why}")


def _by_kind(row) -> dict:
    return {c["kind"]: c for c in row["collectives"]}


@pytest.mark.latest_only
def test_dualop_compile_reports_the_expert_parallel_collectives(capsys):
    """``dualop compile --json`` on the small expert-parallel layers for 4 v5e and 8 v6e chips: psum
    mode all-reduces its [tokens, hidden] float32 share once (XLA:TPU folds the cast to bfloat16
    after it into the all-reduce: float32 operands, bfloat16 result); all_to_all mode sends x's
    rows, ids and weights [shards, capacity, ...] out and the float32 outputs back. On v6e the
    program offloads scatters to the SparseCore, which ``Compiled.as_text()`` cannot print (the
    report reads XLA's dump instead). The text table says the same."""
    _require_tpu_compiler()
    args = ["compile", "--ops", "fused_moe", "--targets", "v5e:2x2,v6e:2x4", "--dtypes", "bfloat16", "--no-progress"]
    assert cli.main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 4
    for row in rows:
        n = {"v5e:2x2": 4, "v6e:2x4": 8}[row["target"]]
        if row["case"] == "fused_moe[ep,psum]":
            tokens, _, _, hidden, _, _ = row["shape"]
            assert set(_by_kind(row)) == {"all-reduce"}
            reduce = _by_kind(row)["all-reduce"]
            assert reduce["count"] == 1 and reduce["operand_bytes"] == tokens * hidden * 4
            assert reduce["results"] in ([f"bf16[{tokens},{hidden}]"], [f"f32[{tokens},{hidden}]"])
            assert reduce["bytes"] == tokens * hidden * (2 if reduce["results"][0].startswith("bf16") else 4)
        else:
            tokens, _, top_k, hidden, _, factor = row["shape"]
            capacity = int(np.ceil(factor * (tokens // n) * top_k / n))
            out = n * capacity * (hidden * 2 + 4 + 4)  # x's rows (bf16), ids (s32), weights (f32)
            back = n * capacity * hidden * 4  # float32 outputs
            assert set(_by_kind(row)) == {"all-to-all"}
            exchange = _by_kind(row)["all-to-all"]
            assert exchange["bytes"] == exchange["operand_bytes"] == out + back
            assert 2 <= exchange["count"] <= 4  # XLA may combine the three sends into one tuple all-to-all

    assert cli.main([*args, "--no-details"]) == 0  # the same programs: compiled once in this process
    text = capsys.readouterr().out
    assert "Collectives (sharded layers, compiled program):" in text
    for row in rows:
        line = next(ln for ln in text.splitlines() if ln.startswith(row["case"]) and row["target"] in ln)
        assert describe(row["collectives"]) in line


@pytest.mark.latest_only
def test_a_tensor_parallel_function_reports_its_psum_and_all_gather():
    """A hand-written tensor-parallel step through ``compile_layer``: psum of a [8, 256] float32
    partial sum and a tiled all_gather of [8, 128] bfloat16 shards into [8, 512] (XLA:TPU makes the
    gather an async collective chain: counted once)."""
    _require_tpu_compiler()
    from dualop.aot import tpu

    def build(mesh, shape, dtype):
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P

        from dualop.jax.parallel import shard_map

        rows, hidden, cols = shape

        def per_rank(x, w, b):
            return jax.lax.psum(x @ w, "x"), jax.lax.all_gather(b, "x", axis=1, tiled=True)

        fn = shard_map(per_rank, mesh=mesh, in_specs=(P(None, "x"), P("x", None), P(None, "x")),
                       out_specs=(P(), P()))
        args = (jax.ShapeDtypeStruct((rows, hidden), jnp.float32, sharding=NamedSharding(mesh, P(None, "x"))),
                jax.ShapeDtypeStruct((hidden, cols), jnp.float32, sharding=NamedSharding(mesh, P("x", None))),
                jax.ShapeDtypeStruct((rows, 512), jnp.dtype(dtype), sharding=NamedSharding(mesh, P(None, "x"))))
        return fn, args

    layer = sharded.ShardedLayer("tp_probe", "tp_probe", ((8, 512, 256),), (), build)
    with tpu.quiet_native_stderr():
        result = sharded.compile_layer(layer, (8, 512, 256), "bfloat16", "v5e:2x2")
    assert result.status == "ok", result.message
    kinds = {c["kind"]: c for c in result.collectives}
    assert set(kinds) == {"all-reduce", "all-gather"}
    assert kinds["all-reduce"] == {"kind": "all-reduce", "count": 1, "bytes": 8 * 256 * 4, "operand_bytes": 8 * 256 * 4,
                                   "per_iteration": 0, "results": ["f32[8,256]"]}
    assert kinds["all-gather"] == {"kind": "all-gather", "count": 1, "bytes": 8 * 512 * 2, "operand_bytes": 8 * 128 * 2,
                                   "per_iteration": 0, "results": ["bf16[8,512]"]}
