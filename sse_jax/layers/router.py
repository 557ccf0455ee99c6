"""The SSE router: e_t = softmax(x_t W_e) in float32, top-k without renormalisation,
and the partition-level load-balance loss.

    e_t  = softmax(x_t W_e)                       [N]
    T_t  = TopK(e_t, k)                           weights e_t^i, i in T_t (NOT renormalised)
    aux  = N / k * sum_i f_i p_i                  p_i = mean_t e_t^i,
                                                  f_i = mean_t 1[i in T_t (write set)]

f_i is piecewise constant (it comes from the top-k indices) so the load-balance
gradient reaches W_e only through p_i; a uniform router gives aux = 1.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sse_jax.layers import params


class Routing(NamedTuple):
  """Router output for x [B, T, D].

  probs: float32 [B, T, N]. write_weights / write_indices: [B, T, Kw] (float32 /
  int32), the write set. read_weights / read_indices: [B, T, Kr], or None when the
  read set is the write set. aux_loss: float32 scalar (unscaled). usage: float32 [N],
  the f_i above.
  """

  probs: jax.Array
  write_weights: jax.Array
  write_indices: jax.Array
  read_weights: jax.Array | None
  read_indices: jax.Array | None
  aux_loss: jax.Array
  usage: jax.Array


def load_balance(probs: jax.Array, indices: jax.Array, num_partitions: int):
  """(aux = N / k * sum_i f_i p_i, f [N]) for probs [B, T, N], indices [B, T, k]."""
  k = indices.shape[-1]
  hits = jnp.sum(jax.nn.one_hot(indices, num_partitions, dtype=jnp.float32), axis=-2)
  f = jnp.mean(hits.reshape(-1, num_partitions), axis=0)
  p = jnp.mean(probs.reshape(-1, num_partitions), axis=0)
  return num_partitions / k * jnp.sum(f * p), f


def top_k(probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`jax.lax.top_k` over the last axis (ties: lower index first), as a stable sort.

  Why not lax.top_k: under a batch-sharded `jit`, GSPMD all-gathers top_k's operand
  across the batch, while it partitions a sort; routing must stay on each data shard.
  """
  idx = jnp.argsort(-probs, axis=-1, stable=True)[..., :k]
  return jnp.take_along_axis(probs, idx, axis=-1), idx


class Router(nnx.Module):
  """W_e [D, N], always float32 (routing decisions are sensitive to rounding)."""

  def __init__(self, hidden: int, num_partitions: int, num_writers: int, num_readers: int,
               *, rngs: nnx.Rngs):
    self.num_partitions = num_partitions
    self.num_writers = num_writers
    self.num_readers = num_readers
    self.kernel = params.param(rngs, params.default_init, (hidden, num_partitions),
                               ("embed", "partitions"), jnp.float32)

  def __call__(self, x: jax.Array) -> Routing:
    logits = jnp.einsum("btd,dn->btn", x.astype(jnp.float32), self.kernel[...],
                        precision=jax.lax.Precision.HIGHEST)
    probs = jax.nn.softmax(logits, axis=-1)
    ww, wi = top_k(probs, self.num_writers)
    rw = ri = None
    if self.num_readers != self.num_writers:
      rw, ri = top_k(probs, self.num_readers)
      ri = ri.astype(jnp.int32)
    aux, usage = load_balance(probs, wi, self.num_partitions)
    return Routing(probs, ww, wi.astype(jnp.int32), rw, ri, aux, usage)
