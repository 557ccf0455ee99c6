"""Checkpoints: the train state, the data iterator's position and a JSON record, per step.

    workdir/checkpoints/<step>/state     TrainState (orbax StandardSave; sharded arrays)
                              /data      grain iterator state, one JSON file per process
                              /meta      {"format", "fingerprint": the config fields a
                                          resume must keep, "process_count", "step",
                                          "host": the trainer's host-side accumulators}
                              /checksums.json   {"files": {path: [bytes, sha256]}} of the
                                          files above
    workdir/checkpoint_errors.log        the full text of checkpoint failures

Saves are asynchronous (orbax copies the arrays off the device before `save` returns,
so the state can be donated to the next step right away). Restoring compares the meta
record with the current config first, so a checkpoint of another model, data stream or
optimizer is refused with the list of differing fields instead of orbax's shape error or,
worse, a silent reinterpretation (grain's state is only a position; orbax casts dtypes
without a word).

Integrity. Neither orbax nor tensorstore checks what it reads back: bytes changed in an
array file decode to other numbers (Adam moments of 1e38, a run that later dies of a
non-finite loss with the wrong cause), a flipped bit to a run that silently ends
elsewhere. So every save records the size and sha256 of every file of the step, and
every restore checks them before anything of the step is read. Whole files rather than
per-array checksums in the meta record, because (1) that covers everything a restore
reads: orbax's metadata and OCDBT manifests and the data-iterator files as much as the
array bytes; (2) it is checked before orbax opens the step, so a damaged file never
reaches orbax's decoder; (3) it costs no device-to-host copy at save time: the files
orbax just wrote are read back and hashed in orbax's background save thread (its
post_finalization_callback), so training does not wait for it, as it does not wait for
the write (under a second per GB on one core; orbax waits for it only where it waits for
the write: at the next save or at the end of the run).
The manifest is written after orbax has written and finalized every item and before it
renames <step>.orbax-checkpoint-tmp to <step>, so it goes into place with the step:
there is no window in which a complete step lacks its manifest. A crash before the
rename leaves only the temporary directory, which is no step (orbax replaces it when the
step is saved again; the SIGKILL resume test); a crash after it leaves a complete,
verifiable step. Not covered: the two files orbax
writes at the step's top level after that (_CHECKPOINT_METADATA: timestamps and item
handler names; commit_success.txt), which hold no state, and files the manifest does
not name (nothing reads them). A missing, truncated, grown or changed file is a
one-line CheckpointError naming the step, the file and the other steps that verify
intact; the run does not fall back to an older step by itself (which step to resume
from, losing which steps, is the user's call). A step without a manifest is restored
unverified, with a warning line, if its meta record is of format 1 (written before
checksums were recorded); a step of format 2 without one cannot come from a save (see
above) and is refused like a damaged one.

Failures are one line each (the runner's summary cuts messages at 500 characters): what
orbax, tensorstore or grain raise (and the asyncio tracebacks tensorstore leaves behind
when orbax's event loop closes under it, and orbax's own error log records) goes into
workdir/checkpoint_errors.log, the console gets a CheckpointError naming the step, the
directory and the log. A save that fails (disk full, read-only file system, no
permission) stops the run as soon as it is noticed (single process: at the next step;
several processes: at the next save or at the end, where every process notices it
together), after removing the step's temporary directory, with a CheckpointError naming
the path, the error, the space the step needs and the space free.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import traceback
import warnings
from typing import Any

from absl import logging as absl_logging
import jax

from sse_jax.train import config as config_lib
from sse_jax.train.state import TrainState

FORMAT = 2  # 2: the step has a checksum manifest; 1: written before checksums (still read)
ITEMS = ("state", "data", "meta")
MANIFEST = "checksums.json"
ERROR_LOG = "checkpoint_errors.log"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's name for a step being written
# Written by orbax into the step directory after the manifest (commit time, commit marker).
UNCHECKED = ("_CHECKPOINT_METADATA", "commit_success.txt")
SUMMARY_CHARS = 200  # of an orbax / tensorstore message quoted in a one-line error


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be resumed (unreadable, corrupt, or from another run) or
  written (disk full, read-only, no permission)."""


