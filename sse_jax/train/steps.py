"""The jitted train and eval steps.

    train_step(state, batch) -> (state, metrics)   state donated; metrics replicated scalars
    eval_step(params, batch) -> sums              replicated (see metrics.eval_sums)

Both are `jax.jit` with explicit in/out shardings (the state's layout in and out, the
batch split on "data"), so the compiled program does not depend on where the inputs
happen to live. Trace and call them inside `jax.set_mesh(mesh)`: ops that shard_map
themselves over the mesh (ops.sse / ops.gla per data shard) find the mesh there.
"""

from __future__ import annotations

from typing import Callable

import jax
import optax
from flax import nnx

from sse_jax.train import metrics as metrics_lib
from sse_jax.train.state import TrainState


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, state_sharding: TrainState, batch_sharding,
                    replicated) -> Callable:
  """loss = CE on weighted positions + aux_loss; grads w.r.t. the fp32 params (the model
  casts them to the compute dtype inside); one optax update."""

  def loss_fn(params, batch):
    out = nnx.merge(graphdef, params)(batch["inputs"])
    m = metrics_lib.train_metrics(out, batch)
    return m["loss"], m

  def step(state: TrainState, batch):
    (_, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    m = {**m, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step)}
    return TrainState(state.step + 1, params, opt_state, state.rng), m

  return jax.jit(step, in_shardings=(state_sharding, batch_sharding),
                 out_shardings=(state_sharding, replicated), donate_argnums=0)


def make_eval_step(graphdef: nnx.GraphDef, params_sharding, batch_sharding,
                   replicated) -> Callable:
  def step(params, batch):
    return metrics_lib.eval_sums(nnx.merge(graphdef, params)(batch["inputs"]), batch)

  return jax.jit(step, in_shardings=(params_sharding, batch_sharding),
                 out_shardings=replicated)
