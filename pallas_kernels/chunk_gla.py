"""Chunkwise GLA forward and backward as Pallas (Triton) GPU kernels.

Inputs are whole chunks of C tokens grouped in *segments* (a sequence, or one
(sequence, partition) of an SSE layer), each starting from its own initial state; the
caller pads every segment to whole chunks, so no kernel ever sees a sequence boundary
inside a chunk. `chunk_gla` states the contract; `reference` computes the same thing
one token at a time, for the tests. Nothing here imports the package that calls it:
the dependency runs one way, from the ops to these kernels.

Per chunk, with b_t = sum_{u <= t} g_u (in-chunk cumulative log decay, b <= 0,
non-increasing), Gamma = b_{C-1} and H the state entering the chunk:

  o_t = (q_t e^{b_t}) H + sum_{s <= t} A_ts v_s,   A_ts = sum_d q_td k_sd e^{b_td - b_sd}
  H'  = e^{Gamma} H + sum_s (k_s e^{Gamma - b_s})^T v_s

The intra-chunk sums of q_t k_s e^{b_t - b_s} factor through an anchor a as
(q_t e^{b_t - a}) (k_s e^{a - b_s}); which anchor is safe depends on how steep the
gates are, so each program picks one of three levels at run time:
  1. whole chunk: if the chunk's decay span (b at row 0 minus b at any row, per
     feature) is at most BlockSizes.diag_matmul_span, one matmul anchored at row 0
     (factors up to e^span, finite), with operands split into bf16 hi + lo halves
     (_dot_split): db = q dq - k dk cancels the near-diagonal terms, which bf16
     rounding would not let cancel;
  2. per 16-row sub-block i (L rows), anchored at its first row a_i: every earlier
     key block has both factors <= 1 and is one matmul; the diagonal block too (one
     fp32 matmul) if the sub-block's own span is within the limit;
  3. otherwise the diagonal block one key / query row at a time ([L, Dk] elementwise
     steps), the exponent masked to s <= t before the exponential, so never above 0.
Steep gates anywhere therefore stay exact; GLA-style gates take level 1.

Kernels (grid; what each program does):
  _scores_kernel  (NC, H)         b = cumsum(g) over the chunk's rows and the
                                   intra-chunk matrix A [C, C] (fp32), both kept for
                                   the backward pass.
  _states_kernel  (nK', nV', H, Z) walk a segment's chunks (backward: in reverse) with
                                   S = diag(e^Gamma) S + (k e^{Gamma - b})^T v -- or,
                                   backward, + (q e^b)^T do -- each chunk's own term
                                   computed on the way: the state entering each chunk
                                   and the final state (backward: dH' of every chunk
                                   and dh0). Only this walk is sequential; the next
                                   chunk's loads are issued one step ahead (_walk), the
                                   longest segments are launched first, and its tiles
                                   follow the grid's size (_fused_walk_tiles).
  With BlockSizes.fused_states=False, the same in two kernels:
  _local_kernel   (NC, H, nK, nV) each chunk's own term, all chunks in parallel;
  _sweep_kernel   (nK', nV', H, Z) the walk, a multiply-add per chunk.
  _output_kernel  (NC, H, nV)     o = (q e^b) H + A v, for one chunk.
  _dv_kernel      (NC, H, nV)     dv = A^T do + (k e^{Gamma - b}) dH'.
  _dqk_kernel     (NC, H, nK, C/L) dq, dk and db (gradient w.r.t. the cumulative gates)
                                   of sub-block i, from dA = tril(do v^T) (one batched
                                   XLA matmul) and the chunk's states.
  With BlockSizes.split_dqk, _dqk_kernel's work in two kernels:
  _dqk_inter_kernel (NC, H, nK)   the inter-chunk terms of dq and dk, [C, Dv] x [Dv, BK]
                                   matmuls with the states loaded once, and dGamma.
  _dqk_intra_kernel (NC, H, nK)   adds the intra-chunk terms in place, its tiles of dA
                                   computed from do and v on the way
                                   (BlockSizes.intra_scores), and writes dg.
                                   With BlockSizes.inter_in_intra it computes the
                                   inter terms itself (no inter kernel, no fp32
                                   buffers between the two) and writes dq and dk in
                                   their own dtype.
The custom_vjp takes the gates g themselves: b is summed in the scores kernel, and the
intra kernel turns db into dg_u = sum_{t >= u} db_t (dGamma included), so neither b's
sums nor their transpose, nor dA, are XLA ops between the kernels (with the fused
_dqk_kernel, XLA still computes dA and dg).

Gradient bookkeeping (per chunk; dq, dk are w.r.t. the scaled q and k):
  dH  = e^{Gamma} dH' + sum_t (q_t e^{b_t})^T do_t
  dA_ts = do_t . v_s  (s <= t)
  dq_t = e^{b_t} (do_t H^T) + sum_{s <= t} dA_ts k_s e^{b_t - b_s}
  dk_s = e^{Gamma - b_s} (v_s dH'^T) + sum_{t >= s} dA_ts q_t e^{b_t - b_s}
  db_t = q_t dq_t - k_t dk_t + [t = C-1] dGamma,
  dGamma = e^{Gamma} sum_v (H dH') + sum_s k_s (v_s dH'^T) e^{Gamma - b_s}
The forward keeps the chunk states H for the backward (BlockSizes.recompute_states
trades that memory for one more sweep).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import slot_rows
from pallas_kernels.slot_rows import Slots

SUB = 16  # L: rows of a sub-chunk.
# The name (`jax.ad_checkpoint.checkpoint_name`) of the residuals that the custom_vjp
# cores keep from their forward kernels (scores, in-chunk gate sums, chunk states): a
# `jax.checkpoint` policy that saves only these recomputes everything else the backward
# pass needs, e.g. the packed copies of q, k, v that a caller built (sse_jax's
# `impl.keep_kernel_residuals`).
RESIDUAL_NAME = "pallas_kernel_residual"
HEAD_DIMS = (16, 32, 64, 128, 256)  # the head dims Dk, Dv the kernels support
CHUNKS = (16, 32, 64, 128)  # the chunk lengths they support


def shape_error(chunk: int | None, dk: int, dv: int) -> str | None:
  """Why the kernels cannot take chunk length `chunk` (None: not checked) and head dims
  (dk, dv), in one line naming the value; None when they can. The one place these
  limits are checked."""
  if chunk is not None and chunk not in CHUNKS:
    return f"chunk_size={chunk!r}: the Pallas kernels take chunk sizes {CHUNKS}"
  for name, d in (("Dk", dk), ("Dv", dv)):
    if d not in HEAD_DIMS:
      return f"{name}={d!r}: the Pallas kernels support head dims {HEAD_DIMS}"
  return None


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and launch parameters; frozen (hashable) so it can be a static argument.

  chunk: C, tokens per chunk. block_k / block_v: columns of Dk / Dv per program in the
  chunk-parallel kernels (Dk in the dq/dk kernel, Dv in the output / dv kernels, both
  in the local-state kernel). sweep_k / sweep_v: the state tile each program of the
  sequential sweep walks: smaller tiles, more programs in flight on the one part
  of the op whose depth grows with L. recompute_states: recompute the chunk states in
  the backward pass instead of keeping them ([NC, H, Dk, Dv] fp32, the largest
  residual) -- less memory, one more sweep. diag_unroll: rows of a diagonal sub-block
  handled per loop iteration in the scores and dq/dk kernels (the loop is a chain of
  small dependent steps; unrolling gives the scheduler independent work). split_dqk:
  compute dq / dk in two kernels, the inter-chunk terms per (chunk, Dk block) as
  [C, Dv] x [Dv, BK] matmuls that read the states once, then the intra-chunk terms
  per chunk; instead of one kernel per sub-block that reads the [BK, Dv] states
  C / L times and multiplies 16-row tiles. diag_matmul_span: the largest decay span
  (nats of b, per feature) over which a chunk, or else a sub-block, is multiplied in
  one anchored matmul, with factors up to e^span (finite in fp32 / bf16 up to ~88);
  steeper sub-blocks, or all with 0, go row by row, with exponents <= 0 (module
  docstring: the three levels). fused_states: the state recurrence as one walk that
  computes each chunk's own term on the way (else a parallel local-term kernel and a
  sweep). walk_programs: the fused walk uses the sweep tiles while its grid at those
  tiles has at most this many programs, else the block tiles. low_precision_states:
  keep the per-chunk states in bf16 when the matmul operands are bf16. intra_scores:
  the split backward's intra kernel computes its tiles of dA = tril(do v^T) from do
  and v itself, instead of reading them from one batched XLA matmul. prefetch: the
  walks (fused or sweep) load the next chunk's inputs one step ahead in registers
  (`_walk`), else leave the loads in the step to Triton's pipelining. inter_in_intra:
  the split backward as one kernel: the intra kernel computes the inter-chunk terms of
  dq and dk itself (two more [C, Dv] x [Dv, BK] matmuls, from do, v and the chunk's
  states), instead of a first kernel writing them to fp32 buffers that the second reads
  back; a refinement of split_dqk, where its tiles fit (_fits_inter_in_intra).
  gather_rows: for callers that pack slots into chunk-aligned buffers (sse_jax's packed
  paths), read the slots in place instead (`chunk_gla_slots`, `slot_rows`): the kernels
  gather each chunk's rows through the buffer's row table and scatter their per-row
  results back, so no copy of q, k, v, g (and do) goes in and none of o (dq, dk, dv,
  dg) comes out.
  """

  chunk: int = 64
  block_k: int = 64
  block_v: int = 64
  sweep_k: int = 32
  sweep_v: int = 32
  num_warps: int = 4
  num_stages: int = 2
  recompute_states: bool = False
  # H200, L = 32K, fwd + bwd of the kernel core: 6.71 ms with diag_unroll=1 and the
  # fused dq/dk kernel, 5.27 ms with these two (experiments.profile_kernels).
  diag_unroll: int = 4
  split_dqk: bool = True
  diag_matmul_span: float = 40.0
  fused_states: bool = True
  # H200, L = 32K (profile_kernels --walk_partitions): the fused walk with 32 x 32
  # tiles is best for dense GLA (256 programs), with 64 x 64 tiles for SSE varlen and
  # masking (1280 or more programs at 32 x 32).
  walk_programs: int = 512
  # bf16 per-chunk states for bf16 inputs: every matmul that reads them rounds them to
  # bf16 anyway; at L = 1024 the bf16 errors against the fp32 scan moved by < 1e-5.
  low_precision_states: bool = True
  intra_scores: bool = True
  # L = 32K, the dense core's fwd + bwd: on an H200 3.36 ms with it, 3.03 without
  # (results/bench_ops/gla_walk_prefetch_h200.log), on an H100 3.15 with it, 3.23
  # without (results/bench_ops/gla_kernels_h100.log); the GDN walks, with [C, Dk] tiles,
  # ran 2-5x faster without it. Kept on until the SSE walks (64 x 64 tiles) are timed
  # without it too.
  prefetch: bool = True
  # H100, L = 32K, fwd + bwd (experiments.bench_ops, one session): dense GLA 4.96 ->
  # 4.89 ms, SSE varlen N = 4 9.16 -> 8.07 ms; the 125M SSE model's training step at
  # T = 32K 166.7 -> 159.5 ms (results/bench_ops/inter_in_intra_h100).
  inter_in_intra: bool = True
  # Off: on an H100 at L = 32K (results/bench_ops/in_place_h100) GLA with cu_seqlens
  # 4.65 -> 3.91 ms, but SSE varlen (routed and shared slots, two parts) 8.27 -> 9.12 ms
  # and the SSE model's step 161.4 -> 166.9 ms.
  gather_rows: bool = False

  def __post_init__(self):
    if self.chunk not in CHUNKS:
      raise ValueError(f"chunk={self.chunk} must be one of {CHUNKS}")
    for name in ("block_k", "block_v", "sweep_k", "sweep_v"):
      value = getattr(self, name)
      if value not in HEAD_DIMS:
        raise ValueError(f"{name}={value} must be one of {HEAD_DIMS}")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps={self.num_warps} must be a power of 2 <= 16")
    if self.diag_unroll not in (1, 2, 4, 8, 16):
      raise ValueError(f"diag_unroll={self.diag_unroll} must divide {SUB}: 1, 2, 4, 8 or 16")
    if not 0.0 <= self.diag_matmul_span <= 60.0:
      raise ValueError(f"diag_matmul_span={self.diag_matmul_span} must be in [0, 60]: "
                       "e^span scales k rows inside the matmul (fp32 / bf16 overflow at ~88)")
    if self.walk_programs < 1:
      raise ValueError(f"walk_programs={self.walk_programs} must be >= 1")
    if self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages} must be >= 1")

  def tiles(self, dk: int, dv: int) -> tuple[int, int]:
    """(block_k, block_v) clipped to the head dims, which are checked here."""
    error = shape_error(self.chunk, dk, dv)
    if error:
      raise ValueError(error)
    return min(self.block_k, dk), min(self.block_v, dv)

  def sweep_tiles(self, dk: int, dv: int) -> tuple[int, int]:
    self.tiles(dk, dv)
    return min(self.sweep_k, dk), min(self.sweep_v, dv)


