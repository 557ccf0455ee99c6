"""sse with per-partition q, k, v ([B, T, N, H, D], the paper's Table 8 control): the
scan against a literal numpy loop, every other impl against the scan (float64, outputs,
final states and gradients), the decode step against the full call, and the shared
partition with values of its own."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sse_jax import ops
from sse_jax.ops import impl as impl_lib
from tests.op_testing import assert_close, random_routing, x64

F64_TOL = 1e-6


def _inputs(b, t, n, h, dk, dv, top_k, dtype=jnp.float64, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 10)
  normal = lambda key, shape: jax.random.normal(key, shape, dtype)
  q, k = normal(keys[0], (b, t, n, h, dk)), normal(keys[1], (b, t, n, h, dk))
  v = normal(keys[2], (b, t, n, h, dv))
  g = -jnp.abs(normal(keys[3], (b, t, h, dk)))
  w, idx = random_routing(keys[4], b, t, n, top_k, dtype)
  shared = (normal(keys[5], (b, t, h, dk)), normal(keys[6], (b, t, h, dk)), 0.5 * g,
            normal(keys[7], (b, t, h, dv)))
  h0 = (normal(keys[8], (b, n, h, dk, dv)), normal(keys[9], (b, h, dk, dv)))
  return (q, k, v, g, w, idx), shared, h0


def _numpy_loop(q, k, v, g, w, idx, shared, h0, scale):
  """o_t = sum_i w_i scale q_{t,i} S_i + scale q'_t S'_t, S_i written only when selected."""
  q, k, v, g, w, idx = (np.asarray(a, np.float64) for a in (q, k, v, g, w, idx))
  q0, k0, g0, v0 = (np.asarray(a, np.float64) for a in shared)
  s, s0 = (np.array(a, np.float64) for a in h0)
  b, t, _, h, _ = q.shape
  o = np.zeros((b, t, h, v.shape[-1]))
  for bb in range(b):
    for tt in range(t):
      for hh in range(h):
        for j, i in enumerate(idx[bb, tt].astype(int)):
          s[bb, i, hh] = (np.exp(g[bb, tt, hh])[:, None] * s[bb, i, hh]
                          + w[bb, tt, j] * np.outer(k[bb, tt, i, hh], v[bb, tt, i, hh]))
        for j, i in enumerate(idx[bb, tt].astype(int)):
          o[bb, tt, hh] += w[bb, tt, j] * scale * q[bb, tt, i, hh] @ s[bb, i, hh]
        s0[bb, hh] = (np.exp(g0[bb, tt, hh])[:, None] * s0[bb, hh]
                      + np.outer(k0[bb, tt, hh], v0[bb, tt, hh]))
        o[bb, tt, hh] += scale * q0[bb, tt, hh] @ s0[bb, hh]
  return o, s, s0


def test_scan_is_the_literal_recurrence():
  with x64():
    args, shared, h0 = _inputs(2, 12, 3, 2, 4, 5, top_k=2)
    o, (f, f0) = ops.sse(*args, num_partitions=3, impl="scan", shared=shared,
                         initial_state=h0, output_final_state=True)
    want = _numpy_loop(*args, shared, h0, 4 ** -0.5)
  for name, a, r in zip(("o", "final", "final shared"), (o, f, f0), want):
    assert_close(a, r, 1e-12, name)


@pytest.mark.parametrize("impl", ["loop", "masking", "varlen", "pallas_masking",
                                  "pallas_varlen"])
@pytest.mark.parametrize("read_set", [False, True])
def test_impls_match_scan_float64(impl, read_set):
  """Ragged packed sequences, K = 2 of N = 4, chunk 16, with and without a separate
  read set; the Pallas core in fp32 against the float64 scan."""
  n, cu = 4, jnp.asarray([0, 23, 23, 70], jnp.int32)
  with x64():
    args, shared, h0 = _inputs(1, 70, n, 2, 16, 16, top_k=2)
    h0 = tuple(jnp.concatenate([x, x, x]) for x in h0)  # one per packed sequence
    read_w, read_idx = random_routing(jax.random.PRNGKey(7), 1, 70, n, 1, jnp.float64)
    read = dict(read_weights=read_w, read_indices=read_idx) if read_set else {}
    cot = jax.random.normal(jax.random.PRNGKey(8), (1, 70, 2, 16), jnp.float64)

    def run(impl, dtype):
      def loss(q, k, v, g, w, shared, h0):
        o, (f, f0) = ops.sse(q, k, v, g, w, args[5], num_partitions=n, impl=impl,
                             shared=shared, initial_state=h0, output_final_state=True,
                             cu_seqlens=cu, chunk_size=16, **read)
        return jnp.sum(o * cot) + jnp.sum(f) + jnp.sum(f0 * f0), (o, f, f0)
      cast = lambda tree: jax.tree.map(lambda a: a.astype(dtype), tree)
      grad = jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True)
      return jax.jit(grad)(*cast(args[:5]), cast(shared), cast(h0))

    (_, want), want_grads = run("scan", jnp.float64)
    pallas = isinstance(impl_lib.named(impl).core, ops.PallasCore)
    (_, got), grads = run(impl, jnp.float32 if pallas else jnp.float64)
  tol = 1e-5 if pallas else F64_TOL
  for name, a, r in zip(("o", "final", "final shared"), got, want):
    assert_close(a, r, tol, f"{impl} {name}")
  names = ("dq", "dk", "dv", "dg", "dweights", "dq'", "dk'", "dg'", "dv'", "dh0", "dh0'")
  for name, a, r in zip(names, jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    assert_close(a, r, tol, f"{impl} {name}")


def test_decode_continues_prefill():
  """Per-partition decode steps after a prefill give the full call's outputs."""
  n, t0 = 3, 9
  with x64():
    args, shared, h0 = _inputs(2, 13, n, 2, 8, 8, top_k=2, seed=3)
    full = functools.partial(ops.sse, num_partitions=n, output_final_state=True,
                             initial_state=h0, impl="varlen", chunk_size=16)
    o_full, _ = full(*args, shared=shared)
    _, state = full(*(a[:, :t0] for a in args), shared=tuple(s[:, :t0] for s in shared))
    for t in range(t0, 13):
      o, state = ops.sse_decode_step(*(a[:, t] for a in args), state,
                                     shared=tuple(s[:, t] for s in shared))
      assert_close(o, o_full[:, t], F64_TOL, f"o at {t}")


def test_shared_values_of_its_own_default_to_v():
  """shared=(q', k', g') uses v; (q', k', g', v) is the same call."""
  args, shared, _ = _inputs(1, 20, 4, 1, 16, 16, top_k=1, dtype=jnp.float32)
  q, k, v = (a[:, :, 0] for a in args[:3])
  plain = (q, k, v, *args[3:])
  o3, _ = ops.sse(*plain, num_partitions=4, shared=shared[:3], chunk_size=16)
  o4, _ = ops.sse(*plain, num_partitions=4, shared=shared[:3] + (v,), chunk_size=16)
  np.testing.assert_array_equal(o3, o4)
