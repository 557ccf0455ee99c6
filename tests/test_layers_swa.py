"""Sliding-window attention: the layer against full attention with an explicit band mask
(numpy, packed sequences included), the ring-buffer cache against the full call, the
SSE-SWA-SSE-SWA-Softmax preset (decode == full forward, one training step), cuDNN on GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sse_jax.layers import RingCache, SlidingWindowAttention, SWAConfig, apply_rope
from sse_jax.layers.testing import random_module
from sse_jax.model import LanguageModel, count_params
from sse_jax.model.presets import preset, tiny
from tests.op_testing import assert_close
from tests.test_layers_attention import numpy_attention

B, T, D = 2, 24, 32
CU = np.array([0, 1, 1, 9, 24], np.int32)  # lengths 1, 0, 8, 15: shorter and longer than W


def band_reference(layer, x, window, cu=None):
  """Full attention with an explicit band mask (the attention tests' numpy reference:
  causal, key positions within `window` of the query) over each sequence of `cu` alone
  (None: one sequence per row), in float64."""
  cu = [0, x.shape[1]] if cu is None else np.asarray(cu).tolist()
  return np.concatenate([numpy_attention(layer, x[:, a:b], window)
                         for a, b in zip(cu[:-1], cu[1:]) if b > a], axis=1)


def make(window=5, kv_heads=2, short_conv=0, dtype=jnp.float32, implementation="xla"):
  cfg = SWAConfig(hidden=D, num_heads=4, num_kv_heads=kv_heads, window=window,
                  implementation=implementation, short_conv=short_conv)
  return random_module(lambda: SlidingWindowAttention(cfg, rngs=nnx.Rngs(0), dtype=dtype),
                       seed=4)


@nnx.jit
def call(layer, x, cache=None, cu_seqlens=None):
  return layer(x, cache, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("window,short_conv,cu", [
    (5, 0, None), (1, 0, None), (5, 3, None), (T + 4, 0, None), (6, 0, CU), (6, 4, CU)])
def test_swa_equals_attention_with_an_explicit_band_mask(window, short_conv, cu):
  """Batched rows, or (cu) four sequences packed in one row: one of one token, an empty
  one, one shorter and one longer than the window; no token attends across a boundary."""
  layer = make(window, kv_heads=2 if cu is None else 1, short_conv=short_conv)
  x = jax.random.normal(jax.random.key(0), (B if cu is None else 1, T, D))
  got = call(layer, x, cu_seqlens=None if cu is None else jnp.asarray(cu)).y
  assert_close(got, band_reference(layer, x, window, cu), 1e-5,
               f"{window=}, {short_conv=}, packed={cu is not None}")


@pytest.mark.parametrize("short_conv,splits", [(0, (3,)), (3, (9, 11)), (0, (13,))])
def test_ring_cache_prefill_and_decode_equal_the_full_call(short_conv, splits):
  """Prefill chunks shorter and longer than the window, then one-token steps: the ring
  of W = 5 slots wraps around several times."""
  layer = make(window=5, short_conv=short_conv)
  x = jax.random.normal(jax.random.key(2), (B, T, D))
  full = call(layer, x).y
  cache = layer.init_cache(B, 10)  # max_len is ignored: the ring has W slots
  assert isinstance(cache, RingCache) and cache.k.shape == (B, 5, 2, D // 4)
  ys, start = [], 0
  for end in splits + tuple(range(splits[-1] + 1, T + 1)):
    out = call(layer, x[:, start:end], cache)
    ys.append(out.y)
    cache, start = out.cache, end
  assert int(cache.index) == T and cache.k.shape[1] == 5
  assert (cache.conv is None) == (short_conv == 0)
  assert_close(jnp.concatenate(ys, axis=1), full, 1e-5, "cached vs full")


def test_window_is_required():
  with pytest.raises(ValueError, match=r"SWAConfig.window=None must be a positive int"):
    SWAConfig(hidden=D, num_heads=4, window=None)
  with pytest.raises(ValueError, match=r"window=0"):
    SWAConfig(hidden=D, num_heads=4, window=0)
  layer = make()
  with pytest.raises(ValueError, match="cannot be combined with a cache"):
    layer(jnp.zeros((1, 4, D)), layer.init_cache(1), cu_seqlens=jnp.asarray([0, 4]))


# --- the SSE-SWA-SSE-SWA-Softmax hybrid -----------------------------------------------

def test_hybrid_preset_pattern_and_sizes():
  assert preset("600m", "sse_swa").pattern == "SWSWA" * 4 + "SWSW"
  assert preset("125m", "sse_swa").pattern == "SWSWASWSWASW"
  assert tiny("sse_swa").pattern == "SWA" and tiny("sse_swa").swa.window == 8
  assert preset("600m", "sse_swa").swa.window == 512
  count = count_params(preset("600m", "sse_swa"))
  assert count.active == count.total and 0.9 < count.non_embedding / 300e6 < 1.0, count


def model(seed=0):
  return random_module(lambda: LanguageModel(tiny("sse_swa"), rngs=nnx.Rngs(0)), seed, 0.1)


@nnx.jit
def forward(m, toks, cache=None):
  return m(toks, cache=cache)


def decode_logits(m, toks, prefill: int):
  """The logits of a prefill of `prefill` tokens from a fresh cache, then one-token
  decode steps to the end of toks [B, T]."""
  cache = m.init_cache(toks.shape[0], toks.shape[1])
  out = forward(m, toks[:, :prefill], cache)
  logits, cache = [out.logits], out.cache
  for t in range(prefill, toks.shape[1]):
    out = forward(m, toks[:, t:t + 1], cache)
    logits.append(out.logits)
    cache = out.cache
  return jnp.concatenate(logits, axis=1)


def test_hybrid_model_decode_equals_the_full_forward():
  """SSE, SWA (window 8) and attention layers: a prefill of 11 tokens, then 17 decode
  steps, reproduce the full forward's logits."""
  m = model()
  toks = jax.random.randint(jax.random.key(5), (B, 28), 0, 256)
  assert_close(decode_logits(m, toks, 11), forward(m, toks).logits, 1e-4, "decode vs full")


