"""How an op is computed: an algorithm and, for the chunked ones, a chunk core.

    Plan(Algorithm.VARLEN, PallasCore(BlockSizes(chunk=64), interpret=False))

The typed form is what the ops dispatch on (`match ... case _: raise`); every field is
a static parameter of their jitted bodies, so a change of block sizes or interpret
mode retraces them. The public `impl=` strings ("chunk", "pallas_varlen", "auto", ...,
the `Impl` enum) are a thin parser over it: `plan(impl, op, ...)`. docs/design.md,
section 3, compares the algorithms and their cost.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import chunk_gdn as gdn_kernels
from pallas_kernels import chunk_gla as kernels
from pallas_kernels import move_rows as move_kernels
from sse_jax.ops import checks
from sse_jax.ops import chunked
from sse_jax.ops import packing


class Algorithm(enum.Enum):
  """How the recurrence is organised.

  SCAN     `lax.scan` over time on the whole state: the reference, O(T N Dk Dv).
  CHUNK    chunkwise-parallel GLA (gla only; the building block of the others).
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


GLA_ALGORITHMS = (Algorithm.SCAN, Algorithm.CHUNK)
SSE_ALGORITHMS = (Algorithm.SCAN, Algorithm.LOOP, Algorithm.MASKING, Algorithm.VARLEN)
# The delta-rule ops (gdn, sse_gdn): the same algorithms on the gated delta rule.
GDN_ALGORITHMS = GLA_ALGORITHMS
SSE_GDN_ALGORITHMS = (Algorithm.SCAN, Algorithm.MASKING, Algorithm.VARLEN)


@dataclasses.dataclass(frozen=True)
class XlaCore:
  """The chunk core in plain XLA (`chunked.chunk_gla`); computes in the compute dtype."""


@dataclasses.dataclass(frozen=True)
class PallasCore:
  """The Pallas GPU kernels (`pallas_kernels.chunk_gla`; `chunk_gdn` for the delta-rule
  ops) as the chunk core.

  block_sizes: their tiles, a `BlockSizes` of that kernel module whose `chunk` is the
    op's chunk size; None: BlockSizes(chunk=chunk_size), filled in by `plan`.
  interpret: run them in Pallas interpret mode (slow; for tests off the GPU); None:
    when the default backend is not a GPU, filled in by `plan`.
  bf16 inputs stay bf16 in the matmuls (fp32 accumulation); others run fp32
  (`storage_dtype`).
  """

  block_sizes: kernels.BlockSizes | gdn_kernels.BlockSizes | None = None
  interpret: bool | None = None


Core = XlaCore | PallasCore


@dataclasses.dataclass(frozen=True)
class Plan:
  """An algorithm and its chunk core (None for SCAN, which has none)."""

  algorithm: Algorithm
  core: Core | None = None

  @property
  def name(self) -> str:
    """The `impl` string of this plan's algorithm and core kind ("pallas_varlen")."""
    prefix = "pallas_" if isinstance(self.core, PallasCore) else ""
    return prefix + self.algorithm.value


