"""CustomOp: registries, OOT replacement, enabled rules, dispatch and its report."""

from __future__ import annotations

import warnings

import pytest
import torch

import dualop
from dualop import CustomOp, OpsConfig, dispatch_report, override_platform, set_config
from dualop.platforms import PLATFORMS


def _x():
    return torch.zeros(2, 4)


class _Recorder(CustomOp):
    """Returns the name of the method that ran."""

    def forward_native(self, x):
        return "forward_native"


def _recording(name: str, *methods: str, class_name: str) -> type[CustomOp]:
    """Register op ``name`` (a class named ``class_name``, the name out-of-tree replacements
    give) whose platform ``methods`` each return their own name."""

    def returning(method: str):
        def forward(self, x):
            return method

        forward.__name__ = method
        return forward

    return CustomOp.register(name)(type(class_name, (_Recorder,), {m: returning(m) for m in methods}))


@pytest.fixture
def op_classes(clean_registry):
    full = _recording("test_full", "forward_cpu", "forward_cuda", "forward_tpu", "forward_xpu", "forward_oot",
                      class_name="Full")
    return full, _recording("test_native_only", class_name="NativeOnly")


# ---- registries ------------------------------------------------------------------------------


def test_register_sets_name_and_registry(op_classes):
    full, native_only = op_classes
    assert full.name == "test_full"
    assert CustomOp.op_registry["test_full"] is full
    assert CustomOp.op_registry["test_native_only"] is native_only


def test_register_rejects_a_duplicate_name(op_classes):
    with pytest.raises(ValueError, match="duplicate op name 'test_full'"):

        @CustomOp.register("test_full")
        class Other(_Recorder):
            pass


def test_register_rejects_non_ops(clean_registry):
    with pytest.raises(TypeError, match="not a CustomOp subclass"):
        CustomOp.register("x")(object)


def test_in_tree_ops_are_registered():
    assert {"rms_norm", "silu_and_mul", "gelu_and_mul", "relu2"} <= set(CustomOp.op_registry)
    assert CustomOp.op_registry["rms_norm"] is dualop.ops.RMSNorm


@pytest.mark.parametrize("form", ["positional", "keyword", "direct", "bare"])
def test_register_oot_forms_swap_the_class(op_classes, form):
    full, _ = op_classes

    class Replacement(full):
        def forward_oot(self, x):
            return "replacement"

    if form == "positional":
        CustomOp.register_oot("Full")(Replacement)
    elif form == "keyword":
        CustomOp.register_oot(name="Full")(Replacement)
    elif form == "direct":
        assert CustomOp.register_oot(_decorated_op_cls=Replacement, name="Full") is Replacement
    else:
        assert full.register_oot(Replacement) is Replacement  # bare @Full.register_oot
    assert CustomOp.op_registry_oot["Full"] is Replacement
    op = full()
    assert type(op) is Replacement
    assert op.name == "test_full"  # the replacement follows its parent's registered name
    with override_platform("oot"):
        assert op(_x()) == "replacement"


def test_register_oot_same_class_twice_is_a_no_op_other_class_is_an_error(op_classes):
    full, _ = op_classes

    class A(full):
        pass

    class B(full):
        pass

    CustomOp.register_oot("Full")(A)
    CustomOp.register_oot("Full")(A)
    with pytest.raises(ValueError, match="already replaced"):
        CustomOp.register_oot("Full")(B)


def test_register_oot_needs_a_name_or_a_parent(clean_registry):
    class Loose(_Recorder):
        pass

    with pytest.raises(TypeError, match="bare use needs the in-tree class"):
        CustomOp.register_oot(Loose)
    with pytest.raises(TypeError, match="name the in-tree class"):
        CustomOp.register_oot()


def test_oot_replacement_that_is_not_a_subclass_is_initialised(op_classes):
    full, _ = op_classes

    class Unrelated(CustomOp):
        def __init__(self, tag="t"):
            super().__init__()
            self.tag = tag

        def forward_native(self, x):
            return self.tag

    CustomOp.register_oot(_decorated_op_cls=Unrelated, name="Full")
    op = full(tag="hello")
    assert type(op) is Unrelated and op.tag == "hello"


def test_constructor_arguments_reach_the_replacement(clean_registry):
    class Base(CustomOp):
        def __init__(self, size, *, enforce_enable=False):
            super().__init__(enforce_enable=enforce_enable)
            self.size = size

        def forward_native(self, x):
            return self.size

    @Base.register_oot
    class Replacement(Base):
        pass

    op = Base(7)
    assert type(op) is Replacement and op.size == 7


# ---- enabled rules ---------------------------------------------------------------------------


