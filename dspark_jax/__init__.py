"""dspark_jax: DSpark speculative decoding (semi-autoregressive drafter, confidence head,
hardware-aware scheduler) in JAX/Flax."""

__version__ = "0.1.0"
