r"""Table 4 at small scale: convert a trained Transformer into SSE-H and GLA-H hybrids.

    python -m experiments.convert --config=configs/table4.py:cpu   # 2 CPU cores, minutes
    python -m experiments.convert --config=configs/table4.py        # one GPU, 3 seeds

Three stages, all through the ablation runner's pieces (`sweep`, `dispatch`, `report`,
`plots`), into <workdir>/<sweep>/<run>/lr<lr>_s<seed>/ like any sweep:
  1. the source run (cfg.source, a Transformer) trains for train.num_steps;
  2. every converted run (a run with `init` naming the source) gets a step-0 checkpoint:
     its own fresh init with the weights the source's checkpoint of the same seed (at
     the source's best learning rate) carries over (`weight_map`: W_q / W_k / W_v / W_o
     and the short convs of the replaced layers, everything of the other layers);
  3. the continued runs (converted, and the same hybrids from scratch as the control)
     train for cfg.continue_fraction of the source's steps (warm-up, eval, log and
     checkpoint intervals scaled alike), the converted ones resuming from step 0.
Then the report: results.json / .csv / .md and the figure (cfg.figure) in the sweep
directory, as `experiments.ablation` writes them, and a one-line verdict at the end of
results.md (and in results.json): at the largest evaluated pair count, each converted
hybrid against the same hybrid from scratch (does conversion help?), the two converted
hybrids against each other and against the original.

The continued budget is derived after the --config flags are applied, so
--config.train.num_steps=N scales every stage. A run trained already is skipped (a
converted run that has its step-0 checkpoint is not converted again). The flags are
`experiments.ablation`'s; runs train one group after another (--workers is refused: a
child process of the ablation runner would not derive the continued budget). A source
run that did not finish, or whose checkpoint cannot be read or does not convert (a
damaged file, another model, head dims that do not match), is one line on stderr and
exit status 1.
"""

from __future__ import annotations

import json
import pathlib
import shlex
import sys
from typing import Any

from absl import app
from absl import flags
from absl import logging
import ml_collections

from experiments import ablation
from experiments import dispatch
from experiments import plots
from experiments import report
from experiments import sweep
from experiments import weight_map
from sse_jax.cli import usage_exit
from sse_jax.train import CheckpointError, load_state
from sse_jax.train import config as config_lib
from sse_jax.train import loop

FLAGS = flags.FLAGS


class ConversionError(ValueError):
  """The source run cannot seed a converted run (one line, names the run)."""


def continued_budget(train: ml_collections.ConfigDict, fraction: float) -> dict[str, int]:
  """The continued runs' step fields: fraction of the source's num_steps (>= 1), its
  warm-up, eval, log and checkpoint intervals scaled alike (warm-up < steps)."""
  if not 0 < fraction <= 1:
    raise app.UsageError(f"--config.continue_fraction={fraction}: must lie in (0, 1]")
  steps = max(1, round(fraction * train.num_steps))
  scale = lambda every: max(1, round(fraction * every)) if every else 0
  return dict(num_steps=steps, warmup_steps=min(round(fraction * train.warmup_steps),
                                                steps - 1),
              eval_every=scale(train.eval_every), log_every=scale(train.log_every),
              checkpoint_every=scale(train.checkpoint_every))


def with_budget(cfg: ml_collections.ConfigDict, jobs: list[sweep.Job]) -> list[sweep.Job]:
  """Sets the continued budget in the train configs of the jobs of runs marked
  `continued` (in place; returns the jobs)."""
  budget = continued_budget(cfg.train, float(cfg.continue_fraction))
  continued = {r["name"] for r in cfg.runs if r.get("continued")}
  for job in jobs:
    if job.run in continued:
      job.config.update(budget)
  return jobs


def sweep_jobs(cfg: ml_collections.ConfigDict, root: pathlib.Path) -> list[sweep.Job]:
  """`ablation.sweep_jobs` (the --config.train flags checked, every job validated) with
  the continued budget derived from the resulting train config (valid by construction:
  steps >= 1, warm-up below them, intervals >= 0)."""
  return with_budget(cfg, ablation.sweep_jobs(cfg, root))


def source_of(cfg, jobs: list[sweep.Job], job: sweep.Job) -> sweep.Job:
  """The source job a converted job starts from: the source run's job of the same seed
  at the source's best learning rate (lowest final eval loss, as the report picks)."""
  name = next(r["init"] for r in cfg.runs if r["name"] == job.run)
  mine = [j for j in jobs if j.run == name]
  if not mine:
    raise ConversionError(f"run {job.run}: its init names {name!r}, not a run of "
                          f"{cfg.name}")
  rows = report.collect(cfg, mine)
  lr = rows[0]["lr"] if rows and rows[0]["finished"] else mine[0].lr
  found = [j for j in mine if j.lr == lr and j.seed == job.seed]
  if not found:
    raise ConversionError(f"run {sweep.job_id(job)}: the source {name!r} has no seed "
                          f"{job.seed} (its seeds: {sorted({j.seed for j in mine})})")
  return found[0]


