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

--config.<path>=<value> sets a field of the experiment config (train fields under
--config.train, e.g. --config.train.num_steps=500). Two rules keep the sweep what the
command line says (`sweep.check_train_changes`):
  - a train field that runs set again in their own overrides is refused, naming those
    runs (fig7's SSE runs set model.sse.top_k, its GLA runs all of `model`): the flag
    would be dropped silently for them; such a field is changed in the config file.
    train.lr and train.seed are refused too: each job's come from --config.lrs and
    --config.seeds;
  - --config.train.data.<field> also sets eval_data.<field> (the validation stream the
    learning rates are chosen on, and from which the test sets are made) when the config
    file's eval_data is its data on another split (every field but `split` equal, as
    `configs.common.train` builds it), unless --config.train.eval_data.<field> is given
    too; where eval_data is a stream of its own, such a data flag is refused.
A mistake on the command line (a config file or argument that does not exist, a field
the config does not have, a workdir that cannot be made, a flag a run would ignore, a
train field with an impossible value) is one line on stderr and exit status 2, before
anything trains. results.json and results.md record the command (less --workdir,
--workers and --report_only) quoted for the shell.
"""

from __future__ import annotations

import pathlib
import shlex
import shutil
import sys

from absl import app
from absl import flags
from absl import logging
import ml_collections
from ml_collections import config_flags

from experiments import dispatch
from experiments import plots
from experiments import report
from experiments import sweep
from experiments import verdict
from sse_jax import cli
from sse_jax.train import config as config_lib

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Experiment config file and its argument, e.g. configs/fig7.py:cpu."
    " Its fields are set with --config.<path>=<value>, e.g. --config.train.num_steps=500."
    " A train field that runs set in their own overrides is refused (it would be"
    " ignored for them); --config.train.data.<field> also sets eval_data.<field> when"
    " the config's eval_data is its data on another split, unless"
    " --config.train.eval_data.<field> is given too, and is refused where eval_data is"
    " a stream of its own.", lock_config=False)
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
read_summary, collect, write_tables = sweep.read_summary, report.collect, report.write_tables
plot = plots.plot


def load_config(argument: str) -> ml_collections.ConfigDict:
  """The experiment config that --config=<file>[:<arg>] names, as its file builds it (no
  --config.* flags applied; `sse_jax.cli.load_config_file`); a file that does not exist
  or fails to build its config, or a config that is not an experiment's (a training
  config: the trainer's command runs it), is an app.UsageError naming the flag."""
  cfg = cli.load_config_file(argument)
  if not {"train", "runs"} <= set(cfg):
    raise app.UsageError(f"--config={argument}: get_config() did not return an experiment"
                         " config (a ConfigDict with train and runs; configs/common.py);"
                         " a training config runs with python -m sse_jax.train"
                         f" --config={argument} --workdir=DIR")
  return cfg


def check_config_flags(args: list[str]) -> None:
  """Loads --config and checks that every --config.<path> flag names one of its fields
  that a flag can set (`sse_jax.cli.check_override_paths`), before absl parses them: a
  missing file, a failing config argument or a field that does not exist would be a
  traceback there. The message suggests the closest field (e.g.
  --config.model.sse.top_k: --config.train.model.sse.top_k)."""
  argument = cli.config_argument(args)
  if argument:  # without --config, main says so
    cli.check_override_paths(args, argument, load_config(argument))


def parse_flags(argv: list[str]) -> list[str]:
  """app.run's flag parser: absl's, after `check_config_flags`, with every mistake one
  line and exit status 2 (`sse_jax.cli.usage_exit`); --help still prints the flags' help."""
  try:
    check_config_flags(argv[1:])
    return FLAGS(argv)
  except (app.UsageError, flags.Error) as e:
    cli.usage_exit(e)


def make_dir(path: pathlib.Path, flag: str) -> None:
  """mkdir -p, a directory that cannot be made an app.UsageError naming the flag."""
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise app.UsageError(f"--{flag}={FLAGS[flag].value}: cannot create {path} "
                         f"({e.strerror or e}): give a directory you can write to") from None


