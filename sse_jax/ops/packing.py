"""Chunk-aligned packing of variable-length segments, with static shapes.

A "slot" is one (token, segment) occurrence: a token of a packed sequence (GLA with
`cu_seqlens`), or a token routed to a partition (SSE varlen: one slot per selected
partition, plus one per token for the shared partition). Slots are listed in time
order; a stable sort by segment id groups them per segment and keeps time order inside
each segment. Every segment then starts on a fresh chunk, so a chunked kernel needs no
in-chunk boundary handling: padding rows are k = 0, g = 0, q = 0 (exact identities).

Shapes stay static under `jit`: with P slots, Z segments and chunk length C, the
padded buffer holds at most ceil(P / C) + Z chunks, whatever the routing.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


# The name (`jax.ad_checkpoint.checkpoint_name`) of the layout's index tables: small
# (int32 per slot or row), and a checkpoint that saves them (`impl.keep_kernel_residuals`)
# does not sort the slots again in the backward pass.
LAYOUT_NAME = "packing_layout"

# (x [P, ...], take int32 [R]) -> y [R, ...], y[i] = x[take[i]] for 0 <= take[i] < P and
# zeros elsewhere: how rows are copied (`take_rows` in XLA; the Pallas ops pass
# `pallas_kernels.move_rows.move_rows`, which copies whole tiles instead of elements).
# x may be a tuple of sources, indexed as their concatenation along axis 0.
RowMover = Callable[[jax.Array | tuple[jax.Array, ...], jax.Array], jax.Array]

# Slot values given as parts: one array, or a tuple of arrays [P_1, ...], [P_2, ...], ...
# that stand for their concatenation along the slot axis without being concatenated.
Parts = jax.Array | tuple[jax.Array, ...]


def as_parts(x: Parts) -> tuple[jax.Array, ...]:
  """x as a tuple of parts: a lone array becomes a tuple of one."""
  return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def part_sizes(**operands: tuple[jax.Array, ...]) -> tuple[int, ...]:
  """The slots in each part, common to every operand (name=parts); raises a ValueError
  naming the first operand whose parts are cut differently from the first one's."""
  (first, parts), *others = operands.items()
  sizes = tuple(x.shape[0] for x in parts)
  for name, x in others:
    if tuple(part.shape[0] for part in x) != sizes:
      raise ValueError(f"{name}'s parts hold {[part.shape[0] for part in x]} slots, "
                       f"{first}'s {list(sizes)}: the parts must match")
  return sizes


def take_rows(x: Parts, take: jax.Array) -> jax.Array:
  """The XLA row mover (`RowMover`): a gather that fills out-of-range rows with 0."""
  if isinstance(x, (tuple, list)):
    x = jnp.concatenate(x, axis=0)  # XLA fuses it into the gather's operand
  if x.shape[0] == 0:  # no slots (e.g. T = 0): nothing to take, all rows are padding
    return jnp.zeros(take.shape + x.shape[1:], x.dtype)
  return jnp.take(x, take, axis=0, mode="fill", fill_value=0)


class ChunkLayout(NamedTuple):
  """Where each slot lives in the padded buffer, and where each segment lives.

  rows [P]: buffer row of each slot. seg_start / seg_chunks [Z]: first chunk and
  number of chunks of each segment (0 for an empty one). seg_len [Z]: its slots.
  """

  rows: jax.Array
  seg_start: jax.Array
  seg_chunks: jax.Array
  seg_len: jax.Array


