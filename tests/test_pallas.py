"""Pallas kernels through the ops API, against the lax.scan reference.

`TestPallasGPU` runs the kernels compiled for the GPU (skipped without one);
`TestPallasInterpret` reruns every test in Pallas interpret mode, which is what CI
exercises on CPU: the mode is the `interpret` field of the ops' typed impl
(`ops.PallasCore`), passed explicitly. `test_kernels_lower_for_cuda` lowers the real
(non-interpret) kernels for CUDA on any machine, so Triton-only restrictions fail in
CI too.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import chunk_gla as pallas_chunk_gla
from sse_jax import ops
from sse_jax.ops import chunked
from sse_jax.ops import impl as impl_lib
from tests.op_testing import (assert_close, cuda_triton_calls, cuda_triton_kernels,
                               random_qkvg, random_routing, rel_err, x64)

BF16_TOL = 5e-3   # bf16 matmul operands, fp32 accumulation (the target)


def _gla_value_and_grads(impl, cu, chunk, with_h0):
  def loss(q, k, v, g, h0, cot):
    o, f = ops.gla(q, k, v, g, initial_state=h0 if with_h0 else None,
                   output_final_state=True, cu_seqlens=cu, impl=impl, chunk_size=chunk)
    return jnp.sum(o.astype(jnp.float32) * cot[0]) + jnp.sum(f * cot[1]), (o, f)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


def _sse_value_and_grads(impl, n, cu, chunk, gate, read):
  def loss(q, k, v, g, w, shared, h0, idx, cot):
    rd = dict(read_weights=w[1], read_indices=idx[1]) if read else {}
    o, (f, f0) = ops.sse(q, k, v, g, w[0], idx[0], num_partitions=n, gate=gate,
                         initial_state=h0, output_final_state=True, cu_seqlens=cu,
                         impl=impl, shared=shared, chunk_size=chunk, **rd)
    val = (jnp.sum(o.astype(jnp.float32) * cot[0]) + jnp.sum(f * cot[1])
           + jnp.sum(f0 * cot[2]))
    return val, (o, f, f0)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5, 6), has_aux=True))


def _up(tree, dtype):
  return jax.tree_util.tree_map(
      lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def pallas(algorithm: str, interpret: bool | None = None, **block_sizes) -> ops.Plan:
  """The typed impl: `algorithm` ("chunk", "varlen", ...) on the Pallas core."""
  bs = pallas_chunk_gla.BlockSizes(**block_sizes) if block_sizes else None
  return ops.Plan(ops.Algorithm(algorithm), ops.PallasCore(bs, interpret))


def _compare(out, ref, tol, names):
  leaves = jax.tree_util.tree_leaves
  for name, a, r in zip(names, leaves(out), leaves(ref)):
    assert_close(a, r, tol, name)


class TestPallasGPU:
  INTERPRET = False
  # fp32 kernels (IEEE dots) against the references. Interpret mode runs the kernels'
  # arithmetic in XLA on the CPU (errors measured 3e-7 to 8e-7); on the GPU the looser
  # bound of the first GPU runs stands until fp32 errors are measured there.
  fp32_tol = 1e-4

  @pytest.fixture(autouse=True)
  def _mode(self):
    if not self.INTERPRET and jax.default_backend() != "gpu":
      pytest.skip("needs a GPU; TestPallasInterpret runs these tests in interpret mode")
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", category=DeprecationWarning,
                              message="The Pallas Triton backend is deprecated")
      yield

  def impl(self, name: str) -> ops.Plan:
    """The Pallas impl `name` ("pallas_varlen", ...) in this class's mode."""
    return pallas(name.removeprefix("pallas_"), self.INTERPRET)

  @pytest.mark.parametrize("b, t, dk, dv, cu, chunk, with_h0", [
      (1, 100, 16, 16, (0, 30, 30, 100), 32, True),   # ragged, empty sequence, T % C
      (2, 27, 16, 32, None, 32, False),               # T < C, Dk != Dv
      (1, 150, 16, 16, (0, 70, 150), 64, True),       # the default chunk, T % 64 != 0
  ])
  @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
  def test_gla_matches_scan(self, b, t, dk, dv, cu, chunk, with_h0, dtype):
    dtype = jnp.dtype(dtype)
    x = random_qkvg(jax.random.PRNGKey(1), b, t, 2, dk, dv, dtype)
    s = b if cu is None else len(cu) - 1
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)
    ks = jax.random.split(jax.random.PRNGKey(2), 3)
    h0 = jax.random.normal(ks[0], (s, 2, dk, dv))
    cot = (jax.random.normal(ks[1], (b, t, 2, dv)), jax.random.normal(ks[2], h0.shape))
    (_, out), grads = _gla_value_and_grads(self.impl("pallas_chunk"), cu, chunk, with_h0)(
        *x, h0, cot)
    with x64():
      (_, ref), ref_grads = _gla_value_and_grads("scan", cu, chunk, with_h0)(
          *_up(tuple(x), jnp.float64), _up(h0, jnp.float64), _up(cot, jnp.float64))
    assert out[0].dtype == dtype
    tol = self.fp32_tol if dtype == jnp.float32 else BF16_TOL
    _compare(out, ref, tol, ("o", "final"))
    names = ("dq", "dk", "dv", "dg") + (("dh0",) if with_h0 else ())
    _compare(grads[:len(names)], ref_grads[:len(names)], tol, names)

  @pytest.mark.parametrize("impl", ["pallas_varlen", "pallas_masking"])
  @pytest.mark.parametrize("n, top_k, gate, read, dtype, routing", [
      (4, 1, "both", False, "float32", "random"),
      (3, 2, "write", True, "float32", "random"),
      (4, 2, "both", False, "bfloat16", "random"),
      (3, 3, "read", False, "float32", "random"),    # K = N
      (1, 1, "none", False, "float32", "random"),    # one partition
      (4, 2, "both", False, "float32", "one"),       # every token to the same partitions
  ])
  def test_sse_matches_scan(self, impl, n, top_k, gate, read, dtype, routing):
    dtype = jnp.dtype(dtype)
    b, t, h, d = 1, 90, 2, 16
    cu = jnp.asarray((0, 20, 90), jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(3), 8)
    x = random_qkvg(keys[0], b, t, h, d, d, dtype)
    w = random_routing(keys[1], b, t, n, top_k, dtype, routing)
    rw = random_routing(keys[2], b, t, n, 1, dtype)
    shared = tuple(random_qkvg(keys[3], b, t, h, d, d, dtype))[:2] + (0.5 * x.g,)
    h0 = (jax.random.normal(keys[4], (2, n, h, d, d)), jax.random.normal(keys[5], (2, h, d, d)))
    cot = (jax.random.normal(keys[6], (b, t, h, d)), jax.random.normal(keys[7], h0[0].shape),
           jax.random.normal(keys[7], h0[1].shape))
    args = (*x, (w[0], rw[0]), shared, h0, (w[1], rw[1]), cot)
    (_, out), grads = _sse_value_and_grads(self.impl(impl), n, cu, 32, gate, read)(*args)
    with x64():
      (_, ref), ref_grads = _sse_value_and_grads("scan", n, cu, 32, gate, read)(
          *_up(args, jnp.float64))
    tol = self.fp32_tol if dtype == jnp.float32 else BF16_TOL
    _compare(out, ref, tol, ("o", "final", "final shared"))
    names = ["dq", "dk", "dv", "dg", "dweights", "dread_weights", "dq'", "dk'", "dg'",
             "dh0", "dh0'"]
    if not read:
      names.remove("dread_weights")
      grads = grads[:4] + ((grads[4][0],),) + grads[5:]
      ref_grads = ref_grads[:4] + ((ref_grads[4][0],),) + ref_grads[5:]
    _compare(grads, ref_grads, tol, names)

  @pytest.mark.parametrize("impl", ["pallas_varlen", "pallas_masking"])
  def test_unselected_partition_is_an_exact_identity(self, impl):
    n, b, t, h, d = 4, 2, 50, 1, 16
    x = random_qkvg(jax.random.PRNGKey(5), b, t, h, d, d)
    w, idx = random_routing(jax.random.PRNGKey(6), b, t, n, 2, mode="skip_last")
    h0 = jax.random.normal(jax.random.PRNGKey(7), (b, n, h, d, d))
    fn = jax.jit(functools.partial(ops.sse, num_partitions=n, impl=self.impl(impl),
                                   output_final_state=True, chunk_size=32))
    o, final = fn(*x, w, idx, initial_state=h0)
    np.testing.assert_array_equal(np.asarray(final[:, -1]), np.asarray(h0[:, -1]))
    o_ref, ref = ops.sse(*x, w, idx, num_partitions=n, impl="scan", initial_state=h0,
                         output_final_state=True)
    assert_close(o, o_ref, self.fp32_tol, "o")
    assert_close(final, ref, self.fp32_tol, "final")

  @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
  def test_gather_rows_matches_scan(self, dtype):
    """BlockSizes.gather_rows: the packed ops read their slots in place (no copies into
    a buffer and back). Packed GLA (ragged, an empty sequence) and SSE varlen with the
    shared partition (the routed and shared slots as two parts), fwd + bwd, against
    the float64 scan."""
    dtype = jnp.dtype(dtype)
    b, t, h, d, n = 1, 90, 2, 16, 4
    impl = lambda name: pallas(name, self.INTERPRET, chunk=32, gather_rows=True)
    keys = jax.random.split(jax.random.PRNGKey(12), 9)
    x = random_qkvg(keys[0], b, t, h, d, d, dtype)
    cu = jnp.asarray((0, 20, 20, 90), jnp.int32)
    h0 = jax.random.normal(keys[1], (3, h, d, d))
    cot = (jax.random.normal(keys[2], (b, t, h, d)), jax.random.normal(keys[3], h0.shape))
    (_, out), grads = _gla_value_and_grads(impl("chunk"), cu, 32, True)(*x, h0, cot)
    with x64():
      (_, ref), ref_grads = _gla_value_and_grads("scan", cu, 32, True)(
          *_up(tuple(x), jnp.float64), _up(h0, jnp.float64), _up(cot, jnp.float64))
    tol = self.fp32_tol if dtype == jnp.float32 else BF16_TOL
    _compare(out, ref, tol, ("o", "final"))
    _compare(grads, ref_grads, tol, ("dq", "dk", "dv", "dg", "dh0"))

    w = random_routing(keys[4], b, t, n, 2, dtype)
    shared = tuple(random_qkvg(keys[5], b, t, h, d, d, dtype))[:2] + (0.5 * x.g,)
    h0 = (jax.random.normal(keys[6], (3, n, h, d, d)), jax.random.normal(keys[7], (3, h, d, d)))
    cot = (cot[0], jax.random.normal(keys[8], h0[0].shape), h0[1])
    args = (*x, (w[0],), shared, h0, (w[1],), cot)
    (_, out), grads = _sse_value_and_grads(impl("varlen"), n, cu, 32, "both", False)(*args)
    with x64():
      (_, ref), ref_grads = _sse_value_and_grads("scan", n, cu, 32, "both", False)(
          *_up(args, jnp.float64))
    _compare(out, ref, tol, ("o", "final", "final shared"))
    _compare(grads, ref_grads, tol, ("dq", "dk", "dv", "dg", "dweights", "dq'", "dk'",
                                     "dg'", "dh0", "dh0'"))

  @pytest.mark.parametrize("dk, dv", [(64, 128), (64, 64), (128, 128), (256, 256)])
  @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
  def test_head_dims(self, dk, dv, dtype):
    """The issue's head dims, dense (no cu_seqlens) with initial and final states, at
    the default chunk, against the float64 scan."""
    dtype = jnp.dtype(dtype)
    x = random_qkvg(jax.random.PRNGKey(8), 1, 100, 1, dk, dv, dtype)
    ks = jax.random.split(jax.random.PRNGKey(11), 3)
    h0 = jax.random.normal(ks[0], (1, 1, dk, dv))
    cot = (jax.random.normal(ks[1], (1, 100, 1, dv)), jax.random.normal(ks[2], h0.shape))
    (_, out), grads = _gla_value_and_grads(self.impl("pallas_chunk"), None, 64, True)(
        *x, h0, cot)
    with x64():
      (_, ref), ref_grads = _gla_value_and_grads("scan", None, 64, True)(
          *_up(tuple(x), jnp.float64), _up(h0, jnp.float64), _up(cot, jnp.float64))
    tol = self.fp32_tol if dtype == jnp.float32 else BF16_TOL
    _compare(out, ref, tol, ("o", "final"))
    _compare(grads, ref_grads, tol, ("dq", "dk", "dv", "dg", "dh0"))

  @pytest.mark.parametrize("bs", [
      dict(recompute_states=True, sweep_k=16, sweep_v=64),
      dict(block_k=32, block_v=16, sweep_k=64, sweep_v=16, num_warps=2, diag_unroll=4),
      dict(split_dqk=True, block_k=32, diag_unroll=2),
      dict(split_dqk=True, inter_in_intra=False, block_k=32),  # two kernels
      dict(intra_scores=False),               # dA from XLA's matmul, read by the kernel
      dict(intra_scores=False, diag_matmul_span=0.0),
      # The split dq/dk kernels' largest tiles.
      dict(split_dqk=True, chunk=128, dims=(128, 128)),
      dict(split_dqk=True, block_k=128, dims=(256, 256)),  # inter kernel: block_k 64
      dict(split_dqk=True, chunk=128, dims=(256, 256)),  # too large to split: fused
      dict(split_dqk=False, diag_unroll=1),  # the fused dq/dk kernel
      # The split dq/dk as two kernels, the inter terms through fp32 buffers (the
      # default computes them in the intra kernel, where its tiles fit).
      dict(inter_in_intra=False, diag_matmul_span=0.0),
      dict(inter_in_intra=False, intra_scores=False),
      dict(inter_in_intra=False, chunk=128, dims=(128, 128)),
      dict(diag_matmul_span=0.0),            # every diagonal block row by row
      dict(diag_matmul_span=60.0, split_dqk=False),  # the largest span allowed
      # The states as a local-contribution pass plus a sweep instead of one walk.
      dict(fused_states=False, sweep_k=16, sweep_v=64),
      dict(fused_states=False, recompute_states=True),
      # The fused walk on the block tiles (its choice for large grids).
      dict(walk_programs=1),
      dict(walk_programs=1, block_k=32, block_v=64, recompute_states=True),
      # The walks with their loads in the step rather than prefetched.
      dict(prefetch=False),
      dict(prefetch=False, fused_states=False, recompute_states=True),
  ])
  def test_block_sizes_and_steep_gates(self, bs):
    """Other tiles, recomputed states, and gates down to -60 per step, on the kernel
    core against its own one-token-at-a-time reference in float64 and the ops' XLA
    chunk core in float32 (chunk 32: four chunks in two segments and a gap; Dk = 64
    so that block_k = 32 splits the dq/dk kernel into two Dk blocks). Chunks 1 and 3
    have gentler gates (sub-block spans ~3 and ~32-43, around the default threshold of
    40) and take the diagonal-matmul path where the span allows,
    the others are steep (spans ~300-450) and go row by row."""
    bs = dict(bs)
    dims = bs.pop("dims", None)
    c = bs.pop("chunk", 32)
    dk, dv = dims or (64, 64)
    bs = pallas_chunk_gla.BlockSizes(chunk=c, **bs)
    (_, out), grads = _steep_gate_step(
        functools.partial(pallas_chunk_gla.chunk_gla, block_sizes=bs,
                          interpret=self.INTERPRET), _steep_gate_inputs(c, dk, dv))
    (ref32, ref32_grads), (ref, ref_grads) = _steep_gate_references(c, dk, dv)
    assert np.isfinite(np.asarray(grads[3])).all()
    # Against float64, and no less accurate than the XLA core in float32: with gates
    # this steep the in-chunk sums b reach ~-1000 at C = 32 (~-2000 at C = 128), so
    # differences of them carry ~eps * |b| of rounding whichever order sums them (the
    # fp32 XLA core is up to 2e-5 off at C = 128).
    names = ("o", "final", "dq", "dk", "dv", "dg", "dh0")
    leaves = jax.tree_util.tree_leaves
    for name, a, r32, r in zip(names, leaves((out, grads)), leaves((ref32, ref32_grads)),
                               leaves((ref, ref_grads))):
      assert_close(a, r, self.fp32_tol * 5, name)
      assert_close(a, r, 2 * rel_err(r32, r) + 1e-6, f"{name} (twice the XLA core's error)")


