"""Chunkwise gated delta rule (Gated DeltaNet) forward and backward as Pallas (Triton)
GPU kernels.

The contract is `chunk_gla`'s (pallas_kernels/chunk_gla.py) with one log decay g and one
write strength beta per head and token: inputs are whole chunks of C tokens grouped in
*segments* (a sequence, or one (sequence, partition) of an SSE-GDN layer), each from its
own initial state, padded by the caller to whole chunks (a row with g = beta = 0 and
k = 0 is an identity). `reference` is the same function one token at a time:

  S'_t = e^{g_t} S_{t-1},   S_t = S'_t + beta_t k_t^T (v_t - k_t S'_t),   o_t = q_t S_t

(q already scaled). Per chunk, with G_t = sum_{u <= t} g_u (in-chunk cumulative log
decay), S the state entering the chunk and D_ts = e^{G_t - G_s} for s <= t (else 0):

  A = strict_tril(diag(beta) (K K^T) o D),   T = (I + A)^{-1}          (UT transform)
  W = T diag(beta e^G) K,   U = T diag(beta) V                          (WY terms)
  u = U - W S                   the values the delta rule actually writes
  o = diag(e^G) Q S + (tril(Q K^T) o D) u
  S_next = e^{G_C} S + (diag(e^{G_C - G}) K)^T u

Kernels (grid; what each program does):
  _prepare_kernel (NC, H)          G = cumsum(g), T in [16, 16] blocks (the diagonal
                                   ones by forward substitution, one row per step; the
                                   ones below from them by small matmuls), W and U.
  _states_kernel  (nV, H, Z)       walk a segment's chunks: the state entering each
                                   chunk, u = U - W S, S_next; the final state. The
                                   only sequential part (u depends on S).
  _output_kernel  (NC, H, nV)      o.
  _local_du_kernel (NC, H, nV)     P^T do, where P = tril(Q K^T) o D: the part of du
                                   that does not depend on the state, kept out of the
                                   reverse walk's sequential steps.
  _dstates_kernel (nV, H, Z)       the reverse walk: with dS the gradient of the state
                                   after a chunk, du = P^T do + (e^{G_C - G} K) dS and
                                   dS_prev = e^{G_C} dS + (e^G Q)^T do - W^T du;
                                   dh0 at each segment's start.
  _grads_kernel   (NC, H)          dq, dk, dv, dbeta and dg of one chunk from S, dS,
                                   u, du and T (below), in two passes: the [C, C] terms
                                   over Dv blocks, then dq and dk per Dk tile.

Gradient bookkeeping of one chunk (dP = tril(do u^T), dW = -du S^T):
  dq   = e^G (do S^T) + (dP o D) K
  dk   = e^{G_C - G} (u dS^T) + (dP o D)^T Q + diag(beta e^G) T^T dW + (M + M^T) K
  dv   = diag(beta) T^T du
  dT   = dW (diag(beta e^G) K)^T + du (diag(beta) V)^T,   dA = -T^T dT T^T (strictly lower)
  M    = dA o D o beta (row-scaled)
  dbeta_t = (T^T du)_t . v_t + e^{G_t} (T^T dW)_t . k_t + sum_s dA_ts D_ts k_t . k_s
  dG_t = q_t . dq_inter_t + rowsum(dP o P)_t - colsum(dP o P)_t - k_t . dk_end_t
         + beta_t e^{G_t} (T^T dW)_t . k_t + rowsum(dA o A)_t - colsum(dA o A)_t
         + [t = C-1] (sum_s k_s . dk_end_s + e^{G_C} sum(S o dS))
  dg_u = sum_{t >= u} dG_t
where dq_inter = e^G (do S^T) and dk_end = e^{G_C - G} (u dS^T). Every exponent is a
difference G_t - G_s with s <= t, or G_C - G_s, or G_t: all <= 0, so nothing overflows
(the decay is a scalar per head: no anchoring as in the GLA kernels is needed).

Precision: q, k, v, W, U and the per-chunk states and state gradients handed from the
walks to the parallel kernels are stored in the storage dtype (bf16 for bf16 inputs,
float64 for float64 inputs -- interpret mode, for the tests -- else fp32: the matmuls
that read them round them to it anyway); G, T, the walks' running states, the final
states and every accumulation are fp32 (float64 for float64). Products with T and the
[C, C] score matrices round their fp32 operands to bf16, or by choice use ~16-bit split
operands (`_exact_dot`, `BlockSizes.split_products`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from pallas_kernels import chunk_gla as gla
from pallas_kernels import slot_rows
from pallas_kernels.slot_rows import Slots

HEAD_DIMS = (16, 32, 64, 128)  # the head dims Dk, Dv these kernels support
CHUNKS = (16, 32, 64)  # the chunk lengths they support (T is [C, C], one row per step)


def shape_error(chunk: int | None, dk: int, dv: int) -> str | None:
  """Why the GDN kernels cannot take chunk length `chunk` (None: not checked) and head
  dims (dk, dv), in one line naming the value; None when they can. The one place these
  limits are checked."""
  if chunk is not None and chunk not in CHUNKS:
    return f"chunk_size={chunk!r}: the Pallas GDN kernels take chunk sizes {CHUNKS}"
  for name, d in (("Dk", dk), ("Dv", dv)):
    if d not in HEAD_DIMS:
      return f"{name}={d!r}: the Pallas GDN kernels support head dims {HEAD_DIMS}"
  return None


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles and launch parameters; frozen (hashable): a static argument.

  chunk: C, tokens per chunk. block_v: Dv columns per program of the output and local
  du kernels. walk_block_v: Dv columns per program of the two walks (None: block_v; Dk
  is always whole there: u = U - W S contracts over it); smaller tiles give more
  programs and shorter steps on the op's sequential part. num_warps, num_stages: Triton
  launch settings. walk_stages: the walks' num_stages (None: num_stages); 3 took them at
  L = 32K on an H100 from 0.52 / 0.91 to 0.37 / 0.76 ms, and SSE-GDN at 8K, N = 4 (with
  split_grads) from 2.49 to 2.25 ms.
  split_products: for bf16 storage, the products with T and the
  [C, C] gradient matrices use hi + lo split operands (~16 bits, three bf16 products
  each) rather than operands rounded to bf16 (one product). Off by default: on an H200
  at L = 32K the split products made the gradient kernel 1.9x slower for a largest
  gradient error against float32 of 3.8e-3 instead of 4.6e-3 (fla's: 4.5e-3).
  grads_warps: num_warps of the gradient kernel alone (None: num_warps). grads_block_v:
  the Dv columns the gradient kernel reads at a time (None: block_v). grads_block_k: the
  Dk columns of dq and dk its second pass forms at a time (None: all of Dk).
  prepare_block: the diagonal blocks of T inverted by substitution in the prepare
  kernel (clipped to the chunk; the chunk itself: one whole-chunk substitution).
  split_grads: the gradient kernel's two passes as two kernels, the second with one
  program per (chunk, head, Dk tile) (fla splits its backward so): more, smaller
  programs for the heaviest part, for one more [C, C] round trip through memory (dP o D
  and M, bf16 unless split_products). On an H100 at L = 32K: 2.65 ms in one kernel,
  0.59 + 1.10 ms in two, same errors.
  prefetch: the walks load the next chunk's inputs one step ahead, in registers
  (`chunk_gla._walk`), rather than leaving the loads in the step to Triton's
  pipelining. Off by default: the register copy of the [C, Dk] tiles made the walks
  2-5x slower on an H200. With num_warps = 2 the earlier one-pass gradient kernel
  gave wrong dq, dk, dg and dbeta at C = 64, D = 128 on an H200 (relative error 0.38;
  the tests pass with 2 warps at their small shapes); not measured with this kernel:
  keep 4 or more there.
  gather_rows: the packed paths read their slots in place (`chunk_gdn_slots`, as
  `chunk_gla.BlockSizes.gather_rows`): no row copies into the chunk buffer and back.
  """

  chunk: int = 64
  block_v: int = 64
  num_warps: int = 4
  num_stages: int = 2
  split_products: bool = False
  grads_warps: int | None = None
  # H200, L = 32K: the walks with Dv tiles of 32 (64 programs) instead of 64: forward
  # 0.64 -> 0.51 ms, reverse 1.13 -> 0.92 ms.
  walk_block_v: int | None = 32
  walk_stages: int | None = 3
  grads_block_v: int | None = None
  # H100, L = 32K: the gradient kernel 2.74 ms with all of Dk at once, 2.73 with tiles
  # of 64, 2.24 with tiles of 32 (same errors).
  grads_block_k: int | None = 32
  # H100, L = 32K: prepare 0.77 ms with one whole-chunk substitution, 0.48 ms with
  # [16, 16] blocks.
  prepare_block: int = 16
  split_grads: bool = True
  prefetch: bool = False
  # Off: on an H100 at L = 32K (results/bench_ops/in_place_h100) GDN 4.87 -> 4.98 ms,
  # SSE-GDN varlen 8.67 -> 10.98 ms.
  gather_rows: bool = False

  def __post_init__(self):
    if self.chunk not in CHUNKS:
      raise ValueError(f"chunk={self.chunk} must be one of {CHUNKS}")
    for name in ("block_v", "walk_block_v", "grads_block_v", "grads_block_k"):
      tile = getattr(self, name)
      if tile not in HEAD_DIMS and not (name != "block_v" and tile is None):
        raise ValueError(f"{name}={tile} must be one of {HEAD_DIMS}")
    for name in ("num_warps", "grads_warps"):
      warps = getattr(self, name)
      if warps not in (1, 2, 4, 8, 16) and not (name == "grads_warps" and warps is None):
        raise ValueError(f"{name}={warps} must be a power of 2 <= 16")
    if self.prepare_block not in CHUNKS:
      raise ValueError(f"prepare_block={self.prepare_block} must be one of {CHUNKS}")
    for name in ("num_stages", "walk_stages"):
      stages = getattr(self, name)
      if not (stages is None and name == "walk_stages") and stages < 1:
        raise ValueError(f"{name}={stages} must be >= 1")

  def tile_v(self, dk: int, dv: int) -> int:
    """block_v clipped to Dv; the chunk and head dims are checked here."""
    error = shape_error(self.chunk, dk, dv)
    if error:
      raise ValueError(error)
    return min(self.block_v, dv)

  def for_walks(self) -> "BlockSizes":
    """These block sizes with the walks' launch settings (walk_stages)."""
    return dataclasses.replace(self, num_stages=self.walk_stages or self.num_stages)

  def walk_tile_v(self, dk: int, dv: int) -> int:
    """The walks' Dv tile: walk_block_v (else block_v) clipped to Dv; the chunk and head
    dims are checked here."""
    self.tile_v(dk, dv)
    return min(self.walk_block_v or self.block_v, dv)

  def grads_tile_v(self, dk: int, dv: int) -> int:
    """The gradient kernel's Dv block: grads_block_v (else block_v) clipped to Dv; the
    chunk and head dims are checked here."""
    self.tile_v(dk, dv)
    return min(self.grads_block_v or self.block_v, dv)

  def grads_tile_k(self, dk: int, dv: int) -> int:
    """The Dk tile of the gradient kernel's second pass: grads_block_k (else the whole
    Dk) clipped to Dk; the chunk and head dims are checked here."""
    self.tile_v(dk, dv)
    return min(self.grads_block_k or dk, dk)


