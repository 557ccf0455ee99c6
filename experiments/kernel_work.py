"""What each Pallas kernel of a program must do, to hold its measured time against:
the bytes it moves if it reads every operand and writes every result once, and the
FLOPs of its matrix products.

    io = kernel_work.io_bytes(fn, *args)        # {pallas_call name: bytes per call of fn}
    flops = kernel_work.matmul_flops(fn, *args) # {name: FLOPs per call, None: unknown}
    kernel_work.rate(io, ms_by_kernel)          # {name: bytes / s / 1e9}: GB/s
    kernel_work.rate(flops, ms_by_kernel, 1e12) # TFLOP/s

`io_bytes` lowers jit(fn) for CUDA (on any host: no GPU needed) and reads each Triton
kernel call's signature, `(operand types) -> (result types)`, from the module text,
summing the calls of one name. A kernel that reads a tile twice (several programs on
one tile of the state, a walk's tiles re-read from L2) moves more than this, and one
that skips unused chunks moves less: it is the compulsory traffic, not a measurement.

`matmul_flops` traces fn and counts 2 M N K per `dot_general` in each kernel's body
(scan bodies times their length, the larger branch of a cond) times its grid; a kernel
with a matrix product inside a loop of data-dependent length (a walk over a segment's
chunks) gets None. Elementwise work (exp, masks, sums) is not counted.
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


def matmul_flops(fn: Callable, *args) -> dict[str, float | None]:
  """{pallas_call name: FLOPs of its matrix products per call of fn, summed over its
  calls; None where a product sits in a loop of data-dependent length}."""
  total: dict[str, float | None] = {}
  for eqn in _pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr):
    name = _kernel_name(eqn.params)
    per_program = _dot_flops(eqn.params["jaxpr"])
    grid = int(np.prod(eqn.params["grid_mapping"].grid, dtype=np.int64))
    flops = None if per_program is None else float(per_program * grid)
    total[name] = None if flops is None or total.get(name, 0) is None else (
        total.get(name, 0) + flops)
  if not total:
    raise ValueError("no pallas_call in the traced program (interpret mode kernels are "
                     "still pallas_calls; is fn running the XLA path?)")
  return total


def _kernel_name(params) -> str:
  name = params.get("name_and_src_info", params.get("name"))
  return str(getattr(name, "name", name) or "(unnamed)")


def _sub_jaxprs(eqn):
  """The jaxprs inside an equation's parameters (pjit, custom_vjp, cond branches...)."""
  for value in eqn.params.values():
    for item in value if isinstance(value, (list, tuple)) else (value,):
      inner = getattr(item, "jaxpr", item)
      if hasattr(inner, "eqns"):
        yield inner


def _pallas_calls(jaxpr):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
    else:
      for inner in _sub_jaxprs(eqn):
        yield from _pallas_calls(inner)


def _dot_flops(jaxpr) -> float | None:
  """2 M N K summed over the dot_generals of one program; None: data-dependent."""
  total = 0.0
  for eqn in jaxpr.eqns:
    match eqn.primitive.name:
      case "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        out = eqn.outvars[0].aval.shape
        flops = 2.0 * np.prod(out) * np.prod([lhs[d] for d in contract])
      case "scan":
        body = _dot_flops(eqn.params["jaxpr"].jaxpr)
        flops = None if body is None else body * eqn.params["length"]
      case "while":
        body = _dot_flops(eqn.params["body_jaxpr"].jaxpr)
        flops = None if body is None or body > 0 else 0.0
      case "cond":
        branches = [_dot_flops(b.jaxpr) for b in eqn.params["branches"]]
        flops = None if None in branches else max(branches)
      case _:
        inner = [_dot_flops(j) for j in _sub_jaxprs(eqn)]
        flops = None if None in inner else sum(inner)
    if flops is None:
      return None
    total += flops
  return total


def rate(work: dict[str, float | None], ms: dict[str, float],
         unit: float = 1e9) -> dict[str, float]:
  """{kernel: work / s / unit} for the kernels timed (`ms`) whose work is known and not
  zero (a kernel with no matrix product has no TFLOP/s; a name the trace reports with a
  suffix, e.g. "gdn_grads.1", matches its pallas_call name): GB/s from io_bytes,
  TFLOP/s from matmul_flops with unit 1e12."""
  out = {}
  for timed, t in ms.items():
    base = timed if timed in work else timed.split(".")[0]
    if work.get(base) and t > 0:
      out[timed] = work[base] / (t * 1e-3) / unit
  return out
