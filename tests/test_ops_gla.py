"""gla: every implementation against the lax.scan reference, forward and gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sse_jax import ops
from tests.op_testing import assert_close, random_qkvg, x64

F64_TOL = 1e-6   # float64: the chunked factorisation is exact up to rounding
BF16_TOL = 5e-3  # bf16 inputs and outputs, float32 accumulation (the target)

CASES = [
    # (B, T, H, Dk, Dv, cu_seqlens, with_h0)
    (2, 150, 2, 16, 8, None, False),         # T not a multiple of C, 3 chunks
    (1, 37, 2, 16, 16, None, True),          # T < C, initial state
    (3, 64, 1, 16, 8, None, True),           # exactly one chunk
    (1, 200, 2, 16, 8, (0, 5, 5, 70, 130, 200), True),  # ragged, empty sequence,
                                                         # boundaries inside chunks
]


def _loss_fn(impl, cu, with_h0, cot_o, cot_f, scale=None):
  """A scalar of outputs and final state, so that jax.grad checks every gradient."""

  def loss(q, k, v, g, h0):
    o, f = ops.gla(q, k, v, g, initial_state=h0 if with_h0 else None,
                   output_final_state=True, cu_seqlens=cu, impl=impl, scale=scale)
    return jnp.sum(o * cot_o) + jnp.sum(f * cot_f), (o, f)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}cu{c[5] is not None}")
def test_chunk_matches_scan_float64(case):
  b, t, h, dk, dv, cu, with_h0 = case
  with x64():
    key = jax.random.PRNGKey(0)
    x = random_qkvg(key, b, t, h, dk, dv, jnp.float64)
    cu_arr = None if cu is None else jnp.asarray(cu, jnp.int32)
    s = b if cu is None else len(cu) - 1
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    h0 = jax.random.normal(ks[0], (s, h, dk, dv), jnp.float64)
    cot_o = jax.random.normal(ks[1], (b, t, h, dv), jnp.float64)
    cot_f = jax.random.normal(ks[2], (s, h, dk, dv), jnp.float64)
    (_, (o_ref, f_ref)), g_ref = _loss_fn("scan", cu_arr, with_h0, cot_o, cot_f)(*x, h0)
    (_, (o, f)), grads = _loss_fn("chunk", cu_arr, with_h0, cot_o, cot_f)(*x, h0)
    assert o.dtype == jnp.float64 and f.dtype == jnp.float64
    assert_close(o, o_ref, F64_TOL, "o")
    assert_close(f, f_ref, F64_TOL, "final_state")
    names = ("dq", "dk", "dv", "dg", "dh0")
    for name, a, r in zip(names, grads, g_ref):
      if name == "dh0" and not with_h0:
        continue
      assert_close(a, r, F64_TOL, name)


def test_chunk_bf16_close_to_float32_scan():
  """bf16 inputs: outputs, final state and every gradient against the fp32 scan."""
  x = random_qkvg(jax.random.PRNGKey(3), 2, 130, 2, 32, 32, jnp.bfloat16)
  cot_o = jax.random.normal(jax.random.PRNGKey(13), (2, 130, 2, 32))
  cot_f, h0 = jnp.ones((2, 2, 32, 32)), jnp.zeros((2, 2, 32, 32))
  (_, (o, f)), grads = _loss_fn("chunk", None, False, cot_o, cot_f)(*x, h0)
  assert o.dtype == jnp.bfloat16 and f.dtype == jnp.float32
  (_, (o_ref, f_ref)), ref_grads = _loss_fn("scan", None, False, cot_o, cot_f)(
      *(a.astype(jnp.float32) for a in x), h0)
  assert_close(o, o_ref, BF16_TOL, "o")
  assert_close(f, f_ref, 1e-5, "final_state")
  for name, a, r in zip(("dq", "dk", "dv", "dg"), grads, ref_grads):
    assert a.dtype == jnp.bfloat16, name
    assert_close(a, r, BF16_TOL, name)


def test_explicit_scale_matches_scan_float64():
  with x64():
    x = random_qkvg(jax.random.PRNGKey(6), 1, 100, 2, 16, 8, jnp.float64)
    cot_o = jax.random.normal(jax.random.PRNGKey(7), (1, 100, 2, 8), jnp.float64)
    cot_f, h0 = jnp.ones((1, 2, 16, 8)), jnp.zeros((1, 2, 16, 8))
    run = lambda impl, scale=0.3: _loss_fn(impl, None, False, cot_o, cot_f, scale)(*x, h0)
    (val, (o, f)), grads = run("chunk")
    (ref_val, (o_ref, f_ref)), ref_grads = run("scan")
    assert not np.isclose(float(ref_val), float(run("scan", None)[0][0]))  # scale matters
    assert_close(o, o_ref, F64_TOL, "o")
    assert_close(f, f_ref, F64_TOL, "final_state")
    for name, a, r in zip(("dq", "dk", "dv", "dg"), grads, ref_grads):
      assert_close(a, r, F64_TOL, name)


def test_strong_decay_does_not_overflow():
  """g = -60 per step: exp(-cumsum) over a chunk would be exp(3840) = inf in float32."""
  x = random_qkvg(jax.random.PRNGKey(4), 1, 128, 1, 16, 16)
  g = jnp.full_like(x.g, -60.0).at[:, ::7].set(0.0)
  grad = lambda impl: jax.jit(jax.grad(
      lambda q, k, v, g: ops.gla(q, k, v, g, impl=impl)[0].sum(), (0, 1, 2, 3)))
  o_ref, _ = ops.gla(x.q, x.k, x.v, g, impl="scan")
  o, _ = jax.jit(ops.gla)(x.q, x.k, x.v, g)
  assert_close(o, o_ref, 1e-5, "o")
  for name, d, d_ref in zip(("dq", "dk", "dv", "dg"), grad("chunk")(x.q, x.k, x.v, g),
                            grad("scan")(x.q, x.k, x.v, g)):
    assert np.all(np.isfinite(np.asarray(d))), name
    assert_close(d, d_ref, 1e-5, name)


def test_decode_steps_continue_prefill():
  with x64():
    b, t, t0, h, dk, dv = 2, 90, 70, 2, 16, 8
    x = random_qkvg(jax.random.PRNGKey(5), b, t, h, dk, dv, jnp.float64)
    run = jax.jit(functools.partial(ops.gla, output_final_state=True))
    o_full, _ = run(*x)
    _, state = run(*(a[:, :t0] for a in x))
    step = jax.jit(ops.gla_decode_step)
    outs = []
    for i in range(t0, t):
      o_i, state = step(*(a[:, i] for a in x), state)
      outs.append(o_i)
    assert_close(jnp.stack(outs, 1), o_full[:, t0:], F64_TOL, "decode")
    # An explicit scale reaches the decode step too.
    run_scaled = jax.jit(functools.partial(ops.gla, output_final_state=True, scale=0.3))
    o_scaled, _ = run_scaled(*x)
    _, state = run_scaled(*(a[:, :t0] for a in x))
    o_i, _ = jax.jit(functools.partial(ops.gla_decode_step, scale=0.3))(
        *(a[:, t0] for a in x), state)
    assert_close(o_i, o_scaled[:, t0], F64_TOL, "decode with scale")


@pytest.mark.parametrize("bad, match", [
    (dict(q=jnp.zeros((2, 8, 2))), "q must have rank 4"),
    (dict(k=jnp.zeros((2, 8, 2, 4))), "q and k must have the same shape"),
    (dict(g=jnp.zeros((2, 8, 2, 4))), "g must have the shape of k"),
    (dict(v=jnp.zeros((2, 9, 2, 8))), "v must share"),
    (dict(impl="fast"), "impl='fast' is not one of"),
    (dict(impl="varlen"), "impl='varlen' is not available for gla"),
    (dict(cu_seqlens=jnp.array([0, 8], jnp.int32)), "needs batch size B == 1, got B=2"),
    (dict(initial_state=jnp.zeros((2, 2, 8, 8))), r"initial_state must have shape \(2, 2, 8, 4\), got \(2, 2, 8, 8\)"),
    (dict(chunk_size=24), "chunk_size=24"),
    (dict(q=jnp.zeros((2, 8, 2, 8), jnp.int32)), "q must be a floating-point array"),
    (dict(chunk_size=48, impl="pallas_chunk"),
     r"chunk_size=48: the Pallas kernels take chunk sizes \(16, 32, 64, 128\) "
     r"\(impl='pallas_chunk'\)"),
    (dict(impl="pallas_chunk"), r"Dk=8: the Pallas kernels support head dims \(16, 32"),
    (dict(impl=ops.Plan(ops.Algorithm.VARLEN, ops.XlaCore())),
     "impl algorithm 'varlen' is not available for gla; choose one of scan, chunk"),
    (dict(impl=ops.Plan(ops.Algorithm.CHUNK)), "impl core None does not fit algorithm"),
    (dict(chunk_size=True), "chunk_size=True must be a positive multiple of 16"),
    (dict(scale=jnp.ones((2,))), r"scale must be a scalar, got shape \(2,\)"),
    (dict(initial_state=(jnp.zeros((2, 2, 8, 4)),) * 2),
     "initial_state must be an array, got a tuple"),
])
def test_bad_inputs_raise(bad, match):
  args = dict(q=jnp.zeros((2, 8, 2, 8)), k=jnp.zeros((2, 8, 2, 8)),
              v=jnp.zeros((2, 8, 2, 4)), g=jnp.zeros((2, 8, 2, 8)))
  kwargs = {}
  for name, value in bad.items():
    (args if name in args else kwargs)[name] = value
  with pytest.raises(ValueError, match=match):
    ops.gla(**args, **kwargs)


def test_bad_cu_seqlens_values_raise():
  x = random_qkvg(jax.random.PRNGKey(0), 1, 10, 1, 16, 16)
  with pytest.raises(ValueError, match="end at T=10"):
    ops.gla(*x, cu_seqlens=jnp.array([0, 4, 9], jnp.int32))
  with pytest.raises(ValueError, match="non-decreasing"):
    ops.gla(*x, cu_seqlens=jnp.array([0, 6, 4, 10], jnp.int32))


def test_inputs_need_not_be_jax_arrays_and_chunk_size_may_be_numpy():
  x = random_qkvg(jax.random.PRNGKey(1), 1, 40, 1, 16, 16)
  want, _ = ops.gla(*x, cu_seqlens=jnp.asarray([0, 15, 40], jnp.int32), chunk_size=16)
  got, _ = ops.gla(*(np.asarray(a) for a in x), cu_seqlens=[0, 15, 40],
                   chunk_size=np.int64(16))
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl", ["scan", "chunk", "pallas_chunk"])
@pytest.mark.parametrize("cu", [None, (0, 0, 0)], ids=["dense", "packed"])
def test_no_tokens_keeps_the_initial_state(impl, cu):
  h0 = jax.random.normal(jax.random.PRNGKey(0), (2 if cu is None else 2, 2, 16, 16))
  b = 2 if cu is None else 1
  x = jnp.zeros((b, 0, 2, 16))
  cu = None if cu is None else jnp.asarray(cu, jnp.int32)
  o, f = ops.gla(x, x, x, x, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                 impl=impl)
  assert o.shape == (b, 0, 2, 16)
  np.testing.assert_array_equal(f, h0)


@pytest.mark.parametrize("impl, dtype, tol", [("chunk", jnp.float64, F64_TOL),
                                             ("pallas_chunk", jnp.float32, 1e-4)])
def test_infinite_and_huge_decays_reset_the_state_without_nan(impl, dtype, tol):
  """g = -inf (a hard reset) and g = -1e38 rows, also several in one chunk and at a
  chunk's first row: the chunked paths match the scan, values and gradients, instead
  of turning -inf - (-inf) into NaN (chunked.LOG_DECAY_FLOOR, applied by
  gla.dense_chunked and gla.packed_chunked). Pallas runs fp32."""
  with x64():
    x = random_qkvg(jax.random.PRNGKey(8), 1, 100, 2, 16, 16, dtype)
    g = x.g.at[:, 5].set(-jnp.inf).at[:, 9].set(-1e38).at[:, 32].set(-jnp.inf)
    g = g.at[:, 70:73].set(-3e4)
    cot = jax.random.normal(jax.random.PRNGKey(9), (1, 100, 2, 16), dtype)
    h0 = jax.random.normal(jax.random.PRNGKey(10), (1, 2, 16, 16), dtype)

    def run(impl, x):
      def loss(q, k, v, g, h0):
        o, f = ops.gla(q, k, v, g, initial_state=h0, output_final_state=True,
                       impl=impl, chunk_size=32)
        return jnp.sum(o * cot) + jnp.sum(f), (o, f)
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
          *x, h0)

    (_, (o, f)), grads = run(impl, (x.q, x.k, x.v, g))
    (_, (o_ref, f_ref)), ref_grads = run(
        "scan", tuple(a.astype(jnp.float64) for a in (x.q, x.k, x.v, g)))
    assert_close(o, o_ref, tol, "o")
    assert_close(f, f_ref, tol, "final_state")
    for name, d, d_ref in zip(("dq", "dk", "dv", "dg", "dh0"), grads, ref_grads):
      assert np.all(np.isfinite(np.asarray(d))), name
      assert_close(d, d_ref, tol, name)


@pytest.mark.parametrize("impl", ["chunk", "pallas_chunk"])
def test_traced_cu_seqlens_matches_concrete(impl):
  """cu_seqlens as a jit argument (its values unknown at trace time: the static chunk
  table path) gives the numbers of the concrete one, for two different boundaries
  through one compiled function."""
  x = random_qkvg(jax.random.PRNGKey(12), 1, 90, 2, 16, 16)
  fn = jax.jit(lambda cu, *a: ops.gla(*a, cu_seqlens=cu, impl=impl, chunk_size=32,
                                      output_final_state=True))
  for cu in ([0, 7, 7, 90], [0, 40, 64, 90]):
    cu = jnp.asarray(cu, jnp.int32)
    o, f = fn(cu, *x)
    o_ref, f_ref = ops.gla(*x, cu_seqlens=cu, impl="scan", output_final_state=True)
    assert_close(o, o_ref, 1e-5, "o")
    assert_close(f, f_ref, 1e-5, "final")


def test_explicit_scale_reaches_the_pallas_path():
  x = random_qkvg(jax.random.PRNGKey(6), 1, 100, 2, 16, 16)
  cot_o = jax.random.normal(jax.random.PRNGKey(7), (1, 100, 2, 16))
  cot_f, h0 = jnp.ones((1, 2, 16, 16)), jnp.zeros((1, 2, 16, 16))
  run = lambda impl: _loss_fn(impl, None, False, cot_o, cot_f, 0.3)(*x, h0)
  (_, (o, f)), grads = run("pallas_chunk")
  (_, (o_ref, f_ref)), ref_grads = run("scan")
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(f, f_ref, 1e-5, "final_state")
  for name, a, r in zip(("dq", "dk", "dv", "dg"), grads, ref_grads):
    assert_close(a, r, 1e-5, name)


@pytest.mark.parametrize("shape,axis", [((3, 64, 2, 5), 1), ((2, 3, 16, 4), 2), ((4, 32), 1),
                                        ((0, 64, 3), 1), ((2, 64, 0), 1)])
def test_in_chunk_cumsum_matches_cumsum_values_and_gradient(shape, axis):
  """The triangular-matmul cumsum of the chunk cores against jnp.cumsum (float64),
  forward and the transpose (a reverse sum), with g of either sign and steep values."""
  from sse_jax.ops import chunked
  with x64():
    g = 50.0 * jax.random.normal(jax.random.key(3), shape, jnp.float64)
    w = jax.random.normal(jax.random.key(4), shape, jnp.float64)
    ours = lambda x: chunked.in_chunk_cumsum(x, axis)
    ref = lambda x: jnp.cumsum(x, axis=axis)
    np.testing.assert_allclose(jax.jit(ours)(g), ref(g), rtol=1e-12, atol=1e-10)
    grad = lambda f: jax.grad(lambda x: jnp.sum(w * f(x)))(g)
    np.testing.assert_allclose(grad(ours), grad(ref), rtol=1e-12, atol=1e-10)
    # And in float32 at full precision (no TF32-style operand rounding).
    g32 = g.astype(jnp.float32)
    np.testing.assert_allclose(chunked.in_chunk_cumsum(g32, axis), ref(g32.astype(jnp.float64)),
                               rtol=1e-5, atol=1e-3)
