"""Row-sparse GLA, the paper's Eq. (7)-(8) (Appendix A, Fig. 9): with "topk-softmax"
keys a state row outside the key's top-k is left untouched (no decay, no write).

The GLA layer against a literal float64 recurrence built from the layer's own q, k, v,
g; decoding against the full call; the key's row mask against its activation; dense key
maps unchanged (plain g).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sse_jax.layers import GLA, GLAConfig, activate
from sse_jax.layers import features
from sse_jax.layers.gla import run_gla
from sse_jax.layers.linear import RecurrentCache
from sse_jax.layers.testing import random_module
from tests.op_testing import assert_close, rel_err, x64

B, T, D, H = 2, 24, 32, 2   # Dk = Dv = 16: k = 4 rows kept per key
F64_TOL = 1e-12             # float64 layer vs float64 recurrence: rounding only
# gate_normalizer 1: per-step decays exp(g) ~ 0.6-0.8, so a masked row that wrongly
# decayed would be far off after a few tokens.
SPARSE = GLAConfig(hidden=D, num_heads=H, chunk_size=16, key_activation="topk-softmax",
                   gate_normalizer=1.0)


def make(config, dtype=jnp.float32, seed=0):
  return random_module(lambda: GLA(config, rngs=nnx.Rngs(0), dtype=dtype,
                                   param_dtype=dtype), seed)


def inputs(seed=3, dtype=jnp.float32, t=T):
  return jax.random.normal(jax.random.key(seed), (B, t, D), dtype)


def random_state(config, dtype, seed=5):
  return jax.random.normal(jax.random.key(seed),
                           (B, config.num_heads, config.head_k, config.head_v), dtype)


def own_inputs(layer, x):
  """The layer's own q, k (after the feature maps), v, log decay g, and the raw key
  projection k_raw it selects rows from: float64 numpy, q, k, g, k_raw [B, T, H, Dk],
  v [B, T, H, Dv]."""
  c = layer.config
  q, k_raw, v, _ = layer.qkv(x)
  arrays = (activate(c.query_activation, q), activate(c.key_activation, k_raw),
            activate(c.value_activation, v), layer.decay(x), k_raw)
  return tuple(np.asarray(a, np.float64) for a in arrays)


def numpy_top_rows(k_raw):
  """bool [..., Dk]: the max(1, Dk // 4) largest entries of each key (Eq. (7))."""
  n = max(1, k_raw.shape[-1] // 4)
  keep = k_raw >= np.sort(k_raw, -1)[..., -n][..., None]
  assert np.all(keep.sum(-1) == n), "ties in the test data"
  return keep


def numpy_gla(q, k, v, g, keep, h0):
  """Eq. (7)-(8) one token at a time, in float64:

      S_t[i] = exp(g_t[i]) S_{t-1}[i] + k_t[i] v_t   where keep_t[i]
      S_t[i] = S_{t-1}[i]                            elsewhere
      o_t = Dk^-1/2 q_t S_t

  q, k, g, keep [B, T, H, Dk]; v [B, T, H, Dv]; h0 [B, H, Dk, Dv]. keep all True is
  plain GLA. Returns (o [B, T, H, Dv], S_T).
  """
  s, outs = h0, []
  for t in range(q.shape[1]):
    updated = np.exp(g[:, t])[..., None] * s + k[:, t, ..., None] * v[:, t, :, None, :]
    s = np.where(keep[:, t, ..., None], updated, s)
    outs.append(np.einsum("bhk,bhkv->bhv", q[:, t], s) / np.sqrt(q.shape[-1]))
  return np.stack(outs, 1), s


# --- (a) the layer is Eq. (7)-(8) ----------------------------------------------------

@pytest.mark.parametrize("impl", ["scan", "chunk"])
@pytest.mark.parametrize("with_state", [False, True], ids=["fresh", "from_state"])
def test_layer_matches_row_sparse_recurrence_float64(impl, with_state):
  cfg = dataclasses.replace(SPARSE, impl=impl)
  with x64():
    layer, x = make(cfg, jnp.float64), inputs(dtype=jnp.float64)
    h0 = (random_state(cfg, jnp.float64) if with_state
          else jnp.zeros((B, H, cfg.head_k, cfg.head_v), jnp.float64))
    if with_state:  # chunked prefill from a cache
      o, cache, _ = layer.attend(x, RecurrentCache(h0, None))
      final = cache.state
    else:
      o, final = layer.attend(x)[0], None
    q, k, v, g, k_raw = own_inputs(layer, x)
  keep = numpy_top_rows(k_raw)
  assert np.all(k[~keep] == 0) and np.all(k[keep] > 0)
  h0 = np.asarray(h0, np.float64)
  want_o, want_s = numpy_gla(q, k, v, g, keep, h0)
  assert o.dtype == jnp.float64
  assert_close(o, want_o, F64_TOL, f"{impl} output")
  if final is not None:
    assert_close(final, want_s, F64_TOL, f"{impl} final state")
  # The case discriminates: decaying the masked rows (plain GLA with these q, k, v, g,
  # what the layer computed before the mask) is far outside the tolerance.
  plain_o, plain_s = numpy_gla(q, k, v, g, np.ones_like(keep), h0)
  assert rel_err(plain_o, want_o) > 1e-2
  assert rel_err(plain_s, want_s) > 1e-2


# --- (b) decoding --------------------------------------------------------------------

@nnx.jit
def cached(layer, x, cache):
  return layer(x, cache)


def test_prefill_then_decode_equals_full_call():
  cfg = dataclasses.replace(SPARSE, short_conv=4)
  with x64():
    layer, x = make(cfg, jnp.float64, seed=1), inputs(seed=7, dtype=jnp.float64)
    start = layer.init_cache(B)._replace(state=random_state(cfg, jnp.float64, seed=8))
    full = cached(layer, x, start)
    out = cached(layer, x[:, :10], start)
    ys, cache = [out.y], out.cache
    for t in range(10, T):
      out = cached(layer, x[:, t:t + 1], cache)
      ys.append(out.y)
      cache = out.cache
    assert_close(jnp.concatenate(ys, axis=1), full.y, F64_TOL, "decode vs full")
    assert_close(cache.state, full.cache.state, F64_TOL, "decode vs full: final state")


# --- (c) the key's row mask ----------------------------------------------------------

@pytest.mark.parametrize("dk", [1, 2, 3, 4, 7, 16, 64])
def test_mask_agrees_with_activation(dk):
  x = jax.random.normal(jax.random.key(dk), (5, 3, dk))
  mask = np.asarray(features.row_mask("topk-softmax", x))
  y = np.asarray(activate("topk-softmax", x))
  assert mask.dtype == bool and mask.shape == x.shape
  np.testing.assert_array_equal(y != 0, mask)
  np.testing.assert_array_equal(mask.sum(-1), max(1, dk // 4))
  xb = x.astype(jnp.bfloat16)  # selected in float32 like the activation
  np.testing.assert_array_equal(np.asarray(activate("topk-softmax", xb)) != 0,
                                features.row_mask("topk-softmax", xb))


def test_mask_ties_and_underflow():
  # Ties at the k-th largest value (k = 2 of 8): all tied entries kept by both.
  x = jnp.asarray([3.0, 1.0, 1.0, 1.0, 0.0, 0.0, -1.0, 0.5])
  mask = np.asarray(features.row_mask("topk-softmax", x))
  np.testing.assert_array_equal(mask, [1, 1, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(np.asarray(activate("topk-softmax", x)) != 0, mask)
  # A kept entry far below the largest underflows to 0 in the softmax but stays kept:
  # the mask is the selection, not a test of the activation for zero.
  x = jnp.asarray([0.0, -200.0, -300.0, -400.0, -500.0, -600.0, -700.0, -800.0])
  np.testing.assert_array_equal(features.row_mask("topk-softmax", x),
                                [1, 1, 0, 0, 0, 0, 0, 0])
  assert float(activate("topk-softmax", x)[1]) == 0.0


def test_dense_maps_have_no_mask():
  for name in features.ACTIVATIONS:
    if name != "topk-softmax":
      assert features.row_mask(name, jnp.ones((2, 8))) is None, name
  with pytest.raises(ValueError, match="unknown activation"):
    features.row_mask("gelu", jnp.ones((2, 8)))


# --- (d) dense key maps: plain g -------------------------------------------------------

@pytest.mark.parametrize("key_activation", ["identity", "softmax"])
def test_dense_key_maps_use_the_plain_decay(key_activation):
  cfg = dataclasses.replace(SPARSE, key_activation=key_activation)
  layer, x = make(cfg, seed=2), inputs(seed=4)
  h0 = random_state(cfg, jnp.float32)
  q, k, v, _ = layer.qkv(x)
  q, k, v = (activate(a, p) for a, p in ((cfg.query_activation, q),
                                         (cfg.key_activation, k),
                                         (cfg.value_activation, v)))
  want_o, want_s = run_gla(q, k, v, layer.decay(x), h0, impl=cfg.impl,
                           chunk_size=cfg.chunk_size, decode=False)
  o, cache, _ = layer.attend(x, RecurrentCache(h0, None))
  np.testing.assert_array_equal(o, want_o)
  np.testing.assert_array_equal(cache.state, want_s)