def _ocp():
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp


def _grain_checkpoint():
  import grain  # pylint: disable=g-import-not-at-top
  return grain.checkpoint


# --- checksums -------------------------------------------------------------------------


def _sha256(path: str) -> tuple[int, str]:
  with open(path, "rb") as f:
    digest = hashlib.file_digest(f, "sha256")
    return f.tell(), digest.hexdigest()


def _step_files(step_dir: str) -> list[str]:
  """The step's files the manifest covers, as "state/d/ab12" relative to the step."""
  found = []
  for parent, _, names in os.walk(step_dir):
    for name in names:
      rel = os.path.relpath(os.path.join(parent, name), step_dir).replace(os.sep, "/")
      if rel != MANIFEST and rel not in UNCHECKED:
        found.append(rel)
  return sorted(found)


def write_manifest(step_dir: str, step: int) -> None:
  """Records the size and sha256 of every file under `step_dir` in its checksums.json."""
  files = {rel: _sha256(os.path.join(step_dir, rel)) for rel in _step_files(step_dir)}
  # JSON, one file a line, so that it reads (and diffs) by eye.
  lines = ",\n".join(f"  {json.dumps(rel)}: [{size}, \"{digest}\"]"
                     for rel, (size, digest) in files.items())
  with open(os.path.join(step_dir, MANIFEST), "w") as f:
    f.write(f'{{"step": {step}, "algorithm": "sha256", "files": {{\n{lines}\n}}}}\n')
    f.flush()
    os.fsync(f.fileno())


NO_MANIFEST = "no checksum manifest"


def check_files(step_dir: str) -> str | None:
  """None if every file the step's manifest names has its recorded size and sha256;
  otherwise what is wrong (NO_MANIFEST if there is no manifest)."""
  path = os.path.join(step_dir, MANIFEST)
  if not os.path.exists(path):
    return NO_MANIFEST
  try:
    with open(path) as f:
      entries = sorted((str(rel), int(size), str(digest))
                       for rel, (size, digest) in json.load(f)["files"].items())
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    return f"its checksum manifest {MANIFEST} is unreadable ({_summary(e)})"
  problems = []
  for rel, size, digest in entries:
    try:
      got_size, got = _sha256(os.path.join(step_dir, rel))
    except FileNotFoundError:
      problems.append(f"file {rel} is missing")
      continue
    except OSError as e:
      problems.append(f"file {rel} cannot be read ({e.strerror})")
      continue
    if got_size < size:
      problems.append(f"file {rel} is truncated ({got_size} of {size} bytes)")
    elif got_size > size:
      problems.append(f"file {rel} has {got_size} bytes, {size} when saved (corrupt)")
    elif got != digest:
      problems.append(f"file {rel} fails its checksum (corrupt)")
  if not problems:
    return None
  return problems[0] + (f" (and {len(problems) - 1} more files)" if len(problems) > 1 else "")


# --- one-line errors -------------------------------------------------------------------


def _summary(e: BaseException) -> str:
  """An exception as one short line: its type and the start of its first line (without
  tensorstore's spec, a few hundred characters of JSON)."""
  text = str(e).strip().split("\n")[0].split(" [tensorstore_spec=")[0]
  if len(text) > SUMMARY_CHARS:
    text = text[:SUMMARY_CHARS] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _chain(e: BaseException) -> list[BaseException]:
  """`e` and the exceptions it was raised from or while handling, outermost first."""
  seen, chain = set(), []
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    chain.append(e)
    e = e.__cause__ or e.__context__
  return chain


def _root_cause(e: BaseException) -> BaseException:
  """The innermost exception of a chain, preferring an OSError (it has the errno)."""
  chain = _chain(e)
  return next((x for x in chain if isinstance(x, OSError) and x.errno), chain[-1])


