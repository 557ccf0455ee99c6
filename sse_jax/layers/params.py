"""Parameters with logical-axis sharding names, and the einsum projection.

Every parameter records logical axis names (`out_sharding` metadata), e.g. a query
kernel [D, H, Dk] is ("embed", "heads", "head_dim"). A training loop maps them to
mesh axes with `nnx.logical_axis_rules(LOGICAL_AXIS_RULES)` and
`nnx.get_named_sharding(state, mesh)`.

Creation works with no mesh: flax 0.12 shards a variable eagerly at creation when
`nnx.using_eager_sharding()` (the default), which raises without a mesh. We request
eager sharding only when a mesh is active (`jax.set_mesh`), so outside a mesh the
names are metadata only and under a mesh the variables are born sharded.

Logical axes used by the layers:
  "vocab"      V, vocabulary                "embed"     D, model width
  "mlp"        I, SwiGLU hidden width       "heads"     H, query / linear-attention heads
  "kv_heads"   attention key/value heads    "head_dim"  per-head feature dims
  "partitions" N (+1) SSE partitions        "lora"      low-rank bottlenecks (gate, LoRA)
  "conv"       short-convolution taps
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Initializer = Callable[..., jax.Array]

# Default rules for a mesh with "data" and "model" axes: tensor-parallel heads / MLP /
# vocabulary, everything else replicated. FSDP users add e.g. ("embed", "data").
LOGICAL_AXIS_RULES = (
    ("batch", "data"),
    ("vocab", "model"),
    ("embed", None),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("head_dim", None),
    ("partitions", None),
    ("lora", None),
    ("conv", None),
)

INIT_STD = 0.02  # normal(0, 0.02) for projections and embeddings, as in fla's models.
default_init = nnx.initializers.normal(INIT_STD)


def eager_sharding() -> bool:
  """Shard at creation only if flax asks for it and a mesh is there to shard on."""
  return nnx.using_eager_sharding() and not jax.sharding.get_abstract_mesh().empty


def param(rngs: nnx.Rngs | None, init: Initializer, shape: Sequence[int],
          names: Sequence[str | None], dtype) -> nnx.Param:
  """A parameter of `shape` in `dtype` with logical axis `names` (one per dim)."""
  if len(names) != len(shape):
    raise ValueError(f"sharding names {names} do not match shape {tuple(shape)}")
  key = rngs.params() if rngs is not None else jax.random.key(0)
  return nnx.Param(init(key, tuple(shape), dtype), out_sharding=tuple(names),
                   eager_sharding=eager_sharding())


def ones(shape: Sequence[int], names: Sequence[str | None], dtype) -> nnx.Param:
  return param(None, nnx.initializers.ones_init(), shape, names, dtype)


def zeros(shape: Sequence[int], names: Sequence[str | None], dtype) -> nnx.Param:
  return param(None, nnx.initializers.zeros_init(), shape, names, dtype)


class Einsum(nnx.Module):
  """y = einsum(eqn, x, W) in the compute dtype, W of `shape` in `param_dtype`.

  For instance eqn "btd,dhk->bthk" with shape [D, H, Dk] maps x [B, T, D] to
  [B, T, H, Dk].
  """

  def __init__(self, eqn: str, shape: Sequence[int], names: Sequence[str | None], *,
               rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
               init: Initializer = default_init):
    self.eqn = eqn
    self.dtype = dtype
    self.kernel = param(rngs, init, shape, names, param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return jnp.einsum(self.eqn, x.astype(self.dtype), self.kernel[...].astype(self.dtype))
