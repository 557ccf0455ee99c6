"""The attention mixer and RoPE against numpy: GQA, sliding window, KV-cache decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sse_jax.layers import Attention, AttentionConfig, apply_rope
from sse_jax.layers.testing import random_module
from tests.op_testing import assert_close

B, T, D = 2, 24, 32


def numpy_rope(x, pos, base=10000.0):
  """Rotates the pairs (x_j, x_{j + D/2}) by the angle pos * base^(-2j / D)."""
  x = np.asarray(x, np.float64)
  half = x.shape[-1] // 2
  theta = base ** (-2.0 * np.arange(half) / x.shape[-1])
  angle = np.asarray(pos, np.float64)[None, :, None, None] * theta
  z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * angle)
  return np.concatenate([z.real, z.imag], axis=-1)


def numpy_short_conv(x, kernel):
  """silu(sum_j W_j x_{t-w+1+j}) per channel, zeros before the first token."""
  width, t = kernel.shape[0], x.shape[1]
  padded = np.concatenate([np.zeros((x.shape[0], width - 1) + x.shape[2:]), x], axis=1)
  y = sum(kernel[j] * padded[:, j:j + t] for j in range(width))
  return y / (1.0 + np.exp(-y))


def numpy_attention(layer, x, window):
  """softmax(q k^T / sqrt(Dh)) v with causal (+ window) mask, KV heads repeated; with
  the config's short conv on the q / k / v projections before RoPE."""
  c = layer.config
  x = np.asarray(x, np.float64)
  w = lambda p: np.asarray(p.kernel[...], np.float64)
  pos = np.arange(x.shape[1])
  q, k, v = (np.einsum("btd,dhk->bthk", x, w(p)) for p in (layer.q, layer.k, layer.v))
  if c.short_conv:
    q, k, v = (numpy_short_conv(a, w(cv)) for a, cv in
               zip((q, k, v), (layer.q_conv, layer.k_conv, layer.v_conv)))
  q, k = numpy_rope(q, pos), numpy_rope(k, pos)
  rep = c.num_heads // c.kv_heads
  k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
  s = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(c.head)
  allowed = pos[None, :] <= pos[:, None]
  if window is not None:
    allowed &= pos[None, :] > pos[:, None] - window
  s = np.where(allowed, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhts,bshk,hkd->btd", p, v, w(layer.o))


def make(window=None, kv_heads=2, short_conv=0):
  cfg = AttentionConfig(hidden=D, num_heads=4, num_kv_heads=kv_heads, window=window,
                        implementation="xla", short_conv=short_conv)
  return random_module(lambda: Attention(cfg, rngs=nnx.Rngs(0)), seed=4)


@nnx.jit
def call(layer, x, cache=None):
  return layer(x, cache)


@pytest.mark.parametrize("window,short_conv", [(None, 0), (5, 0), (None, 4)])
def test_attention_matches_numpy(window, short_conv):
  layer = make(window, short_conv=short_conv)
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  assert_close(call(layer, x).y, numpy_attention(layer, x, window), 1e-5,
               f"{window=}, {short_conv=}")


@pytest.mark.parametrize("short_conv", [0, 3])
def test_kv_cache_prefill_and_decode_equal_full_attention(short_conv):
  layer = make(window=6, kv_heads=1, short_conv=short_conv)
  x = jax.random.normal(jax.random.key(1), (B, T, D))
  full = call(layer, x).y
  out = call(layer, x[:, :9], layer.init_cache(B, T + 3))
  ys, cache = [out.y], out.cache
  for t in range(9, T):
    out = call(layer, x[:, t:t + 1], cache)
    ys.append(out.y)
    cache = out.cache
  assert int(cache.index) == T
  assert (cache.conv is None) == (short_conv == 0)
  assert_close(jnp.concatenate(ys, axis=1), full, 1e-5, "cached vs full")


def test_rope_matches_numpy_and_scores_depend_on_offsets_only():
  x = jax.random.normal(jax.random.key(2), (1, 6, 2, 8))
  pos = jnp.arange(6) * 7
  assert_close(apply_rope(x, pos), numpy_rope(x, pos), 1e-5, "rope")
  q, k = x[:, :1], x[:, 1:2]
  score = lambda m, n: jnp.sum(apply_rope(q, jnp.array([m])) * apply_rope(k, jnp.array([n])))
  np.testing.assert_allclose(score(3, 1), score(103, 101), rtol=1e-4)


def test_auto_implementation_is_xla_off_gpu_or_in_float32():
  from sse_jax.layers.attention import resolve_implementation
  assert resolve_implementation("auto", jnp.float32, 128) == "xla"
  assert resolve_implementation("cudnn", jnp.float32, 128) == "cudnn"
  want = "cudnn" if jax.default_backend() == "gpu" else "xla"
  assert resolve_implementation("auto", jnp.bfloat16, 128) == want


@pytest.mark.parametrize("window,packed", [(None, False), (5, False), (None, True),
                                           (5, True)])
def test_cudnn_attention_matches_xla_on_gpu(window, packed):
  """The path the GPU models take (bf16, cuDNN flash attention) against the XLA one,
  forward and gradients, at the ablation models' head dim (64); `packed`: two
  sequences in one row (cu_seqlens: a [T, T] mask, a bias for cuDNN)."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU (cuDNN); off the GPU both names resolve to the XLA path")
  cfgs = {impl: AttentionConfig(hidden=128, num_heads=2, window=window, implementation=impl)
          for impl in ("cudnn", "xla")}
  layers = {impl: random_module(lambda c=c: Attention(c, rngs=nnx.Rngs(0),
                                                      dtype=jnp.bfloat16), seed=4)
            for impl, c in cfgs.items()}
  b = 1 if packed else 2
  cu = jnp.asarray([0, 50, 128], jnp.int32) if packed else None
  x = jax.random.normal(jax.random.key(1), (b, 128, 128), jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(2), (b, 128, 128), jnp.float32)

  def value_and_grads(layer):
    loss = lambda m, x: jnp.sum(m(x, cu_seqlens=cu).y.astype(jnp.float32) * cot)
    return nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(layer, x)

  (got, (g_params, g_x)), (want, (w_params, w_x)) = (value_and_grads(layers[i])
                                                     for i in ("cudnn", "xla"))
  assert_close(got, want, 2e-2, "loss")
  assert_close(g_x, w_x, 2e-2, "dx")
  for name in ("q", "k", "v", "o"):
    assert_close(getattr(g_params, name).kernel[...], getattr(w_params, name).kernel[...],
                 2e-2, f"d{name}")


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="short_conv"):
    AttentionConfig(hidden=D, num_heads=4, short_conv=-1)


def test_kv_cache_overflow_is_an_error():
  """dynamic_update_slice would clamp a write past max_len (wrong outputs, silently):
  a concrete cache index, or more tokens than max_len, is checked instead."""
  layer = make()
  x = jax.random.normal(jax.random.key(2), (B, 6, D))
  with pytest.raises(ValueError, match="6 tokens do not fit a KV cache of max_len=4"):
    call(layer, x, layer.init_cache(B, 4))
  cache = call(layer, x[:, :4], layer.init_cache(B, 4)).cache
  with pytest.raises(ValueError, match="holds 4 of max_len=4 positions: 1 more"):
    layer(x[:, 4:5], cache)  # eagerly: under jit the index is traced (the docstring)