def _steep_gate_inputs(c: int, dk: int, dv: int):
  """test_block_sizes_and_steep_gates' q, k, v, g, h0 and output cotangent: five chunks
  of c tokens, two heads."""
  keys = jax.random.split(jax.random.PRNGKey(9), 6)
  shape = (1, 5, c, 2)
  q, k = (jax.random.normal(kk, shape + (dk,)) for kk in keys[:2])
  v = jax.random.normal(keys[2], shape + (dv,))
  g = -60.0 * jax.random.uniform(keys[3], shape + (dk,)) ** 4   # mostly mild, some steep
  g = g * jnp.asarray([1.0, 0.01, 1.0, 0.1, 1.0])[None, :, None, None, None]
  h0 = jax.random.normal(keys[4], (2, 2, dk, dv))
  cot = jax.random.normal(keys[5], shape + (dv,))
  return q, k, v, g, h0, cot


def _steep_gate_step(core, inputs):
  """(loss, (o, final)), gradients w.r.t. q, k, v, g, h0 of `core` on two segments
  (chunk 0, and chunks 2-4) of `inputs`."""
  q, k, v, g, h0, cot = inputs
  start, count = jnp.asarray([0, 2], jnp.int32), jnp.asarray([1, 3], jnp.int32)

  def loss(q, k, v, g, h0):
    o, f = core(q, k, v, g, h0, start, count)
    return jnp.sum(o * cot) + jnp.sum(f), (o, f)
  return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3, 4), has_aux=True))(q, k, v, g, h0)


