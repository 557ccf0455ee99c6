"""Sharded execution of the ops on 8 simulated CPU devices (in a subprocess, since the
device count must be set before JAX starts)."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ops_run_per_shard_without_all_gather():
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "tests.sharded_ops_check"], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=900)
  report = proc.stdout + proc.stderr[-3000:]
  assert proc.returncode == 0, report
  for impl in ("varlen", "masking", "pallas_varlen", "pallas_masking", "varlen packed",
               "pallas_varlen packed", "varlen per-partition", "masking per-partition"):
    assert f"{impl}: max rel err" in proc.stdout and "FAIL" not in proc.stdout, report
