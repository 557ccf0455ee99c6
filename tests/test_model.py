"""The language model: preset sizes (eval_shape only), outputs, load-balance loss,
rematerialisation, router gradients under gate placements, bf16, sharding specs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

from sse_jax.layers import LOGICAL_AXIS_RULES
from sse_jax.layers.testing import random_module
from sse_jax.model import LanguageModel, ModelConfig, count_params
from sse_jax.model.presets import VARIANTS, preset, tiny
from tests.op_testing import assert_close

B, T = 2, 24


@pytest.mark.parametrize("size,variant,paper", [
    ("600m", "sse", 300e6), ("600m", "sse_h", 300e6), ("600m", "gla", 300e6),
    ("600m", "transformer", 300e6), ("2b", "sse_h", 1.3e9), ("2b", "sse", 1.3e9),
    ("2b", "transformer", 1.3e9)])
def test_paper_presets_match_the_papers_non_embedding_counts(size, variant, paper):
  count = count_params(preset(size, variant))
  assert abs(count.non_embedding / paper - 1) < 0.10, count
  if size == "2b" and variant == "sse_h":
    assert preset(size, variant).pattern == "SSSSSA" * 3


def test_125m_family_has_roughly_equal_sizes():
  counts = [count_params(preset("125m", v)).non_embedding for v in VARIANTS]
  assert max(counts) / min(counts) < 1.05, counts
  assert 85e6 < min(counts) and max(counts) < 100e6, counts


def test_tied_and_untied_embeddings_counts():
  tied, untied = (count_params(tiny("sse_h", tie_embeddings=t)) for t in (True, False))
  assert untied.total - tied.total == 256 * 64
  assert untied.non_embedding == tied.non_embedding


def make(config, seed=0, **kw):
  # Weights ~ N(0, 0.1^2) keep activations O(1) at width 64 (1 / sqrt(64) ~ 0.12).
  return random_module(lambda: LanguageModel(config, rngs=nnx.Rngs(0), **kw), seed, 0.1)


def tokens(seed=0, t=T):
  return jax.random.randint(jax.random.key(seed), (B, t), 0, 256)


@nnx.jit
def forward(model, toks):
  return model(toks)


def test_forward_outputs_and_scaled_aux_loss():
  cfg = tiny("sse_h", sse={"top_k": 2})
  out = forward(make(cfg), tokens())
  assert out.logits.shape == (B, T, 256) and out.logits.dtype == jnp.float32
  assert len(out.router_usage) == len(out.router_aux) == 2       # "SSA"
  np.testing.assert_allclose(out.aux_loss, 0.01 * sum(out.router_aux), rtol=1e-6)
  for usage in out.router_usage:
    np.testing.assert_allclose(np.sum(usage), 2.0, rtol=1e-6)   # sum_i f_i = k
  assert out.cache is None


def lm_loss(model, toks):
  out = model(toks[:, :-1])
  ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, toks[:, 1:])
  return jnp.mean(ce), out


@nnx.jit
def task_and_aux_grads(model, toks):
  (loss, _), grads = nnx.value_and_grad(lm_loss, has_aux=True)(model, toks)
  aux_grads = nnx.grad(lambda m: m(toks[:, :-1]).aux_loss)(model)
  return loss, grads, aux_grads


def router_kernels(tree):
  return np.asarray(tree["blocks"][0]["mixer"]["router"]["kernel"][...])


def small(**sse):
  return ModelConfig.create(pattern="SA", vocab_size=256, hidden=32, num_heads=2,
                            mlp_dim=64, sse={"chunk_size": 16, "lora_rank": 4, **sse})


def test_remat_keeps_loss_and_gradients_and_router_learns_through_gates():
  toks = tokens(1)
  cfg = small(impl="scan")  # remat is impl-agnostic; scan compiles fastest
  plain = make(cfg)
  remat = make(dataclasses.replace(cfg, remat="nothing_saveable"))
  loss, grads, _ = task_and_aux_grads(plain, toks)
  loss_r, grads_r, _ = task_and_aux_grads(remat, toks)
  np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads_r), jax.tree.leaves(grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
  assert np.abs(grads["blocks"][0]["mixer"]["router"]["kernel"][...]).max() > 1e-6


@nnx.jit
def adam_step(optimizer, model, grads):
  optimizer.update(model, grads)


def test_gate_none_router_does_not_move_under_the_lm_loss():
  model = make(small(gate_placement="none", top_k=2))
  _, grads, aux_grads = task_and_aux_grads(model, tokens(2))
  assert not np.any(router_kernels(grads))                  # exactly zero
  assert np.abs(router_kernels(aux_grads)).max() > 0        # only the balance loss
  router, mlp = router_kernels(nnx.state(model)), np.asarray(model.blocks[0].mlp.up.kernel[...])
  adam_step(nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), model, grads)
  np.testing.assert_array_equal(router_kernels(nnx.state(model)), router)
  assert np.abs(np.asarray(model.blocks[0].mlp.up.kernel[...]) - mlp).max() > 0


def test_bf16_compute_keeps_float32_logits_close_to_float32():
  cfg = tiny("sse_h")
  toks = tokens(3)
  out16 = forward(make(cfg, dtype=jnp.bfloat16), toks)
  out32 = forward(make(cfg), toks)
  assert out16.logits.dtype == jnp.float32 and out16.aux_loss.dtype == jnp.float32
  assert np.all(np.isfinite(out16.logits))
  # bf16 activations (8-bit mantissa) through 3 random blocks: measured 3.4e-2, incl.
  # the odd rounding-induced top-k flip at a near-tie token (fp32 is checked at 1e-5).
  assert_close(out16.logits, out32.logits, 6e-2, "bf16 vs fp32 logits")


def test_model_shardings_resolve_on_a_data_model_mesh():
  mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  abstract = nnx.eval_shape(lambda: LanguageModel(tiny("sse_h", tie_embeddings=False),
                                                  rngs=nnx.Rngs(0)))
  with nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
    shardings = nnx.get_named_sharding(nnx.state(abstract, nnx.Param), mesh)
  assert shardings["embed"].get_value().spec == P("model", None)
  assert shardings["lm_head"].get_value().spec == P(None, "model")
  attn = shardings["blocks"][2]["mixer"]
  assert attn["k"]["kernel"].get_value().spec == P(None, "model", None)


def test_out_of_range_token_ids_are_named():
  model = make(small(impl="scan"))
  with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=256\), got "
                                       r"values in \[1, 256\]"):
    model(jnp.asarray([[1, 2, 256, 3]]))
  with pytest.raises(ValueError, match=r"got values in \[-1, 3\]"):
    model(jnp.asarray([[1, 2, 3, -1]]))
  with pytest.raises(ValueError, match="tokens must be integer ids"):
    model(jnp.ones((1, 4)))
  with pytest.raises(ValueError, match="aux_loss_coef"):
    dataclasses.replace(small(), aux_loss_coef=True)


def test_pallas_limits_are_checked_with_the_config():
  from sse_jax.layers import GLAConfig, SSEConfig  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r"^SSEConfig.impl='pallas_varlen' cannot take "
                     r"chunk_size=48: the Pallas kernels take chunk sizes \(16, 32, 64, 128\)"):
    SSEConfig(32, 2, chunk_size=48, impl="pallas_varlen")
  with pytest.raises(ValueError, match=r"^SSEConfig.impl='pallas_masking' cannot take "
                     r"Dk=12: the Pallas kernels support head dims"):
    SSEConfig(24, 2, chunk_size=16, impl="pallas_masking")
  with pytest.raises(ValueError, match="^GLAConfig.impl='pallas_chunk' cannot take Dv=8"):
    GLAConfig(32, 2, value_dim=8, chunk_size=16, impl="pallas_chunk")
  with pytest.raises(ValueError, match="^GLAConfig.chunk_size=24 must be a positive "
                     "multiple of 16"):
    GLAConfig(32, 2, chunk_size=24)
  SSEConfig(32, 2, chunk_size=16, impl="pallas_varlen")  # head dim 16: fine
  SSEConfig(24, 2, chunk_size=48, impl="auto")  # falls back to XLA by itself
  SSEConfig(24, 2, chunk_size=48, impl="masking")
