"""Quantisation ops (being written: QuantFP8)."""

__all__: list[str] = []
