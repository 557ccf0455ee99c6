"""Packed sequences in the layers: S sequences laid end to end along T (B == 1), with
boundaries `cu_seqlens` int [S + 1] (0 = c_0 <= c_1 <= ... <= c_S = T), as `ops.gla`
and `ops.sse` take them.

Every mixer then computes each sequence as if it were alone: the recurrences restart
from a zero state at c_s, the short convolutions see zeros before c_s, attention sees
only its own sequence, and RoPE positions count from 0 at c_s. (The router and the
load-balance loss are per token, so they need nothing.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sse_jax.ops import checks
from sse_jax.ops import reference


def check(owner: str, x: jax.Array, cu_seqlens, cache) -> None:
  """Raises ValueError for cu_seqlens that cannot describe x [B, T, ...] (shape, dtype,
  B != 1, values where concrete), or that come with a cache (decoding runs one
  sequence per batch row: no packing)."""
  if cu_seqlens is None:
    return
  if cache is not None:
    raise ValueError(f"{owner}: cu_seqlens (packed sequences) cannot be combined with a "
                     "cache; decode each sequence in a batch row of its own")
  checks.check_cu_seqlens(jnp.asarray(cu_seqlens), x.shape[0], x.shape[1])


def positions(cu_seqlens: jax.Array, length: int) -> jax.Array:
  """int32 [T]: each token's position within its own sequence (t - c_s)."""
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  seq, _ = reference.sequence_ids(cu, length)
  return jnp.arange(length, dtype=jnp.int32) - cu[seq]


def positions_or_none(cu_seqlens, length: int):
  """`positions`, or None without packing (cu_seqlens None)."""
  return None if cu_seqlens is None else positions(cu_seqlens, length)


def same_sequence(cu_seqlens: jax.Array, length: int) -> jax.Array:
  """bool [T, T]: whether tokens t and u belong to the same sequence."""
  seq, _ = reference.sequence_ids(jnp.asarray(cu_seqlens, jnp.int32), length)
  return seq[:, None] == seq[None, :]