class Impl(enum.Enum):
  """The `impl=` strings of `gla` / `sse`; all compute the same function.

  Each names an `Algorithm` (the same word) with the XLA chunk core; PALLAS_* use the
  Pallas core instead, compiled on a GPU and in interpret mode elsewhere (slow, for
  testing). AUTO: PALLAS_CHUNK / PALLAS_VARLEN where the kernels run compiled
  (`pallas_gpu`: an NVIDIA GPU of compute capability >= 8.0) and take the chunk size
  and head dims, CHUNK / VARLEN elsewhere.
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


GLA_IMPLS = (Impl.SCAN, Impl.CHUNK, Impl.PALLAS_CHUNK, Impl.AUTO)
SSE_IMPLS = (Impl.SCAN, Impl.LOOP, Impl.MASKING, Impl.VARLEN, Impl.PALLAS_MASKING,
             Impl.PALLAS_VARLEN, Impl.AUTO)
GDN_IMPLS = GLA_IMPLS
SSE_GDN_IMPLS = (Impl.SCAN, Impl.MASKING, Impl.VARLEN, Impl.PALLAS_MASKING,
                 Impl.PALLAS_VARLEN, Impl.AUTO)
_OPS = {"gla": (GLA_IMPLS, GLA_ALGORITHMS), "sse": (SSE_IMPLS, SSE_ALGORITHMS),
        "gdn": (GDN_IMPLS, GDN_ALGORITHMS), "sse_gdn": (SSE_GDN_IMPLS, SSE_GDN_ALGORITHMS)}
DELTA_OPS = ("gdn", "sse_gdn")


def kernels_for(op: str):
  """The Pallas kernel module of `op`: `chunk_gdn` for the delta-rule ops, else
  `chunk_gla`."""
  return gdn_kernels if op in DELTA_OPS else kernels


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


def resolve_auto(impl: Impl, op: str, head_dims: tuple[int, int] | None = None,
                 chunk_size: int | None = None) -> Impl:
  """AUTO -> the fastest implementation available on the default backend: Pallas where
  the kernels run (`pallas_gpu`) and take the head dims (Dk, Dv) and chunk size, the
  XLA paths otherwise. Other impls are returned as they are."""
  if impl is not Impl.AUTO:
    return impl
  pallas = pallas_gpu()
  if pallas and head_dims is not None:
    pallas = kernels_for(op).shape_error(chunk_size, *head_dims) is None
  return auto_choice(op, pallas)


def auto_choice(op: str, pallas: bool) -> Impl:
  """What AUTO picks for `op` where the Pallas kernels run (`pallas`) or do not."""
  if op in ("gla", "gdn"):
    return Impl.PALLAS_CHUNK if pallas else Impl.CHUNK
  return Impl.PALLAS_VARLEN if pallas else Impl.VARLEN


# What each concrete `Impl` string names (AUTO names none until `resolve_auto`).
_NAMED = {
    Impl.SCAN: Plan(Algorithm.SCAN),
    Impl.CHUNK: Plan(Algorithm.CHUNK, XlaCore()),
    Impl.LOOP: Plan(Algorithm.LOOP, XlaCore()),
    Impl.MASKING: Plan(Algorithm.MASKING, XlaCore()),
    Impl.VARLEN: Plan(Algorithm.VARLEN, XlaCore()),
    Impl.PALLAS_CHUNK: Plan(Algorithm.CHUNK, PallasCore()),
    Impl.PALLAS_MASKING: Plan(Algorithm.MASKING, PallasCore()),
    Impl.PALLAS_VARLEN: Plan(Algorithm.VARLEN, PallasCore()),
}


def named(impl: Impl | str) -> Plan:
  """The plan an `impl` string names, its Pallas fields left for `plan` to fill in."""
  impl = checks.parse_enum(Impl, impl, "impl")
  if impl not in _NAMED:
    raise ValueError(f"impl={impl.value!r} names no single plan; resolve it first "
                     "(resolve_auto)")
  return _NAMED[impl]


def plan(impl, op: str, *, chunk_size: int,
         head_dims: tuple[int, int]) -> tuple[Plan, int]:
  """`impl` (an `Impl` string, or a `Plan`) as a complete plan for `op` ("gla", "sse",
  "gdn" or "sse_gdn") at this chunk size and head dims (Dk, Dv): AUTO resolved, the
  Pallas fields filled in, and everything checked here, with a one-line ValueError
  naming the value. Returns the chunk size as an int too: (plan, chunk_size). The
  delta-rule ops' XLA core takes any positive chunk size (the op checks it), their
  Pallas core the `chunk_gdn` kernels' sizes."""
  impls, algorithms = _OPS[op]
  pallas_kernels = kernels_for(op)
  chunk_size = int(chunk_size) if op in DELTA_OPS else check_chunk_size(chunk_size)
  if isinstance(impl, Plan):
    resolved = impl
  else:
    parsed = checks.parse_enum(Impl, impl, "impl")
    if parsed not in impls:
      names = ", ".join(repr(i.value) for i in impls)
      raise ValueError(f"impl={parsed.value!r} is not available for {op}; choose one of {names}")
    resolved = named(resolve_auto(parsed, op, head_dims, chunk_size))
  if resolved.algorithm not in algorithms:
    names = ", ".join(a.value for a in algorithms)
    got = getattr(resolved.algorithm, "value", resolved.algorithm)
    raise ValueError(f"impl algorithm {got!r} is not available for {op}; choose one of "
                     f"{names}")
  match resolved.algorithm, resolved.core:
    case Algorithm.SCAN, None:
      return resolved, chunk_size
    case Algorithm.SCAN, core:
      raise ValueError(f"impl algorithm 'scan' takes no chunk core, got {core!r}")
    case _, XlaCore():
      return resolved, chunk_size
    case _, PallasCore(block_sizes=block_sizes, interpret=interpret):
      error = pallas_kernels.shape_error(chunk_size, *head_dims)
      if error:
        raise ValueError(f"{error} (impl={resolved.name!r})")
      if block_sizes is not None and not isinstance(block_sizes,
                                                    pallas_kernels.BlockSizes):
        raise ValueError(f"block_sizes={block_sizes!r} is not a "
                         f"{pallas_kernels.__name__}.BlockSizes, which {op} needs")
      if block_sizes is not None and block_sizes.chunk != chunk_size:
        raise ValueError(f"block_sizes.chunk={block_sizes.chunk} must equal "
                         f"chunk_size={chunk_size}")
      core = PallasCore(block_sizes or pallas_kernels.BlockSizes(chunk=chunk_size),
                        kernels.default_interpret() if interpret is None else bool(interpret))
      return dataclasses.replace(resolved, core=core), chunk_size
    case algorithm, core:
      raise ValueError(f"impl core {core!r} does not fit algorithm {algorithm.value!r}")


