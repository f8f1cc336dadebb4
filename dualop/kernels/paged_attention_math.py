"""What every ragged paged attention path shares (the op's native body, the Pallas and Triton
kernels): the default mask value and the rule for when masked KV positions may be skipped."""

from __future__ import annotations

__all__ = ["DEFAULT_MASK_VALUE", "FLOAT32_MAX", "masked_positions_vanish", "sink_logits"]

FLOAT32_MAX = 3.4028234663852886e38
# JAX's DEFAULT_MASK_VALUE: -0.7 * float32 max (finite, so a fully masked row never makes NaN).
DEFAULT_MASK_VALUE = -0.7 * FLOAT32_MAX


def masked_positions_vanish(mask_value: float, soft_cap: float | None) -> bool:
    """Whether a masked position's weight ``exp(mask_value - row max)`` is 0 in float32 for any
    real attention row, so KV blocks no row can see may be skipped: -inf, a mask value at or
    below -1e30, or one over 104 (float32's exp range) below the lowest soft-capped score. A mask
    value near the scores (say -1) makes every masked position below kv_len count, as in JAX's
    reference; then every KV block up to kv_len is visited."""
    if mask_value <= -1e30:
        return True
    return soft_cap is not None and mask_value < -soft_cap - 104.0


def sink_logits(xp, sinks):
    """Attention sinks as every path reads them: float32, clipped to +-float32 max (NaN stays NaN).
    A sink is one logit per query head that joins each row's softmax denominator (gpt-oss): the
    row's weights are ``exp(s_j - m) / (exp(sink - m) + sum_k exp(s_k - m))`` with ``m`` the max of
    the scores and the sink. Clipped, +inf weighs every position 0 (the output is 0) and -inf
    weighs nothing, with no ``inf - inf``; the kernels start each row's online softmax at
    ``(max, sum) = (sink, 1)`` from the same clipped value."""
    return xp.clip(xp.astype(sinks, xp.float32), -FLOAT32_MAX, FLOAT32_MAX)