@functools.lru_cache(maxsize=None)
def _steep_gate_references(c: int, dk: int, dv: int):
  """The references of test_block_sizes_and_steep_gates at chunk c and head dims
  (dk, dv), as host arrays: ((o, final), gradients) of the XLA chunk core in float32
  and of the kernel file's one-token-at-a-time reference in float64. They do not
  depend on the block sizes, so a process computes them once per shape (most of the
  variants share the default one)."""
  inputs = _steep_gate_inputs(c, dk, dv)
  with jax.default_matmul_precision("highest"):  # XLA's GPU default would be TF32
    (_, ref32), ref32_grads = _steep_gate_step(chunked.chunk_gla, inputs)
  with x64():
    (_, ref), ref_grads = _steep_gate_step(pallas_chunk_gla.reference,
                                           _up(inputs, jnp.float64))
    return jax.device_get(((ref32, ref32_grads), (ref, ref_grads)))


class TestPallasInterpret(TestPallasGPU):
  INTERPRET = True
  fp32_tol = 1e-5


def test_kernel_reference_is_the_xla_chunk_core():
  """The kernel file's own reference (one token at a time) and the ops' XLA chunk core
  agree in float64, on segments with an empty one, a gap and a batch row of two."""
  with x64():
    keys = jax.random.split(jax.random.PRNGKey(4), 5)
    shape = (2, 3, 16, 2)
    q, k = (jax.random.normal(kk, shape + (16,), jnp.float64) for kk in keys[:2])
    v = jax.random.normal(keys[2], shape + (32,), jnp.float64)
    g = -jnp.abs(jax.random.normal(keys[3], shape + (16,), jnp.float64))
    h0 = jax.random.normal(keys[4], (4, 2, 16, 32), jnp.float64)
    start, count = jnp.asarray([0, 2, 3, 5]), jnp.asarray([2, 0, 2, 0])
    ref = pallas_chunk_gla.reference(q, k, v, g, h0, start, count)
    xla = chunked.chunk_gla(q, k, v, g, h0, start, count)
    for name, a, b in zip(("o", "final"), ref, xla):
      assert_close(a, b, 1e-12, name)


