"""The gated delta rule (Gated DeltaNet): `gdn(q, k, v, g, beta)` (design.md, section 7).

One head, row vectors, the state S in R^{Dk x Dv}; one log decay g_t <= 0 and one write
strength beta_t per head and token:

    S'_t = exp(g_t) S_{t-1}
    S_t  = S'_t + beta_t k_t^T (v_t - k_t S'_t)
    o_t  = scale q_t S_t

i.e. S_t = exp(g_t) (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t. The op does not
normalise q or k (the layer does): with unit keys and beta in [0, 2] the transition's
eigenvalues lie in [-1, 1].

Chunkwise-parallel form (the WY / UT representation). In a chunk of C tokens let
G_t = sum_{u <= t} g_u (from the chunk start), S the state at the chunk start and
u_t = beta_t (v_t - k_t S'_t) the value the delta rule actually writes at t. Then

    S'_t = exp(G_t) S + sum_{s < t} exp(G_t - G_s) k_s^T u_s,    S_t = S'_t + k_t^T u_t,

so the rows u_t solve one unit lower-triangular system per chunk,

    (I + A) u = diag(beta) V - diag(beta exp G) K S,
    A_ts = beta_t exp(G_t - G_s) k_t . k_s  for s < t (A is strictly lower-triangular),

and with U = (I + A)^-1 diag(beta) V, W = (I + A)^-1 diag(beta exp G) K (independent of S,
batched over all chunks): u = U - W S. The chunk's output and next state are

    o_t    = exp(G_t) q_t S + sum_{s <= t} exp(G_t - G_s) (q_t . k_s) u_s
    S_next = exp(G_C) S + sum_s exp(G_C - G_s) k_s^T u_s.

A `lax.scan` over chunks carries S (u = U - W S and S_next: two matmuls per chunk);
the rest is batched over chunks. The decay is a scalar per head, so exp(G_t - G_s) is a
[C, C] matrix whose exponents are all <= 0 where it is used (s <= t): nothing overflows
and, unlike the GLA core's per-channel decays, no sub-chunk anchoring is needed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import chunk_gdn as kernels
from sse_jax.ops import checks
from sse_jax.ops import chunked
from sse_jax.ops import impl as impl_lib
from sse_jax.ops import packing
from sse_jax.ops import reference
from sse_jax.ops import sharding
from sse_jax.ops.impl import Algorithm

DEFAULT_CHUNK = 64
# The impl strings gdn takes (`impl_lib.GDN_IMPLS`): "scan", "chunk", "pallas_chunk",
# "auto"; a typed `impl_lib.Plan` of algorithm SCAN or CHUNK is taken too.
GDN_IMPLS = tuple(i.value for i in impl_lib.GDN_IMPLS)


def core_fn(core, qkv_dtype):
  """The delta-rule chunk core (contract: `chunk_gdn`) of a plan's core: the XLA form
  below, or the Pallas kernels (`pallas_kernels.chunk_gdn`) with their static
  parameters bound."""
  match core:
    case impl_lib.XlaCore():
      return chunk_gdn
    case impl_lib.PallasCore(block_sizes=block_sizes, interpret=interpret):
      return impl_lib.pallas_chunk_core(kernels.chunk_gdn, kernels.chunk_gdn_slots,
                                        block_sizes, interpret, qkv_dtype)
    case _:
      raise ValueError(f"unknown chunk core {core!r}")


def storage_dtype(core, input_dtypes, compute_dtype) -> jnp.dtype:
  """dtype of q, k, v inside the chunked path: `impl_lib.storage_dtype`, except that
  float64 runs the Pallas kernels in float64 (interpret mode: the tests compare them with
  the scan to float64 precision)."""
  if isinstance(core, impl_lib.PallasCore) and jnp.dtype(compute_dtype) == jnp.float64:
    return jnp.dtype(jnp.float64)
  return impl_lib.storage_dtype(core, input_dtypes, compute_dtype)


def check_chunk_size(chunk_size) -> int:
  if (not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, bool)
      or chunk_size < 1):
    raise ValueError(f"chunk_size={chunk_size!r} must be a positive int")
  return int(chunk_size)


def check_inputs(q, k, v, g, beta, *, step: bool = False, prefix: str = ""):
  """Shapes of the delta-rule inputs: q, k [*lead, Dk], v [*lead, Dv], g, beta [*lead],
  with lead = [B, T, H] (or [B, H] for one decoding step). Returns lead + (Dk, Dv).

  prefix names a second set of inputs (the shared partition's "shared q'", ...); v is
  always the routed partitions' v.
  """
  rank, lead_axes = (3, "[B, H]") if step else (4, "[B, T, H]")
  axes = lead_axes[:-1] + ", D]" + (" (one token)" if step else "")
  name = lambda x: f"{prefix}{x}" + ("'" if prefix else "")
  for n, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != rank:
      raise ValueError(f"{name(n)} must have rank {rank} {axes}, got shape"
                       f" {tuple(x.shape)}")
    checks.check_floating(name(n), x)
  if q.shape != k.shape:
    raise ValueError(f"{name('q')} and {name('k')} must have the same shape, got"
                     f" {tuple(q.shape)} and {tuple(k.shape)}")
  lead = tuple(k.shape[:-1])
  if tuple(v.shape[:-1]) != lead:
    raise ValueError(f"v must share {lead_axes} with k {lead}, got v {tuple(v.shape)}")
  for n, x in (("g", g), ("beta", beta)):
    if x.ndim != rank - 1 or tuple(x.shape) != lead:
      raise ValueError(f"{name(n)} must have shape {lead_axes} = {lead} (one value per"
                       f" head{'' if step else ' and token'}), got {tuple(x.shape)}")
    checks.check_floating(name(n), x)
  return lead + (k.shape[-1], v.shape[-1])


def check_gates(g, beta, prefix: str = "") -> None:
  """g <= 0 (-inf resets) and beta in [0, 2]: raised on concrete values, recorded for
  `checks.checked` on traced ones."""
  name = lambda x: f"{prefix}{x}" + ("'" if prefix else "")
  checks.check_log_decay(name("g"), g)
  checks.require(lambda b: (b >= 0) & (b <= 2), name("beta"), beta,
                 "in [0, 2] (a write strength; above 1 gives negative eigenvalues)")


def delta_rule_step(state, k, v, g, beta):
  """One gated delta-rule update on any (broadcast) leading axes.

  state [..., Dk, Dv]; k [..., Dk]; v [..., Dv]; g, beta [...]. Returns
  S' + beta k^T (v - k S') with S' = exp(g) state.
  """
  decayed = jnp.exp(g)[..., None, None] * state
  recalled = jnp.sum(k[..., :, None] * decayed, axis=-2)
  written = beta[..., None] * (v - recalled)
  return decayed + k[..., :, None] * written[..., None, :]


def gdn_scan(q, k, v, g, beta, h0, cu_seqlens=None):
  """The reference: one delta-rule step per `lax.scan` iteration.

  q (scaled), k [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H]; h0 [B | S, H, Dk, Dv].
  Returns o [B, T, H, Dv] and the final states (shaped like h0).
  """

  def step(state, x):
    qt, kt, vt, gt, bt = x
    state = delta_rule_step(state, kt, vt, gt, bt)
    return state, jnp.einsum("bhk,bhkv->bhv", qt, state)

  xs = tuple(jnp.swapaxes(a, 0, 1) for a in (q, k, v, g, beta))
  ys, final = reference.recurrent_scan(step, xs, h0, cu_seqlens, q.shape[1])
  return jnp.swapaxes(ys, 0, 1), final


def _substitute(a, b, reverse: bool):
  """X with X_i = b_i - sum_j a_ij X_j, row by row (from the first row, or from the last
  with reverse): the solve of (I + a) X = b for a strictly lower (upper with reverse)
  triangular [..., C, C] a, b [..., C, D]. Rows not yet solved still hold b, and a's
  zero triangle keeps them out of each row's sum."""
  c = a.shape[-1]

  def row(step, x):
    i = c - 1 - step if reverse else step
    a_i = jax.lax.dynamic_index_in_dim(a, i, axis=-2, keepdims=True)      # [..., 1, C]
    b_i = jax.lax.dynamic_index_in_dim(b, i, axis=-2, keepdims=True)
    return jax.lax.dynamic_update_index_in_dim(x, b_i - a_i @ x, i, axis=-2)

  return jax.lax.fori_loop(0, c, row, b)