def check_chunk_size(chunk_size) -> int:
  """chunk_size as an int: a positive multiple of the XLA core's sub-chunk length (16),
  which every core needs (the Pallas kernels take fewer: `kernels.shape_error`)."""
  sub = chunked.SUBCHUNK
  if (isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer))
      or chunk_size < sub or chunk_size % sub):
    raise ValueError(f"chunk_size={chunk_size!r} must be a positive multiple of {sub}")
  return int(chunk_size)


def storage_dtype(core: Core | None, input_dtypes, compute_dtype) -> jnp.dtype:
  """dtype of q, k, v inside the chunked path.

  XLA paths compute in `compute_dtype` (fp32, or fp64 under x64). Pallas keeps bf16
  inputs bf16 (the matmul operands and per-chunk states; accumulation is fp32) when
  all of `input_dtypes` (q, k, v, ...) are bf16, and runs fp32 otherwise: float16's
  5-bit exponent overflows in the states (65504), and mixed inputs must not be
  rounded to the lowest precision among them.
  """
  match core:
    case None | XlaCore():
      return jnp.dtype(compute_dtype)
    case PallasCore():
      if all(jnp.dtype(d) == jnp.bfloat16 for d in input_dtypes):
        return jnp.dtype(jnp.bfloat16)
      return jnp.dtype(jnp.float32)
    case _:
      raise ValueError(f"unknown chunk core {core!r}")


def row_mover(core: Core | None) -> packing.RowMover:
  """How the packed paths copy rows into their chunk-aligned buffer and back: XLA's
  gather for the XLA core, the Pallas kernel (`pallas_kernels.move_rows`, in the core's
  interpret mode) for the Pallas one."""
  match core:
    case None | XlaCore():
      return packing.take_rows
    case PallasCore(interpret=interpret):
      return functools.partial(move_kernels.move_rows, interpret=interpret)
    case _:
      raise ValueError(f"unknown chunk core {core!r}")


def keep_kernel_residuals(fn, core: Core | None):
  """fn, for a Pallas core under `jax.checkpoint` with a policy that saves only the
  kernels' own residuals (`kernels.RESIDUAL_NAME`: scores, gate sums, chunk states)
  and the packing's index tables (`packing.LAYOUT_NAME`); fn itself for other cores.

  What it saves: the packed paths build copies of their inputs (routed and shared
  slots gathered into chunk-aligned buffers, masked per-partition copies) that the
  kernels' backward reads. Kept, they are the largest part of an SSE layer's memory
  beyond a GLA layer's; recomputed in the backward pass from fn's inputs, they cost a
  second pass of the packing, row copies and elementwise glue (no kernel reruns); with
  BlockSizes.gather_rows there are no buffers, and what is recomputed is the slots
  themselves (routed copies of q, k and g, floored gates). The XLA core's residuals
  carry no names, so under this policy its whole forward pass
  would run again: it keeps its residuals instead.
  """
  match core:
    case PallasCore():
      policy = jax.checkpoint_policies.save_only_these_names(kernels.RESIDUAL_NAME,
                                                             packing.LAYOUT_NAME)
      return jax.checkpoint(fn, policy=policy)
    case None | XlaCore():
      return fn
    case _:
      raise ValueError(f"unknown chunk core {core!r}")


def core_fn(core: Core, qkv_dtype):
  """The chunk core function (contract: `chunked.chunk_gla`) with the core's static
  parameters bound."""
  match core:
    case XlaCore():
      return chunked.chunk_gla
    case PallasCore(block_sizes=block_sizes, interpret=interpret):
      return pallas_chunk_core(kernels.chunk_gla, kernels.chunk_gla_slots, block_sizes,
                               interpret, qkv_dtype)
    case _:
      raise ValueError(f"unknown chunk core {core!r}")


@dataclasses.dataclass(frozen=True)
class PallasChunkCore:
  """A Pallas chunk core with its static parameters bound: called as a chunk core on
  packed buffers (the contract of `chunked.chunk_gla`, or `gdn.chunk_gdn`'s); `slots`:
  the same on slots that stay in place (`chunk_gla_slots` / `chunk_gdn_slots`, which
  take the buffer's row table), which the packed paths call instead of copying rows
  into a buffer and back; None unless the BlockSizes' `gather_rows`."""

  on_buffers: Callable
  slots: Callable | None

  def __call__(self, *args):
    return self.on_buffers(*args)


def pallas_chunk_core(on_buffers, in_place, block_sizes, interpret, qkv_dtype):
  """The PallasChunkCore of a kernel module's two entry points and static parameters."""
  bound = lambda fn: functools.partial(fn, block_sizes=block_sizes, interpret=interpret,
                                       storage_dtype=qkv_dtype)
  return PallasChunkCore(bound(on_buffers),
                         bound(in_place) if block_sizes.gather_rows else None)
