r"""Runs one of the paper's ablations and writes its table and figure.

    python -m experiments.ablation --config=configs/fig7.py:cpu
    python -m experiments.ablation --config=configs/table7.py --workdir=/tmp/sse

Every run of the sweep (config.runs x config.lrs x config.seeds) trains with
`sse_jax.train.train_and_evaluate` into <workdir>/<sweep>/<run>/lr<lr>_s<seed>/; a run
whose summary.json exists is skipped, so an interrupted sweep resumes where it stopped
(and an interrupted run resumes from its last checkpoint). With --workers=W, W runs
train at once in child processes (logs in each run's train.log). With --stack, the
learning rates and seeds of one run train as one vmapped program (one process, or one
child, per run; each still gets its own run directory). At the end the sweep
directory receives results.json, results.csv, results.md and <sweep>.png (and, when
the config names `controls`, a verdict at the end of results.md: `verdict`); with
--results=DIR they are copied there too.

Per run, the learning rate with the lowest final eval loss (mean over seeds) is kept
(`report.collect`). The pieces: `sweep` (the jobs), `dispatch` (training them),
`report` (rows and tables), `plots` (the figure, by cfg.figure).
"""

from __future__ import annotations

import pathlib
import shutil
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from experiments import dispatch
from experiments import plots
from experiments import report
from experiments import sweep
from experiments import verdict

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Experiment config file, e.g."
                                " configs/fig7.py:cpu.", lock_config=False)
flags.DEFINE_string("workdir", "workdir", "Root of the run directories.")
flags.DEFINE_string("results", "", "Also copy the tables and figure into this directory.")
flags.DEFINE_list("only", [], "Run only these run names (the report covers all finished runs).")
flags.DEFINE_bool("report_only", False, "Only rebuild the report from finished runs.")
flags.DEFINE_integer("workers", 1, "Runs trained at once, each in its own process: a small"
                     " model leaves a GPU mostly idle. On GPU each process may take"
                     " 0.9 / workers of the device memory. Default: the config's"
                     " `workers` where it has one.")
flags.DEFINE_bool("stack", False, "Train each run's learning rates and seeds together as"
                  " one vmapped program (sse_jax.train.train_stacked), one process per"
                  " run: small models cost about one run's kernel launches for all."
                  " Default: the config's `stack` where it has one.")
flags.DEFINE_list("job", [], "(internal) train these runs <run>/lr<lr>_s<seed> (several:"
                  " stacked) and exit.")

# The pipeline's steps under the names notebooks/02_ablation.ipynb calls them by.
expand, label_text = sweep.expand, report.label_text
read_summary, collect, write_tables = report.read_summary, report.collect, report.write_tables
plot = plots.plot


def train_only_jobs(jobs: list[sweep.Job]) -> None:
  """--job (a child of --workers): trains the named jobs, as one group."""
  by_id = {sweep.job_id(j): j for j in jobs}
  unknown = [i for i in FLAGS.job if i not in by_id]
  if unknown:
    raise app.UsageError(f"--job: no such run {unknown} in {FLAGS.config.name}; runs: "
                         + ", ".join(by_id))
  dispatch.train_group([by_id[i] for i in FLAGS.job])


def setting(cfg, name: str):
  """--stack / --workers when given on the command line, else the config's own value
  (a config knows what its models need), else the flag's default."""
  if FLAGS[name].present or name not in cfg:
    return FLAGS[name].value
  return cfg[name]


def train_pending(jobs: list[sweep.Job]) -> tuple[list[str], bool]:
  """Trains the jobs of --only (all by default) that have not finished; returns the
  failed job ids and whether training was interrupted (Ctrl-C)."""
  todo = [j for j in jobs if not FLAGS.only or j.run in FLAGS.only]
  pending = [j for j in todo if report.read_summary(j) is None]
  if len(pending) < len(todo):
    print(f"{len(todo) - len(pending)} of {len(todo)} runs already finished: skipped",
          flush=True)
  cfg = FLAGS.config
  groups = sweep.groups_of(pending, setting(cfg, "stack"))
  workers = setting(cfg, "workers")
  try:
    if workers > 1 and len(groups) > 1:
      return dispatch.train_in_parallel(groups, workers), False
    return dispatch.train_serially(groups), False
  except KeyboardInterrupt:
    # Still report what finished (and how far the rest got), then exit as interrupted.
    print("interrupted: reporting the runs so far", flush=True)
    return [], True


def write_report(cfg, jobs: list[sweep.Job], root: pathlib.Path, command: str) -> None:
  """results.json / .csv / .md, the figure and, with controls, the verdict in root."""
  rows = report.collect(cfg, jobs)
  if not rows:
    raise SystemExit(f"no finished runs under {root}")
  report.write_tables(cfg, rows, root, command)
  plots.plot(cfg, rows, root / f"{cfg.name}.png")
  lines = verdict.verdict(cfg, rows, root / "results.md", root / f"{cfg.name}.png")
  if lines:
    with open(root / "results.md", "a") as f:
      f.write("\n".join(["", "## Verdict", "", *lines]) + "\n")
  print((root / "results.md").read_text())
  if FLAGS.results:
    dest = pathlib.Path(FLAGS.results)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("results.json", "results.csv", "results.md", f"{cfg.name}.png"):
      shutil.copy(root / name, dest / name)
    print(f"copied the report to {dest}")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # checkpointing logs every save at INFO
  cfg = FLAGS.config
  if cfg is None:
    raise app.UsageError("--config is required, e.g. --config=configs/fig7.py:cpu")
  if setting(cfg, "workers") < 1:
    raise app.UsageError(f"--workers={setting(cfg, 'workers')}: must be >= 1")
  try:
    plots.figure_of(cfg.figure)  # before training, not after hours of it
  except ValueError as e:
    raise SystemExit(f"{cfg.name}: {e}") from None
  root = pathlib.Path(FLAGS.workdir) / cfg.name
  root.mkdir(parents=True, exist_ok=True)
  jobs = sweep.expand(cfg, root)
  if FLAGS.job:
    train_only_jobs(jobs)
    return
  names = {j.run for j in jobs}
  unknown = [n for n in FLAGS.only if n not in names]
  if unknown:
    raise app.UsageError(f"--only: unknown run names {unknown}; runs: {sorted(names)}")
  sweep.check_finished_runs(jobs)
  command = "python -m experiments.ablation " + " ".join(  # what reproduces the runs
      dispatch.without(sys.argv[1:], ("--workdir", "--report_only", "--workers")))
  failed, interrupted = ([], False) if FLAGS.report_only else train_pending(jobs)
  write_report(cfg, jobs, root, command)
  if interrupted:
    raise SystemExit(130)
  if failed:
    raise SystemExit(f"{len(failed)} runs failed (see the output above, or their "
                     f"train.log with --workers): {failed}")


if __name__ == "__main__":
  app.run(main)
