"""sse_gdn: the scan reference against a literal loop of the equations, masking and
varlen against the scan (outputs, final states, gradients), untouched partitions,
decoding, resets, empty and bad inputs. Tiny shapes: T <= 64, chunk 16."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
import zlib
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sse_jax.ops.gdn import gdn, gdn_decode_step
from sse_jax.ops.sse_gdn import sse_gdn, sse_gdn_decode_step
from tests.op_testing import assert_close, random_routing, x64
from tests.test_ops_gdn import BF16_TOL, C, F64_TOL, numpy_gdn, random_gdn, raises_one_line
from tests.test_ops_sse import Case as SseCase

IMPLS = ("masking", "varlen")


def numpy_sse_gdn(x, weights, indices, n, gate, h0, scale, cu=None, shared=None,
                  h0_shared=None, read=None):
  """The equations, literally, in float64: per token, each selected partition takes one
  delta-rule step with strength w beta and is read with weight r; the others do not
  change. read: an optional separate (read_weights, read_indices)."""
  q, k, v, g, beta = (np.asarray(a, np.float64) for a in x)
  weights, indices = np.asarray(weights, np.float64), np.asarray(indices)
  r_weights, r_indices = (weights, indices) if read is None else (
      np.asarray(read[0], np.float64), np.asarray(read[1]))
  b, t, h = g.shape
  bounds = [(i, 0, t) for i in range(b)] if cu is None else [
      (0, cu[s], cu[s + 1]) for s in range(len(cu) - 1)]
  o = np.zeros(v.shape)
  final = np.array(h0, np.float64, copy=True)
  on_write, on_read = gate in ("both", "write"), gate in ("both", "read")
  for z, (row, start, end) in enumerate(bounds):
    for i in range(start, end):
      for head in range(h):
        kt, vt = k[row, i, head], v[row, i, head]
        for j, part in enumerate(indices[row, i]):
          w = weights[row, i, j] if on_write else 1.0
          s_dec = np.exp(g[row, i, head]) * final[z, part, head]
          final[z, part, head] = s_dec + w * beta[row, i, head] * np.outer(
              kt, vt - kt @ s_dec)
        for j, part in enumerate(r_indices[row, i]):
          r = r_weights[row, i, j] if on_read else 1.0
          o[row, i, head] += r * scale * q[row, i, head] @ final[z, part, head]
  if shared is None:
    return o, final
  o0, final0 = numpy_gdn(type(x)(*shared[:2], x.v, *shared[2:]), h0_shared, scale, cu)
  return o + o0, (final, final0)


# The routing cases of the sse tests (b, t, n, top_k, gate, shared, with_h0, cu, ...),
# at smaller head dims.
Case = functools.partial(SseCase, dk=8, dv=4)


CASES = {
    "K1_both_shared_T37": Case(2, 37, 4, 1, "both", True, True),
    "K2_write_ragged_cu": Case(1, 50, 4, 2, "write", False, True, cu=(0, 5, 5, 21, 50)),
    "K_eq_N_read_shared": Case(2, 24, 3, 3, "read", True, False),
    "K2_none_ragged_shared": Case(1, 40, 4, 2, "none", True, True, cu=(0, 17, 40)),
    "separate_read_set": Case(2, 30, 4, 1, "both", True, True, read_k=2),
    "all_tokens_one_partition": Case(1, 33, 3, 1, "both", False, True, routing="one"),
}


def _make(case: SseCase, dtype):
  keys = jax.random.split(jax.random.PRNGKey(zlib.crc32(repr(case).encode())), 9)
  s = case.b if case.cu is None else len(case.cu) - 1
  x = random_gdn(keys[0], case.b, case.t, case.h, case.dk, case.dv, dtype, beta_max=2.0)
  w, idx = random_routing(keys[1], case.b, case.t, case.n, case.top_k, dtype,
                          case.routing)
  rw, ridx = random_routing(keys[2], case.b, case.t, case.n, max(case.read_k, 1), dtype)
  y = random_gdn(keys[3], case.b, case.t, case.h, case.dk, case.dv, dtype)
  shared = (y.q, y.k, 0.5 * x.g, y.beta)
  h0 = jax.random.normal(keys[4], (s, case.n, case.h, case.dk, case.dv), dtype)
  h0s = jax.random.normal(keys[5], (s, case.h, case.dk, case.dv), dtype)
  cots = tuple(jax.random.normal(kc, a.shape, dtype)
               for kc, a in zip(keys[6:], (x.v, h0, h0s)))
  return x, (w, rw), (idx, ridx), shared, (h0, h0s), cots


def _call(case: SseCase, impl, x, w, idx, shared, h0, **kw):
  """sse_gdn on a case's arguments; the final state as (routed, shared or None)."""
  h0_arg = (h0 if case.shared else h0[0]) if case.with_h0 else None
  read = dict(read_weights=w[1], read_indices=idx[1]) if case.read_k else {}
  o, f = sse_gdn(*x, w[0], idx[0], num_partitions=case.n, gate=case.gate,
                 initial_state=h0_arg, output_final_state=True, impl=impl,
                 shared=shared if case.shared else None, chunk_size=C,
                 cu_seqlens=None if case.cu is None else jnp.asarray(case.cu, jnp.int32),
                 **read, **kw)
  return o, (f if case.shared else (f, None))


