"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * scale, over the last axis, in float32."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from sse_jax.layers import params


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2, -1) + eps) in float32."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis of size `dim`: x [..., dim] -> [..., dim] in `dtype`.

  The statistics are computed in float32 whatever the compute dtype. Used on the
  residual stream ([B, T, D], names ("embed",)) and per head on the linear-attention
  output ([B, T, H, Dv], one scale [Dv] shared by the heads, names ("head_dim",)).
  """

  def __init__(self, dim: int, *, eps: float = 1e-6,
               names: Sequence[str | None] = ("embed",), rngs: nnx.Rngs | None = None,
               dtype=jnp.float32, param_dtype=jnp.float32):
    del rngs  # ones-initialised; the keyword keeps the layer constructors uniform
    self.eps = eps
    self.dtype = dtype
    self.scale = params.ones((dim,), names, param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return _scaled_rms_norm(x, self.scale[...], self.eps, jnp.dtype(self.dtype))


@functools.partial(jax.checkpoint, static_argnums=(2, 3))
def _scaled_rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype) -> jax.Array:
  """rms_normalize(x) * scale in `dtype`, recomputed in the backward pass: its float32
  intermediates are three float32 copies of x (about a third of what a model keeps for
  its backward pass, `experiments.saved_residuals`), and recomputing them is elementwise
  work on x, which is kept anyway in its own dtype."""
  y = rms_normalize(x, eps) * scale.astype(jnp.float32)
  return y.astype(dtype)
