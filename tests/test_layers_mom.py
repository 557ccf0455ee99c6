"""The MoM (Mixture-of-Memories) mixer against a plain per-token float64 loop (GLA and
delta-rule transitions, shared memory, per-memory short convs), packed sequences, the
cache (chunked prefill + decode == full call), parameter counts, and one training step
of the MoM model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sse_jax.layers import MoM, MoMConfig
from sse_jax.layers.testing import random_module, router_margin
from sse_jax.model import LanguageModel, count_params
from sse_jax.model.presets import preset, tiny
from tests.op_testing import assert_close
from tests.test_layers_swa import decode_logits, forward, loss_after, train_step

B, T, D, H = 2, 21, 32, 2
BASE = MoMConfig(hidden=D, num_heads=H, num_memories=4, top_k=2, short_conv=4,
                 chunk_size=16)
CASES = {
    "gla": BASE,
    "delta": dataclasses.replace(BASE, transition="delta"),
    "gla_top1_no_shared_no_conv": dataclasses.replace(BASE, top_k=1, shared_memory=False,
                                                      short_conv=0),
    "delta_scan_silu": dataclasses.replace(BASE, transition="delta", impl="scan",
                                           query_activation="silu", key_dim=8),
}
TOL = 1e-5 if jax.default_backend() == "cpu" else 1e-4


@pytest.fixture(autouse=True)
def _full_float32_matmuls():  # TF32 on a GPU would be ~1e-4 off the float64 loop
  with jax.default_matmul_precision("highest"):
    yield


def make(cfg, seed=3):
  return random_module(lambda: MoM(cfg, rngs=nnx.Rngs(0)), seed)


@nnx.jit
def call(layer, x, cache=None, cu_seqlens=None):
  return layer(x, cache, cu_seqlens=cu_seqlens)


# --- the reference: one token at a time ----------------------------------------------

def loop_reference(layer, x):
  """The layer's function written plainly in float64, token by token: route, then for
  each of the token's memories (its k routed ones, weighted by the renormalised router
  probabilities, and the shared one, weight 1) push the token through that memory's own
  short-conv history and update and read that memory's state."""
  c = layer.config
  f64 = lambda p: np.asarray(p[...], np.float64)
  x = np.asarray(x, np.float64)
  n, m, w = c.num_memories, c.memories, c.short_conv
  silu = lambda z: z / (1.0 + np.exp(-z))
  act = {"identity": lambda z: z, "silu": silu}
  w_r, w_q = f64(layer.router.kernel), f64(layer.q_proj.kernel)
  w_k, w_v = f64(layer.k_proj.kernel), f64(layer.v_proj.kernel)
  kernels = [f64(cv.kernel) for cv in (layer.q_conv, layer.k_conv, layer.v_conv)] if w else []
  b, t, _ = x.shape
  out = np.zeros((b, t, c.num_heads, c.head_v))
  for r in range(b):
    state = np.zeros((m, c.num_heads, c.head_k, c.head_v))
    history = [[np.zeros((max(w - 1, 0),) + kern.shape[1:]) for kern in kernels]
               for _ in range(m)]
    for i in range(t):
      xt = x[r, i]
      logits = xt @ w_r
      p = np.exp(logits - logits.max())
      p /= p.sum()
      chosen = np.argsort(-p, kind="stable")[:c.top_k]
      mems = list(chosen) + ([n] if c.shared_memory else [])
      weights = list(p[chosen] / p[chosen].sum()) + [1.0]
      for mem, weight in zip(mems, weights):
        q = np.einsum("d,dhk->hk", xt, w_q)
        k = np.einsum("d,dhk->hk", xt, w_k[mem])
        v = np.einsum("d,dhk->hk", xt, w_v[mem])
        if w:
          feats = []
          for j, (z, kern) in enumerate(zip((q, k, v), kernels)):
            window = np.concatenate([history[mem][j], z[None]])
            history[mem][j] = window[1:]
            feats.append(silu(np.einsum("whk,whk->hk", kern, window)))
          q, k, v = feats
        q, k = act[c.query_activation](q), act[c.key_activation](k)
        if c.transition == "gla":
          hidden = xt @ f64(layer.gate_down.kernel)[mem]
          logit = np.einsum("r,rhk->hk", hidden, f64(layer.gate_up.kernel)[mem])
          g = -np.logaddexp(0.0, -(logit + f64(layer.gate_bias)[mem])) / c.gate_normalizer
          state[mem] = np.exp(g)[..., None] * state[mem] + k[..., None] * v[:, None]
        else:
          q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
          k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
          a = xt @ f64(layer.decay_proj.kernel)[mem] + f64(layer.dt_bias)
          g = -np.exp(f64(layer.a_log)) * np.logaddexp(0.0, a)
          beta = 1.0 / (1.0 + np.exp(-(xt @ f64(layer.beta_proj.kernel)[mem])))
          s = np.exp(g)[:, None, None] * state[mem]
          err = v - np.einsum("hk,hkv->hv", k, s)
          state[mem] = s + beta[:, None, None] * k[..., None] * err[:, None]
        out[r, i] += weight * np.einsum("hk,hkv->hv", q * c.head_k ** -0.5, state[mem])
  norm = out / np.sqrt(np.mean(out ** 2, -1, keepdims=True) + c.norm_eps)
  norm = norm * f64(layer.out.norm.scale)
  gate = silu(np.einsum("btd,dhk->bthk", x, f64(layer.out.gate.kernel)))
  return np.einsum("bthk,hkd->btd", norm * gate, f64(layer.out.proj.kernel))


