"""Small parts against numpy (RMSNorm, SwiGLU, short conv, feature maps), config
validation, and the logical-axis sharding metadata of the parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from sse_jax.layers import (LOGICAL_AXIS_RULES, AttentionConfig, Block, GLAConfig,
                            MLPConfig, RMSNorm, SSEConfig, ShortConv, SwiGLU, activate)
from sse_jax.layers.testing import random_module
from sse_jax.model import ModelConfig
from tests.op_testing import assert_close

X = jax.random.normal(jax.random.key(0), (2, 9, 8))


def test_rmsnorm_and_swiglu_match_numpy():
  norm = random_module(lambda: RMSNorm(8, eps=1e-5), seed=1)
  x = np.asarray(X, np.float64)
  scale = np.asarray(norm.scale[...], np.float64)
  want = x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + 1e-5) * scale
  assert_close(norm(X), want, 1e-6, "rmsnorm")
  mlp = random_module(lambda: SwiGLU(MLPConfig(8, 12), rngs=nnx.Rngs(0)), seed=2)
  w = lambda m: np.asarray(m.kernel[...], np.float64)
  a, b = x @ w(mlp.gate), x @ w(mlp.up)
  assert_close(mlp(X), (a / (1 + np.exp(-a)) * b) @ w(mlp.down), 1e-5, "swiglu")


def test_rmsnorm_gradients_match_numpy_and_keep_only_its_inputs():
  """RMSNorm's gradients (x and scale) against the closed form in float64; its float32
  intermediates are recomputed in the backward pass, so the only residuals are x (in
  its own dtype, bf16 here) and the scale."""
  graphdef, state = nnx.split(random_module(lambda: RMSNorm(8, eps=1e-5), seed=1))
  cot = jax.random.normal(jax.random.key(2), X.shape)
  loss = lambda x, state: jnp.sum(nnx.merge(graphdef, state)(x) * cot)
  dx, dstate = jax.grad(loss, (0, 1))(X, state)
  x, c = np.asarray(X, np.float64), np.asarray(cot, np.float64)
  scale = np.asarray(state["scale"][...], np.float64)
  r = 1 / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + 1e-5)
  u = c * scale  # the cotangent of x * r
  want_dx = r * u - x * r ** 3 * np.mean(u * x, -1, keepdims=True)
  assert_close(dx, want_dx, 1e-5, "d rmsnorm / dx")
  assert_close(dstate["scale"][...], np.sum(c * x * r, (0, 1)), 1e-5, "d rmsnorm / dscale")
  from jax._src import ad_checkpoint  # pylint: disable=g-import-not-at-top
  kept = ad_checkpoint.saved_residuals(loss, X.astype(jnp.bfloat16), state)
  # Besides the arguments, only the test's own cotangent (a constant of `loss`).
  assert [why for _, why in kept if "from the argument" not in why] == ["from a constant"]


def test_short_conv_is_causal_depthwise_and_resumable():
  conv = random_module(lambda: ShortConv(3, (2, 4), ("heads", "head_dim"),
                                         rngs=nnx.Rngs(0)), seed=3)
  x = jax.random.normal(jax.random.key(1), (2, 9, 2, 4))
  w = np.asarray(conv.kernel[...], np.float64)
  xp = np.concatenate([np.zeros((2, 2, 2, 4)), np.asarray(x, np.float64)], axis=1)
  pre = sum(w[j] * xp[:, j:j + 9] for j in range(3))
  y, state = conv(x)
  assert_close(y, pre / (1 + np.exp(-pre)), 1e-6, "conv")
  np.testing.assert_array_equal(state, x[:, -2:])
  y1, s1 = conv(x[:, :4])
  y2, _ = conv(x[:, 4:], s1)
  assert_close(jnp.concatenate([y1, y2], 1), y, 1e-6, "conv resumed from its state")


def test_feature_maps():
  x = np.asarray(X, np.float64)
  e = np.exp(x - x.max(-1, keepdims=True))
  want = {"identity": x, "relu": np.maximum(x, 0), "silu": x / (1 + np.exp(-x)),
          "elu+1": np.where(x > 0, x + 1, np.exp(x)), "softmax": e / e.sum(-1, keepdims=True)}
  keep = x >= np.sort(x, -1)[..., -(x.shape[-1] // 4)][..., None]  # the d/4 largest
  et = np.where(keep, e, 0)
  want["topk-softmax"] = et / et.sum(-1, keepdims=True)
  for name, value in want.items():
    assert_close(activate(name, X), value, 1e-6, name)
  assert activate("softmax", X.astype(jnp.bfloat16)).dtype == jnp.bfloat16
  sparse = np.asarray(activate("topk-softmax", X))
  assert np.all((sparse > 0).sum(-1) == x.shape[-1] // 4)


BAD_CONFIGS = [
    (lambda: SSEConfig(32, 2, num_partitions=4, top_k=5), "top_k"),
    (lambda: SSEConfig(32, 2, num_writers=0), "num_writers"),
    (lambda: SSEConfig(32, 2, num_partitions=2, num_readers=3), "num_readers"),
    (lambda: SSEConfig(32, 2, num_partitions=0), "num_partitions"),
    (lambda: SSEConfig(32, 2, key_activation="gelu"), "key_activation"),
    (lambda: SSEConfig(32, 2, query_activation="tanh"), "query_activation"),
    (lambda: SSEConfig(32, 2, lora_target="both"), "lora_target"),
    (lambda: SSEConfig(32, 2, lora_rank=-1), "lora_rank"),
    (lambda: SSEConfig(30, 4), "hidden"),
    (lambda: SSEConfig(32, 2, gate_placement="sometimes"), "gate_placement"),
    (lambda: SSEConfig(32, 2, impl="fast"), "impl"),
    (lambda: SSEConfig(32, 2, chunk_size=20), "chunk_size"),
    (lambda: SSEConfig(32, 2, short_conv=-1), "short_conv"),
    (lambda: SSEConfig(32, 2, shared_partition="yes"), "shared_partition"),
    (lambda: SSEConfig(32, 2, gate_normalizer=0), "gate_normalizer"),
    (lambda: SSEConfig(32, 2, share_partition_params=1), "share_partition_params"),
    (lambda: GLAConfig(32, 2, impl="varlen"), "impl"),
    (lambda: AttentionConfig(32, 4, num_kv_heads=3), "num_kv_heads"),
    (lambda: AttentionConfig(32, 4, window=0), "window"),
    (lambda: AttentionConfig(32, 4, head_dim=7), "head_dim"),
    (lambda: AttentionConfig(32, 4, implementation="flash"), "implementation"),
    (lambda: MLPConfig(32, 0), "intermediate"),
    (lambda: ModelConfig.create(pattern="SXA", vocab_size=8, hidden=32, num_heads=2,
                                mlp_dim=64), "pattern"),
    (lambda: ModelConfig(vocab_size=8, hidden=32, pattern="SA", mlp=MLPConfig(32, 64),
                         sse=SSEConfig(32, 2)), "attention"),
    (lambda: ModelConfig(vocab_size=8, hidden=32, pattern="S", mlp=MLPConfig(32, 64),
                         sse=SSEConfig(64, 2)), "sse.hidden"),
    (lambda: ModelConfig.create(pattern="A", vocab_size=8, hidden=32, num_heads=2,
                                mlp_dim=64, remat="sometimes"), "remat"),
    (lambda: ModelConfig.create(pattern="G", vocab_size=8, hidden=32, num_heads=2,
                                mlp_dim=64, aux_loss_coef=-1.0), "aux_loss_coef"),
]


@pytest.mark.parametrize("make,field", BAD_CONFIGS, ids=[f for _, f in BAD_CONFIGS])
def test_bad_configs_raise_naming_the_field(make, field):
  with pytest.raises(ValueError, match=rf"\b{field}="):
    make()


def block_factory():
  cfg = SSEConfig(hidden=16, num_heads=2, num_partitions=3, short_conv=4, lora_rank=4)
  return Block(cfg, MLPConfig(16, 32), rngs=nnx.Rngs(0))


def test_parameters_carry_logical_axes_resolved_by_the_rules():
  abstract = nnx.eval_shape(block_factory)           # creation needs no mesh
  with nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
    specs = nnx.get_partition_spec(nnx.state(abstract, nnx.Param))
  flat = dict(nnx.to_flat_state(specs))
  spec = lambda *path: flat[path].get_value()
  assert spec("mixer", "qkv", "q_proj", "kernel") == P(None, "model", None)
  assert spec("mixer", "out", "proj", "kernel") == P("model", None, None)
  assert spec("mixer", "router", "kernel") == P(None, None)
  assert spec("mixer", "qkv", "k_conv", "kernel") == P(None, "model", None)
  assert spec("mlp", "up", "kernel") == P(None, "model")
  assert spec("mlp", "down", "kernel") == P("model", None)
  names = [v.get_metadata().get("out_sharding")
           for _, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))]
  assert all(n is not None for n in names), "every parameter names its axes"


def test_created_under_a_mesh_parameters_are_sharded():
  mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
    mlp = SwiGLU(MLPConfig(16, 32), rngs=nnx.Rngs(0))
  sharding = mlp.up.kernel[...].sharding
  assert isinstance(sharding, NamedSharding) and sharding.spec == P(None, "model")
