"""Feature maps for queries, keys and values (SPEC section 2, Table 6).

  "identity"  x                        "silu"   x sigmoid(x)
  "relu"      max(x, 0)                "elu+1"  elu(x) + 1  (positive, as in linear transformers)
  "softmax"   softmax over the head dim, in float32 (the paper's key map: each key is
              a distribution over the Dk state rows)
  "topk-softmax"  softmax over the Dk/4 largest entries only, zero elsewhere: the
              row-sparse key of the paper's Eq. (7) (Appendix A, Fig. 9), k = d/4
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = ("identity", "silu", "relu", "elu+1", "softmax", "topk-softmax")


def activate(name: str, x: jax.Array) -> jax.Array:
  """Applies feature map `name` over the last axis of x; keeps x's dtype."""
  if name == "identity":
    return x
  if name == "silu":
    return jax.nn.silu(x)
  if name == "relu":
    return jax.nn.relu(x)
  if name == "elu+1":
    return jax.nn.elu(x) + 1
  if name == "softmax":
    return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)
  if name == "topk-softmax":
    x32 = x.astype(jnp.float32)
    kth = jax.lax.top_k(x32, max(1, x.shape[-1] // 4))[0][..., -1:]
    # Ties at the threshold may keep a few more than d/4 rows; harmless.
    return jax.nn.softmax(jnp.where(x32 >= kth, x32, -jnp.inf), axis=-1).astype(x.dtype)
  raise ValueError(f"unknown activation {name!r}; choose one of {', '.join(ACTIVATIONS)}")
