"""Chunk operands that stay in place: rows gathered from slot arrays inside the kernels.

The chunk kernels see each operand as chunks of C rows, [NC, C, H, D]. For packed
sequences (and SSE's partitions) that shape is normally a copy: every slot (a token of a
segment) moved into a buffer where each segment starts on a fresh chunk, and the outputs
moved back (`move_rows`). `Slots` stands for such a buffer without building it:

    Slots(parts, take, chunk, dtype)
    parts  arrays [P_j, H, D], read as their concatenation along the rows (P slots)
    take   int32 [NC * C]: the slot behind each buffer row; >= P (or < 0) for a padding row
    row r of chunk n = slot take[n * C + r], or a zero row

A kernel reads a chunk's rows through `SlotRef`, which loads the C entries of take and
gathers those rows of each part with a masked load: the same [rows, cols] tile that a
block of the buffer would give, at the same granularity (a head's D contiguous values
per row), so the kernels' reads cost what they did and the copies into and out of the
buffer are gone. Outputs in the slot layout are written the same way, by a masked
scatter: a slot behind no buffer row is not written (callers mask it).

`call` is `pl.pallas_call` over operands that may be Slots: each Slots operand's
buffer-layout BlockSpec (one chunk, block (None, C, None, BD), or all chunks, block
(NC, C, None, BD); the row index must be 0) becomes the spec of take and of each part,
and the kernel receives a SlotRef in its place, indexed as the buffer's block would be:
`x[...]`, `x[rows, cols]` (slices or `pl.ds`), and for all chunks `x[c]`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import move_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
  """A virtual buffer [NC, C, H, D] whose rows are slots of `parts` (module docstring).

  parts: arrays [P_j, H, D] of one trailing shape and dtype; take: int32 [NC * C];
  chunk: C (static); dtype (static): the dtype the kernels read the rows in (a cast on
  load), for outputs the parts' own dtype.
  """

  parts: tuple[jax.Array, ...]
  take: jax.Array
  chunk: int = dataclasses.field(metadata=dict(static=True))
  dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    """The buffer's shape [NC, C, H, D]."""
    return (self.take.shape[0] // self.chunk, self.chunk) + tuple(self.parts[0].shape[1:])

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(part.shape[0] for part in self.parts)

  def with_parts(self, parts, dtype=None) -> "Slots":
    """The same rows of other parts (of the same sizes), e.g. an operand's gradient."""
    parts = tuple(parts)
    return Slots(parts, self.take, self.chunk, jnp.dtype(dtype or parts[0].dtype))

  def like(self, trailing: tuple[int, ...], dtype) -> "Slots":
    """An output template: parts of these sizes with rows of shape `trailing` (as
    ShapeDtypeStructs), for `call`'s out_shape."""
    parts = tuple(jax.ShapeDtypeStruct((n,) + tuple(trailing), dtype) for n in self.sizes)
    return Slots(parts, self.take, self.chunk, jnp.dtype(dtype))


def make(parts, take, chunk: int, dtype=None) -> Slots:
  """Slots over `parts` (one array or a tuple), checked: one trailing shape and dtype,
  take of whole chunks."""
  parts = tuple(parts) if isinstance(parts, (tuple, list)) else (parts,)
  if not parts:
    raise ValueError("Slots needs at least one part")
  for i, part in enumerate(parts):
    if part.shape[1:] != parts[0].shape[1:] or part.dtype != parts[0].dtype:
      raise ValueError(f"part {i} has rows {part.shape[1:]} of {part.dtype}, part 0 "
                       f"{parts[0].shape[1:]} of {parts[0].dtype}: parts must match")
  if take.ndim != 1 or take.shape[0] % chunk:
    raise ValueError(f"take of shape {take.shape} is not whole chunks of {chunk} rows")
  return Slots(parts, take.astype(jnp.int32), chunk, jnp.dtype(dtype or parts[0].dtype))


def to_buffer(x: Slots) -> jax.Array:
  """The buffer x stands for, [NC, C, H, D] in x.dtype, built in XLA (for the few
  places that need it whole: a batched XLA matmul over chunks): the row mover's XLA
  reference, zeros at padding rows."""
  return move_rows.reference(x.parts, x.take).astype(x.dtype).reshape(x.shape)


def from_buffer(buffer: jax.Array, x: Slots) -> tuple[jax.Array, ...]:
  """The slots' rows of a buffer [NC, C, ...] (the inverse of to_buffer for the slots
  behind some row; zero for the others), as parts of x's sizes, in XLA."""
  flat = buffer.reshape((-1,) + buffer.shape[2:])
  p = sum(x.sizes)
  # A padding row's entry (>= P, or < 0, which a scatter would wrap) is sent past the end.
  take = jnp.where((x.take >= 0) & (x.take < p), x.take, p)
  row_of = jnp.full((p,), flat.shape[0], jnp.int32).at[take].set(
      jnp.arange(flat.shape[0], dtype=jnp.int32), mode="drop")
  return _split(jnp.take(flat, row_of, axis=0, mode="fill", fill_value=0), x.sizes)


def _split(a: jax.Array, sizes: tuple[int, ...]) -> tuple[jax.Array, ...]:
  """a [P, ...] cut along axis 0 into parts of `sizes` rows."""
  out, start = [], 0
  for n in sizes:
    out.append(a[start:start + n])
    start += n
  return tuple(out)


def like(x, trailing: tuple[int, ...], dtype):
  """The out_shape of a per-row result of operand x (a buffer [NC, C, ...] or Slots)
  with rows of shape `trailing` in `dtype`, in x's layout."""
  if isinstance(x, Slots):
    return x.like(trailing, dtype)
  return jax.ShapeDtypeStruct(tuple(x.shape[:2]) + tuple(trailing), dtype)


def split_like(covered, x: Slots) -> tuple[jax.Array, ...]:
  """A per-slot flag, one bool array [P] or parts, as parts of x's sizes (checked)."""
  if isinstance(covered, (tuple, list)):
    sizes = tuple(m.shape[0] for m in covered)
    if sizes != x.sizes:
      raise ValueError(f"covered's parts hold {list(sizes)} slots, the operands' "
                       f"{list(x.sizes)}: they must match")
    return tuple(covered)
  if covered.shape != (sum(x.sizes),):
    raise ValueError(f"covered of shape {covered.shape} must be [{sum(x.sizes)}] (P)")
  return _split(covered, x.sizes)


def zero_uncovered(parts, covered) -> tuple[jax.Array, ...]:
  """Per-slot results (parts [P_j, ...]) with the slots that are not covered (bool
  parts [P_j]: False for a slot behind no row, whose rows no kernel writes) set to 0."""
  return tuple(jnp.where(m.reshape(m.shape + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))
               for x, m in zip(parts, covered))


@jax.custom_vjp
def zero_uncovered_grads(x: Slots, covered) -> Slots:
  """x itself; its cotangent is zeroed at the slots that are not covered (the kernels
  write no gradient there)."""
  return x


def _zero_uncovered_grads_fwd(x, covered):
  return x, covered


def _zero_uncovered_grads_bwd(covered, dx):
  return Slots(zero_uncovered(dx.parts, covered), None, dx.chunk, dx.dtype), None


zero_uncovered_grads.defvjp(_zero_uncovered_grads_fwd, _zero_uncovered_grads_bwd)


class SlotRef:
  """In a kernel: the rows of one chunk (`index` given) or of all chunks of a Slots
  operand, for one head and one block of `cols` columns, read and written like the
  buffer block they stand for. take_ref: the whole table; parts: one ref [P_j, BD] per
  non-empty part, spans: each one's (first slot, slots) in the concatenation."""

  def __init__(self, take_ref, parts, spans, cols: int, chunk: int, dtype, index=None):
    self._take, self._parts, self._spans = take_ref, tuple(parts), tuple(spans)
    self._chunk, self._index = chunk, index
    self.dtype = jnp.dtype(dtype)
    nc = take_ref.shape[0] // chunk
    self.shape = (chunk, cols) if index is not None else (nc, chunk, cols)

  def _where(self, idx):
    """(chunk, first row, rows, first column, columns) of an index of the block."""
    if self._index is None:                       # all chunks: x[c] is chunk c
      if isinstance(idx, tuple):
        raise NotImplementedError("index a SlotRef of all chunks by one chunk, x[c]")
      return idx, 0, self._chunk, 0, self.shape[-1]
    if idx is Ellipsis:
      idx = (slice(None), slice(None))
    elif not isinstance(idx, tuple):  # x[rows]: all columns
      idx = (idx, slice(None))
    rows, cols = idx
    r0, nr = _span(rows, self._chunk)
    c0, ncol = _span(cols, self.shape[-1])
    return self._index, r0, nr, c0, ncol

  def _slots(self, chunk, r0, nr):
    return self._take[pl.ds(chunk * self._chunk + r0, nr)]

  def slots_of(self, chunk):
    """The slots behind chunk `chunk`'s rows, int32 [C] (for `rows_at`; all chunks)."""
    return self._slots(chunk, 0, self._chunk)

  def rows_at(self, slots):
    """The [C, BD] rows of these slots (from `slots_of`): x[c] in two steps, so that a
    loop can load a chunk's addresses ahead of its rows."""
    return self._gather(slots, 0, self.shape[-1])

  def __getitem__(self, idx):
    chunk, r0, nr, c0, ncol = self._where(idx)
    return self._gather(self._slots(chunk, r0, nr), c0, ncol)

  def _gather(self, slot, c0, ncol):
    if not self._parts:  # no slots at all: every row is padding
      return jnp.zeros((slot.shape[0], ncol), self.dtype)
    col = c0 + lax.broadcasted_iota(jnp.int32, (1, ncol), 1)
    out = None
    for part, (first, size) in zip(self._parts, self._spans):
      local = slot - first
      inside = ((local >= 0) & (local < size))[:, None]
      # A masked-off row is never read; 0 keeps its address in range.
      src = jnp.where(inside, local[:, None], 0)
      rows = plgpu.load(part.at[src, col], mask=inside, other=0)
      # A select, not a sum, keeps every value's bits (-0.0 + 0.0 would be +0.0).
      out = rows if out is None else jnp.where(inside, rows, out)
    return out.astype(self.dtype)

  def __setitem__(self, idx, value):
    chunk, r0, nr, c0, ncol = self._where(idx)
    slot = self._slots(chunk, r0, nr)
    col = c0 + lax.broadcasted_iota(jnp.int32, (1, ncol), 1)
    for part, (first, size) in zip(self._parts, self._spans):
      local = slot - first
      inside = ((local >= 0) & (local < size))[:, None]
      # A masked-off row is never written. Its index is one past the part's end rather
      # than 0: interpret mode stores by a scatter, where a duplicate in-range index
      # would put the row's old value back over another program lane's write.
      dst = jnp.where(inside, local[:, None], size)
      plgpu.store(part.at[dst, col], jnp.broadcast_to(value, (nr, ncol)).astype(part.dtype),
                  mask=jnp.broadcast_to(inside, (nr, ncol)))


def walk_loads(*refs):
  """(load, index) for a walk over chunks that reads ref[c] of each ref (`_walk` in
  chunk_gla): load(c) -> the tuple, index None; or, where some refs are SlotRefs (of one
  table, as a kernel's slot operands are), index(c) -> the chunk's slots and
  load(c, slots) -> the tuple, so that the walk loads a chunk's addresses a step ahead."""
  slot_refs = [r for r in refs if isinstance(r, SlotRef)]
  if not slot_refs:
    return (lambda c: tuple(r[c] for r in refs)), None

  def load(c, slots):
    return tuple(r.rows_at(slots) if isinstance(r, SlotRef) else r[c] for r in refs)
  return load, slot_refs[0].slots_of


def _span(index, size: int) -> tuple:
  """(start, length) of a slice(None) or a `pl.ds` along an axis of `size`."""
  if isinstance(index, slice):
    if index != slice(None):
      raise NotImplementedError(f"SlotRef takes slice(None) or pl.ds, not {index}")
    return 0, size
  if isinstance(index, pl.Slice):
    if index.stride != 1:
      raise NotImplementedError(f"SlotRef takes unit-stride slices, not {index}")
    return index.start, index.size
  raise NotImplementedError(f"SlotRef takes slices, not {index!r}")


def _part_spec(spec: pl.BlockSpec, rows: int, chunk: int) -> pl.BlockSpec:
  """The spec of one part [P_j, H, D] standing for a buffer block (None | NC, C, None,
  BD) at index (n, 0, head, col): all its rows, the same head and column block."""
  block = tuple(spec.block_shape)
  if len(block) != 4 or block[1] != chunk or block[2] is not None:
    raise ValueError(f"a Slots operand needs a (None or NC, C={chunk}, None, cols) block, "
                     f"got {block}")
  index_map = spec.index_map
  return pl.BlockSpec((rows, None, block[3]),
                      lambda *ids: (0,) + tuple(index_map(*ids)[2:]))


def _chunk_index(spec: pl.BlockSpec, grid_rank: int):
  """In a kernel: the chunk a one-chunk block holds (index_map's first entry at this
  program), or None for a block of all chunks. The row block's index must be 0 (the
  whole chunk): a SlotRef indexes rows within it."""
  ids = [pl.program_id(a) for a in range(grid_rank)]
  index = spec.index_map(*ids)
  if not (isinstance(index[1], int) and index[1] == 0):
    raise ValueError(f"a Slots operand's block index must be (chunk, 0, head, col); its "
                     f"row block index is {index[1]!r}")
  return index[0] if spec.block_shape[0] is None else None


def call(kernel: Callable, *, grid: tuple[int, ...],
         ins: Sequence[tuple[jax.Array | Slots, pl.BlockSpec]],
         outs: Sequence[tuple[jax.ShapeDtypeStruct | Slots, pl.BlockSpec]],
         input_output_aliases: dict[int, int] | None = None, **kwargs):
  """pl.pallas_call(kernel, grid, in_specs, out_specs, out_shape)(*args) where args and
  outputs may be Slots (module docstring); kernel(*input refs, *output refs) gets a
  SlotRef for each. input_output_aliases: {input position: output position} among
  plain arrays. Returns the outputs, a Slots' as the tuple of its parts."""
  flat_args, in_specs, out_specs, out_shape = [], [], [], []
  in_layout, out_layout, alias_pos, out_alias_pos = [], [], {}, {}

  def add_table(take):  # a Slots' row table, read whole by every program
    flat_args.append(take)
    in_specs.append(pl.BlockSpec((take.shape[0],), lambda *_: (0,)))

  for x, spec in ins:
    if isinstance(x, Slots):
      in_layout.append((len(flat_args), x, spec))
      add_table(x.take)
      flat_args.extend(x.parts[j] for j, _ in _kept(x))
      in_specs.extend(_part_spec(spec, n, x.chunk) for _, (_, n) in _kept(x))
    else:
      alias_pos[len(in_layout)] = len(flat_args)
      in_layout.append((len(flat_args), None, spec))
      flat_args.append(x)
      in_specs.append(spec)
  for template, spec in outs:
    if isinstance(template, Slots):  # its table rides along as one more input
      out_layout.append((len(out_shape), len(flat_args), template, spec))
      add_table(template.take)
      out_shape.extend(template.parts[j] for j, _ in _kept(template))
      out_specs.extend(_part_spec(spec, n, template.chunk) for _, (_, n) in _kept(template))
    else:
      out_alias_pos[len(out_layout)] = len(out_shape)
      out_layout.append((len(out_shape), None, None, spec))
      out_shape.append(template)
      out_specs.append(spec)
  aliases = {}
  for i, o in (input_output_aliases or {}).items():
    if i not in alias_pos or o not in out_alias_pos:
      raise ValueError(f"alias {i} -> {o}: only plain arrays can share a buffer")
    aliases[alias_pos[i]] = out_alias_pos[o]
  n_in, rank = len(flat_args), len(grid)

  def flat_kernel(*refs):
    in_refs, out_refs = refs[:n_in], refs[n_in:]
    args = []
    for start, x, spec in in_layout:
      if x is None:
        args.append(in_refs[start])
      else:
        args.append(_slot_ref(in_refs[start], in_refs[start + 1:], x, spec, rank))
    for start, take_at, template, spec in out_layout:
      if template is None:
        args.append(out_refs[start])
      else:
        args.append(_slot_ref(in_refs[take_at], out_refs[start:], template, spec, rank))
    kernel(*args)

  flat_out = pl.pallas_call(flat_kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                            out_shape=out_shape, input_output_aliases=aliases,
                            **kwargs)(*flat_args)
  results = []
  for start, _, template, _ in out_layout:
    if template is None:
      results.append(flat_out[start])
      continue
    parts, kept = list(flat_out[start:start + len(_kept(template))]), []
    for part in template.parts:  # an empty part was no output: zero rows of it
      kept.append(parts.pop(0) if part.shape[0] else jnp.zeros(part.shape, part.dtype))
    results.append(tuple(kept))
  return results


def _kept(x: Slots) -> list[tuple[int, tuple[int, int]]]:
  """(part index, (first slot, slots)) of x's non-empty parts: an empty part holds no
  slot that take could name, and a block of zero rows is no tile."""
  kept, first = [], 0
  for j, n in enumerate(x.sizes):
    if n:
      kept.append((j, (first, n)))
    first += n
  return kept


def _slot_ref(take_ref, refs, x: Slots, spec: pl.BlockSpec, rank: int) -> SlotRef:
  """The SlotRef of operand x over its table and the refs that start with its kept
  parts' (spec: its buffer-layout BlockSpec)."""
  kept = _kept(x)
  return SlotRef(take_ref, refs[:len(kept)], [span for _, span in kept],
                 spec.block_shape[3], x.chunk, x.dtype, _chunk_index(spec, rank))