# ----------------------------------------------------------------------------------
# In-kernel chunk math, shared by the kernels below.


def _dot(a, b, contract, dtype):
  """a . b over the given contracting dims, operands in `dtype`, fp32 accumulate.

  fp32 operands use IEEE precision (Triton's default would be TF32).
  """
  prec = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT
  return lax.dot_general(a.astype(dtype), b.astype(dtype), (contract, ((), ())),
                         preferred_element_type=jnp.float32, precision=prec)


_NN = ((1,), (0,))  # a @ b
_NT = ((1,), (1,))  # a @ b^T
_TN = ((0,), (0,))  # a^T @ b


def _rows(ref, i, cols=None):
  """Sub-chunk i (L rows) of a [C, D] ref, as fp32."""
  if cols is None:
    return ref[pl.ds(i * SUB, SUB), :].astype(jnp.float32)
  return ref[pl.ds(i * SUB, SUB), cols].astype(jnp.float32)


def _row(ref, r):
  """Row r of a [C, D] ref as a [1, D] fp32 array."""
  return ref[pl.ds(r, 1), :].astype(jnp.float32)


def _row_of(x, r):
  """Row r of an [R, D] value as [1, D], exactly (a masked sum: Triton cannot slice)."""
  pos = lax.broadcasted_iota(jnp.int32, (x.shape[0], 1), 0)
  return jnp.sum(jnp.where(pos == r, x, 0.0), axis=0, keepdims=True)


def _iota(axis, cols=SUB):
  """Row (axis 0) or column (axis 1) indices of an [L, cols] block."""
  return lax.broadcasted_iota(jnp.int32, (SUB, cols), axis)


def _row_loop(body, carry, unroll):
  """carry = body(s, carry) for the SUB rows s of a sub-block, `unroll` per iteration
  (written out by hand: the Triton lowering has no fori_loop unroll)."""
  def step(it, carry):
    for r in range(unroll):
      carry = body(it * unroll + r, carry)
    return carry
  return lax.fori_loop(0, SUB // unroll, step, carry)


def _masked_exp(x, mask):
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def _within_span(x, span):
  """True when every exponent in x is <= span: the block may use one anchored matmul."""
  return jnp.max(x) <= span


def _dot_split(a, b, contract, dtype):
  """a . b for fp32 a, b to about 16 mantissa bits, on bf16 tensor cores.

  Each operand is split as hi + lo (two bf16 parts) and three products are summed
  (lo . lo, ~2^-16 relative, is dropped); IEEE fp32 for fp32 inputs. Used where the
  whole chunk goes through one matmul: its diagonal blocks must not be rounded to bf16,
  since db = q dq - k dk cancels their near-diagonal terms (bf16 operands there
  tripled dg's error).
  """
  if dtype == jnp.float32:
    return _dot(a, b, contract, jnp.float32)
  def split(x):
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)

  (ah, al), (bh, bl) = split(a), split(b)
  dot = lambda x, y: lax.dot_general(x, y, (contract, ((), ())),
                                     preferred_element_type=jnp.float32)
  return dot(ah, bh) + (dot(ah, bl) + dot(al, bh))


def _by_chunk_or_sub_block(gates, *, chunk, span, whole_chunk, whole, sub_block,
                           init=0, reverse=False):
  """whole(b_0, b) where the chunk's decay span b_0 - b is <= span everywhere (and
  whole_chunk, a static shared-memory verdict), else carry = sub_block(i, carry) for
  each sub-block i in turn (last to first with `reverse`), from `init`. gates(): the
  chunk's [1, D] first row b_0 and [C, D] fp32 gates b, used for the check and by
  whole."""
  ns = chunk // SUB

  def by_sub_block():
    lax.fori_loop(0, ns, lambda n, carry: sub_block(ns - 1 - n if reverse else n, carry),
                  init)

  if not whole_chunk:
    by_sub_block()
    return
  first, b = gates()
  mild = _within_span(first - b, span)
  pl.when(jnp.logical_not(mild))(by_sub_block)
  pl.when(mild)(lambda: whole(first, b))


def _value_rows(b):
  """rows(i): the [L, D] rows of sub-block i of a [C, D] fp32 value, exactly (Triton
  cannot slice a value), as a one-hot IEEE matmul: each sum has one nonzero term."""
  c = b.shape[0]

  def rows(i):
    onehot = (_iota(1, c) == i * SUB + _iota(0, c)).astype(jnp.float32)   # [L, C]
    return _dot(onehot, b, _NN, jnp.float32)
  return rows


def _suffix_sums(x):
  """y_t = sum_{u >= t} x_u along axis 0 of a [R, D] fp32 block (Triton's scan runs
  forwards only: the total less the exclusive prefix sum)."""
  return jnp.sum(x, axis=0, keepdims=True) - jnp.cumsum(x, axis=0) + x


def _scores_kernel(q_ref, k_ref, g_ref, a_ref, b_ref, *, chunk, dtype, unroll, span,
                   whole_chunk, barrier):
  """a_ref [C, C] (fp32): the intra-chunk matrix A of one (chunk, head), and b_ref
  [C, Dk] (fp32): the chunk's in-chunk cumulative gates b = cumsum(g), both kept for
  the other kernels.

  A_ts = sum_d q_td k_sd e^{b_td - b_sd} for s <= t, else 0. q, k, g: [C, Dk].
  Computed once per chunk and reused by the output kernel (A v) and the dv kernel
  (A^T do). Where the chunk's decay span is at most `span` (BlockSizes.
  diag_matmul_span), A is one matmul anchored at row 0,
  (q e^{b - b_0}) (k e^{b_0 - b})^T, with factors up to e^span; otherwise sub-block by
  sub-block (_score_rows), reading rows of b exactly (_value_rows, _row_of). whole_chunk=False
  (static: the chunk's operands would not fit in shared memory, see
  _fits_whole_chunk) always goes sub-block by sub-block, and reads b's rows back from
  b_ref instead: the one-hot matmul would stage all of b in shared memory beside the
  key operand (C = 128, Dk = 256, fp32: 272 KiB asked on the H200, over the limit).
  `barrier` (static; off in interpret mode, which runs one program's steps in order)
  makes the block's stores of b visible to all its threads before they are read.
  Summing b here (Triton's scan,
  forwards) saves a pass over g: XLA's triangular matmul for it ran at half the copy
  rate on the H200, and a kernel of its own at the copy rate.
  """
  b = jnp.cumsum(g_ref[...].astype(jnp.float32), axis=0)
  b_ref[...] = b
  if whole_chunk:
    rows = _value_rows(b)
  else:
    if barrier:
      plgpu.debug_barrier()
    rows = lambda i: _rows(b_ref, i)

  def whole(first, b):
    a = _dot_split(q_ref[...].astype(jnp.float32) * jnp.exp(b - first),
                   k_ref[...].astype(jnp.float32) * jnp.exp(first - b), _NT, dtype)
    pos = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    a_ref[...] = jnp.where(lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1) <= pos, a, 0.0)

  def sub_block(i, carry):
    _score_rows(q_ref, k_ref, b if whole_chunk else b_ref[...], rows, a_ref, i,
                chunk=chunk, dtype=dtype, unroll=unroll, span=span)
    return carry

  # b_0 = g_0: the scan's first element is g's (a one-row load, not a reduction).
  _by_chunk_or_sub_block(lambda: (_row(g_ref, 0), b), chunk=chunk, span=span,
                         whole_chunk=whole_chunk, whole=whole, sub_block=sub_block)