def test_kernels_import_nothing_from_sse_jax():
  """The dependency runs one way, from the ops to the kernels."""
  import ast  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  for path in pathlib.Path(pallas_chunk_gla.__file__).parent.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      assert not any(n.split(".")[0] == "sse_jax" for n in names), (path.name, names)


def test_block_sizes_validate():
  with pytest.raises(ValueError, match="chunk=48"):
    pallas_chunk_gla.BlockSizes(chunk=48)
  with pytest.raises(ValueError, match="block_k=24"):
    pallas_chunk_gla.BlockSizes(block_k=24)
  with pytest.raises(ValueError, match="sweep_v=48"):
    pallas_chunk_gla.BlockSizes(sweep_v=48)
  with pytest.raises(ValueError, match="Dk=40"):
    pallas_chunk_gla.BlockSizes().tiles(40, 64)


def test_kernels_lower_for_cuda():
  """Lower the compiled (non-interpret) kernels, forward and backward, for CUDA.

  Runs on CPU too: this catches what the Triton lowering rejects but interpret mode
  accepts (non power-of-2 tiles, value slicing, batched dots, ...).
  """
  x = random_qkvg(jax.random.PRNGKey(0), 1, 128, 2, 64, 64, jnp.bfloat16)
  w, idx = random_routing(jax.random.PRNGKey(1), 1, 128, 4, 1)
  cu = jnp.asarray((0, 64, 128), jnp.int32)

  def loss(q, k, v, g, w):
    o1, _ = ops.gla(q, k, v, g, cu_seqlens=cu, impl=pallas("chunk", interpret=False))
    o2, _ = ops.sse(q, k, v, g, w, idx, num_partitions=4, cu_seqlens=cu,
                    impl=pallas("varlen", interpret=False), shared=(q, k, g))
    return jnp.sum(o1.astype(jnp.float32)) + jnp.sum(o2.astype(jnp.float32))

  # Per op: forward scores (and gate sums), states, outputs; backward reverse states
  # (state gradients), dv, dq/dk (one kernel: BlockSizes.inter_in_intra; the forward's
  # states are kept).
  counts = cuda_triton_kernels(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)), *x, w)
  moves = counts.pop("move_rows", 0)
  assert sum(counts.values()) == 12, f"expected 12 Triton kernel calls, found {counts}"
  # The packing's row moves. GLA: q, k, v, g into the buffer and o out, then the
  # cotangents the other way (10), and q, k, v into the buffer again in the backward
  # pass, which recomputes the packed copies instead of keeping them (3). SSE packs its
  # routed and shared slots as two parts: one move in per operand (reading both), one
  # out per part, so o out and dq, dk, dv, dg out take two each (13 + 5).
  assert moves == 31, f"expected 31 row moves, found {moves}"
  # Stacked training (sse_jax.train.stacked) vmaps the kernels over a run axis: each
  # pallas_call gains a grid dimension, and still lowers, as the same 12 calls.
  stack = lambda a: jnp.stack([a, a])
  calls = cuda_triton_calls(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))),
                             *map(stack, x), stack(w))
  assert calls == 12, f"vmapped: expected 12 Triton kernel calls, found {calls}"
  # BlockSizes.gather_rows: the kernels read the slots in place; the same 12 kernels,
  # no row moves.
  gathering = lambda name: ops.Plan(ops.Algorithm(name), ops.PallasCore(
      pallas_chunk_gla.BlockSizes(gather_rows=True), interpret=False))

  def loss_in_place(q, k, v, g, w):
    o1, _ = ops.gla(q, k, v, g, cu_seqlens=cu, impl=gathering("chunk"))
    o2, _ = ops.sse(q, k, v, g, w, idx, num_partitions=4, cu_seqlens=cu,
                    impl=gathering("varlen"), shared=(q, k, g))
    return jnp.sum(o1.astype(jnp.float32)) + jnp.sum(o2.astype(jnp.float32))

  counts = cuda_triton_kernels(jax.value_and_grad(loss_in_place, argnums=(0, 1, 2, 3, 4)),
                               *x, w)
  assert "move_rows" not in counts and sum(counts.values()) == 12, counts
  # ... and vmapped (each run its own routing, so its own row table).
  counts = cuda_triton_kernels(
      jax.vmap(jax.value_and_grad(loss_in_place, argnums=(0, 1, 2, 3, 4))),
      *map(stack, x), stack(w))
  assert "move_rows" not in counts and sum(counts.values()) == 12, f"vmapped: {counts}"

  # Other BlockSizes change the kernels' code: unrolled diagonal loops, recomputed states
  # (one more state walk in the backward), other tiles, dq/dk in two kernels (the inter
  # terms through buffers), and the states as a local-contribution pass plus a sweep
  # (two kernels each way).
  c, h, d = 32, 1, 64
  q = jnp.ones((1, 2, c, h, d), jnp.bfloat16)
  h0, start, count = jnp.zeros((1, h, d, d)), jnp.asarray([0]), jnp.asarray([2])
  for fields, want in ((dict(split_dqk=False, diag_unroll=1), 6),
                       (dict(split_dqk=False, diag_unroll=4), 6),
                       (dict(recompute_states=True), 7),
                       (dict(block_k=32, block_v=16, sweep_k=16, num_warps=8), 6),
                       (dict(split_dqk=True), 6),
                       (dict(intra_scores=False), 6),
                       (dict(inter_in_intra=False), 7),
                       (dict(inter_in_intra=False, intra_scores=False), 7),
                       (dict(fused_states=False), 8),
                       (dict(walk_programs=1), 6),
                       (dict(fused_states=False, recompute_states=True), 10)):
    bs = pallas_chunk_gla.BlockSizes(chunk=c, **fields)
    core = lambda q, k, v, g, bs=bs: jnp.sum(pallas_chunk_gla.chunk_gla(
        q, k, v, g, h0, start, count, block_sizes=bs, interpret=False)[0].astype(jnp.float32))
    # value_and_grad: under jax.grad alone the output kernel is pruned (o is unused).
    calls = cuda_triton_calls(jax.value_and_grad(core, (0, 1, 2, 3)), q, q, q,
                              -q.astype(jnp.float32))
    assert calls == want, f"{fields}: expected {want} Triton kernel calls, found {calls}"
  # Tiles too large for whole-chunk matmuls (C = 128, Dk = Dv = 256, fp32): the scores
  # kernel reads b's rows back from its output after a barrier, and the dq/dk kernels
  # are fused (the split one's tiles do not fit).
  big = jnp.ones((1, 1, 128, h, 256), jnp.float32)
  bs = pallas_chunk_gla.BlockSizes(chunk=128)
  core = lambda q, k, v, g: jnp.sum(pallas_chunk_gla.chunk_gla(
      q, k, v, g, jnp.zeros((1, h, 256, 256)), start, jnp.asarray([1]), block_sizes=bs,
      interpret=False)[0])
  calls = cuda_triton_calls(jax.value_and_grad(core, (0, 1, 2, 3)), big, big, big, -big)
  assert calls == 6, f"C = 128, D = 256: expected 6 Triton kernel calls, found {calls}"