# ----------------------------------------------------------------------------------
# In-kernel helpers.


def _acc(dtype) -> jnp.dtype:
  """Accumulation dtype for operands in `dtype`: float64 for float64, else fp32."""
  return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def _dot(a, b, contract, dtype):
  """a . b over `contract`, operands cast to `dtype`, accumulated in _acc(dtype)
  (IEEE products for fp32 / float64: Triton's default would be TF32)."""
  prec = lax.Precision.DEFAULT if dtype == jnp.bfloat16 else lax.Precision.HIGHEST
  return lax.dot_general(a.astype(dtype), b.astype(dtype), (contract, ((), ())),
                         preferred_element_type=_acc(dtype), precision=prec)


def _exact_dot(a, b, contract, dtype, split):
  """a . b for accumulator-precision a, b: where the storage dtype is bf16, bf16 hi + lo
  split products (~16 bits, `chunk_gla._dot_split`) with `split`, else operands rounded
  to bf16 (one product, a third of the tensor-core work); IEEE in _acc(dtype) for
  other storage dtypes."""
  if dtype == jnp.bfloat16:
    return gla._dot_split(a, b, contract, dtype) if split else _dot(a, b, contract, dtype)
  return _dot(a, b, contract, _acc(dtype))


_NN, _NT, _TN = gla._NN, gla._NT, gla._TN


def _iotas(c):
  """Row and column indices of a [C, C] block."""
  return (lax.broadcasted_iota(jnp.int32, (c, c), 0),
          lax.broadcasted_iota(jnp.int32, (c, c), 1))


def _col(x):
  return x.reshape(-1, 1)


def _row(x):
  return x.reshape(1, -1)


def _decay(gc, lower):
  """D [C, C]: e^{G_t - G_s} where lower(t, s) (row t, column s), else 0; the exponent
  is masked before `exp`, so it is never evaluated above 0."""
  rows, cols = _iotas(gc.shape[0])
  mask = lower(rows, cols)
  return jnp.where(mask, jnp.exp(jnp.where(mask, _col(gc) - _row(gc), 0.0)), 0.0)


def _last(gc):
  """G_C: the last element of the in-chunk sums [C], as a scalar (a masked sum:
  Triton cannot index a value)."""
  pos = lax.broadcasted_iota(jnp.int32, gc.shape, 0)
  return jnp.sum(jnp.where(pos == gc.shape[0] - 1, gc, 0.0))


def _scores(q, k, gc, dtype):
  """P = tril(Q K^T) o D [C, C] (diagonal included)."""
  return _decay(gc, lambda t, s: s <= t) * _dot(q, k, _NT, dtype)