def seed_converted(cfg, jobs: list[sweep.Job], job: sweep.Job) -> list[str]:
  """Writes the converted job's step-0 checkpoint from its source's latest checkpoint;
  returns the carried parameter paths. ConversionError (one line) if the source is
  unfinished, unreadable or does not convert."""
  source = source_of(cfg, jobs, job)
  where = f"{sweep.job_id(job)}: source {source.dir}"
  if sweep.read_summary(source) is None:
    raise ConversionError(f"{where} has not finished (no summary.json): train it first")
  try:
    state, step = load_state(source.config, str(source.dir))
  except (CheckpointError, ValueError, OSError) as e:
    raise ConversionError(f"{where}: unusable checkpoint: {' '.join(str(e).split())}"
                          ) from None
  src_model = config_lib.model_config(source.config)
  carried: list[str] = []

  def transform(params, program):
    out, paths = weight_map.convert_params(state.params, src_model, params,
                                           program.model_config)
    carried.extend(paths)
    return out

  try:
    loop.write_initial_checkpoint(job.config, str(job.dir), transform)
  except ValueError as e:
    raise ConversionError(f"{where} (step {step}) does not seed the converted run: "
                          f"{' '.join(str(e).split())}") from None
  return carried


def provenance(cfg, jobs: list[sweep.Job]) -> None:
  """Records in each converted job's tags (config.json) where its weights come from;
  the same for every seed of a run, so its seeds still stack."""
  for job in jobs:
    run = next(r for r in cfg.runs if r["name"] == job.run)
    if run.get("init"):
      source = source_of(cfg, jobs, job)
      job.config.tags = dict(converted_from=f"{source.run}/lr{source.lr:g} (same seed)",
                             replaced_layers=list(run.get("replaced", ())))


def pending(jobs: list[sweep.Job]) -> list[sweep.Job]:
  return [j for j in jobs if sweep.read_summary(j) is None]


def train(jobs: list[sweep.Job], stack: bool) -> list[str]:
  """Trains the pending jobs serially (stacked per run); the failed job ids."""
  todo = pending(jobs)
  if len(todo) < len(jobs):
    print(f"{len(jobs) - len(todo)} of {len(jobs)} runs already finished: skipped",
          flush=True)
  return dispatch.train_serially(sweep.groups_of(todo, stack)) if todo else []


def convert_pending(cfg, jobs: list[sweep.Job], selected: list[sweep.Job]) -> None:
  """Stage 2: seeds every selected converted job that has no checkpoint yet."""
  for job in selected:
    run = next(r for r in cfg.runs if r["name"] == job.run)
    if not run.get("init") or sweep.read_summary(job) is not None:
      continue
    if (job.dir / "checkpoints").is_dir() and any((job.dir / "checkpoints").iterdir()):
      continue  # seeded (or part trained) already: resume
    carried = seed_converted(cfg, jobs, job)
    print(f"converted {sweep.job_id(job)} from {source_of(cfg, jobs, job).dir}: "
          f"{len(carried)} arrays carried over, the rest fresh", flush=True)


def verdict_line(cfg, rows: list[dict[str, Any]]) -> str:
  """At the largest evaluated P: each converted hybrid vs its from-scratch control, the
  converted hybrids vs each other, and the original, mean ± std over seeds."""
  pairs = report.rows_largest_pairs(rows)
  stat = lambda r: report.mean_std((r.get("accuracy_by_pairs") or {}).get(pairs, []))
  find = lambda **labels: next((r for r in rows if all(
      r["labels"].get(k) == v for k, v in labels.items()) and stat(r)), None)
  text = lambda m: f"{m[0]:.3f} ± {m[1]:.3f}"
  # apart: beyond the larger seed spread; with one seed no spread is measured, so any
  # difference counts and the line says so
  apart = lambda a, b: abs(a[0] - b[0]) > max(a[1], b[1])
  parts = []
  source = find(init="trained")
  if source:
    parts.append(f"original {source['run']} {text(stat(source))}")
  converted = {}
  for hybrid in cfg.hybrids:
    conv, scratch = find(hybrid=hybrid, init="converted"), find(hybrid=hybrid, init="scratch")
    if conv is None or scratch is None:
      parts.append(f"{hybrid}: converted or scratch run missing")
      continue
    a, b = stat(conv), stat(scratch)
    converted[hybrid] = a
    said = ("conversion helps" if a[0] > b[0] else "conversion hurts") if apart(a, b) \
        else "no difference beyond the seed spread"
    parts.append(f"{hybrid} converted {text(a)} vs from scratch {text(b)}: {said} "
                 f"({a[0] - b[0]:+.3f})")
  if len(converted) == 2:
    (h1, a), (h2, b) = converted.items()
    parts.append(f"converted {h1} - {h2} {a[0] - b[0]:+.3f}"
                 + ("" if apart(a, b) else " (within the seed spread)"))
  seeds = max((r["seeds"] for r in rows), default=0)
  note = "; one seed: no spread measured, so any difference counts" if seeds < 2 else ""
  return (f"Verdict (P={pairs}, mean ± std over {seeds} seed{'s' if seeds != 1 else ''}"
          f"{note}): " + "; ".join(parts) + ".")


