"""Faults and bad inputs at the ops: each either computes what the scan reference
computes or fails loudly.

  g = -inf (a hard reset)       every impl matches the scan: outputs, final states, and
                                finite gradients (no -inf - (-inf) or -inf * 0 NaNs).
  B = 0, T = 0                  zeros, and the initial state as the final state.
  g > 0, negative weights       a one-line ValueError on concrete inputs.
  bad values under jit          caught by `ops.checked` (checkify), not by plain jit.

Tiny shapes (T <= 40, one head, Dk = Dv = 16, chunk 16): the Pallas impls run in
interpret mode on CPU, on grids of a few programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from sse_jax import ops
from tests.op_testing import assert_close, random_qkvg, random_routing

GLA_IMPLS = ("chunk", "pallas_chunk")
SSE_IMPLS = ("loop", "masking", "varlen", "pallas_masking", "pallas_varlen")
T, N, K, D, C = 40, 4, 2, 16, 16
RESETS = (0, 5, 16, 17, 33)  # a chunk's first row, mid-chunk, two in a row
TOL = 1e-5


def _inputs(b=1, t=T, seed=0):
  x = random_qkvg(jax.random.PRNGKey(seed), b, t, 1, D, D)
  w, idx = random_routing(jax.random.PRNGKey(seed + 1), b, t, N, K)
  h0 = jax.random.normal(jax.random.PRNGKey(seed + 2), (b, N, 1, D, D))
  return x, w, idx, h0


def _reset_g(g):
  """-inf on every key dim at RESETS, and on one dim only at t = 9."""
  g = g.at[:, RESETS].set(-jnp.inf)
  return g.at[:, 9, :, 3].set(-jnp.inf)


def _gla(impl, q, k, v, g, h0):
  return ops.gla(q, k, v, g, initial_state=h0, output_final_state=True, impl=impl,
                 chunk_size=C)


def _sse(impl, q, k, v, g, w, idx, h0):
  return ops.sse(q, k, v, g, w, idx, num_partitions=N, initial_state=h0,
                 output_final_state=True, impl=impl, chunk_size=C)


# --- g = -inf --------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ("scan",) + GLA_IMPLS)
def test_gla_hard_reset_forgets_and_matches_scan(impl):
  """After a row of -inf the state is k_t^T v_t alone: o and the final state do not
  depend on h0 (nor, by the recurrence, on anything before), and equal the scan's."""
  x, _, _, h0 = _inputs()
  g = _reset_g(x.g)
  o, f = _gla(impl, x.q, x.k, x.v, g, h0[:, 0])
  o2, f2 = _gla(impl, x.q, x.k, x.v, g, 5.0 * h0[:, 0] + 1.0)
  o_ref, f_ref = _gla("scan", x.q, x.k, x.v, g, h0[:, 0])
  assert_close(o, o_ref, TOL, "o")
  assert_close(f, f_ref, TOL, "final_state")
  np.testing.assert_allclose(o2[:, RESETS[0]:], o[:, RESETS[0]:], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(f2, f, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", SSE_IMPLS)
def test_sse_hard_reset_matches_scan(impl):
  """The issue's row: masking and loop gave all-NaN outputs (the partition mask was
  multiplied into g: -inf * 0). Eager and under jit."""
  x, w, idx, h0 = _inputs()
  args = (x.q, x.k, x.v, _reset_g(x.g), w, idx, h0)
  o_ref, f_ref = _sse("scan", *args)
  for o, f in (_sse(impl, *args), jax.jit(lambda *a: _sse(impl, *a))(*args)):
    assert_close(o, o_ref, TOL, "o")
    assert_close(f, f_ref, TOL, "final_state")


def test_sse_hard_reset_forgets_the_selected_partitions():
  """With every partition selected (K = N) a row of -inf forgets every state."""
  x, _, _, h0 = _inputs()
  idx = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (1, T, N))
  w = jnp.full((1, T, N), 0.5)
  g = _reset_g(x.g)
  for impl in ("scan", "varlen", "masking"):
    o, f = _sse(impl, x.q, x.k, x.v, g, w, idx, h0)
    o2, f2 = _sse(impl, x.q, x.k, x.v, g, w, idx, 3.0 * h0 - 1.0)
    np.testing.assert_allclose(o2[:, RESETS[0]:], o[:, RESETS[0]:], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(f2, f, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op, impl", [("gla", "chunk"), ("sse", "loop"),
                                      ("sse", "masking"), ("sse", "varlen")])
def test_hard_reset_gradients_are_finite_and_match_scan(op, impl):
  """Gradients of <o, cot> + <final, cot'> w.r.t. every float input; dg is 0 at the
  -inf rows (the scan's exp'(-inf) = 0, the chunk cores' floor has slope 0 there)."""
  x, w, idx, h0 = _inputs()
  g = _reset_g(x.g)
  if op == "gla":
    args, names = (x.q, x.k, x.v, g, h0[:, 0]), ("dq", "dk", "dv", "dg", "dh0")
    fn = lambda impl, q, k, v, g, h: _gla(impl, q, k, v, g, h)
  else:
    args, names = (x.q, x.k, x.v, g, w, h0), ("dq", "dk", "dv", "dg", "dweights", "dh0")
    fn = lambda impl, q, k, v, g, w, h: _sse(impl, q, k, v, g, w, idx, h)
  cot_o = jax.random.normal(jax.random.PRNGKey(7), x.v.shape)
  cot_f = jax.random.normal(jax.random.PRNGKey(8), args[-1].shape)

  def grads(impl):
    def loss(*a):
      o, f = fn(impl, *a)
      return jnp.sum(o * cot_o) + jnp.sum(f * cot_f)
    return jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)

  out = grads(impl)
  for name, d, d_ref in zip(names, out, grads("scan")):
    assert np.all(np.isfinite(np.asarray(d_ref))), f"scan {name}"
    assert np.all(np.isfinite(np.asarray(d))), name
    assert_close(d, d_ref, 1e-4, name)
  assert not np.any(np.asarray(out[3])[:, RESETS]), "dg at the resets"


