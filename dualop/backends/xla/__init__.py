"""The XLA side: the jax array namespace (``array_api``) and the Pallas bridges (``pallas_bridge``)
that reach a Pallas kernel from JAX, from torch_xla tensors and from torchax tensors."""