def test_block_sizes_and_interpret_mode_key_the_ops_jit():
  """The ops jit their bodies with the typed impl as a static argument: another
  interpret flag or other block sizes trace them again instead of reusing the first
  trace. The same op lowered for CUDA has no Triton calls in interpret mode, then its
  kernels, then other kernels under other block sizes; a string impl resolves to the
  plan with those fields filled in."""
  x = random_qkvg(jax.random.PRNGKey(0), 1, 64, 1, 32, 32, jnp.float32)
  for op, algorithm in (
      (lambda q, k, v, g, impl: ops.gla(q, k, v, g, impl=impl, chunk_size=32)[0], "chunk"),
      (lambda q, k, v, g, impl: ops.sse(q, k, v, g, jnp.ones((1, 64, 1)),
                                        jnp.zeros((1, 64, 1), jnp.int32), num_partitions=2,
                                        impl=impl, chunk_size=32)[0], "varlen")):
    # A fresh outer jit each time: only the ops' own jit could reuse a trace.
    calls = lambda impl: cuda_triton_calls(lambda *a: op(*a, impl), *x)
    assert calls(pallas(algorithm, interpret=True)) == 0
    assert calls(pallas(algorithm, interpret=False)) == 3  # forward: scores, states, outputs
    # local + sweep instead of one walk
    assert calls(pallas(algorithm, interpret=False, chunk=32, fused_states=False)) == 4
  resolved, c = impl_lib.plan("pallas_varlen", "sse", chunk_size=32, head_dims=(32, 32))
  assert c == 32 and resolved == pallas(
      "varlen", interpret=pallas_chunk_gla.default_interpret(), chunk=32)


