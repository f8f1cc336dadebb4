"""Frontend-neutral op definitions, one module per family. Importing this package registers
every op (it imports no torch or jax)."""

from dualop.ops.activation import GeluAndMul, SiluAndMul
from dualop.ops.layernorm import RMSNorm
from dualop.ops.pointwise import ReLUSquaredActivation

__all__ = ["GeluAndMul", "ReLUSquaredActivation", "RMSNorm", "SiluAndMul"]
