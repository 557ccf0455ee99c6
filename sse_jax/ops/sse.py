"""Sparse State Expansion: `sse(q, k, v, g, weights, indices)` (docs/design.md, section 1).

N routed partitions share g (and q, k, v, unless each partition has its own). At each
token the router selects K partitions (`indices`, with probabilities `weights`, not
renormalised); only those are decayed and written, and only those are read:

  S_t^i = diag(exp g_t) S_{t-1}^i + w_t^i k_t^T v_t     i selected at t
  S_t^i = S_{t-1}^i                                     otherwise (its clock stops)
  o_t   = sum_{i selected} r_t^i (scale q_t) S_t^i  [+ (scale q'_t) S'_t, shared]

with (w, r) = (e, e) for gate "both", (e, 1) "write", (1, e) "read", (1, 1) "none".
An optional always-on shared partition S' (a plain GLA state with its own q', k', g',
and v or its own v') can be passed as `shared=(q', k', g'[, v'])`, so that the masking
and varlen paths process it in the same chunked call as the routed partitions. The
algorithms themselves are in `sse_paths`, the routing in `routing`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sse_jax.ops import checks
from sse_jax.ops import gla as gla_lib
from sse_jax.ops import sharding
from sse_jax.ops import sse_paths
from sse_jax.ops.checks import Gate
from sse_jax.ops import impl as impl_lib
from sse_jax.ops.impl import Algorithm
from sse_jax.ops.routing import Routing, make_routing, spread  # pylint: disable=unused-import

SHARED_NAMES = ("shared q'", "shared k'", "shared g'", "shared v'")


def sse(q, k, v, g, weights, indices, *, num_partitions, scale=None, gate="both",
        initial_state=None, output_final_state=False, cu_seqlens=None, impl="varlen",
        shared=None, read_weights=None, read_indices=None,
        chunk_size: int = gla_lib.DEFAULT_CHUNK):
  """Sparse State Expansion over N routed partitions (module docstring).

  Args:
    q, k, g: [B, T, H, Dk]; v: [B, T, H, Dv]. g is the log decay, g <= 0; -inf is a
      hard reset of the selected partitions, computed exactly by every impl. g > 0 or
      NaN raises a ValueError on concrete values; under `jit` it is the caller's
      contract (`checked` checks it), as is weights >= 0. Per-partition projections
      (the paper's Table 8 control): q, k [B, T, N, H, Dk] and v [B, T, N, H, Dv],
      partition i reading and writing q[:, :, i], k[:, :, i], v[:, :, i]; g stays
      shared, and `shared` then needs its own v'.
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
    shared: optional (q', k', g') or (q', k', g', v'), [B, T, H, Dk] and v'
      [B, T, H, Dv]: an always-on GLA partition with weight 1 (g' <= 0 as g), with the
      values v unless v' is given.
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
  b, t, h, dk, dv = _check_qkvg(q, k, v, g, num_partitions)
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
    shared = _check_shared(shared, v, (b, t, h, dk, dv))
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
                  *((name, x) for name, x in zip(SHARED_NAMES, shared or ())
                    if name != "shared g'")):
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
  # The matmul operands: q, k, v and the shared partition's q', k', v' (not the gates).
  operands = (q, k, v) if shared is None else (q, k, v, *shared[:2], shared[3])
  qkv_dtype = impl_lib.storage_dtype(plan.core, [x.dtype for x in operands], dtype)
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
  b, h = g.shape[0], g.shape[2]
  with_shared = bool(shared)
  out_dtype = v.dtype
  q = (q.astype(dtype) * scale).astype(qkv_dtype)
  k, v, g = k.astype(qkv_dtype), v.astype(qkv_dtype), g.astype(dtype)
  if with_shared:
    q0, k0, g0, v0 = shared
    shared = ((q0.astype(dtype) * scale).astype(qkv_dtype), k0.astype(qkv_dtype),
              g0.astype(dtype), v0.astype(qkv_dtype))
  weights = weights.astype(dtype)
  if read:
    read = (read[0].astype(dtype), read[1])

  def run(q, k, v, g, weights, indices, read, h0, shared, h0_shared):
    routing = make_routing(weights, indices, *(read or (None, None)), gate)
    if not shared:  # () stands for "none" inside shard_map
      shared = h0_shared = None
    args = (q, k, v, g, routing, num_partitions, h0, shared, h0_shared, cu_seqlens)
    chunked = lambda path: path(*args, chunk_size, impl_lib.core_fn(plan.core, qkv_dtype),
                                impl_lib.row_mover(plan.core))
    match plan.algorithm:
      case Algorithm.SCAN:
        o, final, final0 = sse_paths.scan(*args)
      case Algorithm.LOOP:
        o, final, final0 = chunked(sse_paths.loop)
      case Algorithm.MASKING:
        o, final, final0 = chunked(sse_paths.masking)
      case Algorithm.VARLEN:
        o, final, final0 = chunked(sse_paths.varlen)
      case other:
        raise ValueError(f"sse has no algorithm {other!r}")
    return o, final, (() if final0 is None else final0)  # no None leaves in shard_map

  run = impl_lib.keep_kernel_residuals(run, plan.core)
  inputs = (q, k, v, g, weights, indices, read, h0, shared, h0_shared)
  # With cu_seqlens (B == 1) only the heads can be sharded: shard_axes finds no batch
  # axis that divides 1, and each device runs its heads over the whole packed T.
  axes = sharding.shard_axes(b, h)
  if axes is None:
    o, final, final0 = run(*inputs)
  else:  # one shard of the batch and heads per device: see `sharding`
    act = sharding.spec(axes, 4, head_dim=2)
    qkv = act if q.ndim == 4 else sharding.spec(axes, 5, head_dim=3)
    route = sharding.spec(axes, 3)
    routed = sharding.spec(axes, 5, head_dim=2)
    state = sharding.spec(axes, 4, head_dim=1)
    specs = (qkv,) * 3 + (act, route, route, (route,) * len(read), routed,
                          (act,) * len(shared), state if with_shared else ())
    o, final, final0 = sharding.per_shard(run, inputs, specs,
                                          (act, routed, state if with_shared else ()))
  if not output_final_state:
    return o.astype(out_dtype), None
  final = final.astype(dtype)
  return o.astype(out_dtype), (final if not with_shared else (final, final0.astype(dtype)))


def _check_qkvg(q, k, v, g, num_partitions) -> tuple[int, int, int, int, int]:
  """checks.check_qkvg, or for per-partition q, k, v ([B, T, N, H, D]) their shapes
  against g's; returns (B, T, H, Dk, Dv)."""
  ranks = (q.ndim, k.ndim, v.ndim)
  if 5 not in ranks:
    return checks.check_qkvg(q, k, v, g)
  if ranks != (5, 5, 5):
    raise ValueError(f"q, k and v must all be per partition [B, T, N, H, D] or all shared "
                     f"[B, T, H, D], got ranks {ranks}")
  b, t, h, dk, dv = checks.check_qkvg(q[:, :, 0], k[:, :, 0], v[:, :, 0], g)
  for name, x, d in (("q", q, dk), ("k", k, dk), ("v", v, dv)):
    if tuple(x.shape) != (b, t, num_partitions, h, d):
      raise ValueError(f"per-partition {name} must have shape [B, T, N, H, D] = "
                       f"{(b, t, num_partitions, h, d)}, got {tuple(x.shape)}")
  return b, t, h, dk, dv


def _check_shared(shared, v, dims) -> tuple:
  """shared (q', k', g'[, v']) checked, as a 4-tuple (v' = v by default)."""
  b, t, h, dk, dv = dims
  if not (isinstance(shared, (tuple, list)) and len(shared) in (3, 4)):
    raise ValueError("shared must be a tuple (q', k', g') or (q', k', g', v') of "
                     "[B, T, H, D] arrays")
  if len(shared) == 3:
    if v.ndim == 5:
      raise ValueError("per-partition v needs the shared partition's own values: "
                       "shared=(q', k', g', v')")
    shared = (*shared, v)
  shared = tuple(checks.as_array(name, x) for name, x in zip(SHARED_NAMES, shared))
  for name, x, d in zip(SHARED_NAMES, shared, (dk, dk, dk, dv)):
    if tuple(x.shape) != (b, t, h, d):
      raise ValueError(f"{name} must have shape [B, T, H, D] = {(b, t, h, d)}, got"
                       f" {tuple(x.shape)}")
    checks.check_floating(name, x)
  checks.check_log_decay("shared g'", shared[2])
  return shared