def test_enabled_and_default_on(op_classes):
    full, _ = op_classes
    with set_config(OpsConfig(["all"])):
        assert full.enabled() and full().enabled() and CustomOp.default_on()
    with set_config(OpsConfig(["none"])):
        assert not full.enabled() and not CustomOp.default_on()
    with set_config(OpsConfig(["none", "+test_full"])):
        assert full.enabled() and not CustomOp.default_on()
    with set_config(OpsConfig(["all", "-test_full"])):
        assert not full.enabled() and CustomOp.default_on()


def test_unregistered_subclass_follows_parent_name(op_classes):
    full, _ = op_classes

    class Child(full):
        pass

    assert Child.name == "test_full"
    with set_config(OpsConfig(["all", "-test_full"])):
        assert not Child.enabled()
        with override_platform("tpu"):
            assert Child()(_x()) == "forward_native"


def test_unregistered_op_follows_the_default(clean_registry):
    class Loose(_Recorder):
        def forward_cpu(self, x):
            return "forward_cpu"

    with set_config(OpsConfig(["all"])), override_platform("cpu"):
        assert Loose()(_x()) == "forward_cpu"
    with set_config(OpsConfig(["none"])), override_platform("cpu"):
        assert Loose()(_x()) == "forward_native"


def test_enforce_enable_forces_the_fast_path_only_for_that_instance(op_classes):
    full, _ = op_classes
    with set_config(OpsConfig(["none"])), override_platform("tpu"):
        forced, plain = full(enforce_enable=True), full()
        assert forced(_x()) == "forward_tpu"
        (row,) = dispatch_report()  # one row per (class, frontend, platform): the latest resolution
        assert (row["method"], row["reason"]) == ("forward_tpu", "enforce_enable=True")
        assert plain(_x()) == "forward_native"
        assert not full.enabled() and not forced.enabled()


# ---- dispatch ---------------------------------------------------------------------------------


@pytest.mark.parametrize("platform", PLATFORMS)
def test_each_platform_takes_its_method(op_classes, platform):
    full, _ = op_classes
    expected = {"rocm": "forward_cuda"}.get(platform, f"forward_{'hip' if platform == 'rocm' else platform}")
    with override_platform(platform):
        assert full()(_x()) == expected


def test_rocm_falls_back_to_cuda_and_says_so(op_classes):
    full, _ = op_classes
    with override_platform("rocm"):
        assert full()(_x()) == "forward_cuda"
    (row,) = [r for r in dispatch_report() if r["op"] == "test_full"]
    assert row["method"] == "forward_cuda"
    assert row["reason"] == "default: config holds 'all'; forward_hip not implemented, so forward_cuda"


def test_rocm_uses_forward_hip_when_present(clean_registry):
    hip = _recording("test_hip", "forward_hip", "forward_cuda", class_name="Hip")
    with override_platform("rocm"):
        assert hip()(_x()) == "forward_hip"


@pytest.mark.parametrize("platform", ["cpu", "cuda", "rocm", "tpu", "xpu", "oot"])
def test_missing_platform_method_falls_back_to_native(op_classes, platform):
    _, native_only = op_classes
    with override_platform(platform):
        assert native_only()(_x()) == "forward_native"
    (row,) = [r for r in dispatch_report() if r["op"] == "test_native_only"]
    assert row["method"] == "forward_native"
    assert row["reason"].endswith("not implemented, so forward_native")
    assert row["enabled"] is True


def test_not_implemented_at_call_time_falls_back_and_reports(clean_registry):
    @CustomOp.register("test_declines")
    class Declines(_Recorder):
        def forward_tpu(self, x):
            raise NotImplementedError("no bridge for this array")

    op = Declines()
    with override_platform("tpu"):
        assert op(_x()) == "forward_native"
        reason = "forward_tpu declined this call (no bridge for this array), so forward_native"
        assert op.last_run("torch") == ("forward_native", reason)
        assert op.resolution("torch") == ("forward_tpu", "default: config holds 'all'")
    (row,) = [r for r in dispatch_report() if r["op"] == "test_declines"]
    assert (row["method"], row["reason"]) == ("forward_native", reason)


def _declining_op():
    """An op whose CPU kernel exists for torch only, and not for one constructor variant."""

    @CustomOp.register("test_declines_at_resolution")
    class Variant(_Recorder):
        def __init__(self, exotic=False):
            super().__init__()
            self.exotic = exotic

        def declines(self, method, frontend):
            if method == "forward_cpu" and self.exotic:
                return "no kernel for the exotic variant"
            return None

        def forward_cpu(self, x):
            return "forward_cpu"

    return Variant


