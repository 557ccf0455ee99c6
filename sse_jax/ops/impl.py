"""The `impl` switch: one enum names every implementation of the ops."""

from __future__ import annotations

import enum


class Impl(enum.Enum):
  """Implementations of `gla` / `sse`; all compute the same function.

  SCAN     `lax.scan` over time on the whole state: the reference, O(T N Dk Dv).
  CHUNK    chunkwise-parallel GLA (gla only; sse's building block).
  LOOP     sse: one chunked GLA call per partition on masked inputs (Fig. 6 "loop").
  MASKING  sse: masked copies of q/k/g per partition folded into the head axis, one
           chunked call. Cost and memory ~ (N + 1) x dense: best at short T.
  VARLEN   sse: tokens gathered per (sequence, partition) into one packed, chunk-aligned
           buffer of ~ (K + 1) B T rows, one chunked call, scatter-add back. Cost ~ (K + 1)
           x dense, independent of N: best at long T.
  """

  SCAN = "scan"
  CHUNK = "chunk"
  LOOP = "loop"
  MASKING = "masking"
  VARLEN = "varlen"


GLA_IMPLS = (Impl.SCAN, Impl.CHUNK)
SSE_IMPLS = (Impl.SCAN, Impl.LOOP, Impl.MASKING, Impl.VARLEN)
