"""Stacked runs (`sse_jax.train.train_stacked`): several (lr, seed) runs of one model as
one vmapped program give each run the numbers it gets alone, resume, and refuse configs
that differ in more than lr and seed."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from sse_jax import train
from sse_jax.train import stacked


def tiny_config(lr: float, seed: int):
  c = train.default_config()
  c.model.pattern, c.model.hidden, c.model.mlp_dim = "S", 16, 32
  c.model.sse = dict(num_partitions=4, top_k=2, chunk_size=16, impl="masking")
  c.data.seq_len, c.data.num_pairs, c.data.vocab_size = 16, 4, 64
  c.model.vocab_size = 64
  c.batch_size, c.num_steps, c.warmup_steps = 4, 8, 2
  c.compute_dtype = "float32"
  c.log_every, c.eval_every, c.checkpoint_every, c.eval_batches = 1, 4, 2, 1
  c.progress = False
  c.lr, c.seed = lr, seed
  return c


REPO = pathlib.Path(__file__).resolve().parents[1]

# Trains the two runs of `short_configs` stacked on 8 simulated CPU devices (data 4 x
# model 2) and prints their final eval losses as JSON.
EIGHT_DEVICES = """
import json, sys
sys.path.insert(0, "tests")
import jax
from test_train_stacked import short_configs
from sse_jax import train
assert jax.device_count() == 8
configs = short_configs(data=-1, model=2)
out = train.train_stacked(configs, [sys.argv[1] + "/a", sys.argv[1] + "/b"])
print(json.dumps({"mesh": out[0]["mesh"], "loss": [s["eval"]["loss"] for s in out]}))
"""


def short_configs(data=1, model=1):
  configs = [tiny_config(3e-2, 0), tiny_config(1e-2, 1)]
  for c in configs:
    c.num_steps, c.eval_every, c.checkpoint_every, c.batch_size = 3, 3, 0, 8
    c.mesh.data, c.mesh.model = data, model
  return configs


def records(workdir, kind):
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def test_stacked_runs_match_separate_runs_and_resume(tmp_path):
  # Runs a and c share seed 0, so they share one data iterator.
  configs = [tiny_config(3e-2, 0), tiny_config(1e-2, 1), tiny_config(1e-2, 0)]
  dirs = [tmp_path / "stacked_a", tmp_path / "stacked_b", tmp_path / "stacked_c"]
  # Interrupted after step 4 (checkpoints at 2 and 4), then resumed to the end.
  partial = train.train_stacked(configs, dirs, stop_after=4)
  assert [s["step"] for s in partial] == [4] * 3 and not any(s["finished"] for s in partial)
  summaries = train.train_stacked(configs, dirs)
  assert [s["resumed_from"] for s in summaries] == [4] * 3
  assert all(s["finished"] for s in summaries)
  for config, d, s in zip(configs, dirs, summaries):
    alone = train.train_and_evaluate(config, str(tmp_path / f"alone_{d.name}"))
    got = records(d, "train")
    want = records(tmp_path / f"alone_{d.name}", "train")
    assert [r["step"] for r in got] == list(range(1, 9)) == [r["step"] for r in want]
    for name in ("loss", "ce", "aux_loss", "accuracy", "grad_norm", "lr"):
      np.testing.assert_allclose([r[name] for r in got], [r[name] for r in want],
                                 rtol=2e-4, atol=1e-6, err_msg=f"{d.name}: {name}")
    for name in ("loss", "accuracy"):
      np.testing.assert_allclose(s["eval"][name], alone["eval"][name], rtol=2e-4,
                                 err_msg=f"{d.name}: eval {name}")
    assert (d / "summary.json").exists() and (d / "checkpoints").is_dir()
  # The two runs did differ (their own lr, seed and data).
  a, b = (records(d, "train") for d in dirs[:2])
  assert a[-1]["loss"] != b[-1]["loss"]
  assert a[1]["lr"] == pytest.approx(3 * b[1]["lr"]) and b[1]["lr"] > 0


def test_stacked_runs_must_differ_only_in_lr_and_seed(tmp_path):
  a, b = tiny_config(1e-2, 0), tiny_config(1e-2, 1)
  stacked.check_stackable([a, b])  # lr and seed may differ
  b.model.hidden = 32
  with pytest.raises(ValueError, match="model.hidden"):
    stacked.check_stackable([a, b])
  with pytest.raises(ValueError, match="one distinct workdir per config"):
    train.train_stacked([a, a], [tmp_path / "x", tmp_path / "x"])


def test_stacked_runs_on_eight_devices_match_one_device(tmp_path):
  # The session's XLA flags (conftest.py: cheap compiles) plus the device count; on
  # their own the device-count flag would compile the subprocess's programs at full
  # optimisation, about twice as slowly.
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip(),
             PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run([sys.executable, "-c", EIGHT_DEVICES, str(tmp_path / "eight")],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  eight = json.loads(proc.stdout.strip().splitlines()[-1])
  assert eight["mesh"] == {"data": 4, "model": 2}
  one = train.train_stacked(short_configs(), [tmp_path / "one_a", tmp_path / "one_b"])
  np.testing.assert_allclose(eight["loss"], [s["eval"]["loss"] for s in one], rtol=1e-5)
  assert eight["loss"][0] != eight["loss"][1]


def test_stacked_runs_resume_from_the_newest_step_they_all_have(tmp_path):
  """A group stopped while saving leaves one run a checkpoint ahead of the others: the
  group resumes from the step they all have, and ends as an uninterrupted group."""
  configs = [tiny_config(3e-2, 0), tiny_config(1e-2, 1)]
  whole = train.train_stacked(configs, [tmp_path / "whole_a", tmp_path / "whole_b"])
  dirs = [tmp_path / "a", tmp_path / "b"]
  train.train_stacked(configs, dirs, stop_after=4)  # checkpoints at 2 and 4
  shutil.rmtree(dirs[1] / "checkpoints" / "4")      # b's step-4 save never finished
  summaries = train.train_stacked(configs, dirs)
  assert [s["resumed_from"] for s in summaries] == [2, 2]
  assert all(s["finished"] for s in summaries)
  for d, s, w in zip(dirs, summaries, whole):
    assert [r["step"] for r in records(d, "train")] == list(range(1, 9))
    np.testing.assert_allclose(s["eval"]["loss"], w["eval"]["loss"], rtol=1e-6)
  # No step in common (a keeps only 8, b only 6): refused, naming both runs' steps.
  shutil.rmtree(dirs[0] / "checkpoints" / "6")
  shutil.rmtree(dirs[1] / "checkpoints" / "8")
  with pytest.raises(ValueError, match=r"a: \[8\].*b: \[6\]"):
    train.train_stacked(configs, dirs)