# ----------------------------------------------------------------------------------
# Forward kernels.


def _prepare_kernel(k_ref, v_ref, g_ref, beta_ref, gc_ref, t_ref, w_ref, u_ref, *, dtype,
                    split, block):
  """One (chunk, head): G = cumsum(g) [C], T = (I + A)^{-1} [C, C], W [C, Dk] and
  U [C, Dv] (module docstring), in [block, block] blocks of T (nb = C / block).

  T is block lower triangular: each diagonal block T_ii = (I + A_ii)^{-1} by forward
  substitution (row r becomes e_r - sum_{j < r} A_rj T_j, one row per step: block
  steps of [block, block] vector work), the blocks below it by
  T_ij = -T_ii sum_{j <= m < i} A_im T_mj (fp32 products), in order of i. Small
  blocks trade the C steps of [C, C] vector work of a whole-chunk substitution for
  nb (nb - 1) (nb + 1) / 6 small matmuls.
  """
  acc = _acc(dtype)
  xdot = lambda a, b, contract: _exact_dot(a, b, contract, dtype, split)
  nb = k_ref.shape[0] // block
  part = [pl.ds(i * block, block) for i in range(nb)]
  ks = [k_ref[p] for p in part]
  betas = [beta_ref[p].astype(acc) for p in part]
  gcs, offset = [], jnp.zeros((), acc)
  for p in part:  # G block by block: the in-block sums plus all earlier blocks' total
    g = g_ref[p].astype(acc)
    gcs.append(offset + jnp.cumsum(g, axis=0))
    offset = offset + jnp.sum(g)
    gc_ref[p] = gcs[-1]
  rows, cols = _iotas(block)
  eye = (rows == cols).astype(acc)

  def a_block(i, m):
    """A_im [block, block] for m < i: beta_t e^{G_t - G_s} k_t . k_s (exponents <= 0)."""
    return (_col(betas[i]) * jnp.exp(_col(gcs[i]) - _row(gcs[m]))
            * _dot(ks[i], ks[m], _NT, dtype))

  def invert_diagonal(i):
    # A_ii^T[r, c] = A_ii[c, r] = beta_c e^{G_c - G_r} k_c . k_r for r < c; column r
    # of A^T is row r of A as a column, read by a masked sum (Triton cannot slice a
    # value).
    upper = rows < cols
    a_t = jnp.where(upper, _row(betas[i]) * jnp.exp(
        jnp.where(upper, _row(gcs[i]) - _col(gcs[i]), 0.0)), 0.0) * _dot(
            ks[i], ks[i], _NT, dtype)

    def substitute(r, inv):
      a_r = jnp.sum(jnp.where(cols == r, a_t, 0.0), axis=1, keepdims=True)     # [b, 1]
      new = jnp.where(cols == r, 1.0, 0.0) - jnp.sum(a_r * inv, axis=0, keepdims=True)
      return jnp.where(rows == r, new, inv)

    return lax.fori_loop(1, block, substitute, eye)

  t = {}
  for i in range(nb):
    t[i, i] = invert_diagonal(i)
    a_row = {m: a_block(i, m) for m in range(i)}
    for j in range(i - 1, -1, -1):
      below = functools.reduce(jnp.add, [_dot(a_row[m], t[m, j], _NN, acc)
                                         for m in range(j, i)])
      t[i, j] = -_dot(t[i, i], below, _NN, acc)
  kbs = [ks[j].astype(acc) * _col(betas[j] * jnp.exp(gcs[j])) for j in range(nb)]
  vbs = [v_ref[p].astype(acc) * _col(betas[j]) for j, p in enumerate(part)]
  for i, p in enumerate(part):
    for j, q in enumerate(part):
      t_ref[p, q] = (t[i, j] if j <= i else jnp.zeros_like(eye)).astype(t_ref.dtype)
    w_ref[p] = functools.reduce(jnp.add, [xdot(t[i, j], kbs[j], _NN)
                                          for j in range(i + 1)]).astype(w_ref.dtype)
    u_ref[p] = functools.reduce(jnp.add, [xdot(t[i, j], vbs[j], _NN)
                                          for j in range(i + 1)]).astype(u_ref.dtype)


def _states_kernel(start_ref, count_ref, k_ref, w_ref, uu_ref, gc_ref, init_ref, h_ref,
                   u_ref, last_ref, *, dtype, prefetch):
  """Walks segment program_id(2)'s chunks: h_ref[c] = S (the state entering chunk c),
  u_ref[c] = U_c - W_c S, then S = e^{G_C} S + (e^{G_C - G} K)^T u.

  k_ref, w_ref [NC, C, Dk]; uu_ref (U) and u_ref [NC, C, BV]; gc_ref [NC, C];
  h_ref [NC, Dk, BV]; init_ref, last_ref [Dk, BV].
  """
  seg = pl.program_id(2)
  acc = _acc(dtype)

  load, index = slot_rows.walk_loads(k_ref, w_ref, uu_ref, gc_ref)

  def step(c, loaded, s):
    k, w, uu, gc = loaded
    h_ref[c] = s.astype(h_ref.dtype)
    u = uu.astype(acc) - _dot(w, s, _NN, dtype)
    u_ref[c] = u.astype(u_ref.dtype)
    gl = _last(gc.astype(acc))
    k_end = k.astype(acc) * _col(jnp.exp(gl - gc.astype(acc)))
    return jnp.exp(gl) * s + _dot(k_end, u, _TN, dtype)

  last_ref[...] = gla._walk(start_ref[seg], count_ref[seg], h_ref.shape[0], False, load,
                            step, init_ref[...].astype(acc), prefetch, index
                            ).astype(last_ref.dtype)


def _output_kernel(valid_ref, q_ref, k_ref, gc_ref, h_ref, u_ref, o_ref, *, dtype):
  """o [C, BV] = e^G (Q S) + P u for one (chunk, head, Dv block); zero in a chunk of
  no segment. q, k [C, Dk]; gc [C]; h (entering the chunk) [Dk, BV]; u [C, BV]."""
  acc = _acc(dtype)
  valid = valid_ref[pl.program_id(0)] > 0
  gc = gc_ref[...].astype(acc)
  q = q_ref[...]
  out = (_col(jnp.exp(gc)) * _dot(q, h_ref[...], _NN, dtype)
         + _dot(_scores(q, k_ref[...], gc, dtype), u_ref[...], _NN, dtype))
  o_ref[...] = jnp.where(valid, out, 0.0).astype(o_ref.dtype)


# ----------------------------------------------------------------------------------
# Backward kernels.


def _local_du_kernel(q_ref, k_ref, gc_ref, do_ref, out_ref, *, dtype):
  """P^T do [C, BV] for one (chunk, head, Dv block), P = tril(Q K^T) o D: du's term
  that needs no state. q, k [C, Dk]; gc [C]; do [C, BV]."""
  gc = gc_ref[...].astype(_acc(dtype))
  out_ref[...] = _dot(_scores(q_ref[...], k_ref[...], gc, dtype), do_ref[...], _TN,
                      dtype).astype(out_ref.dtype)