@jax.custom_vjp
def unit_lower_solve(a, b):
  """(I + a)^-1 b for a strictly lower triangular a [..., C, C] and b [..., C, D] (the
  WY / UT system of the chunked delta rule), by forward substitution.

  Not `jax.scipy.linalg.solve_triangular`: on the CPU its gradient, LAPACK's batched
  trsm at training batch sizes, was seen to deadlock jax's thread pool. The gradient
  here is one backward substitution and a matmul, with nothing saved per row:
  db = (I + a)^-T dx, da = -tril(db x^T, -1).
  """
  return _substitute(a, b, reverse=False)


def _unit_lower_solve_fwd(a, b):
  x = _substitute(a, b, reverse=False)
  return x, (a, x)


def _unit_lower_solve_bwd(res, dx):
  a, x = res
  db = _substitute(jnp.swapaxes(a, -1, -2), dx, reverse=True)
  c = a.shape[-1]
  strictly_lower = jnp.arange(c)[:, None] > jnp.arange(c)[None, :]
  da = jnp.where(strictly_lower, -(db @ jnp.swapaxes(x, -1, -2)), 0.0).astype(a.dtype)
  return da, db


unit_lower_solve.defvjp(_unit_lower_solve_fwd, _unit_lower_solve_bwd)


def chunk_gdn(q, k, v, g, beta, h0, seg_start, seg_chunks):
  """The chunked gated delta rule over pre-chunked inputs organised in segments.

  The contract of the GLA chunk cores (`chunked.chunk_gla`) with one decay and one write
  strength per head: q (scaled), k [B, NC, C, H, Dk]; v [B, NC, C, H, Dv]; g, beta
  [B, NC, C, H]; h0 [Z, H, Dk, Dv] per segment; segment z occupies the flattened chunks
  [seg_start[z], seg_start[z] + seg_chunks[z]). A row with g = beta = 0 is an identity
  (padding). Returns o [B, NC, C, H, Dv] (zero outside every segment) and the segments'
  final states [Z, H, Dk, Dv] (an empty segment keeps its h0).
  """
  b, nc, c = q.shape[:3]
  dv = v.shape[-1]
  reset, h0_index = chunked.segment_starts(seg_start, seg_chunks, b * nc)
  h0_table = jnp.concatenate([h0, jnp.zeros((1,) + h0.shape[1:], h0.dtype)])

  # Head-major inside a chunk: [B, NC, H, C, ...].
  q, k, v = (jnp.moveaxis(x, 3, 2) for x in (q, k, v))
  g, beta = (jnp.moveaxis(x, 3, 2) for x in (g, beta))
  gcum = chunked.in_chunk_cumsum(chunked.floor_log_decay(g), axis=-1)   # G_t
  pos = jnp.arange(c)
  causal = pos[:, None] >= pos[None, :]
  diff = gcum[..., :, None] - gcum[..., None, :]                        # G_t - G_s
  decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
  a = jnp.where(pos[:, None] > pos[None, :],
                beta[..., :, None] * decay * jnp.einsum("...td,...sd->...ts", k, k), 0.0)
  rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(gcum))[..., None] * k], -1)
  uw = unit_lower_solve(a, rhs)
  u_free, w = uw[..., :dv], uw[..., dv:]                                # U, W
  g_last = gcum[..., -1]                                                # [B, NC, H]
  k_end = k * jnp.exp(g_last[..., None] - gcum)[..., None]             # exp(G_C - G_s) k_s
  chunk_decay = jnp.exp(g_last)

  def step(h, x):
    dec, ke, u0, wc, rst, idx = x
    h = jnp.where(rst[:, None, None, None], h0_table[idx], h)
    u = u0 - jnp.einsum("bhck,bhkv->bhcv", wc, h)
    return dec[..., None, None] * h + jnp.einsum("bhck,bhcv->bhkv", ke, u), (h, u)

  time_major = lambda x: jnp.swapaxes(x, 0, 1)
  xs = tuple(map(time_major, (chunk_decay, k_end, u_free, w, reset.reshape(b, nc),
                              h0_index.reshape(b, nc))))
  h_init = jnp.zeros((b,) + h0.shape[1:], h0.dtype)
  _, (h_start, u) = jax.lax.scan(step, h_init, xs)
  h_start, u = time_major(h_start), time_major(u)

  # A segment's final state: the update of its last chunk, for those chunks only.
  last = jnp.clip(seg_start + seg_chunks - 1, 0, b * nc - 1)
  at_last = lambda x: x.reshape((b * nc,) + x.shape[2:])[last]
  h_end = (at_last(chunk_decay)[..., None, None] * at_last(h_start)
           + jnp.einsum("zhck,zhcv->zhkv", at_last(k_end), at_last(u)))
  final = jnp.where((seg_chunks > 0)[:, None, None, None], h_end, h0)

  scores = decay * jnp.einsum("...td,...sd->...ts", q, k)
  o = (jnp.exp(gcum)[..., None] * jnp.einsum("bnhck,bnhkv->bnhcv", q, h_start)
       + jnp.einsum("bnhts,bnhsv->bnhtv", scores, u))
  covered = chunked.covered_chunks(seg_start, seg_chunks, b * nc).reshape(b, nc, 1, 1, 1)
  return jnp.where(covered, jnp.moveaxis(o, 2, 3), 0.0), final


