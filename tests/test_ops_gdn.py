"""gdn: the scan reference against a literal loop of the equations, the chunked WY form
against the scan (outputs, final states, gradients), decoding, resets, empty and bad
inputs. Tiny shapes: T <= 64, chunk 16."""

from __future__ import annotations

import functools
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from sse_jax import ops
from sse_jax.ops.gdn import gdn, gdn_decode_step
from tests.op_testing import assert_close, x64

F64_TOL = 1e-6
BF16_TOL = 5e-3  # bf16 outputs and gradients against the float32 scan on the same inputs
C = 16


class GdnInputs(NamedTuple):
  q: jax.Array
  k: jax.Array
  v: jax.Array
  g: jax.Array
  beta: jax.Array


def random_gdn(key, b, t, h, dk, dv, dtype=jnp.float32, beta_max=1.0) -> GdnInputs:
  """q, v ~ N(0, 1); unit-norm keys (as the layer gives them); g = -0.3 |N(0, 1)|;
  beta ~ U(0, beta_max) (beta_max = 2: negative eigenvalues)."""
  kq, kk, kv, kg, kb = jax.random.split(key, 5)
  k = jax.random.normal(kk, (b, t, h, dk), jnp.float32)
  k = k / jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
  return GdnInputs(jax.random.normal(kq, (b, t, h, dk), dtype), k.astype(dtype),
                   jax.random.normal(kv, (b, t, h, dv), dtype),
                   (-0.3 * jnp.abs(jax.random.normal(kg, (b, t, h)))).astype(dtype),
                   (beta_max * jax.random.uniform(kb, (b, t, h))).astype(dtype))


def numpy_gdn(x: GdnInputs, h0, scale, cu=None):
  """The equations, literally: one head, one token at a time, in float64."""
  q, k, v, g, beta = (np.asarray(a, np.float64) for a in x)
  b, t, h = g.shape
  bounds = [(i, 0, t) for i in range(b)] if cu is None else [
      (0, cu[s], cu[s + 1]) for s in range(len(cu) - 1)]
  o = np.zeros(v.shape)
  final = np.array(h0, np.float64, copy=True)
  for z, (row, start, end) in enumerate(bounds):
    for head in range(h):
      s = final[z, head]
      for i in range(start, end):
        s_dec = np.exp(g[row, i, head]) * s
        kt = k[row, i, head]
        s = s_dec + beta[row, i, head] * np.outer(kt, v[row, i, head] - kt @ s_dec)
        o[row, i, head] = scale * q[row, i, head] @ s
      final[z, head] = s
  return o, final


class Case(NamedTuple):
  b: int
  t: int
  with_h0: bool
  cu: tuple | None = None
  chunk: int = C
  scale: float | None = None
  beta_max: float = 1.0
  h: int = 2
  dk: int = 8
  dv: int = 4


CASES = {
    "T37_not_a_chunk_multiple": Case(2, 37, True),
    "T64_two_chunks_negative_eigenvalues": Case(1, 64, False, chunk=32, beta_max=2.0),
    "ragged_cu_with_empty_sequence": Case(1, 50, True, cu=(0, 5, 5, 21, 50)),
    "T10_shorter_than_chunk_explicit_scale": Case(2, 10, True, chunk=64, scale=0.3),
}


def _make(case: Case, dtype):
  keys = jax.random.split(jax.random.PRNGKey(zlib.crc32(repr(case).encode())), 4)
  s = case.b if case.cu is None else len(case.cu) - 1
  x = random_gdn(keys[0], case.b, case.t, case.h, case.dk, case.dv, dtype, case.beta_max)
  h0 = jax.random.normal(keys[1], (s, case.h, case.dk, case.dv), dtype)
  cot_o = jax.random.normal(keys[2], x.v.shape, dtype)
  cot_f = jax.random.normal(keys[3], h0.shape, dtype)
  return x, h0, (cot_o, cot_f)


def _value_and_grads(case: Case, impl: str):
  cu = None if case.cu is None else jnp.asarray(case.cu, jnp.int32)

  def loss(q, k, v, g, beta, h0, cots):
    o, f = gdn(q, k, v, g, beta, scale=case.scale,
                   initial_state=h0 if case.with_h0 else None, output_final_state=True,
                   cu_seqlens=cu, impl=impl, chunk_size=case.chunk)
    return jnp.sum(o * cots[0]) + jnp.sum(f * cots[1]), (o, f)

  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))


GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def test_scan_matches_the_equations():
  """The reference against a literal loop: ragged packed sequences, an initial state,
  beta up to 2 and a -inf reset."""
  with x64():
    x = random_gdn(jax.random.PRNGKey(0), 1, 30, 2, 4, 3, jnp.float64, beta_max=2.0)
    x = x._replace(g=x.g.at[0, 12, 1].set(-jnp.inf))
    cu = (0, 7, 7, 19, 30)
    h0 = jax.random.normal(jax.random.PRNGKey(1), (4, 2, 4, 3), jnp.float64)
    o, f = gdn(*x, initial_state=h0, output_final_state=True, impl="scan",
                   cu_seqlens=jnp.asarray(cu, jnp.int32), scale=0.7)
    o_ref, f_ref = numpy_gdn(x, h0, 0.7, cu)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(f, f_ref, rtol=1e-12, atol=1e-12)
    x2 = random_gdn(jax.random.PRNGKey(2), 2, 9, 1, 4, 5, jnp.float64)
    o, f = gdn(*x2, output_final_state=True, impl="scan")
    o_ref, f_ref = numpy_gdn(x2, np.zeros((2, 1, 4, 5)), 4 ** -0.5)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(f, f_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_chunk_matches_scan_float64(name):
  case = CASES[name]
  with x64():
    x, h0, cots = _make(case, jnp.float64)
    (_, ref_out), ref_grads = _value_and_grads(case, "scan")(*x, h0, cots)
    (_, out), grads = _value_and_grads(case, "chunk")(*x, h0, cots)
    for what, a, r in zip(("o", "final"), out, ref_out):
      assert_close(a, r, F64_TOL, what)
    for what, a, r in zip(GRAD_NAMES[:6 if case.with_h0 else 5], grads, ref_grads):
      assert_close(a, r, F64_TOL, what)


def test_bf16_close_to_float32_scan():
  """bf16 inputs run in float32: o and the gradients (bf16) within BF16_TOL of the
  float32 scan on the same values, the float32 final state within 1e-5."""
  case = Case(2, 40, True, h=2, dk=16, dv=16)
  x, h0, cots = _make(case, jnp.bfloat16)
  (_, (o, f)), grads = _value_and_grads(case, "chunk")(*x, h0, cots)
  assert o.dtype == jnp.bfloat16 and f.dtype == jnp.float32
  up = lambda t: jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), t)
  (_, (o_ref, f_ref)), ref_grads = _value_and_grads(case, "scan")(*up(tuple(x)), up(h0),
                                                                  up(cots))
  assert_close(o, o_ref, BF16_TOL, "o")
  assert_close(f, f_ref, 1e-5, "final")
  for what, a, r in zip(GRAD_NAMES, grads, ref_grads):
    assert a.dtype == jnp.bfloat16, what
    assert_close(a, r, BF16_TOL, what)


RESETS = (0, 5, 16, 17, 33)  # a chunk's first row, mid-chunk, two in a row


@pytest.mark.parametrize("impl", ("scan", "chunk"))
def test_hard_reset_forgets_and_matches_scan(impl):
  """g = -inf: the state before is forgotten exactly; values and finite gradients equal
  the scan's, dg = 0 at the resets."""
  x = random_gdn(jax.random.PRNGKey(3), 1, 40, 1, 8, 8)
  x = x._replace(g=x.g.at[:, RESETS].set(-jnp.inf))
  h0 = jax.random.normal(jax.random.PRNGKey(4), (1, 1, 8, 8))
  cot_o = jax.random.normal(jax.random.PRNGKey(5), x.v.shape)
  run = lambda impl, *a: gdn(*a[:5], initial_state=a[5], output_final_state=True,
                                 impl=impl, chunk_size=C)
  o, f = run(impl, *x, h0)
  o2, f2 = run(impl, *x, 5.0 * h0 + 1.0)
  np.testing.assert_allclose(o2, o, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(f2, f, rtol=1e-6, atol=1e-6)
  o_ref, f_ref = run("scan", *x, h0)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(f, f_ref, 1e-5, "final")

  def grads(impl):
    loss = lambda *a: jnp.sum(run(impl, *a)[0] * cot_o) + jnp.sum(run(impl, *a)[1])
    return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*x, h0)

  for what, d, d_ref in zip(GRAD_NAMES, grads(impl), grads("scan")):
    assert np.all(np.isfinite(np.asarray(d))), what
    assert_close(d, d_ref, 1e-4, what)
  assert not np.any(np.asarray(grads(impl)[3])[:, RESETS]), "dg at the resets"


