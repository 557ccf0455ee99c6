"""Faults in checkpoints and their saves: each is one line, never a silent resume.

A tiny run (1 attention layer, 3 steps, a checkpoint every step) is trained once; each
test damages a copy of it the way disks and people do (random bytes, flipped bytes, one
flipped bit, a truncated or missing file, a deleted manifest), then resumes it: the
checksums recorded at save time must refuse the damaged step, in one line that names
the step, the file and the intact steps, before orbax reads a byte of it. A checkpoint
written before checksums (no manifest, meta format 1) still resumes, with a warning.
Saves that fail (disk full, read-only) stop the run at once, in one line, and leave no
temporary directory; a workdir that cannot be written is one line too.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import random
import shutil

import pytest

from sse_jax import train
from sse_jax.train import checkpoint as ckpt

STEPS = 4  # the run's schedule; the shared run stops after 3 (checkpoints 1, 2, 3)
RUNNER_CUT = 500  # experiments.ablation prints the first 500 characters of an error


def tiny_config():
  c = train.default_config()
  c.model.pattern, c.model.hidden, c.model.mlp_dim = "A", 16, 32
  c.data.seq_len = 32
  c.batch_size, c.num_steps, c.warmup_steps = 4, STEPS, 1
  c.compute_dtype = "float32"
  c.log_every, c.eval_every, c.eval_batches = 1, STEPS, 1
  c.checkpoint_every, c.keep_checkpoints = 1, 5
  c.progress = False
  return c


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> pathlib.Path:
  workdir = tmp_path_factory.mktemp("faults") / "run"
  summary = train.train_and_evaluate(tiny_config(), str(workdir), stop_after=3)
  assert summary["step"] == 3 and not summary["finished"]
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1", "2", "3"]
  return workdir


def copy(trained, tmp_path) -> pathlib.Path:
  workdir = tmp_path / "copy"
  shutil.copytree(trained, workdir)
  return workdir


def step_dir(workdir, step=3) -> pathlib.Path:
  return workdir / "checkpoints" / str(step)


def array_file(workdir) -> pathlib.Path:
  """The step's largest array-data file (OCDBT data files: weights, Adam moments)."""
  files = [p for p in (step_dir(workdir) / "state").rglob("*")
           if p.is_file() and p.parent.name == "d"]
  return max(files, key=lambda p: p.stat().st_size)


def rel(path, workdir) -> str:
  return path.relative_to(step_dir(workdir)).as_posix()


def refused(workdir) -> str:
  """The one-line CheckpointError message of resuming `workdir`."""
  with pytest.raises(train.CheckpointError) as error:
    train.train_and_evaluate(tiny_config(), str(workdir))
  message = str(error.value)
  assert "\n" not in message, message
  assert quiet(error.value), "the console would print orbax's traceback under the message"
  return message


def quiet(error: BaseException) -> bool:
  """Whether Python prints `error` without an exception chain under it."""
  return error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def assert_names_intact_steps(message, workdir):
  assert f"{step_dir(workdir)} (workdir {workdir})" in message
  assert "intact steps: [1, 2]. Delete steps [3] there to resume from step 2" in message
  assert len(message) < RUNNER_CUT, len(message)


def overwrite(path, offset, data: bytes):
  raw = bytearray(path.read_bytes())
  raw[offset:offset + len(data)] = data
  path.write_bytes(bytes(raw))


# --- damaged files ---------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["64 random bytes", "a few flipped bytes"])
def test_changed_bytes_are_refused_naming_step_and_file(trained, tmp_path, damage):
  """Both used to load silently (Adam moments up to 1e38, a NaN loss later)."""
  workdir = copy(trained, tmp_path)
  target = array_file(workdir)
  if damage == "64 random bytes":
    overwrite(target, 100, random.Random(0).randbytes(64))
  else:
    raw = bytearray(target.read_bytes())
    for i in (100, 1000, 3000):
      raw[i] ^= 0xFF
    target.write_bytes(bytes(raw))
  message = refused(workdir)
  assert f"file {rel(target, workdir)} fails its checksum (corrupt)" in message
  assert_names_intact_steps(message, workdir)


