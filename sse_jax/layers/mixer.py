"""What every token mixer (attention, GLA, SSE) returns."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class MixerOutput(NamedTuple):
  """Result of `mixer(x, cache)`.

  y:        [B, T, D] in the compute dtype.
  cache:    the updated cache when one was passed in, else None.
  aux_loss: float32 scalar, the layer's unscaled load-balance loss (routed mixers
            only, else None).
  usage:    float32 [N], fraction of tokens whose write set contains each partition
            (routed mixers only, else None).
  indices:  (write int32 [B, T, Kw], read int32 [B, T, Kr]): the partitions each token
            writes and reads (routed mixers only, else None).
  """

  y: jax.Array
  cache: Any = None
  aux_loss: jax.Array | None = None
  usage: jax.Array | None = None
  indices: tuple[jax.Array, jax.Array] | None = None
