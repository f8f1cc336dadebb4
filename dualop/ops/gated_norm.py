"""Gated RMS normalisation (being written: RMSNormGated)."""

__all__: list[str] = []