def sweep_jobs(cfg, root: pathlib.Path) -> list[sweep.Job]:
  """The sweep's jobs (`sweep.expand`), the --config.train flags checked against the
  config file's own values first (`sweep.check_train_changes`), every job's train
  config validated (`sse_jax.train.config.validate`): a mistake is refused before any
  run trains, not reported by every run as it fails."""
  defaults = load_config(FLAGS["config"].config_filename)
  given = list(FLAGS["config"].override_values)
  train = None if "train" in given else [p[len("train."):] for p in given
                                         if p.startswith("train.")]
  jobs = sweep.expand(cfg, root, defaults=defaults, given=train)
  for job in jobs:
    try:
      config_lib.validate(job.config)
    except ValueError as e:
      raise app.UsageError(f"run {sweep.job_id(job)}: {e}") from None
  return jobs


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
  pending = [j for j in todo if sweep.read_summary(j) is None]
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
  try:
    report.write_tables(cfg, rows, root, command)
    plots.plot(cfg, rows, root / f"{cfg.name}.png")
    verdict.append_to_report(cfg, rows, root)
  except OSError as e:
    # A full or read-only disk: the runs are trained, so say where writing failed and
    # still print one line per run rather than dying in a traceback.
    print(f"could not write the report under {root}: {e.strerror or e}"
          f"{f' ({e.filename})' if getattr(e, 'filename', None) else ''}; the runs:",
          file=sys.stderr, flush=True)
    for row in rows:
      print(f"{row['run']}: {cfg.metric} {row['metric']:.4f} ± {row['metric_std']:.4f}"
            f" over {row['seeds']} seeds at step {row['step']}", flush=True)
    raise SystemExit(1) from None
  print((root / "results.md").read_text())
  if FLAGS.results:
    dest = pathlib.Path(FLAGS.results)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("results.json", "results.csv", "results.md", f"{cfg.name}.png"):
      shutil.copy(root / name, dest / name)
    print(f"copied the report to {dest}")


def main(argv):
  """Runs the sweep; a usage mistake is one line on stderr and exit status 2."""
  try:
    run_sweep(argv)
  except app.UsageError as e:
    cli.usage_exit(e)


def run_sweep(argv):
  """Trains the sweep's pending runs (or one --job group) and writes the report."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected argument {argv[1]!r}: flags are --name=value, the"
                         " config --config=FILE[:ARG]")
  logging.set_verbosity(logging.WARNING)  # checkpointing logs every save at INFO
  cfg = FLAGS.config
  if cfg is None:
    raise app.UsageError("--config is required, e.g. --config=configs/fig7.py:cpu")
  if "source" in cfg:
    # The converted runs start from the source run's weights, which only the conversion
    # runner writes; trained here they would silently start from scratch.
    argument = FLAGS["config"].config_filename
    raise app.UsageError(f"--config={argument}: a conversion config (source="
                         f"{cfg.source!r}) runs with python -m experiments.convert"
                         f" --config={argument}")
  if setting(cfg, "workers") < 1:
    raise app.UsageError(f"--workers={setting(cfg, 'workers')}: must be >= 1")
  try:
    plots.figure_of(cfg.figure)  # before training, not after hours of it
  except ValueError as e:
    raise app.UsageError(f"--config={FLAGS['config'].config_filename}: {e}") from None
  root = pathlib.Path(FLAGS.workdir) / cfg.name
  jobs = sweep_jobs(cfg, root)
  make_dir(root, "workdir")
  if FLAGS.job:
    train_only_jobs(jobs)
    return
  names = {j.run for j in jobs}
  unknown = [n for n in FLAGS.only if n not in names]
  if unknown:
    raise app.UsageError(f"--only: unknown run names {unknown}; runs: {sorted(names)}")
  if FLAGS.results:
    make_dir(pathlib.Path(FLAGS.results), "results")  # before training, not after
  sweep.check_finished_runs(jobs)
  command = shlex.join(["python", "-m", "experiments.ablation", *dispatch.without(
      sys.argv[1:], ("--workdir", "--report_only", "--workers"))])  # reproduces the runs
  failed, interrupted = ([], False) if FLAGS.report_only else train_pending(jobs)
  write_report(cfg, jobs, root, command)
  if interrupted:
    raise SystemExit(130)
  if failed:
    raise SystemExit(f"{len(failed)} runs failed (see the output above, or their "
                     f"train.log with --workers): {failed}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