def _dstates_kernel(start_ref, count_ref, q_ref, k_ref, w_ref, gc_ref, do_ref, pdo_ref,
                    init_ref, dh_ref, du_ref, last_ref, *, dtype, prefetch):
  """The reverse walk of segment program_id(2): dh_ref[c] = dS (the gradient of the
  state after chunk c), du_ref[c] = P^T do + (e^{G_C - G} K) dS, then
  dS = e^{G_C} dS + (e^G Q)^T do - W^T du; last_ref: the gradient of the segment's
  initial state. q, k, w [NC, C, Dk]; gc [NC, C]; do, P^T do (pdo), du [NC, C, BV];
  dh [NC, Dk, BV]; init (the final state's cotangent), last [Dk, BV]."""
  seg = pl.program_id(2)
  acc = _acc(dtype)

  load, index = slot_rows.walk_loads(q_ref, k_ref, w_ref, gc_ref, do_ref, pdo_ref)

  def step(c, loaded, ds):
    q, k, w, gc, do, pdo = loaded
    gc = gc.astype(acc)
    dh_ref[c] = ds.astype(dh_ref.dtype)
    gl = _last(gc)
    k_end = k.astype(acc) * _col(jnp.exp(gl - gc))
    du = pdo.astype(acc) + _dot(k_end, ds, _NN, dtype)
    du_ref[c] = du.astype(du_ref.dtype)
    q_dec = q.astype(acc) * _col(jnp.exp(gc))
    return (jnp.exp(gl) * ds + _dot(q_dec, do, _TN, dtype)
            - _dot(w, du, _TN, dtype))

  last_ref[...] = gla._walk(start_ref[seg], count_ref[seg], dh_ref.shape[0], True, load,
                            step, init_ref[...].astype(acc), prefetch, index
                            ).astype(last_ref.dtype)


def _gates(gc_ref, beta_ref, dtype):
  """(G, beta, e^G, e^{G_C - G}, G_C) of one chunk [C] in the accumulation dtype."""
  acc = _acc(dtype)
  gc, beta = gc_ref[...].astype(acc), beta_ref[...].astype(acc)
  gl = _last(gc)
  return gc, beta, jnp.exp(gc), jnp.exp(gl - gc), gl