def _value_and_grads(case: SseCase, impl: str):
  def loss(x, w, shared, h0, idx, cots):
    o, (f, f0) = _call(case, impl, x, w, idx, shared, h0)
    val = jnp.sum(o * cots[0]) + jnp.sum(f * cots[1])
    if f0 is not None:
      val = val + jnp.sum(f0 * cots[2])
    return val, (o, f, f0)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dweights", "dread_weights", "dq'", "dk'",
              "dg'", "dbeta'", "dh0", "dh0'")


def test_scan_matches_the_equations():
  """The reference against a literal loop, for every gate, with the shared partition,
  a separate read set, ragged packed sequences and a -inf reset."""
  case = Case(1, 26, 4, 2, "both", True, True, cu=(0, 9, 9, 26), read_k=1, h=2, dk=4, dv=3)
  with x64():
    x, w, idx, shared, (h0, h0s), _ = _make(case, jnp.float64)
    x = x._replace(g=x.g.at[0, 13, 0].set(-jnp.inf))
    for gate, read in (("both", False), ("write", True), ("read", False), ("none", True)):
      kw = dict(read_weights=w[1], read_indices=idx[1]) if read else {}
      o, (f, f0) = sse_gdn(*x, w[0], idx[0], num_partitions=4, gate=gate, scale=0.6,
                           initial_state=(h0, h0s), output_final_state=True, impl="scan",
                           shared=shared, cu_seqlens=jnp.asarray(case.cu, jnp.int32),
                           **kw)
      o_ref, (f_ref, f0_ref) = numpy_sse_gdn(
          x, w[0], idx[0], 4, gate, h0, 0.6, case.cu, shared, h0s,
          (w[1], idx[1]) if read else None)
      for what, a, r in (("o", o, o_ref), ("final", f, f_ref), ("final'", f0, f0_ref)):
        np.testing.assert_allclose(a, r, rtol=1e-12, atol=1e-12, err_msg=f"{gate} {what}")


@pytest.mark.parametrize("name", list(CASES))
def test_impls_match_scan_float64(name):
  case = CASES[name]
  with x64():
    x, w, idx, shared, h0, cots = _make(case, jnp.float64)
    (_, ref_out), ref_grads = _value_and_grads(case, "scan")(x, w, shared, h0, idx, cots)
    for impl in IMPLS:
      (_, out), grads = _value_and_grads(case, impl)(x, w, shared, h0, idx, cots)
      for what, a, r in zip(("o", "final", "final'"), out, ref_out):
        if r is not None:
          assert_close(a, r, F64_TOL, f"{impl} {what}")
      leaves = jax.tree_util.tree_leaves(grads)
      ref_leaves = jax.tree_util.tree_leaves(ref_grads)
      assert len(leaves) == len(GRAD_NAMES) == len(ref_leaves)
      for what, a, r in zip(GRAD_NAMES, leaves, ref_leaves):
        assert_close(a, r, F64_TOL, f"{impl} {what}")


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_close_to_float32_scan(impl):
  case = Case(2, 40, 4, 2, "both", True, True, h=2, dk=16, dv=16)
  x, w, idx, shared, h0, cots = _make(case, jnp.bfloat16)
  (_, (o, f, f0)), grads = _value_and_grads(case, impl)(x, w, shared, h0, idx, cots)
  assert o.dtype == jnp.bfloat16 and f.dtype == f0.dtype == jnp.float32
  up = lambda t: jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), t)
  (_, (o_ref, f_ref, f0_ref)), ref_grads = _value_and_grads(case, "scan")(
      up(x), up(w), up(shared), up(h0), idx, up(cots))
  assert_close(o, o_ref, BF16_TOL, "o")
  assert_close(f, f_ref, 1e-5, "final")
  assert_close(f0, f0_ref, 1e-5, "final'")
  # Without a separate read set, dread_weights is zero.
  for what, a, r in zip(GRAD_NAMES, jax.tree_util.tree_leaves(grads),
                        jax.tree_util.tree_leaves(ref_grads)):
    assert_close(a, r, BF16_TOL, what)


