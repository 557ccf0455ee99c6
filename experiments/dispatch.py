"""Trains a sweep's job groups (see `sweep.groups_of`): in this process, or in children.

    failed = train_serially(groups)                 # one after another, here
    failed = train_in_parallel(groups, workers=4)   # up to 4 child processes

Both return the ids (`sweep.job_id`) of the jobs that failed; a failure (e.g. a
non-finite loss at a too-large learning rate) is reported and the sweep goes on. A
child is this program again (`python -m experiments.ablation`, same flags) with
--job=<ids>, which trains just that group (`train_group`).
"""

from __future__ import annotations

import pathlib
import sys
import time

from experiments import pool
from experiments import report
from experiments import sweep
from sse_jax import train as train_lib

_BOOL_FLAGS = ("--report_only",)  # flags that never take a separate value


def without(argv: list[str], names: tuple[str, ...]) -> list[str]:
  """argv less the named flags, in the "--f=v", "--f v" and "--nof" forms."""
  drop = names + tuple("--no" + n[2:] for n in names)
  out, skip_value = [], False
  for a in argv:
    if skip_value:
      skip_value = False
      continue
    flag = a.split("=")[0]
    if flag in drop:
      skip_value = a == flag and flag in names and flag not in _BOOL_FLAGS
      continue
    out.append(a)
  return out


def train_group(group: list[sweep.Job]) -> None:
  """Trains one job, or several stacked as one vmapped program."""
  if len(group) == 1:
    train_lib.train_and_evaluate(group[0].config, str(group[0].dir))
  else:
    train_lib.train_stacked([j.config for j in group], [str(j.dir) for j in group])


def train_serially(groups: list[list[sweep.Job]]) -> list[str]:
  """Trains the groups one after another; returns the failed job ids. A run that fails
  (e.g. a non-finite loss at a too-large learning rate) is reported and the sweep goes
  on, as in train_in_parallel."""
  t0, failed = time.time(), []
  for i, group in enumerate(groups, 1):
    what = ", ".join(f"lr={j.lr:g} seed={j.seed}" for j in group)
    print(f"[{i}/{len(groups)}] {group[0].run} {what} ({report.label_text(group[0].labels)})"
          f" -> {group[0].dir.parent}  [{time.time() - t0:.0f}s elapsed]", flush=True)
    try:
      train_group(group)
    except Exception as e:  # pylint: disable=broad-exception-caught
      failed += [sweep.job_id(j) for j in group]
      print(f"FAILED {', '.join(map(sweep.job_id, group))}: {type(e).__name__}: "
            f"{str(e)[:500]}", flush=True)
  return failed


def train_in_parallel(groups: list[list[sweep.Job]], workers: int) -> list[str]:
  """Trains the groups (see `sweep.groups_of`) in up to `workers` child processes;
  returns the failed job ids.

  A child re-runs this program with the same flags plus --job; its output goes to
  train.log in the run directory of the group's first job. Killing the parent (Ctrl-C,
  SIGTERM) ends the children too.
  """
  argv = without(sys.argv[1:], ("--workers", "--only", "--results", "--report_only",
                                "--job"))
  failed, ended, t0 = [], [], time.time()
  total = sum(map(len, groups))

  def log_path(group: list[sweep.Job]) -> pathlib.Path:
    for job in group:
      job.dir.mkdir(parents=True, exist_ok=True)
    return group[0].dir / "train.log"

  def on_start(group: list[sweep.Job]) -> None:
    print(f"[{time.time() - t0:5.0f}s] start  {', '.join(map(sweep.job_id, group))} "
          f"({report.label_text(group[0].labels)})", flush=True)

  def on_exit(group: list[sweep.Job], returncode: int, seconds: float) -> None:
    for job in group:
      ended.append(sweep.job_id(job))
      summary = sweep.read_summary(job)
      if returncode == 0 and summary is not None:
        ev = summary.get("eval") or {}
        result = ", ".join(f"{k}={ev[k]:.4f}" for k in ("loss", "accuracy") if k in ev)
      else:
        failed.append(sweep.job_id(job))
        tail = (group[0].dir / "train.log").read_text(errors="replace").splitlines()[-5:]
        result = f"FAILED (exit {returncode}): " + " | ".join(tail)
      print(f"[{time.time() - t0:5.0f}s] {len(ended)}/{total} done {sweep.job_id(job)} in "
            f"{seconds:.0f}s: {result}", flush=True)

  pool.run(groups, workers,
           lambda group: [sys.executable, "-m", "experiments.ablation", *argv,
                          "--job=" + ",".join(map(sweep.job_id, group))],
           log_path, on_exit, on_start)
  return failed
