"""A dummy dualop device plugin, installed by the plugin tests into a temporary directory."""

import os


def register_ops():
    from dualop import CustomOp
    from dualop.ops import RMSNorm

    @RMSNorm.register_oot
    class DummyRMSNorm(RMSNorm):
        def forward_oot(self, x, weight=None, residual=None):
            out = self.forward_native(x, weight, residual)
            return ("dummy_oot", out)

    assert CustomOp.op_registry_oot["RMSNorm"] is DummyRMSNorm


def broken():
    raise RuntimeError("the dummy plugin's device is missing")


def claim_platform():
    return "oot" if os.environ.get("DUMMY_PLUGIN_CLAIM") == "1" else None