@pytest.mark.parametrize("impl", ("scan",) + IMPLS)
def test_unselected_partition_keeps_its_state_exactly(impl):
  """Partition N-1 is never selected: no decay, no delta update -- its final state is
  bit for bit the initial state, and its gradient passes straight through."""
  case = Case(1, 40, 4, 2, "both", True, True, cu=(0, 13, 40), routing="skip_last")
  x, (w, _), (idx, _), shared, (h0, h0s), _ = _make(case, jnp.float32)
  assert not np.any(np.asarray(idx) == case.n - 1)
  cu = jnp.asarray(case.cu, jnp.int32)
  routed_final = jax.jit(lambda h: sse_gdn(
      *x, w, idx, num_partitions=case.n, output_final_state=True, impl=impl, chunk_size=C,
      cu_seqlens=cu, initial_state=(h, h0s), shared=shared)[1][0])
  final, pullback = jax.vjp(routed_final, h0)
  (dh0,) = pullback(jnp.ones_like(final))
  np.testing.assert_array_equal(np.asarray(final[:, -1]), np.asarray(h0[:, -1]))
  np.testing.assert_array_equal(np.asarray(dh0[:, -1]), np.ones_like(h0[:, -1]))
  assert not np.allclose(np.asarray(final[:, 0]), np.asarray(h0[:, 0]))


@pytest.mark.parametrize("gate", ("both", "none"))
def test_one_partition_is_gdn(gate):
  """N = K = 1 with weight-1 routing is the dense gated delta rule."""
  with x64():
    x = random_gdn(jax.random.PRNGKey(0), 2, 30, 2, 8, 4, jnp.float64)
    ones, zeros = jnp.ones((2, 30, 1)), jnp.zeros((2, 30, 1), jnp.int32)
    o_ref, f_ref = gdn(*x, output_final_state=True, impl="scan")
    for impl in ("scan",) + IMPLS:
      o, f = sse_gdn(*x, ones, zeros, num_partitions=1, gate=gate, impl=impl,
                     output_final_state=True, chunk_size=C)
      assert_close(o, o_ref, F64_TOL, f"{impl} o")
      assert_close(f[:, 0], f_ref, F64_TOL, f"{impl} final")


@pytest.mark.parametrize("gate, shared, separate_read", [
    ("both", False, False), ("both", True, True), ("write", True, False),
    ("read", False, True), ("none", True, False)])
def test_decode_steps_continue_prefill(gate, shared, separate_read):
  """Prefill (varlen) then sse_gdn_decode_step token by token == one full call."""
  case = Case(2, 36, 4, 2, gate, shared, True, read_k=2 if separate_read else 0)
  with x64():
    x, w, idx, sh, h0, _ = _make(case, jnp.float64)
    o_full, f_full = _call(case, "varlen", x, w, idx, sh, h0)
    t0 = 21
    cut = lambda t: tuple(a[:, :t0] for a in t)
    _, state = _call(case, "varlen", cut(x), cut(w), cut(idx), cut(sh), h0)
    state = state if shared else state[0]
    step = jax.jit(functools.partial(sse_gdn_decode_step, gate=gate))
    outs = []
    for i in range(t0, case.t):
      at = lambda t: tuple(a[:, i] for a in t)
      read = (dict(read_weights=w[1][:, i], read_indices=idx[1][:, i]) if separate_read
              else {})
      o_i, state = step(*at(x), w[0][:, i], idx[0][:, i], state,
                        shared=at(sh) if shared else None, **read)
      outs.append(o_i)
    assert_close(jnp.stack(outs, 1), o_full[:, t0:], F64_TOL, "decode")
    if shared:
      assert_close(state[0], f_full[0], F64_TOL, "state")
      assert_close(state[1], f_full[1], F64_TOL, "state'")
    else:
      assert_close(state, f_full[0], F64_TOL, "state")


