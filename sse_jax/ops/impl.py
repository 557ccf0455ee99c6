"""The `impl` switch: one enum names every implementation of the ops."""

from __future__ import annotations

import enum
import functools
import re

import jax
import jax.numpy as jnp


class Impl(enum.Enum):
  """Implementations of `gla` / `sse`; all compute the same function.

  SCAN     `lax.scan` over time on the whole state: the reference, O(T N Dk Dv).
  CHUNK    chunkwise-parallel GLA in XLA (gla only; sse's building block).
  LOOP     sse: one chunked GLA call per partition on masked inputs (Fig. 6 "loop").
  MASKING  sse: masked copies of q/k/g per partition folded into the head axis, one
           chunked call. Cost and memory ~ (N + 1) x dense: best at short T.
  VARLEN   sse: tokens gathered per (sequence, partition) into one packed, chunk-aligned
           buffer of ~ (K + 1) B T rows, one chunked call, scatter-add back. Cost ~ (K + 1)
           x dense, independent of N: best at long T.
  PALLAS_* the same algorithms with the chunked GLA as Pallas GPU kernels
           (`pallas_kernels.chunk_gla`); without a GPU they run in interpret mode (slow,
           for testing). bf16 inputs stay bf16 in the matmuls (fp32 accumulation);
           float16 runs in fp32 (see `storage_dtype`).
  AUTO     PALLAS_CHUNK / PALLAS_VARLEN where the kernels run compiled (`pallas_gpu`: an
           NVIDIA GPU of compute capability >= 8.0), CHUNK / VARLEN elsewhere.
  """

  SCAN = "scan"
  CHUNK = "chunk"
  LOOP = "loop"
  MASKING = "masking"
  VARLEN = "varlen"
  PALLAS_CHUNK = "pallas_chunk"
  PALLAS_MASKING = "pallas_masking"
  PALLAS_VARLEN = "pallas_varlen"
  AUTO = "auto"

  @property
  def is_pallas(self) -> bool:
    return self.value.startswith("pallas")


GLA_IMPLS = (Impl.SCAN, Impl.CHUNK, Impl.PALLAS_CHUNK, Impl.AUTO)
SSE_IMPLS = (Impl.SCAN, Impl.LOOP, Impl.MASKING, Impl.VARLEN, Impl.PALLAS_MASKING,
             Impl.PALLAS_VARLEN, Impl.AUTO)


PALLAS_MIN_CAPABILITY = (8, 0)  # Ampere on: the kernels do bf16 matmuls (Triton needs sm_80)


def pallas_gpu(device=None) -> bool:
  """Whether the Pallas kernels run compiled on `device` (default: the first local device
  of the default backend): an NVIDIA GPU whose compute capability ("major.minor") is at
  least PALLAS_MIN_CAPABILITY. A T4 (7.5), an AMD GPU ("gfx...") or a CPU is not."""
  if device is None:
    if jax.default_backend() != "gpu":
      return False
    device = jax.local_devices()[0]
  capability = re.fullmatch(r"(\d+)\.(\d+)", str(getattr(device, "compute_capability", "")))
  return capability is not None and (
      (int(capability[1]), int(capability[2])) >= PALLAS_MIN_CAPABILITY)


def resolve_auto(impl: Impl, op: str, head_dims: tuple[int, int] | None = None) -> Impl:
  """AUTO -> the fastest implementation available on the default backend: Pallas where
  the kernels run (`pallas_gpu`) and support the head dims (Dk, Dv), the XLA paths
  otherwise."""
  if impl is not Impl.AUTO:
    return impl
  gpu = pallas_gpu()
  if gpu and head_dims is not None:
    from pallas_kernels import chunk_gla as pallas_chunk_gla  # pylint: disable=g-import-not-at-top
    gpu = all(d in pallas_chunk_gla.HEAD_DIMS for d in head_dims)
  if op == "gla":
    return Impl.PALLAS_CHUNK if gpu else Impl.CHUNK
  return Impl.PALLAS_VARLEN if gpu else Impl.VARLEN


def chunk_core(impl: Impl, storage_dtype):
  """The chunk core behind an implementation (see `chunked.chunk_gla`)."""
  # Imported here: pallas_kernels builds on sse_jax.ops (its reference lives there).
  if impl.is_pallas:
    from pallas_kernels import chunk_gla as pallas_chunk_gla  # pylint: disable=g-import-not-at-top
    return functools.partial(pallas_chunk_gla.chunk_gla, storage_dtype=storage_dtype)
  from sse_jax.ops import chunked  # pylint: disable=g-import-not-at-top
  return chunked.chunk_gla


def storage_dtype(impl: Impl, input_dtypes, compute_dtype):
  """dtype of q, k, v inside the chunked path.

  XLA paths compute in `compute_dtype` (fp32, or fp64 under x64). Pallas keeps bf16
  inputs bf16 (the matmul operands and per-chunk states; accumulation is fp32) when
  all of `input_dtypes` (q, k, v, ...) are bf16, and runs fp32 otherwise: float16's
  5-bit exponent overflows in the states (65504), and mixed inputs must not be
  rounded to the lowest precision among them.
  """
  if not impl.is_pallas:
    return jnp.dtype(compute_dtype)
  if all(jnp.dtype(d) == jnp.bfloat16 for d in input_dtypes):
    return jnp.dtype(jnp.bfloat16)
  return jnp.dtype(jnp.float32)


def trace_key(impl: Impl):
  """What a trace of `impl` depends on beyond its arguments: the Pallas kernels'
  trace-time settings (`pallas_kernels.chunk_gla.trace_settings`), None for the XLA
  impls. The ops pass it as a static argument of their jitted bodies."""
  if not impl.is_pallas:
    return None
  from pallas_kernels import chunk_gla as pallas_chunk_gla  # pylint: disable=g-import-not-at-top
  return pallas_chunk_gla.trace_settings()
