"""Sparse State Expansion on the gated delta rule: `sse_gdn` (design.md, section 7).

The routing of `sse` (weights / indices [B, T, K], states [B, N, H, Dk, Dv]), with every
routed partition a gated delta-rule state (`gdn`). At each token a selected partition i
takes one delta-rule step with write strength w_t^i beta_t, and an unselected one is
untouched (no decay, no delta update: its clock stops):

  S_t^i = exp(g_t) S_{t-1}^i + w_t^i beta_t k_t^T (v_t - exp(g_t) k_t S_{t-1}^i)   i selected
  S_t^i = S_{t-1}^i                                                                 otherwise
  o_t   = sum_{i selected} r_t^i scale q_t S_t^i  [+ scale q'_t S'_t, shared]

with (w, r) = (e, e) for gate "both", (e, 1) "write", (1, e) "read", (1, 1) "none". The
router weight is a write strength and an output weight, never a factor of q or k (it
would not survive the layer's L2 normalisation of q and k; design.md, section 7). The
optional always-on shared partition S' is a plain gated delta-rule state with its own
q', k', g', beta' (sharing v), `shared=(q', k', g', beta')`, fused into the same
chunked call by the masking and varlen paths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sse_jax.ops import checks
from sse_jax.ops import impl as impl_lib
# Names, not the module: the package binds `gdn` to the function.
from sse_jax.ops.gdn import (DEFAULT_CHUNK, check_chunk_size, check_gates, check_inputs,
                             chunked_gdn, core_fn, delta_rule_step, gdn_scan,
                             packed_chunk_gdn, storage_dtype)
from sse_jax.ops import reference
from sse_jax.ops import sharding
from sse_jax.ops.checks import Gate
from sse_jax.ops.impl import Algorithm
from sse_jax.ops.sse import Routing, make_routing, spread

# The impl strings sse_gdn takes (`impl_lib.SSE_GDN_IMPLS`): "scan", "masking",
# "varlen", "pallas_masking", "pallas_varlen", "auto"; a typed `impl_lib.Plan` of
# algorithm SCAN, MASKING or VARLEN is taken too.
SSE_GDN_IMPLS = tuple(i.value for i in impl_lib.SSE_GDN_IMPLS)
SHARED_NAMES = ("shared q'", "shared k'", "shared g'", "shared beta'")


def sse_gdn_scan(q, k, v, g, beta, write_w, written, read_w, h0, cu_seqlens=None):
  """The reference: one step over all N partitions per `lax.scan` iteration.

  q (scaled), k [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H]; write weights w, the
  boolean `written` and read weights r [B, T, N] (r = 0 where not read);
  h0 [B | S, N, H, Dk, Dv]. Returns o [B, T, H, Dv] and the final states.
  """

  def step(state, x):
    qt, kt, vt, gt, bt, wt, st, rt = x
    updated = delta_rule_step(state, kt[:, None], vt[:, None], gt[:, None],
                                      bt[:, None] * wt[..., None])
    state = jnp.where(st[:, :, None, None, None], updated, state)
    return state, jnp.einsum("bhk,bnhkv,bn->bhv", qt, state, rt)

  xs = tuple(jnp.swapaxes(a, 0, 1) for a in (q, k, v, g, beta, write_w, written, read_w))
  ys, final = reference.recurrent_scan(step, xs, h0, cu_seqlens, q.shape[1])
  return jnp.swapaxes(ys, 0, 1), final


def _scan(q, k, v, g, beta, routing: Routing, n, h0, shared, h0_shared, cu_seqlens):
  written, ww = spread(routing.write_idx, routing.write_w, n)
  _, rw = spread(routing.read_idx, routing.read_w, n)
  o, final = sse_gdn_scan(q, k, v, g, beta, ww, written, rw, h0, cu_seqlens)
  if shared is None:
    return o, final, None
  q0, k0, g0, b0 = shared
  o0, final0 = gdn_scan(q0, k0, v, g0, b0, h0_shared, cu_seqlens)
  return o + o0, final, final0


def _masking(q, k, v, g, beta, routing: Routing, n, h0, shared, h0_shared, cu_seqlens,
             chunk_size, core, move):
  """Per-partition copies folded into the head axis, one chunked call.

  Where partition i is not written at t: g = 0 and beta = 0 (an identity step: no decay,
  no write); not read: q = 0.
  """
  written, ww = spread(routing.write_idx, routing.write_w, n)
  _, rw = spread(routing.read_idx, routing.read_w, n)
  per_part = lambda x: jnp.broadcast_to(x[:, :, None], x.shape[:2] + (n,) + x.shape[2:])
  parts = [(q[:, :, None] * rw[..., None, None]).astype(q.dtype), per_part(k),
           per_part(v),
           # g selected, not multiplied by the 0/1 mask: -inf * 0 is NaN.
           jnp.where(written[..., None], g[:, :, None], jnp.zeros((), g.dtype)),
           (beta[:, :, None] * ww[..., None]).astype(beta.dtype)]
  if shared is not None:
    shared = shared[:2] + (v,) + shared[2:]
    parts = [jnp.concatenate([x, s[:, :, None]], axis=2) for x, s in zip(parts, shared)]
    h0 = jnp.concatenate([h0, h0_shared[:, None]], axis=1)
  b, t, p, h = parts[3].shape
  fold = lambda x: x.reshape((b, t, p * h) + x.shape[4:])
  o, final = chunked_gdn(*map(fold, parts), h0.reshape((-1, p * h) + h0.shape[3:]),
                         cu_seqlens, chunk_size, core, move)
  o = o.reshape(b, t, p, h, -1).sum(axis=2)
  final = final.reshape((-1, p, h) + final.shape[2:])
  if shared is None:
    return o, final, None
  return o, final[:, :n], final[:, n]


def _routed_slots(q, k, v, g, beta, routing: Routing):
  """Per-token slots [B*T, J, ...] (q, k, v, g, beta) and their partitions [B*T, J].

  Tied sets: one slot per selected partition (q r, k, v, g, beta w). Untied: Kw write
  slots (q = 0) then Kr read slots (g = beta = 0: no decay, no write); in a segment the
  write slot of a token precedes its read slot, so the read sees S_t.
  """
  kw, kr = routing.write_idx.shape[-1], routing.read_idx.shape[-1]
  flat = lambda x: x.reshape((-1,) + x.shape[2:])
  tok = lambda x, j: jnp.broadcast_to(flat(x)[:, None],
                                      (flat(x).shape[0], j) + x.shape[2:])
  weigh = lambda x, w: (tok(x, w.shape[-1]) * flat(w).reshape(
      flat(w).shape + (1,) * (x.ndim - 2))).astype(x.dtype)
  q_r, b_w = weigh(q, routing.read_w), weigh(beta, routing.write_w)
  if routing.tied:
    return q_r, tok(k, kw), tok(v, kw), tok(g, kw), b_w, flat(routing.write_idx)
  zeros = lambda x, j: jnp.zeros((flat(x).shape[0], j) + x.shape[2:], x.dtype)
  cat = lambda a, b: jnp.concatenate([a, b], axis=1)
  return (cat(zeros(q, kw), q_r), tok(k, kw + kr), tok(v, kw + kr),
          cat(tok(g, kw), zeros(g, kr)), cat(b_w, zeros(beta, kr)),
          cat(flat(routing.write_idx), flat(routing.read_idx)))


def _varlen(q, k, v, g, beta, routing: Routing, n, h0, shared, h0_shared, cu_seqlens,
            chunk_size, core, move):
  """Tokens gathered per (sequence, partition) segment, one packed chunked call."""
  b, t = q.shape[:2]
  seq = (jnp.repeat(jnp.arange(b), t) if cu_seqlens is None
         else reference.sequence_ids(cu_seqlens, t)[0])
  nseq = h0.shape[0]
  *slots, part = _routed_slots(q, k, v, g, beta, routing)
  # An id out of [0, N) (possible only under jit, against the contract) would land in
  # another segment: its slot becomes a zero (identity) row of partition 0 instead
  # (ignored, as the scan and masking paths ignore it), zeroed by the packing (`valid`).
  valid = (part >= 0) & (part < n)
  per_token = part.shape[1]
  # Slots are token-major: a stable sort by segment keeps time order in each segment.
  seg = (seq[:, None] * n + jnp.where(valid, part, 0)).reshape(-1)
  slots = [x.reshape((-1,) + x.shape[2:]) for x in slots]
  h0_table = h0.reshape((nseq * n,) + h0.shape[2:])
  valid = valid.reshape(-1)
  if shared is not None:  # segment nseq * N + sequence, after every routed one
    valid = jnp.concatenate([valid, jnp.ones(seq.shape, bool)])
    flat = lambda x: x.reshape((b * t,) + x.shape[2:])
    shared = shared[:2] + (v,) + shared[2:]
    # A second part of the packed op's inputs, not concatenated (`packing.Parts`).
    slots = [(x, flat(s)) for x, s in zip(slots, shared)]
    seg = jnp.concatenate([seg, nseq * n + seq])
    h0_table = jnp.concatenate([h0_table, h0_shared])
  o_s, finals = packed_chunk_gdn(slots, seg, h0_table, chunk_size,
                                 sorted_tail=0 if shared is None else b * t, core=core,
                                 move=move, valid=valid)
  o_routed = o_s if shared is None else o_s[0]
  o = o_routed.reshape((b * t, per_token) + o_routed.shape[1:]).sum(axis=1)
  final, final0 = finals[:nseq * n].reshape(h0.shape), None
  if shared is not None:
    o, final0 = o + o_s[1], finals[nseq * n:]
  return o.reshape((b, t) + o.shape[1:]), final, final0


def _as_shared(shared):
  """shared as a tuple of four arrays (q', k', g', beta'), else a one-line error."""
  if not (isinstance(shared, (tuple, list)) and len(shared) == 4):
    raise ValueError("shared must be a tuple (q', k', g', beta'): q', k' like k, g', beta'"
                     " like g")
  return tuple(checks.as_array(n, x) for n, x in zip(SHARED_NAMES, shared))


def _check_shared(shared, k):
  """shared (q', k', g', beta') against k [B, T, H, Dk], as arrays."""
  shared = _as_shared(shared)
  for name, x, want in zip(SHARED_NAMES, shared, (k.shape, k.shape, k.shape[:-1],
                                                  k.shape[:-1])):
    if tuple(x.shape) != tuple(want):
      raise ValueError(f"{name} must have shape {tuple(want)}, got {tuple(x.shape)}")
    checks.check_floating(name, x)
  check_gates(*shared[2:], prefix="shared ")
  for name, x in zip(SHARED_NAMES[:2], shared[:2]):
    checks.check_finite(name, x)
  return shared


def _initial_states(initial_state, with_shared: bool, routed_shape: tuple[int, ...]):
  """(routed, shared) initial states as checked arrays, None where not given.

  initial_state is the routed state [Z, N, H, Dk, Dv] or None; with the shared
  partition, a pair (routed or None, shared [Z, H, Dk, Dv] or None) or None.
  """
  if not with_shared:
    if isinstance(initial_state, (tuple, list)):
      raise ValueError("initial_state is a tuple, but shared is None: a (routed, shared) "
                       "pair of initial states needs the shared partition's inputs")
    pair = (initial_state, None)
  elif initial_state is None:
    pair = (None, None)
  elif isinstance(initial_state, (tuple, list)) and len(initial_state) == 2:
    pair = tuple(initial_state)
  else:
    raise ValueError("with shared, initial_state must be a tuple (routed, shared)")
  shapes = (routed_shape, routed_shape[:1] + routed_shape[2:])
  out = []
  for name, x, shape in zip(("initial_state", "initial_state (shared)"), pair, shapes):
    x = checks.as_array(name, x)
    checks.check_state(name, x, shape)
    checks.check_finite(name, x)
    out.append(x)
  return tuple(out)


def _check_routing_sets(write, read, lead: tuple[int, ...], num_partitions: int):
  """The write set (weights, indices) and the optional read set (read_weights,
  read_indices, both or neither), each [*lead, K]: lead = (B, T), or (B,) for one
  decoding step. Weights must be >= 0 (on concrete values)."""
  if (read[0] is None) != (read[1] is None):
    raise ValueError("read_weights and read_indices must be given together")
  for prefix, (w, idx) in (("", write), ("read_", read)):
    if idx is None:
      continue
    if len(lead) == 2:
      checks.check_routing(w, idx, *lead, num_partitions)
    elif idx.ndim != 2 or idx.shape[0] != lead[0] or w.shape != idx.shape:
      raise ValueError(f"{prefix}weights and {prefix}indices must both be [B={lead[0]},"
                       f" K], got {tuple(w.shape)} and {tuple(idx.shape)}")
    else:  # one token: [B, K] checked as [B, 1, K]
      checks.check_routing(w[:, None], idx[:, None], lead[0], 1, num_partitions)
    checks.check_weights(f"{prefix}weights", w)


def sse_gdn(q, k, v, g, beta, weights, indices, *, num_partitions, scale=None,
            gate="both", initial_state=None, output_final_state=False, cu_seqlens=None,
            impl="varlen", shared=None, read_weights=None, read_indices=None,
            chunk_size: int = DEFAULT_CHUNK):
  """SSE over N routed gated delta-rule partitions (module docstring).

  Args:
    q, k: [B, T, H, Dk]; v: [B, T, H, Dv] (q and k not normalised here).
    g: [B, T, H] log decay <= 0 (-inf: a hard reset of the selected partitions);
      beta: [B, T, H] write strength in [0, 2]. Both checked on concrete values;
      under `jit` the caller's contract (`checked` checks them), as is weights >= 0.
    weights: float [B, T, K] router probabilities e_t^i >= 0 of the selected
      partitions (shared by all heads); gradients flow into them through the gates.
    indices: int [B, T, K], distinct partition ids in [0, num_partitions) per token
      (checked on concrete inputs; under jit an id out of range selects nothing).
    num_partitions: N (static).
    scale: multiplies q (and the shared q'); defaults to Dk ** -0.5.
    gate: "both" | "write" | "read" | "none": where e_t^i acts (write strength, output
      weight).
    initial_state: [B, N, H, Dk, Dv] ([S, ...] with cu_seqlens); with `shared`, a tuple
      (routed or None, shared [B | S, H, Dk, Dv] or None).
    output_final_state: also return the final state(s), shaped like initial_state.
    cu_seqlens: int32 [S + 1], packed sequences along T (B == 1), as in `gdn`.
    impl: "varlen" (default), "masking", their Pallas forms "pallas_varlen" and
      "pallas_masking" (`pallas_kernels.chunk_gdn`; interpret mode off the GPU), "auto"
      (pallas_varlen on a supported GPU, else varlen) or "scan" (reference); or an
      `impl.Plan` of algorithm SCAN, MASKING or VARLEN.
    shared: optional (q', k', g', beta'): q', k' [B, T, H, Dk], g', beta' [B, T, H]; an
      always-on gated delta-rule partition sharing v, with weight 1.
    read_weights, read_indices: optional [B, T, Kr] read set (see `sse`); weights /
      indices are then the write set only. Default: the read set is the write set.
    chunk_size: C, a positive int (16, 32 or 64 for the Pallas kernels).
  Returns:
    (o [B, T, H, Dv] in v's dtype, final_state or None); states in float32 (float64
    with float64 inputs). Empty inputs give zeros and the initial states.
  """
  q, k, v, g, beta, weights, indices, cu_seqlens, read_weights, read_indices = (
      checks.as_array(name, x) for name, x in (
          ("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("weights", weights),
          ("indices", indices), ("cu_seqlens", cu_seqlens),
          ("read_weights", read_weights), ("read_indices", read_indices)))
  b, t, h, dk, dv = check_inputs(q, k, v, g, beta)
  chunk_size = check_chunk_size(chunk_size)
  plan, chunk_size = impl_lib.plan(impl, "sse_gdn", chunk_size=chunk_size,
                                   head_dims=(dk, dv))
  gate = checks.parse_enum(Gate, gate, "gate")
  checks.check_scale(scale)
  _check_routing_sets((weights, indices), (read_weights, read_indices), (b, t),
                      num_partitions)
  check_gates(g, beta)
  nseq = checks.check_cu_seqlens(cu_seqlens, b, t)
  nstate = b if nseq is None else nseq
  if shared is not None:
    shared = _check_shared(shared, k)
  h0, h0_shared = _initial_states(initial_state, shared is not None,
                                  (nstate, num_partitions, h, dk, dv))
  for name, x in (("q", q), ("k", k), ("v", v), ("weights", weights),
                  ("read_weights", read_weights)):
    checks.check_finite(name, x)

  dtype = checks.compute_dtype(q, k, v, g, beta, weights, h0, h0_shared, *(shared or ()))
  h0 = (jnp.zeros((nstate, num_partitions, h, dk, dv), dtype) if h0 is None
        else h0.astype(dtype))
  if shared is not None:
    h0_shared = (jnp.zeros((nstate, h, dk, dv), dtype) if h0_shared is None
                 else h0_shared.astype(dtype))
  if 0 in (b, t, h, dk, dv):  # nothing to compute: every state stays as it was
    o = jnp.zeros((b, t, h, dv), v.dtype)
    if not output_final_state:
      return o, None
    return o, (h0 if shared is None else (h0, h0_shared))
  scale = dk ** -0.5 if scale is None else scale
  read = () if read_indices is None else (read_weights, read_indices)
  qkv_dtype = storage_dtype(plan.core, (q.dtype, k.dtype, v.dtype) + tuple(
      x.dtype for x in (shared or ())[:2]), dtype)
  return _sse_gdn(q, k, v, g, beta, weights, indices, read, h0, shared or (),
                  () if shared is None else h0_shared, scale, cu_seqlens,
                  num_partitions=num_partitions, gate=gate, plan=plan,
                  chunk_size=chunk_size, dtype=dtype, qkv_dtype=qkv_dtype,
                  output_final_state=output_final_state)


@functools.partial(jax.jit, static_argnames=(
    "num_partitions", "gate", "plan", "chunk_size", "dtype", "qkv_dtype",
    "output_final_state"))
def _sse_gdn(q, k, v, g, beta, weights, indices, read, h0, shared, h0_shared, scale,
             cu_seqlens, *, num_partitions, gate, plan, chunk_size, dtype, qkv_dtype,
             output_final_state):
  """sse_gdn's computation on checked inputs (initial states in `dtype`; q, k, v and
  the shared q', k' in `qkv_dtype`, the chunk core's storage dtype); shared and
  h0_shared are () without the shared partition, read () when it is the write set."""
  b, h = q.shape[0], q.shape[2]
  with_shared = bool(shared)
  out_dtype = v.dtype
  cast = lambda xs: tuple(x.astype(dtype) for x in xs)
  store = lambda x: x.astype(qkv_dtype)
  q, k, v = store(q.astype(dtype) * scale), store(k), store(v)
  g, beta, weights = cast((g, beta, weights))
  if with_shared:
    q0, k0, g0, b0 = shared
    shared = (store(q0.astype(dtype) * scale), store(k0)) + cast((g0, b0))
  if read:
    read = (read[0].astype(dtype), read[1])

  def run(q, k, v, g, beta, weights, indices, read, h0, shared, h0_shared):
    routing = make_routing(weights, indices, *(read or (None, None)), gate)
    if not shared:  # () stands for "none" inside shard_map
      shared = h0_shared = None
    args = (q, k, v, g, beta, routing, num_partitions, h0, shared, h0_shared, cu_seqlens)
    chunked = lambda path: path(*args, chunk_size, core_fn(plan.core, qkv_dtype),
                                impl_lib.row_mover(plan.core))
    match plan.algorithm:
      case Algorithm.SCAN:
        o, final, final0 = _scan(*args)
      case Algorithm.MASKING:
        o, final, final0 = chunked(_masking)
      case Algorithm.VARLEN:
        o, final, final0 = chunked(_varlen)
      case other:
        raise ValueError(f"sse_gdn has no algorithm {other!r}")
    return o, final, (() if final0 is None else final0)  # no None leaves in shard_map

  run = impl_lib.keep_kernel_residuals(run, plan.core)
  inputs = (q, k, v, g, beta, weights, indices, read, h0, shared, h0_shared)
  axes = sharding.shard_axes(b, h)  # a context mesh: one batch / head shard per device
  if axes is None:
    o, final, final0 = run(*inputs)
  else:
    act, gates = sharding.spec(axes, 4, head_dim=2), sharding.spec(axes, 3, head_dim=2)
    route, routed = sharding.spec(axes, 3), sharding.spec(axes, 5, head_dim=2)
    state = sharding.spec(axes, 4, head_dim=1)
    shared_specs = (act, act, gates, gates) if with_shared else ()
    specs = (act, act, act, gates, gates, route, route, (route,) * len(read), routed,
             shared_specs, state if with_shared else ())
    o, final, final0 = sharding.per_shard(run, inputs, specs,
                                          (act, routed, state if with_shared else ()))
  finals = (final, final0) if with_shared else final
  return o.astype(out_dtype), (jax.tree_util.tree_map(lambda x: x.astype(dtype), finals)
                               if output_final_state else None)


def sse_gdn_decode_step(q, k, v, g, beta, weights, indices, state, *, scale=None,
                        gate="both", shared=None, read_weights=None, read_indices=None):
  """One SSE-GDN step that reads and writes only the selected partitions.

  Args:
    q, k: [B, H, Dk]; v: [B, H, Dv]; g, beta: [B, H]; weights: float [B, K];
      indices: int [B, K]. Contracts as in `sse_gdn`.
    state: [B, N, H, Dk, Dv]; with `shared=(q', k', g', beta')` ([B, H, Dk] twice,
      [B, H] twice) a tuple (routed [B, N, H, Dk, Dv], shared [B, H, Dk, Dv]).
    read_weights, read_indices: optional separate read set [B, Kr].
  Returns:
    (o [B, H, Dv] in v's dtype, new state shaped like `state`). Continuing from
    `sse_gdn(..., output_final_state=True)` reproduces one full call.
  """
  q, k, v, g, beta, weights, indices, read_weights, read_indices = (
      checks.as_array(n, x) for n, x in (
          ("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("weights", weights),
          ("indices", indices), ("read_weights", read_weights),
          ("read_indices", read_indices)))
  b, h, dk, dv = check_inputs(q, k, v, g, beta, step=True)
  gate = checks.parse_enum(Gate, gate, "gate")
  if shared is not None and not (isinstance(state, (tuple, list)) and len(state) == 2
                                 and state[1] is not None):
    raise ValueError("with shared, state must be a tuple (routed, shared) of arrays")
  routed, state0 = state if shared is not None else (state, None)
  routed = checks.as_array("state", routed)
  if routed.ndim != 5:
    raise ValueError(f"state must have shape [B, N, H, Dk, Dv], got {tuple(routed.shape)}")
  n = routed.shape[1]
  checks.check_state("state", routed, (b, n, h, dk, dv))
  _check_routing_sets((weights, indices), (read_weights, read_indices), (b,), n)
  check_gates(g, beta)
  if shared is not None:
    shared = _as_shared(shared)
    check_inputs(*shared[:2], v, *shared[2:], step=True, prefix="shared ")
    check_gates(*shared[2:], prefix="shared ")
    state0 = checks.as_array("state (shared)", state0)
    checks.check_state("state (shared)", state0, (b, h, dk, dv))
  for name, x in (("q", q), ("k", k), ("v", v), ("weights", weights),
                  ("read_weights", read_weights), ("state", routed),
                  ("state (shared)", state0)):
    checks.check_finite(name, x)
  scale = dk ** -0.5 if scale is None else scale
  dt = routed.dtype
  q, k, v, g, beta = (x.astype(dt) for x in (q, k, v, g, beta))
  r = make_routing(weights.astype(dt), indices,
                   None if read_weights is None else read_weights.astype(dt),
                   read_indices, gate)

  rows = jnp.arange(b)[:, None]
  picked = routed[rows, r.write_idx]                              # [B, Kw, H, Dk, Dv]
  picked = delta_rule_step(picked, k[:, None], v[:, None], g[:, None],
                                   beta[:, None] * r.write_w[..., None])
  routed = routed.at[rows, r.write_idx].set(picked)
  read = picked if r.tied else routed[rows, r.read_idx]           # [B, Kr, H, Dk, Dv]
  o = jnp.einsum("bhk,bjhkv,bj->bhv", q * scale, read, r.read_w)
  if shared is None:
    return o.astype(v.dtype), routed
  q0, k0, g0, b0 = (x.astype(dt) for x in shared)
  state0 = delta_rule_step(state0, k0, v, g0, b0)
  o0 = jnp.einsum("bhk,bhkv->bhv", q0 * scale, state0)
  return (o + o0).astype(v.dtype), (routed, state0)