@pytest.mark.parametrize("which", ["array data", "meta/metadata", "data/process_0-of-1.json"])
def test_one_flipped_bit_is_detected(trained, tmp_path, which):
  """One bit anywhere: in an array, in the host accumulators of the meta record (a
  resumed run would log other numbers), in the data iterator's position."""
  workdir = copy(trained, tmp_path)
  target = array_file(workdir) if which == "array data" else step_dir(workdir) / which
  raw = bytearray(target.read_bytes())
  raw[len(raw) // 2] ^= 0x01
  target.write_bytes(bytes(raw))
  message = refused(workdir)
  assert f"file {rel(target, workdir)} fails its checksum (corrupt)" in message
  assert_names_intact_steps(message, workdir)


def test_truncated_and_missing_files_are_one_line(trained, tmp_path):
  """A truncated array file was a CheckpointError buried in ~9,000 lines of orbax and
  asyncio tracebacks; now the size check names it before orbax opens the step."""
  workdir = copy(trained, tmp_path)
  target = array_file(workdir)
  size = target.stat().st_size
  os.truncate(target, 1000)
  message = refused(workdir)
  assert f"file {rel(target, workdir)} is truncated (1000 of {size} bytes)" in message
  assert_names_intact_steps(message, workdir)

  target.unlink()
  message = refused(workdir)
  assert f"file {rel(target, workdir)} is missing" in message
  assert_names_intact_steps(message, workdir)


def test_every_damaged_step_is_named(trained, tmp_path):
  workdir = copy(trained, tmp_path)
  for step in (2, 3):
    overwrite(step_dir(workdir, step) / "meta" / "metadata", 10, b"xx")
  message = refused(workdir)
  assert "file meta/metadata fails its checksum" in message
  assert "intact steps: [1]. Delete steps [2, 3] there to resume from step 1" in message

  shutil.rmtree(step_dir(workdir, 1))  # none left
  assert refused(workdir).endswith("intact steps: none. Start in a new workdir.")


def test_a_step_without_its_manifest_is_refused(trained, tmp_path):
  """Saves write the manifest before orbax renames the step into place, so a step of
  this format without one was tampered with."""
  workdir = copy(trained, tmp_path)
  (step_dir(workdir) / ckpt.MANIFEST).unlink()
  message = refused(workdir)
  assert "it has no checksum manifest checksums.json" in message
  assert_names_intact_steps(message, workdir)


# --- checkpoints from before checksums -------------------------------------------------


def strip_to_format_1(workdir):
  """What the trainer wrote before checksums: no manifest, meta format 1."""
  for step in (1, 2, 3):
    (step_dir(workdir, step) / ckpt.MANIFEST).unlink()
    meta_file = step_dir(workdir, step) / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["format"] = 1
    meta_file.write_text(json.dumps(meta))


def test_old_checkpoint_without_manifest_resumes_with_a_warning(trained, tmp_path, caplog):
  workdir = copy(trained, tmp_path)
  strip_to_format_1(workdir)
  summary = train.train_and_evaluate(tiny_config(), str(workdir))
  assert summary["resumed_from"] == 3 and summary["finished"] and summary["step"] == STEPS
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert (f"checkpoint {step_dir(workdir)} was written before checkpoints recorded "
          "checksums; restoring it unverified") in warnings, warnings
  # The step it wrote has a manifest, and verifies.
  assert ckpt.check_files(str(step_dir(workdir, STEPS))) is None


def test_orbax_failure_on_an_old_checkpoint_is_one_line_and_logged(trained, tmp_path, capfd):
  """Without checksums the truncated file reaches orbax: its error (and the asyncio
  tracebacks tensorstore prints, one per array) go to checkpoint_errors.log."""
  workdir = copy(trained, tmp_path)
  strip_to_format_1(workdir)
  os.truncate(array_file(workdir), 1000)
  message = refused(workdir)
  log = workdir / ckpt.ERROR_LOG
  assert "): orbax/grain could not read it. Other steps there: [1, 2]" in message
  assert f"Full error in {log}; it begins: ValueError: OUT_OF_RANGE" in message
  assert "Traceback (most recent call last)" in log.read_text()
  err = capfd.readouterr().err
  assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]


