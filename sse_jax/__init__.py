"""sse-jax: Sparse State Expansion linear attention in JAX / Flax."""

__version__ = "0.1.0"