def _score_rows(q_ref, k_ref, b, b_rows, a_ref, i, *, chunk, dtype, unroll, span):
  """Rows of query sub-block i of A (see _scores_kernel), written to a_ref [C, C]; b:
  the chunk's gates [C, Dk], b_rows(j) its rows of sub-block j [L, Dk].

  Anchored at a = b at the first row of i, e^{b_t - b_s} = e^{b_t - a} e^{a - b_s}:
  both factors are <= 1 for key rows s before i. On the diagonal block e^{a - b_s}
  grows up to e^{a - b_last}; while that span is at most `span`, all earlier key
  blocks are one [L, Dk] x [Dk, C] matmul and the diagonal block one more, with fp32
  operands (as the row-by-row path computes it), over zeroed rows elsewhere. Steeper
  sub-blocks take the overflow-free path: one matmul per earlier key block and the
  diagonal one key row at a time.
  """
  r0 = i * SUB
  rows_i = pl.ds(r0, SUB)
  cols, row = _iota(1), _iota(0, 1)
  qi, bi = _rows(q_ref, i), b_rows(i)
  anchor = _row_of(bi, 0)
  q_t = qi * jnp.exp(bi - anchor)
  mild = _within_span(anchor - bi, span)

  @pl.when(mild)
  def _two_matmuls():
    key_row = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    before, after = key_row < r0, key_row >= r0 + SUB
    # Key rows after i are masked in the exponent (their factor could overflow) and
    # in the result (they are above the diagonal).
    k_t = k_ref[...].astype(jnp.float32) * jnp.exp(
        jnp.where(after, 0.0, anchor - b))
    # Key rows before i with `dtype` operands; those of i with fp32 operands, as the
    # row-by-row path has them. Both [L, C], so that the row block is one store: two
    # overlapping stores from one program could land in either order.
    a_before = _dot(q_t, jnp.where(before, k_t, 0.0), _NT, dtype)
    a_diag = _dot(q_t, jnp.where(before | after, 0.0, k_t), _NT, jnp.float32)
    key_col = _iota(1, chunk)
    a_ref[rows_i, :] = jnp.where(key_col < r0, a_before,
                                 jnp.where(key_col <= r0 + _iota(0, chunk), a_diag, 0.0))

  @pl.when(jnp.logical_not(mild))
  def _row_by_row():
    def off_diagonal(j, carry):
      k_t = _rows(k_ref, j) * jnp.exp(anchor - b_rows(j))
      a_ref[rows_i, pl.ds(j * SUB, SUB)] = _dot(q_t, k_t, _NT, dtype)
      return carry

    def upper(j, carry):
      a_ref[rows_i, pl.ds(j * SUB, SUB)] = jnp.zeros((SUB, SUB), jnp.float32)
      return carry

    lax.fori_loop(0, i, off_diagonal, 0)
    lax.fori_loop(i + 1, chunk // SUB, upper, 0)

    # Diagonal block, one key row s at a time: column s of the block is
    # sum_d q_td k_sd e^{b_td - b_sd} over t >= s, an elementwise [L, Dk] product with
    # the exponent masked to t >= s before `exp` (so never above 0), reduced over Dk.
    def diag(s, a):
      ks, bs = _row(k_ref, r0 + s), _row_of(bi, s)                      # [1, Dk]
      col = jnp.sum(qi * ks * _masked_exp(bi - bs, row >= s), axis=1, keepdims=True)
      return a + jnp.where(cols == s, col, 0.0)

    a_ref[rows_i, rows_i] = _row_loop(diag, jnp.zeros((SUB, SUB), jnp.float32), unroll)


# ----------------------------------------------------------------------------------
# Forward kernels.


def _local_kernel(x_ref, b_ref, z_ref, out_ref, *, chunk, dtype, to_end):
  """out_ref [BK, BV] = (x e^{u})^T z for one (chunk, head, Dk block, Dv block).

  to_end: u = Gamma - b, the chunk's own contribution to the state after it (x = k,
  z = v). Otherwise u = b, its contribution to the gradient of the state entering it
  (x = q, z = do). Every chunk at once: the sequential part is left to _sweep_kernel.
  """
  b = b_ref[...]
  u = _row(b_ref, chunk - 1) - b if to_end else b
  out_ref[...] = _dot(x_ref[...].astype(jnp.float32) * jnp.exp(u), z_ref[...], _TN, dtype)


def _walk(start, count, nc, reverse, load, step, init, prefetch=True, index=None):
  """carry = step(c, loaded, carry) over the chunks c of one segment, in order (or in
  reverse), with chunk c's inputs `load(c)`, or `load(c, index(c))` where the inputs'
  addresses must be loaded first (operands read through a row table, `slot_rows`).

  The walk is the op's one sequential chain, and each of its steps would otherwise
  wait on its own loads (a global-memory round trip, ~1 us). With `prefetch` the loads
  of the next chunk are a loop carry, in flight while this chunk's step runs (the
  prefetch past the last chunk is clamped to a valid chunk and never used), and with
  `index` the addresses of the chunk after it too, so that no step waits on two round
  trips in a row; that costs registers for a second copy of the inputs, so walks over
  large tiles may do better leaving the loads in the step, to Triton's own pipelining
  (with `index`, the next chunk's addresses are still loaded a step ahead).
  """
  def chunk_at(n):
    n = jnp.minimum(n, count - 1)
    return jnp.clip(start + (count - 1 - n if reverse else n), 0, nc - 1)

  if index is None:
    at = lambda c: load(c)
  else:
    at = lambda c: load(c, index(c))
  if not prefetch and index is None:
    return lax.fori_loop(0, count, lambda n, acc: step(chunk_at(n), at(chunk_at(n)), acc),
                         init)
  if not prefetch:  # only the addresses a step ahead: a [C] vector, not the tiles
    def body_addressed(n, carry):
      where, acc = carry
      return index(chunk_at(n + 1)), step(chunk_at(n), load(chunk_at(n), where), acc)
    return lax.fori_loop(0, count, body_addressed, (index(chunk_at(0)), init))[1]
  if index is None:
    def body(n, carry):
      loaded, acc = carry
      nxt = load(chunk_at(n + 1))
      return nxt, step(chunk_at(n), loaded, acc)
    return lax.fori_loop(0, count, body, (load(chunk_at(0)), init))[1]

  def body_indexed(n, carry):
    where_next, loaded, acc = carry
    nxt = load(chunk_at(n + 1), where_next)
    return index(chunk_at(n + 2)), nxt, step(chunk_at(n), loaded, acc)

  init = (index(chunk_at(1)), at(chunk_at(0)), init)
  return lax.fori_loop(0, count, body_indexed, init)[2]


def _sweep_kernel(start_ref, count_ref, decay_ref, local_ref, init_ref, seq_ref,
                  last_ref, *, reverse, prefetch):
  """Walks the chunks of segment z: seq_ref[c] = S, then S = diag(decay_c) S + local_c.

  Forward (S = state): seq_ref holds the state entering each chunk, last_ref the
  final state. Reverse (S = gradient of the state after a chunk): seq_ref holds dH'
  of each chunk, last_ref the gradient of the initial state. Only an elementwise
  multiply-add per step, so the sequential depth costs little.
  decay_ref [NC, BK]; local_ref, seq_ref [NC, BK, BV]; init_ref, last_ref [BK, BV].
  """
  z = pl.program_id(3)  # the grid is (Dk tile, Dv tile, head, segment): _walk_grid

  def load(c):
    return decay_ref[pl.ds(c, 1), :], local_ref[c]

  def step(c, loaded, s):
    decay, local = loaded
    seq_ref[c] = s.astype(seq_ref.dtype)
    return decay.reshape(-1, 1) * s + local

  last_ref[...] = _walk(start_ref[z], count_ref[z], seq_ref.shape[0], reverse, load, step,
                        init_ref[...].astype(jnp.float32), prefetch)


def _states_kernel(start_ref, count_ref, x_ref, b_ref, z_ref, init_ref, seq_ref,
                   last_ref, *, chunk, dtype, reverse, prefetch):
  """_local_kernel and _sweep_kernel in one walk (BlockSizes.fused_states).

  Walks segment program_id(3)'s chunks: seq_ref[c] = S, then
  S = diag(e^{Gamma_c}) S + (x_c e^{u_c})^T z_c, each chunk's own contribution computed
  on the way (forward: x = k, z = v, u = Gamma - b; reverse: x = q, z = do, u = b), so
  it is never written out and read back. x_ref, b_ref [NC, C, BK]; z_ref [NC, C, BV];
  seq_ref [NC, BK, BV]; init_ref, last_ref [BK, BV].
  """
  seg = pl.program_id(3)  # the grid is (Dk tile, Dv tile, head, segment): _walk_grid
  load, index = slot_rows.walk_loads(x_ref, b_ref, z_ref)

  def with_last(load):  # and the chunk's last row of b, Gamma: [1, BK]
    return lambda c, *slots: (*load(c, *slots), b_ref[c, pl.ds(chunk - 1, 1), :])
  load = with_last(load)

  def step(c, loaded, s):
    x, b, z, last = loaded
    seq_ref[c] = s.astype(seq_ref.dtype)
    u = b if reverse else last - b
    local = _dot(x.astype(jnp.float32) * jnp.exp(u), z, _TN, dtype)
    return jnp.exp(last).reshape(-1, 1) * s + local

  last_ref[...] = _walk(start_ref[seg], count_ref[seg], seq_ref.shape[0], reverse, load,
                        step, init_ref[...].astype(jnp.float32), prefetch, index)


def _output_kernel(valid_ref, q_ref, v_ref, b_ref, a_ref, h_ref, o_ref, *, dtype):
  """o_ref [C, BV] for one (chunk, head, Dv block): o = (q e^b) H + A v.

  q, b: [C, Dk]; v: [C, BV]; a: [C, C]; h (entering the chunk): [Dk, BV].
  """
  valid = valid_ref[pl.program_id(0)] > 0
  q_dec = q_ref[...].astype(jnp.float32) * jnp.exp(b_ref[...])
  acc = _dot(q_dec, h_ref[...], _NN, dtype) + _dot(a_ref[...], v_ref[...], _NN, dtype)
  o_ref[...] = jnp.where(valid, acc, 0.0).astype(o_ref.dtype)


# ----------------------------------------------------------------------------------
# Backward kernels.


def _dv_kernel(valid_ref, k_ref, b_ref, a_ref, do_ref, dh_ref, dv_ref, *, chunk, dtype):
  """dv_ref [C, BV] = A^T do + (k e^{Gamma - b}) dH'.

  k, b: [C, Dk]; a: [C, C]; do: [C, BV]; dh (after the chunk): [Dk, BV].
  """
  valid = valid_ref[pl.program_id(0)] > 0
  last = _row(b_ref, chunk - 1)
  k_end = k_ref[...].astype(jnp.float32) * jnp.exp(last - b_ref[...])
  acc = _dot(k_end, dh_ref[...], _NN, dtype) + _dot(a_ref[...], do_ref[...], _TN, dtype)
  dv_ref[...] = jnp.where(valid, acc, 0.0).astype(dv_ref.dtype)


def _dq_dk_inter(b_ref, v, do, h, dh, *, chunk, dtype, rows=None):
  """The inter-chunk terms of dq and dk for the rows `rows` of the chunk (all if None).

  dq = e^b (do H^T) and dk = e^{Gamma - b} (v dH'^T): [rows, BK]; v, do: [rows, Dv];
  h (entering the chunk), dh (after it): [BK, Dv].
  """
  b = b_ref[...].astype(jnp.float32) if rows is None else _rows(b_ref, rows)
  last = _row(b_ref, chunk - 1)                                          # [1, BK]
  dq = jnp.exp(b) * _dot(do, h, _NT, dtype)
  dk = jnp.exp(last - b) * _dot(v, dh, _NT, dtype)
  return dq, dk


def _state_share_of_dgamma(b_ref, h, dh, *, chunk):
  """e^Gamma sum_v H * dH' [1, BK]: the states' term of dGamma."""
  prod = h.astype(jnp.float32) * dh.astype(jnp.float32)
  return jnp.exp(_row(b_ref, chunk - 1)) * jnp.sum(prod, axis=1).reshape(1, -1)


def _dgamma(k_ref, b_ref, dk_inter, h, dh, *, chunk):
  """dGamma [1, BK] of a whole chunk: sum_s k_s dk_inter_s plus the states' term (its
  intra terms cancel); dk_inter [C, BK] from _dq_dk_inter."""
  return (jnp.sum(k_ref[...].astype(jnp.float32) * dk_inter, axis=0, keepdims=True)
          + _state_share_of_dgamma(b_ref, h, dh, chunk=chunk))


def _ds(span):
  """A (start, size) pair as a ref index; None: the whole axis."""
  return slice(None) if span is None else pl.ds(*span)


def _ref_tiles(da_ref):
  """d_a(rows, cols) for _add_intra: a tile of dA read from a [C, C] ref. rows, cols:
  (start, size) or None (all C)."""
  return lambda rows, cols: da_ref[_ds(rows), _ds(cols)]


_DA_COLS = 64  # Dv columns per matmul of _output_score_tiles (bounds shared memory)


def _output_score_tiles(do_ref, v_ref, *, dtype):
  """d_a(rows, cols) for _add_intra: a tile of dA = tril(do v^T) [C, C] (fp32) computed
  from the chunk's do, v [C, Dv] refs, so that dA is never written out and read back.
  rows, cols: (start, size) or None (all C). `dtype` operands, fp32 accumulation: the
  products of XLA's batched matmul (_output_scores), summed in another order."""
  dv = v_ref.shape[-1]
  width = min(dv, _DA_COLS)

  def tile(rows, cols):
    acc = 0.0
    for j in range(dv // width):
      part = pl.ds(j * width, width)
      acc = acc + _dot(do_ref[_ds(rows), part], v_ref[_ds(cols), part], _NT, dtype)
    t = (0 if rows is None else rows[0]) + lax.broadcasted_iota(jnp.int32, acc.shape, 0)
    s = (0 if cols is None else cols[0]) + lax.broadcasted_iota(jnp.int32, acc.shape, 1)
    return jnp.where(s <= t, acc, 0.0)
  return tile


def _add_intra(q_ref, k_ref, b_ref, d_a, i, dq, dk, *, chunk, dtype, unroll, span):
  """dq, dk [L, BK] of sub-block i plus their intra-chunk terms.

  d_a(rows, cols): a tile of dA [C, C] = tril(do v^T) (fp32; _output_score_tiles or
  _ref_tiles). dq is anchored at the first row of i (key rows
  s <= t), dk at the last row of i (query rows t >= s), so that every exponent is <= 0
  outside the diagonal block. While the sub-block's decay span is at most `span`, the
  other sub-blocks are one [L, C] x [C, BK] matmul for each of dq, dk and the diagonal
  block one fp32 [L, L] x [L, BK] matmul; otherwise the other sub-blocks are one matmul
  each and the diagonal block goes one row s at a time: elementwise [L, BK] updates
  whose only reductions are over the [L, L] tile of dA.
  """
  r0, ns = i * SUB, chunk // SUB
  bi = _rows(b_ref, i)
  first, end = _row(b_ref, r0), _row(b_ref, r0 + SUB - 1)

  def two_matmuls(dq, dk):
    row = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    b = b_ref[...].astype(jnp.float32)
    before, after = row < r0, row >= r0 + SUB
    # The other sub-blocks in one matmul each (rows on the far side of the diagonal
    # meet dA = 0; they are masked in the exponent only to keep the factor finite) ...
    k_t = jnp.where(before, k_ref[...].astype(jnp.float32)
                    * jnp.exp(jnp.where(before, first - b, 0.0)), 0.0)
    q_t = jnp.where(after, q_ref[...].astype(jnp.float32)
                    * jnp.exp(jnp.where(after, b - end, 0.0)), 0.0)
    dq_in = _dot(d_a((r0, SUB), None), k_t, _NN, dtype)
    dk_in = _dot(d_a(None, (r0, SUB)), q_t, _TN, dtype)
    # ... and the diagonal block with fp32 operands: db = q dq - k dk cancels its
    # t = s terms only if they are not rounded (bf16 operands here tripled dg's error).
    diag = d_a((r0, SUB), (r0, SUB))
    dq_in += _dot(diag, _rows(k_ref, i) * jnp.exp(first - bi), _NN, jnp.float32)
    dk_in += _dot(diag, _rows(q_ref, i) * jnp.exp(bi - end), _TN, jnp.float32)
    return dq + jnp.exp(bi - first) * dq_in, dk + jnp.exp(end - bi) * dk_in

  def row_by_row(dq, dk):
    def dq_block(j, acc):
      k_t = _rows(k_ref, j) * jnp.exp(first - _rows(b_ref, j))
      return acc + _dot(d_a((r0, SUB), (j * SUB, SUB)), k_t, _NN, dtype)

    def dk_block(j, acc):
      q_t = _rows(q_ref, j) * jnp.exp(_rows(b_ref, j) - end)
      return acc + _dot(d_a((j * SUB, SUB), (r0, SUB)), q_t, _TN, dtype)

    zeros = jnp.zeros_like(bi)
    dq = dq + jnp.exp(bi - first) * lax.fori_loop(0, i, dq_block, zeros)
    dk = dk + jnp.exp(end - bi) * lax.fori_loop(i + 1, ns, dk_block, zeros)

    diag_a = d_a((r0, SUB), (r0, SUB))
    rows, cols, row = _iota(0), _iota(1), _iota(0, 1)

    def diag(s, carry):
      dq_i, dk_i = carry
      ks, bs, qs = _row(k_ref, r0 + s), _row(b_ref, r0 + s), _row(q_ref, r0 + s)
      col = jnp.sum(jnp.where(cols == s, diag_a, 0.0), axis=1, keepdims=True)  # dA[:, s]
      d_row = jnp.sum(jnp.where(rows == s, diag_a, 0.0), axis=0).reshape(-1, 1)  # dA[s, :]
      dq_i = dq_i + col * ks * _masked_exp(bi - bs, row >= s)
      dk_i = dk_i + d_row * qs * _masked_exp(bs - bi, row <= s)
      return dq_i, dk_i

    return _row_loop(diag, (dq, dk), unroll)

  mild = jnp.logical_and(_within_span(first - bi, span), _within_span(bi - end, span))
  return lax.cond(mild, two_matmuls, row_by_row, dq, dk)


def _db(valid, q, k, dq, dk):
  """db = q dq - k dk (without its dGamma term), zero in a chunk of no segment."""
  return jnp.where(valid, q * dq - k * dk, 0.0)


def _write_dq_dk(valid, dq, dk, dq_ref, dk_ref, rows=slice(None)):
  dq_ref[rows, :] = jnp.where(valid, dq, 0.0).astype(dq_ref.dtype)
  dk_ref[rows, :] = jnp.where(valid, dk, 0.0).astype(dk_ref.dtype)


def _dqk_kernel(valid_ref, q_ref, k_ref, b_ref, v_ref, do_ref, h_ref, dh_ref, da_ref,
                dq_ref, dk_ref, db_ref, dgamma_ref, *, chunk, dtype, unroll, span):
  """Sub-block i = program_id(3) of one (chunk, head, Dk block), inter and intra terms.

  Outputs dq, dk and db [L, BK] (db without its dGamma term) and this sub-block's share
  of dGamma [1, BK] (summed over sub-blocks and added to the last row of db outside).
  q, k, b: [C, BK]; v, do: [L, Dv] (rows of i); h (entering the chunk), dh (after it):
  [BK, Dv]; da: [C, C] = tril(do v^T) of the chunk (fp32).
  """
  valid = valid_ref[pl.program_id(0)] > 0
  i = pl.program_id(3)
  h, dh = h_ref[...], dh_ref[...]
  dq, dk = _dq_dk_inter(b_ref, v_ref[...], do_ref[...], h, dh, chunk=chunk, dtype=dtype,
                        rows=i)
  d_gamma = (jnp.sum(_rows(k_ref, i) * dk, axis=0, keepdims=True)
             + jnp.where(i == chunk // SUB - 1,
                         _state_share_of_dgamma(b_ref, h, dh, chunk=chunk), 0.0))
  dq, dk = _add_intra(q_ref, k_ref, b_ref, _ref_tiles(da_ref), i, dq, dk, chunk=chunk,
                      dtype=dtype, unroll=unroll, span=span)
  _write_dq_dk(valid, dq, dk, dq_ref, dk_ref)
  db_ref[...] = _db(valid, _rows(q_ref, i), _rows(k_ref, i), dq, dk)
  dgamma_ref[...] = jnp.where(valid, d_gamma, 0.0)


def _dqk_inter_kernel(valid_ref, k_ref, b_ref, v_ref, do_ref, h_ref, dh_ref,
                      dq_ref, dk_ref, dgamma_ref, *, chunk, dtype):
  """split_dqk, first kernel: one (chunk, head, Dk block).

  dq, dk [C, BK] (fp32): their inter-chunk terms; dGamma [1, BK] (whole: its intra
  terms cancel). k, b: [C, BK]; v, do: [C, Dv]; h, dh: [BK, Dv].
  """
  valid = valid_ref[pl.program_id(0)] > 0
  h, dh = h_ref[...], dh_ref[...]
  dq, dk = _dq_dk_inter(b_ref, v_ref[...], do_ref[...], h, dh, chunk=chunk, dtype=dtype)
  d_gamma = _dgamma(k_ref, b_ref, dk, h, dh, chunk=chunk)
  dq_ref[...] = jnp.where(valid, dq, 0.0)
  dk_ref[...] = jnp.where(valid, dk, 0.0)
  dgamma_ref[...] = jnp.where(valid, d_gamma, 0.0)


def _dqk_intra_kernel(valid_ref, q_ref, k_ref, b_ref, *refs, chunk, dtype, unroll, span,
                      whole_chunk, intra_scores, inter_here):
  """split_dqk, second kernel: one (chunk, head, Dk block) adds the intra-chunk terms
  to the inter ones (dq_in, dk_in [C, BK], whose buffers dq, dk overwrite) and writes
  the gradient of the gates g themselves, dg_u = sum_{t >= u} db_t [C, BK] (b is their
  in-chunk cumulative sum), dGamma [1, BK] (from the first kernel) included.
  q, k, b: [C, BK]; then v, do: [C, Dv], from which the tiles of dA = tril(do v^T)
  are computed here (_output_score_tiles), or with intra_scores=False dA [C, C] itself
  (after v and do if inter_here).
  With inter_here (BlockSizes.inter_in_intra) there is no first kernel: the states
  h (entering the chunk) and dh (after it) [BK, Dv] follow, the inter terms and
  dGamma are computed here (_dq_dk_inter; where the chunk goes sub-block by sub-block,
  the inter terms again per sub-block from its rows of v and do), and dq, dk are
  written in their own dtype (no fp32 copy for XLA to round).

  Where the chunk's decay span (over these BK features) is at most `span`, each of dq
  and dk is one matmul anchored at row 0: dq = e^{b - b_0} (dA (k e^{b_0 - b})) and
  dk = e^{b_0 - b} (dA^T (q e^{b - b_0})); otherwise sub-block by sub-block
  (_add_intra), last to first so that the sums of db over the later rows are a carry,
  as always with whole_chunk=False (static, see _fits_whole_chunk). Each program reads
  rows of dq_in / dk_in before it writes the same rows.
  """
  valid = valid_ref[pl.program_id(0)] > 0
  if intra_scores or inter_here:
    v_ref, do_ref, *refs = refs
  if intra_scores:
    d_a = _output_score_tiles(do_ref, v_ref, dtype=dtype)
  else:
    da_ref, *refs = refs
    d_a = _ref_tiles(da_ref)
  if inter_here:
    h_ref, dh_ref, dq_ref, dk_ref, dg_ref = refs
    h, dh = h_ref[...], dh_ref[...]
    dq_inter, dk_inter = _dq_dk_inter(b_ref, v_ref[...], do_ref[...], h, dh, chunk=chunk,
                                      dtype=dtype)
    # A chunk of no segment has no states to speak of (its buffers are not written).
    d_gamma = jnp.where(valid, _dgamma(k_ref, b_ref, dk_inter, h, dh, chunk=chunk), 0.0)
    inter_all = lambda: (dq_inter, dk_inter)
    inter_rows = lambda i: _dq_dk_inter(b_ref, _rows(v_ref, i), _rows(do_ref, i), h, dh,
                                        chunk=chunk, dtype=dtype, rows=i)
  else:
    dgamma_ref, dq_in_ref, dk_in_ref, dq_ref, dk_ref, dg_ref = refs
    d_gamma = dgamma_ref[...]                                            # [1, BK]
    inter_all = lambda: (dq_in_ref[...], dk_in_ref[...])
    inter_rows = lambda i: (dq_in_ref[pl.ds(i * SUB, SUB), :],
                            dk_in_ref[pl.ds(i * SUB, SUB), :])

  def whole(first, b):
    q, k = q_ref[...].astype(jnp.float32), k_ref[...].astype(jnp.float32)
    decay, growth = jnp.exp(b - first), jnp.exp(first - b)
    scores = d_a(None, None)
    dq_in, dk_in = inter_all()
    dq = dq_in + decay * _dot_split(scores, k * growth, _NN, dtype)
    dk = dk_in + growth * _dot_split(scores, q * decay, _TN, dtype)
    _write_dq_dk(valid, dq, dk, dq_ref, dk_ref)
    row = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    dg_ref[...] = _suffix_sums(_db(valid, q, k, dq, dk)
                               + jnp.where(row == chunk - 1, d_gamma, 0.0))

  def sub_block(i, later):
    """Sub-block i's rows; later: sum of db over the rows after it [1, BK]."""
    rows = pl.ds(i * SUB, SUB)
    dq, dk = _add_intra(q_ref, k_ref, b_ref, d_a, i, *inter_rows(i), chunk=chunk,
                        dtype=dtype, unroll=unroll, span=span)
    _write_dq_dk(valid, dq, dk, dq_ref, dk_ref, rows)
    last_row = (_iota(0, 1) == SUB - 1) & (i == chunk // SUB - 1)
    db = (_db(valid, _rows(q_ref, i), _rows(k_ref, i), dq, dk)
          + jnp.where(last_row, d_gamma, 0.0))
    dg_ref[rows, :] = later + _suffix_sums(db)
    return later + jnp.sum(db, axis=0, keepdims=True)

  _by_chunk_or_sub_block(lambda: (_row(b_ref, 0), b_ref[...].astype(jnp.float32)),
                         chunk=chunk, span=span, whole_chunk=whole_chunk, whole=whole,
                         sub_block=sub_block,
                         init=jnp.zeros((1, k_ref.shape[-1]), jnp.float32), reverse=True)


# ----------------------------------------------------------------------------------
# pallas_call wrappers. Arrays: q, k, b [NC, C, H, Dk]; v [NC, C, H, Dv];
# states [NC | Z, H, Dk, Dv]; tables int32 [Z] / [NC].


def _params(bs: BlockSizes):
  return plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages)


def _whole(n):
  return pl.BlockSpec((n,), lambda *_: (0,))


def _local(x, b, z, bs, interpret, to_end):
  """(x e^u)^T z per chunk: [NC, H, Dk, Dv] fp32 (see _local_kernel)."""
  nc, c, h, dk = x.shape
  dv = z.shape[-1]
  bk, bv = bs.tiles(dk, dv)
  k_blk = pl.BlockSpec((None, c, None, bk), lambda n, hh, i, j: (n, 0, hh, i))
  kernel = functools.partial(_local_kernel, chunk=c, dtype=x.dtype, to_end=to_end)
  return slot_rows.call(
      kernel, grid=(nc, h, dk // bk, dv // bv),
      ins=[(x, k_blk), (b, k_blk),
           (z, pl.BlockSpec((None, c, None, bv), lambda n, hh, i, j: (n, 0, hh, j)))],
      outs=[(jax.ShapeDtypeStruct((nc, h, dk, dv), jnp.float32),
             pl.BlockSpec((None, None, bk, bv), lambda n, hh, i, j: (n, hh, i, j)))],
      compiler_params=_params(bs), interpret=interpret, name="gla_local",
  )[0]


def _longest_first(start, count, init, walk):
  """walk(start', count', init') on the segments reordered longest first, and its
  (per-chunk states, last states) with the last states back in segment order.

  The walk's grid puts segments on its slowest launch axis (_walk_grid), so the CUDA
  blocks of the longest segments -- the op's critical path, e.g. the shared partition's
  segments in SSE varlen, which are listed last -- start first.
  """
  order = jnp.argsort(-count, stable=True).astype(jnp.int32)
  seq, last = walk(start[order], count[order], init[order])
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
  return seq, last[inverse]


def _walk_grid(nc, z, h, dk, dv, bk, bv):
  """Grid (Dk tile, Dv tile, head, segment) and the specs of a [BK, BV] state tile per
  segment and of the [NC, BK, BV] per-chunk states: the Triton lowering folds the two
  leading axes into CUDA's x, so the segment axis is the slowest in launch order."""
  state = pl.BlockSpec((None, None, bk, bv), lambda i, j, hh, s: (s, hh, i, j))
  per_chunk = pl.BlockSpec((nc, None, bk, bv), lambda i, j, hh, s: (0, hh, i, j))
  return (dk // bk, dv // bv, h, z), state, per_chunk


def _sweep(decay, local, init, start, count, bs, interpret, reverse, seq_dtype):
  """Segment-wise recurrence over chunks (see _sweep_kernel)."""
  nc, h, dk, dv = local.shape
  z = init.shape[0]
  bk, bv = bs.sweep_tiles(dk, dv)
  grid, state, per_chunk = _walk_grid(nc, z, h, dk, dv, bk, bv)
  kernel = functools.partial(_sweep_kernel, reverse=reverse, prefetch=bs.prefetch)
  call = pl.pallas_call(
      kernel, grid=grid,
      in_specs=[_whole(z), _whole(z),
                pl.BlockSpec((nc, None, bk), lambda i, j, hh, s: (0, hh, i)),
                per_chunk, state],
      out_specs=[per_chunk, state],
      out_shape=[jax.ShapeDtypeStruct((nc, h, dk, dv), seq_dtype),
                 jax.ShapeDtypeStruct((z, h, dk, dv), jnp.float32)],
      compiler_params=_params(bs), interpret=interpret,
      name="gla_sweep_reverse" if reverse else "gla_sweep",
  )
  return _longest_first(start, count, init,
                        lambda s0, n0, h0: call(s0, n0, decay, local, h0))


def _fused_walk_tiles(bs: BlockSizes, z, h, dk, dv) -> tuple[int, int]:
  """State tiles of the fused walk: the small sweep tiles while the grid at those
  tiles has at most BlockSizes.walk_programs programs (latency-bound: dense GLA), else
  the block tiles, which load and exponentiate each chunk's k and gates fewer times
  over (throughput-bound: SSE masking and varlen)."""
  bk, bv = bs.sweep_tiles(dk, dv)
  if z * h * (dk // bk) * (dv // bv) <= bs.walk_programs:
    return bk, bv
  return bs.tiles(dk, dv)


def _fused_states(x, b, z, init, start, count, bs, interpret, reverse):
  """Segment-wise recurrence with each chunk's contribution computed on the way (see
  _states_kernel): (per-chunk states [NC, H, Dk, Dv], last state per segment)."""
  nc, c, h, dk = x.shape
  dv = z.shape[-1]
  zz = init.shape[0]
  bk, bv = _fused_walk_tiles(bs, zz, h, dk, dv)
  grid, state, per_chunk = _walk_grid(nc, zz, h, dk, dv, bk, bv)
  k_all = pl.BlockSpec((nc, c, None, bk), lambda i, j, hh, s: (0, 0, hh, i))
  v_all = pl.BlockSpec((nc, c, None, bv), lambda i, j, hh, s: (0, 0, hh, j))
  kernel = functools.partial(_states_kernel, chunk=c, dtype=x.dtype, reverse=reverse,
                             prefetch=bs.prefetch)
  outs = [(jax.ShapeDtypeStruct((nc, h, dk, dv), _seq_dtype(bs, x.dtype)), per_chunk),
          (jax.ShapeDtypeStruct((zz, h, dk, dv), jnp.float32), state)]
  call = lambda s0, n0, h0: slot_rows.call(
      kernel, grid=grid,
      ins=[(s0, _whole(zz)), (n0, _whole(zz)), (x, k_all), (b, k_all), (z, v_all),
           (h0, state)],
      outs=outs, compiler_params=_params(bs), interpret=interpret,
      name="gla_states_reverse" if reverse else "gla_states")
  return _longest_first(start, count, init, call)


def _seq_dtype(bs: BlockSizes, dtype) -> jnp.dtype:
  """dtype of the per-chunk states: fp32, or bf16 for bf16 operands with
  BlockSizes.low_precision_states (the final states are fp32 either way; float16's
  range would overflow in them)."""
  dtype = jnp.dtype(dtype)
  if bs.low_precision_states and dtype == jnp.bfloat16:
    return dtype
  return jnp.dtype(jnp.float32)


def _states(k, v, b, h0, start, count, bs, interpret):
  """(state entering each chunk [NC, H, Dk, Dv], final state per segment)."""
  if bs.fused_states:
    return _fused_states(k, b, v, h0, start, count, bs, interpret, reverse=False)
  decay = jnp.exp(b[:, -1])                                              # [NC, H, Dk]
  local = _local(k, b, v, bs, interpret, to_end=True)
  return _sweep(decay, local, h0, start, count, bs, interpret, reverse=False,
                seq_dtype=_seq_dtype(bs, k.dtype))


def _dstates(q, do, b, dfinal, start, count, bs, interpret):
  """(gradient of the state after each chunk, gradient of h0 per segment)."""
  if bs.fused_states:
    return _fused_states(q, b, do, dfinal, start, count, bs, interpret, reverse=True)
  decay = jnp.exp(b[:, -1])
  local = _local(q, b, do, bs, interpret, to_end=False)
  return _sweep(decay, local, dfinal, start, count, bs, interpret, reverse=True,
                seq_dtype=_seq_dtype(bs, q.dtype))


def _scores(q, k, g, bs, interpret):
  """(A [NC, H, C, C], b [NC, C, H, Dk]) fp32 (see _scores_kernel)."""
  nc, c, h, dk = q.shape
  full_k = pl.BlockSpec((None, c, None, dk), lambda n, hh: (n, 0, hh, 0))
  kernel = functools.partial(_scores_kernel, chunk=c, dtype=q.dtype, unroll=bs.diag_unroll,
                             span=bs.diag_matmul_span,
                             whole_chunk=_fits_whole_chunk(c, dk, c),
                             barrier=not interpret)
  return slot_rows.call(
      kernel, grid=(nc, h), ins=[(q, full_k), (k, full_k), (g, full_k)],
      outs=[(jax.ShapeDtypeStruct((nc, h, c, c), jnp.float32),
             pl.BlockSpec((None, None, c, c), lambda n, hh: (n, hh, 0, 0))),
            (jax.ShapeDtypeStruct(g.shape, jnp.float32), full_k)],
      compiler_params=_params(bs), interpret=interpret, name="gla_scores")


def _value_tiled_specs(c, dk, dv, bs):
  """For grids (chunk, head, value tile): the value tile width bv, the spec of a whole
  [C, Dk] key-side block, and the spec of a [C, bv] value-side tile."""
  _, bv = bs.tiles(dk, dv)
  full_k = pl.BlockSpec((None, c, None, dk), lambda n, hh, j: (n, 0, hh, 0))
  v_blk = pl.BlockSpec((None, c, None, bv), lambda n, hh, j: (n, 0, hh, j))
  return bv, full_k, v_blk


def _outputs(q, v, b, a, h_start, valid, bs, interpret):
  nc, c, h, dk = q.shape
  dv = v.shape[-1]
  bv, full_k, v_blk = _value_tiled_specs(c, dk, dv, bs)
  kernel = functools.partial(_output_kernel, dtype=q.dtype)
  return slot_rows.call(
      kernel, grid=(nc, h, dv // bv),
      ins=[(valid, _whole(nc)), (q, full_k), (v, v_blk), (b, full_k),
           (a, pl.BlockSpec((None, None, c, c), lambda n, hh, j: (n, hh, 0, 0))),
           (h_start, pl.BlockSpec((None, None, dk, bv), lambda n, hh, j: (n, hh, 0, j)))],
      outs=[(slot_rows.like(v, v.shape[2:], v.dtype), v_blk)],
      compiler_params=_params(bs), interpret=interpret, name="gla_outputs")[0]


def _dv(k, b, a, do, dh, valid, bs, interpret):
  nc, c, h, dk = k.shape
  dv = do.shape[-1]
  bv, full_k, v_blk = _value_tiled_specs(c, dk, dv, bs)
  kernel = functools.partial(_dv_kernel, chunk=c, dtype=k.dtype)
  return slot_rows.call(
      kernel, grid=(nc, h, dv // bv),
      ins=[(valid, _whole(nc)), (k, full_k), (b, full_k),
           (a, pl.BlockSpec((None, None, c, c), lambda n, hh, j: (n, hh, 0, 0))),
           (do, v_blk), (dh, pl.BlockSpec((None, None, dk, bv), lambda n, hh, j: (n, hh, 0, j)))],
      outs=[(slot_rows.like(do, do.shape[2:], do.dtype), v_blk)],
      compiler_params=_params(bs), interpret=interpret, name="gla_dv")[0]


def _output_scores(do, v):
  """dA [NC, H, C, C] fp32 = tril(do v^T) per (chunk, head): one batched matmul (XLA)."""
  c = do.shape[1]
  # fp32 inputs: IEEE products, as in the kernels (XLA's default on GPU would be TF32).
  prec = lax.Precision.HIGHEST if do.dtype == jnp.float32 else lax.Precision.DEFAULT
  d_a = jnp.einsum("nthv,nshv->nhts", do, v, preferred_element_type=jnp.float32,
                   precision=prec)
  return jnp.where(jnp.tril(jnp.ones((c, c), bool)), d_a, 0.0)


def _sub_block_specs(c, bk):
  """For grids (chunk, head, Dk block, sub-block): the specs of a whole [C, BK] key-side
  block, of the sub-block's [L, BK] rows of it, and of the chunk's [C, C] dA."""
  k_blk = pl.BlockSpec((None, c, None, bk), lambda n, hh, kk, i: (n, 0, hh, kk))
  sub_k = pl.BlockSpec((None, SUB, None, bk), lambda n, hh, kk, i: (n, i, hh, kk))
  d_a = pl.BlockSpec((None, None, c, c), lambda n, hh, kk, i: (n, hh, 0, 0))
  return k_blk, sub_k, d_a


# Shared memory per block on Hopper (H100 / H200): 227 KiB. Triton reports a tile that
# needs more only when the kernel is compiled, with a RESOURCE_EXHAUSTED error.
_SMEM_BYTES = 227 * 1024


def _whole_chunk_bytes(c: int, inner: int, cols: int) -> int:
  """Shared memory of a whole-chunk matmul [C, inner] x [inner, cols].

  Its operands are staged there, 4 bytes per element either way (fp32, or the bf16
  hi / lo halves of _dot_split); an fp32 [C, C] tile is counted on top as a margin.
  On the H200 the scores kernel at C = 128 and Dk = 256 asked for 262,144 bytes, the
  two operands exactly, and failed; at C = 128 and Dk = 128 it compiled.
  """
  return 4 * c * inner + 4 * inner * cols + 4 * c * c


def _fits_whole_chunk(c: int, inner: int, cols: int) -> bool:
  """Whether a whole-chunk matmul [C, inner] x [inner, cols] fits in shared memory."""
  return _whole_chunk_bytes(c, inner, cols) <= _SMEM_BYTES


def _inter_bytes(c: int, bk: int, dv: int, itemsize: int) -> int:
  """Shared memory of the split dq/dk inter terms at Dk block bk: v and do [C, Dv]
  (input dtype) and both states [BK, Dv] (fp32) whole; the count matched what Triton
  asked for on the H200 (C = 32, BK = 128, Dv = 256, fp32: 335,872 bytes, over the
  limit)."""
  return 2 * c * dv * itemsize + 8 * bk * dv + 2 * c * bk


def _inter_block_k(c: int, bk: int, dv: int, itemsize: int) -> int | None:
  """Dk block of the split dq/dk inter kernel: the largest <= bk whose tiles fit in
  shared memory, or None if none does.

  Its tiles: _inter_bytes. Where no block fits (v and do alone are too large: C = 128
  and Dv = 256 in fp32), _dqkb uses the fused kernel, which holds L rows of them
  instead of C.
  """
  while bk >= 16:
    if _inter_bytes(c, bk, dv, itemsize) <= _SMEM_BYTES:
      return bk
    bk //= 2
  return None


def _dqkb(q, k, b, v, do, h_start, dh, valid, bs, interpret):
  """dq, dk and dg [NC, C, H, Dk]: the gradients w.r.t. q, k and the gates g
  whose in-chunk cumulative sums are b.

  BlockSizes.split_dqk uses two kernels where the first one's tiles fit in shared
  memory (_inter_block_k), the second of which turns db into dg; else the fused
  kernel, whose db (dGamma added) XLA turns into dg. dg is fp32, dq and dk are in q's
  and k's dtype from the one kernel of BlockSizes.inter_in_intra, else fp32."""
  nc, c, h, dk = q.shape
  dv = v.shape[-1]
  if bs.split_dqk:
    bk_inter = _inter_block_k(c, bs.tiles(dk, dv)[0], dv, max(v.dtype.itemsize,
                                                              do.dtype.itemsize))
    if bk_inter is not None:
      return _dqkb_split(q, k, b, v, do, h_start, dh, valid, bs, bk_inter, interpret)
  if isinstance(q, Slots):
    # The fused kernel reads rows of v and do by sub-block and XLA sums its db: it runs
    # on buffers built in XLA, its results taken back to the slots.
    dq, dk_, dg = _dqkb(_buffer(q), _buffer(k), b, _buffer(v), _buffer(do), h_start, dh,
                        valid, bs, interpret)
    return (slot_rows.from_buffer(dq, q), slot_rows.from_buffer(dk_, k),
            slot_rows.from_buffer(dg, q))
  bk, _ = bs.tiles(dk, dv)
  ns = c // SUB
  k_blk, sub_k, d_a = _sub_block_specs(c, bk)
  sub_v = pl.BlockSpec((None, SUB, None, dv), lambda n, hh, kk, i: (n, i, hh, 0))
  state = pl.BlockSpec((None, None, bk, dv), lambda n, hh, kk, i: (n, hh, kk, 0))
  kernel = functools.partial(_dqk_kernel, chunk=c, dtype=q.dtype, unroll=bs.diag_unroll,
                             span=bs.diag_matmul_span)
  dq, dk_, db, d_gamma = pl.pallas_call(
      kernel, grid=(nc, h, dk // bk, ns),
      in_specs=[_whole(nc), k_blk, k_blk, k_blk, sub_v, sub_v, state, state, d_a],
      out_specs=[sub_k, sub_k, sub_k,
                 pl.BlockSpec((None, None, 1, bk), lambda n, hh, kk, i: (n, hh, i, kk))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32),
                 jax.ShapeDtypeStruct(k.shape, jnp.float32),
                 jax.ShapeDtypeStruct(b.shape, jnp.float32),
                 jax.ShapeDtypeStruct((nc, h, ns, dk), jnp.float32)],
      compiler_params=_params(bs), interpret=interpret, name="gla_dqk",
  )(valid, q, k, b, v, do, h_start, dh, _output_scores(do, v))
  db = db.at[:, -1].add(jnp.sum(d_gamma, axis=2))
  return dq, dk_, _suffix_sums_over_chunk(db)


def _suffix_sums_over_chunk(db):
  """dg_u = sum_{t >= u} db_t along axis 1 (a chunk's C rows) of [NC, C, H, Dk] fp32.

  One matmul with an upper-triangular matrix of ones at full precision, not a reversed
  cumsum: XLA on GPU fuses a cumsum's windowed reduction with its producer and
  recomputes that for every element of the window; a dot reads its operand once."""
  c = db.shape[1]
  upper = jnp.triu(jnp.ones((c, c), db.dtype))
  return jnp.einsum("st,ntf->nsf", upper, db.reshape(db.shape[:2] + (-1,)),
                    precision=lax.Precision.HIGHEST).reshape(db.shape)


def _fits_inter_in_intra(c: int, bk: int, dv: int, itemsize: int) -> bool:
  """Whether BlockSizes.inter_in_intra's one kernel fits in shared memory at Dk block
  bk: the inter terms' tiles and the intra kernel's whole-chunk matmul counted side by
  side."""
  return _inter_bytes(c, bk, dv, itemsize) + _whole_chunk_bytes(c, c, bk) <= _SMEM_BYTES


def _dqkb_split(q, k, b, v, do, h_start, dh, valid, bs, bk_inter, interpret):
  """_dqkb as two kernels (BlockSizes.split_dqk): inter-chunk terms and dGamma per
  (chunk, head, Dk block of bk_inter columns), then intra-chunk terms and dg per
  (chunk, head, Dk block of block_k columns), updating the first kernel's buffers;
  with BlockSizes.inter_in_intra, where its tiles fit, the second kernel alone."""
  nc, c, h, dk = q.shape
  dv = v.shape[-1]
  bk, _ = bs.tiles(dk, dv)
  v_all = pl.BlockSpec((None, c, None, dv), lambda n, hh, kk: (n, 0, hh, 0))
  inter_here = bs.inter_in_intra and _fits_inter_in_intra(
      c, bk, dv, max(v.dtype.itemsize, do.dtype.itemsize))
  if inter_here:
    state = pl.BlockSpec((None, None, bk, dv), lambda n, hh, kk: (n, hh, kk, 0))
    inter_specs, inter_args = [state, state], (h_start, dh)
  else:
    k_blk = pl.BlockSpec((None, c, None, bk_inter), lambda n, hh, kk: (n, 0, hh, kk))
    state = pl.BlockSpec((None, None, bk_inter, dv), lambda n, hh, kk: (n, hh, kk, 0))
    kernel = functools.partial(_dqk_inter_kernel, chunk=c, dtype=q.dtype)
    dq_inter, dk_inter, d_gamma = slot_rows.call(
        kernel, grid=(nc, h, dk // bk_inter),
        ins=[(valid, _whole(nc)), (k, k_blk), (b, k_blk), (v, v_all), (do, v_all),
             (h_start, state), (dh, state)],
        outs=[(jax.ShapeDtypeStruct((nc, c, h, dk), jnp.float32), k_blk),
              (jax.ShapeDtypeStruct((nc, c, h, dk), jnp.float32), k_blk),
              (jax.ShapeDtypeStruct((nc, h, 1, dk), jnp.float32),
               pl.BlockSpec((None, None, 1, bk_inter), lambda n, hh, kk: (n, hh, 0, kk)))],
        compiler_params=_params(bs), interpret=interpret, name="gla_dqk_inter")
    k_blk = pl.BlockSpec((None, c, None, bk), lambda n, hh, kk: (n, 0, hh, kk))
    inter_specs = [pl.BlockSpec((None, None, 1, bk), lambda n, hh, kk: (n, hh, 0, kk)),
                   k_blk, k_blk]
    inter_args = (d_gamma, dq_inter, dk_inter)

  k_blk = pl.BlockSpec((None, c, None, bk), lambda n, hh, kk: (n, 0, hh, kk))
  kernel = functools.partial(_dqk_intra_kernel, chunk=c, dtype=q.dtype,
                             unroll=bs.diag_unroll, span=bs.diag_matmul_span,
                             whole_chunk=_fits_whole_chunk(c, c, bk),
                             intra_scores=bs.intra_scores, inter_here=inter_here)
  scores_specs, scores_args = [], ()
  if bs.intra_scores or inter_here:
    scores_specs, scores_args = [v_all, v_all], (v, do)
  if not bs.intra_scores:
    scores_specs.append(pl.BlockSpec((None, None, c, c), lambda n, hh, kk: (n, hh, 0, 0)))
    scores_args += (_output_scores(_buffer(do), _buffer(v)),)
  args = (valid, q, k, b, *scores_args, *inter_args)
  specs = [_whole(nc), k_blk, k_blk, k_blk, *scores_specs, *inter_specs]
  # Each program reads rows of the inter terms before writing the same rows of dq / dk:
  # the first kernel's buffers (the last two arguments) can be reused, when dq and dk
  # are buffers too.
  slots = isinstance(q, Slots)
  aliases = {} if inter_here or slots else {len(args) - 2: 0, len(args) - 1: 1}
  out = lambda x, dtype: (slot_rows.like(x, (h, dk), dtype), k_blk)
  return slot_rows.call(
      kernel, grid=(nc, h, dk // bk), ins=list(zip(args, specs)),
      outs=[out(q, q.dtype if inter_here else jnp.float32),
            out(k, k.dtype if inter_here else jnp.float32), out(q, jnp.float32)],
      input_output_aliases=aliases,
      compiler_params=_params(bs), interpret=interpret, name="gla_dqk_intra")


def _buffer(x):
  """x as a buffer array [NC, C, ...]: built in XLA from Slots, else x itself."""
  return slot_rows.to_buffer(x) if isinstance(x, Slots) else x


# ----------------------------------------------------------------------------------
# custom_vjp core over (q, k, v, b, h0) with static tables.


def _valid_chunks(start, count, nc):
  """int32 [NC]: 1 for a chunk inside some segment [start, start + count), else 0
  (+1 at each non-empty segment's start, -1 past its end, summed)."""
  edge = lambda at, d: jnp.zeros((nc,), jnp.int32).at[jnp.where(count > 0, at, nc)].add(
      d, mode="drop")
  return (jnp.cumsum(edge(start, 1) + edge(start + count, -1)) > 0).astype(jnp.int32)


def _core(q, k, v, g, h0, start, count, bs, interpret):
  """(o, final) with gradients for (q, k, v, g, h0).

  The forward kernels whose results the backward pass reads (scores and gate sums,
  chunk states) run here, outside the custom_vjp, on stopped gradients, their results
  named RESIDUAL_NAME; `_outputs_with_grads` takes them as inputs and differentiates
  the whole op. So every residual of the custom_vjp is one of its inputs, and a
  `jax.checkpoint` policy that saves only RESIDUAL_NAME recomputes q, k, v (a packed
  copy, say) in the backward pass without running these kernels again; a residual
  made inside a custom_vjp's forward would make the checkpoint rerun all of it.
  """
  stop = lax.stop_gradient
  a, b, h_start, final = _forward_kernels(stop(q), stop(k), stop(v), stop(g), stop(h0),
                                          start, count, bs, interpret)
  return _outputs_with_grads(q, k, v, g, h0, start, count, a, b, h_start, final, bs,
                             interpret)


# A jit of its own: JAX never prunes an unused pallas_call, but prunes an unused jit. A
# checkpoint's recomputation in the backward pass copies these calls, whose results
# it then takes from the saved residuals: pruned, the copy is never lowered.
@functools.partial(jax.jit, static_argnums=(7, 8))
def _forward_kernels(q, k, v, g, h0, start, count, bs, interpret):
  """(a, b, h_start, final): the scores, gate sums and states, named RESIDUAL_NAME
  (h_start only when the backward pass does not walk the states again)."""
  kept = functools.partial(checkpoint_name, name=RESIDUAL_NAME)
  a, b = map(kept, _scores(q, k, g, bs, interpret))
  h_start, final = _states(k, v, b, h0, start, count, bs, interpret)
  # final is small; naming it keeps the states walk out of the recomputation.
  return a, b, h_start if bs.recompute_states else kept(h_start), kept(final)


@functools.partial(jax.custom_vjp, nondiff_argnums=(11, 12))
def _outputs_with_grads(q, k, v, g, h0, start, count, a, b, h_start, final, bs,
                        interpret):
  """(o, final) from the forward kernels' results a, b, h_start, final (computed from
  q, k, v, g, h0 by `_core`); the backward pass gives the gradients of the whole op
  w.r.t. q, k, v, g, h0 and none w.r.t. those results."""
  valid = _valid_chunks(start, count, q.shape[0])
  return _outputs(q, v, b, a, h_start, valid, bs, interpret), final


def _outputs_fwd(q, k, v, g, h0, start, count, a, b, h_start, final, bs, interpret):
  out = _outputs_with_grads(q, k, v, g, h0, start, count, a, b, h_start, final, bs,
                            interpret)
  # Keeping the states saves a local-state pass and a sweep in the backward pass;
  # [NC, H, Dk, Dv] is the largest residual, hence bs.recompute_states.
  kept = None if bs.recompute_states else h_start
  return out, (q, k, v, b, h0, start, count, a, kept)


def _outputs_bwd(bs, interpret, res, cot):
  q, k, v, b, h0, start, count, a, h_start = res
  do, dfinal = cot
  valid = _valid_chunks(start, count, q.shape[0])
  if h_start is None:
    h_start, _ = _states(k, v, b, h0, start, count, bs, interpret)
  do = v.with_parts(do, v.dtype) if isinstance(v, Slots) else do.astype(v.dtype)
  dh, dh0 = _dstates(q, do, b, dfinal.astype(jnp.float32), start, count, bs, interpret)
  dv = _dv(k, b, a, do, dh, valid, bs, interpret)
  dq, dk, dg = _dqkb(q, k, b, v, do, h_start, dh, valid, bs, interpret)
  return (_cotangent(dq, q), _cotangent(dk, k), _cotangent(dv, v), _gate_cotangent(dg, q),
          dh0.astype(h0.dtype), None, None, None, None, None, None)


def _cotangent(dx, x):
  """dx as the cotangent of operand x: in x's dtype, or for Slots the Slots of its
  parts, each in its part's dtype."""
  if isinstance(x, Slots):
    return Slots(tuple(d.astype(p.dtype) for d, p in zip(dx, x.parts)), None, x.chunk,
                 x.dtype)
  return dx.astype(x.dtype)


def _gate_cotangent(dg, q):
  """dg (fp32) as the cotangent of the gates, which are fp32 and laid out as q."""
  if isinstance(q, Slots):
    return Slots(tuple(dg), None, q.chunk, jnp.dtype(jnp.float32))
  return dg


_outputs_with_grads.defvjp(_outputs_fwd, _outputs_bwd)


def storage_dtype_for(dtype) -> jnp.dtype:
  """bf16 inputs stay bf16 (bf16 matmuls, fp32 accumulation); others run fp32 (float16
  too: its range overflows in the states)."""
  dtype = jnp.dtype(dtype)
  return dtype if dtype == jnp.bfloat16 else jnp.dtype(jnp.float32)


def default_interpret() -> bool:
  """Pallas-Triton kernels need a GPU; elsewhere they run in interpret mode."""
  return jax.default_backend() != "gpu"


def chunk_gla(q, k, v, g, h0, seg_start, seg_chunks, *, block_sizes=None,
              interpret=None, storage_dtype=None):
  """Chunked GLA over pre-chunked inputs organised in segments (module docstring).

  Args:
    q, k, g: [B, NC, C, H, Dk]; v: [B, NC, C, H, Dv]; q already scaled. q, k, v are
      cast to `storage_dtype` (default: bf16 if q is bf16, else fp32): the dtype of
      the matmul operands. g and everything accumulated are fp32. g is a finite log
      decay <= 0: a hard reset (-inf) must be raised to a large negative value first
      (exp(-200) is 0 in fp32), else differences of in-chunk sums give NaN.
    h0: [Z, H, Dk, Dv] initial state of each segment.
    seg_start, seg_chunks: int [Z]; segment z occupies the flattened chunks
      b * NC + c in [seg_start, seg_start + seg_chunks), never crossing a batch row.
    block_sizes (static): tiles; default BlockSizes(chunk=C).
    interpret (static): run the kernels in interpret mode; default: when the default
      backend is not a GPU (`default_interpret`).
  Returns:
    o [B, NC, C, H, Dv] in v's dtype (zero in chunks of no segment) and the final
    state of each segment [Z, H, Dk, Dv] fp32 (an empty segment keeps h0).
  """
  bsz, nc, c, h, dk = q.shape
  block_sizes = block_sizes or BlockSizes(chunk=c)
  if c != block_sizes.chunk:
    raise ValueError(f"chunk length {c} != block_sizes.chunk={block_sizes.chunk}")
  block_sizes.tiles(dk, v.shape[-1])
  interpret = default_interpret() if interpret is None else interpret
  flat = lambda x: x.reshape((bsz * nc,) + x.shape[2:])
  dtype = storage_dtype or storage_dtype_for(q.dtype)
  q, k, v = (flat(x).astype(dtype) for x in (q, k, v))
  o, final = _core(q, k, v, flat(g).astype(jnp.float32), h0.astype(jnp.float32),
                   seg_start.astype(jnp.int32), seg_chunks.astype(jnp.int32),
                   block_sizes, interpret)
  return o.reshape((bsz, nc) + o.shape[1:]), final


def chunk_gla_slots(q, k, v, g, take, h0, seg_start, seg_chunks, *, covered=None,
                    block_sizes=None, interpret=None, storage_dtype=None):
  """`chunk_gla` on slots that stay where they are (`slot_rows`): no buffer is built.

  Args:
    q, k, g: [P, H, Dk]; v: [P, H, Dv]; or each a tuple of parts [P_j, ...] (the same
      sizes for all four) read as their concatenation. q already scaled.
    take: int32 [NC * C]: the slot behind each row of the chunk buffer that chunk_gla
      would take (each slot behind at most one row); >= P for a padding row.
    h0, seg_start, seg_chunks: as chunk_gla's, over the NC chunks of take.
    covered: bool [P] (or parts), False for a slot behind no row, whose output and
      gradients are then zero; None: every slot is behind a row.
    block_sizes, interpret, storage_dtype: as chunk_gla's (the chunk is
      block_sizes.chunk; rows are cast to the storage dtype as they are loaded).
  Returns:
    o (like v: an array [P, H, Dv] or parts, in the storage dtype) and the final state
    of each segment [Z, H, Dk, Dv] fp32.
  """
  one = not isinstance(q, (tuple, list))
  parts = lambda x: (x,) if one else tuple(x)
  q, k, v, g = map(parts, (q, k, v, g))
  sizes = [tuple(x.shape[0] for x in xs) for xs in (q, k, v, g)]
  if len(set(sizes)) != 1:
    raise ValueError(f"q, k, v, g parts hold {sizes} slots: they must match")
  block_sizes = block_sizes or BlockSizes()
  c = block_sizes.chunk
  block_sizes.tiles(q[0].shape[-1], v[0].shape[-1])
  interpret = default_interpret() if interpret is None else interpret
  dtype = jnp.dtype(storage_dtype or storage_dtype_for(q[0].dtype))
  make = lambda xs, dt: slot_rows.make(xs, take, c, dt)
  g = make(tuple(x.astype(jnp.float32) for x in g), jnp.float32)
  q, k, v = make(q, dtype), make(k, dtype), make(v, dtype)
  if not sum(q.sizes):  # no slots: all rows padding, which the buffer path runs
    o, final = chunk_gla(*(slot_rows.to_buffer(x)[None] for x in (q, k, v, g)), h0,
                         seg_start, seg_chunks, block_sizes=block_sizes,
                         interpret=interpret, storage_dtype=dtype)
    o = tuple(jnp.zeros((0,) + o.shape[3:], o.dtype) for _ in q.parts)
    return (o[0] if one else o), final
  if covered is not None:
    covered = slot_rows.split_like(covered, q)
    q, k, v, g = (slot_rows.zero_uncovered_grads(x, covered) for x in (q, k, v, g))
  o, final = _core(q, k, v, g, h0.astype(jnp.float32), seg_start.astype(jnp.int32),
                   seg_chunks.astype(jnp.int32), block_sizes, interpret)
  if covered is not None:
    o = slot_rows.zero_uncovered(o, covered)
  return (o[0] if one else o), final




def reference(q, k, v, g, h0, seg_start, seg_chunks):
  """What `chunk_gla` computes, one token at a time (for the tests; any float dtype).

  Same arguments and results. Row by row over the flattened B * NC * C tokens:
  S = h0[z] at the first row of segment z, then S = diag(e^g) S + k^T v, o = q S;
  rows of no segment give o = 0 and leave every state alone.
  """
  c, dv = q.shape[2], v.shape[-1]
  rows = lambda x: x.reshape((-1,) + x.shape[3:])                # [B NC C, H, D]
  chunk = jnp.arange(q.shape[0] * q.shape[1])
  inside = ((chunk[:, None] >= seg_start[None]) &
            (chunk[:, None] < (seg_start + seg_chunks)[None]))      # [B NC, Z]
  z = h0.shape[0]
  owner = jnp.where(inside.any(1), jnp.argmax(inside, 1), z)      # Z: no segment
  starts = (owner < z) & (chunk == seg_start[jnp.minimum(owner, z - 1)])
  seg = jnp.repeat(owner, c)
  first = jnp.repeat(starts, c) & (jnp.arange(seg.shape[0]) % c == 0)

  def step(carry, x):
    s, finals = carry
    qt, kt, vt, gt, zt, start = x
    s = jnp.where(start, h0[jnp.minimum(zt, z - 1)], s)
    s = jnp.exp(gt)[..., None] * s + kt[..., None] * vt[..., None, :]
    finals = finals.at[zt].set(s, mode="drop")
    o = jnp.where(zt < z, jnp.einsum("hk,hkv->hv", qt, s), 0)
    return (s, finals), o

  init = (jnp.zeros(h0.shape[1:], h0.dtype), h0)
  (_, finals), o = lax.scan(step, init, (rows(q), rows(k), rows(v), rows(g), seg, first))
  return o.reshape(q.shape[:-1] + (dv,)).astype(v.dtype), finals
