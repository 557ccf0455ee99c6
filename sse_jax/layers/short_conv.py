"""Causal depthwise short convolution + SiLU over time (fla's ShortConvolution).

    y_t = silu( sum_{j=0}^{w-1} W_j * x_{t-w+1+j} ),   per feature channel,

where inputs before the first token come from the conv state (the last w - 1 inputs
of the previous call; zeros at the start of a sequence). With `positions` (packed
sequences, see `sequences`), a term whose input lies before its token's sequence start
(position p < w - 1 - j) is dropped, as if that sequence had started from zeros.
Applied to the q / k / v projections of the linear-attention mixers (official `use_short_conv`, width 4).
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

  def __call__(self, x: jax.Array, state: jax.Array | None = None,
               positions: jax.Array | None = None):
    """x [B, T, *F], state [B, w - 1, *F] or None (zeros), positions int [T] or None:
    each token's position within its packed sequence (`state` must then be None)."""
    b, t = x.shape[:2]
    if state is None:
      state = self.init_state(b)
    xs = jnp.concatenate([state.astype(self.dtype), x.astype(self.dtype)], axis=1)
    w = self.kernel[...].astype(self.dtype)
    # A width-w depthwise conv is w shifted multiply-adds: cheaper than a grouped
    # convolution for w ~ 4, and the same code serves prefill and decode (T = 1).
    terms = [w[j] * xs[:, j:j + t] for j in range(self.width)]
    if positions is not None:
      # term j reads the input w - 1 - j steps back: in its own sequence only
      pos = positions.reshape((1, t) + (1,) * len(self.features))
      terms = [jnp.where(pos >= self.width - 1 - j, term, 0) for j, term in enumerate(terms)]
    y = sum(terms)
    return jax.nn.silu(y), xs[:, t:]


def init_states(convs: Sequence[ShortConv | None], batch: int):
  """The zero states of the q / k / v convs, or None without short conv (convs None)."""
  if convs[0] is None:
    return None
  return tuple(c.init_state(batch) for c in convs)


def apply_all(convs: Sequence[ShortConv | None], xs: Sequence[jax.Array], states=None,
              positions: jax.Array | None = None):
  """(ys, new states) of the q / k / v convs over xs, from `states` (None: zeros), with
  packed-sequence `positions` (see `ShortConv`); without short conv (convs None),
  (xs, None)."""
  if convs[0] is None:
    return tuple(xs), None
  states = states if states is not None else (None,) * len(xs)
  pairs = [c(x, s, positions) for c, x, s in zip(convs, xs, states)]
  return tuple(y for y, _ in pairs), tuple(s for _, s in pairs)
