"""Rotary position embedding (rotate-half form, as in Llama / fla).

For a head vector x = [x1, x2] (halves of size D/2) at position p, with
theta_j = base^(-2j / D):
    rope(x, p) = [x1 cos(p theta) - x2 sin(p theta),  x2 cos(p theta) + x1 sin(p theta)]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
  """x [B, T, H, D] (D even), positions int [T] or [B, T] -> [B, T, H, D] in x's dtype.

  Angles are computed in float32 so that large positions stay accurate in bf16.
  """
  d = x.shape[-1]
  if d % 2:
    raise ValueError(f"RoPE needs an even head dim, got {d}")
  inv_freq = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)         # [D/2]
  pos = jnp.asarray(positions, jnp.float32)
  pos = jnp.broadcast_to(pos, x.shape[:2])                                 # [B, T]
  angle = pos[:, :, None, None] * inv_freq                                 # [B, T, 1, D/2]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
