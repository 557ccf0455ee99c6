"""Chunk-aligned packing (`sse_jax.ops.packing`): layout and the row moves' gradients."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sse_jax.ops import packing


def test_layout_starts_every_segment_on_a_fresh_chunk():
  # Segments 0, 2, 1 interleaved in time, segment 3 empty; chunks of 4 rows.
  seg = jnp.asarray([0, 2, 0, 1, 2, 0, 0, 0, 2], jnp.int32)
  layout = packing.chunk_layout(seg, 4, 4)
  np.testing.assert_array_equal(layout.seg_len, [5, 1, 3, 0])
  np.testing.assert_array_equal(layout.seg_chunks, [2, 1, 1, 0])
  np.testing.assert_array_equal(layout.seg_start, [0, 2, 3, 4])
  # Time order kept inside each segment; segment z starts at row 4 * seg_start[z].
  np.testing.assert_array_equal(layout.rows, [0, 12, 1, 8, 13, 2, 3, 4, 14])
  assert packing.max_chunks(9, 4, 4) >= int(layout.seg_chunks.sum())


def test_presorted_layout_equals_the_sorted_one():
  """GLA's packed sequences skip the sort (presorted=True): same layout, including an
  empty segment and segments that end inside a chunk."""
  seg = jnp.asarray([0, 0, 0, 0, 0, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3, 3], jnp.int32)
  want = packing.chunk_layout(seg, 5, 4)
  got = jax.jit(packing.chunk_layout, static_argnums=(1, 2, 3))(seg, 5, 4, True)
  for name, a, b in zip(want._fields, got, want):
    np.testing.assert_array_equal(a, b, err_msg=name)
  np.testing.assert_array_equal(want.rows[:7], [0, 1, 2, 3, 4, 8, 9])


def test_sorted_tail_layout_equals_the_sorted_one():
  """SSE varlen sorts only its routed slots (sorted_tail = the shared partition's):
  same layout as the full sort, with routed slots interleaved, an empty routed
  segment, and the tail's segments ending inside a chunk; an out-of-range tail fails."""
  head = jnp.asarray([2, 0, 2, 1, 0, 2, 0], jnp.int32)      # routed ids 0..3, 3 empty
  tail = jnp.asarray([4, 4, 4, 5, 5, 5, 5, 5, 6], jnp.int32)  # "shared" ids, in order
  seg = jnp.concatenate([head, tail])
  want = packing.chunk_layout(seg, 7, 4)
  got = jax.jit(packing.chunk_layout, static_argnums=(1, 2, 3, 4))(seg, 7, 4, False, 9)
  for name, a, b in zip(want._fields, got, want):
    np.testing.assert_array_equal(a, b, err_msg=name)
  np.testing.assert_array_equal(want.rows[:7], [8, 0, 9, 4, 1, 10, 2])
  try:
    packing.chunk_layout(seg, 7, 4, sorted_tail=17)
  except ValueError as e:
    assert "sorted_tail=17" in str(e)
  else:
    raise AssertionError("sorted_tail > P was accepted")


def test_row_moves_and_their_gradients_are_exact():
  """scatter_rows / gather_rows against plain indexing: same values, and the same
  gradients (a gather as the transpose instead of a scatter-add), bit for bit."""
  rows = jnp.asarray([5, 0, 2, 7], jnp.int32)
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 3))
  buf = jax.random.normal(jax.random.PRNGKey(1), (9, 3))
  w9, w4 = jnp.arange(9.0)[:, None], jnp.arange(4.0)[:, None]

  def plain_scatter(x):
    return jnp.zeros((9, 3), x.dtype).at[rows].set(x)

  for ours, plain, arg, w in ((lambda a: packing.scatter_rows(a, rows, 9), plain_scatter, x, w9),
                              (lambda a: packing.gather_rows(a, rows), lambda a: a[rows], buf, w4)):
    np.testing.assert_array_equal(jax.jit(ours)(arg), plain(arg))
    loss = lambda f: (lambda a: jnp.sum(jnp.sin(f(a)) * w))
    np.testing.assert_array_equal(jax.jit(jax.grad(loss(ours)))(arg), jax.grad(loss(plain))(arg))

  # No slots at all (T = 0): an all-padding buffer, and nothing gathered back.
  empty = jnp.zeros((0, 3))
  none = jnp.zeros((0,), jnp.int32)
  np.testing.assert_array_equal(packing.scatter_rows(empty, none, 4), np.zeros((4, 3)))
  np.testing.assert_array_equal(
      jax.grad(lambda a: jnp.sum(packing.scatter_rows(a, none, 4)))(empty), empty)
  np.testing.assert_array_equal(
      jax.grad(lambda b: jnp.sum(packing.gather_rows(b, none)))(buf), np.zeros((9, 3)))

  # Padding rows of the buffer get exactly zero gradient through gather_rows.
  grad = jax.grad(lambda a: jnp.sum(packing.gather_rows(a, rows)))(buf)
  np.testing.assert_array_equal(np.asarray(grad)[[1, 3, 4, 6, 8]], 0.0)


