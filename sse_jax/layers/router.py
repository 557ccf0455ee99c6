"""The SSE router: e_t = softmax(x_t W_e) in float32, top-k without renormalisation,
and the partition-level load-balance loss.

    e_t  = softmax(x_t W_e)                       [N]
    T_t  = TopK(e_t, k)                           weights e_t^i, i in T_t (NOT renormalised)
    aux  = N / k * sum_i f_i p_i                  p_i = mean_t e_t^i,
                                                  f_i = mean_t 1[i in T_t (write set)]

The means run over the tokens of `token_mask` (all tokens when it is None): PAD tokens
must not pull the balance or the usage statistics towards the partition PAD picks.

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
  read set is the write set.
  """

  probs: jax.Array
  write_weights: jax.Array
  write_indices: jax.Array
  read_weights: jax.Array | None
  read_indices: jax.Array | None

  @property
  def reads(self) -> jax.Array:
    """int32 [B, T, Kr]: the partitions each token reads."""
    return self.write_indices if self.read_indices is None else self.read_indices


def load_balance(probs: jax.Array, indices: jax.Array, num_partitions: int,
                 token_mask: jax.Array | None = None):
  """(aux = N / k * sum_i f_i p_i, f [N]) for probs [B, T, N], indices [B, T, k], the
  means over the tokens where token_mask [B, T] is true (None: all). With no token
  selected, f = 0 and aux = 0."""
  k = indices.shape[-1]
  hits = jnp.sum(jax.nn.one_hot(indices, num_partitions, dtype=jnp.float32), axis=-2)
  if token_mask is None:
    token_mask = jnp.ones(probs.shape[:-1], jnp.float32)
  m = token_mask.astype(jnp.float32)[..., None]
  count = jnp.maximum(jnp.sum(m), 1.0)
  f = jnp.sum((hits * m).reshape(-1, num_partitions), axis=0) / count
  p = jnp.sum((probs * m).reshape(-1, num_partitions), axis=0) / count
  return num_partitions / k * jnp.sum(f * p), f


def top_k(probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`jax.lax.top_k` over the last axis (ties: lower index first), as a stable sort.

  Why not lax.top_k: under a batch-sharded `jit`, GSPMD all-gathers top_k's operand
  across the batch, while it partitions a sort; routing must stay on each data shard.
  """
  idx = jnp.argsort(-probs, axis=-1, stable=True)[..., :k]
  # The weights as a one-hot masked sum rather than take_along_axis: the same values
  # (one nonzero term per sum), and its transpose is an elementwise multiply where the
  # gather's is a scatter into [.., N] (~0.2 ms per layer on an H100 at 32K tokens, for N = 4).
  pick = jax.nn.one_hot(idx, probs.shape[-1], dtype=probs.dtype)
  return jnp.sum(probs[..., None, :] * pick, axis=-1), idx


# Under jax.checkpoint the backward pass keeps x in its own dtype (bf16 in a bf16
# model; the block keeps it anyway) rather than the fp32 copy the matmul reads.
@jax.checkpoint
def _logits(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """x [B, T, D] @ W_e [D, N] in fp32 (HIGHEST: no TF32): [B, T, N]."""
  return jnp.einsum("btd,dn->btn", x.astype(jnp.float32), kernel,
                    precision=jax.lax.Precision.HIGHEST)


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
    logits = _logits(x, self.kernel[...])
    probs = jax.nn.softmax(logits, axis=-1)
    ww, wi = top_k(probs, self.num_writers)
    rw = ri = None
    if self.num_readers != self.num_writers:
      rw, ri = top_k(probs, self.num_readers)
      ri = ri.astype(jnp.int32)
    return Routing(probs, ww, wi.astype(jnp.int32), rw, ri)
