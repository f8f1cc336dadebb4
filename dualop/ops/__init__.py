"""Frontend-neutral op definitions, one module per family. Importing this package registers
every op (it imports no torch or jax)."""

from dualop.ops.activation import *  # noqa: F403
from dualop.ops.attention import *  # noqa: F403
from dualop.ops.encoder_attention import *  # noqa: F403
from dualop.ops.gated_norm import *  # noqa: F403
from dualop.ops.kv_cache import *  # noqa: F403
from dualop.ops.layernorm import *  # noqa: F403
from dualop.ops.moe import *  # noqa: F403
from dualop.ops.moe_modular import *  # noqa: F403
from dualop.ops.pointwise import *  # noqa: F403
from dualop.ops.quantization import *  # noqa: F403
from dualop.ops.rope_scaling import *  # noqa: F403
from dualop.ops.rotary import *  # noqa: F403
from dualop.ops import (
    activation, attention, encoder_attention, gated_norm, kv_cache, layernorm, moe, pointwise, quantization,
    rope_scaling, rotary,
)
from dualop.ops.moe_transformers import *  # noqa: F403
from dualop.ops import moe_transformers
from dualop.ops import moe_modular
from dualop.ops.linear import *  # noqa: F403
from dualop.ops.embedding import *  # noqa: F403
from dualop.ops.logits_processor import *  # noqa: F403
from dualop.ops.conv import *  # noqa: F403
from dualop.ops import conv, embedding, linear, logits_processor
from dualop.ops.mamba_mixer2 import *  # noqa: F403
from dualop.ops import mamba_mixer2

# Ops that hold no parameters: the layer modules wrap each as-is (dualop.torch/jax.layers).
PARAMETERLESS_OPS = (
    SiluAndMul, MulAndSilu, GeluAndMul, GeluAndMulSparse, FatreluAndMul, SwigluOAIAndMul,  # noqa: F405
    NewGELU, FastGELU, QuickGELU, ReLUSquaredActivation, QuantFP8,  # noqa: F405
)

__all__ = [
    *activation.__all__,
    *attention.__all__,
    *encoder_attention.__all__,
    *gated_norm.__all__,
    *kv_cache.__all__,
    *layernorm.__all__,
    *moe.__all__,
    *pointwise.__all__,
    *quantization.__all__,
    *rope_scaling.__all__,
    *rotary.__all__,
    *moe_transformers.__all__,
    *moe_modular.__all__,
    *linear.__all__,
    *embedding.__all__,
    *logits_processor.__all__,
    *conv.__all__,
    *mamba_mixer2.__all__,
]

# --- state-space ops (causal conv) ---
from dualop.ops.causal_conv1d import *  # noqa: F403,E402
from dualop.ops import causal_conv1d  # noqa: E402

__all__ += [*causal_conv1d.__all__]
from dualop.ops.short_conv import *  # noqa: F403,E402
from dualop.ops import short_conv  # noqa: E402

__all__ += [*short_conv.__all__]

# the Mamba-1 mixer
from dualop.ops.mamba_mixer import *  # noqa: F403,E402
from dualop.ops import mamba_mixer  # noqa: E402

__all__ += mamba_mixer.__all__

# PLaMo 2's Mamba mixer
from dualop.ops.plamo2 import *  # noqa: F403,E402
from dualop.ops import plamo2  # noqa: E402

__all__ += plamo2.__all__

# Mamba-1's selective scan
from dualop.ops.selective_scan import *  # noqa: F403,E402
from dualop.ops import selective_scan  # noqa: E402

__all__ += selective_scan.__all__

# --- state-space ops (SSD chunk scan) ---
from dualop.ops.ssd import *  # noqa: F403,E402
from dualop.ops import ssd  # noqa: E402

__all__ += [*ssd.__all__]

# DeepSeek's multi-head latent attention: the paged latent cache, its write and the layer
from dualop.ops.mla import *  # noqa: F403,E402
from dualop.ops import mla  # noqa: E402

__all__ += mla.__all__
