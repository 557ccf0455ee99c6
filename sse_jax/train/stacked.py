"""`train_stacked(configs, workdirs)`: several runs of one model, trained as one program.

    summaries = train_stacked([config_a, config_b], ["/tmp/a", "/tmp/b"])

The runs may differ in `lr` and `seed` only (a learning-rate sweep, seeds of one
configuration). Their states are stacked along a leading run axis [M, ...] and one
jitted step updates them all (`jax.vmap` of the single-run update; see
`steps.make_stacked_train_step`), so M small models cost about as many kernel launches
as one: on a GPU a 2-layer ablation model is launch-bound, and M processes sharing the
device only take turns.

Everything else is per run, exactly as `train_and_evaluate` writes it: each run reads
the data stream of its seed (runs of one seed share one iterator), and gets its own
metrics.jsonl, TensorBoard events, evaluations, checkpoints (its slice of the stacked
state, with its data-iterator state) and summary.json, so a run trained here resumes,
reports and compares like any other; its steps/s and tokens/s are those of the group's
steps (one step of every run), and the progress line is the first run's. The stacked
update equals the separate ones up to float rounding (the learning rate multiplies the
update instead of entering the optimizer; vmapped matmuls may sum in another order): a
stacked run is not bitwise the same as the run trained alone.

A non-finite loss or gradient norm in any run stops them all, with that run's
NonFiniteLossError (its message names the run's last checkpoint, if any).

Resuming: all runs resume from the newest step that every one of them has a checkpoint
of. They are usually at the same step, but a group stopped while saving can leave some
runs one checkpoint ahead: their later checkpoints are deleted (and said so) and the
group retrains those steps. If some runs have checkpoints and others none, or they share
no step, a ValueError names their steps (train them separately, or move checkpoints
away).
"""

from __future__ import annotations

from typing import Any, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from sse_jax.train import config as config_lib
from sse_jax.train import optim
from sse_jax.train import program as program_lib
from sse_jax.train import steps
from sse_jax.train.loop import (Run, _as_config, prepare_workdir, train_lockstep,
                                 write_summary)

VARYING = ("lr", "seed")  # the only fields stacked runs may differ in


def check_stackable(configs: Sequence[Any]) -> None:
  """ValueError unless the configs differ in VARYING fields only."""
  if not configs:
    raise ValueError("train_stacked needs at least one config")

  def rest(c):
    d = config_lib.to_dict(c)
    return {k: v for k, v in d.items() if k not in VARYING}

  first = rest(configs[0])
  for i, c in enumerate(configs[1:], 1):
    fields = [line.split(":")[0] for line in config_lib.diff(first, rest(c))]
    if fields:
      raise ValueError(f"stacked runs may differ only in {VARYING}; config {i} differs from "
                       f"config 0 in {', '.join(fields)}")


def common_step(runs: Sequence[Run]) -> int | None:
  """The newest checkpoint step every run has (None: no run has one)."""
  saved = [run.checkpoints.all_steps() for run in runs]
  if not any(saved):
    return None
  shared = set(saved[0]).intersection(*saved[1:])
  if not shared:
    raise ValueError("stacked runs must resume from a step they all have a checkpoint "
                     "of; their checkpoints are at " + ", ".join(
                         f"{r.workdir}: {s or 'none'}" for r, s in zip(runs, saved)))
  return max(shared)


def discard_later(runs: Sequence[Run], step: int | None):
  """Deletes the checkpoints after `step` of the runs ahead of the group (called once
  every run has restored `step`, so a refused checkpoint deletes nothing)."""
  if step is None:
    return
  for run in runs:
    later = run.checkpoints.discard_after(step)
    if later:
      logging.warning("%s: the group resumes from step %d, the newest checkpoint every "
                      "run has; deleted this run's later checkpoints %s", run.workdir, step,
                      later)


def _unit_lr(config) -> ml_collections.ConfigDict:
  unit = ml_collections.ConfigDict(config.to_dict())
  unit.lr = 1.0
  return unit


def train_stacked(configs: Sequence[Any], workdirs: Sequence[str], *,
                  stop_after: int | None = None) -> list[dict[str, Any]]:
  """Trains (or resumes) the runs `configs[m]` in `workdirs[m]` as one stacked program
  and returns their summaries (see `train_and_evaluate`; each also in its
  workdir/summary.json). stop_after: as in `train_and_evaluate`."""
  configs = [_as_config(c) for c in configs]
  if len(configs) != len(workdirs) or len(set(map(str, workdirs))) != len(workdirs):
    raise ValueError(f"need one distinct workdir per config: {len(configs)} configs, "
                     f"workdirs {list(workdirs)}")
  for c in configs:
    config_lib.validate(c)
  check_stackable(configs)
  for w in workdirs:
    prepare_workdir(str(w))
  # One program per run for its init (the seed) and checkpoint layout; all share the
  # first one's eval step, so it compiles once.
  programs = [program_lib.build(c) for c in configs]
  programs = [programs[0]] + [p._replace(eval_step=programs[0].eval_step)
                              for p in programs[1:]]
  base = programs[0]
  unit = _unit_lr(configs[0])
  state_sharding = steps.stack_shardings(base.state_sharding)
  batch_sharding = steps.stack_shardings(base.batch_sharding)
  stack_sharding = steps.stack_shardings(
      jax.sharding.NamedSharding(base.mesh, jax.sharding.PartitionSpec()))
  step_fn = steps.make_stacked_train_step(
      base.graphdef, optim.optimizer(unit), optim.schedule(unit), state_sharding,
      batch_sharding, stack_sharding)
  lrs = jax.device_put(np.asarray([c.lr for c in configs], np.float32), stack_sharding)
  runs = [Run(c, str(w), p) for c, w, p in zip(configs, workdirs, programs)]
  # Runs of one seed read the same data (the configs differ in lr and seed only): they
  # share the first one's iterator, read once per step, so a learning-rate sweep costs
  # the host no more input than one run. Its state is saved with each run's checkpoint.
  reader = [next(j for j, r in enumerate(runs) if r.config.seed == run.config.seed)
            for run in runs]
  for run, j in zip(runs, reader):
    run.train_iter = runs[j].train_iter
  try:
    with jax.set_mesh(base.mesh):
      step = common_step(runs)
      for run in runs:
        run.start(step)
      discard_later(runs, step)
      for run in runs[1:]:  # one progress line for the group (the first run's)
        run.progress.active = False
      stacked = jax.device_put(
          jax.tree.map(lambda *xs: jnp.stack(xs), *[r.state for r in runs]), state_sharding)
      for run in runs:
        run.state = None  # the stacked copy is the live one

      def advance():
        nonlocal stacked
        local = []
        for i, (run, j) in enumerate(zip(runs, reader)):
          local.append(run.local_batch(local[j] if j < i else None))
        batch = {k: jax.make_array_from_process_local_data(
            batch_sharding, np.stack([b[k] for b in local])) for k in local[0]}
        stacked, metrics = step_fn(stacked, batch, lrs)
        return metrics  # {name: [M]}

      def split(metrics):
        return [{k: v[i] for k, v in metrics.items()} for i in range(len(runs))]

      def sync():
        for i, run in enumerate(runs):
          run.state = jax.tree.map(lambda x, i=i: x[i], stacked)

      train_lockstep(runs, advance, split, sync, stop_after)
    summaries = [run.summary() for run in runs]
  finally:
    for run in runs:
      run.close()
  for run, summary in zip(runs, summaries):
    write_summary(run, summary)
  return summaries