def test_profile_kernels_runs_every_kernel():
  """`experiments.profile_kernels` reaches each kernel through the private wrappers it
  times; in interpret mode, at a tiny size, its numbers are not timings, only a check
  that the tool still matches the kernel file."""
  from experiments import op_setting, profile_kernels  # pylint: disable=g-import-not-at-top
  x = profile_kernels.make_inputs(128, 1, 16, 32)
  bs = pallas_chunk_gla.BlockSizes(chunk=32, split_dqk=False)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    times = profile_kernels.per_kernel(x, bs, True, reps=1)
  assert set(times) == {"scores", "states", "local", "sweep", "outputs", "dv", "dqk",
                        "dqk_split"}
  assert all(t > 0 for t in times.values())
  # Its check of a variant against the defaults: the split dq/dk agrees to bf16
  # rounding, and a wrong array is reported as such.
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    fused = profile_kernels.core_outputs(x, bs, True)
    split = profile_kernels.core_outputs(
        x, pallas_chunk_gla.BlockSizes(chunk=32, split_dqk=True), True)
  diff = profile_kernels.max_rel_diff(split, fused)
  assert set(diff) == {"o", "dq", "dk", "dv", "dg"}
  # The split's intra kernel multiplies whole chunks with ~16-bit operands, the fused
  # kernel's off-diagonal blocks with bf16 ones: the bf16 outputs differ by about an ulp
  # (2^-8 of the largest values).
  assert max(diff.values()) < 1e-2, diff
  wrong = dict(split, dk=-split["dk"])
  assert profile_kernels.max_rel_diff(wrong, fused)["dk"] > 1.0
  assert op_setting.parse_variant(
      "num_warps=8, recompute_states=true, diag_matmul_span=12.5") == dict(
          num_warps=8, recompute_states=True, diag_matmul_span=12.5)
  with pytest.raises(ValueError, match="field=value"):
    op_setting.parse_variant("num_warps")


