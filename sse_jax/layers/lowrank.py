"""Low-rank maps: the GLA decay gate and the LoRA of the shared SSE partition."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sse_jax.layers import params
from sse_jax.layers.params import Einsum


class LowRank(nnx.Module):
  """x [B, T, D] -> x A B : [B, T, H, Dk], A [D, r], B [r, H, Dk].

  `zero_init=True` starts B at zero (LoRA: the adapted projection starts equal to the
  base one).
  """

  def __init__(self, hidden: int, rank: int, heads: int, dim: int, *, rngs: nnx.Rngs,
               dtype=jnp.float32, param_dtype=jnp.float32, zero_init: bool = False):
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.down = Einsum("btd,dr->btr", (hidden, rank), ("embed", "lora"), **kw)
    init = nnx.initializers.zeros_init() if zero_init else params.default_init
    self.up = Einsum("btr,rhk->bthk", (rank, heads, dim), ("lora", "heads", "head_dim"),
                     init=init, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.up(self.down(x))


class DecayGate(nnx.Module):
  """GLA's low-rank log-decay gate (fla `gk_proj`, docs/design.md, section 2):

      g = log_sigmoid(x W_1 W_2 + b) / normalizer    [B, T, H, Dk], float32, <= 0

  with W_1 [D, r], W_2 [r, H, Dk], b [H, Dk] (rank r = 16, normaliser 16 by default:
  per-step decays exp(g) start near sigmoid(0)^(1/16) ~ 0.96).
  """

  def __init__(self, hidden: int, rank: int, heads: int, dim: int, normalizer: float, *,
               rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
    self.normalizer = float(normalizer)
    self.proj = LowRank(hidden, rank, heads, dim, rngs=rngs, dtype=dtype,
                        param_dtype=param_dtype)
    self.bias = params.zeros((heads, dim), ("heads", "head_dim"), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    logits = self.proj(x).astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return jax.nn.log_sigmoid(logits) / self.normalizer
