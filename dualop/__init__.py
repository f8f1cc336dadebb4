"""dualop: one op definition, two frontends (PyTorch and JAX), per-platform kernels.

>>> import dualop
>>> norm = dualop.ops.RMSNorm(4096)
>>> y = norm(x)            # x: torch.Tensor or jax.Array; the path follows config and platform

Importing dualop imports neither torch nor jax; each is imported when an array of it is seen.
"""

from dualop.config import CompilationMode, OpsConfig, get_config, set_config
from dualop.custom_op import CustomOp, dispatch_report
from dualop.platforms import current_platform, override_platform
from dualop import ops  # registers every in-tree op
from dualop import plugins as _plugins

__version__ = "0.1.0"

__all__ = [
    "CompilationMode",
    "CustomOp",
    "OpsConfig",
    "current_platform",
    "dispatch_report",
    "get_config",
    "ops",
    "override_platform",
    "set_config",
    "load_plugins",
]

load_plugins = _plugins.load_plugins
load_plugins()
