"""sse: loop / masking / varlen against the lax.scan reference, forward and gradients."""

from __future__ import annotations

import functools
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import chunk_gla as pallas_chunk_gla
from sse_jax import ops
from tests.op_testing import assert_close, random_qkvg, random_routing, x64

F64_TOL = 1e-6
BF16_TOL = 5e-3  # the target for bf16 against the float32 scan
IMPLS = ("loop", "masking", "varlen")


class Case(NamedTuple):
  b: int
  t: int
  n: int
  top_k: int
  gate: str
  shared: bool
  with_h0: bool
  cu: tuple | None = None
  routing: str = "random"
  h: int = 2
  dk: int = 16
  dv: int = 8
  read_k: int = 0  # > 0: a separate read set of this size (num_readers)
  scale: float | None = None


CASES = {
    "T150_N4_K1_both_shared": Case(2, 150, 4, 1, "both", True, True),
    "T37_lt_chunk_K2_write": Case(1, 37, 4, 2, "write", False, True),
    "K_eq_N_read_shared": Case(2, 80, 3, 3, "read", True, False),
    "ragged_cu_K2_none": Case(1, 200, 4, 2, "none", True, True,
                              cu=(0, 5, 5, 70, 130, 200)),
    "all_tokens_one_partition": Case(2, 100, 4, 1, "both", False, True, routing="one"),
    "N1_K1": Case(1, 70, 1, 1, "both", True, False),
    "separate_read_set": Case(2, 90, 4, 1, "both", True, True, read_k=2),
    "separate_read_set_ragged": Case(1, 120, 5, 2, "read", False, True,
                                     cu=(0, 50, 120), read_k=1),
    "explicit_scale": Case(1, 80, 4, 2, "both", True, True, scale=0.3),
}


def _make(case: Case, dtype):
  keys = jax.random.split(jax.random.PRNGKey(zlib.crc32(repr(case).encode())), 8)
  s = case.b if case.cu is None else len(case.cu) - 1
  x = random_qkvg(keys[0], case.b, case.t, case.h, case.dk, case.dv, dtype)
  w, idx = random_routing(keys[1], case.b, case.t, case.n, case.top_k, dtype,
                          case.routing)
  shared = tuple(random_qkvg(keys[2], case.b, case.t, case.h, case.dk, case.dk,
                             dtype))[:2] + (0.5 * x.g,)
  h0 = jax.random.normal(keys[3], (s, case.n, case.h, case.dk, case.dv), dtype)
  h0s = jax.random.normal(keys[4], (s, case.h, case.dk, case.dv), dtype)
  cot_o = jax.random.normal(keys[5], (case.b, case.t, case.h, case.dv), dtype)
  cot_f = jax.random.normal(keys[6], h0.shape, dtype)
  cot_fs = jax.random.normal(keys[7], h0s.shape, dtype)
  read = random_routing(jax.random.fold_in(keys[1], 1), case.b, case.t, case.n,
                        max(case.read_k, 1), dtype, case.routing)
  return x, (w, read[0]), (idx, read[1]), shared, (h0, h0s), (cot_o, cot_f, cot_fs)


def _value_and_grads(case: Case, impl: str):
  cu = None if case.cu is None else jnp.asarray(case.cu, jnp.int32)

  def loss(q, k, v, g, w, shared, h0, idx, cots):
    h0_arg = (h0 if case.shared else h0[0]) if case.with_h0 else None
    read = dict(read_weights=w[1], read_indices=idx[1]) if case.read_k else {}
    o, f = ops.sse(q, k, v, g, w[0], idx[0], num_partitions=case.n, gate=case.gate,
                   scale=case.scale,
                   initial_state=h0_arg, output_final_state=True, cu_seqlens=cu,
                   impl=impl, shared=shared if case.shared else None, **read)
    f_routed, f_shared = f if case.shared else (f, jnp.zeros_like(cots[2]))
    val = (jnp.sum(o * cots[0]) + jnp.sum(f_routed * cots[1])
           + jnp.sum(f_shared * cots[2]))
    return val, (o, f_routed, f_shared)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5, 6), has_aux=True))


