"""fla's entry points (`ops.chunk_gla`, `ops.fused_recurrent_gla`) against `ops.gla`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sse_jax import ops
from tests.op_testing import assert_close, random_qkvg, x64

F64_TOL = 1e-10


def _inputs(b=1, t=40, h=2, d=16):
  x = random_qkvg(jax.random.PRNGKey(0), b, t, h, d, d)
  h0 = jax.random.normal(jax.random.PRNGKey(1), (2, h, d, d))
  return x, h0


def test_chunk_gla_takes_fla_positional_order():
  """(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens), packed."""
  x, h0 = _inputs()
  cu = jnp.asarray([0, 15, 40], jnp.int32)
  o, final = ops.chunk_gla(*x, 0.3, h0, True, cu)
  want, want_final = ops.gla(*x, scale=0.3, initial_state=h0, output_final_state=True,
                             cu_seqlens=cu)
  np.testing.assert_array_equal(o, want)
  np.testing.assert_array_equal(final, want_final)
  o, final = ops.chunk_gla(*x)  # fla's defaults: scale Dk ** -0.5, no final state
  np.testing.assert_array_equal(o, ops.gla(*x)[0])
  assert final is None


def test_fused_recurrent_gla_takes_fla_positional_order():
  """(q, k, v, gk, gv, scale, initial_state, output_final_state, reverse), cu_seqlens
  by keyword; the step-by-step recurrence equals the chunked op (in float64: on a GPU
  XLA's float32 matmuls default to TF32)."""
  with x64():
    x, h0 = _inputs(b=2)
    x, h0 = type(x)(*(a.astype(jnp.float64) for a in x)), h0.astype(jnp.float64)
    o, final = ops.fused_recurrent_gla(x.q, x.k, x.v, x.g, None, 0.3, h0, True)
    want, want_final = ops.gla(*x, scale=0.3, initial_state=h0, output_final_state=True)
    assert_close(o, want, F64_TOL, "o")
    assert_close(final, want_final, F64_TOL, "final")
    cu = jnp.asarray([0, 15, 40], jnp.int32)
    packed = tuple(a[:1] for a in x)
    o, _ = ops.fused_recurrent_gla(*packed, cu_seqlens=cu)
    assert_close(o, ops.gla(*packed, cu_seqlens=cu)[0], F64_TOL, "o packed")
    o, _ = ops.fused_recurrent_gla(x.q, x.k, x.v)  # gk None: no decay
    assert_close(o, ops.gla(x.q, x.k, x.v, jnp.zeros_like(x.k))[0], F64_TOL,
                 "o without gk")


@pytest.mark.parametrize("kwargs, match", [
    (dict(gv=jnp.zeros((1, 40, 2, 16))), "gv .* is not supported"),
    (dict(reverse=True), "reverse=True is not supported"),
    (dict(state_v_first=True), "state_v_first=True is not supported"),
])
def test_fused_recurrent_gla_refuses_what_gla_lacks(kwargs, match):
  x, _ = _inputs()
  with pytest.raises(ValueError, match=match) as e:
    ops.fused_recurrent_gla(x.q, x.k, x.v, x.g, **kwargs)
  assert "\n" not in str(e.value)