# --- failed saves and unusable workdirs ------------------------------------------------


def no_tmp_left(workdir):
  return not [p for p in (workdir / "checkpoints").iterdir() if ckpt.TMP_SUFFIX in p.name]


def test_disk_full_during_a_save_stops_the_run(tmp_path, monkeypatch, capfd):
  """ENOSPC while the data item of step 2 is written (a synchronous part of orbax's
  save): the run stops there, one line, the partial step removed."""
  from etils import epath  # pylint: disable=g-import-not-at-top  (orbax's own)
  path_class = type(epath.Path(str(tmp_path)))
  write_text = path_class.write_text

  def full(self, *args, **kwargs):
    if f"{os.sep}2{ckpt.TMP_SUFFIX}" in os.fspath(self):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(self))
    return write_text(self, *args, **kwargs)

  monkeypatch.setattr(path_class, "write_text", full)
  workdir = tmp_path / "w"
  with pytest.raises(train.CheckpointError) as error:
    train.train_and_evaluate(tiny_config(), str(workdir))
  message = str(error.value)
  assert "\n" not in message and quiet(error.value)
  assert message.startswith(f"checkpoint step 2 could not be saved in {workdir / 'checkpoints'}"
                            " (No space left on device): it needs about ")
  assert "Training stopped; the last checkpoint is step 1." in message
  assert f"removed its partial {workdir / 'checkpoints' / ('2' + ckpt.TMP_SUFFIX)}" in message
  assert f"Full error in {workdir / ckpt.ERROR_LOG}" in message
  assert no_tmp_left(workdir) and sorted(os.listdir(workdir / "checkpoints")) == ["1"]
  assert not (workdir / "summary.json").exists()
  steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").open()]
  assert max(steps) == 2  # stopped at the step whose save failed
  assert "Traceback" not in capfd.readouterr().err


def test_failed_background_save_stops_the_run(tmp_path, monkeypatch, capfd):
  """EROFS in orbax's background save thread (here: recording the checksums of step 2,
  the last thing a save does): noticed at the next step, not at the end of the run."""
  def read_only(step_dir_, step):
    if step == 2:
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), step_dir_)
    return write_manifest(step_dir_, step)

  write_manifest = ckpt.write_manifest
  monkeypatch.setattr(ckpt, "write_manifest", read_only)
  config = tiny_config()
  config.num_steps = 8
  workdir = tmp_path / "w"
  with pytest.raises(train.CheckpointError) as error:
    train.train_and_evaluate(config, str(workdir))
  message = str(error.value)
  assert "\n" not in message and quiet(error.value)
  assert message.startswith(f"checkpoint step 2 could not be saved in {workdir / 'checkpoints'}"
                            " (Read-only file system): ")
  assert "Training stopped; the last checkpoint is step 1." in message
  assert no_tmp_left(workdir) and sorted(os.listdir(workdir / "checkpoints")) == ["1"]
  steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").open()]
  assert max(steps) <= 3, steps  # the next step's poll (or its save) stops it
  assert "Traceback" not in capfd.readouterr().err


def test_unusable_workdir_is_one_line(tmp_path, monkeypatch):
  a_file = tmp_path / "a_file"
  a_file.write_text("not a directory")
  for workdir in (a_file / "w", a_file):
    with pytest.raises(train.CheckpointError) as error:
      train.train_and_evaluate(tiny_config(), str(workdir))
    assert str(error.value) == (f"cannot use workdir {workdir}: {a_file} is a file, not a "
                                "directory")
    assert quiet(error.value)

  def read_only(path, *args, **kwargs):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

  monkeypatch.setattr(os, "makedirs", read_only)
  with pytest.raises(train.CheckpointError) as error:
    train.train_and_evaluate(tiny_config(), str(tmp_path / "ro"))
  assert str(error.value) == (f"cannot use workdir {tmp_path / 'ro'}: Read-only file system "
                              "(creating it)")
