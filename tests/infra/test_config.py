"""OpsConfig: parsing, validation, defaults, the environment, context-local activation."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dualop import CompilationMode, OpsConfig, get_config, set_config
from dualop.config import config_from_env


@pytest.mark.parametrize(
    "entries, expected",
    [
        ([], ("all",)),
        (["none"], ("none",)),
        (["none,+rms_norm"], ("none", "+rms_norm")),
        (["all,-rms_norm,-silu_and_mul"], ("all", "-rms_norm", "-silu_and_mul")),
        (["+rms_norm"], ("+rms_norm", "all")),
        ([" none , +rms_norm "], ("none", "+rms_norm")),
    ],
)
def test_entries_are_split_and_default_appended(entries, expected):
    assert OpsConfig(entries).custom_ops == expected


def test_inductor_compilation_defaults_to_none():
    assert OpsConfig([], backend="inductor", mode=CompilationMode.FULL).custom_ops == ("none",)
    assert OpsConfig([], backend="inductor", mode=0).custom_ops == ("all",)
    assert OpsConfig([], backend="eager", mode=3).custom_ops == ("all",)
    assert OpsConfig(["+rms_norm"], backend="inductor", mode=1).custom_ops == ("+rms_norm", "none")
    assert OpsConfig(["all"], backend="inductor", mode=3).custom_ops == ("all",)


@pytest.mark.parametrize(
    "entries, fragment",
    [
        (["all", "none"], "both 'all' and 'none'"),
        (["all,none"], "both 'all' and 'none'"),
        (["all", "all"], "'all' more than once"),
        (["none", "none"], "'none' more than once"),
        (["+rms_norm", "-rms_norm"], "'+rms_norm' and '-rms_norm'"),
        (["rms_norm"], "'rms_norm' is not one of"),
        (["+"], "'+' is not one of"),
        (["+rms norm"], "'+rms norm' is not one of"),
        (["*all"], "'*all' is not one of"),
    ],
)
def test_bad_entries_raise_naming_the_entry(entries, fragment):
    with pytest.raises(ValueError, match="OpsConfig") as info:
        OpsConfig(entries)
    assert fragment in str(info.value)


def test_string_instead_of_list_is_a_type_error():
    with pytest.raises(TypeError, match=r"write \['none,\+rms_norm'\]"):
        OpsConfig("none,+rms_norm")


def test_bad_mode_and_backend():
    with pytest.raises(ValueError, match="mode"):
        OpsConfig([], mode=7)
    with pytest.raises(TypeError, match="backend"):
        OpsConfig([], backend="")


def test_decide_follows_reference_rules():
    cfg = OpsConfig(["none", "+rms_norm"])
    assert cfg.decide("rms_norm") == (True, "config '+rms_norm'")
    assert cfg.decide("silu_and_mul")[0] is False
    cfg = OpsConfig(["all", "-rms_norm"])
    assert cfg.decide("rms_norm")[0] is False
    assert cfg.decide("silu_and_mul")[0] is True
    assert cfg.decide(None)[0] is True  # unregistered op: the default


def test_equal_configs_hash_alike():
    assert OpsConfig(["none,+a"]) == OpsConfig(["none", "+a"])
    assert hash(OpsConfig(["none,+a"])) == hash(OpsConfig(["none", "+a"]))
    assert OpsConfig(["none"]) != OpsConfig(["all"])


def test_config_from_env():
    env = {"DUALOP_CUSTOM_OPS": "none,+rms_norm", "DUALOP_BACKEND": "inductor", "DUALOP_MODE": "3"}
    cfg = config_from_env(env)
    assert cfg.custom_ops == ("none", "+rms_norm")
    assert cfg.backend == "inductor" and cfg.mode is CompilationMode.FULL
    assert config_from_env({"DUALOP_BACKEND": "inductor", "DUALOP_MODE": "full"}).custom_ops == ("none",)
    with pytest.raises(ValueError, match="DUALOP_CUSTOM_OPS"):
        config_from_env({"DUALOP_CUSTOM_OPS": "all,none"})
    with pytest.raises(ValueError, match="DUALOP_MODE"):
        config_from_env({"DUALOP_MODE": "fast"})


def test_set_config_is_a_context_manager_and_restores():
    outer = get_config()
    cfg = OpsConfig(["none"])
    with set_config(cfg) as active:
        assert active is cfg and get_config() is cfg
        inner = OpsConfig(["all", "-rms_norm"])
        with set_config(inner):
            assert get_config() is inner
        assert get_config() is cfg
    assert get_config() is outer
    with pytest.raises(TypeError):
        with set_config(["none"]):
            pass


def test_set_config_is_thread_local():
    seen = {}
    barrier = threading.Barrier(2)

    def worker(name, cfg):
        with set_config(cfg):
            barrier.wait()
            seen[name] = get_config()
            barrier.wait()

    a, b = OpsConfig(["none"]), OpsConfig(["all"])
    threads = [threading.Thread(target=worker, args=("a", a)), threading.Thread(target=worker, args=("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": a, "b": b}


def test_set_config_is_task_local():
    async def task(cfg, gate_in, gate_out):
        with set_config(cfg):
            gate_in.set()
            await gate_out.wait()
            return get_config()

    async def main():
        a_in, b_in, go = asyncio.Event(), asyncio.Event(), asyncio.Event()
        a, b = OpsConfig(["none"]), OpsConfig(["all", "-rms_norm"])
        ta = asyncio.create_task(task(a, a_in, go))
        tb = asyncio.create_task(task(b, b_in, go))
        await a_in.wait()
        await b_in.wait()
        go.set()
        return (await ta) is a, (await tb) is b

    assert asyncio.run(main()) == (True, True)