def test_decode_step_touches_only_selected_partitions():
  x = random_gdn(jax.random.PRNGKey(0), 2, 1, 2, 8, 4)
  state = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 2, 8, 4))
  idx = jnp.array([[1, 3], [4, 0]], jnp.int32)
  w = jnp.array([[0.5, 0.2], [0.3, 0.1]])
  _, new = sse_gdn_decode_step(*(a[:, 0] for a in x), w, idx, state)
  for b, chosen in enumerate(([1, 3], [4, 0])):
    for i in range(5):
      same = np.array_equal(np.asarray(new[b, i]), np.asarray(state[b, i]))
      assert same == (i not in chosen), (b, i)


RESETS = (0, 5, 16, 17, 33)


@pytest.mark.parametrize("impl", IMPLS)
def test_hard_reset_matches_scan_with_finite_gradients(impl):
  """g = -inf (and g' = -inf) resets the selected partitions: values and gradients equal
  the scan's and are finite."""
  case = Case(1, 40, 4, 2, "both", True, True, h=1)
  x, (w, _), (idx, _), shared, h0, (cot_o, cot_f, _) = _make(case, jnp.float32)
  x = x._replace(g=x.g.at[:, RESETS].set(-jnp.inf))
  shared = shared[:2] + (shared[2].at[:, 7].set(-jnp.inf),) + shared[3:]

  def grads(impl):
    def loss(x, w, shared, h0):
      o, (f, f0) = sse_gdn(*x, w, idx, num_partitions=4, impl=impl, shared=shared,
                           initial_state=h0, output_final_state=True, chunk_size=C)
      return jnp.sum(o * cot_o) + jnp.sum(f * cot_f) + jnp.sum(f0)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, w, shared, h0)

  (val, dx), (val_ref, dx_ref) = grads(impl), grads("scan")
  assert_close(val, val_ref, 1e-5, "loss")
  for a, r in zip(jax.tree_util.tree_leaves(dx), jax.tree_util.tree_leaves(dx_ref)):
    assert np.all(np.isfinite(np.asarray(a)))
    assert_close(a, r, 1e-4, "gradient")


@pytest.mark.parametrize("impl", ("scan",) + IMPLS)
@pytest.mark.parametrize("b, t", [(0, 20), (2, 0)])
def test_empty_batch_or_time_keeps_the_initial_states(impl, b, t):
  case = Case(b, t, 3, 1, "both", True, True)
  x, (w, _), (idx, _), shared, (h0, h0s), _ = _make(case, jnp.float32)
  o, (f, f0) = sse_gdn(*x, w, idx, num_partitions=3, impl=impl, shared=shared,
                       initial_state=(h0, h0s), output_final_state=True)
  assert o.shape == x.v.shape and not np.any(np.asarray(o))
  np.testing.assert_array_equal(f, h0)
  np.testing.assert_array_equal(f0, h0s)


def test_out_of_range_ids_under_jit_are_ignored_alike():
  """Under jit an id outside [0, N) selects nothing, in every impl (varlen must not write
  it into another (sequence, partition) segment)."""
  case = Case(2, 30, 3, 2, "both", False, False, h=1)
  x, (w, _), (idx, _), _, _, _ = _make(case, jnp.float32)
  idx = idx.at[0, 3, 0].set(3).at[0, 7, 1].set(-1).at[1, 9, 0].set(8)
  run = lambda impl: jax.jit(lambda *a: sse_gdn(
      *a, num_partitions=3, impl=impl, output_final_state=True, chunk_size=C))(*x, w, idx)
  o_ref, f_ref = run("scan")
  for impl in IMPLS:
    o, f = run(impl)
    assert_close(o, o_ref, 1e-5, f"{impl} o")
    assert_close(f, f_ref, 1e-5, f"{impl} final")


def _args(**over):
  b, t, h, d, n = 1, 8, 2, 4, 4
  x = dict(q=jnp.zeros((b, t, h, d)), k=jnp.zeros((b, t, h, d)), v=jnp.zeros((b, t, h, d)),
           g=jnp.zeros((b, t, h)), beta=jnp.ones((b, t, h)), weights=jnp.ones((b, t, 2)),
           indices=jnp.zeros((b, t, 2), jnp.int32).at[..., 1].set(1))
  kwargs = dict(num_partitions=n)
  for key, value in over.items():
    (x if key in x else kwargs)[key] = value
  return x, kwargs