@pytest.mark.parametrize("name", list(CASES))
def test_impls_match_scan_float64(name):
  case = CASES[name]
  with x64():
    x, w, idx, shared, h0, cots = _make(case, jnp.float64)
    (_, ref_out), ref_grads = _value_and_grads(case, "scan")(*x, w, shared, h0, idx, cots)
    for impl in IMPLS:
      (_, out), grads = _value_and_grads(case, impl)(*x, w, shared, h0, idx, cots)
      for what, a, r in zip(("o", "final", "final_shared"), out, ref_out):
        assert_close(a, r, F64_TOL, f"{impl} {what}")
      flat = lambda t: jax.tree_util.tree_leaves(t)
      names = ["dq", "dk", "dv", "dg", "dweights", "dread_weights", "dq'", "dk'", "dg'",
               "dh0", "dh0'"]
      for gname, a, r in zip(names, flat(grads), flat(ref_grads)):
        assert_close(a, r, F64_TOL, f"{impl} {gname}")


@pytest.mark.parametrize("impl", ("scan",) + IMPLS)
def test_unselected_partition_keeps_its_state_exactly(impl):
  """Partition N-1 is never selected: its final state is bitwise the initial state
  (a masked token must not decay it) and its gradient passes straight through."""
  case = Case(1, 100, 4, 2, "both", True, True, cu=(0, 33, 100), routing="skip_last")
  x, (w, _), (idx, _), shared, (h0, h0s), _ = _make(case, jnp.float32)
  assert not np.any(np.asarray(idx) == case.n - 1)
  fn = jax.jit(functools.partial(
      ops.sse, num_partitions=case.n, output_final_state=True, impl=impl,
      cu_seqlens=jnp.asarray(case.cu, jnp.int32)))
  _, (final, _) = fn(*x, w, idx, initial_state=(h0, h0s), shared=shared)
  np.testing.assert_array_equal(np.asarray(final[:, -1]), np.asarray(h0[:, -1]))
  assert not np.allclose(np.asarray(final[:, 0]), np.asarray(h0[:, 0]))
  dh0 = jax.grad(lambda h: jnp.sum(fn(*x, w, idx, initial_state=(h, h0s),
                                      shared=shared)[1][0]))(h0)
  np.testing.assert_array_equal(np.asarray(dh0[:, -1]), np.ones_like(h0[:, -1]))


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_close_to_float32_scan(impl):
  """bf16 inputs: outputs, final states and every gradient against the fp32 scan."""
  case = Case(2, 130, 4, 2, "both", True, False, h=2, dk=32, dv=32)
  x, w, idx, shared, h0, cots = _make(case, jnp.bfloat16)
  (_, (o, f, fs)), grads = _value_and_grads(case, impl)(*x, w, shared, h0, idx, cots)
  assert o.dtype == jnp.bfloat16 and f.dtype == jnp.float32
  up = lambda t: jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), t)
  (_, (o_ref, f_ref, fs_ref)), ref_grads = _value_and_grads(case, "scan")(
      *up(tuple(x)), up(w), up(shared), up(h0), idx, up(cots))
  assert_close(o, o_ref, BF16_TOL, "o")
  assert_close(f, f_ref, 1e-5, "final")
  assert_close(fs, fs_ref, 1e-5, "final shared")
  # Without a separate read set or an initial state, dread_weights and dh0 are zero.
  names = ("dq", "dk", "dv", "dg", "dweights", "dread_weights", "dq'", "dk'", "dg'",
           "dh0", "dh0'")
  leaves, ref_leaves = jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)
  assert len(leaves) == len(names) == len(ref_leaves)
  for name, a, r in zip(names, leaves, ref_leaves):
    assert_close(a, r, BF16_TOL, name)


@pytest.mark.parametrize("shared, separate_read, gate, scale", [
    (False, False, "both", None), (True, False, "both", None), (True, True, "both", None),
    (True, False, "write", None), (True, True, "read", 0.3), (False, False, "none", 0.3)])
def test_decode_steps_continue_prefill(shared, separate_read, gate, scale):
  """Prefill (varlen) then sse_decode_step token by token == one full call, for every
  gate placement and an explicit scale."""
  with x64():
    case = Case(2, 90, 4, 2, gate, shared, False, read_k=2 if separate_read else 0)
    x, (w, rw), (idx, ridx), sh, _, _ = _make(case, jnp.float64)
    t0 = 70
    sh_arg = sh if shared else None
    rd = lambda sl: (dict(read_weights=rw[sl], read_indices=ridx[sl]) if separate_read
                     else {})
    run = jax.jit(functools.partial(ops.sse, num_partitions=4, output_final_state=True,
                                    gate=gate, scale=scale))
    o_full, _ = run(*x, w, idx, shared=sh_arg, **rd(slice(None)))
    cut = lambda t: None if t is None else tuple(a[:, :t0] for a in t)
    _, state = run(*cut(tuple(x)), w[:, :t0], idx[:, :t0], shared=cut(sh_arg),
                   **rd(np.s_[:, :t0]))
    step = jax.jit(functools.partial(ops.sse_decode_step, gate=gate, scale=scale))
    outs = []
    for i in range(t0, case.t):
      at = lambda t: None if t is None else tuple(a[:, i] for a in t)
      o_i, state = step(*at(tuple(x)), w[:, i], idx[:, i], state, shared=at(sh_arg),
                        **rd(np.s_[:, i]))
      outs.append(o_i)
    assert_close(jnp.stack(outs, 1), o_full[:, t0:], F64_TOL, "decode")


