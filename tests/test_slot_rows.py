"""The chunk kernels reading their operands in place (`pallas_kernels.slot_rows`), in
Pallas interpret mode: `chunk_gla_slots` and `chunk_gdn_slots` against `chunk_gla` and
`chunk_gdn` on the buffer that the same slots would be copied into. Interpret mode fills rows a kernel never writes with
NaN, so a slot left unwritten that the op should have zeroed shows up."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import chunk_gdn
from pallas_kernels import chunk_gla
from pallas_kernels import slot_rows
from tests.op_testing import assert_close

C = 16
# Slots per segment: ragged, one of them empty and one a whole number of chunks.
LENGTHS = (5, 37, 0, 16, 20)


def _layout(lengths, chunk):
  """(take [NC * C], slot of each row or P; rows [P], row of each slot; seg_start,
  seg_chunks) of segments of these lengths, each starting on a fresh chunk."""
  take, rows, start, count, nc = [], [], [], [], 0
  p = sum(lengths)
  slot = 0
  for n in lengths:
    chunks = -(-n // chunk)
    start.append(nc)
    count.append(chunks)
    for r in range(chunks * chunk):
      if r < n:
        rows.append(nc * chunk + r)
      take.append(slot + r if r < n else p)
    slot += n
    nc += chunks
  nc += 1  # one chunk of no segment: every row padding
  take += [p] * chunk
  as_i32 = lambda x: jnp.asarray(x, jnp.int32)
  return as_i32(take), as_i32(rows), as_i32(start), as_i32(count)


def _inputs(p, z, h=1, dk=16, dv=16, dtype=jnp.float32):
  keys = jax.random.split(jax.random.PRNGKey(0), 6)
  q = jax.random.normal(keys[0], (p, h, dk), dtype)
  k = (jax.random.normal(keys[1], (p, h, dk)) / 4).astype(dtype)
  v = jax.random.normal(keys[2], (p, h, dv), dtype)
  g = jax.nn.log_sigmoid(jax.random.normal(keys[3], (p, h, dk))) / 4
  h0 = jax.random.normal(keys[4], (z, h, dk, dv)) / 4
  cot = jax.random.normal(keys[5], (p, h, dv))
  return q, k, v, g, h0, cot


@functools.lru_cache(maxsize=None)
def _buffer_reference(dtype_name):
  """(o, final) and gradients of chunk_gla on the buffer built from the slots, with
  the uncovered slots' values zeroed (what the op's packing does to them)."""
  dtype = jnp.dtype(dtype_name)
  take, rows, start, count = _layout(LENGTHS, C)
  q, k, v, g, h0, cot = _inputs(rows.shape[0], len(LENGTHS), dtype=dtype)
  covered = _covered(rows.shape[0])
  nc = take.shape[0] // C

  def loss(q, k, v, g, h0):
    q, k, v, g = (jnp.where(covered[:, None, None], x, 0) for x in (q, k, v, g))
    buf = lambda x: slot_rows.to_buffer(slot_rows.make(x, take, C)).reshape(
        (1, nc, C) + x.shape[1:])
    o, final = chunk_gla.chunk_gla(buf(q), buf(k), buf(v), buf(g), h0, start, count,
                                   block_sizes=chunk_gla.BlockSizes(chunk=C, block_k=16,
                                                                    block_v=16),
                                   interpret=True)
    o = o.reshape((nc * C,) + o.shape[3:])[rows]
    o = jnp.where(covered[:, None, None], o, 0)
    return jnp.sum(o.astype(jnp.float32) * cot) + jnp.sum(0.3 * final), (o, final)
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, g, h0)


def _covered(p):
  """Three slots behind no row (as the SSE packing drops a slot of an invalid id)."""
  return jnp.ones((p,), bool).at[jnp.asarray([3, 30, 60])].set(False)


def _without_uncovered(take, covered):
  """take with the rows of uncovered slots made padding rows (zero rows in place)."""
  p = covered.shape[0]
  return jnp.where(covered[jnp.minimum(take, p - 1)] & (take < p), take, p)


@pytest.mark.parametrize("fields, dtype", [
    (dict(), "float32"),
    (dict(), "bfloat16"),
    # The walk as a local pass plus a sweep; the fused dq/dk kernel, which runs on
    # buffers built in XLA (its results taken back to the slots).
    (dict(fused_states=False, split_dqk=False), "float32"),
    # dA from XLA's batched matmul; dq/dk in two kernels through fp32 buffers; states
    # walked again in the backward pass.
    (dict(intra_scores=False, inter_in_intra=False, recompute_states=True), "float32"),
])
def test_slots_in_place_equal_the_copied_buffer(fields, dtype):
  """Outputs, final states and gradients of chunk_gla_slots (q, k, v, g as two parts;
  three slots behind no row) equal chunk_gla's on the copied buffer; the uncovered
  slots get zero outputs and gradients."""
  take, rows, start, count = _layout(LENGTHS, C)
  (_, ref), ref_grads = _buffer_reference(dtype)
  q, k, v, g, h0, cot = _inputs(rows.shape[0], len(LENGTHS), dtype=jnp.dtype(dtype))
  covered = _covered(rows.shape[0])
  halves = lambda x: (x[:30], x[30:])
  bs = chunk_gla.BlockSizes(chunk=C, block_k=16, block_v=16, **fields)

  # covered as parts, or as one [P] array (split as the operands are).
  cov = covered if fields else halves(covered)

  def loss(q, k, v, g, h0):
    o, final = chunk_gla.chunk_gla_slots(
        halves(q), halves(k), halves(v), halves(g), _without_uncovered(take, covered), h0,
        start, count, covered=cov, block_sizes=bs, interpret=True)
    o = jnp.concatenate(o)
    return jnp.sum(o.astype(jnp.float32) * cot) + jnp.sum(0.3 * final), (o, final)
  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(
      q, k, v, g, h0)
  names = ("o", "final", "dq", "dk", "dv", "dg", "dh0")
  for name, a, r in zip(names, jax.tree_util.tree_leaves((out, grads)),
                        jax.tree_util.tree_leaves((ref, ref_grads))):
    assert np.isfinite(np.asarray(a, np.float32)).all(), name
    assert_close(a, r, 1e-6, name)
  for name, a in zip(("o", "dq", "dk", "dv", "dg"), (out[0],) + grads[:4]):
    np.testing.assert_array_equal(np.asarray(a, np.float32)[~np.asarray(covered)], 0.0,
                                  err_msg=name)


@pytest.mark.parametrize("fields", [
    dict(),
    # The gradients as one kernel; the walks with their loads prefetched.
    dict(split_grads=False, prefetch=True),
])
def test_delta_rule_slots_in_place_equal_the_copied_buffer(fields):
  """chunk_gdn_slots (two parts, three uncovered slots) against chunk_gdn on the
  copied buffer: outputs, final states and the gradients w.r.t. q, k, v, g, beta, h0;
  zero outputs and gradients at the uncovered slots."""
  take, rows, start, count = _layout(LENGTHS, C)
  p, z = rows.shape[0], len(LENGTHS)
  q, k, v, _, h0, cot = _inputs(p, z)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  keys = jax.random.split(jax.random.PRNGKey(7), 2)
  g = -0.2 * jnp.abs(jax.random.normal(keys[0], (p, 1)))
  beta = jax.nn.sigmoid(jax.random.normal(keys[1], (p, 1)))
  covered = _covered(p)
  nc = take.shape[0] // C
  bs = chunk_gdn.BlockSizes(chunk=C, **fields)
  halves = lambda x: (x[:30], x[30:])

  def in_place(q, k, v, g, beta, h0):
    o, final = chunk_gdn.chunk_gdn_slots(
        *map(halves, (q, k, v, g, beta)), _without_uncovered(take, covered), h0, start,
        count, covered=halves(covered), block_sizes=bs, interpret=True)
    return jnp.concatenate(o), final

  def copied(q, k, v, g, beta, h0):
    m = lambda x: jnp.where(covered.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0)
    buf = lambda x: slot_rows.to_buffer(slot_rows.make(m(x), take, C)).reshape(
        (1, nc, C) + x.shape[1:])
    o, final = chunk_gdn.chunk_gdn(*map(buf, (q, k, v, g, beta)), h0, start, count,
                                   block_sizes=bs, interpret=True)
    return m(o.reshape((nc * C,) + o.shape[3:])[rows]), final

  def run(fn):
    def loss(*x):
      o, final = fn(*x)
      return jnp.sum(o * cot) + jnp.sum(0.3 * final), (o, final)
    return jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True)(
        q, k, v, g, beta, h0)
  (_, out), grads = run(in_place)
  (_, ref), ref_grads = run(copied)
  names = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")
  for name, a, r in zip(names, jax.tree_util.tree_leaves((out, grads)),
                        jax.tree_util.tree_leaves((ref, ref_grads))):
    assert np.isfinite(np.asarray(a)).all(), name
    assert_close(a, r, 1e-6, name)
  for name, a in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), (out[0],) + grads[:5]):
    np.testing.assert_array_equal(np.asarray(a)[~np.asarray(covered)], 0.0, err_msg=name)


def test_buffer_round_trip_and_refusals():
  """to_buffer puts each slot at its row (zeros at padding rows), from_buffer takes it
  back as parts; parts that differ, or a table of partial chunks, are refused."""
  take, rows, _, _ = _layout(LENGTHS, C)
  x = jnp.arange(rows.shape[0] * 2, dtype=jnp.float32).reshape(-1, 1, 2)
  slots = slot_rows.make((x[:50], x[50:]), take, C)
  buf = slot_rows.to_buffer(slots)
  assert buf.shape == (take.shape[0] // C, C, 1, 2)
  flat = np.asarray(buf).reshape(-1, 2)
  np.testing.assert_array_equal(flat[np.asarray(rows)], np.asarray(x)[:, 0])
  padding = np.setdiff1d(np.arange(flat.shape[0]), np.asarray(rows))
  np.testing.assert_array_equal(flat[padding], 0.0)
  back = slot_rows.from_buffer(buf, slots)
  np.testing.assert_array_equal(np.concatenate(back), x)
  # A padding row may also be marked by a negative entry.
  negative = jnp.where(take < rows.shape[0], take, -1)
  np.testing.assert_array_equal(
      np.concatenate(slot_rows.from_buffer(buf, slot_rows.make(x, negative, C))), x)
  with pytest.raises(ValueError, match="part 1 has rows"):
    slot_rows.make((x, x.astype(jnp.bfloat16)), take, C)
  with pytest.raises(ValueError, match="not whole chunks of 16 rows"):
    slot_rows.make(x, take[:-3], C)


@pytest.mark.parametrize("kernels, gates", [(chunk_gla, 1), (chunk_gdn, 2)])
def test_empty_parts_and_no_slots(kernels, gates):
  """A part without slots (the shared part of no tokens, say) is no tile: the other
  part's results are unchanged and the empty one's are empty. With no slots at all
  every row is padding: the segments keep their initial states, whose gradient is the
  final states' cotangent."""
  take, rows, start, count = _layout(LENGTHS, C)
  p, z = rows.shape[0], len(LENGTHS)
  q, k, v, g, h0, _ = _inputs(p, z)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  x = (q, k, v, g) if gates == 1 else (q, k, v, -jnp.abs(g[..., 0]), jnp.abs(g[..., 0]))
  bs = kernels.BlockSizes(chunk=C)
  run = getattr(kernels, kernels.__name__.rsplit(".", 1)[1] + "_slots")
  o, final = run(*x, take, h0, start, count, block_sizes=bs, interpret=True)
  (o0, o1), final2 = run(*((a[:0], a) for a in x), take, h0, start, count,
                         block_sizes=bs, interpret=True)
  assert o0.shape == (0,) + o.shape[1:]
  np.testing.assert_array_equal(o1, o)
  np.testing.assert_array_equal(final2, final)

  none = tuple(a[:0] for a in x)
  padding = jnp.full_like(take, 0)  # out of range of zero slots: padding
  loss = lambda h: jnp.sum(run(*none, padding, h, start, count, block_sizes=bs,
                               interpret=True)[1])
  o_none, final_none = run(*none, padding, h0, start, count, block_sizes=bs,
                           interpret=True)
  assert o_none.shape == (0,) + o.shape[1:]
  np.testing.assert_allclose(final_none, h0, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(jax.grad(loss)(h0), np.ones(h0.shape), rtol=1e-6)