SHARED_OK = (jnp.zeros((1, 8, 2, 4)),) * 2 + (jnp.zeros((1, 8, 2)),) * 2


@pytest.mark.parametrize("bad, match", [
    (dict(num_partitions=1), r"top-k K=2 \(last axis of indices\) must be in \[1, num_partitions=1\]"),
    (dict(indices=jnp.zeros((1, 8, 2))), "indices must be integer"),
    (dict(weights=jnp.ones((1, 8, 3))), "weights must have the shape of indices"),
    (dict(indices=jnp.full((1, 8, 2), 4, jnp.int32).at[..., 1].set(0)),
     r"indices must lie in \[0, num_partitions=4\)"),
    (dict(indices=jnp.zeros((1, 8, 2), jnp.int32)), "indices must be distinct"),
    (dict(weights=-jnp.ones((1, 8, 2))), r"weights must be >= 0 .*weights\[0, 0, 0\]"),
    (dict(g=jnp.zeros((1, 8, 2, 4))), r"g must have shape \[B, T, H\] = \(1, 8, 2\)"),
    (dict(beta=jnp.ones((1, 8, 2)).at[0, 2, 1].set(2.01)),
     r"beta must be in \[0, 2\].*beta\[0, 2, 1\]"),
    (dict(g=jnp.ones((1, 8, 2))), r"g must be <= 0 .*g\[0, 0, 0\] = 1.0"),
    (dict(gate="sideways"), "gate='sideways' is not one of"),
    (dict(impl="chunk"), "impl='chunk' is not available for sse_gdn; choose one of 'scan',"
     " 'masking', 'varlen', 'pallas_masking', 'pallas_varlen', 'auto'"),
    (dict(impl="pallas_chunk"), "impl='pallas_chunk' is not available for sse_gdn"),
    (dict(impl="pallas_varlen", chunk_size=48),
     r"chunk_size=48: the Pallas GDN kernels take chunk sizes \(16, 32, 64\)"),
    (dict(shared=SHARED_OK[:3]), r"shared must be a tuple \(q', k', g', beta'\)"),
    (dict(shared=SHARED_OK[:2] + (jnp.zeros((1, 8, 2, 4)), SHARED_OK[3])),
     r"shared g' must have shape \(1, 8, 2\)"),
    (dict(shared=SHARED_OK[:3] + (3 * jnp.ones((1, 8, 2)),)), r"shared beta' must be in \[0, 2\]"),
    (dict(initial_state=jnp.zeros((1, 3, 2, 4, 4))),
     r"initial_state must have shape \(1, 4, 2, 4, 4\)"),
    (dict(initial_state=(jnp.zeros((1, 4, 2, 4, 4)), jnp.zeros((1, 2, 4, 4)))),
     "initial_state is a tuple, but shared is None"),
    (dict(shared=SHARED_OK, initial_state=jnp.zeros((1, 4, 2, 4, 4))),
     r"with shared, initial_state must be a tuple \(routed, shared\)"),
    (dict(read_weights=jnp.ones((1, 8, 1))), "read_weights and read_indices must be given"),
    (dict(chunk_size=-16), "chunk_size=-16 must be a positive int"),
    (dict(scale=jnp.ones((1, 2))), "scale must be a scalar"),
])
def test_bad_inputs_raise_one_line(bad, match):
  x, kwargs = _args(**bad)
  raises_one_line(lambda: sse_gdn(**x, **kwargs), match)


def test_cu_seqlens_with_batch_raises():
  x, kwargs = _args()
  x = {k: jnp.concatenate([v, v]) for k, v in x.items()}
  with pytest.raises(ValueError, match="B == 1, got B=2"):
    sse_gdn(**x, **kwargs, cu_seqlens=jnp.array([0, 8], jnp.int32))


