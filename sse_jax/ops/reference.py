"""Ground truth: the GLA and SSE recurrences as a `lax.scan` over time.

Notation (used throughout `sse_jax.ops`):
  B batch, T time, H heads, Dk key/query dim, Dv value dim, N routed partitions,
  K partitions selected per token (top-k), S packed sequences, C chunk length.

These functions are deliberately literal: one time step per scan iteration over the
whole state, so that every faster implementation can be checked against them. They
take `q` already multiplied by `scale` and inputs already cast to the compute dtype.
The step itself (`write`, `gla_step`) is the one the decoding steps take too.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def sequence_ids(cu_seqlens: jax.Array, length: int) -> tuple[jax.Array, jax.Array]:
  """For packed tokens 0..T-1: (sequence id [T], is-first-token-of-sequence [T])."""
  t = jnp.arange(length)
  seq = jnp.searchsorted(cu_seqlens[1:], t, side="right")
  return seq, t == cu_seqlens[seq]


def write(state: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array) -> jax.Array:
  """S' = diag(exp g) S + k^T v: state [..., Dk, Dv], k and g [..., Dk], v [..., Dv]
  (any leading axes that broadcast)."""
  return jnp.exp(g)[..., None] * state + k[..., None] * v[..., None, :]


def gla_step(state, q, k, v, g) -> tuple[jax.Array, jax.Array]:
  """One GLA step: (S' = write(S, k, v, g), o = q S'); o [..., Dv]."""
  state = write(state, k, v, g)
  return state, jnp.einsum("...k,...kv->...v", q, state)


def recurrent_scan(step: Callable, xs, h0: jax.Array, cu_seqlens: jax.Array | None,
                   length: int):
  """Runs `state, y = step(state, x)` over time, restarting at sequence starts.

  Args:
    step: one time step on batched state [B, ...] and x (a pytree of [B, ...]).
    xs: pytree of time-major inputs [T, B, ...].
    h0: initial states: [B, ...] without `cu_seqlens`, [S, ...] with (then B == 1).
    cu_seqlens: int [S + 1] or None.
  Returns:
    ys [T, B, ...] and final states shaped like h0. A sequence of length 0 keeps its
    initial state.
  """
  if cu_seqlens is None:
    final, ys = jax.lax.scan(step, h0, xs)
    return ys, final

  seq, is_start = sequence_ids(cu_seqlens, length)

  def packed_step(carry, inp):
    state, finals = carry
    x, s, start = inp
    state = jnp.where(start, h0[s][None], state)
    state, y = step(state, x)
    finals = finals.at[s].set(state[0])
    return (state, finals), y

  (_, finals), ys = jax.lax.scan(packed_step, (h0[:1], h0), (xs, seq, is_start))
  return ys, finals


def gla_scan(q, k, v, g, h0, cu_seqlens=None):
  """GLA: S_t = diag(exp g_t) S_{t-1} + k_t^T v_t ;  o_t = q_t S_t.

  Shapes: q, k, g [B, T, H, Dk]; v [B, T, H, Dv]; h0 [B | S, H, Dk, Dv].
  Returns o [B, T, H, Dv] and the final states (shaped like h0).
  """

  def step(state, x):
    return gla_step(state, *x)

  xs = tuple(jnp.swapaxes(a, 0, 1) for a in (q, k, v, g))
  ys, final = recurrent_scan(step, xs, h0, cu_seqlens, q.shape[1])
  return jnp.swapaxes(ys, 0, 1), final


def sse_scan(q, k, v, g, write_w, written, read_w, h0, cu_seqlens=None):
  """SSE over N routed partitions, one time step at a time (docs/design.md, section 1).

    S_t^i = diag(exp g_t) S_{t-1}^i + w_t^i k_t^T v_t   if i is written at t
    S_t^i = S_{t-1}^i                                   otherwise (no decay)
    o_t   = sum_i r_t^i q_t S_t^i                       (r = 0 where i is not read)

  Shapes: q, k, g [B, T, H, Dk]; v [B, T, H, Dv] (q, k, v may instead be per partition,
  [B, T, N, H, D]); write weights w, the boolean `written` and read weights r:
  [B, T, N]; h0 [B | S, N, H, Dk, Dv].
  """
  # Partitions on axis 1 of a step's inputs: shared ones gain it with size 1.
  each = lambda x: x if x.ndim == 4 else x[:, None]

  def step(state, x):
    qt, kt, vt, gt, wt, st, rt = x
    updated = write(state, each(kt) * wt[:, :, None, None], each(vt), gt[:, None])
    state = jnp.where(st[:, :, None, None, None], updated, state)
    if qt.ndim == 3:
      return state, jnp.einsum("bhk,bnhkv,bn->bhv", qt, state, rt)
    return state, jnp.einsum("bnhk,bnhkv,bn->bhv", qt, state, rt)

  xs = tuple(jnp.swapaxes(a, 0, 1) for a in (q, k, v, g, write_w, written, read_w))
  ys, final = recurrent_scan(step, xs, h0, cu_seqlens, q.shape[1])
  return jnp.swapaxes(ys, 0, 1), final