@pytest.mark.parametrize("impl", ("scan", "chunk"))
@pytest.mark.parametrize("b, t", [(0, 20), (2, 0)])
def test_empty_batch_or_time(impl, b, t):
  x = random_gdn(jax.random.PRNGKey(6), b, t, 2, 8, 4)
  h0 = jax.random.normal(jax.random.PRNGKey(7), (b, 2, 8, 4))
  o, f = gdn(*x, initial_state=h0, output_final_state=True, impl=impl)
  assert o.shape == (b, t, 2, 4) and not np.any(np.asarray(o))
  np.testing.assert_array_equal(f, h0)


@pytest.mark.parametrize("scale", (None, 0.3))
def test_decode_steps_continue_prefill(scale):
  """A chunked prefill of 23 tokens, then gdn_decode_step token by token == one call."""
  with x64():
    x = random_gdn(jax.random.PRNGKey(8), 2, 40, 2, 8, 4, jnp.float64, beta_max=2.0)
    h0 = jax.random.normal(jax.random.PRNGKey(9), (2, 2, 8, 4), jnp.float64)
    run = jax.jit(functools.partial(gdn, output_final_state=True, scale=scale,
                                    chunk_size=C))
    o_full, f_full = run(*x, initial_state=h0)
    t0 = 23
    _, state = run(*(a[:, :t0] for a in x), initial_state=h0)
    step = jax.jit(functools.partial(gdn_decode_step, scale=scale))
    outs = []
    for i in range(t0, 40):
      o_i, state = step(*(a[:, i] for a in x), state)
      outs.append(o_i)
    assert_close(jnp.stack(outs, 1), o_full[:, t0:], F64_TOL, "decode")
    assert_close(state, f_full, F64_TOL, "state")


def raises_one_line(fn, match: str) -> None:
  """fn() raises a one-line ValueError matching `match`."""
  with pytest.raises(ValueError, match=match) as e:
    fn()
  assert "\n" not in str(e.value), str(e.value)


def _gdn_args(**over):
  b, t, h, d = 1, 8, 2, 4
  args = dict(q=jnp.zeros((b, t, h, d)), k=jnp.zeros((b, t, h, d)),
              v=jnp.zeros((b, t, h, d)), g=jnp.zeros((b, t, h)), beta=jnp.ones((b, t, h)))
  kwargs = {}
  for key, value in over.items():
    (args if key in args else kwargs)[key] = value
  return args, kwargs


