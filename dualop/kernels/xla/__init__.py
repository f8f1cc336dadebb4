"""Kernels written as plain JAX programs for XLA to compile (no Pallas): the paths jax arrays take
where XLA's own kernels are the fast ones (the vendor GEMM and grouped matmul, cuDNN's attention,
a chunked scan built from matmuls), and that torch_xla and torchax reach through the JAX bridge."""
