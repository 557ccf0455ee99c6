"""The row-move kernel (`pallas_kernels.move_rows`) against its XLA reference, and the
packing's gradients through it.

`TestMoveRowsGPU` runs the compiled kernel (skipped without a GPU); `TestMoveRowsInterpret`
reruns it in Pallas interpret mode, which is what CI exercises on CPU.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import move_rows as kernel
from sse_jax.ops import packing


class TestMoveRowsGPU:
  INTERPRET = False

  @pytest.fixture(autouse=True)
  def _mode(self):
    if not self.INTERPRET and jax.default_backend() != "gpu":
      pytest.skip("needs a GPU; TestMoveRowsInterpret runs these tests in interpret mode")
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", category=DeprecationWarning,
                              message="The Pallas Triton backend is deprecated")
      yield

  @pytest.mark.parametrize("shape, rows, dtype, blocks", [
      ((100, 6, 128), 131, "bfloat16", {}),          # R not a multiple of the tile
      ((37, 6), 50, "float32", {}),                  # width 6: tiles of 2 columns
      ((64, 8, 16), 64, "float32", dict(rows=16, cols=32)),
      ((9, 2, 4), 0, "float32", {}),                 # nothing to take
      ((0, 2, 4), 5, "float32", {}),                 # nothing to take from: all zeros
  ])
  def test_equals_the_xla_gather(self, shape, rows, dtype, blocks):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=shape), dtype)
    # Indices in range, past the end (padding rows: P is what the packing uses) and
    # negative (zeros too, unlike numpy's wrap-around).
    take = jnp.asarray(rng.integers(-3, shape[0] + 6, rows), jnp.int32)
    got = kernel.move_rows(x, take, block_sizes=kernel.BlockSizes(**blocks),
                           interpret=self.INTERPRET)
    want = kernel.reference(x, take)
    assert got.shape == want.shape == (rows,) + shape[1:] and got.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    inside = (np.asarray(take) >= 0) & (np.asarray(take) < shape[0])
    assert not np.any(np.asarray(got, np.float32)[~inside]), "a padding row is not zero"

  def test_sources_read_as_their_concatenation(self):
    """A tuple of sources (one empty) copies exactly what their concatenation would."""
    rng = np.random.default_rng(1)
    sources = tuple(jnp.asarray(rng.normal(size=(n, 3, 8)), jnp.bfloat16) for n in (21, 0, 40))
    take = jnp.asarray(rng.permutation(np.arange(-5, 70))[:66], jnp.int32)
    got = kernel.move_rows(sources, take, block_sizes=kernel.BlockSizes(rows=16, cols=8),
                           interpret=self.INTERPRET)
    want = kernel.reference(jnp.concatenate(sources), take)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="source 1"):
      kernel.move_rows((sources[0], sources[2].astype(jnp.float32)), take,
                       interpret=self.INTERPRET)

  def _setting(self, segments, sorted_tail=0):
    """(layout of 4 segments in chunks of 4, buffer rows, slot values x [P, 2, 8], buffer
    weights w, the kernel as the mover) for slots of segment ids `segments`."""
    seg = jnp.asarray(segments, jnp.int32)
    layout = packing.chunk_layout(seg, 4, 4, sorted_tail=sorted_tail)
    rows = 4 * packing.max_chunks(seg.shape[0], 4, 4)
    x = jax.random.normal(jax.random.PRNGKey(seg.shape[0]), (seg.shape[0], 2, 8))
    w = jax.random.normal(jax.random.PRNGKey(1), (rows, 2, 8))
    return layout, rows, x, w, functools.partial(kernel.move_rows, interpret=self.INTERPRET)

  def test_packing_from_parts_equals_packing_their_concatenation(self):
    """scatter_rows from parts and gather_rows into parts, with the kernel: the same
    buffer and slots as from the concatenation, and each part's gradient its share."""
    layout, rows, x, w, pallas = self._setting([2, 0, 2, 1, 0, 2, 0, 0, 1, 3, 3, 3, 3],
                                               sorted_tail=4)

    def loss(parts, move):
      buffer = packing.scatter_rows(parts, layout.rows, rows, move)
      back = packing.gather_rows(buffer * 2.0, layout.rows, move, sizes=(9, 4))
      return jnp.sum(buffer * w) + jnp.sum(back[0] ** 2) + 3.0 * jnp.sum(back[1] ** 2), (
          buffer, back)

    (d9, d4), (buffer, (b9, b4)) = jax.grad(loss, has_aux=True)((x[:9], x[9:]), pallas)
    np.testing.assert_array_equal(buffer, packing.scatter_rows(x, layout.rows, rows))
    np.testing.assert_array_equal(b9, 2.0 * x[:9])
    np.testing.assert_array_equal(b4, 2.0 * x[9:])
    want = np.asarray(w[layout.rows]) + np.concatenate([8.0 * x[:9], 24.0 * x[9:]])
    np.testing.assert_allclose(np.concatenate([d9, d4]), want, rtol=1e-6)
    with pytest.raises(ValueError, match="must sum to the 13 slots"):
      packing.gather_rows(buffer, layout.rows, pallas, sizes=(9, 5))

  def test_packing_round_trip_and_gradients(self):
    """scatter_rows then gather_rows with the kernel as the mover: the identity, and
    the same values and gradients as the XLA mover (both are exact copies)."""
    layout, rows, x, w, pallas = self._setting([2, 0, 2, 1, 0, 2, 0, 0, 1, 2, 2])

    def loss(x, move):
      buffer = packing.scatter_rows(x, layout.rows, rows, move)
      back = packing.gather_rows(buffer * 2.0, layout.rows, move)
      return jnp.sum(buffer * w) + jnp.sum(back * back), (buffer, back)

    grad = jax.grad(loss, has_aux=True)
    (dx, (buffer, back)), (dx_ref, (buffer_ref, _)) = (
        grad(x, pallas), grad(x, packing.take_rows))
    np.testing.assert_array_equal(back, 2.0 * x)
    np.testing.assert_array_equal(buffer, buffer_ref)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-6)
    np.testing.assert_allclose(dx, w[layout.rows] + 8.0 * x, rtol=1e-6)


class TestMoveRowsInterpret(TestMoveRowsGPU):
  INTERPRET = True


def test_block_sizes_refuse_tiles_that_are_not_powers_of_two():
  with pytest.raises(ValueError, match="rows=24"):
    kernel.BlockSizes(rows=24)
  with pytest.raises(ValueError, match="cols=0"):
    kernel.BlockSizes(cols=0)
