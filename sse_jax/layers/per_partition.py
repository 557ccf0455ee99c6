"""SSE with per-partition Q/K/V (share_partition_params=False; the MoM-like control
of the paper's Table 8): the layer's P = N (+1) projection slots, slot N the shared
partition, handed to `ops.sse` / `ops.sse_decode_step` as per-partition inputs.

For partition i selected at t (docs/design.md, section 1)

    S_t^i = diag(exp g_t) S_{t-1}^i + w_t^i (k_t^i)^T v_t^i     (else S^i unchanged)
    o_t   = sum_{i read} r_t^i Dk^-1/2 q_t^i S_t^i  +  Dk^-1/2 q_t^N S_t^N

with the shared slot N always on (weight 1, its own decay g0). Every SSE `impl` (scan,
loop, masking, varlen; XLA or Pallas chunk core; auto) runs it as it runs the shared-
projection layer.

The layer's cache keeps its folded layout [B, P H, Dk, Dv] (slot-major: slot p, head h
at p H + h); `unfold` / `fold` convert it to and from the ops' (routed [B, N, H, Dk, Dv],
shared [B, H, Dk, Dv]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sse_jax import ops
from sse_jax.layers.router import Routing


def unfold(state: jax.Array, num_partitions: int, shared: bool):
  """[B, P H, Dk, Dv] -> the ops' state: routed [B, N, H, Dk, Dv], and with the shared
  slot the pair (routed, shared [B, H, Dk, Dv])."""
  b, ph = state.shape[:2]
  p = num_partitions + int(shared)
  slots = state.reshape((b, p, ph // p) + state.shape[2:])
  if not shared:
    return slots
  return slots[:, :num_partitions], slots[:, num_partitions]


def fold(state, shared: bool) -> jax.Array:
  """The inverse of `unfold`: the ops' state -> [B, P H, Dk, Dv]."""
  slots = jnp.concatenate([state[0], state[1][:, None]], axis=1) if shared else state
  b, p, h = slots.shape[:3]
  return slots.reshape((b, p * h) + slots.shape[3:])


def per_partition_sse(q, k, v, g, g0, routing: Routing, state, *, num_partitions: int,
                      gate: str, shared: bool, impl, chunk_size: int, decode: bool,
                      cu_seqlens=None):
  """q, k [B, T, P, H, Dk], v [B, T, P, H, Dv] (slot N = the shared partition when
  `shared`), g, g0 [B, T, H, Dk] (g0: the shared slot's log decay); state
  [B, P H, Dk, Dv] (`fold`) or None: a fresh sequence, no state returned; `decode`: one
  token (T == 1) by `ops.sse_decode_step`; cu_seqlens: packed sequences (B == 1) or None.
  `impl`: any `ops.sse` impl (a string of `ops.SSE_IMPLS` or a `Plan`).

  Returns (o [B, T, H, Dv] in v's dtype, state [B, P H, Dk, Dv] or None).
  """
  n = num_partitions
  r = routing
  slot = (lambda z: (z[:, :, :n], z[:, :, n])) if shared else (lambda z: (z, None))
  (q, q0), (k, k0), (v, v0) = slot(q), slot(k), slot(v)
  extra = (q0, k0, g0, v0) if shared else None
  h0 = None if state is None else unfold(state, n, shared)
  if decode:
    first = lambda z: None if z is None else z[:, 0]
    o, h1 = ops.sse_decode_step(
        *(first(z) for z in (q, k, v, g, r.write_weights, r.write_indices)), h0,
        gate=gate, shared=None if extra is None else tuple(first(z) for z in extra),
        read_weights=first(r.read_weights), read_indices=first(r.read_indices))
    return o[:, None], fold(h1, shared)
  o, h1 = ops.sse(q, k, v, g, r.write_weights, r.write_indices, num_partitions=n,
                  gate=gate, initial_state=h0, output_final_state=state is not None,
                  impl=impl, chunk_size=chunk_size, shared=extra,
                  read_weights=r.read_weights, read_indices=r.read_indices,
                  cu_seqlens=cu_seqlens)
  return o, (None if h1 is None else fold(h1, shared))
