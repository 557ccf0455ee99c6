"""The Pallas gated delta-rule kernels (`pallas_kernels.chunk_gdn`) through gdn and
sse_gdn ("pallas_chunk", "pallas_masking", "pallas_varlen"), against the scan.

`TestPallasGdnGPU` runs the kernels compiled for the GPU in float32 (skipped without
one); `TestPallasGdnInterpret` reruns every test in Pallas interpret mode, where the
exact cases run the kernels in float64 (the ops keep float64 inputs in float64 on the
Pallas core) and must match the float64 scan to 1e-6. Grids are tiny (chunk 16, T <= 40,
head dims 16): interpret mode compiles every kernel into the test's program.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import chunk_gdn as kernels
from sse_jax import ops
from sse_jax.ops.gdn import chunk_gdn as xla_chunk_gdn
from sse_jax.ops import impl as impl_lib
from tests.op_testing import assert_close, cuda_triton_kernels, random_routing, x64
from tests.test_ops_gdn import random_gdn

# bf16 q, k, v (fp32 accumulation; bf16 or ~16-bit products with T and the score
# matrices) against the float64 scan on the same bf16 values: measured 2e-3 to 4.2e-3.
BF16_TOL = 1e-2
C = 16
D = 16


def _up(tree, dtype):
  return jax.tree_util.tree_map(
      lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _compare(out, ref, tol, names):
  leaves = jax.tree_util.tree_leaves
  assert len(leaves(out)) == len(leaves(ref)) == len(names), (names, len(leaves(out)))
  for name, a, r in zip(names, leaves(out), leaves(ref)):
    assert_close(a, r, tol, name)


def _gdn_value_and_grads(impl, cu):
  def loss(x, h0, cot):
    o, f = ops.gdn(*x, initial_state=h0, output_final_state=True, cu_seqlens=cu, impl=impl,
                   chunk_size=C)
    return jnp.sum(o.astype(jnp.float32) * cot[0]) + jnp.sum(f * cot[1]), (o, f)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _sse_value_and_grads(impl, n, cu, gate, read):
  def loss(x, w, shared, h0, idx, cot):
    rd = dict(read_weights=w[1], read_indices=idx[1]) if read else {}
    o, (f, f0) = ops.sse_gdn(*x, w[0], idx[0], num_partitions=n, gate=gate,
                             initial_state=h0, output_final_state=True, cu_seqlens=cu,
                             impl=impl, shared=shared, chunk_size=C, **rd)
    val = (jnp.sum(o.astype(jnp.float32) * cot[0]) + jnp.sum(f * cot[1])
           + jnp.sum(f0 * cot[2]))
    return val, (o, f, f0)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def _core_value_and_grads(core, x, start, count, cot):
  """(o, final) and the gradients w.r.t. (q, k, v, g, beta, h0) = x of a kernel core's
  loss sum(o * cot) + sum(final^2), over the segment table (start, count)."""
  def loss(*x):
    o, f = core(*x, start, count)
    return jnp.sum(o * cot) + jnp.sum(f * f), (o, f)
  (_, out), grads = jax.jit(jax.value_and_grad(loss, tuple(range(6)), has_aux=True))(*x)
  return out, grads


def _core_inputs(key, shape, dk, dv, segments, dtype):
  """Random core inputs (q, k, v, g, beta, h0) and a cotangent of o: chunks `shape` =
  (B, NC, C, H), unit-norm keys, g = -0.2 |N(0, 1)|, beta ~ U(0, 2)."""
  keys = jax.random.split(key, 7)
  q, k = (jax.random.normal(kk, shape + (dk,), dtype) for kk in keys[:2])
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = jax.random.normal(keys[2], shape + (dv,), dtype)
  g = -0.2 * jnp.abs(jax.random.normal(keys[3], shape, dtype))
  beta = 2.0 * jax.random.uniform(keys[4], shape, dtype)
  h0 = jax.random.normal(keys[5], (segments, shape[3], dk, dv), dtype)
  return (q, k, v, g, beta, h0), jax.random.normal(keys[6], shape + (dv,), dtype)


GDN_NAMES = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")
SSE_NAMES = ("o", "final", "final'", "dq", "dk", "dv", "dg", "dbeta", "dweights",
             "dread_weights", "dq'", "dk'", "dg'", "dbeta'", "dh0", "dh0'")


class TestPallasGdnGPU:
  INTERPRET = False
  EXACT = jnp.float32     # the dtype of the exact cases, and their tolerance against
  exact_tol = 1e-4        # the float64 scan

  @pytest.fixture(autouse=True)
  def _mode(self):
    if not self.INTERPRET and jax.default_backend() != "gpu":
      pytest.skip("needs a GPU; TestPallasGdnInterpret runs these tests in interpret mode")
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", category=DeprecationWarning,
                              message="The Pallas Triton backend is deprecated")
      yield

  def impl(self, algorithm: str, **block_sizes) -> ops.Plan:
    """The Pallas plan of `algorithm` ("chunk", "masking", "varlen") in this mode, with
    BlockSizes fields `block_sizes` if any."""
    bs = kernels.BlockSizes(chunk=C, **block_sizes) if block_sizes else None
    return ops.Plan(ops.Algorithm(algorithm), ops.PallasCore(bs, self.INTERPRET))

  @pytest.mark.parametrize("b, t, cu, beta_max, exact, dk, dv, blocks", [
      (1, 40, (0, 7, 7, 40), 2.0, True, D, D, {}),  # ragged, empty seq., T % C != 0
      (1, 40, (0, 7, 7, 40), 2.0, True, 2 * D, 2 * D,  # walks and gradients over two
       dict(walk_block_v=D, grads_block_v=D, grads_block_k=D, prefetch=True,  # tiles,
            walk_stages=2, split_grads=False)),  # the gradients as one kernel
      (2, 21, None, 1.0, False, D, D, {}),          # batch rows, T % C != 0, bf16
      (2, 21, None, 1.0, False, 2 * D, 2 * D,       # bf16, split products, output and
       dict(block_v=D, split_products=True, grads_warps=2, grads_block_k=D,  # local du
            prefetch=True)),                                                 # in 2 tiles
      (1, 40, (0, 7, 7, 40), 2.0, True, 2 * D, 2 * D,  # the gradients as two kernels
       dict(grads_block_k=D, grads_block_v=D)),     # (the default), two Dk tiles
      (2, 21, None, 1.0, False, 2 * D, D,           # the same in bf16 ([C, C] terms
       dict(split_grads=True, grads_block_k=D)),    # kept in bf16)
      pytest.param(1, 40, (0, 7, 7, 40), 2.0, True, D, D,  # packed slots read in
                   dict(gather_rows=True), id="gather_rows"),  # place
      pytest.param(1, 40, (0, 7, 7, 40), 2.0, False, 2 * D, 2 * D,  # the same in bf16,
                   dict(gather_rows=True, split_grads=False, prefetch=True,  # one
                        walk_block_v=D), id="gather_rows_bf16_one_grads_kernel"),
  ])
  def test_gdn_matches_scan(self, b, t, cu, beta_max, exact, dk, dv, blocks):
    s = b if cu is None else len(cu) - 1
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)
    with x64():
      dtype, tol = (self.EXACT, self.exact_tol) if exact else (jnp.bfloat16, BF16_TOL)
      keys = jax.random.split(jax.random.PRNGKey(1), 4)
      x = _up(random_gdn(keys[0], b, t, 2, dk, dv, jnp.float32, beta_max), dtype)
      h0 = jax.random.normal(keys[1], (s, 2, dk, dv), jnp.float32)
      cot = (jax.random.normal(keys[2], x.v.shape, jnp.float32),
             jax.random.normal(keys[3], h0.shape, jnp.float32))
      h0, cot = _up((h0, cot), self.EXACT if exact else jnp.float32)
      (_, out), grads = _gdn_value_and_grads(self.impl("chunk", **blocks), cu)(x, h0, cot)
      (_, ref), ref_grads = _gdn_value_and_grads("scan", cu)(*_up((x, h0, cot), jnp.float64))
    assert out[0].dtype == dtype
    _compare((out, grads), (ref, ref_grads), tol, GDN_NAMES)

  @pytest.mark.parametrize("impl, n, top_k, gate, read, cu, exact", [
      ("varlen", 3, 2, "write", True, (0, 9, 9, 34), True),    # K = 2, separate reads
      ("masking", 4, 1, "both", False, (0, 20, 34), True),     # K = 1
      ("varlen", 3, 3, "read", False, None, True),             # K = N, dense batch
      ("masking", 3, 2, "none", True, None, True),
      ("varlen", 4, 1, "both", False, (0, 20, 34), False),     # bf16
      # The routed and shared slots read in place (BlockSizes.gather_rows).
      ("varlen_in_place", 3, 2, "both", True, (0, 9, 9, 34), True),
  ])
  def test_sse_gdn_matches_scan(self, impl, n, top_k, gate, read, cu, exact):
    b, t, h = (1, 34, 1) if cu is not None else (2, 19, 1)
    s = b if cu is None else len(cu) - 1
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)
    with x64():
      dtype, tol = (self.EXACT, self.exact_tol) if exact else (jnp.bfloat16, BF16_TOL)
      keys = jax.random.split(jax.random.PRNGKey(3), 9)
      x = random_gdn(keys[0], b, t, h, D, D, jnp.float32, beta_max=2.0)
      y = random_gdn(keys[1], b, t, h, D, D, jnp.float32)
      w = random_routing(keys[2], b, t, n, top_k)
      rw = random_routing(keys[3], b, t, n, 1)
      shared = (y.q, y.k, 0.5 * x.g, y.beta)
      h0 = (jax.random.normal(keys[4], (s, n, h, D, D)), jax.random.normal(keys[5], (s, h, D, D)))
      cot = tuple(jax.random.normal(kk, a.shape) for kk, a in zip(keys[6:], (x.v,) + h0))
      x, shared = _up((x, shared), dtype)
      wide = self.EXACT if exact else jnp.float32
      args = (x, _up((w[0], rw[0]), wide), shared, _up(h0, wide), (w[1], rw[1]),
              _up(cot, wide))
      plan = (self.impl("varlen", gather_rows=True) if impl == "varlen_in_place"
              else self.impl(impl))
      (_, out), grads = _sse_value_and_grads(plan, n, cu, gate, read)(*args)
      (_, ref), ref_grads = _sse_value_and_grads("scan", n, cu, gate, read)(
          *_up(args, jnp.float64))
    names = list(SSE_NAMES)
    if not read:  # the read weights are unused: no gradient leaf compared
      names.remove("dread_weights")
      grads = grads[:1] + ((grads[1][0],),) + grads[2:]
      ref_grads = ref_grads[:1] + ((ref_grads[1][0],),) + ref_grads[2:]
    _compare((out, grads), (ref, ref_grads), tol, names)

  def test_unselected_partition_is_an_exact_identity(self):
    """Partition N-1 is never selected: its final state is its initial state bit for
    bit, through both Pallas paths (forward: the kernels never see it in varlen, and
    see identity rows g = beta = 0 in masking)."""
    n, b, t = 3, 1, 30
    x = random_gdn(jax.random.PRNGKey(5), b, t, 1, D, D)
    w, idx = random_routing(jax.random.PRNGKey(6), b, t, n, 1, mode="skip_last")
    h0 = jax.random.normal(jax.random.PRNGKey(7), (b, n, 1, D, D))
    for algorithm in ("varlen", "masking"):
      fn = jax.jit(functools.partial(ops.sse_gdn, num_partitions=n,
                                     impl=self.impl(algorithm), output_final_state=True,
                                     chunk_size=C))
      o, final = fn(*x, w, idx, initial_state=h0)
      np.testing.assert_array_equal(np.asarray(final[:, -1]), np.asarray(h0[:, -1]))
      o_ref, ref = ops.sse_gdn(*x, w, idx, num_partitions=n, impl="scan",
                               initial_state=h0, output_final_state=True)
      assert_close(o, o_ref, 1e-4, f"{algorithm} o")
      assert_close(final, ref, 1e-4, f"{algorithm} final")

  def test_core_with_gaps_and_empty_segments(self):
    """The kernel core against its own token-by-token reference: two batch rows of
    chunks, a segment of two chunks, an empty one, a chunk of no segment (zero output)
    and hard-reset-sized gates (LOG_DECAY_FLOOR rows)."""
    with x64():
      x, cot = _core_inputs(jax.random.PRNGKey(8), (2, 2, C, 1), D, 2 * D, 3, self.EXACT)
      q, k, v, g, beta, h0 = x
      x = (q, k, v, g.at[0, 1, 5].set(-200.0), beta, h0)
      start, count = jnp.asarray([0, 2, 2]), jnp.asarray([2, 0, 1])
      out, grads = _core_value_and_grads(
          functools.partial(kernels.chunk_gdn, interpret=self.INTERPRET), x, start, count,
          cot)
      ref, ref_grads = _core_value_and_grads(kernels.reference, x, start, count, cot)
    assert not np.any(np.asarray(out[0])[1, 1]), "a chunk of no segment"
    _compare((out, grads), (ref, ref_grads), self.exact_tol, GDN_NAMES)

  @pytest.mark.parametrize("chunk, prepare_block", [(64, 16), (32, 16), (64, 32)])
  def test_core_with_t_in_blocks(self, chunk, prepare_block):
    """T = (I + A)^{-1} built from [prepare_block]^2 blocks (2 or 4 along the chunk,
    below-diagonal blocks from one or several earlier ones) against the token-by-token
    reference: outputs, final states and every gradient, over a segment of one chunk
    and one of two."""
    with x64():
      x, cot = _core_inputs(jax.random.PRNGKey(9), (1, 3, chunk, 1), D, D, 2, self.EXACT)
      start, count = jnp.asarray([0, 1]), jnp.asarray([1, 2])
      bs = kernels.BlockSizes(chunk=chunk, prepare_block=prepare_block)
      out, grads = _core_value_and_grads(
          functools.partial(kernels.chunk_gdn, block_sizes=bs, interpret=self.INTERPRET),
          x, start, count, cot)
      ref, ref_grads = _core_value_and_grads(kernels.reference, x, start, count, cot)
    _compare((out, grads), (ref, ref_grads), self.exact_tol, GDN_NAMES)


class TestPallasGdnInterpret(TestPallasGdnGPU):
  INTERPRET = True
  EXACT = jnp.float64
  exact_tol = 1e-6


def test_kernel_reference_is_the_xla_chunk_core():
  """The kernel file's own reference and the ops' XLA chunk core agree in float64, on
  segments with an empty one, a gap and a batch row of two."""
  with x64():
    keys = jax.random.split(jax.random.PRNGKey(4), 6)
    shape = (2, 3, 8, 2)
    q, k = (jax.random.normal(kk, shape + (4,), jnp.float64) for kk in keys[:2])
    v = jax.random.normal(keys[2], shape + (3,), jnp.float64)
    g = -jnp.abs(jax.random.normal(keys[3], shape, jnp.float64))
    beta = jax.random.uniform(keys[4], shape, jnp.float64)
    h0 = jax.random.normal(keys[5], (4, 2, 4, 3), jnp.float64)
    start, count = jnp.asarray([0, 2, 3, 5]), jnp.asarray([2, 0, 2, 0])
    ref = kernels.reference(q, k, v, g, beta, h0, start, count)
    xla = xla_chunk_gdn(q, k, v, g, beta, h0, start, count)
    for name, a, b in zip(("o", "final"), ref, xla):
      assert_close(a, b, 1e-12, name)


@pytest.mark.parametrize("split_grads", [False, True])
def test_kernels_lower_for_cuda(split_grads):
  """The compiled (non-interpret) kernels, forward and backward, lower for CUDA at the
  benchmark's head dim (catches what Triton rejects but interpret mode accepts):
  prepare, states, outputs, then the local du, the reverse walk and the gradient kernel
  (two with split_grads)."""
  b, t, h, d = 1, 128, 2, 128
  x = random_gdn(jax.random.PRNGKey(0), b, t, h, d, d, jnp.bfloat16)
  w, idx = random_routing(jax.random.PRNGKey(1), b, t, 4, 1)
  cu = jnp.asarray((0, 64, 128), jnp.int32)
  bs = kernels.BlockSizes(split_grads=split_grads)
  plan = lambda a: ops.Plan(ops.Algorithm(a), ops.PallasCore(bs, False))

  def loss(x, w):  # pallas_chunk runs the same kernels, on other grids
    o, _ = ops.sse_gdn(*x, w, idx, num_partitions=4, cu_seqlens=cu, impl=plan("varlen"),
                       shared=(x.q, x.k, x.g, x.beta))
    return jnp.sum(o.astype(jnp.float32))

  counts = cuda_triton_kernels(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
  moves = counts.pop("move_rows", 0)
  calls = sum(counts.values())
  assert calls == 6 + split_grads, f"expected {6 + split_grads} Triton calls, found {counts}"
  # The packing's row moves, the routed and the shared slots as two parts: q, k, v, g,
  # beta into the buffer (one move each, reading both parts) and o out (one per part),
  # then the cotangents the other way (1 + 10), and q, k, v, beta into the buffer again
  # in the backward pass, which recomputes the packed copies instead of keeping them (4).
  assert moves == 22, f"expected 22 row moves, found {moves}"
  # BlockSizes.gather_rows: the kernels read the slots in place, no row moves.
  bs = kernels.BlockSizes(split_grads=split_grads, gather_rows=True)
  counts = cuda_triton_kernels(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
  assert "move_rows" not in counts and sum(counts.values()) == 6 + split_grads, counts


def test_profile_gdn_variants_measures_time_and_error():
  """`experiments.profile_kernels.gdn_variants` (interpret mode, tiny): one row per
  variant with device time and gradient errors against float32 at the bf16 level."""
  from experiments import profile_kernels  # pylint: disable=g-import-not-at-top
  rows = profile_kernels.gdn_variants(64, 1, 16, 16, ["defaults", "split_products=true"],
                                      True, reps=1)
  assert [r["gdn_variant"] for r in rows] == ["defaults", "split_products=true"]
  for row in rows:
    assert row["device_ms"] > 0
    assert set(row["rel_error"]) == {"dq", "dk", "dv", "dg", "dbeta"}
    assert all(1e-5 < e < 2e-2 for e in row["rel_error"].values()), row["rel_error"]


def test_auto_and_plans_for_the_delta_rule_ops(monkeypatch):
  """"auto" picks the Pallas kernels on a supported GPU where they take the shapes, the
  XLA forms elsewhere; the strings fill in the GDN kernels' BlockSizes; a GLA
  BlockSizes is refused for a GDN op, and unsupported shapes name the value."""
  auto = impl_lib.Impl.AUTO
  assert (impl_lib.resolve_auto(auto, "gdn", (16, 16)) is impl_lib.Impl.PALLAS_CHUNK) == (
      impl_lib.pallas_gpu())
  monkeypatch.setattr(impl_lib, "pallas_gpu", lambda device=None: True)
  assert impl_lib.resolve_auto(auto, "gdn", (128, 128), 64) is impl_lib.Impl.PALLAS_CHUNK
  assert impl_lib.resolve_auto(auto, "sse_gdn", (128, 64)) is impl_lib.Impl.PALLAS_VARLEN
  assert impl_lib.resolve_auto(auto, "gdn", (256, 256)) is impl_lib.Impl.CHUNK
  assert impl_lib.resolve_auto(auto, "sse_gdn", (64, 64), 128) is impl_lib.Impl.VARLEN
  monkeypatch.setattr(impl_lib, "pallas_gpu", lambda device=None: False)
  assert impl_lib.resolve_auto(auto, "gdn", (128, 128)) is impl_lib.Impl.CHUNK
  assert impl_lib.resolve_auto(auto, "sse_gdn", (128, 128)) is impl_lib.Impl.VARLEN

  plan, c = impl_lib.plan("pallas_varlen", "sse_gdn", chunk_size=32, head_dims=(16, 32))
  assert c == 32 and plan.core.block_sizes == kernels.BlockSizes(chunk=32)
  # The XLA delta-rule core takes any chunk size the op accepts.
  assert impl_lib.plan("chunk", "gdn", chunk_size=7, head_dims=(4, 4))[1] == 7
  from pallas_kernels import chunk_gla  # pylint: disable=g-import-not-at-top
  gla_plan = ops.Plan(ops.Algorithm.CHUNK, ops.PallasCore(chunk_gla.BlockSizes(chunk=64)))
  x = random_gdn(jax.random.PRNGKey(0), 1, 8, 1, 16, 16)
  with pytest.raises(ValueError, match="is not a pallas_kernels.chunk_gdn.BlockSizes"):
    ops.gdn(*x, impl=gla_plan)
  with pytest.raises(ValueError, match=r"Dv=48: the Pallas GDN kernels support head dims"):
    ops.gdn(*x[:2], jnp.zeros((1, 8, 1, 48)), *x[3:], impl="pallas_chunk")
  with pytest.raises(ValueError, match="block_v=24"):
    kernels.BlockSizes(block_v=24)
