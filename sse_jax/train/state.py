"""The train state, the device mesh and where every array lives.

    TrainState(step int32 [], params {path: fp32 array}, opt_state (optax), rng uint32 [2])

params is the model's `nnx.Param` state as a pure nested dict (`nnx.to_pure_dict`): plain
dicts survive flax version changes in checkpoints, and `nnx.merge(graphdef, params)`
rebuilds the module inside the step. rng is raw key data (checkpointable as is); the
current models have no dropout, so nothing draws from it yet.

Mesh: `jax.make_mesh((data, model), ("data", "model"))` with Auto axis types (GSPMD
propagation; Explicit axes would make sharding part of every type and reject ops such as
contractions over sharded dims). Parameters are laid out by the model's logical axis names
through `LOGICAL_AXIS_RULES` (vocab / mlp / heads on "model", the rest replicated, so the
"data" axis is pure data parallelism); Adam moments follow their parameters; step, rng and
the schedule count are replicated; batches are split along "data" on their first dim.
"""

from __future__ import annotations

import contextlib

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from sse_jax.layers import LOGICAL_AXIS_RULES
from sse_jax.model import LanguageModel, ModelConfig


class TrainState(NamedTuple):
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array


def make_mesh(data: int, model: int) -> jax.sharding.Mesh:
  """("data", "model") mesh over all devices; data = -1 takes what `model` leaves."""
  count = jax.device_count()
  if data == -1:
    if count % model:
      raise ValueError(f"mesh.model={model} does not divide the {count} devices")
    data = count // model
  if data * model != count:
    raise ValueError(f"mesh data={data} x model={model} = {data * model} devices, but "
                     f"there are {count} (set mesh.data=-1 to use them all)")
  return jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def new_model(config: ModelConfig, seed: int, dtype, param_dtype) -> LanguageModel:
  return LanguageModel(config, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype)


def split_model(model: LanguageModel) -> tuple[nnx.GraphDef, dict]:
  """(graphdef, params as a pure dict); the train state holds only nnx.Param."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if jax.tree.leaves(rest):
    raise NotImplementedError(
        f"the trainer keeps only nnx.Param in its state; the model also has "
        f"{sorted(map(str, nnx.to_flat_state(rest).paths))}")
  return graphdef, nnx.to_pure_dict(params)


def param_shardings(abstract: LanguageModel, mesh) -> dict:
  """NamedSharding per parameter from its logical axis names (pure dict)."""
  with nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
    specs = nnx.get_partition_spec(nnx.state(abstract, nnx.Param))
  specs = nnx.to_pure_dict(specs)
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                      is_leaf=lambda x: isinstance(x, P))


def state_shardings(tx: optax.GradientTransformation, abstract_state: TrainState,
                    params_sharding: dict, mesh) -> TrainState:
  """Shardings of the whole state: optimizer leaves shaped like a parameter take its
  sharding (optax.tree_map_params knows which), everything else is replicated."""
  replicated = NamedSharding(mesh, P())
  opt = optax.tree_map_params(
      tx, lambda _, sharding: sharding, abstract_state.opt_state, params_sharding,
      transform_non_params=lambda _: replicated,
      is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  return TrainState(step=replicated, params=params_sharding, opt_state=opt, rng=replicated)


@contextlib.contextmanager
def rng_kernel_lowering(enabled: bool = True):
  """Lowers jax.random's threefry draws to one GPU kernel call each while active.

  By default XLA inlines every draw's hash rounds into its own fusion; an initialiser
  makes hundreds of draws, and compiling them all is what made a 125M model's
  `jit(init_state)` take minutes on the GPU (`python -m experiments.init_compile`
  measures both lowerings). The kernel computes the same threefry2x32 bits. No effect
  on CPU, or where the installed JAX has no such option.
  """
  name = "jax_threefry_gpu_kernel_lowering"
  before = getattr(jax.config, name, None)
  if before is None:
    yield
    return
  jax.config.update(name, enabled)
  try:
    yield
  finally:
    jax.config.update(name, before)


def init_state(model_config: ModelConfig, tx: optax.GradientTransformation, seed: int,
               dtype, param_dtype) -> TrainState:
  """A fresh state (traceable: run under jit with out_shardings to create it sharded)."""
  _, params = split_model(new_model(model_config, seed, dtype, param_dtype))
  rng = jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 1))
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=tx.init(params), rng=rng)


def abstract_with_shardings(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs that carry the target sharding (what orbax restores into)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)