# --- empty inputs ----------------------------------------------------------------------

@pytest.mark.parametrize("b, t", [(0, T), (2, 0)])
@pytest.mark.parametrize("impl", ("scan",) + GLA_IMPLS)
def test_gla_empty_batch_or_time(impl, b, t):
  x = random_qkvg(jax.random.PRNGKey(3), b, t, 1, D, D)
  h0 = jax.random.normal(jax.random.PRNGKey(4), (b, 1, D, D))
  o, f = _gla(impl, *x, h0)
  assert o.shape == (b, t, 1, D) and not np.any(np.asarray(o))
  np.testing.assert_array_equal(f, h0)


@pytest.mark.parametrize("b, t", [(0, T), (2, 0)])
@pytest.mark.parametrize("impl", ("scan",) + SSE_IMPLS)
def test_sse_empty_batch_or_time(impl, b, t):
  """The issue's row: varlen and masking crashed at B = 0 (ZeroDivisionError in a
  reshape inferring a -1 axis), pallas_chunk in a slice. With the shared partition."""
  x, w, idx, h0 = _inputs(b, t)
  h0s = jax.random.normal(jax.random.PRNGKey(5), (b, 1, D, D))
  o, (f, f0) = ops.sse(*x, w, idx, num_partitions=N, initial_state=(h0, h0s),
                       output_final_state=True, impl=impl, chunk_size=C,
                       shared=(x.q, x.k, x.g))
  assert o.shape == (b, t, 1, D) and not np.any(np.asarray(o))
  np.testing.assert_array_equal(f, h0)
  np.testing.assert_array_equal(f0, h0s)


# --- contract violations on concrete inputs --------------------------------------------

def _one_line_error(fn, *patterns):
  with pytest.raises(ValueError) as e:
    fn()
  msg = str(e.value)
  assert "\n" not in msg, msg
  for p in patterns:
    assert p in msg, msg


@pytest.mark.parametrize("impl", ("scan",) + GLA_IMPLS)
def test_gla_positive_or_nan_g_raises(impl):
  x, _, _, h0 = _inputs()
  g = x.g.at[0, 7, 0, 2].set(6.0)
  _one_line_error(lambda: _gla(impl, x.q, x.k, x.v, g, h0[:, 0]),
                  "g must be <= 0", "g[0, 7, 0, 2] = 6.0")
  g = x.g.at[0, 3, 0, 1].set(jnp.nan).at[0, 4].set(0.5)
  _one_line_error(lambda: _gla(impl, x.q, x.k, x.v, g, h0[:, 0]),
                  "g[0, 3, 0, 1] = nan (and 16 more)")


@pytest.mark.parametrize("impl", ("scan",) + SSE_IMPLS)
def test_sse_positive_g_and_negative_weights_raise(impl):
  x, w, idx, h0 = _inputs()
  args = [x.q, x.k, x.v, x.g, w, idx, h0]
  bad_g = list(args)
  bad_g[3] = x.g.at[0, 11, 0, 5].set(6.0)
  _one_line_error(lambda: _sse(impl, *bad_g), "g must be <= 0", "g[0, 11, 0, 5] = 6.0")
  bad_w = list(args)
  bad_w[4] = w.at[0, 2, 1].set(-0.25)
  _one_line_error(lambda: _sse(impl, *bad_w), "weights must be >= 0",
                  "weights[0, 2, 1] = -0.25")


