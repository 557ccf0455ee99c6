"""Device time per compiled HLO op from a profiler trace, and where each op came from.

`device_ms_by_op(run, reps)` traces `reps` calls of `run` and sums the duration of every
event that carries an `hlo_op` stat: on a GPU the kernels (each named by the fusion or
custom call it runs), on CPU the host's XLA thunks.

`hlo_sources(hlo_text)` reads the compiled module's text (`compiled.as_text()`) and
returns, for every instruction, the metadata JAX attached when it traced the program:
the op name (the transformation path, e.g. `jit(step)/transpose(jvp(...))/dot_general`)
and the Python code that emitted it. XLA writes that code either as `source_file` /
`source_line` on the instruction or, in newer versions, as a `stack_frame_id` into the
module's frame tables (FileNames, FunctionNames, FileLocations, StackFrames), which hold
the whole Python stack: there the op is attributed to its innermost frame in code this
project or optax owns (a dense layer's matmul goes to our layer's file, not flax's). A
fusion carries its root instruction's metadata, so a kernel is attributed to the code of
its root.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import re
import tempfile
from typing import Callable

import jax

from sse_jax.train.steps import OPTIMIZER_SCOPE

# `%name = type opcode(...), ..., metadata={op_name="..." stack_frame_id=3}`
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\bmetadata=\{([^}]*)\}")
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s,}]+)')
_TABLE_ROW = re.compile(r'^(\d+)\s+(\{.*\}|".*")\s*$')
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
# The prefixes a source path is cut at: the package a file belongs to names it.
_PACKAGES = ("sse_jax/", "pallas_kernels/", "experiments/", "optax/", "flax/", "jax/")
# Frames an op is attributed to: the innermost one in these packages.
_OWNED = ("sse_jax/", "pallas_kernels/", "experiments/", "optax/")


@dataclasses.dataclass(frozen=True)
class Source:
  """Where an HLO instruction came from: JAX's op name, the emitting file (cut at its
  package: `sse_jax/layers/router.py`; "" when XLA created the op) and line."""
  op_name: str
  file: str
  line: int

  @property
  def phase(self) -> str:
    """"optimizer" (optax code, or an op under the trainer's optimizer scope),
    "backward" (a transposed op: the gradient), else "forward" (which includes
    forward ops recomputed for the backward under remat)."""
    if self.file.startswith("optax/") or OPTIMIZER_SCOPE in self.op_name.split("/"):
      return "optimizer"
    return "backward" if "transpose(" in self.op_name else "forward"


def package_path(path: str) -> str:
  """`/any/where/site-packages/optax/_src/alias.py` -> `optax/_src/alias.py`: the path
  from the last package directory `_PACKAGES` names (the full path when none)."""
  path = path.replace("\\", "/")
  cut = max((path.rfind("/" + p) + 1 for p in _PACKAGES if "/" + p in path), default=-1)
  if cut <= 0:
    cut = next((0 for p in _PACKAGES if path.startswith(p)), -1)
  return path if cut < 0 else path[cut:]


def _frame_tables(hlo_text: str) -> dict[str, dict[int, str | dict[str, str]]]:
  """The module's stack-frame tables {table: {id: "quoted value" unquoted, or the
  {field: value} of a braced row}}; empty tables when the text has none."""
  tables = {name: {} for name in _TABLES}
  current = None
  for line in hlo_text.splitlines():
    stripped = line.strip()
    if stripped in _TABLES:
      current = tables[stripped]
      continue
    row = _TABLE_ROW.match(stripped) if current is not None else None
    if row is None:
      current = None if stripped.startswith(("%", "ENTRY", "HloModule")) else current
      continue
    value = row.group(2)
    current[int(row.group(1))] = (value[1:-1] if value.startswith('"') else
                                  {k: v.strip('"') for k, v in _FIELD.findall(value)})
  return tables


def _stacks(tables) -> dict[int, list[tuple[str, int]]]:
  """{stack frame id: [(package path, line), ...] innermost first}. XLA prints a frame's
  parent as (parent id + 1), so a root frame names itself; where no frame names itself
  the ids are taken as printed (0 = no parent)."""
  frames, locations = tables["StackFrames"], tables["FileLocations"]
  files = tables["FileNames"]
  shifted = any(int(f.get("parent_frame_id", 0)) == i for i, f in frames.items())

  def location(frame_id: int) -> tuple[str, int]:
    loc = locations.get(int(frames[frame_id].get("file_location_id", 0)), {})
    return (package_path(files.get(int(loc.get("file_name_id", 0)), "")),
            int(loc.get("line", 0)))

  stacks = {}
  for frame_id in frames:
    stack, seen, current = [], set(), frame_id
    while current in frames and current not in seen:
      seen.add(current)
      stack.append(location(current))
      parent = int(frames[current].get("parent_frame_id", 0))
      current = parent - 1 if shifted else parent
    stacks[frame_id] = stack
  return stacks


def _attribute(stack: list[tuple[str, int]]) -> tuple[str, int]:
  """The innermost frame in an owned package (else the innermost frame)."""
  for path, line in stack:
    if path.startswith(_OWNED):
      return path, line
  return stack[0] if stack else ("", 0)


def hlo_sources(hlo_text: str) -> dict[str, Source]:
  """{instruction name: Source} for every instruction of the module text that has
  metadata (instructions of nested computations included: names are module-unique)."""
  stacks = _stacks(_frame_tables(hlo_text))
  sources = {}
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    fields = {k: v.strip('"') for k, v in _FIELD.findall(match.group(2))}
    if "stack_frame_id" in fields:
      path, number = _attribute(stacks.get(int(fields["stack_frame_id"]), []))
    else:
      path = package_path(fields.get("source_file", ""))
      number = int(fields.get("source_line", 0))
    sources[match.group(1)] = Source(fields.get("op_name", ""), path, number)
  return sources


def device_ms_by_op(run: Callable[[], object], reps: int,
                    by_kernel: bool = False) -> dict[str, float]:
  """{HLO op name: device ms per call} over a profiler trace of `reps` calls of `run`
  (which must block until its results are ready), largest first; with `by_kernel`, keyed
  by the device kernel's name instead (a Pallas kernel's is its `pallas_call` name).
  Call `run` once before: compilation and autotuning are not part of a call."""
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      for _ in range(reps):
        run()
    path = next(pathlib.Path(tmp).rglob("*.xplane.pb"))
    data = jax.profiler.ProfileData.from_file(str(path))
  planes = [p for p in data.planes if p.name.startswith("/device:")] or list(data.planes)
  total = collections.Counter()
  for plane in planes:
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if "hlo_op" in stats:
          total[event.name if by_kernel else stats["hlo_op"]] += (
              event.duration_ns / 1e6 / reps)
  return dict(total.most_common())
