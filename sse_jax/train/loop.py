"""`train_and_evaluate(config, workdir)`: train (or resume), evaluate, log, checkpoint.

One step s = 1..num_steps: read batch s -> jitted train step (state donated) -> at the
step's boundaries, in this order: log (every log_every), evaluate (every eval_every),
checkpoint (every checkpoint_every); all three also at num_steps. The step's metrics
are fetched one step late (after the next step is dispatched) so the host never idles
the device, except at boundaries, where they are fetched at once: a non-finite loss or
gradient norm stops the run with NonFiniteLossError before it can be checkpointed.

Resuming: if workdir/checkpoints has a step, the state, the data iterator and the
host-side accumulators (partial log and eval windows) are restored from the latest, after
checking that its files are intact (checksums recorded when it was saved) and that it
belongs to this config (see checkpoint.py); the run then computes exactly what the
uninterrupted run would have (bitwise on CPU), and metrics.jsonl reads as one run. A
finished run returns its summary without training. A checkpoint that cannot be saved
(disk full, read-only) stops the run with a CheckpointError as soon as it is noticed
(single process: at the next step).

`Run` holds one run's host side; `train_lockstep` is the step loop above, for one run
or for several stepped together (`sse_jax.train.stacked`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from typing import Any, Callable

import jax
import numpy as np

from sse_jax.model import count_params
from sse_jax.train import config as config_lib
from sse_jax.train import metrics as metrics_lib
from sse_jax.train import program as program_lib
from sse_jax.train.checkpoint import CheckpointError, Checkpoints
from sse_jax.train.logs import MetricsLog, Progress

CHECKED = ("loss", "grad_norm")  # a non-finite value of these stops the run


class NonFiniteLossError(FloatingPointError):
  """The loss (or the gradient norm) became inf / NaN."""


def _as_config(config):
  import ml_collections  # pylint: disable=g-import-not-at-top
  if isinstance(config, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict)):
    return config
  return ml_collections.ConfigDict(dict(config))


def _datasets(config):
  """(training stream, validation stream, {P: (test set, batches)} of `eval_pairs`)."""
  from sse_jax.data import make_dataset, make_source  # pylint: disable=g-import-not-at-top
  train = make_dataset(make_source(config.data), batch_size=config.batch_size,
                       seed=config.seed, shuffle=True, num_workers=config.data_workers)
  # The same shuffled subset of the eval stream every time (one pass, no repeats).
  evals = make_dataset(make_source(config_lib.eval_data_config(config)),
                       batch_size=config.batch_size, seed=config.seed, shuffle=True,
                       num_epochs=1)
  tests = {}
  for p in config.eval_pairs:
    # Unshuffled: the same test examples for every run and seed.
    test = config_lib.test_config(config_lib.eval_data_config(config), p)
    tests[int(p)] = (make_dataset(make_source(test), batch_size=config.batch_size,
                                  seed=0, shuffle=False, num_epochs=1),
                     config_lib.test_batches(config, test))
  return train, evals, tests


def fresh_host() -> dict[str, Any]:
  """Host-side accumulators; checkpointed so that a resumed run logs the same numbers."""
  return {"log_sums": {}, "log_count": 0, "eval_loss_sum": 0.0, "eval_count": 0}


class Run:
  """One training run's host side: config, data iterators, checkpoints, logs and
  accumulators, and its `state` (kept current by `train_lockstep`'s sync)."""

  def __init__(self, config, workdir: str, program: program_lib.Program):
    self.config = config
    self.workdir = workdir
    self.program = program
    self.started = time.time()
    self.lead = jax.process_index() == 0
    self.fingerprint = config_lib.fingerprint(config)
    self.train_ds, self.eval_ds, self.test_sets = _datasets(config)
    self.train_iter = iter(self.train_ds)
    self.checkpoints = Checkpoints(workdir, config.keep_checkpoints)
    self.train_bytes = config.data.kind != "mqar"
    self.eval_bytes = config_lib.eval_data_config(config)["kind"] != "mqar"
    # The routed layers (SSE and MoM) in the order of the model's router outputs: each
    # gets usage statistics and, on MQAR, write / read agreement.
    self.routed = program.model_config.routed_layers
    self.tokens_per_step = None
    self.timed_steps = 0       # steps after the first of this invocation (no compile)
    self.timed_seconds = 0.0   # their seconds, eval and checkpoints left out
    self.log = None

  # --- start ---------------------------------------------------------------------------

  def start(self, step: int | None = None):
    """Restores the checkpoint of `step` (None: the latest), or initialises the state
    when there is none."""
    if step is None:
      step = self.checkpoints.latest_step()
    if step is None:
      self.state, self.host, self.step = self.program.init(), fresh_host(), 0
    else:
      meta = self.checkpoints.read_meta(step)
      self.checkpoints.check(step, meta, self.fingerprint)
      self.state = self.checkpoints.restore(step, self.program.restore_target(),
                                            self.train_iter)
      self.host, self.step = meta["host"], step
    self.resumed_from = step
    self.log = MetricsLog(self.workdir, self.lead, step)
    self.progress = Progress(self.config.num_steps, self.lead and self.config.progress)
    if self.lead:
      with open(os.path.join(self.workdir, "config.json"), "w") as f:
        f.write(self.config.to_json_best_effort(indent=2, sort_keys=True) + "\n")

  # --- per step ------------------------------------------------------------------------

  def local_batch(self, read: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """This process's rows of the next training batch (checked against the vocab once);
    `read`: that batch, already read by a run sharing this run's iterator."""
    local = next(self.train_iter) if read is None else read
    if self.tokens_per_step is None:
      self.tokens_per_step = self.config.batch_size * local["inputs"].shape[1]
      vocab = self.program.model_config.vocab_size
      top = max(int(local["inputs"].max()), int(local["targets"].max()))
      if top >= vocab:
        raise ValueError(f"the data has token id {top} but model vocab_size={vocab}")
    return local

  def advance(self):
    """One train step of this run alone; returns its metrics, still on the device."""
    self.state, device_metrics = self.program.train_step(
        self.state, self.program.global_batch(self.local_batch()))
    return device_metrics

  def settle(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
    """Takes one step's metrics (host copies), stops on non-finite values, adds them to
    the windows."""
    m = {k: float(v) for k, v in metrics.items()}
    for name in CHECKED:
      if not math.isfinite(m[name]):
        self.non_finite(step, name, m)
    sums = self.host["log_sums"]
    for k, v in m.items():
      sums[k] = sums.get(k, 0.0) + v
    self.host["log_count"] += 1
    self.host["eval_loss_sum"] += m["loss"]
    self.host["eval_count"] += 1
    return m

  def non_finite(self, step: int, name: str, m: dict[str, float]):
    values = ", ".join(f"{k}={m[k]:.6g}" for k in ("loss", "ce", "aux_loss", "grad_norm", "lr"))
    self.checkpoints.wait()  # so that the step named below is on disk
    latest = self.checkpoints.latest_step()
    where = (f"the last checkpoint is step {latest} in {self.checkpoints.directory}"
             if latest is not None else "no checkpoint was written")
    message = (f"non-finite {name} ({m[name]}) at step {step}: {values}. Training stopped; "
               f"{where}. Lower lr / raise warmup_steps, or check the data.")
    self.log.write({"kind": "error", "step": step, "message": message})
    raise NonFiniteLossError(message)

  def due(self, step: int, every: int) -> bool:
    return step == self.config.num_steps or (every > 0 and step % every == 0)

  # --- boundaries ----------------------------------------------------------------------

  def log_train(self, step: int, timed_steps: int, timed_seconds: float,
                first_step_s: float | None = None):
    """Writes the window's record and progress line. The rates are timed_steps /
    timed_seconds: the window's steps and seconds with this invocation's first step (it
    compiles) and eval / checkpoint time left out; a window of that step alone has no
    rates (first_step_s: how long it took)."""
    count = self.host["log_count"]
    if not count:
      return
    record = {"kind": "train", "step": step}
    record.update({k: v / count for k, v in sorted(self.host["log_sums"].items())})
    if self.train_bytes:
      record["bpb"] = record["ce"] / math.log(2.0)
    rate = None
    if timed_steps > 0:
      rate = timed_steps / timed_seconds if timed_seconds > 0 else 0.0
      record.update(steps_per_s=rate, tokens_per_s=rate * self.tokens_per_step)
    record["time"] = time.time() - self.started
    self.log.write(record)
    self.progress.update(step, record["loss"], rate,
                         None if rate is None else rate * self.tokens_per_step, first_step_s)
    self.host["log_sums"], self.host["log_count"] = {}, 0

  def _sums(self, params, dataset, batches: int) -> list[dict[str, Any]]:
    iterator = iter(dataset)
    sums = [self.program.eval_step(params, self.program.global_batch(local))
            for local in itertools.islice(iterator, batches)]
    del iterator  # stops grain's prefetch threads now rather than at interpreter exit
    return jax.device_get(sums)

  def evaluate(self, params) -> dict[str, Any]:
    """The validation stream's metrics, and `by_pairs` {P: accuracy, loss, answers} on
    the test sets of `eval_pairs` (if any)."""
    out = metrics_lib.finish_eval(self._sums(params, self.eval_ds, self.config.eval_batches),
                                  self.routed, self.eval_bytes)
    if self.test_sets:
      out["by_pairs"] = {}
      for p, (dataset, batches) in self.test_sets.items():
        m = metrics_lib.finish_eval(self._sums(params, dataset, batches), self.routed, False)
        out["by_pairs"][str(p)] = {
            "accuracy": m["accuracy"], "loss": m["loss"], "answers": m["tokens_scored"],
            "agreement": [r.get("agreement") for r in m["router"]]}
    return out

  def eval_and_log(self, step: int):
    count = self.host["eval_count"]
    record = {"kind": "eval", "step": step,
              "train_loss": self.host["eval_loss_sum"] / count if count else None}
    record.update(self.evaluate(self.state.params))
    record["time"] = time.time() - self.started
    self.log.write(record)
    self.host["eval_loss_sum"], self.host["eval_count"] = 0.0, 0

  # --- the end -------------------------------------------------------------------------

  def summary(self) -> dict[str, Any]:
    count = count_params(self.program.model_config)
    timed = self.timed_steps > 0 and self.timed_seconds > 0
    rate = self.timed_steps / self.timed_seconds if timed else None
    return {
        "step": self.step, "finished": self.step >= self.config.num_steps,
        "train": self.log.last("train"), "eval": self.log.last("eval"),
        "history": self.log.history(),
        "wall_time_s": time.time() - self.started,
        "steps_per_s": rate,
        "tokens_per_s": rate * self.tokens_per_step if rate else None,
        "params": count.total, "params_non_embedding": count.non_embedding,
        "resumed_from": self.resumed_from, "processes": jax.process_count(),
        "devices": jax.device_count(), "mesh": dict(self.program.mesh.shape),
        "workdir": os.fspath(self.workdir),  # as given: a relative path stays relative
    }

  def close(self):
    self.checkpoints.close()
    if self.log is not None:
      self.log.close()
    del self.train_iter


def train_lockstep(runs: list[Run], advance: Callable[[], Any],
                   split: Callable[[Any], list[dict]], sync: Callable[[], None],
                   stop_after: int | None) -> None:
  """Steps `runs` together until num_steps (or stop_after): one run, or several whose
  states are stacked into one array tree (`sse_jax.train.stacked`).

  advance() dispatches one step of every run and returns its metrics, on the device;
  split(host copy of those) gives one dict of scalars per run; sync() brings each run's
  `state` up to date before it is evaluated or checkpointed. The runs share num_steps,
  log_every, eval_every and checkpoint_every, and start from the same step.
  """
  c = runs[0].config
  last = c.num_steps if stop_after is None else min(c.num_steps, stop_after)
  first = runs[0].step + 1
  step = runs[0].step
  pending = None
  started = window_start = timer = time.time()
  first_step_s = None  # the first step compiles: the timing starts at its end
  window_steps = 0  # steps of the window after the first step
  paused = pauses = 0.0  # eval and checkpoint seconds, kept out of the throughput

  def settle(at, metrics):
    for run, m in zip(runs, split(jax.device_get(metrics))):
      run.settle(at, m)

  while step < last:
    device_metrics = advance()
    step += 1
    window_steps += step > first
    for run in runs:
      run.step = step
      run.checkpoints.poll()  # a failed background save stops the run now
    if pending is not None:
      settle(*pending)
    pending = (step, device_metrics)
    log, ev, save = (runs[0].due(step, c.log_every), runs[0].due(step, c.eval_every),
                     runs[0].due(step, c.checkpoint_every))
    if not (log or ev or save or step in (first, last)):
      continue
    settle(*pending)
    pending = None
    if step == first:  # the first step compiles: time from its end
      window_start = timer = time.time()
      first_step_s = timer - started
    if log:
      for run in runs:
        run.log_train(step, window_steps, time.time() - window_start - paused,
                      first_step_s if step == first else None)
      window_start, window_steps, paused = time.time(), 0, 0.0
    t0 = time.time()
    if ev or save:
      sync()
    for run in runs:
      if ev:
        run.eval_and_log(step)
      if save:
        run.checkpoints.save(step, run.state, run.train_iter, run.host, run.fingerprint)
    paused += time.time() - t0
    pauses += time.time() - t0
  sync()
  for run in runs:
    run.timed_steps = max(step - first, 0)
    run.timed_seconds = time.time() - timer - pauses
    run.checkpoints.wait()


def prepare_workdir(workdir: str) -> None:
  """Creates `workdir` and checks that files can be written in it, so that a workdir
  under a file or on a read-only file system is one line now rather than a traceback
  from whichever writer comes first."""
  # One name per process: processes on other hosts may share the workdir (and a pid).
  probe = os.path.join(workdir, f".write_test.{jax.process_index()}.{os.getpid()}")
  doing = "creating it"
  try:
    os.makedirs(workdir, exist_ok=True)
    doing = "creating a file in it"
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as e:
    blocker = _file_in_the_way(workdir)
    why = (f"{blocker} is a file, not a directory" if blocker else
           f"{e.strerror or e} ({doing})")
    raise CheckpointError(f"cannot use workdir {workdir}: {why}") from None


def _file_in_the_way(path: str) -> str | None:
  """`path` or the first of its parents that exists, if that is not a directory."""
  path = os.path.abspath(path)
  while not os.path.exists(path):
    parent = os.path.dirname(path)
    if parent == path:
      return None
    path = parent
  return None if os.path.isdir(path) else path


def write_summary(run: Run, summary: dict[str, Any]) -> None:
  """workdir/summary.json, once the run is finished (its presence marks it done)."""
  if run.lead and summary["finished"]:
    with open(os.path.join(run.workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)


def _new_run(config, workdir: str) -> Run:
  """A Run of one config in a checked, writable workdir, its program built."""
  config = _as_config(config)
  config_lib.validate(config)
  prepare_workdir(workdir)
  return Run(config, workdir, program_lib.build(config))


def write_initial_checkpoint(config, workdir: str,
                             transform: Callable[[Any, program_lib.Program], Any]) -> None:
  """Saves step 0 of a run whose parameters do not start from its own init (e.g. a
  converted model): the init's state (step 0, fresh optimizer moments, rng) with params
  = transform(host copy of the init's params, program), the data iterator at its start
  and fresh accumulators. `train_and_evaluate` / `train_stacked` then resume from it like
  from any checkpoint (metrics.jsonl, the schedule and the data stream start at step 0).
  ValueError if the workdir has a checkpoint already."""
  run = _new_run(config, workdir)
  program = run.program
  try:
    if run.checkpoints.latest_step() is not None:
      raise ValueError(f"{workdir} has checkpoints already (step "
                       f"{run.checkpoints.latest_step()}): it would not start from step 0")
    with jax.set_mesh(program.mesh):
      state = program.init()
      params = transform(jax.device_get(state.params), program)
      state = state._replace(params=jax.device_put(params, program.state_sharding.params))
      run.checkpoints.save(0, state, run.train_iter, fresh_host(), run.fingerprint)
      run.checkpoints.wait()
  finally:
    run.close()


def train_and_evaluate(config, workdir: str, *, stop_after: int | None = None
                       ) -> dict[str, Any]:
  """Trains `config` (see `default_config`) in `workdir`, resuming from its latest
  checkpoint, and returns the summary (also written to workdir/summary.json):

    step, finished, train (last train record), eval (last eval record),
    history [{step, train_loss, eval_loss, eval_accuracy, ..., router}],
    wall_time_s (this invocation), steps_per_s / tokens_per_s (this invocation's steps
    after its first, which compiles; eval and checkpoint time left out),
    params (total count), params_non_embedding, resumed_from, processes, devices, mesh,
    workdir.

  stop_after: end this invocation after that global step as a preemption would (the
  periodic checkpoints stay; no final eval / checkpoint / summary.json); for tests and
  drills of the resume path.
  Raises NonFiniteLossError on a non-finite loss, CheckpointError on a checkpoint that
  cannot be resumed (another run's, damaged), a checkpoint that cannot be saved (the run
  stops there) or a workdir that cannot be written, ValueError on a bad config.
  """
  run = _new_run(config, workdir)
  try:
    with jax.set_mesh(run.program.mesh):
      run.start()
      train_lockstep([run], run.advance, lambda m: [m], lambda: None, stop_after)
    summary = run.summary()
  finally:
    run.close()
  write_summary(run, summary)
  return summary
