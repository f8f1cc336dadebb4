"""The XLA side: the jax array namespace (``array_api``) and the JAX bridge (``jax_bridge``) that
calls a JAX function, a Pallas kernel or a plain XLA program, from jax arrays and from torch_xla,
torchax and torch_tpu tensors."""