def test_bad_decode_step_inputs_raise():
  q, g, beta = jnp.zeros((2, 3, 4)), jnp.zeros((2, 3)), jnp.ones((2, 3))
  w, idx, state = jnp.ones((2, 1)), jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 4, 3, 4, 4))
  sse_gdn_decode_step(q, q, q, g, beta, w, idx, state)
  for kwargs, args, match in [
      ({}, (q, q, q, g, beta.at[0, 0].set(-0.5), w, idx, state), r"beta\[0, 0\] = -0.5"),
      ({}, (q, q, q, g, beta, w, idx.at[1, 0].set(4), state), r"indices must lie in \[0, "),
      ({}, (q, q, q, g, beta, w[:, :, None], idx, state), r"weights and indices must both"),
      ({}, (q, q, q, g, beta, w, idx, state[:, :, :2]), r"state must have shape"),
      (dict(shared=(q, q, g, beta)), (q, q, q, g, beta, w, idx, state),
       r"with shared, state must be a tuple \(routed, shared\)"),
      (dict(shared=(q, q, g[..., None], beta)),
       (q, q, q, g, beta, w, idx, (state, state[:, 0])), r"shared g' must have shape"),
  ]:
    with pytest.raises(ValueError, match=match):
      sse_gdn_decode_step(*args, **kwargs)


def test_exported_from_ops():
  from sse_jax import ops  # pylint: disable=g-import-not-at-top
  assert (ops.gdn, ops.gdn_decode_step, ops.sse_gdn, ops.sse_gdn_decode_step) == (
      gdn, gdn_decode_step, sse_gdn, sse_gdn_decode_step)
  assert ops.GDN_IMPLS == ("scan", "chunk", "pallas_chunk", "auto")
  assert ops.SSE_GDN_IMPLS == ("scan", "masking", "varlen", "pallas_masking",
                               "pallas_varlen", "auto")


def _sharded_check():
  """Run in a process with 4 CPU devices: under a 2 x 2 ("data", "model") mesh, gdn and
  sse_gdn (masking, varlen; dense batch and packed sequences) give the unsharded scan's
  value and gradients, run inside the ops' shard_map, with no all-gather."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  assert jax.device_count() == 4, jax.device_count()
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  sharded = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
  failures = 0
  for b, cu in ((4, None), (1, jnp.asarray([0, 9, 9, 32], jnp.int32))):
    x = random_gdn(jax.random.PRNGKey(b), b, 32, 2, 8, 8)
    w, idx = random_routing(jax.random.PRNGKey(1), b, 32, 4, 2)
    batch = "data" if cu is None else None  # packed sequences (B = 1): heads only
    xs = type(x)(*(sharded(a, batch, None, "model") for a in x))
    ws = sharded(w, batch)

    def loss(x, w, impl):
      o, (f, f0) = sse_gdn(*x, w, idx, num_partitions=4, impl=impl, cu_seqlens=cu,
                           shared=(x.q, x.k, x.g, x.beta), output_final_state=True,
                           chunk_size=C)
      o2, f2 = gdn(*x, impl="scan" if impl == "scan" else "chunk", cu_seqlens=cu,
                   output_final_state=True, chunk_size=C)
      return (o * o).sum() + (f * f).sum() + (f0 * f0).sum() + (o2 * o).sum() + (f2 * f2).sum()

    grad = lambda impl: jax.jit(jax.value_and_grad(functools.partial(loss, impl=impl),
                                                   argnums=(0, 1)))
    ref = jax.tree_util.tree_leaves(grad("scan")(x, w))
    for impl in IMPLS:
      with jax.set_mesh(mesh):
        lowered = grad(impl).lower(xs, ws)
        compiled = lowered.compile()
        out = jax.tree_util.tree_leaves(compiled(xs, ws))
      text = lowered.as_text()
      manual = "manual_computation" in text or "SPMDFullToShardShape" in text
      gathers = compiled.as_text().count("all-gather")
      err = max(float(jnp.linalg.norm(a - r) / jnp.linalg.norm(r)) for a, r in zip(out, ref))
      ok = err < 1e-4 and manual and not gathers
      failures += not ok
      print(f"B={b} {impl}: max rel err {err:.2e}, all-gathers {gathers}, shard_map"
            f" {manual}: {'ok' if ok else 'FAIL'}", flush=True)
  raise SystemExit(failures)


def test_sharded_ops_match_scan_without_all_gather():
  """Sharded execution on 4 simulated CPU devices, in a subprocess (the device count is
  fixed when JAX starts)."""
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu",
             XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
             + " --xla_force_host_platform_device_count=4")
  proc = subprocess.run([sys.executable, "-m", "tests.test_ops_sse_gdn"], cwd=root,
                        env=env, capture_output=True, text=True, timeout=600)
  report = proc.stdout + proc.stderr[-3000:]
  assert proc.returncode == 0 and proc.stdout.count(": ok") == 4, report


if __name__ == "__main__":
  _sharded_check()
