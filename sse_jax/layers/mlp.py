"""SwiGLU feed-forward: y = (silu(x W_gate) * (x W_up)) W_down."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from sse_jax.layers import validation as check
from sse_jax.layers.params import Einsum


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  """SwiGLU sizes: `hidden` D -> `intermediate` I -> D (3 D I parameters)."""

  hidden: int
  intermediate: int

  def __post_init__(self):
    self.validate()

  def validate(self) -> None:
    check.positive_int("MLPConfig", "hidden", self.hidden)
    check.positive_int("MLPConfig", "intermediate", self.intermediate)


class SwiGLU(nnx.Module):
  """x [B, T, D] -> [B, T, D] (compute dtype)."""

  def __init__(self, config: MLPConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    config.validate()
    self.config = config
    d, i = config.hidden, config.intermediate
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.gate = Einsum("btd,df->btf", (d, i), ("embed", "mlp"), **kw)
    self.up = Einsum("btd,df->btf", (d, i), ("embed", "mlp"), **kw)
    self.down = Einsum("btf,fd->btd", (i, d), ("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