def max_chunks(num_slots: int, num_segments: int, chunk_size: int) -> int:
  """Static bound on the number of chunks: sum_z ceil(len_z / C) <= ceil(P/C) + Z."""
  return -(-num_slots // chunk_size) + num_segments


def chunk_layout(slot_segment: jax.Array, num_segments: int, chunk_size: int,
                 presorted: bool = False, sorted_tail: int = 0) -> ChunkLayout:
  """Builds the layout for slots with segment ids `slot_segment` [P] (int).

  presorted (static): the caller guarantees that slot_segment is non-decreasing (GLA's
  packed sequences), so a slot's position is already its place in segment order and
  no sort is needed. sorted_tail (static): the same guarantee for the last
  `sorted_tail` slots only, whose ids are also >= every id before them (SSE varlen's
  shared-partition slots after the routed ones): only the slots before them are
  sorted. Ids that break either promise give a wrong layout, silently: it is not
  checked, since checking would need a host sync under `jit`.
  """
  p = slot_segment.shape[0]
  if not 0 <= sorted_tail <= p:
    raise ValueError(f"sorted_tail={sorted_tail} must be in [0, {p}] (the number of slots)")
  seg_len = jnp.zeros((num_segments,), jnp.int32).at[slot_segment].add(1)
  seg_offset = jnp.cumsum(seg_len) - seg_len
  seg_chunks = -(-seg_len // chunk_size)
  seg_start = jnp.cumsum(seg_chunks) - seg_chunks

  # Rank of each slot inside its segment: its position after a stable sort by segment.
  head = 0 if presorted else p - sorted_tail
  sorted_pos = jnp.arange(p, dtype=jnp.int32)
  if head:
    order = jnp.argsort(slot_segment[:head], stable=True)
    sorted_pos = sorted_pos.at[order].set(jnp.arange(head, dtype=jnp.int32))
  rank = sorted_pos - seg_offset[slot_segment]
  rows = seg_start[slot_segment] * chunk_size + rank
  return ChunkLayout(*(checkpoint_name(x, LAYOUT_NAME)
                       for x in (rows, seg_start, seg_chunks, seg_len)))


def drop_invalid(rows: jax.Array, valid: jax.Array | None, num_rows: int) -> jax.Array:
  """rows [P] with the slots where valid [P] is False sent out of the buffer (row
  num_rows): `scatter_rows` then leaves their rows zero (the slot keeps its place in
  its segment, as an identity row), `gather_rows` gives them zeros, and their gradients
  are zero. valid None: rows unchanged. Cheaper than zeroing the slots' values, which
  would copy every slot once more."""
  if valid is None:
    return rows
  return jnp.where(valid, rows, num_rows)


def scatter_rows(x: Parts, rows: jax.Array, num_rows: int,
                 move: RowMover = take_rows) -> jax.Array:
  """Places slot values x [P, ...] at buffer rows [P] (distinct; a row out of [0,
  num_rows) drops its slot); other rows are zero.
  x may be a tuple of parts (`Parts`), the slots in order across them: the buffer is
  filled from the parts directly, and their gradients come back as a tuple.
  move (static): the `RowMover` that copies them (and their cotangents back)."""
  parts = as_parts(x)
  inverse = split_slots(rows, tuple(part.shape[0] for part in parts))
  return _pack(parts, slot_of_row(rows, num_rows), inverse, move)


def gather_rows(buffer: jax.Array, rows: jax.Array, move: RowMover = take_rows,
                sizes: tuple[int, ...] | None = None) -> Parts:
  """buffer[rows] [P, ...] for distinct rows: the inverse of `scatter_rows`. sizes
  (static): return the slots as a tuple of parts of these lengths (summing to P)
  instead, each copied out of the buffer directly."""
  takes = split_slots(rows, (rows.shape[0],) if sizes is None else tuple(sizes))
  out = _unpack(buffer, takes, slot_of_row(rows, buffer.shape[0]), move)
  return out[0] if sizes is None else out


def split_slots(rows: jax.Array, sizes: tuple[int, ...]) -> tuple[jax.Array, ...]:
  """A per-slot array [P] (row numbers, flags) cut into parts of `sizes` slots (slices
  of an int32 or bool vector: cheap beside the values)."""
  if sum(sizes) != rows.shape[0]:
    raise ValueError(f"sizes={sizes} must sum to the {rows.shape[0]} slots of rows")
  out, start = [], 0
  for n in sizes:
    out.append(rows[start:start + n])
    start += n
  return tuple(out)


def slot_of_row(rows: jax.Array, num_rows: int) -> jax.Array:
  """int32 [num_rows]: the slot placed at each buffer row, or P for a padding row."""
  p = rows.shape[0]
  slots = jnp.full((num_rows,), p, jnp.int32).at[rows].set(
      jnp.arange(p, dtype=jnp.int32), mode="drop")  # rows out of range: dropped slots
  return checkpoint_name(slots, LAYOUT_NAME)


# Packing and unpacking are each other's transpose: both are row copies by `move`, so
# neither backward pass is XLA's transpose of a gather (a scatter-add, atomics on GPU).
# Being custom_vjps they support reverse mode only (no `jax.jvp` through the packed
# paths, as for the Pallas kernels).


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pack(parts, take, inverse, move):
  """y[i] = concat(parts)[take[i]] by `move`, zero where take[i] is out of range (a
  padding row). take hits each slot at most once; inverse[j] [P_j] holds, for each slot
  of part j, the row i with take[i] equal to it."""
  return move(parts[0] if len(parts) == 1 else parts, take)


def _pack_fwd(parts, take, inverse, move):
  return _pack(parts, take, inverse, move), (take, inverse)


def _pack_bwd(move, res, dy):
  take, inverse = res
  return _unpack(dy, inverse, take, move), None, None


_pack.defvjp(_pack_fwd, _pack_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _unpack(buffer, takes, inverse, move):
  """parts[j] = buffer[takes[j]] by `move`, a tuple; inverse [R]: for each buffer row
  the slot (in the parts' concatenation) placed there, out of range for none."""
  return tuple(move(buffer, take) for take in takes)


def _unpack_fwd(buffer, takes, inverse, move):
  return _unpack(buffer, takes, inverse, move), (takes, inverse)


def _unpack_bwd(move, res, dparts):
  takes, inverse = res
  return _pack(tuple(dparts), inverse, takes, move), None, None


_unpack.defvjp(_unpack_fwd, _unpack_bwd)