def test_a_method_declined_at_resolution_runs_native_with_the_reason(clean_registry):
    variant = _declining_op()
    plain, exotic = variant(), variant(exotic=True)
    with override_platform("cpu"):
        assert plain(_x()) == "forward_cpu" and plain.last_run("torch")[0] == "forward_cpu"
        assert exotic(_x()) == "forward_native"
        assert exotic.last_run("torch") == (
            "forward_native",
            "default: config holds 'all'; forward_cpu: no kernel for the exotic variant, so forward_native",
        )
        assert exotic.last_fallback is None  # decided once at resolution, not per call


def test_declines_is_asked_once_per_resolution_not_per_call(clean_registry, monkeypatch):
    variant = _declining_op()
    asked = []
    real = variant.declines
    monkeypatch.setattr(variant, "declines", lambda self, m, f: asked.append(m) or real(self, m, f))
    op = variant(exotic=True)
    with override_platform("cpu"):
        for _ in range(5):
            assert op(_x()) == "forward_native"
    assert asked == ["forward_cpu"]


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_what_a_method_serves_is_declared_once_and_read_at_resolution(clean_registry, platform):
    """An op that declares nothing cannot route jax arrays into its CPU or Triton method (both take
    torch tensors); one that declares jax on a method gets it; the reason names the frontend."""
    import jax.numpy as jnp

    from dualop.custom_op import Serves

    @CustomOp.register("test_serves_default")
    class Default(_Recorder):
        def forward_cpu(self, x):
            raise AssertionError("a jax array reached a torch kernel")

        def forward_cuda(self, x):
            raise AssertionError("a jax array reached a torch kernel")

    @CustomOp.register("test_serves_jax")
    class Declared(_Recorder):
        serves = {"forward_cpu": Serves(("torch", "jax")), "forward_cuda": Serves(("torch", "jax"))}

        def forward_cpu(self, x):
            return "forward_cpu"

        def forward_cuda(self, x):
            return "forward_cuda"

    class Narrower(Declared):  # a subclass overrides one entry and inherits the other
        serves = {"forward_cuda": Serves(("torch",), "not for {frontend} arrays")}

    x = jnp.zeros((2, 4))
    with override_platform(platform):
        op = Default()
        assert op(x) == "forward_native"
        method, reason = op.last_run("jax")
        assert method == "forward_native" and "jax arrays" in reason and op.last_fallback is None
        assert Declared()(x) == f"forward_{platform}"
        narrow = Narrower()
        assert narrow(x) == ("forward_cpu" if platform == "cpu" else "forward_native")
        if platform == "cuda":
            assert "not for jax arrays" in narrow.last_run("jax")[1]


def test_last_fallback_is_kept_until_cleared(clean_registry):
    @CustomOp.register("test_declines_sometimes")
    class Sometimes(_Recorder):
        def forward_cpu(self, x):
            if x.shape[0] == 0:
                raise NotImplementedError("empty input")
            return "forward_cpu"

    op = Sometimes()
    with override_platform("cpu"):
        assert op(torch.zeros(0, 4)) == "forward_native"
        assert op(_x()) == "forward_cpu"  # the kernel path records nothing, so
        assert op.last_run("torch")[0] == "forward_native"  # the decline still shows until cleared
        op.last_fallback = None
        assert op(_x()) == "forward_cpu"
        assert op.last_run("torch") == ("forward_cpu", "default: config holds 'all'")


def test_native_not_implemented_propagates(clean_registry):
    class Empty(CustomOp):
        pass

    with override_platform("cpu"), pytest.raises(NotImplementedError, match="forward_native"):
        Empty()(_x())


def test_dispatch_is_resolved_once_and_cached(op_classes, monkeypatch):
    full, _ = op_classes
    op = full()
    calls = []
    original = CustomOp._resolve

    def counting(self, *args):
        calls.append(args[0])
        return original(self, *args)

    monkeypatch.setattr(CustomOp, "_resolve", counting)
    with override_platform("tpu"):
        for _ in range(5):
            assert op(_x()) == "forward_tpu"
    assert len(calls) == 1
    with override_platform("cpu"):  # a platform change invalidates the cache
        assert op(_x()) == "forward_cpu"
    assert len(calls) == 2
    cfg = OpsConfig(["none"])
    with override_platform("cpu"), set_config(cfg):
        assert op(_x()) == "forward_native"
        assert op(_x()) == "forward_native"
    assert len(calls) == 3


