"""The four algorithms of `sse` (docs/design.md, section 3), on prepared inputs.

Every path takes (q, k, v, g, routing, n, h0, shared, h0_shared, cu_seqlens) and the
chunked ones also (chunk_size, core, move: the packing's `packing.RowMover`); they return (o [B, T, H, Dv], final routed states
[B | S, N, H, Dk, Dv], final shared state [B | S, H, Dk, Dv] or None).

q, k: [B, T, H, Dk] or per partition [B, T, N, H, Dk]; v: [B, T, H, Dv] or
[B, T, N, H, Dv]; g: [B, T, H, Dk]; q already scaled, everything in its storage dtype.
shared: None or (q', k', g', v'), each [B, T, H, D], the always-on partition's inputs.
"""

from __future__ import annotations

import jax.numpy as jnp

from sse_jax.ops import gla as gla_lib
from sse_jax.ops import reference
from sse_jax.ops import routing as routing_lib
from sse_jax.ops.routing import Routing, per_partition


def scan(q, k, v, g, routing: Routing, n, h0, shared, h0_shared, cu_seqlens):
  """The reference: one time step of the whole state per scan iteration."""
  written, wd = routing_lib.spread(routing.write_idx, routing.write_w, n)
  _, rd = routing_lib.spread(routing.read_idx, routing.read_w, n)
  o, final = reference.sse_scan(q, k, v, g, wd, written, rd, h0, cu_seqlens)
  if shared is None:
    return o, final, None
  q0, k0, g0, v0 = shared
  o0, final0 = reference.gla_scan(q0, k0, v0, g0, h0_shared, cu_seqlens)
  return o + o0, final, final0


def loop(q, k, v, g, routing, n, h0, shared, h0_shared, cu_seqlens, c, core, move):
  """One chunked call per partition (and one for the shared partition)."""
  qm, km, gm = routing_lib.masked_partitions(q, k, g, routing, n)
  outs, finals = [], []
  for i in range(n):
    v_i = v[:, :, i] if routing_lib.is_per_partition(v) else v
    o_i, f_i = gla_lib.chunked_gla(qm[:, :, i], km[:, :, i], v_i, gm[:, :, i], h0[:, i],
                                   cu_seqlens, c, core, move)
    outs.append(o_i)
    finals.append(f_i)
  o, final, final0 = sum(outs), jnp.stack(finals, axis=1), None
  if shared is not None:
    q0, k0, g0, v0 = shared
    o0, final0 = gla_lib.chunked_gla(q0, k0, v0, g0, h0_shared, cu_seqlens, c, core, move)
    o = o + o0
  return o, final, final0


def masking(q, k, v, g, routing, n, h0, shared, h0_shared, cu_seqlens, c, core, move):
  """Fold the N (+1 shared) partitions into the head axis: one chunked call."""
  qm, km, gm = routing_lib.masked_partitions(q, k, g, routing, n)
  b, t, _, h, _ = qm.shape
  vm = jnp.broadcast_to(per_partition(v), (b, t, n, h, v.shape[-1]))
  if shared is not None:
    qm, km, gm, vm = (jnp.concatenate([x, s[:, :, None]], axis=2)
                      for x, s in zip((qm, km, gm, vm), shared))
    h0 = jnp.concatenate([h0, h0_shared[:, None]], axis=1)
  p = qm.shape[2]
  fold = lambda x: x.reshape(b, t, p * h, x.shape[-1])
  o, final = gla_lib.chunked_gla(fold(qm), fold(km), fold(vm), fold(gm),
                                 h0.reshape((-1, p * h) + h0.shape[3:]), cu_seqlens, c,
                                 core, move)
  o = o.reshape(b, t, p, h, -1).sum(axis=2)
  final = final.reshape((-1, p, h) + final.shape[2:])
  if shared is None:
    return o, final, None
  return o, final[:, :n], final[:, n]


def varlen(q, k, v, g, routing, n, h0, shared, h0_shared, cu_seqlens, c, core, move):
  """Gather tokens per (sequence, partition) segment, one packed chunked call."""
  b, t, h = g.shape[:3]
  if cu_seqlens is None:
    seq = jnp.repeat(jnp.arange(b), t)
  else:
    seq, _ = reference.sequence_ids(cu_seqlens, t)
  nseq = h0.shape[0]
  q_s, k_s, v_s, g_s, part = routing_lib.routed_slots(q, k, v, g, routing)
  # An id out of [0, N) (possible only under jit, against the contract) would land in
  # another (sequence, partition) segment: its slot becomes a zero (identity) row of
  # partition 0 instead, ignored as the masking and scan paths ignore it. The packing
  # zeroes it (`valid`), rather than a select over every slot's values here.
  valid = (part >= 0) & (part < n)
  part = jnp.where(valid, part, 0)
  per_token = part.shape[1]
  # Slots are token-major, so a stable sort by segment keeps time order inside each
  # (sequence, partition) segment.
  seg = (seq[:, None] * n + part).reshape(-1)
  q_s, k_s, v_s, g_s = (x.reshape((-1,) + x.shape[2:]) for x in (q_s, k_s, v_s, g_s))
  h0_table = h0.reshape((nseq * n,) + h0.shape[2:])
  flat = lambda x: x.reshape((b * t,) + x.shape[2:])
  valid = valid.reshape(-1)
  if shared is not None:
    # The shared slots are a second part of the packed op's inputs rather than
    # concatenated after the routed ones: the packing reads both parts directly.
    valid = jnp.concatenate([valid, jnp.ones(seq.shape, bool)])
    seg = jnp.concatenate([seg, nseq * n + seq])
    q_s, k_s, g_s, v_s = ((x, flat(s)) for x, s in zip((q_s, k_s, g_s, v_s), shared))
    h0_table = jnp.concatenate([h0_table, h0_shared])
  # The shared partition's slots (segment ids nseq * N + sequence, after every routed
  # id, in time order) are already in segment order: only the routed ones are sorted.
  o_s, finals = gla_lib.packed_chunked(q_s, k_s, v_s, g_s, seg, h0_table, c, core,
                                       sorted_tail=0 if shared is None else b * t,
                                       move=move, valid=valid)
  o_routed = o_s if shared is None else o_s[0]
  o = o_routed.reshape(b * t, per_token, h, -1).sum(axis=1)
  final = finals[:nseq * n].reshape(h0.shape)
  final0 = None
  if shared is not None:
    o = o + o_s[1]
    final0 = finals[nseq * n:]
  return o.reshape(b, t, h, -1), final, final0
