"""Causal depthwise short convolution + SiLU over time (fla's ShortConvolution).

    y_t = silu( sum_{j=0}^{w-1} W_j * x_{t-w+1+j} ),   per feature channel,

where inputs before the first token come from the conv state (the last w - 1 inputs
of the previous call; zeros at the start of a sequence). Applied to the q / k / v
projections of the linear-attention mixers (official `use_short_conv`, width 4).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from sse_jax.layers import params


def _conv_init(width: int):
  # PyTorch's Conv1d default for a depthwise kernel: U(-1/sqrt(w), 1/sqrt(w)).
  bound = width ** -0.5
  return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


class ShortConv(nnx.Module):
  """x [B, T, *F] -> (y [B, T, *F], state [B, w - 1, *F]), with a kernel [w, *F]."""

  def __init__(self, width: int, features: Sequence[int], names: Sequence[str | None], *,
               rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
    self.width = width
    self.features = tuple(features)
    self.dtype = dtype
    self.kernel = params.param(rngs, _conv_init(width), (width,) + self.features,
                               ("conv",) + tuple(names), param_dtype)

  def init_state(self, batch: int) -> jax.Array:
    return jnp.zeros((batch, self.width - 1) + self.features, self.dtype)

  def __call__(self, x: jax.Array, state: jax.Array | None = None):
    b, t = x.shape[:2]
    if state is None:
      state = self.init_state(b)
    xs = jnp.concatenate([state.astype(self.dtype), x.astype(self.dtype)], axis=1)
    w = self.kernel[...].astype(self.dtype)
    # A width-w depthwise conv is w shifted multiply-adds: cheaper than a grouped
    # convolution for w ~ 4, and the same code serves prefill and decode (T = 1).
    y = sum(w[j] * xs[:, j:j + t] for j in range(self.width))
    return jax.nn.silu(y), xs[:, t:]


def init_states(convs: Sequence[ShortConv | None], batch: int):
  """The zero states of the q / k / v convs, or None without short conv (convs None)."""
  if convs[0] is None:
    return None
  return tuple(c.init_state(batch) for c in convs)


def apply_all(convs: Sequence[ShortConv | None], xs: Sequence[jax.Array], states=None):
  """(ys, new states) of the q / k / v convs over xs, from `states` (None: zeros);
  without short conv (convs None), (xs, None)."""
  if convs[0] is None:
    return tuple(xs), None
  states = states if states is not None else (None,) * len(xs)
  pairs = [c(x, s) for c, x, s in zip(convs, xs, states)]
  return tuple(y for y, _ in pairs), tuple(s for _, s in pairs)
