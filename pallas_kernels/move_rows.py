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

Grid: (ceil(R / rows), F / cols); a program copies rows [i rows, (i + 1) rows) of y,
columns [j cols, (j + 1) cols). `reference` is the same gather in XLA.
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


def reference(x: jax.Array, take: jax.Array) -> jax.Array:
  """y[i] = x[take[i]] for 0 <= take[i] < P, else zeros; x [P, ...], take int [R]."""
  if x.shape[0] == 0:
    return jnp.zeros(take.shape + x.shape[1:], x.dtype)
  inside = (take >= 0) & (take < x.shape[0])
  rows = jnp.take(x, jnp.where(inside, take, 0), axis=0, mode="clip")
  return jnp.where(inside.reshape((-1,) + (1,) * (x.ndim - 1)), rows,
                   jnp.zeros((), x.dtype))


def _kernel(take_ref, x_ref, y_ref, *, num_src: int, cols: int):
  idx = take_ref[...]
  inside = (idx >= 0) & (idx < num_src)
  col = pl.program_id(1) * cols + jnp.arange(cols)
  mask = jnp.broadcast_to(inside[:, None], (idx.shape[0], cols))
  # The index of a masked-off row is never dereferenced; 0 keeps the address in range.
  src = jnp.where(inside, idx, 0)
  y_ref[...] = plgpu.load(x_ref.at[src[:, None], col[None, :]], mask=mask, other=0)


def move_rows(x: jax.Array, take: jax.Array, *, block_sizes: BlockSizes | None = None,
              interpret: bool = False) -> jax.Array:
  """y [R, ...] with y[i] = x[take[i]] for 0 <= take[i] < P and zeros elsewhere.

  x: [P, ...] (any trailing shape, any dtype); take: int32 [R]. block_sizes, interpret
  (static): the tile and Pallas interpret mode (for tests off the GPU).
  """
  bs = block_sizes or BlockSizes()
  p, r = x.shape[0], take.shape[0]
  trailing = x.shape[1:]
  width = 1
  for d in trailing:
    width *= d
  if r == 0 or width == 0 or p == 0:
    return jnp.zeros((r,) + trailing, x.dtype)
  flat = x.reshape(p, width)
  padded = -(-r // bs.rows) * bs.rows
  # Padded index rows are -1: outside, so they copy zeros and are cut off below.
  take = jnp.pad(take.astype(jnp.int32), (0, padded - r), constant_values=-1)
  cols = min(bs.cols, width & -width)  # a power of 2 dividing the width: whole tiles
  y = pl.pallas_call(
      functools.partial(_kernel, num_src=p, cols=cols),
      grid=(padded // bs.rows, pl.cdiv(width, cols)),
      in_specs=[pl.BlockSpec((bs.rows,), lambda i, j: (i,)),
                pl.BlockSpec((p, width), lambda i, j: (0, 0))],
      out_specs=pl.BlockSpec((bs.rows, cols), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((padded, width), x.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=1),
      interpret=interpret, name="move_rows",
  )(take, flat)
  return y[:r].reshape((r,) + trailing)