def check_margin(layer, x):
  """Well posed only if float32 rounding cannot flip a top-k choice."""
  assert router_margin(layer.router(x).probs, layer.config.top_k) > 1e-4


@pytest.mark.parametrize("case", sorted(CASES))
def test_mom_matches_the_per_token_loop(case):
  layer = make(CASES[case])
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  check_margin(layer, x)
  out = call(layer, x)
  assert_close(out.y, loop_reference(layer, x), TOL, case)
  # the router statistics: SSE's load-balance loss over the top-k set
  n, k = layer.config.num_memories, layer.config.top_k
  r = layer.router(x)
  f = jax.nn.one_hot(r.write_indices, n).sum(-2).reshape(-1, n).mean(0)
  np.testing.assert_allclose(out.usage, f, rtol=1e-6)
  np.testing.assert_allclose(out.aux_loss, n / k * np.sum(f * r.probs.reshape(-1, n).mean(0)),
                             rtol=1e-5)


def test_chunk_and_scan_agree_with_gradients():
  x = jax.random.normal(jax.random.key(1), (B, T, D))
  cot = jax.random.normal(jax.random.key(2), (B, T, D))

  @nnx.jit
  def grads(layer):
    return nnx.grad(lambda m: jnp.sum(m(x).y * cot))(layer)

  outs = {impl: grads(make(dataclasses.replace(BASE, impl=impl))) for impl in ("chunk", "scan")}
  leaves = [jax.tree.leaves(nnx.state(outs[i], nnx.Param)) for i in ("chunk", "scan")]
  for a, b in zip(*leaves):
    assert_close(a, b, 1e-4, "parameter gradient, chunk vs scan")
  assert np.abs(outs["chunk"].k_proj.kernel[...]).max() > 0


CU = np.array([0, 1, 1, 9, 21], np.int32)  # lengths 1, 0, 8, 12


@pytest.mark.parametrize("case", ["gla", "delta"])
def test_packed_sequences_are_computed_alone(case):
  """Packed, each sequence's outputs equal the per-token loop over that sequence alone
  (no memory state and no short-conv history crosses a boundary)."""
  layer = make(CASES[case])
  x = jax.random.normal(jax.random.key(3), (1, T, D))
  check_margin(layer, x)
  got = call(layer, x, cu_seqlens=jnp.asarray(CU)).y
  for a, b in ((0, 1), (1, 9), (9, 21)):
    assert_close(got[:, a:b], loop_reference(layer, x[:, a:b]), TOL, f"{case} {a}:{b}")


