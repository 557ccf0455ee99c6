"""The SSE and GLA mixers: implementations agree, a float64 numpy recurrence agrees,
the degenerate cases hold, gradients reach the router exactly where they should,
decoding from a cache reproduces the full sequence, bf16 compute works."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sse_jax.layers import GLA, GLAConfig, SSE, SSEConfig, activate
from sse_jax.layers.testing import random_module, router_margin
from tests.op_testing import assert_close

B, T, D, H = 2, 40, 32, 2
BASE = SSEConfig(hidden=D, num_heads=H, chunk_size=16, lora_rank=8)


def make(config, seed=0, **kw):
  cls = SSE if isinstance(config, SSEConfig) else GLA
  return random_module(lambda: cls(config, rngs=nnx.Rngs(0), **kw), seed)


def inputs(seed=3, t=T):
  return jax.random.normal(jax.random.key(seed), (B, t, D))


@nnx.jit
def forward(layer, x):
  return layer(x)


@nnx.jit
def attend(layer, x):
  return layer.attend(x)[0]


def copy_params(src, dst):
  """dst's parameters := src's, for every path dst has (src may have more: a router)."""
  src_flat = dict(nnx.to_flat_state(nnx.state(src, nnx.Param)))
  dst_state = nnx.state(dst, nnx.Param)
  for path, var in nnx.to_flat_state(dst_state):
    var.set_value(src_flat[path].get_value())
  nnx.update(dst, dst_state)


# --- implementations -------------------------------------------------------------

IMPL_CFG = dataclasses.replace(BASE, short_conv=4, lora_target="routed", num_partitions=5,
                               top_k=2, num_readers=3, gate_placement="write")


def test_impls_give_the_same_layer_output_and_loss():
  x = inputs()
  outs = {impl: forward(make(dataclasses.replace(IMPL_CFG, impl=impl)), x)
          for impl in ("scan", "masking", "varlen", "loop")}
  for impl in ("masking", "varlen", "loop"):
    assert_close(outs[impl].y, outs["scan"].y, 1e-5, f"{impl} vs scan")
  # The load-balance loss N/k sum_i f_i p_i and the usage f_i, from the router alone.
  r = make(IMPL_CFG).router(x)
  f = jax.nn.one_hot(r.write_indices, 5).sum(-2).reshape(-1, 5).mean(0)
  p = r.probs.reshape(-1, 5).mean(0)
  np.testing.assert_allclose(outs["varlen"].aux_loss, 5 / 2 * np.sum(f * p), rtol=1e-6)
  np.testing.assert_allclose(outs["varlen"].usage, f, rtol=1e-6)
  np.testing.assert_allclose(np.sum(f), 2.0, rtol=1e-6)


# --- an independent float64 recurrence -------------------------------------------

def numpy_sse(q, k, v, g, write_w, read_w, written, scale):
  """Per-token recurrence over P per-partition inputs, float64.

  q, k, g: [B, T, P, H, Dk]; v: [B, T, P, H, Dv]; write_w, read_w, written: [B, T, P]
  (0 where not selected). S^p <- diag(exp g)^[written] S^p + w k^T v; o = sum r q S.
  """
  q, k, v, g, write_w, read_w, written = (
      np.asarray(a, np.float64) for a in (q, k, v, g, write_w, read_w, written))
  b, t, p, h, dk = q.shape
  s = np.zeros((b, p, h, dk, v.shape[-1]))
  out = np.zeros((b, t, h, v.shape[-1]))
  for i in range(t):
    decay = np.where(written[:, i, :, None, None, None] > 0,
                     np.exp(g[:, i])[..., None], 1.0)
    kv = np.einsum("bphk,bphv->bphkv", k[:, i], v[:, i])
    s = decay * s + write_w[:, i, :, None, None, None] * kv
    out[:, i] = np.einsum("bp,bphk,bphkv->bhv", read_w[:, i], scale * q[:, i], s)
  return out


def selection(indices, weights, n):
  """([B, T, N] weights with 0 where unselected, [B, T, N] 0/1) from top-k outputs."""
  idx, w = np.asarray(indices), np.asarray(weights, np.float64)
  sel = np.zeros(idx.shape[:2] + (n,))
  wt = np.zeros_like(sel)
  for j in range(idx.shape[-1]):
    np.put_along_axis(sel, idx[..., j:j + 1], 1.0, axis=-1)
    np.put_along_axis(wt, idx[..., j:j + 1], w[..., j:j + 1], axis=-1)
  return wt, sel


def slots(layer, x):
  """The layer's own q, k, v, g per slot [B, T, P, H, D] (P = N, + 1 for the shared
  partition), taken from its submodules, and the router output."""
  c = layer.config
  n = c.num_partitions
  qp, kp, vp, _ = layer.qkv(x)
  q, k, v = (activate(a, z) for a, z in zip(
      (c.query_activation, c.key_activation, c.value_activation), (qp, kp, vp)))
  g = layer.decay(x)
  g0 = g if layer.shared_decay is None else layer.shared_decay(x)
  if not c.share_partition_params:  # projections already [B, T, P, H, D]
    gs = [g] * n + [g0] * c.shared_partition
    return q, k, v, jnp.stack(gs, axis=2), layer.router(x)
  rep = lambda z: [z] * n
  qs, ks, vs, gs = rep(q), rep(k), rep(v), rep(g)
  if c.shared_partition:
    q0, k0 = q, k
    if layer.lora_q is not None:
      adapted = (activate(c.query_activation, qp + layer.lora_q(x)),
                 activate(c.key_activation, kp + layer.lora_k(x)))
      if c.lora_target == "shared":
        q0, k0 = adapted
      else:
        qs, ks = [adapted[0]] * n, [adapted[1]] * n
    qs, ks, vs, gs = qs + [q0], ks + [k0], vs + [v], gs + [g0]
  stack = lambda zs: jnp.stack(zs, axis=2)
  return stack(qs), stack(ks), stack(vs), stack(gs), layer.router(x)


REFERENCE_CASES = {
    "shared_params_lora_shared_both": dict(num_partitions=4, top_k=2),
    "shared_params_lora_routed_read_set": dict(num_partitions=4, top_k=1, num_readers=2,
                                               gate_placement="read",
                                               lora_target="routed", impl="scan"),
    "per_partition_read_set_none": dict(share_partition_params=False, num_partitions=4,
                                        top_k=2, num_readers=1, gate_placement="none",
                                        lora_target="routed"),
}


@nnx.jit
def attend_and_slots(layer, x):
  return layer.attend(x)[0], slots(layer, x)


@pytest.mark.parametrize("case", sorted(REFERENCE_CASES))
def test_attend_matches_numpy_recurrence(case):
  cfg = dataclasses.replace(BASE, short_conv=3, **REFERENCE_CASES[case])
  layer, x = make(cfg), inputs(t=24)
  o, (q, k, v, g, r) = attend_and_slots(layer, x)
  n = cfg.num_partitions
  wt, written = selection(r.write_indices, r.write_weights, n)
  rt, read = selection(*((r.read_indices, r.read_weights) if r.read_indices is not None
                         else (r.write_indices, r.write_weights)), n)
  ww = wt if cfg.gate_placement in ("both", "write") else written
  rw = rt if cfg.gate_placement in ("both", "read") else read
  if cfg.shared_partition:  # the last slot: always on, weight 1
    one = np.ones(ww.shape[:2] + (1,))
    ww, rw, written = (np.concatenate([z, one], axis=2) for z in (ww, rw, written))
  want = numpy_sse(q, k, v, g, ww, rw, written, cfg.head_k ** -0.5)
  assert_close(o, want, 1e-5, case)


# --- degenerate cases ------------------------------------------------------------

@nnx.jit
def router_grads(layer, x):
  """(output, d task / d W_e, d aux / d W_e) with task = mse(y, a fixed target)."""
  target = jax.random.normal(jax.random.key(7), x.shape)

  def task(m):
    out = m(x)
    return jnp.mean((out.y - target) ** 2), out

  (_, out), grads = nnx.value_and_grad(task, has_aux=True)(layer)
  aux_grads = nnx.grad(lambda m: m(x).aux_loss)(layer)
  return out, grads["router"]["kernel"][...], aux_grads["router"]["kernel"][...]


def test_one_partition_without_shared_equals_gla():
  common = dict(hidden=D, num_heads=H, chunk_size=16, key_activation="softmax",
                short_conv=4, value_activation="silu")
  sse = make(SSEConfig(num_partitions=1, top_k=1, shared_partition=False, impl="scan",
                       **common))
  gla = make(GLAConfig(**common), seed=9)  # chunked: a different code path
  copy_params(sse, gla)
  x = inputs()
  out, router_grad, _ = router_grads(sse, x)
  assert_close(out.y, forward(gla, x).y, 1e-6, "N=1 SSE vs GLA")
  np.testing.assert_allclose(out.aux_loss, 1.0, rtol=1e-6)
  np.testing.assert_allclose(out.usage, [1.0])
  assert not np.any(router_grad)


def test_top_k_equal_n_gate_none_is_n_times_gla():
  n = 3
  sse = make(dataclasses.replace(BASE, num_partitions=n, top_k=n, gate_placement="none",
                                 shared_partition=False, impl="scan"))
  gla = make(GLAConfig(hidden=D, num_heads=H, chunk_size=16, key_activation="softmax",
                       impl="scan"), seed=1)
  copy_params(sse, gla)
  x = inputs()
  assert_close(attend(sse, x), n * attend(gla, x), 1e-5, "top_k == N, gate none")


# --- router gradients ------------------------------------------------------------
# (impl "scan": the router's gradient enters through the op's weights, which every impl
# differentiates identically -- see tests/test_ops_sse.py; the model tests use varlen.)

def test_gate_both_sends_task_gradient_to_the_router():
  _, grad, _ = router_grads(make(dataclasses.replace(BASE, impl="scan")), inputs(t=24))
  assert np.abs(grad).max() > 1e-6


@pytest.mark.parametrize("per_partition", [False, True])
def test_gate_none_router_gets_no_gradient_from_the_task_loss(per_partition):
  cfg = dataclasses.replace(BASE, gate_placement="none", top_k=2, impl="scan",
                            share_partition_params=not per_partition)
  _, task_grad, aux_grad = router_grads(make(cfg), inputs(t=24))
  assert not np.any(task_grad)            # exactly zero
  assert np.abs(aux_grad).max() > 0       # the load-balance loss still trains W_e


# --- decoding from a cache -------------------------------------------------------

DECODE_CASES = {
    "sse_routed_lora_read_set": dataclasses.replace(
        BASE, short_conv=4, lora_target="routed", num_readers=2, gate_placement="write"),
    "sse_per_partition": dataclasses.replace(BASE, share_partition_params=False,
                                             short_conv=2, top_k=2),
    "sse_gate_read": dataclasses.replace(BASE, short_conv=4, gate_placement="read", top_k=2),
    "sse_gate_none": dataclasses.replace(BASE, gate_placement="none"),
    "gla_conv": GLAConfig(hidden=D, num_heads=H, chunk_size=16, short_conv=4),
}


@nnx.jit
def cached(layer, x, cache):
  return layer(x, cache)


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_prefill_then_decode_equals_full_sequence(case):
  cfg = DECODE_CASES[case]
  layer, x = make(cfg), inputs(seed=11, t=30)
  full = forward(layer, x).y
  if isinstance(cfg, SSEConfig):
    assert router_margin(layer.router(x).probs, cfg.writers) > 1e-4
  out = cached(layer, x[:, :17], layer.init_cache(B))
  ys, cache = [out.y], out.cache
  for t in range(17, 30):
    out = cached(layer, x[:, t:t + 1], cache)
    ys.append(out.y)
    cache = out.cache
  assert_close(jnp.concatenate(ys, axis=1), full, 1e-5, case)


# --- dtypes ----------------------------------------------------------------------

def test_bf16_compute_with_fp32_params():
  cfg = dataclasses.replace(BASE, short_conv=4)
  x = inputs()
  bf16 = make(cfg, dtype=jnp.bfloat16)
  out = forward(bf16, x)
  assert out.y.dtype == jnp.bfloat16 and out.aux_loss.dtype == jnp.float32
  assert bf16.qkv.q_proj.kernel[...].dtype == jnp.float32
  assert bf16.router.kernel[...].dtype == jnp.float32
  # The router sees the same float32 input, so routing is identical; the rest carries
  # bf16 rounding (8-bit mantissa) through ~10 matmuls.
  assert_close(out.y.astype(jnp.float32), forward(make(cfg), x).y, 3e-2, "bf16 vs fp32")


def test_load_balance_loss_by_hand():
  """N / k * sum_i f_i p_i with f the fraction of tokens routed to i and p the mean
  probability: probs [.7, .2, .1] and [.1, .3, .6] route (k = 1) to 0 and 2, so
  f = [.5, 0, .5], p = [.4, .25, .35], aux = 3 * (.5 * .4 + .5 * .35) = 1.125."""
  from sse_jax.layers import router  # pylint: disable=g-import-not-at-top
  probs = jnp.asarray([[[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]])
  _, idx = router.top_k(probs, 1)
  aux, f = router.load_balance(probs, idx, 3)
  np.testing.assert_allclose(f, [0.5, 0.0, 0.5])
  np.testing.assert_allclose(aux, 1.125, rtol=1e-6)
  _, idx2 = router.top_k(probs, 2)  # k = 2: {0, 1} and {2, 1}: f = [.5, 1, .5]
  aux2, f2 = router.load_balance(probs, idx2, 3)
  np.testing.assert_allclose(f2, [0.5, 1.0, 0.5])
  np.testing.assert_allclose(aux2, 1.5 * (0.5 * 0.4 + 1.0 * 0.25 + 0.5 * 0.35), rtol=1e-6)


def test_top_k_weights_and_their_gradient_are_the_probabilities_picked():
  """top_k's weights are the selected probabilities, bit for bit, and their gradient
  lands on exactly those entries (it sums one-hot terms rather than gathering, so the
  backward pass needs no scatter); ties keep the lower index first."""
  from sse_jax.layers import router  # pylint: disable=g-import-not-at-top
  probs = jax.nn.softmax(jax.random.normal(jax.random.key(3), (2, 9, 5)), axis=-1)
  probs = probs.at[0, 0].set(jnp.asarray([0.3, 0.3, 0.2, 0.1, 0.1]))  # a tie
  for k in (1, 2, 5):
    w, idx = router.top_k(probs, k)
    np.testing.assert_array_equal(idx, jax.lax.top_k(probs, k)[1])
    np.testing.assert_array_equal(w, np.take_along_axis(np.asarray(probs), idx, -1))
    coef = jnp.arange(1.0, k + 1)
    grad = jax.grad(lambda p: jnp.sum(router.top_k(p, k)[0] * coef))(probs)
    expected = np.zeros(probs.shape, np.float32)
    np.put_along_axis(expected, np.asarray(idx), np.broadcast_to(coef, idx.shape), -1)
    np.testing.assert_array_equal(grad, expected)