def test_decode_step_touches_only_selected_partitions():
  x = random_qkvg(jax.random.PRNGKey(0), 2, 1, 2, 16, 8)
  state = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 2, 16, 8))
  idx = jnp.array([[1, 3], [4, 0]], jnp.int32)
  w = jnp.array([[0.5, 0.2], [0.3, 0.1]])
  _, new = ops.sse_decode_step(*(a[:, 0] for a in x), w, idx, state)
  for b, chosen in enumerate(([1, 3], [4, 0])):
    for i in range(5):
      same = np.array_equal(np.asarray(new[b, i]), np.asarray(state[b, i]))
      assert same == (i not in chosen), (b, i)


def _sse_args(**over):
  b, t, h, d, n = 1, 8, 2, 8, 4
  args = dict(q=jnp.zeros((b, t, h, d)), k=jnp.zeros((b, t, h, d)), v=jnp.zeros((b, t, h, d)),
              g=jnp.zeros((b, t, h, d)), weights=jnp.ones((b, t, 2)),
              indices=jnp.zeros((b, t, 2), jnp.int32).at[..., 1].set(1))
  kwargs = dict(num_partitions=n)
  for key, value in over.items():
    (args if key in args else kwargs)[key] = value
  return args, kwargs


@pytest.mark.parametrize("bad, match", [
    (dict(num_partitions=1), r"top-k K=2 \(last axis of indices\) must be in \[1, num_partitions=1\]"),
    (dict(num_partitions=0), "num_partitions must be a positive int, got 0"),
    (dict(indices=jnp.zeros((1, 8, 2))), "indices must be integer"),
    (dict(indices=jnp.zeros((1, 7, 2), jnp.int32)), r"indices must have shape \[B, T, K\]"),
    (dict(weights=jnp.ones((1, 8, 3))), "weights must have the shape of indices"),
    (dict(indices=jnp.full((1, 8, 2), 4, jnp.int32).at[..., 1].set(0)),
     r"indices must lie in \[0, num_partitions=4\), got values in \[0, 4\]"),
    (dict(indices=jnp.zeros((1, 8, 2), jnp.int32)), "indices must be distinct"),
    (dict(gate="sideways"), "gate='sideways' is not one of"),
    (dict(impl="chunk"), "impl='chunk' is not available for sse"),
    (dict(shared=(jnp.zeros((1, 8, 2, 4)),) * 3),
     r"shared q' must have shape \[B, T, H, D\] = \(1, 8, 2, 8\), got \(1, 8, 2, 4\)"),
    (dict(q=jnp.zeros((1, 8, 4, 2, 8))), r"q, k and v must all be per partition .* got "
     r"ranks \(5, 4, 4\)"),
    (dict(q=jnp.zeros((1, 8, 3, 2, 8)), k=jnp.zeros((1, 8, 3, 2, 8)),
          v=jnp.zeros((1, 8, 3, 2, 8))),
     r"per-partition q must have shape \[B, T, N, H, D\] = \(1, 8, 4, 2, 8\)"),
    (dict(q=jnp.zeros((1, 8, 4, 2, 8)), k=jnp.zeros((1, 8, 4, 2, 8)),
          v=jnp.zeros((1, 8, 4, 2, 8)), shared=(jnp.zeros((1, 8, 2, 8)),) * 3),
     r"per-partition v needs the shared partition's own values"),
    (dict(initial_state=jnp.zeros((1, 3, 2, 8, 8))), r"initial_state must have shape \(1, 4, 2, 8, 8\)"),
    (dict(initial_state=(jnp.zeros((1, 4, 2, 8, 8)), jnp.zeros((1, 2, 8, 8)))),
     "initial_state is a tuple, but shared is None"),
    (dict(chunk_size=256, impl="pallas_varlen"),
     r"chunk_size=256: the Pallas kernels take chunk sizes \(16, 32, 64, 128\) "
     r"\(impl='pallas_varlen'\)"),
    (dict(scale=jnp.ones((1, 2))), "scale must be a scalar"),
])
def test_bad_inputs_raise(bad, match):
  args, kwargs = _sse_args(**bad)
  with pytest.raises(ValueError, match=match):
    ops.sse(**args, **kwargs)


