"""Feature maps for queries, keys and values (docs/design.md, sections 1-2; Table 6).

  "identity"  x                        "silu"   x sigmoid(x)
  "relu"      max(x, 0)                "elu+1"  elu(x) + 1  (positive, as in linear transformers)
  "softmax"   softmax over the head dim, in float32 (the paper's key map: each key is
              a distribution over the Dk state rows)
  "topk-softmax"  softmax over the k = max(1, Dk // 4) largest entries only, zero
              elsewhere: the row-sparse key of the paper's Eq. (7) (Appendix A, Fig. 9).

Row-sparse maps ("topk-softmax") also select which state rows a token touches. With
m_t = `row_mask(name, x_t)` (bool [Dk], 1 on the top-k rows) the paper's Eq. (7)-(8) is

    S_t[i] = exp(g_t[i]) S_{t-1}[i] + k_t[i] v_t   if m_t[i]
    S_t[i] = S_{t-1}[i]                            otherwise (no decay, no write),

i.e. GLA with the log decay m_t * g_t (see `layers.gla`). Dense maps have no mask
(`row_mask` is None) and every row decays. The mask comes from the same top-k selection
as the activation, not from testing the activation for zero: a kept entry far below the
largest one can underflow to exactly 0 in the softmax and must still count as kept.

Ties: the selection keeps every entry >= the k-th largest value, so entries tied with
it are all kept (a few more than k rows); mask and activation use that same rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = ("identity", "silu", "relu", "elu+1", "softmax", "topk-softmax")


def _topk_keep(x32: jax.Array) -> jax.Array:
  """bool [..., Dk]: entries >= the k-th largest over the last axis, k = max(1, Dk // 4)
  (ties at the threshold all kept)."""
  kth = jax.lax.top_k(x32, max(1, x32.shape[-1] // 4))[0][..., -1:]
  return x32 >= kth


# Under jax.checkpoint the backward pass keeps x (bf16 in a bf16 model) and computes the
# softmax again, rather than keeping its fp32 result: half the bytes, same numbers.
@jax.checkpoint
def _softmax(x: jax.Array) -> jax.Array:
  """softmax over the last axis, taken in fp32 and rounded to x's dtype."""
  return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)


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
    return _softmax(x)
  if name == "topk-softmax":
    x32 = x.astype(jnp.float32)
    masked = jnp.where(_topk_keep(x32), x32, -jnp.inf)
    return jax.nn.softmax(masked, axis=-1).astype(x.dtype)
  raise ValueError(f"unknown activation {name!r}; choose one of {', '.join(ACTIVATIONS)}")


def row_mask(name: str, x: jax.Array) -> jax.Array | None:
  """The rows a row-sparse feature map keeps: bool [..., Dk] for x [..., Dk] (True on
  the rows `activate(name, x)` may be nonzero on), or None for a dense map.

  Computed in float32 like `activate`, so the two select the same rows for any dtype.
  """
  if name not in ACTIVATIONS:
    raise ValueError(f"unknown activation {name!r}; choose one of {', '.join(ACTIVATIONS)}")
  if name == "topk-softmax":
    return _topk_keep(x.astype(jnp.float32))
  return None
