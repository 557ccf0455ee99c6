"""Everything compiled for a run, built from the config: `build(config) -> Program`.

    program = build(config)
    with jax.set_mesh(program.mesh):
      state = program.init()                                   # born sharded
      state, m = program.train_step(state, program.global_batch(local_batch))
      sums = program.eval_step(state.params, program.global_batch(local_batch))

`global_batch` turns this process's numpy batch [B / processes, T] into a global array
split on "data". `abstract_state` / `state_sharding` describe the state without
allocating it (for checkpoint restore and for lowering the step, e.g. to read its HLO).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from sse_jax.model import ModelConfig
from sse_jax.train import config as config_lib
from sse_jax.train import optim, state as state_lib, steps


class Program(NamedTuple):
  mesh: jax.sharding.Mesh
  model_config: ModelConfig
  graphdef: nnx.GraphDef
  abstract_state: state_lib.TrainState     # ShapeDtypeStructs
  state_sharding: state_lib.TrainState     # NamedShardings
  batch_sharding: NamedSharding
  init: Callable[[], state_lib.TrainState]
  train_step: Callable
  eval_step: Callable

  def global_batch(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows of a batch -> global arrays split on "data"."""
    return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
            for k, v in local.items()}

  def abstract_batch(self, seq_len: int, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch's shapes (to lower the steps without data)."""
    shape, sh = (batch_size, seq_len), self.batch_sharding
    return {"inputs": jax.ShapeDtypeStruct(shape, np.int32, sharding=sh),
            "targets": jax.ShapeDtypeStruct(shape, np.int32, sharding=sh),
            "weights": jax.ShapeDtypeStruct(shape, np.float32, sharding=sh)}

  def restore_target(self) -> state_lib.TrainState:
    return state_lib.abstract_with_shardings(self.abstract_state, self.state_sharding)


def initialiser(config, model_config: ModelConfig, tx: optax.GradientTransformation
                ) -> Callable[[], state_lib.TrainState]:
  """`state.init_state` bound to the config's model, optimizer, seed and dtypes (what
  `build` jits into `Program.init`)."""
  dtypes = config_lib.DTYPES
  return functools.partial(state_lib.init_state, model_config, tx, config.seed,
                           dtypes[config.compute_dtype], dtypes[config.param_dtype])


def build(config) -> Program:
  """Mesh, model, optimizer, shardings and jitted steps for a validated config."""
  mesh = state_lib.make_mesh(config.mesh.data, config.mesh.model)
  data_size = mesh.shape["data"]
  if config.batch_size % data_size:
    raise ValueError(f"batch_size={config.batch_size} must be a multiple of the "
                     f"{data_size} devices on the data axis")
  model_config = config_lib.model_config(config)
  dtype = config_lib.DTYPES[config.compute_dtype]
  param_dtype = config_lib.DTYPES[config.param_dtype]
  tx = optim.optimizer(config)
  init = initialiser(config, model_config, tx)
  # Variables are created unsharded and placed by out_shardings: no mesh needed while
  # the model is built, and one layout rule (the logical names) for init and restore.
  with nnx.use_eager_sharding(False):
    abstract_model = nnx.eval_shape(
        lambda: state_lib.new_model(model_config, config.seed, dtype, param_dtype))
    graphdef, _ = state_lib.split_model(abstract_model)
    abstract_state = jax.eval_shape(init)
  params_sharding = state_lib.param_shardings(abstract_model, mesh)
  state_sharding = state_lib.state_shardings(tx, abstract_state, params_sharding, mesh)
  replicated = NamedSharding(mesh, P())
  batch_sharding = NamedSharding(mesh, P("data"))
  jit_init = jax.jit(init, out_shardings=state_sharding)

  def sharded_init() -> state_lib.TrainState:
    with nnx.use_eager_sharding(False), state_lib.rng_kernel_lowering():
      return jit_init()

  train_step = steps.make_train_step(graphdef, tx, optim.schedule(config), state_sharding,
                                     batch_sharding, replicated)
  recall = config_lib.eval_data_config(config)["kind"] == "mqar"
  eval_step = steps.make_eval_step(graphdef, params_sharding, batch_sharding, replicated,
                                   recall=recall)
  return Program(mesh, model_config, graphdef, abstract_state, state_sharding,
                 batch_sharding, sharded_init, train_step, eval_step)