def _counting_resolutions(monkeypatch) -> list:
    """Record the frontend of every resolution (a dispatch cache miss) from now on."""
    calls = []
    original = CustomOp._resolve

    def counting(self, *args):
        calls.append(args[0])
        return original(self, *args)

    monkeypatch.setattr(CustomOp, "_resolve", counting)
    return calls


def test_one_dispatch_cache_is_what_introspection_reports(op_classes):
    """Each resolution is one entry of the op's dispatch cache; the last hit is that entry itself;
    ``resolution()``, ``dispatched_method()``, ``last_run()`` and the report row read the same
    entry, and asking before any call adds the entry the first call then reuses."""
    from dualop.custom_op import report_row

    full, _ = op_classes
    op = full()
    with override_platform("cpu"):
        assert op(_x()) == "forward_cpu"
        (entry,) = op._resolutions.values()
        assert op._armed is entry and entry.key == ("torch", "cpu", dualop.get_config().dispatch_key)
        assert entry.method == op.forward_cpu and entry.array_type is torch.Tensor
        assert op.resolution("torch", "cpu") == (entry.name, entry.reason) == op.last_run("torch", "cpu")
        assert op.dispatched_method("torch") == entry.name
        row = report_row(full, "torch", "cpu")
        assert (row["method"], row["reason"]) == (entry.name, entry.reason)
        with set_config(OpsConfig(["none"])):
            assert op(_x()) == "forward_native"
            assert op._armed is op._resolutions[op._armed.key]
            assert op.resolution("torch", "cpu") == (op._armed.name, op._armed.reason)
        assert sorted(e.name for e in op._resolutions.values()) == ["forward_cpu", "forward_native"]

    asked = full()
    with override_platform("tpu"):
        assert asked.dispatched_method("torch") == "forward_tpu"
        (entry,) = asked._resolutions.values()
        assert asked._armed is not entry  # no call yet: nothing to reuse
        assert asked(_x()) == "forward_tpu"
        (armed,) = asked._resolutions.values()
        assert asked._armed is armed and (armed.name, armed.reason) == (entry.name, entry.reason)


def test_the_dispatch_cache_follows_a_config_change(op_classes, monkeypatch):
    """A context config and the process default each change what an existing instance runs; an
    equal config object reuses the cached entry without resolving again."""
    from dualop import config

    full, _ = op_classes
    op = full()
    calls = _counting_resolutions(monkeypatch)
    with override_platform("cpu"):
        with set_config(OpsConfig(["all"])):
            assert [op(_x()) for _ in range(3)] == ["forward_cpu"] * 3
        with set_config(OpsConfig(["none"])):
            assert [op(_x()) for _ in range(3)] == ["forward_native"] * 3
        with set_config(OpsConfig(["all"])):
            assert op(_x()) == "forward_cpu"
        assert len(calls) == 2
        try:
            monkeypatch.setenv(config.ENV_CUSTOM_OPS, "all")
            config.reload_process_default()
            assert [op(_x()) for _ in range(2)] == ["forward_cpu"] * 2
            monkeypatch.setenv(config.ENV_CUSTOM_OPS, "none")
            config.reload_process_default()
            assert [op(_x()) for _ in range(2)] == ["forward_native"] * 2
            assert op._armed.reason == op.resolution("torch", "cpu")[1] and "disabled" in op._armed.reason
        finally:
            monkeypatch.undo()
            config.reload_process_default()


def test_the_dispatch_cache_is_invalidated_by_a_re_registration(op_classes, monkeypatch):
    """Registering a replacement makes every instance's last hit stale (its generation is past), so
    an existing instance resolves again (its own class still decides) and new ones build the
    replacement."""
    from dualop import custom_op

    full, _ = op_classes
    op = full()
    calls = _counting_resolutions(monkeypatch)
    with override_platform("oot"):
        assert [op(_x()) for _ in range(2)] == ["forward_oot"] * 2
        stale = op._armed

        class Replacement(full):
            def forward_oot(self, x):
                return "replacement"

        CustomOp.register_oot("Full")(Replacement)
        assert stale.generation != custom_op._generation
        assert op(_x()) == "forward_oot" and len(calls) == 2
        assert op._armed is not stale and op._armed.generation == custom_op._generation
        assert full()(_x()) == "replacement"


class _Generic(CustomOp):
    """``forward_native(*args)``: no generated ``__call__``, so every call takes ``_dispatch``."""

    def forward_native(self, *args):
        return "forward_native"

    def forward_cpu(self, *args):
        return "forward_cpu"

    def forward_xpu(self, *args):
        return "forward_xpu"


