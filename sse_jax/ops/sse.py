"""Sparse State Expansion: `sse(q, k, v, g, weights, indices)` (docs/design.md, section 1).

N routed partitions share q, k, v, g. At each token the router selects K partitions
(`indices`, with probabilities `weights`, not renormalised); only those are decayed
and written, and only those are read:

  S_t^i = diag(exp g_t) S_{t-1}^i + w_t^i k_t^T v_t     i selected at t
  S_t^i = S_{t-1}^i                                     otherwise (its clock stops)
  o_t   = sum_{i selected} r_t^i (scale q_t) S_t^i  [+ (scale q'_t) S'_t, shared]

with (w, r) = (e, e) for gate "both", (e, 1) "write", (1, e) "read", (1, 1) "none".
An optional always-on shared partition S' (a plain GLA state with its own q', k', g',
sharing v) can be passed as `shared=(q', k', g')`, so that the masking and varlen paths
process it in the same chunked call as the routed partitions.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sse_jax.ops import checks
from sse_jax.ops import gla as gla_lib
from sse_jax.ops import reference
from sse_jax.ops import sharding
from sse_jax.ops.checks import Gate
from sse_jax.ops import impl as impl_lib
from sse_jax.ops.impl import Algorithm


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
  return ((q[:, :, None] * col(rw)).astype(q.dtype),
          (k[:, :, None] * col(ww)).astype(k.dtype),
          jnp.where(col(written), g[:, :, None], jnp.zeros((), g.dtype)))


def _scan(q, k, v, g, routing, n, h0, shared, h0_shared, cu_seqlens):
  written, wd = spread(routing.write_idx, routing.write_w, n)
  _, rd = spread(routing.read_idx, routing.read_w, n)
  o, final = reference.sse_scan(q, k, v, g, wd, written, rd, h0, cu_seqlens)
  if shared is None:
    return o, final, None
  o0, final0 = reference.gla_scan(*shared[:2], v, shared[2], h0_shared, cu_seqlens)
  return o + o0, final, final0


def _loop(q, k, v, g, routing, n, h0, shared, h0_shared, cu_seqlens, c, core):
  """One chunked call per partition (and one for the shared partition)."""
  qm, km, gm = masked_partitions(q, k, g, routing, n)
  outs, finals = [], []
  for i in range(n):
    o_i, f_i = gla_lib.chunked_gla(qm[:, :, i], km[:, :, i], v, gm[:, :, i],
                                   h0[:, i], cu_seqlens, c, core)
    outs.append(o_i)
    finals.append(f_i)
  o, final, final0 = sum(outs), jnp.stack(finals, axis=1), None
  if shared is not None:
    o0, final0 = gla_lib.chunked_gla(shared[0], shared[1], v, shared[2], h0_shared,
                                     cu_seqlens, c, core)
    o = o + o0
  return o, final, final0


def _masking(q, k, v, g, routing, n, h0, shared, h0_shared, cu_seqlens, c, core):
  """Fold the N (+1 shared) partitions into the head axis: one chunked call."""
  qm, km, gm = masked_partitions(q, k, g, routing, n)
  if shared is not None:
    qm, km, gm = (jnp.concatenate([x, s[:, :, None]], axis=2)
                  for x, s in zip((qm, km, gm), shared))
    h0 = jnp.concatenate([h0, h0_shared[:, None]], axis=1)
  b, t, p, h, dk = qm.shape
  fold = lambda x: x.reshape(b, t, p * h, x.shape[-1])
  vm = jnp.broadcast_to(v[:, :, None], (b, t, p, h, v.shape[-1]))
  o, final = gla_lib.chunked_gla(fold(qm), fold(km), fold(vm), fold(gm),
                                 h0.reshape((-1, p * h) + h0.shape[3:]), cu_seqlens, c,
                                 core)
  o = o.reshape(b, t, p, h, -1).sum(axis=2)
  final = final.reshape((-1, p, h) + final.shape[2:])
  if shared is None:
    return o, final, None
  return o, final[:, :n], final[:, n]


def _routed_slots(q, k, v, g, routing: Routing):
  """Per-token slots [B*T, J, ...] and their partitions [B*T, J].

  Tied sets: one slot per selected partition (q r, k w, v, g). Untied: Kw write slots
  (q = 0) then Kr read slots (k = 0, g = 0: no write, no decay); inside a segment a
  write slot precedes the read slot of the same token, so the read sees S_t.
  """
  flat = lambda x: x.reshape((-1,) + x.shape[2:])
  tok = lambda x, j: jnp.broadcast_to(flat(x)[:, None], (flat(x).shape[0], j) + x.shape[2:])
  col = lambda w: flat(w)[..., None, None]
  kw, kr = routing.write_idx.shape[-1], routing.read_idx.shape[-1]
  gated = lambda x, j, w: (tok(x, j) * col(w)).astype(x.dtype)
  if routing.tied:
    return (gated(q, kw, routing.read_w), gated(k, kw, routing.write_w),
            tok(v, kw), tok(g, kw), flat(routing.write_idx))
  zeros = lambda x, j: jnp.zeros((flat(x).shape[0], j) + x.shape[2:], x.dtype)
  cat = lambda a, b: jnp.concatenate([a, b], axis=1)
  return (cat(zeros(q, kw), gated(q, kr, routing.read_w)),
          cat(gated(k, kw, routing.write_w), zeros(k, kr)),
          tok(v, kw + kr),
          cat(tok(g, kw), zeros(g, kr)),
          cat(flat(routing.write_idx), flat(routing.read_idx)))


def _varlen(q, k, v, g, routing, n, h0, shared, h0_shared, cu_seqlens, c, core):
  """Gather tokens per (sequence, partition) segment, one packed chunked call."""
  b, t, h, dk = q.shape
  if cu_seqlens is None:
    seq = jnp.repeat(jnp.arange(b), t)
  else:
    seq, _ = reference.sequence_ids(cu_seqlens, t)
  nseq = h0.shape[0]
  q_s, k_s, v_s, g_s, part = _routed_slots(q, k, v, g, routing)
  # An id out of [0, N) (possible only under jit, against the contract) would land in
  # another (sequence, partition) segment: make its slot an identity row of partition
  # 0 instead, so that it is ignored as the masking and scan paths ignore it.
  valid = (part >= 0) & (part < n)
  keep = lambda x: jnp.where(valid[..., None, None], x, jnp.zeros((), x.dtype))
  q_s, k_s, g_s, part = keep(q_s), keep(k_s), keep(g_s), jnp.where(valid, part, 0)
  per_token = part.shape[1]
  # Slots are token-major, so a stable sort by segment keeps time order inside each
  # (sequence, partition) segment.
  seg = (seq[:, None] * n + part).reshape(-1)
  q_s, k_s, v_s, g_s = (x.reshape((-1,) + x.shape[2:]) for x in (q_s, k_s, v_s, g_s))
  h0_table = h0.reshape((nseq * n,) + h0.shape[2:])
  flat = lambda x: x.reshape((b * t,) + x.shape[2:])
  if shared is not None:
    seg = jnp.concatenate([seg, nseq * n + seq])
    q_s, k_s, g_s = (jnp.concatenate([x, flat(s)]) for x, s in zip((q_s, k_s, g_s), shared))
    v_s = jnp.concatenate([v_s, flat(v)])
    h0_table = jnp.concatenate([h0_table, h0_shared])
  # The shared partition's slots (segment ids nseq * N + sequence, after every routed
  # id, in time order) are already in segment order: only the routed ones are sorted.
  o_s, finals = gla_lib.packed_chunked(q_s, k_s, v_s, g_s, seg, h0_table, c, core,
                                       sorted_tail=0 if shared is None else b * t)
  routed = b * t * per_token
  o = o_s[:routed].reshape(b * t, per_token, h, -1).sum(axis=1)
  final = finals[:nseq * n].reshape(h0.shape)
  final0 = None
  if shared is not None:
    o = o + o_s[routed:]
    final0 = finals[nseq * n:]
  return o.reshape(b, t, h, -1), final, final0


def sse(q, k, v, g, weights, indices, *, num_partitions, scale=None, gate="both",
        initial_state=None, output_final_state=False, cu_seqlens=None, impl="varlen",
        shared=None, read_weights=None, read_indices=None,
        chunk_size: int = gla_lib.DEFAULT_CHUNK):
  """Sparse State Expansion over N routed partitions (module docstring).

  Args:
    q, k, g: [B, T, H, Dk]; v: [B, T, H, Dv]. g is the log decay, g <= 0; -inf is a
      hard reset of the selected partitions, computed exactly by every impl. g > 0 or
      NaN raises a ValueError on concrete values; under `jit` it is the caller's
      contract (`checked` checks it), as is weights >= 0.
    weights: float [B, T, K], router probabilities e_t^i >= 0 of the selected
      partitions (shared by all heads; a negative one raises on concrete values).
      Gradients flow into them through the gates.
    indices: int [B, T, K], distinct partition ids in [0, num_partitions) per token
      (checked on concrete inputs; under jit that is the caller's contract, checked by
      `checked`, and every impl ignores an id out of range: that selection writes and
      reads nothing).
    num_partitions: N (static).
    scale: multiplies q (and the shared q'); defaults to Dk ** -0.5.
    gate: "both" | "write" | "read" | "none".
    initial_state: [B, N, H, Dk, Dv] ([S, ...] with cu_seqlens); with `shared`, a tuple
      (routed or None, shared [B | S, H, Dk, Dv] or None).
    output_final_state: also return the final state(s), shaped like initial_state.
    cu_seqlens: int32 [S + 1], packed sequences along T (B == 1): starts at 0, never
      decreases, ends at T (checked on concrete values; under `jit`, the caller's
      contract: other values give wrong results; `checked` checks it).
    impl: "varlen" (default), "masking", "pallas_varlen", "pallas_masking", "auto",
      "loop" or "scan" (reference); see `impl.Impl`. Or an `impl.Plan` of algorithm
      SCAN, LOOP, MASKING or VARLEN with its chunk core (Pallas block sizes, interpret
      mode).
    shared: optional (q', k', g'), each [B, T, H, Dk]: an always-on GLA partition
      sharing v, with weight 1 (g' <= 0 as g).
    read_weights, read_indices: optional [B, T, Kr] read set (the official code's
      `num_readers`); `weights`/`indices` are then the write set only. A partition
      read but not written at t neither decays nor changes; one written but not
      read contributes nothing to o_t. Default: the read set is the write set.
    chunk_size: C, a multiple of 16 (16, 32, 64 or 128 for the Pallas impls).
  Returns:
    (o [B, T, H, Dv] in v's dtype, final_state or None). Empty inputs (B, T, H, Dk or
    Dv = 0) give zeros and the initial states as the final states.
  """
  q, k, v, g, weights, indices, cu_seqlens, read_weights, read_indices = (
      checks.as_array(name, x) for name, x in (
          ("q", q), ("k", k), ("v", v), ("g", g), ("weights", weights),
          ("indices", indices), ("cu_seqlens", cu_seqlens),
          ("read_weights", read_weights), ("read_indices", read_indices)))
  b, t, h, dk, dv = checks.check_qkvg(q, k, v, g)
  plan, chunk_size = impl_lib.plan(impl, "sse", chunk_size=chunk_size, head_dims=(dk, dv))
  gate = checks.parse_enum(Gate, gate, "gate")
  checks.check_scale(scale)
  checks.check_routing(weights, indices, b, t, num_partitions)
  if (read_weights is None) != (read_indices is None):
    raise ValueError("read_weights and read_indices must be given together")
  if read_indices is not None:
    checks.check_routing(read_weights, read_indices, b, t, num_partitions)
  checks.check_log_decay("g", g)
  checks.check_weights("weights", weights)
  if read_weights is not None:
    checks.check_weights("read_weights", read_weights)
  nseq = checks.check_cu_seqlens(cu_seqlens, b, t)
  nstate = b if nseq is None else nseq
  h0, h0_shared = initial_state, None
  if shared is None and isinstance(initial_state, (tuple, list)):
    raise ValueError("initial_state is a tuple, but shared is None: a (routed, shared) "
                     "pair of initial states needs the shared partition's inputs")
  if shared is not None:
    if not (isinstance(shared, (tuple, list)) and len(shared) == 3):
      raise ValueError("shared must be a tuple (q', k', g') of [B, T, H, Dk] arrays")
    shared = tuple(checks.as_array(name, x)
                   for name, x in zip(("shared q'", "shared k'", "shared g'"), shared))
    for name, x in zip(("shared q'", "shared k'", "shared g'"), shared):
      if tuple(x.shape) != tuple(k.shape):
        raise ValueError(f"{name} must have the shape of k {tuple(k.shape)}, got"
                         f" {tuple(x.shape)}")
      checks.check_floating(name, x)
    checks.check_log_decay("shared g'", shared[2])
    if initial_state is not None:
      if not (isinstance(initial_state, (tuple, list)) and len(initial_state) == 2):
        raise ValueError("with shared, initial_state must be a tuple (routed, shared)")
      h0, h0_shared = initial_state
  h0 = checks.as_array("initial_state", h0)
  h0_shared = checks.as_array("initial_state (shared)", h0_shared)
  checks.check_state("initial_state", h0, (nstate, num_partitions, h, dk, dv))
  checks.check_state("initial_state (shared)", h0_shared, (nstate, h, dk, dv))
  for name, x in (("q", q), ("k", k), ("v", v), ("weights", weights),
                  ("read_weights", read_weights), ("initial_state", h0),
                  ("initial_state (shared)", h0_shared),
                  *zip(("shared q'", "shared k'"), shared or ())):
    checks.check_finite(name, x)

  dtype = checks.compute_dtype(q, k, v, g, weights, h0, h0_shared,
                               *(shared if shared is not None else ()))
  h0 = (jnp.zeros((nstate, num_partitions, h, dk, dv), dtype) if h0 is None
        else h0.astype(dtype))
  if shared is not None:
    h0_shared = (jnp.zeros((nstate, h, dk, dv), dtype) if h0_shared is None
                 else h0_shared.astype(dtype))
  # Nothing to compute, every state stays as it was. Returned here, before the paths'
  # reshapes (which cannot infer a -1 axis of an empty array) and the Pallas grids.
  if 0 in (b, t, h, dk, dv):
    o = jnp.zeros((b, t, h, dv), v.dtype)
    if not output_final_state:
      return o, None
    return o, (h0 if shared is None else (h0, h0_shared))
  scale = dk ** -0.5 if scale is None else scale
  qkv_dtype = impl_lib.storage_dtype(
      plan.core, [x.dtype for x in (q, k, v) + tuple(shared or ())[:2]], dtype)
  read = () if read_indices is None else (read_weights, read_indices)
  return _sse(q, k, v, g, weights, indices, read, h0, shared or (),
              () if shared is None else h0_shared, scale, cu_seqlens,
              num_partitions=num_partitions, gate=gate, plan=plan, chunk_size=chunk_size,
              dtype=dtype, qkv_dtype=qkv_dtype, output_final_state=output_final_state)


# One compiled program per configuration, as for `gla._gla`: eager calls run one
# executable instead of each small op of the packing and the chunked core in turn
# (varlen with the shared partition, B = 2, T = 64, on CPU: the first call 8.7 s
# against 1.2 s, later ones 0.27 against 0.06 s).
@functools.partial(jax.jit, static_argnames=(
    "num_partitions", "gate", "plan", "chunk_size", "dtype", "qkv_dtype",
    "output_final_state"))
def _sse(q, k, v, g, weights, indices, read, h0, shared, h0_shared, scale, cu_seqlens, *,
         num_partitions, gate, plan, chunk_size, dtype, qkv_dtype, output_final_state):
  """sse's computation on checked inputs (see `sse`), the initial states already in
  `dtype`; shared and h0_shared are () without the shared partition, read () when the
  read set is the write set."""
  b, h = q.shape[0], q.shape[2]
  with_shared = bool(shared)
  out_dtype = v.dtype
  q = (q.astype(dtype) * scale).astype(qkv_dtype)
  k, v, g = k.astype(qkv_dtype), v.astype(qkv_dtype), g.astype(dtype)
  if with_shared:
    q0, k0, g0 = shared
    shared = ((q0.astype(dtype) * scale).astype(qkv_dtype), k0.astype(qkv_dtype),
              g0.astype(dtype))
  weights = weights.astype(dtype)
  if read:
    read = (read[0].astype(dtype), read[1])

  def run(q, k, v, g, weights, indices, read, h0, shared, h0_shared):
    routing = make_routing(weights, indices, *(read or (None, None)), gate)
    if not shared:  # () stands for "none" inside shard_map
      shared = h0_shared = None
    args = (q, k, v, g, routing, num_partitions, h0, shared, h0_shared, cu_seqlens)
    chunked = lambda path: path(*args, chunk_size, impl_lib.core_fn(plan.core, qkv_dtype))
    match plan.algorithm:
      case Algorithm.SCAN:
        o, final, final0 = _scan(*args)
      case Algorithm.LOOP:
        o, final, final0 = chunked(_loop)
      case Algorithm.MASKING:
        o, final, final0 = chunked(_masking)
      case Algorithm.VARLEN:
        o, final, final0 = chunked(_varlen)
      case other:
        raise ValueError(f"sse has no algorithm {other!r}")
    return o, final, (() if final0 is None else final0)  # no None leaves in shard_map

  inputs = (q, k, v, g, weights, indices, read, h0, shared, h0_shared)
  # With cu_seqlens (B == 1) only the heads can be sharded: shard_axes finds no batch
  # axis that divides 1, and each device runs its heads over the whole packed T.
  axes = sharding.shard_axes(b, h)
  if axes is None:
    o, final, final0 = run(*inputs)
  else:  # one shard of the batch and heads per device: see `sharding`
    act = sharding.spec(axes, 4, head_dim=2)
    route = sharding.spec(axes, 3)
    routed = sharding.spec(axes, 5, head_dim=2)
    state = sharding.spec(axes, 4, head_dim=1)
    specs = (act,) * 4 + (route, route, (route,) * len(read), routed,
                          (act,) * len(shared), state if with_shared else ())
    o, final, final0 = sharding.per_shard(run, inputs, specs,
                                          (act, routed, state if with_shared else ()))
  if not output_final_state:
    return o.astype(out_dtype), None
  final = final.astype(dtype)
  return o.astype(out_dtype), (final if not with_shared else (final, final0.astype(dtype)))