def test_storage_dtype_keeps_only_bf16_at_16_bits():
  """float16 runs the Pallas path in fp32 (its range overflows in the states: here
  they reach 1.7e5 > 65504), and mixed bf16 / fp32 inputs are not rounded to bf16."""
  core, f32 = ops.PallasCore(), jnp.float32
  assert impl_lib.storage_dtype(core, [jnp.bfloat16] * 3, f32) == jnp.bfloat16
  assert impl_lib.storage_dtype(core, [jnp.float16] * 3, f32) == jnp.float32
  assert impl_lib.storage_dtype(core, [jnp.bfloat16, jnp.float32], f32) == jnp.float32
  assert impl_lib.storage_dtype(ops.XlaCore(), [jnp.bfloat16], f32) == jnp.float32
  t = 192
  kv = jnp.full((1, t, 1, 16), 30.0, jnp.float16)
  q = jnp.full((1, t, 1, 16), 0.01, jnp.float16)  # o stays in float16 range
  g = jnp.zeros((1, t, 1, 16), jnp.float16)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    o, f = ops.gla(q, kv, kv, g, impl="pallas_chunk", output_final_state=True)
  o_ref, f_ref = ops.gla(q, kv, kv, g, impl="scan", output_final_state=True)
  assert float(jnp.max(f_ref)) > 65504
  assert np.isfinite(np.asarray(o, np.float32)).all()
  assert_close(f, f_ref, 1e-5, "final")
  assert_close(o.astype(jnp.float32), o_ref.astype(jnp.float32), 2e-3, "o")


