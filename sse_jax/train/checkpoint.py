"""Checkpoints: the train state, the data iterator's position and a JSON record, per step.

    workdir/checkpoints/<step>/state   TrainState (orbax StandardSave; sharded arrays)
                              /data    grain iterator state, one JSON file per process
                              /meta    {"fingerprint": the config fields a resume must
                                        keep, "process_count", "step", "host": the
                                        trainer's host-side accumulators}

Saves are asynchronous (orbax copies the arrays off the device before `save` returns,
so the state can be donated to the next step right away). Restoring compares the meta
record with the current config first, so a checkpoint of another model, data stream or
optimizer is refused with the list of differing fields instead of orbax's shape error or,
worse, a silent reinterpretation (grain's state is only a position; orbax casts dtypes
without a word). Anything orbax or grain cannot read is re-raised as CheckpointError
naming the checkpoint directory and the step.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from sse_jax.train import config as config_lib
from sse_jax.train.state import TrainState

FORMAT = 1
ITEMS = ("state", "data", "meta")


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be resumed: unreadable, corrupt, or from another run."""


def _ocp():
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp


def _grain_checkpoint():
  import grain  # pylint: disable=g-import-not-at-top
  return grain.checkpoint


class Checkpoints:
  """orbax CheckpointManager over workdir/checkpoints keeping the latest `keep` steps."""

  def __init__(self, workdir: str, keep: int):
    ocp = _ocp()
    self.workdir = workdir
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    """The steps saved completely (a save cut short leaves only a temporary folder)."""
    return sorted(self.manager.all_steps())

  def discard_after(self, step: int) -> list[int]:
    """Deletes the checkpoints later than `step`; returns their steps."""
    later = [s for s in self.all_steps() if s > step]
    for s in later:
      self.manager.delete(s)
    return later

  def save(self, step: int, state: TrainState, data_iterator, host: dict[str, Any],
           fingerprint: dict[str, Any]) -> None:
    ocp = _ocp()
    meta = {"format": FORMAT, "step": step, "process_count": jax.process_count(),
            "fingerprint": fingerprint, "host": host}
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state._asdict()),
        data=_grain_checkpoint().CheckpointSave(data_iterator),
        meta=ocp.args.JsonSave(meta))
    self.manager.save(step, args=args, force=True)

  def _fail(self, step: int, what: str, cause: BaseException | None = None):
    others = [s for s in self.all_steps() if s != step]
    hint = (f" Other steps there: {others}; move the bad one away to resume from "
            "them," if others else "") + " or start in a new workdir."
    error = CheckpointError(
        f"cannot resume from {self.directory}/{step} (workdir {self.workdir}): {what}.{hint}")
    if cause is None:
      raise error
    raise error from cause

  def read_meta(self, step: int) -> dict[str, Any]:
    # Look before asking orbax: on a directory that is no checkpoint at all it fails
    # deep inside its async machinery.
    found = sorted(os.listdir(os.path.join(self.directory, str(step))))
    missing = [item for item in ITEMS if item not in found]
    if missing:
      self._fail(step, f"it is not a trainer checkpoint: no {missing} item (found {found})")
    try:
      meta = self.manager.restore(step, args=_ocp().args.Composite(
          meta=_ocp().args.JsonRestore())).meta
    except Exception as e:  # pylint: disable=broad-except
      self._fail(step, f"its meta record is unreadable ({type(e).__name__}: {e})", e)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
      self._fail(step, f"its meta record is not a format-{FORMAT} trainer record: {meta!r}")
    return meta

  def check(self, step: int, meta: dict[str, Any], fingerprint: dict[str, Any],
            data: bool = True) -> None:
    """Raises CheckpointError if the checkpoint belongs to another run (or, with `data`,
    if its data position cannot be resumed by this many processes)."""
    differences = config_lib.diff(meta["fingerprint"], fingerprint)
    if differences:
      self._fail(step, "the config differs from the checkpoint's: " + "; ".join(differences))
    if data and meta["process_count"] != jax.process_count():
      self._fail(step, f"it was written by {meta['process_count']} processes, this run has "
                 f"{jax.process_count()} (the data position is per process)")

  def restore(self, step: int, target: TrainState, data_iterator=None) -> TrainState:
    """The state at `step` laid out as `target` (ShapeDtypeStructs with shardings); moves
    `data_iterator` (if given) to where it was when the checkpoint was written."""
    ocp = _ocp()
    self._check_stored_arrays(step, target)
    items = {"state": ocp.args.StandardRestore(target._asdict())}
    if data_iterator is not None:
      items["data"] = _grain_checkpoint().CheckpointRestore(data_iterator)
    args = ocp.args.Composite(**items)
    try:
      restored = self.manager.restore(step, args=args)
    except Exception as e:  # pylint: disable=broad-except
      self._fail(step, f"orbax/grain could not read it ({type(e).__name__}: {e})", e)
    return TrainState(**restored.state)

  def _check_stored_arrays(self, step: int, target: TrainState) -> None:
    """Compares the shapes and dtypes orbax recorded for `step` with the target's.

    Restoring does not do it for us: orbax casts a stored array to the target's dtype
    (a float32 checkpoint comes back as bf16 without a word). The config fingerprint
    already refuses another param_dtype or model; this catches the rest (e.g. a state
    layout changed by the code between save and resume).
    """
    try:
      from etils import epath  # pylint: disable=g-import-not-at-top  (orbax's own)
      stored = _ocp().StandardCheckpointHandler().metadata(
          epath.Path(self.directory) / str(step) / "state").tree
    except Exception as e:  # pylint: disable=broad-except
      self._fail(step, f"orbax could not read its array metadata ({type(e).__name__}: "
                 f"{e})", e)
    have = dict(zip(*_paths_and_leaves(stored)))
    for path, want in zip(*_paths_and_leaves(target._asdict())):
      got = have.pop(path, None)
      if got is None:
        self._fail(step, f"it has no array {path} (the state to restore has "
                   f"{want.dtype}{list(want.shape)})")
      if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        self._fail(step, f"{path} is stored as {got.dtype}{list(got.shape)}, the state "
                   f"to restore has {want.dtype}{list(want.shape)}")
    if have:
      self._fail(step, f"it holds arrays the state to restore lacks: {sorted(have)[:5]}")

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def load_state(config, workdir: str, step: int | None = None) -> tuple[TrainState, int]:
  """(state, step) of a run's checkpoint (the latest by default), checked against
  `config` and laid out on this process's devices as training would lay it out."""
  from sse_jax.train import program as program_lib  # pylint: disable=g-import-not-at-top
  config_lib.validate(config)
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  if not os.path.isdir(directory):
    raise CheckpointError(f"no checkpoints in workdir {workdir} ({directory} is missing)")
  program = program_lib.build(config)
  checkpoints = Checkpoints(workdir, keep=1 << 30)
  try:
    step = checkpoints.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no checkpoint in {checkpoints.directory} (workdir {workdir})")
    saved = checkpoints.all_steps()
    if step not in saved:
      raise CheckpointError(f"no checkpoint of step {step} in {checkpoints.directory}; "
                            f"steps there: {saved}")
    checkpoints.check(step, checkpoints.read_meta(step), config_lib.fingerprint(config),
                      data=False)
    return checkpoints.restore(step, program.restore_target()), step
  finally:
    checkpoints.close()


def _paths_and_leaves(tree) -> tuple[list[str], list[Any]]:
  """Leaves with their paths as "a/b/0" (key names only, so that the state's pytree and
  orbax's metadata tree of it, built from other node types, give the same paths)."""
  def name(entry):
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        return str(getattr(entry, attr))
    return str(entry)
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return (["/".join(name(e) for e in path) for path, _ in flat],
          [leaf for _, leaf in flat])
