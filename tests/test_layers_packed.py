"""Packed sequences (`cu_seqlens`) through the mixers and the model: every sequence of a
packed row gives the outputs and parameter / input gradients it gives alone, with
boundaries inside chunks, an empty sequence, a one-token sequence and T not a multiple
of the chunk; bad cu_seqlens and packing with a cache are refused."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sse_jax.layers import (Attention, AttentionConfig, Block, GLA, GLAConfig, MLPConfig,
                            SSE, SSEConfig, attention, sequences)
from sse_jax.layers.testing import random_module, router_margin
from sse_jax.model import LanguageModel
from sse_jax.model.presets import tiny
from tests.op_testing import assert_close

T, D, H = 40, 32, 2
# lengths 1, 0, 13, 13, 13: a one-token sequence, an empty one, ends inside 16-row
# chunks, T not a multiple of 16; the three of length 13 run alone as one batch [3, 13]
CU = np.array([0, 1, 1, 14, 27, 40], np.int32)
POSITIONS = np.r_[0, np.tile(np.arange(13), 3)]  # each token's position in its sequence
SSE_BASE = SSEConfig(hidden=D, num_heads=H, chunk_size=16, lora_rank=8, short_conv=4,
                     num_partitions=4, top_k=2)

# On a GPU, float32 matmuls default to TF32 (~1e-4 relative differences between the
# packed and the separate computation orders): these tests ask for full float32.
TOL = 1e-5 if jax.default_backend() == "cpu" else 1e-4


@pytest.fixture(autouse=True)
def _full_float32_matmuls():
  with jax.default_matmul_precision("highest"):
    yield


MIXERS = {
    "gla_chunk": (GLA, GLAConfig(hidden=D, num_heads=H, chunk_size=16, short_conv=4)),
    "gla_scan": (GLA, GLAConfig(hidden=D, num_heads=H, short_conv=4, impl="scan")),
    "sse_varlen_read_gate": (SSE, dataclasses.replace(SSE_BASE, gate_placement="read")),
    "sse_masking": (SSE, dataclasses.replace(SSE_BASE, impl="masking",
                                             lora_target="routed", num_readers=3)),
    "sse_pallas_varlen": (SSE, dataclasses.replace(SSE_BASE, impl="pallas_varlen",
                                                   key_dim=64, value_dim=64)),
    "sse_per_partition": (SSE, dataclasses.replace(SSE_BASE,
                                                   share_partition_params=False)),
    "attention_window": (Attention, AttentionConfig(hidden=D, num_heads=H, num_kv_heads=1,
                                                    window=9, short_conv=4)),
}


def spans(cu):
  return [(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]


@nnx.jit
def loss_and_grads(layer, x, w, cu_seqlens):
  """(y, sum(y * w), its gradients wrt the parameters and x), packed if cu_seqlens."""
  def loss(layer, x):
    y = layer(x, cu_seqlens=cu_seqlens).y
    return jnp.sum(y * w), y
  (value, y), (grad_params, grad_x) = nnx.value_and_grad(loss, argnums=(0, 1),
                                                         has_aux=True)(layer, x)
  return y, value, nnx.state(grad_params, nnx.Param), grad_x


def alone(layer, x, w):
  """loss_and_grads of each sequence of CU on its own (batch rows are independent
  sequences: the equal-length ones run as one batch), in packed order."""
  (a, b), *rest = spans(CU)
  assert b - a == 1 and len({e - s for s, e in rest}) == 1
  row = lambda z: z[:, rest[0][0]:].reshape(len(rest), -1, z.shape[-1])
  first = loss_and_grads(layer, x[:, :1], w[:, :1], None)
  others = loss_and_grads(layer, row(x), row(w), None)
  join = lambda u, v: jnp.concatenate([u, v.reshape(1, -1, v.shape[-1])], axis=1)
  return (join(first[0], others[0]), first[1] + others[1],
          jax.tree.map(jnp.add, first[2], others[2]), join(first[3], others[3]))


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_packed_mixer_matches_each_sequence_alone(name):
  cls, config = MIXERS[name]
  layer = random_module(lambda: cls(config, rngs=nnx.Rngs(0)), seed=1)
  kx, kw = jax.random.split(jax.random.key(2))
  x = jax.random.normal(kx, (1, T, D))
  w = jax.random.normal(kw, (1, T, D))
  if isinstance(layer, SSE):  # rounding must not be able to flip a top-k choice
    assert router_margin(layer.router(x).probs, config.top_k) > 1e-4
  y, value, grads, grad_x = loss_and_grads(layer, x, w, jnp.asarray(CU))
  ref_y, ref_value, ref_grads, ref_grad_x = alone(layer, x, w)
  # (ignoring cu_seqlens would fail here: later sequences would see earlier ones)
  assert_close(y, ref_y, TOL, "y")
  # the loss sums y * w of both signs (here ~1e3 of terms for a sum ~1): relative to
  # its terms, not to itself
  np.testing.assert_allclose(value, ref_value, rtol=0,
                             atol=TOL * float(jnp.sum(jnp.abs(ref_y * w))), err_msg="loss")
  assert_close(grad_x, ref_grad_x, TOL, "dx")
  for (path, g), (_, ref) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
    assert_close(g.get_value(), ref.get_value(), TOL, str(path))


def test_packed_model_logits_match_each_sequence_alone():
  config = dataclasses.replace(tiny("sse_h", gla={}, remat="nothing_saveable"),
                               pattern="SGA")
  model = random_module(lambda: LanguageModel(config, rngs=nnx.Rngs(0)), 0, 0.1)
  tokens = jax.random.randint(jax.random.key(4), (1, T), 0, config.vocab_size)
  logits = nnx.jit(lambda m, t, cu: m(t, cu_seqlens=cu).logits)(model, tokens,
                                                                 jnp.asarray(CU))
  logits_of = nnx.jit(lambda m, t: m(t).logits)
  alone = jnp.concatenate([logits_of(model, tokens[:, :1]),
                           logits_of(model, tokens[:, 1:].reshape(3, -1)).reshape(
                               1, T - 1, -1)], axis=1)
  assert_close(logits, alone, TOL, "logits")


def test_positions_and_mask():
  np.testing.assert_array_equal(sequences.positions(jnp.asarray(CU), T), POSITIONS)
  same = np.asarray(sequences.same_sequence(jnp.asarray(CU), T))
  assert same[0, 0] and not same[0, 1] and same[1, 13] and not same[13, 14]


@pytest.mark.parametrize("cu,batch,message", [
    ([0, 10, 20], 2, "B == 1"),
    ([0, 30, 20], 1, "non-decreasing"),
    ([0, 10, 30], 1, "end at T=20"),
    ([[0, 20]], 1, "1-D array"),
    ([0.0, 20.0], 1, "integer"),
])
def test_bad_cu_seqlens_are_refused(cu, batch, message):
  layer = GLA(GLAConfig(hidden=D, num_heads=H), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=message):
    layer(jnp.zeros((batch, 20, D)), cu_seqlens=jnp.asarray(cu))
  model = LanguageModel(tiny("sse_h"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=message):
    model(jnp.zeros((batch, 20), jnp.int32), cu_seqlens=jnp.asarray(cu))
  # a rematerialised block passes cu_seqlens on as a tracer: it checks them first
  block = Block(GLAConfig(hidden=D, num_heads=H), MLPConfig(D, 2 * D),
                remat="nothing_saveable", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=message):
    block(jnp.zeros((batch, 20, D)), cu_seqlens=jnp.asarray(cu))


def test_packed_attention_restarts_rope_positions(monkeypatch):
  """RoPE scores depend only on q - k distances, so the outputs cannot show whether
  positions restart: record the positions Attention rotates with instead."""
  seen, original = [], attention.apply_rope

  def spy(x, positions, base):
    seen.append(np.asarray(positions))
    return original(x, positions, base)
  monkeypatch.setattr(attention, "apply_rope", spy)
  layer = Attention(AttentionConfig(hidden=D, num_heads=H), rngs=nnx.Rngs(0))
  layer(jnp.zeros((1, T, D)), cu_seqlens=jnp.asarray(CU))
  assert len(seen) == 2  # q and k
  for p in seen:
    np.testing.assert_array_equal(np.broadcast_to(p, (T,)), POSITIONS)


@pytest.mark.parametrize("cls,config", [
    (GLA, GLAConfig(hidden=D, num_heads=H)),
    (Attention, AttentionConfig(hidden=D, num_heads=H))])
def test_packing_with_a_cache_is_refused(cls, config):
  layer = cls(config, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="cannot be combined with a cache"):
    layer(jnp.zeros((1, 8, D)), layer.init_cache(1, 8), cu_seqlens=jnp.asarray([0, 8]))
