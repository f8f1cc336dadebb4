"""Frontend-neutral op definitions, one module per family. Importing this package registers
every op (it imports no torch or jax)."""

from dualop.ops.activation import GeluAndMul, ReLUSquaredActivation, SiluAndMul
from dualop.ops.layernorm import RMSNorm

__all__ = ["GeluAndMul", "ReLUSquaredActivation", "RMSNorm", "SiluAndMul"]
