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

from typing import NamedTuple

import jax
import jax.numpy as jnp


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


def chunk_layout(slot_segment: jax.Array, num_segments: int,
                 chunk_size: int) -> ChunkLayout:
  """Builds the layout for slots with segment ids `slot_segment` [P] (int)."""
  p = slot_segment.shape[0]
  seg_len = jnp.zeros((num_segments,), jnp.int32).at[slot_segment].add(1)
  seg_offset = jnp.cumsum(seg_len) - seg_len
  seg_chunks = -(-seg_len // chunk_size)
  seg_start = jnp.cumsum(seg_chunks) - seg_chunks

  # Rank of each slot inside its segment: its position after a stable sort by segment.
  order = jnp.argsort(slot_segment, stable=True)
  sorted_pos = jnp.zeros((p,), jnp.int32).at[order].set(jnp.arange(p, dtype=jnp.int32))
  rank = sorted_pos - seg_offset[slot_segment]
  rows = seg_start[slot_segment] * chunk_size + rank
  return ChunkLayout(rows, seg_start, seg_chunks, seg_len)


def scatter_rows(x: jax.Array, rows: jax.Array, num_rows: int) -> jax.Array:
  """Places slot values x [P, ...] at buffer rows; other rows are zero.

  Implemented as a gather (buffer row -> slot, or a zero row) because the rows are
  distinct; its transpose is then a cheap gather-add on the way back.
  """
  p = x.shape[0]
  slot_of_row = jnp.full((num_rows,), p, jnp.int32).at[rows].set(
      jnp.arange(p, dtype=jnp.int32))
  padded = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])
  return padded[slot_of_row]
