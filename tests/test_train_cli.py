"""The trainer's command line, `python -m sse_jax.train --config=FILE[:ARG] --workdir=DIR`:
an ml_collections config file with dotted --config.<field> overrides; every mistake is
one line on stderr naming the flag or path and the fix, exit status 2, no traceback; a
tiny run trains, logs its progress through absl.logging and resumes from its saved
config.json. And the progress lines' timing: the first window leaves the compiling
step out."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import types

import pytest

from sse_jax import train
from sse_jax.train import loop

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "--config=configs/train_default.py"
TINY = ["--config.num_steps=2", "--config.warmup_steps=1", "--config.log_every=1",
        "--config.eval_every=2", "--config.checkpoint_every=2", "--config.batch_size=4",
        "--config.eval_batches=1", "--config.model.pattern=S", "--config.model.hidden=32",
        "--config.model.mlp_dim=64", "--config.compute_dtype=float32"]


def _cli(*args, timeout=300):
  """Runs the trainer from the repository root; returns (exit status, stdout, stderr)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")  # the compilation cache: conftest.py
  proc = subprocess.run([sys.executable, "-m", "sse_jax.train", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)
  return proc.returncode, proc.stdout, proc.stderr


def _under_a_file(tmp_path):
  (tmp_path / "file").write_text("")
  return str(tmp_path / "file" / "workdir")


# (arguments, words the one line must hold: the flag or path first, then the fix)
MISTAKES = {
    "no config": (["--workdir=w"], ["--config is required", "configs/train_default.py"]),
    "config file": (["--config=configs/nope.py", "--workdir=w"],
                    ["--config=configs/nope.py", "no such config file",
                     "configs/train_default.py"]),
    "config argument": (["--config=configs/train_default.py:nope.json", "--workdir=w"],
                        ["--config=configs/train_default.py:nope.json", "cannot read nope.json",
                         "No such file"]),
    "experiment config": (["--config=configs/fig7.py:cpu", "--workdir=w"],
                          ["--config=configs/fig7.py:cpu", "experiment config",
                           "python -m experiments.ablation --config=configs/fig7.py:cpu"]),
    "wrong path": ([CONFIG, "--workdir=w", "--config.train.lr=0.1"],
                   ["--config.train.lr=0.1", "no field train.lr", "did you mean --config.lr?"]),
    "misspelled key": ([CONFIG, "--workdir=w", "--config.model.sse.top_kk=2"],
                       ["--config.model.sse.top_kk=2", "did you mean --config.model.sse.top_k?"]),
    "a None field": ([CONFIG, "--workdir=w", "--config.model.gla.chunk_size=16"],
                     ["--config.model.gla.chunk_size=16", "model.gla is None",
                      "set it in a config file"]),
    "bad value": ([CONFIG, "--workdir=w", "--config.num_steps=abc"],
                  ["--config.num_steps=abc", "invalid literal"]),
    "impossible value": ([CONFIG, "--workdir=w", "--config.lr=-1"],
                         ["lr=-1.0 must be > 0", "(set by --config.lr)"]),
    "impossible layer value": ([CONFIG, "--workdir=w", "--config.model.sse.top_k=99"],
                               ["SSEConfig.top_k=99 must be <= num_partitions=4",
                                "(set by --config.model.sse.top_k)"]),
    "no workdir": ([CONFIG], ["--workdir is required"]),
    "workdir in /proc": ([CONFIG, "--workdir=/proc/x"],
                         ["--workdir=/proc/x", "cannot use workdir", "give a directory"]),
}


@pytest.mark.parametrize("mistake", list(MISTAKES) + ["workdir under a file"])
def test_a_mistake_is_one_line_and_exit_status_2(mistake, tmp_path):
  if mistake == "workdir under a file":
    workdir = _under_a_file(tmp_path)
    args, words = [CONFIG, f"--workdir={workdir}"], [
        f"--workdir={workdir}", "is a file, not a directory", "give a directory"]
  else:
    args, words = MISTAKES[mistake]
  code, out, err = _cli(*args)
  lines = [line for line in err.splitlines() if line.strip()]
  assert code == 2 and len(lines) == 1, err
  for word in words:
    assert word in lines[0], (word, lines[0])
  assert out == "" and not (REPO / "w").exists()


def test_a_run_trains_with_overrides_and_resumes_from_its_config_json(tmp_path):
  workdir = tmp_path / "run"
  code, out, err = _cli(CONFIG, f"--workdir={workdir}", *TINY, "--config.seed=3")
  assert code == 0, err[-3000:]
  summary = json.loads(out.strip().splitlines()[-1])
  assert summary["finished"] and summary["step"] == 2
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["seed"] == 3 and saved["model"]["pattern"] == "S"
  assert saved["model"]["hidden"] == 32 and saved["num_steps"] == 2
  # Progress lines go through absl.logging (its prefix, then the line); the first
  # window is the compiling step alone: no rate.
  progress = [line for line in err.splitlines() if "[train] step" in line]
  assert len(progress) == 2, err[-3000:]
  assert progress[0].startswith("I") and "] [train] step 1/2 (50%) | first step in" in progress[0]
  assert "(compiling) | loss" in progress[0] and "steps/s" in progress[1]
  assert "Traceback" not in err

  again = _cli(f"{CONFIG}:{workdir / 'config.json'}", f"--workdir={workdir}")
  assert again[0] == 0, again[2][-3000:]
  resumed = json.loads(again[1].strip().splitlines()[-1])
  assert resumed["resumed_from"] == 2 and resumed["finished"]


def test_first_window_leaves_the_compiling_step_out(tmp_path, monkeypatch):
  """On a fake clock where the first step takes 100 s (compiling) and every later one
  1 s, every window's rate is 1 step/s, the first one's included."""
  now = [0.0]
  monkeypatch.setattr(loop, "time", types.SimpleNamespace(time=lambda: now[0]))
  advance = loop.Run.advance

  def timed_advance(self):
    now[0] += 100.0 if now[0] == 0.0 else 1.0
    return advance(self)

  monkeypatch.setattr(loop.Run, "advance", timed_advance)
  c = train.default_config()
  c.model.pattern, c.model.hidden, c.model.mlp_dim = "S", 32, 64
  c.num_steps, c.warmup_steps, c.log_every, c.batch_size = 8, 1, 4, 4
  c.eval_every, c.checkpoint_every, c.eval_batches = 0, 0, 1
  c.compute_dtype, c.progress = "float32", False
  summary = train.train_and_evaluate(c, str(tmp_path / "w"))
  records = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").open()]
  rates = [r["steps_per_s"] for r in records if r["kind"] == "train"]
  assert rates == [1.0, 1.0], rates
  assert summary["steps_per_s"] == 1.0
