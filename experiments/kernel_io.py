"""The bytes each Pallas kernel of a program moves if it reads every operand and writes
every result once: the floor its measured time is held against (achieved bandwidth).

    io = kernel_io.io_bytes(fn, *args)          # {pallas_call name: bytes per call of fn}
    kernel_io.bandwidth(io, ms_by_kernel)       # {name: GB/s} for the kernels timed

`io_bytes` lowers jit(fn) for CUDA (on any host: no GPU needed) and reads each Triton
kernel call's signature, `(operand types) -> (result types)`, from the module text,
summing the calls of one name. A kernel that reads a tile twice (several programs on
one tile of the state, a walk's tiles re-read from L2) moves more than this, and one
that skips unused chunks moves less: it is the compulsory traffic, not a measurement.
"""

from __future__ import annotations

import collections
import re
import warnings
from typing import Callable

import jax
import numpy as np

_TRITON_CALL = "xla.gpu.triton"
_NAME = re.compile(r'\bname = "([^"]*)"')
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]+\d*)>")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i1": 1, "i8": 1, "i16": 2, "i32": 4,
          "i64": 8, "ui8": 1, "ui32": 4}


def tensor_bytes(dims: str, element: str) -> int:
  """Bytes of `tensor<{dims}{element}>` (dims like "4x64x", "" for a scalar)."""
  if element not in _BYTES:
    raise ValueError(f"element type {element!r}: no byte size known for it")
  return int(np.prod([int(d) for d in dims.split("x") if d], dtype=np.int64)) * _BYTES[element]


def signature_bytes(line: str) -> int:
  """Operand plus result bytes of one custom call line of StableHLO text: the types
  after its last " : (", where the call's signature starts (the attributes before it
  hold the kernel's serialised IR)."""
  start = line.rfind(" : (")
  if start < 0:
    raise ValueError(f"no signature in the call line {line[:80]!r}...")
  return sum(tensor_bytes(d, e) for d, e in _TENSOR.findall(line[start:]))


def io_bytes(fn: Callable, *args) -> dict[str, int]:
  """{pallas_call name: operand + result bytes, summed over its calls} in jit(fn)(*args)
  lowered for CUDA; kernels without a name are keyed "(unnamed)"."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  total = collections.Counter()
  for line in text.splitlines():
    if _TRITON_CALL in line:
      name = _NAME.search(line)
      total[name.group(1) if name else "(unnamed)"] += signature_bytes(line)
  return dict(total)


def bandwidth(io: dict[str, int], ms: dict[str, float]) -> dict[str, float]:
  """{kernel: GB/s} = io bytes / measured ms for the kernels in both (a name the trace
  reports with a suffix, e.g. "gdn_grads.1", matches its pallas_call name)."""
  out = {}
  for timed, t in ms.items():
    base = timed if timed in io else timed.split(".")[0]
    if base in io and t > 0:
      out[timed] = io[base] / (t * 1e-3) / 1e9
  return out