def lm_loss(m, toks):
  """(next-token cross-entropy + the routers' balance loss, the model output)."""
  out = m(toks[:, :-1])
  ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, toks[:, 1:])
  return jnp.mean(ce) + out.aux_loss, out


@nnx.jit
def train_step(m, optimizer, toks):
  """One Adam step: (the loss before it, the model output, the gradients)."""
  (loss, out), grads = nnx.value_and_grad(lm_loss, has_aux=True)(m, toks)
  optimizer.update(m, grads)
  return loss, out, grads


def loss_after(m, toks) -> float:
  return float(nnx.jit(lambda m: lm_loss(m, toks)[0])(m))


def test_hybrid_model_one_training_step():
  m = model(1)
  toks = jax.random.randint(jax.random.key(6), (B, T + 1), 0, 256)
  optimizer = nnx.Optimizer(m, optax.adam(3e-3), wrt=nnx.Param)
  loss, _, grads = train_step(m, optimizer, toks)
  swa = grads["blocks"][1]["mixer"]
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  assert np.abs(swa["q"]["kernel"][...]).max() > 0
  assert loss_after(m, toks) < float(loss)


# --- GPU ------------------------------------------------------------------------------

@pytest.mark.parametrize("packed", [False, True])
def test_cudnn_sliding_window_matches_band_mask_on_gpu(packed):
  """The GPU path (bf16, cuDNN flash attention with local_window_size) against XLA with
  an explicit band mask, forward and input gradients."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU (cuDNN)")
  cfg = SWAConfig(hidden=128, num_heads=2, window=16, implementation="cudnn")
  layer = random_module(lambda: SlidingWindowAttention(cfg, rngs=nnx.Rngs(0),
                                                       dtype=jnp.bfloat16), seed=4)
  b = 1 if packed else 2
  cu = jnp.asarray([0, 50, 128], jnp.int32) if packed else None
  x = jax.random.normal(jax.random.key(1), (b, 128, 128), jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(2), (b, 128, 128), jnp.float32)
  seq = np.searchsorted(np.asarray([50, 128] if packed else [128]), np.arange(128),
                        side="right")
  i, j = np.arange(128)[:, None], np.arange(128)[None, :]
  band = jnp.asarray((seq[:, None] == seq[None, :]) & (j <= i) & (j > i - 16))

  def band_masked(m, x):  # the layer's projections, XLA attention with the explicit mask
    pos = (jnp.arange(128) - jnp.asarray(np.r_[0, 50])[seq]) if packed else jnp.arange(128)
    q, k = apply_rope(m.q(x), pos), apply_rope(m.k(x), pos)
    o = jax.nn.dot_product_attention(q, k, m.v(x), mask=band[None, None],
                                     implementation="xla")
    return m.o(o)

  def grad_x(f):
    loss = lambda x: jnp.sum(f(x).astype(jnp.float32) * cot)
    return jax.jit(jax.value_and_grad(loss))(x)

  (got, g_got), (want, g_want) = (grad_x(lambda x: layer(x, cu_seqlens=cu).y),
                                  grad_x(lambda x: band_masked(layer, x)))
  assert_close(got, want, 2e-2, "loss")
  assert_close(g_got, g_want, 2e-2, "dx")
