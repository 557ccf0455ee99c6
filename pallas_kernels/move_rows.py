"""Row gathers y[i] = x[take[i]] as a Pallas (Triton) GPU kernel.

The varlen ops move every slot (a token of a packed sequence, a token routed to a
partition) into a chunk-aligned buffer and the outputs back: a gather of whole rows,
x [P, F] -> y [R, F], where take[i] in [0, P) names the row of x that row i of y
copies and any other value (the padding rows) gives a row of zeros. XLA's own gather
computes the same, but fuses with its producers and consumers; in a training step those
often have T as the minor dimension (projection outputs, cotangents bound for weight
gradients), and the fused gather then touches each row one strided element at a time
(docs/kernels.md, "Row moves"). A kernel is a fusion boundary with row-major operands,
and each program loads `rows` indices once and copies a [rows, cols] tile with one
masked vector load.

x may also be a tuple of sources [P_1, F], [P_2, F], ... read as their concatenation
along the rows (take indexes P_1 + P_2 + ... rows), without materialising it: the SSE
varlen op packs its routed and its shared-partition slots this way, where concatenating
them first would copy every slot once more.

Grid: (ceil(R / rows), F / cols); a program copies rows [i rows, (i + 1) rows) of y,
columns [j cols, (j + 1) cols), with one masked load per source. `reference` is the
same gather in XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile of y one program copies: `rows` x `cols` (powers of 2; cols is clipped to the
  largest power of 2 dividing the row width, so tiles are whole); num_warps: Triton
  launch setting."""

  rows: int = 32
  cols: int = 256
  num_warps: int = 4

  def __post_init__(self):
    for name in ("rows", "cols", "num_warps"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value!r} must be a power of 2")


Sources = jax.Array | tuple[jax.Array, ...]


def reference(x: Sources, take: jax.Array) -> jax.Array:
  """y[i] = x[take[i]] for 0 <= take[i] < P, else zeros; x [P, ...] (or a tuple of
  sources, concatenated along axis 0), take int [R]."""
  if isinstance(x, (tuple, list)):
    x = jnp.concatenate(x, axis=0)
  if x.shape[0] == 0:
    return jnp.zeros(take.shape + x.shape[1:], x.dtype)
  inside = (take >= 0) & (take < x.shape[0])
  rows = jnp.take(x, jnp.where(inside, take, 0), axis=0, mode="clip")
  return jnp.where(inside.reshape((-1,) + (1,) * (x.ndim - 1)), rows,
                   jnp.zeros((), x.dtype))


def _kernel(take_ref, *refs, spans: tuple[tuple[int, int], ...], cols: int):
  """refs: one x_ref per source, then y_ref; spans: each source's (first row, rows) in
  the concatenated index space."""
  *x_refs, y_ref = refs
  idx = take_ref[...]
  col = pl.program_id(1) * cols + jnp.arange(cols)
  y = None
  for x_ref, (first, size) in zip(x_refs, spans):
    local = idx - first
    inside = (local >= 0) & (local < size)
    mask = jnp.broadcast_to(inside[:, None], (idx.shape[0], cols))
    # The index of a masked-off row is never dereferenced; 0 keeps the address in range.
    src = jnp.where(inside, local, 0)
    part = plgpu.load(x_ref.at[src[:, None], col[None, :]], mask=mask, other=0)
    # A select, not a sum, keeps every copied value's bits (-0.0 + 0.0 would be +0.0).
    y = part if y is None else jnp.where(mask, part, y)
  y_ref[...] = y


def move_rows(x: Sources, take: jax.Array, *, block_sizes: BlockSizes | None = None,
              interpret: bool = False) -> jax.Array:
  """y [R, ...] with y[i] = x[take[i]] for 0 <= take[i] < P and zeros elsewhere.

  x: [P, ...] (any trailing shape, any dtype), or a tuple of sources of one trailing
  shape and dtype, indexed as their concatenation along axis 0 (P their total rows);
  take: int32 [R]. block_sizes, interpret (static): the tile and Pallas interpret mode
  (for tests off the GPU).
  """
  bs = block_sizes or BlockSizes()
  sources = tuple(x) if isinstance(x, (tuple, list)) else (x,)
  if not sources:
    raise ValueError("move_rows needs at least one source array")
  trailing, dtype = sources[0].shape[1:], sources[0].dtype
  for i, src in enumerate(sources):
    if src.shape[1:] != trailing or src.dtype != dtype:
      raise ValueError(f"source {i} has rows of shape {src.shape[1:]} and dtype {src.dtype},"
                       f" source 0 {trailing} and {dtype}: sources must match")
  r = take.shape[0]
  width = 1
  for d in trailing:
    width *= d
  spans, first = [], 0
  for src in sources:
    spans.append((first, src.shape[0]))
    first += src.shape[0]
  # Empty sources take no index; they are dropped (a zero-row block is not a tile).
  kept = [(src, span) for src, span in zip(sources, spans) if span[1] > 0]
  if r == 0 or width == 0 or not kept:
    return jnp.zeros((r,) + trailing, dtype)
  flats = [src.reshape(src.shape[0], width) for src, _ in kept]
  padded = -(-r // bs.rows) * bs.rows
  # Padded index rows are -1: outside, so they copy zeros and are cut off below.
  take = jnp.pad(take.astype(jnp.int32), (0, padded - r), constant_values=-1)
  cols = min(bs.cols, width & -width)  # a power of 2 dividing the width: whole tiles
  y = pl.pallas_call(
      functools.partial(_kernel, spans=tuple(span for _, span in kept), cols=cols),
      grid=(padded // bs.rows, pl.cdiv(width, cols)),
      in_specs=[pl.BlockSpec((bs.rows,), lambda i, j: (i,))] + [
          pl.BlockSpec(flat.shape, lambda i, j: (0, 0)) for flat in flats],
      out_specs=pl.BlockSpec((bs.rows, cols), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((padded, width), dtype),
      compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=1),
      interpret=interpret, name="move_rows",
  )(take, *flats)
  return y[:r].reshape((r,) + trailing)
