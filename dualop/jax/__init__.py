"""The JAX face of dualop: ``dualop.jax.layers`` holds flax.nnx modules that own their parameters
and call the ops, so config and dispatch apply unchanged."""