@pytest.mark.parametrize("bad, match", [
    (dict(q=jnp.zeros((1, 8, 4))), r"q must have rank 4 \[B, T, H, D\], got shape \(1, 8, 4\)"),
    (dict(k=jnp.zeros((1, 8, 2, 5))), "q and k must have the same shape"),
    (dict(v=jnp.zeros((1, 7, 2, 4))), r"v must share \[B, T, H\] with k \(1, 8, 2\)"),
    (dict(g=jnp.zeros((1, 8, 2, 4))), r"g must have shape \[B, T, H\] = \(1, 8, 2\)"),
    (dict(beta=jnp.ones((1, 8, 3))), r"beta must have shape \[B, T, H\] = \(1, 8, 2\)"),
    (dict(v=jnp.zeros((1, 8, 2, 4), jnp.int32)), "v must be a floating-point array"),
    (dict(g=jnp.zeros((1, 8, 2)).at[0, 3, 1].set(0.5)),
     r"g must be <= 0 \(a log decay; -inf resets the state\), got g\[0, 3, 1\] = 0.5"),
    (dict(beta=jnp.ones((1, 8, 2)).at[0, 6, 0].set(2.5)),
     r"beta must be in \[0, 2\] .*got beta\[0, 6, 0\] = 2.5"),
    (dict(beta=-jnp.ones((1, 8, 2))), r"got beta\[0, 0, 0\] = -1.0 \(and 15 more\)"),
    (dict(impl="varlen"), "impl='varlen' is not available for gdn; choose one of 'scan',"
     " 'chunk', 'pallas_chunk', 'auto'"),
    (dict(impl="pallas_varlen"), "impl='pallas_varlen' is not available for gdn"),
    (dict(impl="pallas_chunk"), r"Dk=4: the Pallas GDN kernels support head dims"),
    (dict(chunk_size=0), "chunk_size=0 must be a positive int"),
    (dict(scale=jnp.ones(2)), "scale must be a scalar"),
    (dict(initial_state=jnp.zeros((1, 2, 4, 5))),
     r"initial_state must have shape \(1, 2, 4, 4\)"),
    (dict(cu_seqlens=jnp.array([0, 3, 9], jnp.int32)), "cu_seqlens must start at 0"),
])
def test_bad_inputs_raise_one_line(bad, match):
  args, kwargs = _gdn_args(**bad)
  raises_one_line(lambda: gdn(**args, **kwargs), match)


def test_bad_decode_step_inputs_raise():
  q, v, g, beta = jnp.zeros((2, 3, 4)), jnp.zeros((2, 3, 5)), jnp.zeros((2, 3)), jnp.ones((2, 3))
  state = jnp.zeros((2, 3, 4, 5))
  gdn_decode_step(q, q, v, g, beta, state)
  with pytest.raises(ValueError, match=r"g must have shape \[B, H\] = \(2, 3\)"):
    gdn_decode_step(q, q, v, g[..., None], beta, state)
  with pytest.raises(ValueError, match=r"q must have rank 3 \[B, H, D\] \(one token\)"):
    gdn_decode_step(q[None], q, v, g, beta, state)
  with pytest.raises(ValueError, match=r"beta must be in \[0, 2\].*beta\[1, 2\] = 3.0"):
    gdn_decode_step(q, q, v, g, beta.at[1, 2].set(3.0), state)
  with pytest.raises(ValueError, match=r"state must have shape \(2, 3, 4, 5\)"):
    gdn_decode_step(q, q, v, g, beta, state[:1])


def test_checked_catches_bad_gates_under_jit():
  x = random_gdn(jax.random.PRNGKey(10), 1, 20, 1, 8, 4)
  run = ops.checked(lambda *a: gdn(*a, chunk_size=C)[0])
  run(*x)
  with pytest.raises(checkify.JaxRuntimeError, match=r"beta must be in \[0, 2\]"):
    run(*x[:4], x.beta.at[0, 4, 0].set(2.5))
  with pytest.raises(checkify.JaxRuntimeError, match="g must be <= 0"):
    run(*x[:3], x.g.at[0, 4, 0].set(1.0), x.beta)


def test_unit_lower_solve_matches_lapack_in_float64_with_gradients():
  """The chunk form's WY / UT solve (forward substitution with its own VJP) against
  jax.scipy.linalg.solve_triangular, values and gradients w.r.t. both operands."""
  import sys  # pylint: disable=g-import-not-at-top
  solve = sys.modules["sse_jax.ops.gdn"].unit_lower_solve  # ops.gdn is the function
  with x64():
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.normal(size=(2, 3, 16, 16)) * 0.4)
    b = jnp.asarray(rng.normal(size=(2, 3, 16, 5)))
    w = jnp.asarray(rng.normal(size=b.shape))
    lapack = lambda a, b: jax.scipy.linalg.solve_triangular(
        jnp.tril(a, -1), b, lower=True, unit_diagonal=True)
    ours = lambda a, b: solve(jnp.tril(a, -1), b)
    np.testing.assert_allclose(ours(a, b), lapack(a, b), rtol=0, atol=1e-12)
    loss = lambda f: jax.grad(lambda a, b: jnp.sum(f(a, b) * w), (0, 1))(a, b)
    for got, want in zip(loss(ours), loss(lapack)):
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