@pytest.mark.parametrize("case", ["gla", "delta", "gla_top1_no_shared_no_conv"])
def test_prefill_and_decode_equal_the_full_call(case):
  layer = make(CASES[case])
  x = jax.random.normal(jax.random.key(4), (B, T, D))
  check_margin(layer, x)
  full = call(layer, x).y
  cache = layer.init_cache(B)
  ys, start = [], 0
  for end in (5, 12) + tuple(range(13, T + 1)):  # two prefill chunks, then steps
    out = call(layer, x[:, start:end], cache)
    ys.append(out.y)
    cache, start = out.cache, end
  assert_close(jnp.concatenate(ys, axis=1), full, TOL, case)
  c = layer.config
  assert cache.state.shape == (B, c.memories, H, c.head_k, c.head_v)


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match=r"MoMConfig.top_k=5 must be <= num_memories=4"):
    dataclasses.replace(BASE, top_k=5)
  with pytest.raises(ValueError, match=r"MoMConfig.transition='rwkv' is not one of"):
    dataclasses.replace(BASE, transition="rwkv")
  with pytest.raises(ValueError, match=r"MoMConfig.impl='loop' is not one of"):
    dataclasses.replace(BASE, transition="delta", impl="loop")  # a GLA-only impl


# --- the model ---------------------------------------------------------------------

def test_parameter_counts_of_the_600m_preset():
  """n4k1 with a shared memory: 3 of the 5 sets of per-memory weights are inactive; the
  active count matches the dense 600M models (~300M non-embedding)."""
  cfg = preset("600m", "mom")
  assert cfg.pattern == "M" * 24 and cfg.mom.num_memories == 4 and cfg.mom.top_k == 1
  count = count_params(cfg)
  d, h, dk, r = 1024, 8, 128, 16
  per_memory = 2 * d * h * dk + d * r + r * h * dk + h * dk  # W_k, W_v, gate
  assert count.total - count.active == 24 * 3 * per_memory
  assert count.embedding == count.total - count.non_embedding
  assert abs(count.active_non_embedding / 300e6 - 1) < 0.05, count
  assert abs(count.non_embedding / 463.5e6 - 1) < 1e-3, count
  sse = count_params(preset("600m", "sse"))
  assert sse.active == sse.total


def test_active_counts_of_per_partition_sse():
  cfg = tiny("sse", sse={"share_partition_params": False, "top_k": 1, "num_readers": 2})
  count = count_params(cfg)
  model = nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))
  size = lambda z: int(np.prod(z.kernel.shape)) // 5  # one of N + 1 = 5 copies
  unused = 0
  for block in model.blocks:
    qkv = block.mixer.qkv
    unused += 2 * (size(qkv.q_proj) + size(qkv.q_conv))              # 4 - 2 readers
    unused += 3 * sum(size(z) for z in (qkv.k_proj, qkv.k_conv, qkv.v_proj, qkv.v_conv))
  assert count.total - count.active == unused


@pytest.mark.parametrize("transition", ["gla", "delta"])
def test_mom_model_one_training_step(transition):
  cfg = tiny("mom", mom={"top_k": 2, "transition": transition})
  m = random_module(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)), 1, 0.1)
  assert m.routed_layers == (0, 1, 2)
  toks = jax.random.randint(jax.random.key(6), (B, 25), 0, 256)
  optimizer = nnx.Optimizer(m, optax.adam(3e-3), wrt=nnx.Param)
  loss, out, grads = train_step(m, optimizer, toks)
  assert len(out.router_usage) == 3
  np.testing.assert_allclose(out.aux_loss, 0.01 * sum(out.router_aux), rtol=1e-6)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  mixer = grads["blocks"][0]["mixer"]
  for name in ("router", "k_proj", "v_proj", "q_proj"):
    assert np.abs(mixer[name]["kernel"][...]).max() > 0, name
  assert loss_after(m, toks) < float(loss)


def test_mom_model_decode_equals_the_full_forward():
  cfg = tiny("mom", mom={"top_k": 2})
  m = random_module(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)), 2, 0.1)
  toks = jax.random.randint(jax.random.key(7), (B, 20), 0, 256)
  assert_close(decode_logits(m, toks, 9), forward(m, toks).logits, 1e-4, "decode vs full")
