"""The SSE layer with per-partition projections (share_partition_params=False): every
SSE impl gives the same output and parameter gradients (float64 against the scan; the
Pallas core in interpret mode), the scan matches the former path (masked copies folded
into heads, one dense GLA scan), chunked prefill then decode steps reproduce the full
call, and the cache layout converts both ways."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sse_jax import ops
from sse_jax.layers import SSE, SSEConfig
from sse_jax.layers import per_partition
from sse_jax.layers.testing import random_module, router_margin
from sse_jax.ops.sse import make_routing, spread
from tests.op_testing import assert_close, x64
from tests.test_layers_sse import slots

B, T, D, H = 2, 20, 32, 2  # head dims 16: ones the Pallas kernels take
BASE = SSEConfig(hidden=D, num_heads=H, chunk_size=16, share_partition_params=False,
                 num_partitions=3, top_k=2, short_conv=2, impl="scan")
# The chunked XLA core's within-chunk decay ratios cost float64 a few digits (as in
# tests/test_ops_sse_per_partition.py).
F64_TOL = 1e-6
CASES = {
    "shared_both": {},
    "read_set_write_gate_own_decay": dict(num_readers=3, gate_placement="write",
                                          lora_target="routed"),
    "no_shared_read_gate": dict(shared_partition=False, top_k=1, gate_placement="read"),
}


def make(config, dtype=jnp.float32, seed=0):
  return random_module(lambda: SSE(config, rngs=nnx.Rngs(0), dtype=dtype,
                                   param_dtype=dtype), seed)


def inputs(dtype=jnp.float32, seed=3, t=T):
  return jax.random.normal(jax.random.key(seed), (B, t, D), dtype)


@nnx.jit
def output_and_grads(layer, x):
  """(y, d loss / d params) for loss = sum(y * a fixed random cotangent) + aux."""
  cot = jax.random.normal(jax.random.key(5), x.shape, x.dtype)

  def loss(m):
    out = m(x)
    return jnp.sum(out.y * cot) + out.aux_loss, out.y

  (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(layer)
  return y, grads


def _with_impl(layer, impl):
  """`layer` with config.impl replaced (the same parameters): a fresh module would draw
  other random values."""
  graph, state = nnx.split(layer)
  other = nnx.merge(graph, state)
  other.config = dataclasses.replace(layer.config, impl=impl)
  return other


def _assert_same(got, want, tol, what):
  y, grads = got
  y_ref, grads_ref = want
  assert_close(y, y_ref, tol, f"{what}: y")
  flat_ref = dict(nnx.to_flat_state(grads_ref))
  for path, g in nnx.to_flat_state(grads):
    g, g_ref = g.get_value(), flat_ref[path].get_value()
    if np.any(g_ref):
      assert_close(g, g_ref, tol, f"{what}: d/d {'.'.join(map(str, path))}")
    else:  # a parameter the loss does not reach (an unread slot's projection)
      np.testing.assert_array_equal(g, 0, f"{what}: d/d {path}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_xla_impls_match_scan_float64(case):
  with x64():
    layer = make(dataclasses.replace(BASE, **CASES[case]), jnp.float64)
    x = inputs(jnp.float64)
    assert router_margin(layer.router(x).probs, layer.config.writers) > 1e-4
    want = output_and_grads(layer, x)
    for impl in ("loop", "masking", "varlen"):
      _assert_same(output_and_grads(_with_impl(layer, impl), x), want, F64_TOL,
                   f"{case} {impl}")


@pytest.mark.parametrize("impl", ["pallas_masking", "pallas_varlen"])
def test_pallas_impls_match_scan(impl):
  """The Pallas core (interpret mode off the GPU) computes in fp32: float64 layer,
  fp32 kernels, against the float64 scan."""
  with x64():
    cfg = dataclasses.replace(BASE, **CASES["read_set_write_gate_own_decay"])
    layer = make(cfg, jnp.float64)
    x = inputs(jnp.float64, t=18)
    want = output_and_grads(layer, x)
    _assert_same(output_and_grads(_with_impl(layer, impl), x), want, 2e-5, impl)


def _folded_gla(layer, x):
  """The layer's output before the head by the former path: masked per-partition
  copies (q r, k w, g 1[written]; the shared slot always on with its own decay) folded
  into P H heads, one dense GLA scan, the slots summed."""
  c = layer.config
  n = c.num_partitions
  q, k, v, gs, rt = slots(layer, x)  # [B, T, P, H, D]
  r = make_routing(rt.write_weights, rt.write_indices, rt.read_weights, rt.read_indices,
                   ops.Gate(c.gate_placement))
  written, ww = spread(r.write_idx, r.write_w, n)
  _, rw = spread(r.read_idx, r.read_w, n)
  if c.shared_partition:
    one = jnp.ones(written.shape[:2] + (1,), bool)
    written, ww, rw = (jnp.concatenate([z, one.astype(z.dtype)], axis=2)
                       for z in (written, ww, rw))
  col = lambda w: w[..., None, None].astype(gs.dtype)
  b, t, p, h = q.shape[:4]
  fold = lambda z: z.reshape(b, t, p * h, z.shape[-1])
  o, _ = ops.gla(fold(q * col(rw)), fold(k * col(ww)), fold(v), fold(gs * col(written)),
                 impl="scan")
  return o.reshape(b, t, p, h, -1).sum(axis=2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_scan_matches_the_former_folded_gla_path_float64(case):
  with x64():
    layer = make(dataclasses.replace(BASE, **CASES[case]), jnp.float64)
    x = inputs(jnp.float64)
    got = nnx.jit(lambda m, x: m.attend(x)[0])(layer, x)
    # both scans, summed in other orders: float64 rounding apart
    assert_close(got, nnx.jit(_folded_gla)(layer, x), 1e-10, case)


@nnx.jit
def cached(layer, x, cache):
  return layer(x, cache)


@pytest.mark.parametrize("case, impl", [("shared_both", "varlen"),
                                        ("read_set_write_gate_own_decay", "masking"),
                                        ("no_shared_read_gate", "loop"),
                                        ("shared_both", "pallas_varlen")])
def test_prefill_then_decode_equals_full_call(case, impl):
  layer = make(dataclasses.replace(BASE, impl=impl, **CASES[case]))
  x = inputs(seed=11, t=22)
  assert router_margin(layer.router(x).probs, layer.config.writers) > 1e-4
  full = cached(layer, x, layer.init_cache(B))
  # a chunked prefill of 16 tokens, then one decode step per token
  outs = [cached(layer, x[:, :16], layer.init_cache(B))]
  for t in range(16, 22):
    outs.append(cached(layer, x[:, t:t + 1], outs[-1].cache))
  cache = outs[-1].cache
  assert_close(jnp.concatenate([o.y for o in outs], axis=1), full.y, 1e-5,
               f"{case} {impl}: y")
  assert cache.state.shape == layer.zero_state(B).shape
  assert_close(cache.state, full.cache.state, 1e-5, f"{case} {impl}: state")
  no_cache = nnx.jit(lambda m, x: m(x).y)(layer, x)
  assert_close(no_cache, full.y, 1e-5, f"{case} {impl}: with vs without cache")


@pytest.mark.parametrize("shared", [True, False])
def test_fold_unfold_round_trip(shared):
  n, h = 3, 2
  p = n + int(shared)
  state = jnp.arange(B * p * h * 2 * 3, dtype=jnp.float32).reshape(B, p * h, 2, 3)
  ops_state = per_partition.unfold(state, n, shared)
  routed = ops_state[0] if shared else ops_state
  assert routed.shape == (B, n, h, 2, 3)
  # slot-major: routed partition i, head j is folded head i H + j
  np.testing.assert_array_equal(routed[:, 1, 0], state[:, 1 * h + 0])
  if shared:
    assert ops_state[1].shape == (B, h, 2, 3)
    np.testing.assert_array_equal(ops_state[1][:, 1], state[:, n * h + 1])
  np.testing.assert_array_equal(per_partition.fold(ops_state, shared), state)