def _reason(e: BaseException) -> str:
  """The gist of a failed write: the OS error if there is one ("No space left on
  device", from an OSError or tensorstore's message), else tensorstore's status code
  ("RESOURCE_EXHAUSTED"), else the exception's type."""
  root = _root_cause(e)
  if isinstance(root, OSError) and root.errno:
    return os.strerror(root.errno)
  for x in _chain(e):  # tensorstore: "...: No space left on device [os_error_code='28']"
    found = re.search(r"os_error_code='?(\d+)", str(x))
    if found:
      return os.strerror(int(found.group(1)))
  found = re.match(r"([A-Z_]{4,}):", str(root))
  return found.group(1) if found else type(root).__name__


def _size(n: float | None) -> str:
  if n is None:
    return "unknown"
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} TiB"


def _disk_bytes(path: str) -> int:
  """The space the files under `path` take (allocated blocks: many small files take
  more than their sizes add up to)."""
  total = 0
  for parent, _, names in os.walk(path):
    for name in names:
      st = os.stat(os.path.join(parent, name))
      total += max(st.st_size, getattr(st, "st_blocks", 0) * 512)
  return total


def _release(error: BaseException) -> list[str]:
  """Frees what a failed orbax call left for the interpreter's exit: its frames hold
  coroutines it never awaited, whose finalizers print tracebacks while Python shuts
  down. Returns the warnings their closing gives now, for the error log."""
  for e in _chain(error):
    traceback.clear_frames(e.__traceback__)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gc.collect()
  return [f"warning: {w.category.__name__}: {w.message}\n" for w in caught]


