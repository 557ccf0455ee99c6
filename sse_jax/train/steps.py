"""The jitted train and eval steps.

    train_step(state, batch) -> (state, metrics)   state donated; metrics replicated scalars
    eval_step(params, batch) -> sums              replicated (see metrics.eval_sums)

Both are `jax.jit` with explicit in/out shardings (the state's layout in and out, the
batch split on "data"), so the compiled program does not depend on where the inputs
happen to live. Trace and call them inside `jax.set_mesh(mesh)`: ops that shard_map
themselves over the mesh (ops.sse / ops.gla per data shard) find the mesh there.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from sse_jax.data import PAD_ID
from sse_jax.train import metrics as metrics_lib
from sse_jax.train.state import TrainState


def forward(graphdef: nnx.GraphDef, params, batch):
  """The model on batch["inputs"]; PAD tokens (id 0 in every data source) are left out
  of the load-balance loss and the router statistics."""
  return nnx.merge(graphdef, params)(batch["inputs"],
                                     token_mask=batch["inputs"] != PAD_ID)


OPTIMIZER_SCOPE = "optimizer"


def _update(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
            schedule: optax.Schedule) -> Callable:
  """update(state, batch, lr_scale=None) -> (state, metrics): loss = CE on weighted
  positions + aux_loss; grads w.r.t. the fp32 params (the model casts them to the
  compute dtype inside); one optax update, multiplied by lr_scale when given."""

  def loss_fn(params, batch):
    out = forward(graphdef, params, batch)
    m = metrics_lib.train_metrics(out, batch)
    return m["loss"], m

  def update(state: TrainState, batch, lr_scale=None):
    (_, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
    # The scope names the optimizer's ops in the compiled program (optax's own frames
    # are hidden from JAX's source info), so a profile can tell them apart.
    with jax.named_scope(OPTIMIZER_SCOPE):
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      lr = schedule(state.step)
      if lr_scale is not None:
        updates = jax.tree.map(lambda u: (lr_scale * u).astype(u.dtype), updates)
        lr = lr_scale * lr
      params = optax.apply_updates(state.params, updates)
      m = {**m, "grad_norm": optax.tree.norm(grads), "lr": lr}
    return TrainState(state.step + 1, params, opt_state, state.rng), m

  return update


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, state_sharding: TrainState, batch_sharding,
                    replicated) -> Callable:
  """train_step(state, batch) -> (state, metrics): one update (see `_update`)."""
  return jax.jit(_update(graphdef, tx, schedule),
                 in_shardings=(state_sharding, batch_sharding),
                 out_shardings=(state_sharding, replicated), donate_argnums=0)


def make_stacked_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                            schedule: optax.Schedule, state_sharding: TrainState,
                            batch_sharding, stack_sharding) -> Callable:
  """step(states, batches, lrs) -> (states, metrics) for M runs of one model at once.

  states / batches: a run's TrainState / batch with a leading run axis [M, ...];
  lrs [M]. tx and schedule are built for lr = 1: AdamW's update (weight decay
  included) and the warm-up + cosine schedule are linear in the peak lr, so scaling
  run m's update by lrs[m] is its own optimizer, up to rounding. The shardings are the
  stacked ones (`stack_shardings`): the run axis replicated, the rest as in one run.
  """
  step = jax.vmap(_update(graphdef, tx, schedule))
  return jax.jit(step, in_shardings=(state_sharding, batch_sharding, stack_sharding),
                 out_shardings=(state_sharding, stack_sharding), donate_argnums=0)


def stack_shardings(tree: Any) -> Any:
  """NamedShardings with a leading, replicated run axis: P(a, b) -> P(None, a, b)."""
  return jax.tree.map(lambda s: NamedSharding(s.mesh, P(None, *s.spec)), tree,
                      is_leaf=lambda x: isinstance(x, NamedSharding))


def make_eval_step(graphdef: nnx.GraphDef, params_sharding, batch_sharding,
                   replicated, *, recall: bool = False) -> Callable:
  """eval_step(params, batch) -> metrics.eval_sums; `recall` (MQAR data): also the
  routers' write / read agreement on the key-value pairs (`metrics.route_agreement`)."""
  def step(params, batch):
    return metrics_lib.eval_sums(forward(graphdef, params, batch), batch, recall=recall)

  return jax.jit(step, in_shardings=(params_sharding, batch_sharding),
                 out_shardings=replicated)