def test_packed_gla_with_no_tokens_keeps_the_initial_state():
  from sse_jax import ops  # pylint: disable=g-import-not-at-top
  x = jnp.zeros((1, 0, 2, 16))
  h0 = jax.random.normal(jax.random.PRNGKey(0), (1, 2, 16, 16))
  cu = jnp.asarray([0, 0], jnp.int32)
  run = lambda h: ops.gla(x, x, x, x, initial_state=h, output_final_state=True,
                          cu_seqlens=cu, impl="chunk")
  o, final = jax.jit(run)(h0)
  assert o.shape == (1, 0, 2, 16)
  np.testing.assert_array_equal(final, h0)
  grad = jax.grad(lambda h: jnp.sum(run(h)[1]))(h0)
  np.testing.assert_array_equal(grad, np.ones_like(h0))


def test_packed_ops_take_parts_and_refuse_parts_that_do_not_match():
  """gla.packed_chunked / gdn.packed_chunk_gdn on inputs given as two parts: the same
  outputs (as parts) and final states as on their concatenation; parts of different
  lengths across q, k, v, g (and beta) are refused by name."""
  # The modules, not the ops of the same names that sse_jax.ops exports.
  gla = importlib.import_module("sse_jax.ops.gla")
  gdn = importlib.import_module("sse_jax.ops.gdn")
  p, h, d = 13, 2, 16
  keys = jax.random.split(jax.random.PRNGKey(4), 5)
  q, k, v = (jax.random.normal(key, (p, h, d)) for key in keys[:3])
  g = -jax.nn.softplus(jax.random.normal(keys[3], (p, h, d)))
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (p, h)))
  seg = jnp.asarray([1, 0, 1, 1, 0, 0, 1, 0, 0, 2, 2, 2, 2], jnp.int32)
  h0 = jnp.zeros((3, h, d, d))
  halves = lambda x: (x[:9], x[9:])
  for name, run, args in (
      ("gla", lambda *a: gla.packed_chunked(*a, seg, h0, 16, sorted_tail=4), (q, k, v, g)),
      ("gdn", lambda *a: gdn.packed_chunk_gdn(a, seg, h0, 16, sorted_tail=4),
       (q, k, v, g[..., 0], beta))):
    o, final = run(*args)
    (o9, o4), final_parts = run(*map(halves, args))
    np.testing.assert_allclose(np.concatenate([o9, o4]), o, rtol=1e-6, atol=1e-6,
                               err_msg=name)
    np.testing.assert_allclose(final_parts, final, rtol=1e-6, atol=1e-6, err_msg=name)
    bad = [halves(x) for x in args]
    bad[1] = (args[1][:8], args[1][8:])  # k cut elsewhere
    with pytest.raises(ValueError, match="k's parts|same slots"):
      run(*bad)
