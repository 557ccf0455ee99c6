"""Routing: which partitions each token writes and reads, and the per-partition inputs
it selects (docs/design.md, sections 1-2).

Inputs come shared by the partitions (q, k: [B, T, H, Dk], v: [B, T, H, Dv]) or per
partition ([B, T, N, H, D]: the per-partition projections of the paper's Table 8);
`per_partition` and `pick` hide the difference from the algorithms.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sse_jax.ops.checks import Gate


class Routing(NamedTuple):
  """The write set and the read set of every token, with their gated weights.

  write_idx / write_w: [B, T, Kw]; read_idx / read_w: [B, T, Kr]. `tied` (static)
  says the two sets are the same (the default), which lets varlen use one slot per
  selected partition instead of one per write and one per read.
  """

  write_idx: jax.Array
  write_w: jax.Array
  read_idx: jax.Array
  read_w: jax.Array
  tied: bool


def make_routing(weights, indices, read_weights, read_indices, gate: Gate) -> Routing:
  """Applies the gate placement: an ungated side uses weight 1 (docs/design.md,
  section 2)."""
  tied = read_indices is None
  if tied:
    read_weights, read_indices = weights, indices
  ww = weights if gate.on_write else jnp.ones_like(weights)
  rw = read_weights if gate.on_read else jnp.ones_like(read_weights)
  return Routing(indices, ww, read_indices, rw, tied)


def spread(indices, w, num_partitions: int):
  """Per-partition view of one routing side: (selected bool, weight or 0), [B, T, N]."""
  onehot = indices[..., None] == jnp.arange(num_partitions)          # [B, T, K, N]
  return (jnp.any(onehot, axis=-2),
          jnp.sum(jnp.where(onehot, w[..., None], 0), axis=-2))


def is_per_partition(x) -> bool:
  """x [B, T, N, H, D] holds one input per partition; [B, T, H, D] is shared."""
  return x.ndim == 5


def per_partition(x):
  """x as [B, T, N | 1, H, D]: a shared input gains a partition axis of size 1."""
  return x if is_per_partition(x) else x[:, :, None]


def pick(x, idx):
  """Each token's inputs for its selected partitions idx [B T, J]: [B T, J, H, D].

  A shared x [B, T, H, D] is the same for all J; a per-partition one is gathered (an id
  out of range, possible only under jit, takes the last partition: its slot is zeroed
  by the caller)."""
  flat = x.reshape((-1,) + x.shape[2:])
  if not is_per_partition(x):
    return jnp.broadcast_to(flat[:, None], (flat.shape[0], idx.shape[1]) + flat.shape[1:])
  return jnp.take_along_axis(flat, idx[:, :, None, None], axis=1, mode="clip")


@jax.custom_vjp
def weighted(x, w):
  """x [..., H, D] times w [...] per row, in x's dtype; the product is taken in the
  promoted dtype (fp32 for bf16 x and fp32 w) and rounded once.

  A custom_vjp only for what the backward pass keeps: x in its own dtype. Automatic
  differentiation keeps the promoted (fp32) copy of x that the product multiplies,
  twice the bytes for bf16 inputs; the gradients are the same expressions.
  """
  return (x * w[..., None, None]).astype(x.dtype)


def _weighted_fwd(x, w):
  return weighted(x, w), (x, w)


def _weighted_bwd(res, dy):
  x, w = res
  dy = dy.astype(jnp.result_type(x, w))
  dx = (dy * w[..., None, None]).astype(x.dtype)
  dw = jnp.sum(dy * x.astype(dy.dtype), axis=(-2, -1)).astype(w.dtype)
  return dx, dw


weighted.defvjp(_weighted_fwd, _weighted_bwd)


def masked_partitions(q, k, g, routing: Routing, num_partitions: int):
  """Per-partition copies [B, T, N, H, Dk] with unselected tokens made identities.

  For a partition not written at t: k = 0 and g = 0 -- identity decay, the crucial
  detail: zeroing k alone would still decay S^i. Not read at t: q = 0.
  """
  written, ww = spread(routing.write_idx, routing.write_w, num_partitions)
  _, rw = spread(routing.read_idx, routing.read_w, num_partitions)
  col = lambda w: w[..., None, None]
  # g selected, not multiplied by the 0/1 mask: -inf * 0 is NaN (a hard reset would
  # turn every partition's state into NaN).
  return ((per_partition(q) * col(rw)).astype(q.dtype),
          (per_partition(k) * col(ww)).astype(k.dtype),
          jnp.where(col(written), g[:, :, None], jnp.zeros((), g.dtype)))


def routed_slots(q, k, v, g, routing: Routing):
  """Per-token slots [B*T, J, ...] and their partitions [B*T, J].

  Tied sets: one slot per selected partition (q r, k w, v, g). Untied: Kw write slots
  (q = 0) then Kr read slots (k = 0, g = 0: no write, no decay); inside a segment a
  write slot precedes the read slot of the same token, so the read sees S_t.
  """
  flat = lambda x: x.reshape((-1,) + x.shape[2:])
  w_idx, r_idx = flat(routing.write_idx), flat(routing.read_idx)
  gated = lambda x, idx, w: weighted(pick(x, idx), flat(w))
  if routing.tied:
    return (gated(q, w_idx, routing.read_w), gated(k, w_idx, routing.write_w),
            pick(v, w_idx), pick(g, w_idx), w_idx)
  zeros = lambda x, idx: jnp.zeros(idx.shape + x.shape[-2:], x.dtype)
  cat = lambda a, b: jnp.concatenate([a, b], axis=1)
  both = cat(w_idx, r_idx)
  return (cat(zeros(q, w_idx), gated(q, r_idx, routing.read_w)),
          cat(gated(k, w_idx, routing.write_w), zeros(k, r_idx)),
          pick(v, both),
          cat(pick(g, w_idx), zeros(g, r_idx)),
          both)