def add_verdict(cfg, root: pathlib.Path, line: str) -> None:
  """Appends the verdict to results.md and results.json (and their --results copies)."""
  places = [root] + ([pathlib.Path(FLAGS.results)] if FLAGS.results else [])
  for place in places:
    with open(place / "results.md", "a") as f:
      f.write(f"\n## Verdict\n\n{line}\n")
    results = json.loads((place / "results.json").read_text())
    results["verdict"] = line
    (place / "results.json").write_text(json.dumps(results, indent=1))
  print(line, flush=True)


def run_conversion(argv: list[str]) -> None:
  """The three stages and the report (see the module docstring)."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected argument {argv[1]!r}: flags are --name=value, the"
                         " config --config=FILE[:ARG]")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save
  cfg = FLAGS.config
  if cfg is None:
    raise app.UsageError("--config is required, e.g. --config=configs/table4.py:cpu")
  if "source" not in cfg or "continue_fraction" not in cfg:
    raise app.UsageError(f"--config={FLAGS['config'].config_filename}: not a conversion "
                         "config (it needs `source` and `continue_fraction`; "
                         "configs/table4.py)")
  if FLAGS.job or (FLAGS["workers"].present and FLAGS.workers != 1):
    raise app.UsageError("experiments.convert trains its runs one group after another: "
                         "--workers and --job are the ablation runner's")
  try:
    plots.figure_of(cfg.figure)
  except ValueError as e:
    raise app.UsageError(f"--config={FLAGS['config'].config_filename}: {e}") from None
  root = pathlib.Path(FLAGS.workdir) / cfg.name
  jobs = sweep_jobs(cfg, root)
  ablation.make_dir(root, "workdir")
  names = [r["name"] for r in cfg.runs]
  unknown = [n for n in FLAGS.only if n not in names]
  if unknown:
    raise app.UsageError(f"--only: unknown run names {unknown}; runs: {names}")
  if FLAGS.results:
    ablation.make_dir(pathlib.Path(FLAGS.results), "results")
  sweep.check_finished_runs(jobs)
  provenance(cfg, jobs)
  command = shlex.join(["python", "-m", "experiments.convert", *dispatch.without(
      sys.argv[1:], ("--workdir", "--report_only", "--workers"))])
  failed, interrupted = [], False
  if not FLAGS.report_only:
    selected = [j for j in jobs if not FLAGS.only or j.run in FLAGS.only]
    needs_source = any(next(r for r in cfg.runs if r["name"] == j.run).get("init")
                       for j in selected)
    source = [j for j in jobs if j.run == cfg.source and (needs_source or j in selected)]
    stack = ablation.setting(cfg, "stack")
    try:
      print(f"stage 1: the source {cfg.source}", flush=True)
      failed = train(source, stack)
      if not failed:
        print("stage 2: conversion", flush=True)
        convert_pending(cfg, jobs, selected)
        print(f"stage 3: continued training ({cfg.continue_fraction:g} of the source's "
              "steps)", flush=True)
        failed = train([j for j in selected if j.run != cfg.source], stack)
    except KeyboardInterrupt:
      print("interrupted: reporting the runs so far", flush=True)
      interrupted = True
  ablation.write_report(cfg, jobs, root, command)
  add_verdict(cfg, root, verdict_line(cfg, report.collect(cfg, jobs)))
  if interrupted:
    raise SystemExit(130)
  if failed:
    raise SystemExit(f"{len(failed)} runs failed (see the output above): {failed}")


def main(argv):
  """Usage mistakes: one line, exit 2; a source that does not convert: one line, exit 1."""
  try:
    run_conversion(argv)
  except app.UsageError as e:
    usage_exit(e)
  except ConversionError as e:
    print(" ".join(str(e).split()), file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main, flags_parser=ablation.parse_flags)
