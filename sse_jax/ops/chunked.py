"""Chunkwise-parallel GLA in plain XLA (the building block of every SSE path).

Within a chunk of C tokens, let G_t = sum_{u <= t} g_u be the cumulative log decay
(relative to the chunk start, so G_t <= 0 and non-increasing). With S the state at the
chunk start:

  o_t     = q_t exp(G_t) S + sum_{s <= t} (q_t . k_s exp(G_t - G_s)) v_s     (inter + intra)
  S_next  = exp(G_C) S + sum_s (k_s exp(G_C - G_s))^T v_s

Overflow: factoring exp(G_t - G_s) into q_t exp(G_t) and k_s exp(-G_s) overflows once
-G_s is large (strong decay), so we never form exp(-G) over a chunk. Instead the chunk is
split into sub-chunks of L = 16 tokens. A block of (query sub-chunk i, key sub-chunk
j < i) uses the anchor A_i = G at the first token of sub-chunk i:
    exp(G_t - G_s) = exp(G_t - A_i) * exp(A_i - G_s),  both factors <= 1,
and the diagonal blocks (i == j) form exp(G_t - G_s) directly for s <= t. Every
exponent this module evaluates is <= 0.

The state recurrence across chunks is a `lax.scan` over chunks whose body is only an
elementwise multiply-add. Inputs are organised in *segments*: runs of whole chunks
that each start from their own initial state (a sequence of a batch, a packed
sequence, or one (sequence, partition) of the SSE varlen path). Every chunk core
(this one and the Pallas kernels) has the same signature, see `chunk_gla`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

SUBCHUNK = 16  # L: sub-chunk length of the overflow-safe intra-chunk factorisation.

# Log decays below this are raised to it before the in-chunk cumulative sums of every
# chunk core (this one and the Pallas kernels), by the ops (`gla.dense_chunked`,
# `gla.packed_chunked` and their GDN twins), before any packing. exp(-200)
# is 0 in fp32 and 1e-87 in fp64, so values and gradients do not change, but g = -inf
# (a hard reset) or -1e38 no longer turns a difference of cumulative sums into
# -inf - (-inf) = NaN, and large magnitudes do not eat the sums' precision.
LOG_DECAY_FLOOR = -200.0


def in_chunk_cumsum(g: jax.Array, axis: int) -> jax.Array:
  """G = inclusive cumulative sum of g along `axis` (a chunk's C tokens).

  Computed as one batched matmul with a lower-triangular [C, C] matrix of ones, at full
  precision (HIGHEST: no TF32), rather than with `jnp.cumsum`. Why: XLA on GPU lowers a
  cumsum, and its transpose (the reverse sum that turns dG into dg), to windowed
  reductions that it fuses with their producers, the packing's gathers, and then
  recomputes those for every element of the window. At L = 32K that glue took ~0.9 ms
  of the 3.5 ms dense op and ~3.6 ms of the 8.2 ms SSE varlen op on an H200. A dot
  reads its operand once, and its transpose is again a dot. Same sums, up to rounding.
  (The Pallas core sums the gates inside its kernels instead.)
  """
  axis = axis % g.ndim
  c = g.shape[axis]
  lead = math.prod(g.shape[:axis])
  tril = jnp.tril(jnp.ones((c, c), g.dtype))
  x = g.reshape(lead, c, math.prod(g.shape[axis + 1:]))
  out = jnp.einsum("ts,nsf->ntf", tril, x, precision=jax.lax.Precision.HIGHEST)
  return out.reshape(g.shape)


@jax.custom_jvp
def floor_log_decay(g: jax.Array) -> jax.Array:
  """max(g, LOG_DECAY_FLOOR): what the chunk cores sum as g (see LOG_DECAY_FLOOR).

  Its derivative passes dg where g >= LOG_DECAY_FLOOR and is 0 below. Written out
  (rather than jnp.maximum's, which weighs ties by 1/2) so that the backward pass
  keeps a bool mask: jnp.maximum's keeps a float array of g's size, and g here is
  usually a packed copy that nothing else keeps (SSE varlen: two slots per token).
  """
  return jnp.maximum(g, jnp.asarray(LOG_DECAY_FLOOR, g.dtype))


@floor_log_decay.defjvp
def _floor_log_decay_jvp(primals, tangents):
  (g,), (dg,) = primals, tangents
  kept = g >= jnp.asarray(LOG_DECAY_FLOOR, g.dtype)
  return floor_log_decay(g), jnp.where(kept, dg, jnp.zeros((), dg.dtype))


def _exp_masked(x: jax.Array, mask: jax.Array) -> jax.Array:
  """exp(x) where mask, else 0 -- without ever evaluating exp on masked (possibly
  positive and huge) entries, so neither the value nor the gradient can overflow."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def intra_chunk_scores(q: jax.Array, k: jax.Array, gcum: jax.Array) -> jax.Array:
  """Causal in-chunk decayed scores A[t, s] = sum_d q_td k_sd exp(G_td - G_sd), s <= t.

  Args: q, k, gcum: [..., C, H, Dk] (gcum = in-chunk cumulative log decay).
  Returns: A [..., H, C, C] (query position t, key position s).
  """
  c = q.shape[-3]
  ls = min(SUBCHUNK, c)
  ns = c // ls
  lead = q.shape[:-3]
  sub = lambda x: x.reshape(lead + (ns, ls) + x.shape[-2:])  # [..., NS, L, H, Dk]
  qs, ks, gs = sub(q), sub(k), sub(gcum)

  # Diagonal sub-chunk blocks: exp(G_t - G_s) formed directly, s <= t.
  tri = jnp.tril(jnp.ones((ls, ls), bool))[:, :, None, None]            # [L, L, 1, 1]
  diff = gs[..., :, None, :, :] - gs[..., None, :, :, :]                 # [.., NS, L, L, H, Dk]
  w = _exp_masked(diff, tri)
  a_diag = jnp.einsum("...ilhd,...imhd,...ilmhd->...hilm", qs, ks, w)    # [.., H, NS, L, L]

  # Off-diagonal blocks (key sub-chunk j < query sub-chunk i), anchored at A_i.
  anchor = gs[..., :, 0, :, :]                                           # [.., NS, H, Dk]
  q_tilde = qs * jnp.exp(gs - anchor[..., :, None, :, :])                # <= 1 factors
  pos = jnp.arange(c)
  before = (pos[None, :] < (jnp.arange(ns) * ls)[:, None])[:, :, None, None]  # [NS, C, 1, 1]
  k_tilde = k[..., None, :, :, :] * _exp_masked(
      anchor[..., :, None, :, :] - gcum[..., None, :, :, :], before)     # [.., NS, C, H, Dk]
  a_off = jnp.einsum("...ilhd,...ishd->...hils", q_tilde, k_tilde)       # [.., H, NS, L, C]

  eye = jnp.eye(ns, dtype=a_diag.dtype)
  a_diag_full = jnp.einsum("...ilm,ij->...iljm", a_diag, eye)            # [.., H, NS, L, NS, L]
  a = a_off + a_diag_full.reshape(a_off.shape)
  return a.reshape(lead + (q.shape[-2], c, c))


def covered_chunks(seg_start, seg_chunks, num_chunks: int) -> jax.Array:
  """bool [NC]: the chunk belongs to some segment (segments occupy disjoint chunk
  ranges [seg_start, seg_start + seg_chunks); an empty segment has seg_chunks == 0)."""
  edges = jnp.zeros((num_chunks,), jnp.int32)
  edges = edges.at[jnp.where(seg_chunks > 0, seg_start, num_chunks)].add(1, mode="drop")
  edges = edges.at[jnp.where(seg_chunks > 0, seg_start + seg_chunks, num_chunks)].add(
      -1, mode="drop")
  return jnp.cumsum(edges) > 0


def segment_starts(seg_start, seg_chunks, num_chunks: int):
  """Per chunk: (restart the recurrence here, from initial state number ...).

  A chunk that starts segment z restarts from h0[z]; a chunk inside no segment
  restarts from the zero state (index Z) and holds zeros.
  """
  z = seg_start.shape[0]
  at = jnp.where(seg_chunks > 0, seg_start, num_chunks)  # empty segments: dropped
  owner = jnp.full((num_chunks,), z, jnp.int32).at[at].set(
      jnp.arange(z, dtype=jnp.int32), mode="drop")
  inside = covered_chunks(seg_start, seg_chunks, num_chunks)
  return (owner < z) | ~inside, jnp.where(inside, owner, z)


def chunk_gla(q, k, v, g, h0, seg_start, seg_chunks):
  """Chunked GLA over pre-chunked inputs organised in segments.

  Args:
    q, k, g: [B, NC, C, H, Dk] (q already scaled; compute dtype); v: [B, NC, C, H, Dv].
      g: finite log decays <= 0 (`floor_log_decay` raises a -inf reset first).
    h0: [Z, H, Dk, Dv] initial state of each segment.
    seg_start, seg_chunks: int [Z]; segment z occupies the flattened chunks
      b * NC + c in [seg_start, seg_start + seg_chunks), never crossing a batch row.
  Returns:
    o [B, NC, C, H, Dv] (zero in chunks of no segment) and the final state of each
    segment [Z, H, Dk, Dv] (an empty segment keeps h0).
  """
  b, nc = q.shape[:2]
  reset, h0_index = segment_starts(seg_start, seg_chunks, b * nc)
  reset, h0_index = reset.reshape(b, nc), h0_index.reshape(b, nc)
  h0_table = jnp.concatenate([h0, jnp.zeros((1,) + h0.shape[1:], h0.dtype)])

  gcum = in_chunk_cumsum(g, axis=2)
  g_last = gcum[:, :, -1]                                                # [B, NC, H, Dk]
  # Local state contribution of each chunk, with exp(G_C - G_s) <= 1.
  k_end = k * jnp.exp(g_last[:, :, None] - gcum)
  delta = jnp.einsum("bnchk,bnchv->bnhkv", k_end, v)
  decay = jnp.exp(g_last)

  def step(h, x):
    dec, dlt, rst, idx = x
    h = jnp.where(rst[:, None, None, None], h0_table[idx], h)
    return dec[..., None] * h + dlt, h

  xs = (jnp.swapaxes(decay, 0, 1), jnp.swapaxes(delta, 0, 1),
        jnp.swapaxes(reset, 0, 1), jnp.swapaxes(h0_index, 0, 1))
  h_init = jnp.zeros(delta.shape[:1] + delta.shape[2:], delta.dtype)
  _, h_start = jax.lax.scan(step, h_init, xs)
  h_start = jnp.swapaxes(h_start, 0, 1)                                  # [B, NC, H, Dk, Dv]
  h_end = (decay[..., None] * h_start + delta).reshape((b * nc,) + delta.shape[2:])
  last = jnp.clip(seg_start + seg_chunks - 1, 0, b * nc - 1)
  final = jnp.where((seg_chunks > 0)[:, None, None, None], h_end[last], h0)

  o_inter = jnp.einsum("bnchk,bnhkv->bnchv", q * jnp.exp(gcum), h_start)
  scores = intra_chunk_scores(q, k, gcum)                                # [B, NC, H, C, C]
  o_intra = jnp.einsum("bnhts,bnshv->bnthv", scores, v)
  covered = covered_chunks(seg_start, seg_chunks, b * nc).reshape(b, nc, 1, 1, 1)
  return jnp.where(covered, o_inter + o_intra, 0), final