class _Noise:
  """Keeps orbax's error log records, and the asyncio tracebacks that tensorstore and
  orbax's abandoned tasks print ("Event loop is closed" once per array when orbax's
  event loop closes under tensorstore: thousands of lines on a real model), off the
  console while checkpoints are open; `take` hands them to the error log of the failure
  they belong to. After a failure, what orbax's leftovers print until the interpreter
  exits goes to that failure's log too (at exit, before Python's teardown, where their
  finalizers would each print an ImportError traceback)."""

  def __init__(self):
    self.lock = threading.RLock()  # (a record may arrive while it is held)
    self.users = 0
    self.texts: list[str] = []
    self.previous_hook = None
    self.failure = False  # after a failure: its echoes are kept off the console until exit
    self.failure_log: str | None = None  # where they go (None: nowhere could be written)
    self.filter = logging.Filter()
    self.filter.filter = self._keep_record

  def _add(self, text: str):
    with self.lock:
      self.texts.append(text)

  def _keep_record(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR:
      return True
    text = f"{record.levelname} {record.name} {record.pathname}:{record.lineno}: "
    text += record.getMessage()
    if record.exc_info:
      text += "\n" + "".join(traceback.format_exception(*record.exc_info))
    # absl: orbax's own records; asyncio: "Task exception was never retrieved" of
    # orbax's serialization tasks.
    where = record.pathname if record.name == "absl" else text
    if os.sep + "orbax" + os.sep not in where:
      return True
    self._add(text)
    return False

  def _hook(self, unraisable):
    error = unraisable.exc_value
    try:
      text = f"unraisable in {unraisable.object!r}: " + "".join(
          traceback.format_exception(error))
    except Exception:  # pylint: disable=broad-except  (at exit imports fail)
      text = f"unraisable in {unraisable.object!r}: {error!r}"
    leftover = self.failure and ("orbax" in text or "async_serialize" in text)
    if (isinstance(error, RuntimeError) and str(error) == "Event loop is closed") or leftover:
      self._add(text)
    elif self.previous_hook is not None:
      self.previous_hook(unraisable)

  def open(self):
    with self.lock:
      self.users += 1
      if self.users == 1:
        for name in ("absl", "asyncio"):
          logging.getLogger(name).addFilter(self.filter)  # (a no-op if still there)
        if sys.unraisablehook != self._hook:  # (a test runner may have swapped it back)
          self.previous_hook, sys.unraisablehook = sys.unraisablehook, self._hook

  def close(self):
    with self.lock:
      self.users -= 1
      if self.users == 0 and not self.failure:  # else: kept until exit
        for name in ("absl", "asyncio"):
          logging.getLogger(name).removeFilter(self.filter)
        if sys.unraisablehook == self._hook:
          sys.unraisablehook = self.previous_hook

  def take(self) -> list[str]:
    with self.lock:
      texts, self.texts = self.texts, []
    return texts

  def failed(self, log_path: str | None):
    """After a failure: orbax's leftovers go to `log_path` until exit."""
    with self.lock:
      first, self.failure, self.failure_log = not self.failure, True, log_path
    if first:
      atexit.register(self._at_exit)

  def _at_exit(self):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      gc.collect()  # orbax's abandoned tasks and coroutines, finalized while Python works
    texts = self.take() + [f"warning: {w.category.__name__}: {w.message}\n" for w in caught]
    if texts and self.failure_log is not None:
      try:
        with open(self.failure_log, "a") as f:
          f.write(f"--- {len(texts)} error records orbax left behind, at exit:\n")
          f.writelines(t if t.endswith("\n") else t + "\n" for t in texts)
      except OSError:
        pass  # the failure itself has been reported; these are its echoes


_NOISE = _Noise()


# --- the checkpoints of one run --------------------------------------------------------


class Checkpoints:
  """orbax CheckpointManager over workdir/checkpoints keeping the latest `keep` steps,
  with a checksum manifest per step (see the module docstring)."""

  def __init__(self, workdir: str, keep: int):
    ocp = _ocp()
    self.workdir = workdir
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self.log_path = os.path.join(os.path.abspath(workdir), ERROR_LOG)
    self._saving: tuple[int, int] | None = None  # (step, array bytes) of the save in flight
    self._checked: set[int] = set()  # steps verified (or warned about) already
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True,
        async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifest))
    _NOISE.open()
    self._open = True
    try:
      self.manager = ocp.CheckpointManager(self.directory, options=options)
    except Exception as e:  # pylint: disable=broad-except
      self._open = False
      where = self._log(f"opening {self.directory}", e)
      _NOISE.close()
      raise CheckpointError(f"cannot keep checkpoints in {self.directory}: {_reason(e)}. "
                            f"Full error in {where}; it begins: "
                            f"{_summary(_root_cause(e))}") from None

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

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  # --- the error log -------------------------------------------------------------------

  def _log(self, what: str, error: BaseException | None) -> str:
    """Appends `error`'s full text (and what orbax printed meanwhile) to the error log;
    returns where it went ("" if there was nothing to log)."""
    parts = []
    if error is not None:
      parts.append("".join(traceback.format_exception(error)))
      parts.extend(_release(error))
    noise = _NOISE.take()
    if not parts and not noise:
      return ""
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    parts.insert(0, f"=== {stamp} {what}\n")
    if noise:
      parts.append(f"--- {len(noise)} error records orbax / tensorstore printed meanwhile:\n")
      parts.extend(t if t.endswith("\n") else t + "\n" for t in noise)
    # The workdir's log; on a full or read-only disk, one in the temp directory; failing
    # both, the one-line message alone (it has the gist; the rest is orbax's traceback).
    fallback = os.path.join(tempfile.gettempdir(), f"{ERROR_LOG}.{os.getpid()}")
    for path in (self.log_path, fallback):
      try:
        with open(path, "a") as f:
          f.writelines(parts)
      except OSError:
        continue
      if error is not None:
        _NOISE.failed(path)
      return path
    if error is not None:
      _NOISE.failed(None)
    return "no file (none could be written)"

  # --- saving --------------------------------------------------------------------------

  def save(self, step: int, state: TrainState, data_iterator, host: dict[str, Any],
           fingerprint: dict[str, Any]) -> None:
    ocp = _ocp()
    # The previous save first (orbax waits for it here anyway): a failure of it stops the
    # run now, and the manifest callback below always belongs to the save in flight.
    self.wait()
    meta = {"format": FORMAT, "step": step, "process_count": jax.process_count(),
            "fingerprint": fingerprint, "host": host}
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state._asdict()),
        data=_grain_checkpoint().CheckpointSave(data_iterator),
        meta=ocp.args.JsonSave(meta))
    self._saving = (step, sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state)))
    try:
      self.manager.save(step, args=args, force=True)
    except Exception as e:  # pylint: disable=broad-except
      self._save_failed(e)

  def _write_manifest(self) -> None:
    """orbax's post_finalization_callback (primary process, background save thread):
    every item of the step is written and finalized, the step not yet renamed."""
    step = self._saving[0]
    tmp = os.path.join(self.directory, f"{step}{TMP_SUFFIX}")
    if not os.path.isdir(tmp):  # orbax renamed its temporary directories: fail loudly
      raise CheckpointError(f"cannot record the checksums of step {step}: orbax's "
                            f"temporary directory {tmp} is not there")
    write_manifest(tmp, step)

  def wait(self) -> None:
    """Blocks until the save in flight is on disk; a failed save raises CheckpointError."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      self._save_failed(e)
    self._saving = None

  def poll(self) -> None:
    """Raises CheckpointError if the save in flight has failed; never waits. Several
    processes only notice at the next save or wait, where all of them do: one process
    stopping alone would leave the others blocked in the next step's collectives."""
    if (self._saving is not None and jax.process_count() == 1
        and not self.manager.is_saving_in_progress()):
      self.wait()

  def _save_failed(self, error: BaseException):
    step, array_bytes = self._saving or (None, None)
    self._saving = None
    try:  # before the partial step is removed: the space there was when the save failed
      free = _size(shutil.disk_usage(self.directory).free)
    except OSError:
      free = "unknown"
    partial = ""
    tmp = os.path.join(self.directory, f"{step}{TMP_SUFFIX}")
    if step is not None and os.path.exists(tmp) and jax.process_index() == 0:
      shutil.rmtree(tmp, ignore_errors=True)
      partial = (f"; could not remove its partial {tmp}" if os.path.exists(tmp) else
                 f"; removed its partial {tmp}")
    saved = self.all_steps()
    # The last complete step's size on disk is the best estimate (it has every file);
    # before the first one, the state's arrays.
    need = _disk_bytes(self._step_dir(saved[-1])) if saved else array_bytes
    last = (f"the last checkpoint is step {saved[-1]}" if saved else
            "no checkpoint was saved")
    where = self._log(f"saving step {step} in {self.directory}", error)
    raise CheckpointError(
        f"checkpoint step {step} could not be saved in {self.directory} ({_reason(error)}): "
        f"it needs about {_size(need)}, {free} free there{partial}. Training stopped; "
        f"{last}. Full error in {where}; it begins: {_summary(_root_cause(error))}") from None

  # --- restoring -----------------------------------------------------------------------

  def _fail(self, step: int, what: str, cause: BaseException | None = None):
    others = [s for s in self.all_steps() if s != step]
    hint = (f" Other steps there: {others}; move the bad one away to resume from "
            "them," if others else "") + " or start in a new workdir."
    # The cause's own text last: the runner's summary line keeps the first 500 characters.
    where = self._log(f"restoring step {step} from {self.directory}", cause)
    detail = f" Full error in {where}" if where else ""
    if cause is not None:
      detail += f"; it begins: {_summary(_root_cause(cause))}"
    raise CheckpointError(f"cannot resume from {self.directory}/{step} (workdir "
                          f"{self.workdir}): {what}.{hint}{detail}") from None

  def _fail_integrity(self, step: int, what: str):
    """A damaged step: names the other steps whose files verify and which to delete to
    resume from the newest of them."""
    saved = self.all_steps()
    status = {s: check_files(self._step_dir(s)) for s in saved if s != step}
    intact = [s for s, problem in status.items() if problem is None]
    unverified = [s for s, problem in status.items() if problem == NO_MANIFEST]
    older = [s for s in intact if s < step]
    if older:
      later = [s for s in saved if s > older[-1]]
      hint = (f"Delete steps {later} there to resume from step {older[-1]}, or start in a "
              "new workdir.")
    elif intact:
      hint = f"Load step {intact[0]} instead, or start in a new workdir."
    else:
      hint = "Start in a new workdir."
    also = f" (without checksums: {unverified})" if unverified else ""
    raise CheckpointError(
        f"cannot resume from {self.directory}/{step} (workdir {self.workdir}): {what}; "
        f"intact steps: {intact or 'none'}{also}. {hint}")

  def verify(self, step: int) -> None:
    """Checks the step's files against its checksum manifest before anything of it is
    read; raises CheckpointError if one is missing or differs (see the module docstring)."""
    if step in self._checked:
      return
    step_dir = self._step_dir(step)
    # Look before asking orbax: on a directory that is no checkpoint at all it fails
    # deep inside its async machinery.
    found = sorted(os.listdir(step_dir))
    missing = [item for item in ITEMS if item not in found]
    if missing:
      self._fail(step, f"it is not a trainer checkpoint: no {missing} item (found {found})")
    problem = check_files(step_dir)
    if problem == NO_MANIFEST:
      written = self._read_meta_record(step).get("format")
      if written != 1:
        self._fail_integrity(step, f"it has no checksum manifest {MANIFEST}, which every "
                             f"save of format {written} writes with the step (deleted?)")
      absl_logging.warning("checkpoint %s was written before checkpoints recorded "
                           "checksums; restoring it unverified", step_dir)
    elif problem is not None:
      self._fail_integrity(step, problem)
    self._checked.add(step)

  def _read_meta_record(self, step: int) -> dict[str, Any]:
    try:
      meta = self.manager.restore(step, args=_ocp().args.Composite(
          meta=_ocp().args.JsonRestore())).meta
    except Exception as e:  # pylint: disable=broad-except
      self._fail(step, "its meta record is unreadable", e)
    if not isinstance(meta, dict) or meta.get("format") not in (1, FORMAT):
      self._fail(step, f"its meta record is not a trainer record of format 1 to {FORMAT}: "
                 f"{str(meta)[:SUMMARY_CHARS]}")
    return meta

  def read_meta(self, step: int) -> dict[str, Any]:
    self.verify(step)
    return self._read_meta_record(step)

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
    self.verify(step)
    self._check_stored_arrays(step, target)
    items = {"state": ocp.args.StandardRestore(target._asdict())}
    if data_iterator is not None:
      items["data"] = _grain_checkpoint().CheckpointRestore(data_iterator)
    args = ocp.args.Composite(**items)
    try:
      restored = self.manager.restore(step, args=args)
    except Exception as e:  # pylint: disable=broad-except
      self._fail(step, "orbax/grain could not read it", e)
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
      self._fail(step, "orbax could not read its array metadata", e)
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

  def close(self) -> None:
    """Waits for the save in flight (its failure raises CheckpointError) and closes."""
    if not self._open:
      return
    self._open = False
    try:
      self.wait()
    finally:
      error = None
      try:
        self.manager.close()
      except Exception as e:  # pylint: disable=broad-except
        error = e  # a failed save has raised above already; orbax raises it only once
      # What orbax logged without failing a save or restore we saw: kept, and said so
      # (after a failure, these are its echoes: the failure's line has said it).
      where = self._log(f"closing {self.directory}", error)
      if where and not _NOISE.failure:
        absl_logging.warning("orbax reported errors while checkpointing in %s: see %s",
                             self.directory, where)
      _NOISE.close()


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
