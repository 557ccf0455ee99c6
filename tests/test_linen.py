"""Linen wrappers: init / apply / grad inside a Linen module, same numbers as NNX."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sse_jax import linen as sse_linen
import pytest

from sse_jax.layers import GDN, GDNConfig, GLA, GLAConfig, MoM, MoMConfig, SSE, SSEConfig
from sse_jax.layers import SlidingWindowAttention, SWAConfig
from sse_jax.model import LanguageModel
from sse_jax.model.presets import tiny
from tests.op_testing import assert_close

CFG = SSEConfig(hidden=16, num_heads=2, chunk_size=16, lora_rank=4, short_conv=4)


class Net(nn.Module):
  """A user's Linen model with an SSE layer inside."""

  @nn.compact
  def __call__(self, x):
    out = sse_linen.sse_layer(CFG, name="sse")(x)
    return nn.Dense(3)(out.y), out.aux_loss, out.y


def into_nnx(module: nnx.Module, linen_params) -> nnx.Module:
  """The NNX module with the Linen parameters (unboxed) copied in."""
  state = nnx.state(module, nnx.Param)
  flat = dict(nnx.to_flat_state(state))
  for path, value in nnx.to_flat_state(nnx.State(nn.meta.unbox(linen_params))):
    flat[path].set_value(value.get_value() if hasattr(value, "get_value") else value)
  nnx.update(module, state)
  return module


def test_sse_layer_in_a_linen_module_init_apply_grad():
  x = jax.random.normal(jax.random.key(0), (2, 20, 16))
  variables = jax.jit(Net().init)(jax.random.key(1), x)
  y, aux, y_sse = jax.jit(Net().apply)(variables, x)
  assert y.shape == (2, 20, 3) and aux.shape == ()
  nnx_layer = into_nnx(nnx.eval_shape(lambda: SSE(CFG, rngs=nnx.Rngs(0))),
                       variables["params"]["sse"])
  ref = nnx.jit(lambda m, x: m(x))(nnx_layer, x)
  assert_close(y_sse, ref.y, 1e-6, "linen vs nnx")
  np.testing.assert_allclose(aux, ref.aux_loss, rtol=1e-6)
  loss = lambda v: jnp.sum(Net().apply(v, x)[0] ** 2)
  grads = nn.meta.unbox(jax.jit(jax.grad(loss))(variables))
  assert np.abs(grads["params"]["sse"]["router"]["kernel"]).max() > 0
  assert np.abs(grads["params"]["Dense_0"]["kernel"]).max() > 0
  specs = nn.get_partition_spec(variables)
  assert tuple(specs["params"]["sse"]["router"]["kernel"]) == ("embed", "partitions")


MIXERS = {
    "gla": (sse_linen.gla_layer, GLA, GLAConfig(hidden=16, num_heads=2, chunk_size=16)),
    "gdn": (sse_linen.gdn_layer, GDN, GDNConfig(hidden=16, num_heads=2, chunk_size=16)),
    "mom": (sse_linen.mom_layer, MoM, MoMConfig(hidden=16, num_heads=2, chunk_size=16,
                                                num_memories=3, top_k=2)),
    "swa": (sse_linen.swa_layer, SlidingWindowAttention,
            SWAConfig(hidden=16, num_heads=2, window=5)),
}


@pytest.mark.parametrize("name", list(MIXERS))
def test_every_mixer_wrapper_computes_what_its_nnx_module_does(name):
  """Each wrapper's output (and, for MoM, its balance loss) equals the NNX module's with
  the same parameters; its parameters get gradients."""
  wrapper, nnx_class, cfg = MIXERS[name]
  x = jax.random.normal(jax.random.key(6), (2, 20, 16))
  layer = wrapper(cfg)
  variables = jax.jit(layer.init)(jax.random.key(7), x)
  out = jax.jit(layer.apply)(variables, x)
  ref = nnx.jit(lambda m, x: m(x))(
      into_nnx(nnx.eval_shape(lambda: nnx_class(cfg, rngs=nnx.Rngs(0))),
               variables["params"]), x)
  assert_close(out.y, ref.y, 1e-6, f"linen {name} vs nnx")
  assert (out.aux_loss is None) == (ref.aux_loss is None) == (name != "mom")
  if name == "mom":
    np.testing.assert_allclose(out.aux_loss, ref.aux_loss, rtol=1e-6)
  grads = jax.jit(jax.grad(lambda v: jnp.sum(layer.apply(v, x).y ** 2)))(variables)
  leaves = jax.tree.leaves(nn.meta.unbox(grads))
  assert leaves and sum(float(jnp.abs(g).max() > 0) for g in leaves) >= len(leaves) // 2


def test_language_model_wrapper_matches_nnx():
  cfg = tiny("sse_h")
  cfg = dataclasses.replace(cfg, pattern="S")  # one layer keeps compiling cheap
  toks = jax.random.randint(jax.random.key(2), (2, 16), 0, 256)
  lm = sse_linen.language_model(cfg)
  variables = jax.jit(lm.init)(jax.random.key(3), toks)
  out = jax.jit(lm.apply)(variables, toks)
  ref_model = into_nnx(nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0))),
                       variables["params"])
  ref = nnx.jit(lambda m, t: m(t))(ref_model, toks)
  assert out.logits.dtype == jnp.float32
  assert_close(out.logits, ref.logits, 1e-6, "linen LM vs nnx")
  np.testing.assert_allclose(out.aux_loss, ref.aux_loss, rtol=1e-6)
  # packed sequences pass through the wrapper as a keyword
  cu = jnp.asarray([0, 5, 16], jnp.int32)
  packed = jax.jit(lambda v, t, cu: lm.apply(v, t, cu_seqlens=cu))(variables, toks[:1], cu)
  ref = nnx.jit(lambda m, t, cu: m(t, cu_seqlens=cu))(ref_model, toks[:1], cu)
  assert_close(packed.logits, ref.logits, 1e-6, "linen packed LM vs nnx")


def test_language_model_wrapper_decodes_with_a_cache():
  """init_cache through `nnx_method`, then token-by-token steps: the same logits as the
  full sequence (an SSE and an attention layer, so both cache kinds)."""
  cfg = dataclasses.replace(tiny("sse_h"), pattern="SA")
  toks = jax.random.randint(jax.random.key(4), (2, 12), 0, 256)
  lm = sse_linen.language_model(cfg)
  variables = jax.jit(lm.init)(jax.random.key(5), toks)
  full = jax.jit(lm.apply)(variables, toks).logits
  cache = lm.apply(variables, 2, 12, nnx_method="init_cache")
  step = jax.jit(lambda v, t, c: lm.apply(v, t, cache=c))
  logits = []
  for t in range(toks.shape[1]):
    out = step(variables, toks[:, t:t + 1], cache)
    cache = out.cache
    logits.append(out.logits)
  assert_close(jnp.concatenate(logits, axis=1), full, 1e-5, "decoded vs full")