def test_other_gates_and_decode_steps_raise():
  """The read set, the shared partition's g' and the decode steps take the same
  contract; g = -inf and g = 0 pass."""
  x, w, idx, h0 = _inputs()
  call = lambda **kw: ops.sse(*x, w, idx, num_partitions=N, **kw)
  _one_line_error(lambda: call(read_weights=-w, read_indices=idx),
                  "read_weights must be >= 0", "read_weights[0, 0, 0] =")
  _one_line_error(lambda: call(shared=(x.q, x.k, -x.g)), "shared g' must be <= 0")
  call(shared=(x.q, x.k, _reset_g(jnp.zeros_like(x.g))))
  step = (x.q[:, 0], x.k[:, 0], x.v[:, 0])
  _one_line_error(lambda: ops.gla_decode_step(*step, -x.g[:, 0], h0[:, 0]),
                  "g must be <= 0", "g[0, 0, 0] =")
  _one_line_error(lambda: ops.sse_decode_step(*step, x.g[:, 0], -w[:, 0], idx[:, 0], h0),
                  "weights must be >= 0", "weights[0, 0] =")


def test_plain_jit_checks_nothing_and_stays_effect_free():
  """Under jit the values are unknown: a bad g is the caller's contract (the docstrings
  say so), and the traced op carries no checks, so its calls keep JAX's fast path."""
  x, w, idx, h0 = _inputs()
  fn = jax.jit(lambda *a: _sse("varlen", *a))
  assert not fn.trace(*x, w, idx, h0).jaxpr.effects
  o, _ = fn(x.q, x.k, x.v, x.g.at[0, 1].set(0.1), w, idx, h0)
  assert np.all(np.isfinite(np.asarray(o)))


# --- ops.checked: the same checks inside jit -------------------------------------------

def _checked_error(fn, args, kwargs, pattern):
  with pytest.raises(checkify.JaxRuntimeError, match=pattern):
    fn(*args, **kwargs)


def test_checked_catches_bad_inputs_under_jit():
  x, w, idx, h0 = _inputs()
  q, k, v, g = x

  def model(q, k, v, g, w, idx, h0, cu=None):
    if cu is not None:  # packed: one row of T tokens
      o, _ = ops.gla(q, k, v, g, cu_seqlens=cu, chunk_size=C)
      return o
    o, f = _sse("varlen", q, k, v, g, w, idx, h0)
    return o, f

  run = ops.checked(model)
  good = (q, k, v, g, w, idx, h0)
  o, f = run(*good)  # valid inputs: the numbers of the unchecked op
  o_ref, f_ref = _sse("varlen", *good)
  np.testing.assert_array_equal(o, o_ref)
  np.testing.assert_array_equal(f, f_ref)
  run(q, k, v, _reset_g(g), w, idx, h0)  # -inf is a valid g

  def bad(i, value):
    a = list(good)
    a[i] = value
    return a

  cases = [
      (bad(3, g.at[0, 5, 0, 3].set(6.0)), {}, r"g must be <= 0 .*got g\[0 5 0 3\] = 6"),
      (bad(3, g.at[0, 2, 0, 0].set(jnp.nan)), {}, r"g must be <= 0 .*= nan"),
      (bad(4, w.at[0, 1, 1].set(-0.5)), {}, r"weights must be >= 0 .*weights\[0 1 1\]"),
      (bad(5, idx.at[0, 4, 0].set(N)), {}, r"indices must lie in \[0, num_partitions=4\)"),
      (bad(5, idx.at[0, 4, 0].set(-1)), {}, r"got values in \[-1, "),
      (bad(5, idx.at[0, 4].set(2)), {}, "indices must be distinct within a token"),
      (bad(0, q.at[0, 3, 0, 1].set(jnp.nan)), {}, r"q must be finite, got q\[0 3 0 1\]"),
      (bad(2, v.at[0, 0, 0, 0].set(jnp.inf)), {}, "v must be finite"),
      (bad(6, h0.at[0, 1].set(jnp.nan)), {}, "initial_state must be finite"),
      (good, {"cu": jnp.asarray([0, 20, 10, T], jnp.int32)},
       r"cu_seqlens must start at 0, be non-decreasing and end at T=40; got \[ ?0 20 10 40\]"),
      (good, {"cu": jnp.asarray([0, 20, 39], jnp.int32)}, "cu_seqlens must start at 0"),
  ]
  for args, kwargs, pattern in cases:
    _checked_error(run, args, kwargs, pattern)
  run(*good, cu=jnp.asarray([0, 20, 20, T], jnp.int32))  # an empty sequence is valid


def test_checked_under_grad_and_with_pallas():
  """Checks also fire inside a differentiated function and around Pallas kernels."""
  x, w, idx, h0 = _inputs()

  def loss(q, g, impl):
    return jnp.sum(_sse(impl, q, x.k, x.v, g, w, idx, h0)[0])

  for impl in ("masking", "pallas_varlen"):
    grad = ops.checked(jax.grad(lambda q, g: loss(q, g, impl)))
    assert np.all(np.isfinite(np.asarray(grad(x.q, x.g))))
    _checked_error(grad, (x.q, x.g.at[0, 0, 0, 0].set(1.0)), {}, "g must be <= 0")