def test_auto_picks_pallas_on_gpu_for_supported_head_dims(monkeypatch):
  auto = impl_lib.Impl.AUTO
  on_this = impl_lib.pallas_gpu()
  assert (impl_lib.resolve_auto(auto, "gla", (16, 16)) is impl_lib.Impl.PALLAS_CHUNK) == on_this
  monkeypatch.setattr(impl_lib, "pallas_gpu", lambda device=None: True)
  assert impl_lib.resolve_auto(auto, "gla", (128, 64)) is impl_lib.Impl.PALLAS_CHUNK
  assert impl_lib.resolve_auto(auto, "sse", (128, 128)) is impl_lib.Impl.PALLAS_VARLEN
  # Head dims the kernels do not support: the XLA paths, not an error.
  assert impl_lib.resolve_auto(auto, "gla", (48, 64)) is impl_lib.Impl.CHUNK
  assert impl_lib.resolve_auto(auto, "sse", (64, 8)) is impl_lib.Impl.VARLEN
  # A chunk size they do not take (the XLA core does): the XLA paths too.
  assert impl_lib.resolve_auto(auto, "gla", (64, 64), chunk_size=48) is impl_lib.Impl.CHUNK
  monkeypatch.setattr(impl_lib, "pallas_gpu", lambda device=None: False)  # CPU, T4, AMD
  assert impl_lib.resolve_auto(auto, "gla", (128, 128)) is impl_lib.Impl.CHUNK
  assert impl_lib.resolve_auto(auto, "sse", (128, 128)) is impl_lib.Impl.VARLEN
  assert impl_lib.resolve_auto(impl_lib.Impl.SCAN, "gla") is impl_lib.Impl.SCAN
