"""Gated linear attention: `gla(q, k, v, g)` and its chunked building blocks.

    S_t = diag(exp g_t) S_{t-1} + k_t^T v_t,   o_t = (scale q_t) S_t,   g_t <= 0.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from sse_jax.ops import checks
from sse_jax.ops import chunked
from sse_jax.ops import packing
from sse_jax.ops import reference
from sse_jax.ops import sharding
from sse_jax.ops import impl as impl_lib
from sse_jax.ops.impl import Algorithm

DEFAULT_CHUNK = 64

# A chunk core maps pre-chunked inputs and a segment table to (o, final states per
# segment); see chunked.chunk_gla for the contract shared by the XLA and Pallas cores.
ChunkCore = Callable[..., tuple[jax.Array, jax.Array]]


def dense_chunked(q, k, v, g, h0, chunk_size: int, core: ChunkCore = chunked.chunk_gla):
  """Chunked GLA on a batch of equal-length sequences.

  q, k, g: [B, T, H, Dk]; v: [B, T, H, Dv]; h0: [B, H, Dk, Dv]. T is padded up to a
  multiple of C with q = k = g = 0 rows, which leave the state untouched, so the state
  after the padding is the state at T. g is raised to chunked.LOG_DECAY_FLOOR here, as
  in `packed_chunked`: the two places a -inf reset (or -1e38) is made finite for
  every core.
  """
  b, t = q.shape[:2]
  g = chunked.floor_log_decay(g)
  nc = -(-t // chunk_size)
  pad = nc * chunk_size - t

  def chunk(x):
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return x.reshape((b, nc, chunk_size) + x.shape[2:])

  seg_start = jnp.arange(b, dtype=jnp.int32) * nc
  seg_chunks = jnp.full((b,), nc, jnp.int32)
  o, final = core(chunk(q), chunk(k), chunk(v), chunk(g), h0, seg_start, seg_chunks)
  return o.reshape((b, nc * chunk_size) + o.shape[3:])[:, :t], final


def packed_chunked(q, k, v, g, slot_segment, h0, chunk_size: int,
                   core: ChunkCore = chunked.chunk_gla, presorted: bool = False,
                   sorted_tail: int = 0, move: packing.RowMover = packing.take_rows,
                   valid: jax.Array | None = None):
  """Chunked GLA over slots grouped into segments (see `packing`).

  q, k, g: [P, H, Dk]; v: [P, H, Dv], in time order within each segment;
  slot_segment: int [P]; h0: [Z, H, Dk, Dv] per-segment initial states.
  presorted, sorted_tail (static): slot_segment is non-decreasing, or is in its last
  sorted_tail slots, which come after all others in segment order
  (`packing.chunk_layout`). move: how slots are copied into the buffer and back.
  q, k, v and g may each be a tuple of parts (`packing.Parts`, the same part lengths
  for all four, P in all): the slots are packed from the parts without concatenating
  them, and o comes back as parts of those lengths. valid: None or bool [P]; a slot
  that is not valid keeps its place in its segment but as a zero row (an identity: no
  write, no decay, no read), with zero output and zero gradients.
  Returns o [P, H, Dv] and per-segment final states [Z, H, Dk, Dv] (an empty segment
  keeps its initial state).
  """
  q, k, v, g = (packing.as_parts(x) for x in (q, k, v, g))
  sizes = packing.part_sizes(q=q, k=k, v=v, g=g)
  p = sum(sizes)
  z = h0.shape[0]
  # Floored before the packing, so that the backward pass's mask of floored entries
  # is one of the slots, which a checkpoint recomputes from the op's inputs, not one
  # of a packed copy (`impl.keep_kernel_residuals`).
  g = tuple(chunked.floor_log_decay(part) for part in g)
  nc = packing.max_chunks(p, z, chunk_size)
  layout = packing.chunk_layout(slot_segment, z, chunk_size, presorted, sorted_tail)
  rows = packing.drop_invalid(layout.rows, valid, nc * chunk_size)
  in_place = getattr(core, "slots", None)
  if in_place is not None:
    # The kernels read the slots through the buffer's row table: no copies.
    take = packing.slot_of_row(rows, nc * chunk_size)
    covered = None if valid is None else packing.split_slots(valid, sizes)
    o, final = in_place(q, k, v, g, take, h0, layout.seg_start, layout.seg_chunks,
                        covered=covered)
    return (o[0] if len(sizes) == 1 else o), final

  def to_buffer(x):
    x = packing.scatter_rows(x, rows, nc * chunk_size, move)
    return x.reshape((1, nc, chunk_size) + x.shape[1:])

  o, final = core(to_buffer(q), to_buffer(k), to_buffer(v), to_buffer(g), h0,
                  layout.seg_start, layout.seg_chunks)
  o = o.reshape((nc * chunk_size,) + o.shape[3:])
  o = packing.gather_rows(o, rows, move, sizes=sizes)
  return (o[0] if len(sizes) == 1 else o), final


def chunked_gla(q, k, v, g, h0, cu_seqlens, chunk_size: int,
                core: ChunkCore = chunked.chunk_gla,
                move: packing.RowMover = packing.take_rows):
  """Dispatches to the dense or packed chunked path (inputs in compute dtype); move:
  the packed path's row mover."""
  if cu_seqlens is None:
    return dense_chunked(q, k, v, g, h0, chunk_size, core)
  seq, _ = reference.sequence_ids(cu_seqlens, q.shape[1])
  # Sequence ids along T never decrease (cu_seqlens is checked to be non-decreasing
  # on concrete inputs), so the slots are already in segment order.
  o, final = packed_chunked(q[0], k[0], v[0], g[0], seq, h0, chunk_size, core,
                            presorted=True, move=move)
  return o[None], final


def gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, impl="chunk", chunk_size: int = DEFAULT_CHUNK):
  """Gated linear attention.

  Args:
    q, k, g: [B, T, H, Dk]; v: [B, T, H, Dv]. g is the log decay, g <= 0; -inf is
      a hard reset (exp g = 0: the state before is forgotten), computed exactly like
      the scan (`chunked.LOG_DECAY_FLOOR`). g > 0 or NaN raises a ValueError on
      concrete values; under `jit` it is the caller's contract (`checked` checks it).
    scale: multiplies q; defaults to Dk ** -0.5.
    initial_state: [B, H, Dk, Dv], or [S, H, Dk, Dv] with `cu_seqlens`.
    output_final_state: also return the final state(s).
    cu_seqlens: int32 [S + 1] boundaries of S sequences packed along T (needs B == 1);
      no information crosses a boundary. It must start at 0, never decrease and end
      at T: checked on concrete values; under `jit` (a traced cu_seqlens) that is the
      caller's contract, and other values give wrong results (`checked` checks it).
    impl: "chunk" (default), "pallas_chunk", "auto" or "scan" (reference), or an
      `impl.Plan` of algorithm SCAN or CHUNK (Pallas block sizes, interpret mode).
    chunk_size: C, a multiple of 16 (16, 32, 64 or 128 for "pallas_chunk").
  Returns:
    (o [B, T, H, Dv] in v's dtype, final_state or None). States are float32, or
    float64 when the inputs are float64. Empty inputs (B, T, H, Dk or Dv = 0) give
    zeros and the initial state as the final state.
  """
  q, k, v, g, cu_seqlens = (checks.as_array(name, x) for name, x in (
      ("q", q), ("k", k), ("v", v), ("g", g), ("cu_seqlens", cu_seqlens)))
  initial_state = checks.as_array("initial_state", initial_state)
  b, t, h, dk, dv = checks.check_qkvg(q, k, v, g)
  plan, chunk_size = impl_lib.plan(impl, "gla", chunk_size=chunk_size, head_dims=(dk, dv))
  checks.check_scale(scale)
  nseq = checks.check_cu_seqlens(cu_seqlens, b, t)
  nstate = b if nseq is None else nseq
  checks.check_state("initial_state", initial_state, (nstate, h, dk, dv))
  checks.check_log_decay("g", g)
  for name, x in (("q", q), ("k", k), ("v", v), ("initial_state", initial_state)):
    checks.check_finite(name, x)
  dtype = checks.compute_dtype(q, k, v, g, initial_state)
  h0 = (jnp.zeros((nstate, h, dk, dv), dtype) if initial_state is None
        else initial_state.astype(dtype))
  # Nothing to compute, every state stays as it was. Returned here, before the paths'
  # reshapes (which cannot infer a -1 axis of an empty array) and the Pallas grids.
  if 0 in (b, t, h, dk, dv):
    return jnp.zeros((b, t, h, dv), v.dtype), (h0 if output_final_state else None)
  scale = dk ** -0.5 if scale is None else scale
  qkv_dtype = impl_lib.storage_dtype(plan.core, (q.dtype, k.dtype, v.dtype), dtype)
  return _gla(q, k, v, g, scale, h0, cu_seqlens, plan=plan, chunk_size=chunk_size,
              dtype=dtype, qkv_dtype=qkv_dtype, output_final_state=output_final_state)


# One compiled program per configuration: called eagerly (a notebook, a test), `gla`
# runs as one executable instead of dispatching each of its many small ops. On CPU, at
# B = 2, T = 64, the first eager call took 4.5 s that way against 0.3 s, later ones 100x
# longer. Under an outer jit it is inlined. The plan is static: its Pallas block sizes
# and interpret flag key this cache like any other argument.
@functools.partial(jax.jit, static_argnames=("plan", "chunk_size", "dtype", "qkv_dtype",
                                             "output_final_state"))
def _gla(q, k, v, g, scale, h0, cu_seqlens, *, plan, chunk_size, dtype, qkv_dtype,
         output_final_state):
  """gla's computation on checked inputs (see `gla`), h0 already in `dtype`."""
  b, h = q.shape[0], q.shape[2]
  out_dtype = v.dtype
  q = (q.astype(dtype) * scale).astype(qkv_dtype)
  k, v, g = k.astype(qkv_dtype), v.astype(qkv_dtype), g.astype(dtype)

  def run(q, k, v, g, h0):
    match plan.algorithm:
      case Algorithm.SCAN:
        return reference.gla_scan(q, k, v, g, h0, cu_seqlens)
      case Algorithm.CHUNK:
        return chunked_gla(q, k, v, g, h0, cu_seqlens, chunk_size,
                           impl_lib.core_fn(plan.core, qkv_dtype),
                           impl_lib.row_mover(plan.core))
      case other:
        raise ValueError(f"gla has no algorithm {other!r}")

  run = impl_lib.keep_kernel_residuals(run, plan.core)
  # With cu_seqlens (B == 1) only the heads can be sharded: shard_axes finds no batch
  # axis that divides 1, and each device runs its heads over the whole packed T.
  axes = sharding.shard_axes(b, h)
  if axes is None:
    o, final = run(q, k, v, g, h0)
  else:  # one shard of the batch and heads per device: see `sharding`
    act, state = sharding.spec(axes, 4, head_dim=2), sharding.spec(axes, 4, head_dim=1)
    o, final = sharding.per_shard(run, (q, k, v, g, h0), (act,) * 4 + (state,),
                                  (act, state))
  return o.astype(out_dtype), (final.astype(dtype) if output_final_state else None)
