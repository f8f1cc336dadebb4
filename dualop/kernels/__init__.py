"""Kernels: ``pallas/`` (TPU, JAX functions) and ``cuda/`` (Triton, for CUDA and ROCm)."""
