"""One-token decoding steps: O(K Dk Dv) per head, touching only the selected states.

Continue from the `final_state` of a prefill call (`output_final_state=True`) to
reproduce, token by token, the outputs of one full-sequence call.
"""

from __future__ import annotations

import jax.numpy as jnp

from sse_jax.ops import checks
from sse_jax.ops import sse as sse_lib
from sse_jax.ops.checks import Gate
from sse_jax.ops.reference import gla_step, write


def _check_step(q, k, v, g):
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
    if x.ndim != 3:
      raise ValueError(f"{name} must have rank 3 [B, H, D] (one token), got shape"
                       f" {tuple(x.shape)}")
    checks.check_floating(name, x)
  if q.shape != k.shape or g.shape != k.shape or v.shape[:2] != k.shape[:2]:
    raise ValueError(f"mismatched step shapes: q {tuple(q.shape)}, k {tuple(k.shape)},"
                     f" v {tuple(v.shape)}, g {tuple(g.shape)}")
  checks.check_log_decay("g", g)  # g <= 0 as in `gla` / `sse`; -inf resets
  for name, x in (("q", q), ("k", k), ("v", v)):
    checks.check_finite(name, x)
  return k.shape + (v.shape[-1],)


def gla_decode_step(q, k, v, g, state, *, scale=None):
  """One GLA step. q, k, g: [B, H, Dk]; v: [B, H, Dv]; state: [B, H, Dk, Dv].

  g <= 0 as in `gla` (checked on concrete values, and by `checked` under jit).

  Returns (o [B, H, Dv] in v's dtype, new state in the state's dtype).
  """
  b, h, dk, dv = _check_step(q, k, v, g)
  checks.check_state("state", state, (b, h, dk, dv))
  scale = dk ** -0.5 if scale is None else scale
  dt = state.dtype
  state, o = gla_step(state, q.astype(dt) * scale, k.astype(dt), v.astype(dt),
                      g.astype(dt))
  return o.astype(v.dtype), state


def sse_decode_step(q, k, v, g, weights, indices, state, *, scale=None, gate="both",
                    shared=None, read_weights=None, read_indices=None):
  """One SSE step that reads and writes only the K selected partitions.

  Args:
    q, k, g: [B, H, Dk]; v: [B, H, Dv]; weights: float [B, K]; indices: int [B, K].
      g <= 0 and weights >= 0 as in `sse` (checked on concrete values, and by
      `checked` under jit). Per-partition projections as in `sse`: q, k [B, N, H, Dk]
      and v [B, N, H, Dv] (g shared), with `shared=(q', k', g', v')`.
    read_weights, read_indices: optional separate read set [B, Kr] (see `sse`).
    state: [B, N, H, Dk, Dv]; with `shared=(q', k', g'[, v'])` ([B, H, D] each) a tuple
      (routed [B, N, H, Dk, Dv], shared [B, H, Dk, Dv]).
  Returns:
    (o [B, H, Dv] in v's dtype, new state shaped like `state`).
  """
  per_partition = q.ndim == 4
  first = lambda x: x[:, 0] if per_partition else x
  b, h, dk, dv = _check_step(first(q), first(k), first(v), g)
  gate = checks.parse_enum(Gate, gate, "gate")
  routed, state0 = (state if shared is not None else (state, None))
  if routed.ndim != 5:
    raise ValueError(f"state must have shape [B, N, H, Dk, Dv], got {tuple(routed.shape)}")
  n = routed.shape[1]
  checks.check_state("state", routed, (b, n, h, dk, dv))
  for name, x, d in (("q", q, dk), ("k", k, dk), ("v", v, dv)):
    if per_partition and tuple(x.shape) != (b, n, h, d):
      raise ValueError(f"per-partition {name} must have shape [B, N, H, D] = "
                       f"{(b, n, h, d)}, got {tuple(x.shape)}")
  if shared is not None and len(shared) == 3:
    if per_partition:
      raise ValueError("per-partition v needs the shared partition's own values: "
                       "shared=(q', k', g', v')")
    shared = (*shared, v)
  if indices.ndim != 2 or indices.shape[0] != b or weights.shape != indices.shape:
    raise ValueError(f"weights and indices must both be [B={b}, K], got"
                     f" {tuple(weights.shape)} and {tuple(indices.shape)}")
  checks.check_routing(weights[:, None], indices[:, None], b, 1, n)
  if (read_weights is None) != (read_indices is None):
    raise ValueError("read_weights and read_indices must be given together")
  if read_indices is not None:
    checks.check_routing(read_weights[:, None], read_indices[:, None], b, 1, n)
  checks.check_weights("weights", weights)
  checks.check_weights("read_weights", read_weights)
  for name, x in (("weights", weights), ("read_weights", read_weights),
                  ("state", routed), ("state (shared)", state0)):
    checks.check_finite(name, x)
  if shared is not None:
    checks.check_log_decay("shared g'", shared[2])
  scale = dk ** -0.5 if scale is None else scale
  dt = routed.dtype
  q, k, v, g = (x.astype(dt) for x in (q, k, v, g))
  r = sse_lib.make_routing(weights.astype(dt), indices,
                           None if read_weights is None else read_weights.astype(dt),
                           read_indices, gate)

  rows = jnp.arange(b)[:, None]
  # A step's inputs for the selected partitions [B, K, H, D] (or [B, 1, H, D] shared).
  pick = lambda x, idx: x[rows, idx] if per_partition else x[:, None]
  picked = routed[rows, r.write_idx]                              # [B, Kw, H, Dk, Dv]
  kw = pick(k, r.write_idx) * r.write_w[:, :, None, None]
  picked = write(picked, kw, pick(v, r.write_idx), g[:, None])
  routed = routed.at[rows, r.write_idx].set(picked)
  read = picked if r.tied else routed[rows, r.read_idx]           # [B, Kr, H, Dk, Dv]
  if per_partition:
    o = jnp.einsum("bjhk,bjhkv,bj->bhv", pick(q, r.read_idx) * scale, read, r.read_w)
  else:
    o = jnp.einsum("bhk,bjhkv,bj->bhv", q * scale, read, r.read_w)
  if shared is None:
    return o.astype(v.dtype), routed
  checks.check_state("state (shared)", state0, (b, h, dk, dv))
  q0, k0, g0, v0 = (x.astype(dt) for x in shared)
  state0, o0 = gla_step(state0, q0 * scale, k0, v0, g0)
  return (o + o0).astype(v.dtype), (routed, state0)