def packed_chunk_gdn(rows, slot_segment, h0, chunk_size: int, presorted: bool = False,
                     sorted_tail: int = 0, core=chunk_gdn,
                     move: packing.RowMover = packing.take_rows,
                     valid: jax.Array | None = None):
  """`chunk_gdn` (or another chunk core) over slots grouped into segments (see
  `packing`).

  rows: (q, k, v, g, beta), each [P, ...] (P slots, in time order within each segment),
  or each a tuple of parts (`packing.Parts`, the same part lengths for all five), packed
  without concatenating them; slot_segment int [P]; h0 [Z, H, Dk, Dv]; presorted,
  sorted_tail as in `packing.chunk_layout`; move: the row mover; valid: None or bool
  [P], slots that are not valid become zero rows, as in `gla.packed_chunked`. Padding
  rows are zero: identities. Returns o [P, H, Dv] (parts of the same lengths for parts)
  and the final state of every segment [Z, H, Dk, Dv].
  """
  q, k, v, g, beta = (packing.as_parts(x) for x in rows)
  sizes = packing.part_sizes(q=q, k=k, v=v, g=g, beta=beta)
  # g floored before the packing, as in `gla.packed_chunked` (and why).
  rows = (q, k, v, tuple(chunked.floor_log_decay(x) for x in g), beta)
  num_chunks = packing.max_chunks(slot_segment.shape[0], h0.shape[0], chunk_size)
  layout = packing.chunk_layout(slot_segment, h0.shape[0], chunk_size, presorted,
                                sorted_tail)
  places = packing.drop_invalid(layout.rows, valid, num_chunks * chunk_size)
  in_place = getattr(core, "slots", None)
  if in_place is not None:  # the kernels read the slots through the row table
    covered = None if valid is None else packing.split_slots(valid, sizes)
    o, final = in_place(*rows, packing.slot_of_row(places, num_chunks * chunk_size), h0,
                        layout.seg_start, layout.seg_chunks, covered=covered)
    return (o[0] if len(sizes) == 1 else o), final
  buffers = [packing.scatter_rows(x, places, num_chunks * chunk_size, move).reshape(
      (1, num_chunks, chunk_size) + x[0].shape[1:]) for x in rows]
  o, final = core(*buffers, h0, layout.seg_start, layout.seg_chunks)
  o = o.reshape((num_chunks * chunk_size,) + o.shape[3:])
  o = packing.gather_rows(o, places, move, sizes=sizes)
  return (o[0] if len(sizes) == 1 else o), final