@pytest.mark.parametrize("generated", [True, False], ids=["generated call", "generic call"])
def test_the_last_hit_never_serves_another_frontend(op_classes, generated):
    """torch and jax calls alternate on one instance: the CPU method takes torch tensors only, so
    each jax call runs forward_native and each torch call forward_cpu, never the other's hit."""
    import jax.numpy as jnp

    full, _ = op_classes
    op = full() if generated else _Generic()
    assert (type(op).__call__ is not CustomOp.__call__) is generated
    t, j = _x(), jnp.zeros((2, 4))
    ran = {"torch": "forward_cpu", "jax": "forward_native"}
    with override_platform("cpu"):
        for frontend, x in [("torch", t), ("torch", t), ("jax", j), ("jax", j), ("torch", t), ("jax", j)]:
            assert op(x) == ran[frontend]
            assert op._armed.frontend == frontend and op._armed.name == ran[frontend]
        assert {e.key[0] for e in op._resolutions.values()} == {"torch", "jax"}


@pytest.mark.parametrize("generated", [True, False], ids=["generated call", "generic call"])
def test_the_last_hit_never_serves_another_device(op_classes, monkeypatch, generated):
    """Plain tensors of two device types share one type: where devices can differ, the last hit's
    guard probes the device, so a 'meta' tensor (standing in for an XPU) never reuses the CPU hit."""
    from dualop import platforms

    full, _ = op_classes
    original = platforms._torch_device_platform
    monkeypatch.delenv("DUALOP_PLATFORM", raising=False)
    monkeypatch.setattr(platforms, "_torch_devices_vary", lambda: True)
    monkeypatch.setattr(platforms, "_torch_device_platform", lambda x: "xpu" if x.is_meta else original(x))
    platforms.invalidate()
    op = full() if generated else _Generic()
    cpu, meta = torch.zeros(2), torch.empty(2, device="meta")
    with set_config(OpsConfig(["all"])):
        ran = [op(t) for t in (cpu, cpu, meta, meta, cpu, meta)]
        assert ran == ["forward_cpu", "forward_cpu", "forward_xpu", "forward_xpu", "forward_cpu", "forward_xpu"]
        assert op._armed.platform == "xpu" and op._armed.probe is not None
        assert {e.key[1] for e in op._resolutions.values()} == {"cpu", "xpu"}


def test_config_switch_changes_dispatch_of_existing_instances(op_classes):
    full, _ = op_classes
    op = full()
    with override_platform("tpu"):
        with set_config(OpsConfig(["all"])):
            assert op(_x()) == "forward_tpu"
        with set_config(OpsConfig(["none"])):
            assert op(_x()) == "forward_native"
        with set_config(OpsConfig(["none", "+test_full"])):
            assert op(_x()) == "forward_tpu"


def test_non_array_first_argument_is_a_type_error(op_classes):
    full, _ = op_classes
    with pytest.raises(TypeError, match="test_full: expected a torch.Tensor or jax.Array"):
        full()([1.0, 2.0])


def test_keyword_only_call_dispatches(op_classes):
    full, _ = op_classes
    with override_platform("cpu"):
        assert full()(x=_x()) == "forward_cpu"


def test_overriding_call_or_forward_warns_at_class_creation():
    for attr in ("__call__", "forward"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            type("Bypass", (CustomOp,), {attr: lambda self, x: x})
        assert any("bypasses dualop's dispatch" in str(w.message) for w in caught), attr


def test_unknown_config_names_warn_once_with_close_matches(op_classes):
    full, _ = op_classes
    cfg = OpsConfig(["none", "+test_ful"])
    with set_config(cfg), override_platform("cpu"):
        with pytest.warns(UserWarning, match=r"'test_ful'.*did you mean 'test_full'"):
            full()(_x())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            full()(_x())  # once per config: no second warning


def test_strict_config_rejects_unknown_names(op_classes):
    full, _ = op_classes
    with set_config(OpsConfig(["all", "-rms_nrom"], strict=True)), override_platform("cpu"):
        with pytest.raises(ValueError, match=r"strict=True.*'rms_nrom'.*did you mean 'rms_norm'"):
            full()(_x())


def test_report_rows_have_the_documented_keys(op_classes):
    full, _ = op_classes
    with override_platform("tpu"), set_config(OpsConfig(["none", "+test_full"])):
        full()(_x())
    (row,) = [r for r in dispatch_report() if r["op"] == "test_full"]
    assert set(row) == {"op", "cls", "frontend", "platform", "method", "enabled", "reason"}
    assert row == {
        "op": "test_full",
        "cls": f"{__name__}.Full",
        "frontend": "torch",
        "platform": "tpu",
        "method": "forward_tpu",
        "enabled": True,
        "reason": "config '+test_full'",
    }