def _grads_square_terms(q_ref, k_ref, v_ref, gates, t_ref, u_ref, h_ref, do_ref, du_ref,
                        dv_ref, valid, *, dtype, split, block_v):
  """The gradient kernels' first pass (module docstring), over Dv blocks of `block_v`:
  do u^T, dv (written), and all of dT through
  dT = dW Kb^T + du (diag(beta) V)^T = du (diag(beta) V - Kb S)^T (dW = -du S^T,
  Kb = diag(beta e^G) K), which needs no dW; then dA. Returns dP o D and
  M = dA o D o beta [C, C], and the [C] parts of dbeta and of dG they give. gates:
  `_gates`.
  """
  acc = _acc(dtype)
  xdot = lambda a, b, contract: _exact_dot(a, b, contract, dtype, split)
  gc, beta, e_g, _, _ = gates
  c = gc.shape[0]
  inv = t_ref[...].astype(acc)
  kb = k_ref[...].astype(acc) * _col(beta * e_g)                          # Kb
  do_u = jnp.zeros((c, c), acc)
  d_t = jnp.zeros((c, c), acc)
  dbeta = jnp.zeros((c,), acc)
  for j in range(dv_ref.shape[1] // block_v):
    block = pl.ds(j * block_v, block_v)
    du = du_ref[:, block].astype(acc)
    vf = v_ref[:, block].astype(acc)
    do_u = do_u + _dot(do_ref[:, block], u_ref[:, block], _NT, dtype)
    d_t = d_t + xdot(du, vf * _col(beta) - _dot(kb, h_ref[:, block], _NN, dtype), _NT)
    dvb = xdot(inv, du, _TN)                                            # T^T dU
    dv_ref[:, block] = jnp.where(valid, _col(beta) * dvb, 0.0).astype(dv_ref.dtype)
    dbeta = dbeta + jnp.sum(dvb * vf, axis=1)
  # o = e^G (Q S) + P u gives dP; the WY terms give dA and M.
  dp = _decay(gc, lambda t, s: s <= t) * do_u                           # dP o D
  dpp = dp * _dot(q_ref[...], k_ref[...], _NT, dtype)                   # dP o P
  rows, cols = _iotas(c)
  d_a = jnp.where(cols < rows, -xdot(xdot(inv, d_t, _TN), inv, _NT), 0.0)
  a_decay = _decay(gc, lambda t, s: s < t)
  kk = _dot(k_ref[...], k_ref[...], _NT, dtype)
  m = d_a * a_decay * _col(beta)                                        # dA o D o beta
  daa = m * kk                                                          # dA o A
  dbeta = dbeta + jnp.sum(d_a * a_decay * kk, axis=1)
  dgc = (jnp.sum(dpp, axis=1) - jnp.sum(dpp, axis=0)
         + jnp.sum(daa, axis=1) - jnp.sum(daa, axis=0))
  return dp, m, dbeta, dgc


def _grads_tile_terms(qf, kf, h_of, dh_of, gates, inv, dp, m, u_ref, do_ref, du_ref, *,
                      dtype, split, block_v):
  """The second pass for one Dk tile: qf, kf [C, BK] (accumulation dtype);
  h_of(block), dh_of(block): the tile's rows of S and dS in a Dv block [BK, BV].
  Returns the tile's dq and dk [C, BK] and its parts of dbeta and dG [C], the end
  share (sum_s k_s . dk_end_s + e^{G_C} sum(S o dS) over the tile) added at t = C - 1.
  """
  acc = _acc(dtype)
  xdot = lambda a, b, contract: _exact_dot(a, b, contract, dtype, split)
  _, beta, e_g, e_end, gl = gates
  c, bk = kf.shape
  do_h = jnp.zeros((c, bk), acc)
  u_dh = jnp.zeros((c, bk), acc)
  dw = jnp.zeros((c, bk), acc)
  end_share = jnp.zeros((), acc)
  for j in range(u_ref.shape[1] // block_v):
    block = pl.ds(j * block_v, block_v)
    h, dh = h_of(block), dh_of(block)
    do_h = do_h + _dot(do_ref[:, block], h, _NT, dtype)
    u_dh = u_dh + _dot(u_ref[:, block], dh, _NT, dtype)
    dw = dw - _dot(du_ref[:, block], h, _NT, dtype)
    end_share = end_share + jnp.exp(gl) * jnp.sum(h.astype(acc) * dh.astype(acc))
  dq_inter = _col(e_g) * do_h
  dk_end = _col(e_end) * u_dh
  dkb = xdot(inv, dw, _TN)                                              # T^T dW
  kb_dot = jnp.sum(dkb * kf, axis=1)                                    # (T^T dW)_t . k_t
  dq = dq_inter + xdot(dp, kf, _NN)
  dk = (dk_end + xdot(dp, qf, _TN) + _col(beta * e_g) * dkb + xdot(m, kf, _NN)
        + xdot(m, kf, _TN))
  end_share = end_share + jnp.sum(kf * dk_end)
  pos = lax.broadcasted_iota(jnp.int32, (c,), 0)
  dgc = (jnp.sum(qf * dq_inter, axis=1) - jnp.sum(kf * dk_end, axis=1)
         + beta * e_g * kb_dot + jnp.where(pos == c - 1, end_share, 0.0))
  return dq, dk, e_g * kb_dot, dgc


def _suffix_sums(x, axis=0):
  """sum_{t >= u} x_t along `axis` (dg from dG)."""
  return jnp.sum(x, axis=axis, keepdims=True) - jnp.cumsum(x, axis=axis) + x


def _grads_kernel(valid_ref, q_ref, k_ref, v_ref, gc_ref, beta_ref, t_ref, u_ref, h_ref,
                  dh_ref, do_ref, du_ref, dq_ref, dk_ref, dv_ref, dbeta_ref, dg_ref, *,
                  dtype, split, block_k, block_v):
  """dq, dk [C, Dk], dv [C, Dv], dbeta and dg [C] of one (chunk, head), from the state
  entering it (h), the gradient of the state after it (dh), u, du and T (module
  docstring); zero in a chunk of no segment.

  Two passes, so that no [C, Dk] accumulator is live beside the [C, C] ones (at
  C = 64, Dk = Dv = 128 the one-pass form needs ~256 fp32 registers per thread at 4
  warps): the [C, C] terms over Dv blocks (`_grads_square_terms`), then per Dk tile of
  `block_k`, each from its own pass over Dv blocks, the tile's dq and dk
  (`_grads_tile_terms`).
  """
  acc = _acc(dtype)
  kw = dict(dtype=dtype, split=split, block_v=block_v)
  valid = valid_ref[pl.program_id(0)] > 0
  gates = _gates(gc_ref, beta_ref, dtype)
  dp, m, dbeta, dgc = _grads_square_terms(q_ref, k_ref, v_ref, gates, t_ref, u_ref, h_ref,
                                          do_ref, du_ref, dv_ref, valid, **kw)
  # T is read again per tile rather than kept live across the tiles (registers).
  for i in range(k_ref.shape[1] // block_k):
    tile = pl.ds(i * block_k, block_k)
    dq, dk, dbeta_i, dgc_i = _grads_tile_terms(
        q_ref[:, tile].astype(acc), k_ref[:, tile].astype(acc),
        lambda block: h_ref[tile, block], lambda block: dh_ref[tile, block], gates,
        t_ref[...].astype(acc), dp, m, u_ref, do_ref, du_ref, **kw)
    dq_ref[:, tile] = jnp.where(valid, dq, 0.0).astype(dq_ref.dtype)
    dk_ref[:, tile] = jnp.where(valid, dk, 0.0).astype(dk_ref.dtype)
    dbeta, dgc = dbeta + dbeta_i, dgc + dgc_i
  dbeta_ref[...] = jnp.where(valid, dbeta, 0.0).astype(dbeta_ref.dtype)
  dg_ref[...] = jnp.where(valid, _suffix_sums(dgc), 0.0).astype(dg_ref.dtype)


def _grads_square_kernel(valid_ref, q_ref, k_ref, v_ref, gc_ref, beta_ref, t_ref, u_ref,
                         h_ref, do_ref, du_ref, dv_ref, dp_ref, m_ref, dbeta_ref, dgc_ref,
                         *, dtype, split, block_v):
  """split_grads, first kernel, one (chunk, head): dv [C, Dv], dP o D and M [C, C],
  and the [C] parts of dbeta and dG from them (`_grads_square_terms`); zero in a
  chunk of no segment."""
  valid = valid_ref[pl.program_id(0)] > 0
  dp, m, dbeta, dgc = _grads_square_terms(
      q_ref, k_ref, v_ref, _gates(gc_ref, beta_ref, dtype), t_ref, u_ref, h_ref, do_ref,
      du_ref, dv_ref, valid, dtype=dtype, split=split, block_v=block_v)
  for ref, x in ((dp_ref, dp), (m_ref, m), (dbeta_ref, dbeta), (dgc_ref, dgc)):
    ref[...] = jnp.where(valid, x, 0.0).astype(ref.dtype)


def _grads_tile_kernel(valid_ref, q_ref, k_ref, gc_ref, beta_ref, t_ref, u_ref, h_ref,
                       dh_ref, do_ref, du_ref, dp_ref, m_ref, dq_ref, dk_ref, dbeta_ref,
                       dgc_ref, *, dtype, split, block_v):
  """split_grads, second kernel, one (chunk, head, Dk tile): the tile's dq and dk
  [C, BK] and its parts of dbeta and dG [C] (`_grads_tile_terms`), from the first
  kernel's dP o D and M; zero in a chunk of no segment. q, k [C, BK]; h, dh [BK, Dv]."""
  acc = _acc(dtype)
  valid = valid_ref[pl.program_id(0)] > 0
  dq, dk, dbeta, dgc = _grads_tile_terms(
      q_ref[...].astype(acc), k_ref[...].astype(acc), lambda block: h_ref[:, block],
      lambda block: dh_ref[:, block], _gates(gc_ref, beta_ref, dtype),
      t_ref[...].astype(acc), dp_ref[...].astype(acc), m_ref[...].astype(acc), u_ref,
      do_ref, du_ref, dtype=dtype, split=split, block_v=block_v)
  for ref, x in ((dq_ref, dq), (dk_ref, dk), (dbeta_ref, dbeta), (dgc_ref, dgc)):
    ref[...] = jnp.where(valid, x, 0.0).astype(ref.dtype)


# ----------------------------------------------------------------------------------
# pallas_call wrappers. Arrays: q, k [NC, C, H, Dk]; v [NC, C, H, Dv]; g, beta, G
# [NC, C, H]; T [NC, H, C, C]; states [NC | Z, H, Dk, Dv]; tables int32 [Z] / [NC].


def _call(kernel, name, bs, interpret, *, grid, ins, outs):
  """The kernel over `ins` / `outs` ((array or Slots, spec) pairs, `slot_rows.call`):
  a list of its outputs."""
  return slot_rows.call(kernel, grid=grid, ins=ins, outs=outs,
                        compiler_params=gla._params(bs), interpret=interpret, name=name)


def _prepare(k, v, g, beta, bs, interpret):
  """(G [NC, C, H], T [NC, H, C, C], W like k, U like v)."""
  nc, c, h, dk = k.shape
  dv = v.shape[-1]
  acc = _acc(k.dtype)
  spec = lambda d: pl.BlockSpec((None, c, None, d), lambda n, hh: (n, 0, hh, 0))
  gate = pl.BlockSpec((None, c, None), lambda n, hh: (n, 0, hh))
  return _call(
      functools.partial(_prepare_kernel, dtype=k.dtype, split=bs.split_products,
                        block=min(bs.prepare_block, c)),
      "gdn_prepare", bs, interpret, grid=(nc, h),
      ins=[(k, spec(dk)), (v, spec(dv)), (g, gate), (beta, gate)],
      outs=[(jax.ShapeDtypeStruct(g.shape, acc), gate),
            (jax.ShapeDtypeStruct((nc, h, c, c), acc),
             pl.BlockSpec((None, None, c, c), lambda n, hh: (n, hh, 0, 0))),
            (jax.ShapeDtypeStruct(k.shape, k.dtype), spec(dk)),
            (jax.ShapeDtypeStruct(v.shape, v.dtype), spec(dv))])


def _walk_specs(nc, c, dk, bv):
  """For walk grids (Dv tile, head, segment): specs of a segment's [Dk, BV] state
  tile, the per-chunk states [NC, Dk, BV], whole key-side [NC, C, Dk] and value-side
  [NC, C, BV] inputs, and the gates [NC, C]."""
  state = pl.BlockSpec((None, None, dk, bv), lambda j, hh, s: (s, hh, 0, j))
  per_chunk = pl.BlockSpec((nc, None, dk, bv), lambda j, hh, s: (0, hh, 0, j))
  keys = pl.BlockSpec((nc, c, None, dk), lambda j, hh, s: (0, 0, hh, 0))
  values = pl.BlockSpec((nc, c, None, bv), lambda j, hh, s: (0, 0, hh, j))
  gates = pl.BlockSpec((nc, c, None), lambda j, hh, s: (0, 0, hh))
  return state, per_chunk, keys, values, gates


def _walk_longest_first(call, start, count, init, *arrays):
  """call(start', count', *arrays, init') with the segment table reordered longest
  segment first (the walk grid's slowest axis is the segment: the longest, the op's
  critical path, start first; `chunk_gla._longest_first`), the last output (one state
  per segment) permuted back to segment order."""
  order = jnp.argsort(-count, stable=True).astype(jnp.int32)
  *per_chunk, last = call(start[order], count[order], *arrays, init[order])
  return (*per_chunk, jnp.zeros_like(last).at[order].set(last))


def _states(k, w, uu, gc, h0, start, count, bs, interpret):
  """(state entering each chunk [NC, H, Dk, Dv] in k's dtype, u like U, final state
  per segment)."""
  nc, c, h, dk = k.shape
  dv = uu.shape[-1]
  z = h0.shape[0]
  bv = bs.walk_tile_v(dk, dv)
  state, per_chunk, keys, values, gates = _walk_specs(nc, c, dk, bv)
  whole = gla._whole(z)
  call = lambda s0, n0, k, w, uu, gc, init: _call(
      functools.partial(_states_kernel, dtype=k.dtype, prefetch=bs.prefetch), "gdn_states",
      bs.for_walks(), interpret, grid=(dv // bv, h, z),
      ins=[(s0, whole), (n0, whole), (k, keys), (w, keys), (uu, values), (gc, gates),
           (init, state)],
      outs=[(jax.ShapeDtypeStruct((nc, h, dk, dv), k.dtype), per_chunk),
            (jax.ShapeDtypeStruct(uu.shape, uu.dtype), values),
            (jax.ShapeDtypeStruct(h0.shape, h0.dtype), state)])
  return _walk_longest_first(call, start, count, h0, k, w, uu, gc)


def _tile_specs(c, dk, bv):
  """For (chunk, head, Dv tile) grids: specs of a chunk's key-side [C, Dk] and
  value-side [C, BV] tiles and of its gates [C]."""
  keys = pl.BlockSpec((None, c, None, dk), lambda n, hh, j: (n, 0, hh, 0))
  values = pl.BlockSpec((None, c, None, bv), lambda n, hh, j: (n, 0, hh, j))
  gates = pl.BlockSpec((None, c, None), lambda n, hh, j: (n, 0, hh))
  return keys, values, gates


def _outputs(q, k, gc, h_start, u, valid, bs, interpret):
  nc, c, h, dk = q.shape
  dv = u.shape[-1]
  bv = bs.tile_v(dk, dv)
  keys, values, gates = _tile_specs(c, dk, bv)
  return _call(
      functools.partial(_output_kernel, dtype=q.dtype), "gdn_outputs", bs, interpret,
      grid=(nc, h, dv // bv),
      ins=[(valid, gla._whole(nc)), (q, keys), (k, keys), (gc, gates),
           (h_start, pl.BlockSpec((None, None, dk, bv), lambda n, hh, j: (n, hh, 0, j))),
           (u, values)],
      outs=[(slot_rows.like(q, u.shape[2:], u.dtype), values)])[0]


def _local_du(q, k, gc, do, bs, interpret):
  """P^T do [NC, C, H, Dv] fp32 (see _local_du_kernel)."""
  nc, c, h, dk = q.shape
  bv = bs.tile_v(dk, do.shape[-1])
  keys, values, gates = _tile_specs(c, dk, bv)
  return _call(
      functools.partial(_local_du_kernel, dtype=q.dtype), "gdn_local_du", bs, interpret,
      grid=(nc, h, do.shape[-1] // bv),
      ins=[(q, keys), (k, keys), (gc, gates), (do, values)],
      outs=[(jax.ShapeDtypeStruct(do.shape, _acc(q.dtype)), values)])[0]


def _dstates(q, k, w, gc, do, dfinal, start, count, bs, interpret):
  """(gradient of the state after each chunk [NC, H, Dk, Dv] in q's dtype, du
  [NC, C, H, Dv] fp32, gradient of each segment's initial state)."""
  nc, c, h, dk = q.shape
  dv = do.shape[-1]
  z = dfinal.shape[0]
  bv = bs.walk_tile_v(dk, dv)
  state, per_chunk, keys, values, gates = _walk_specs(nc, c, dk, bv)
  whole = gla._whole(z)
  acc = _acc(q.dtype)
  pdo = _local_du(q, k, gc, do, bs, interpret)
  call = lambda s0, n0, q, k, w, gc, do, pdo, init: _call(
      functools.partial(_dstates_kernel, dtype=q.dtype, prefetch=bs.prefetch),
      "gdn_dstates", bs.for_walks(), interpret, grid=(dv // bv, h, z),
      ins=[(s0, whole), (n0, whole), (q, keys), (k, keys), (w, keys), (gc, gates),
           (do, values), (pdo, values), (init, state)],
      outs=[(jax.ShapeDtypeStruct((nc, h, dk, dv), q.dtype), per_chunk),
            (jax.ShapeDtypeStruct(do.shape, acc), values),
            (jax.ShapeDtypeStruct(dfinal.shape, acc), state)])
  return _walk_longest_first(call, start, count, dfinal, q, k, w, gc, do, pdo)


def _grads(q, k, v, gc, beta, inv, u, h_start, dh, do, du, valid, bs, interpret):
  """(dq, dk, dv) in the storage dtype, (dbeta, dg) in the accumulation dtype (see
  _grads_kernel; with bs.split_grads, _grads_square_kernel then _grads_tile_kernel).
  The op returns gradients in its inputs' dtype: written so here, they need no fp32
  copy and conversion pass."""
  nc, c, h, dk = q.shape
  dv = v.shape[-1]
  acc = _acc(q.dtype)
  bk, bv = bs.grads_tile_k(dk, dv), bs.grads_tile_v(dk, dv)
  kw = dict(dtype=q.dtype, split=bs.split_products, block_v=bv)
  grads_bs = dataclasses.replace(bs, num_warps=bs.grads_warps or bs.num_warps)
  spec = lambda d: pl.BlockSpec((None, c, None, d), lambda n, hh, *_: (n, 0, hh, 0))
  gate = pl.BlockSpec((None, c, None), lambda n, hh, *_: (n, 0, hh))
  square = pl.BlockSpec((None, None, c, c), lambda n, hh, *_: (n, hh, 0, 0))
  state = pl.BlockSpec((None, None, dk, dv), lambda n, hh: (n, hh, 0, 0))
  shape = lambda x, dtype=acc: slot_rows.like(x, x.shape[2:], dtype)
  if not bs.split_grads:
    return tuple(_call(
        functools.partial(_grads_kernel, block_k=bk, **kw), "gdn_grads", grads_bs,
        interpret, grid=(nc, h),
        ins=list(zip((valid, q, k, v, gc, beta, inv, u, h_start, dh, do, du),
                     (gla._whole(nc), spec(dk), spec(dk), spec(dv), gate, gate, square,
                      spec(dv), state, state, spec(dv), spec(dv)))),
        outs=[(shape(q, q.dtype), spec(dk)), (shape(k, k.dtype), spec(dk)),
              (shape(v, v.dtype), spec(dv)), (shape(gc), gate), (shape(gc), gate)]))
  # dP o D and M are only read as bf16 products unless split_products: stored so.
  square_dtype = acc if bs.split_products else q.dtype
  square_shape = jax.ShapeDtypeStruct((nc, h, c, c), square_dtype)
  grad_v, dp, m, dbeta, dgc = _call(
      functools.partial(_grads_square_kernel, **kw), "gdn_grads_square", grads_bs,
      interpret, grid=(nc, h),
      ins=list(zip((valid, q, k, v, gc, beta, inv, u, h_start, do, du),
                   (gla._whole(nc), spec(dk), spec(dk), spec(dv), gate, gate, square,
                    spec(dv), state, spec(dv), spec(dv)))),
      outs=[(shape(v, v.dtype), spec(dv)), (square_shape, square), (square_shape, square),
            (shape(gc), gate), (shape(gc), gate)])
  keys = pl.BlockSpec((None, c, None, bk), lambda n, hh, i: (n, 0, hh, i))
  rows = pl.BlockSpec((None, None, bk, dv), lambda n, hh, i: (n, hh, i, 0))
  part = pl.BlockSpec((None, None, c, None), lambda n, hh, i: (i, n, 0, hh))
  parts = jax.ShapeDtypeStruct((dk // bk,) + gc.shape, acc)
  grad_q, grad_k, dbeta_k, dgc_k = _call(
      functools.partial(_grads_tile_kernel, **kw), "gdn_grads_tiles", grads_bs, interpret,
      grid=(nc, h, dk // bk),
      ins=list(zip((valid, q, k, gc, beta, inv, u, h_start, dh, do, du, dp, m),
                   (gla._whole(nc), keys, keys, gate, gate, square, spec(dv), rows, rows,
                    spec(dv), spec(dv), square, square))),
      outs=[(shape(q, q.dtype), keys), (shape(k, k.dtype), keys), (parts, part),
            (parts, part)])
  dgc = dgc + jnp.sum(dgc_k, axis=0)
  return (grad_q, grad_k, grad_v, dbeta + jnp.sum(dbeta_k, axis=0),
          _suffix_sums(dgc, axis=1))


# ----------------------------------------------------------------------------------
# custom_vjp core over (q, k, v, g, beta, h0) with static tables.


def _core(q, k, v, g, beta, h0, start, count, bs, interpret):
  """(o, final) with gradients for (q, k, v, g, beta, h0), split as `chunk_gla._core`:
  the forward kernels whose results the backward pass reads run outside the
  custom_vjp on stopped gradients, named `chunk_gla.RESIDUAL_NAME`, so that a
  checkpoint saving only those recomputes the rest without running them again."""
  stop = lax.stop_gradient
  kept = _forward_kernels(stop(q), stop(k), stop(v), stop(g), stop(beta), stop(h0),
                          start, count, bs, interpret)
  return _outputs_with_grads(q, k, v, g, beta, h0, start, count, *kept, bs, interpret)


# A jit of its own, as `chunk_gla._forward_kernels` (an unused jit is pruned).
@functools.partial(jax.jit, static_argnums=(8, 9))
def _forward_kernels(q, k, v, g, beta, h0, start, count, bs, interpret):
  """(gc, inv, w, u, h_start, final), each named RESIDUAL_NAME."""
  gc, inv, w, uu = _prepare(k, v, g, beta, bs, interpret)
  h_start, u, final = _states(k, w, uu, gc, h0, start, count, bs, interpret)
  kept = functools.partial(checkpoint_name, name=gla.RESIDUAL_NAME)
  return tuple(map(kept, (gc, inv, w, u, h_start, final)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(14, 15))
def _outputs_with_grads(q, k, v, g, beta, h0, start, count, gc, inv, w, u, h_start,
                        final, bs, interpret):
  """(o, final) from the forward kernels' results (computed from the inputs by
  `_core`); the backward pass gives the gradients of the whole op w.r.t. q, k, v, g,
  beta, h0 and none w.r.t. those results."""
  valid = gla._valid_chunks(start, count, q.shape[0])
  return _outputs(q, k, gc, h_start, u, valid, bs, interpret), final


def _outputs_fwd(q, k, v, g, beta, h0, start, count, gc, inv, w, u, h_start, final, bs,
                 interpret):
  out = _outputs_with_grads(q, k, v, g, beta, h0, start, count, gc, inv, w, u, h_start,
                            final, bs, interpret)
  return out, (q, k, v, beta, gc, inv, w, u, h_start, h0, start, count)


def _outputs_bwd(bs, interpret, res, cot):
  q, k, v, beta, gc, inv, w, u, h_start, h0, start, count = res
  do, dfinal = cot
  valid = gla._valid_chunks(start, count, q.shape[0])
  do = v.with_parts(do, v.dtype) if isinstance(v, Slots) else do.astype(v.dtype)
  dh, du, dh0 = _dstates(q, k, w, gc, do, dfinal.astype(h0.dtype), start, count, bs,
                         interpret)
  dq, dk, dv, dbeta, dg = _grads(q, k, v, gc, beta, inv, u, h_start, dh, do, du, valid,
                                 bs, interpret)
  if isinstance(q, Slots):  # written in the storage dtype: cast to each part's own
    dq, dk, dv = (gla._cotangent(d, x) for d, x in ((dq, q), (dk, k), (dv, v)))
  return (dq, dk, dv, dg, dbeta.astype(beta.dtype), dh0.astype(h0.dtype), None, None,
          None, None, None, None, None, None)


_outputs_with_grads.defvjp(_outputs_fwd, _outputs_bwd)


def storage_dtype_for(dtype) -> jnp.dtype:
  """bf16 inputs stay bf16 (bf16 matmuls, fp32 accumulation), float64 stays float64
  (interpret mode: the tests), others run fp32 (float16's range overflows)."""
  dtype = jnp.dtype(dtype)
  return dtype if dtype in (jnp.bfloat16, jnp.float64) else jnp.dtype(jnp.float32)


def chunk_gdn(q, k, v, g, beta, h0, seg_start, seg_chunks, *, block_sizes=None,
              interpret=None, storage_dtype=None):
  """The chunked gated delta rule over pre-chunked inputs organised in segments.

  Args:
    q, k: [B, NC, C, H, Dk] (q already scaled); v: [B, NC, C, H, Dv]; g, beta:
      [B, NC, C, H]. q, k, v are cast to `storage_dtype` (default
      `storage_dtype_for(q.dtype)`), the matmul operands; g and beta run in the
      accumulation dtype (fp32, float64 for float64 storage). g is a finite log decay
      <= 0 (a -inf reset must be raised to a large negative value first); beta the
      write strength. A row with g = beta = 0 and k = 0 is an identity (padding).
    h0: [Z, H, Dk, Dv] initial state of each segment.
    seg_start, seg_chunks: int [Z]; segment z occupies the flattened chunks
      b * NC + c in [seg_start, seg_start + seg_chunks), never crossing a batch row.
    block_sizes (static): `BlockSizes`; default BlockSizes(chunk=C).
    interpret (static): Pallas interpret mode; default: off a GPU
      (`chunk_gla.default_interpret`).
  Returns:
    o [B, NC, C, H, Dv] in v's dtype (zero in chunks of no segment) and the final state
    of each segment [Z, H, Dk, Dv] in the accumulation dtype (an empty segment keeps
    h0).
  """
  bsz, nc, c, h, dk = q.shape
  block_sizes = block_sizes or BlockSizes(chunk=c)
  if c != block_sizes.chunk:
    raise ValueError(f"chunk length {c} != block_sizes.chunk={block_sizes.chunk}")
  block_sizes.tile_v(dk, v.shape[-1])
  interpret = gla.default_interpret() if interpret is None else interpret
  dtype = jnp.dtype(storage_dtype or storage_dtype_for(q.dtype))
  acc = _acc(dtype)
  flat = lambda x: x.reshape((bsz * nc,) + x.shape[2:])
  q, k, v = (flat(x).astype(dtype) for x in (q, k, v))
  o, final = _core(q, k, v, flat(g).astype(acc), flat(beta).astype(acc), h0.astype(acc),
                   seg_start.astype(jnp.int32), seg_chunks.astype(jnp.int32),
                   block_sizes, interpret)
  return o.reshape((bsz, nc) + o.shape[1:]), final


def chunk_gdn_slots(q, k, v, g, beta, take, h0, seg_start, seg_chunks, *, covered=None,
                    block_sizes=None, interpret=None, storage_dtype=None):
  """`chunk_gdn` on slots that stay where they are (`slot_rows`), as
  `chunk_gla.chunk_gla_slots`: q, k [P, H, Dk], v [P, H, Dv], g, beta [P, H], or each
  a tuple of parts; take int32 [NC * C], the slot behind each buffer row (>= P:
  padding); covered: None or bool [P] (parts), False for a slot behind no row (zero
  output and gradients). q, k, v are read in place; the gates, 1/D of a row of q,
  are gathered into their [NC, C, H] buffers in XLA. Returns o (like v, in the storage
  dtype) and the final state of each segment."""
  one = not isinstance(q, (tuple, list))
  parts = lambda x: (x,) if one else tuple(x)
  q, k, v, g, beta = map(parts, (q, k, v, g, beta))
  sizes = [tuple(x.shape[0] for x in xs) for xs in (q, k, v, g, beta)]
  if len(set(sizes)) != 1:
    raise ValueError(f"q, k, v, g, beta parts hold {sizes} slots: they must match")
  block_sizes = block_sizes or BlockSizes()
  c = block_sizes.chunk
  block_sizes.tile_v(q[0].shape[-1], v[0].shape[-1])
  interpret = gla.default_interpret() if interpret is None else interpret
  dtype = jnp.dtype(storage_dtype or storage_dtype_for(q[0].dtype))
  acc = _acc(dtype)
  q, k, v = (slot_rows.make(x, take, c, dtype) for x in (q, k, v))
  g, beta = (slot_rows.to_buffer(slot_rows.make(tuple(p.astype(acc) for p in x), take, c))
             for x in (g, beta))
  if not sum(q.sizes):  # no slots: all rows padding, which the buffer path runs
    o, final = chunk_gdn(*(slot_rows.to_buffer(x)[None] for x in (q, k, v)), g[None],
                         beta[None], h0, seg_start, seg_chunks, block_sizes=block_sizes,
                         interpret=interpret, storage_dtype=dtype)
    o = tuple(jnp.zeros((0,) + o.shape[3:], o.dtype) for _ in q.parts)
    return (o[0] if one else o), final
  if covered is not None:
    covered = slot_rows.split_like(covered, q)
    q, k, v = (slot_rows.zero_uncovered_grads(x, covered) for x in (q, k, v))
  o, final = _core(q, k, v, g, beta, h0.astype(acc), seg_start.astype(jnp.int32),
                   seg_chunks.astype(jnp.int32), block_sizes, interpret)
  if covered is not None:
    o = slot_rows.zero_uncovered(o, covered)
  return (o[0] if one else o), final


def reference(q, k, v, g, beta, h0, seg_start, seg_chunks):
  """What `chunk_gdn` computes, one token at a time (for the tests; any float dtype).

  Same arguments and results. Row by row over the flattened B * NC * C tokens:
  S = h0[z] at the first row of segment z, then S' = e^g S,
  S = S' + beta k^T (v - k S'), o = q S; rows of no segment give o = 0 and leave every
  state alone.
  """
  c, dv = q.shape[2], v.shape[-1]
  rows = lambda x: x.reshape((-1,) + x.shape[3:])                # [B NC C, H, ...]
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
    qt, kt, vt, gt, bt, zt, start = x
    s = jnp.where(start, h0[jnp.minimum(zt, z - 1)], s)
    s = jnp.exp(gt)[:, None, None] * s
    recalled = jnp.einsum("hk,hkv->hv", kt, s)
    s = s + kt[..., None] * (bt[:, None] * (vt - recalled))[:, None, :]
    finals = finals.at[zt].set(s, mode="drop")
    o = jnp.where(zt < z, jnp.einsum("hk,hkv->hv", qt, s), 0)
    return (s, finals), o

  init = (jnp.zeros(h0.shape[1:], h0.dtype), h0)
  (_, finals), o = lax.scan(step, init, (rows(q), rows(k), rows(v), rows(g), rows(beta),
                                         seg, first))
  return o.reshape(q.shape[:-1] + (dv,)).astype(v.dtype), finals