def test_cu_seqlens_with_batch_raises():
  args, kwargs = _sse_args()
  args = {k: jnp.concatenate([v, v]) for k, v in args.items()}
  with pytest.raises(ValueError, match="B == 1, got B=2"):
    ops.sse(**args, **kwargs, cu_seqlens=jnp.array([0, 8], jnp.int32))


def _temp_bytes(n: int, impl: str) -> int:
  b, t, h, d, top_k = 2, 8192, 2, 64, 1
  spec = jax.ShapeDtypeStruct
  fn = jax.jit(functools.partial(ops.sse, num_partitions=n, impl=impl))
  lowered = fn.lower(*(spec((b, t, h, d), jnp.bfloat16),) * 4,
                     spec((b, t, top_k), jnp.float32), spec((b, t, top_k), jnp.int32))
  return lowered.compile().memory_analysis().temp_size_in_bytes


def test_varlen_memory_grows_with_k_not_n():
  """Compiled temporary memory at B=2, T=8192, K=1: N=32 < 1.5 x N=4 for varlen."""
  m4, m32 = _temp_bytes(4, "varlen"), _temp_bytes(32, "varlen")
  assert m32 < 1.5 * m4, (m4, m32)


@pytest.mark.parametrize("impl", ["scan", "loop", "masking", "varlen", "pallas_masking",
                                  "pallas_varlen"])
def test_no_tokens_keeps_the_initial_states(impl):
  b, h, d, n = 2, 2, 16, 3
  x = jnp.zeros((b, 0, h, d))
  h0 = jax.random.normal(jax.random.PRNGKey(0), (b, n, h, d, d))
  h0s = jax.random.normal(jax.random.PRNGKey(1), (b, h, d, d))
  o, (f, fs) = ops.sse(x, x, x, x, jnp.zeros((b, 0, 1)), jnp.zeros((b, 0, 1), jnp.int32),
                       num_partitions=n, impl=impl, shared=(x, x, x),
                       initial_state=(h0, h0s), output_final_state=True)
  assert o.shape == (b, 0, h, d)
  np.testing.assert_array_equal(f, h0)
  np.testing.assert_array_equal(fs, h0s)


@pytest.mark.parametrize("impl", ["masking", "varlen", "pallas_varlen", "in_place"])
def test_out_of_range_ids_under_jit_are_ignored_alike(impl):
  """Under jit an id outside [0, N) cannot be checked (the caller's contract); every
  impl then ignores that selection, as the scan does, instead of varlen writing it into
  another (sequence, partition) segment. B = 2: id N would be sequence 1's partition 0.
  "in_place": pallas_varlen reading its slots in place (BlockSizes.gather_rows), where
  an ignored slot is behind no row of the kernels and must still come out zero."""
  if impl == "in_place":
    impl = ops.Plan(ops.Algorithm.VARLEN, ops.PallasCore(
        pallas_chunk_gla.BlockSizes(chunk=16, gather_rows=True)))
  n, b, t, h, d = 3, 2, 40, 1, 16
  x = random_qkvg(jax.random.PRNGKey(3), b, t, h, d, d)
  w = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(4), (b, t, n)), -1)
  w, idx = jax.lax.top_k(w, 2)
  idx = idx.at[0, 3, 0].set(n).at[0, 7, 1].set(-1).at[1, 9, 0].set(n + 5)
  run = lambda impl: jax.jit(lambda *a: ops.sse(
      *a, num_partitions=n, impl=impl, output_final_state=True, chunk_size=16))(
          *x, w, idx)
  (o_ref, f_ref), (o, f) = run("scan"), run(impl)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(f, f_ref, 1e-5, "final_state")
  # With the shared partition, gradients too: the ignored selections get none.
  probe = jax.random.normal(jax.random.PRNGKey(5), o.shape)

  def loss(impl, q, k, v, g, w, idx):  # idx traced: the checks cannot see its values
    o, _ = ops.sse(q, k, v, g, w, idx, num_partitions=n, impl=impl, chunk_size=16,
                   shared=(k, q, g))
    return jnp.sum(o * probe)

  grads = lambda impl: jax.jit(jax.grad(functools.partial(loss, impl),
                                        argnums=(0, 1, 2, 3, 4)))(*x, w, idx)
  for name, got, want in zip("q k v g w".split(), grads(impl), grads("scan")):
    assert_close(got, want, 1e-4, f"d{name}")