def chunked_gdn(q, k, v, g, beta, h0, cu_seqlens, chunk_size: int, core=chunk_gdn,
                move: packing.RowMover = packing.take_rows):
  """The chunked form on [B, T, ...] inputs (q scaled; q, k, v in the core's storage
  dtype, the rest in the compute dtype): equal-length rows of the batch, or B == 1 row
  of packed sequences. core: a chunk core (`core_fn`), the XLA `chunk_gdn` by default;
  move: the packed path's row mover."""
  b, t = q.shape[:2]
  if cu_seqlens is not None:
    seq, _ = reference.sequence_ids(cu_seqlens, t)
    # Sequence ids never decrease along T: the slots are already in segment order.
    o, final = packed_chunk_gdn(tuple(x[0] for x in (q, k, v, g, beta)), seq, h0,
                                chunk_size, presorted=True, core=core, move=move)
    return o[None], final
  nc = -(-t // chunk_size)

  def chunks(x):  # zero rows up to a whole number of chunks: identities
    x = jnp.pad(x, [(0, 0), (0, nc * chunk_size - t)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape((b, nc, chunk_size) + x.shape[2:])

  g = chunked.floor_log_decay(g)
  o, final = core(*map(chunks, (q, k, v, g, beta)), h0,
                  jnp.arange(b, dtype=jnp.int32) * nc, jnp.full((b,), nc, jnp.int32))
  return o.reshape((b, nc * chunk_size) + o.shape[3:])[:, :t], final


def gdn(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, impl="chunk", chunk_size: int = DEFAULT_CHUNK):
  """The gated delta rule (module docstring; design.md, section 7).

  Args:
    q, k: [B, T, H, Dk]; v: [B, T, H, Dv]. Not normalised here (the layer L2-normalises
      q and k).
    g: [B, T, H], the log decay, g <= 0; -inf is a hard reset (the state before is
      forgotten), exact in every impl. g > 0 or NaN raises a ValueError on concrete
      values; under `jit` it is the caller's contract (`checked` checks it).
    beta: [B, T, H], the write strength in [0, 2] (checked like g).
    scale: multiplies q; defaults to Dk ** -0.5.
    initial_state: [B, H, Dk, Dv], or [S, H, Dk, Dv] with `cu_seqlens`.
    output_final_state: also return the final state(s).
    cu_seqlens: int32 [S + 1] boundaries of S sequences packed along T (needs B == 1);
      starts at 0, never decreases, ends at T (checked on concrete values; under `jit`
      the caller's contract, checked by `checked`).
    impl: "chunk" (default; chunkwise-parallel WY form in XLA), "pallas_chunk" (the
      same form as Pallas kernels, `pallas_kernels.chunk_gdn`; interpret mode off the
      GPU), "auto" (Pallas on a supported GPU, else "chunk") or "scan" (reference); or
      an `impl.Plan` of algorithm SCAN or CHUNK (Pallas block sizes, interpret mode).
    chunk_size: C, a positive int (16, 32 or 64 for the Pallas kernels:
      `chunk_gdn.shape_error`).
  Returns:
    (o [B, T, H, Dv] in v's dtype, final_state or None). States are float32, or float64
    when an input is float64. Empty inputs (B, T, H, Dk or Dv = 0) give zeros and the
    initial state as the final state.
  """
  q, k, v, g, beta, cu_seqlens, initial_state = (checks.as_array(n, x) for n, x in (
      ("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("cu_seqlens", cu_seqlens),
      ("initial_state", initial_state)))
  b, t, h, dk, dv = check_inputs(q, k, v, g, beta)
  chunk_size = check_chunk_size(chunk_size)
  plan, chunk_size = impl_lib.plan(impl, "gdn", chunk_size=chunk_size, head_dims=(dk, dv))
  checks.check_scale(scale)
  nseq = checks.check_cu_seqlens(cu_seqlens, b, t)
  nstate = b if nseq is None else nseq
  checks.check_state("initial_state", initial_state, (nstate, h, dk, dv))
  check_gates(g, beta)
  for name, x in (("q", q), ("k", k), ("v", v), ("initial_state", initial_state)):
    checks.check_finite(name, x)
  dtype = checks.compute_dtype(q, k, v, g, beta, initial_state)
  h0 = (jnp.zeros((nstate, h, dk, dv), dtype) if initial_state is None
        else initial_state.astype(dtype))
  if 0 in (b, t, h, dk, dv):  # nothing to compute (and no -1 axis to infer below)
    return jnp.zeros((b, t, h, dv), v.dtype), (h0 if output_final_state else None)
  scale = dk ** -0.5 if scale is None else scale
  qkv_dtype = storage_dtype(plan.core, (q.dtype, k.dtype, v.dtype), dtype)
  return _gdn(q, k, v, g, beta, scale, h0, cu_seqlens, plan=plan, chunk_size=chunk_size,
              dtype=dtype, qkv_dtype=qkv_dtype, output_final_state=output_final_state)


# One compiled program per configuration (as `gla`'s): eager calls run one executable.
@functools.partial(jax.jit, static_argnames=("plan", "chunk_size", "dtype", "qkv_dtype",
                                             "output_final_state"))
def _gdn(q, k, v, g, beta, scale, h0, cu_seqlens, *, plan, chunk_size, dtype, qkv_dtype,
         output_final_state):
  """gdn's computation on checked inputs, h0 already in `dtype`; q, k, v in
  `qkv_dtype` (the chunk core's storage dtype)."""
  b, h = q.shape[0], q.shape[2]
  out_dtype = v.dtype
  q = (q.astype(dtype) * scale).astype(qkv_dtype)
  k, v = k.astype(qkv_dtype), v.astype(qkv_dtype)
  g, beta = g.astype(dtype), beta.astype(dtype)

  def run(q, k, v, g, beta, h0):
    match plan.algorithm:
      case Algorithm.SCAN:
        return gdn_scan(q, k, v, g, beta, h0, cu_seqlens)
      case Algorithm.CHUNK:
        return chunked_gdn(q, k, v, g, beta, h0, cu_seqlens, chunk_size,
                           core_fn(plan.core, qkv_dtype), impl_lib.row_mover(plan.core))
      case other:
        raise ValueError(f"gdn has no algorithm {other!r}")

  run = impl_lib.keep_kernel_residuals(run, plan.core)
  axes = sharding.shard_axes(b, h)  # a context mesh: one batch / head shard per device
  if axes is None:
    o, final = run(q, k, v, g, beta, h0)
  else:
    act, gate = sharding.spec(axes, 4, head_dim=2), sharding.spec(axes, 3, head_dim=2)
    state = sharding.spec(axes, 4, head_dim=1)
    o, final = sharding.per_shard(run, (q, k, v, g, beta, h0),
                                  (act, act, act, gate, gate, state), (act, state))
  return o.astype(out_dtype), (final.astype(dtype) if output_final_state else None)


def gdn_decode_step(q, k, v, g, beta, state, *, scale=None):
  """One gated delta-rule step: q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H];
  state [B, H, Dk, Dv]. g <= 0 and beta in [0, 2] as in `gdn`.

  Returns (o [B, H, Dv] in v's dtype, new state in the state's dtype). Continuing from
  `gdn(..., output_final_state=True)` reproduces the outputs of one full call.
  """
  q, k, v, g, beta, state = (checks.as_array(n, x) for n, x in (
      ("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)))
  b, h, dk, dv = check_inputs(q, k, v, g, beta, step=True)
  checks.check_state("state", state, (b, h, dk, dv))
  check_gates(g, beta)
  for name, x in (("q", q), ("k", k), ("v", v), ("state", state)):
    checks.check_finite(name, x)
  scale = dk ** -0.5 if scale is None else scale
  dt = state.dtype
  state = delta_rule_step(state, *(x.astype(dt) for x in (k, v, g, beta)))
  o = jnp.einsum("bhk,bhkv->bhv", q.astype(dt) * scale, state)
  return o.astype(v.dtype), state
