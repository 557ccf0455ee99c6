r"""Merges the reports of one sweep trained in pieces into one table and figure.

    python -m experiments.merge_reports --config=configs/fig7.py --config.lrs="(0.003,)" \
        --config.seeds="(0, 1, 2)" --config.train.num_steps=12000 ... \
        --reports=results/a/fig7,results/b/fig7 --out=results/all/fig7

    # a table's base run taken from another sweep's report (checked to be the same run):
    python -m experiments.merge_reports --config=configs/table6.py ... \
        --reports=results/a/table6 --borrow=softmax=N4_k1@results/all/fig7 --out=...

A long sweep is often trained over several sessions, each writing a report
(`experiments.ablation --results=DIR`) of the runs it got to. This takes the
config the runs were trained with (the same --config flags) and, for every run of the
sweep, the row of the last report that has it finished (of the furthest-trained one if
none finished), and writes results.json / .csv / .md and the figure as the runner does,
with a "Sources" list saying where each row came from.

Nothing is mixed silently: the `--config.*` flags in each source report's command are
applied to its config file and the run must then train exactly what this config's run
trains (model resolved, data, held-out data, optimizer, schedule, seed and lr;
`sse_jax.train.config.fingerprint`), or the merge stops naming the differing fields.
That is also what makes --borrow safe: table6's softmax run and fig7's N4_k1 are one
model, so one training can stand for both.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import pathlib
import re
import shlex
import sys
from typing import Any

from absl import app
from absl import flags
import ml_collections

from experiments import ablation  # pylint: disable=unused-import (defines --config)
from experiments import plots
from experiments import report
from experiments import sweep
from experiments import verdict
from sse_jax.train import config as config_lib

FLAGS = flags.FLAGS
# --config (the sweep's config file, with the --config.* flags its runs were trained
# with) is the runner's flag, defined by importing experiments.ablation.


def define_flags() -> None:
  """This tool's flags, defined only when it runs: as module-level flags they would clash
  with other experiments' (--out) in a process that imports several."""
  flags.DEFINE_list("reports", [], "Report directories (each with a results.json) of this"
                    " sweep; a later one wins where two have the same run finished.")
  flags.DEFINE_list("borrow", [], "RUN=OTHER_RUN@DIR: this sweep's RUN is the row OTHER_RUN"
                    " of the report in DIR (of any sweep), which must be the same training.")
  flags.DEFINE_string("out", None, "Directory for the merged report.")


@dataclasses.dataclass(frozen=True)
class Source:
  """One report row offered for a run of the merged sweep."""
  report: pathlib.Path  # the report directory
  run: str              # the row's run name in that report
  row: dict[str, Any]
  command: str          # the command that made the report


def _tokens(command: str) -> list[str]:
  # Reports join argv with spaces ("--config.seeds=(0, 1, 2)" spans three words), so
  # split only where a flag starts.
  return re.split(r"\s+(?=--)", command.strip())


def _value(text: str) -> Any:
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text  # a bare string, as config_flags takes it


def config_of_command(command: str) -> ml_collections.ConfigDict:
  """The sweep config an `experiments.ablation` command trained with: its --config file
  and argument, with its --config.* overrides applied."""
  tokens = _tokens(command)
  files = [t.split("=", 1)[1] for t in tokens if t.startswith("--config=")]
  if len(files) != 1:
    raise ValueError(f"command {command!r}: expected one --config=FILE[:ARG]")
  path, _, arg = files[0].partition(":")
  spec = importlib.util.spec_from_file_location("_merged_sweep_config", path)
  if spec is None or not pathlib.Path(path).exists():
    raise ValueError(f"command {command!r}: no config file {path!r} (run from the"
                     " checkout's root)")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config(arg or None)
  for t in tokens:
    if t.startswith("--config."):
      key, _, text = t[len("--config."):].partition("=")
      sweep.set_path(cfg, key, _value(text))
  return cfg


def _trained(cfg, run: str, lr: float, seed: int) -> dict[str, Any]:
  """What run `run` at (lr, seed) of sweep `cfg` computes: the checkpoint fingerprint with
  the model config resolved, plus the held-out data its metric is measured on."""
  jobs = [j for j in sweep.expand(cfg, pathlib.Path("."))
          if j.run == run and j.lr == lr and j.seed == seed]
  if not jobs:
    raise ValueError(f"sweep {cfg.name} has no run {run!r} at lr {lr:g}, seed {seed}"
                     f" (lrs {list(cfg.lrs)}, seeds {list(cfg.seeds)})")
  c = jobs[0].config
  out = config_lib.fingerprint(c)
  out["model"] = json.loads(json.dumps(dataclasses.asdict(config_lib.model_config(c))))
  out["eval_data"] = json.loads(json.dumps(config_lib.to_dict(c.eval_data)))
  return out


def check_same_training(cfg, run: str, source: Source) -> None:
  """Raises unless every seed of the source row trained what `run` of `cfg` trains."""
  theirs = config_of_command(source.command)
  lr = float(source.row["lr"])
  for seed in source.row["seeds_used"]:
    problems = config_lib.diff(_trained(theirs, source.run, lr, seed),
                               _trained(cfg, run, lr, seed), old="in the report",
                               new="in this config")
    if problems:
      raise ValueError(
          f"{source.report}: its run {source.run!r} (lr {lr:g}, seed {seed}) is not the"
          f" training of {cfg.name}'s run {run!r}:"
          "\n  " + "\n  ".join(problems))


def _read(report: pathlib.Path) -> dict[str, Any]:
  path = report / "results.json"
  if not path.exists():
    raise ValueError(f"{report}: no results.json (a report directory of"
                     " experiments.ablation --results=DIR)")
  return json.loads(path.read_text())


def candidates(cfg, reports: list[str], borrows: list[str]) -> dict[str, list[Source]]:
  """Every source row offered for each run of `cfg`, in command-line order."""
  names = [r["name"] for r in cfg.runs]
  out: dict[str, list[Source]] = {n: [] for n in names}
  for report in map(pathlib.Path, reports):
    data = _read(report)
    if data["name"] != cfg.name:
      raise ValueError(f"{report}: a report of sweep {data['name']!r}, not {cfg.name!r}"
                       " (use --borrow for a run of another sweep)")
    for row in data["rows"]:
      if row["run"] not in out:
        raise ValueError(f"{report}: run {row['run']!r} is not in {cfg.name} ({names})")
      out[row["run"]].append(Source(report, row["run"], row, data["command"]))
  for spec in borrows:
    m = re.fullmatch(r"([^=@]+)=([^=@]+)@(.+)", spec)
    if not m:
      raise ValueError(f"--borrow={spec!r}: use RUN=OTHER_RUN@REPORT_DIR")
    run, other, report = m.group(1), m.group(2), pathlib.Path(m.group(3))
    if run not in out:
      raise ValueError(f"--borrow={spec!r}: no run {run!r} in {cfg.name} ({names})")
    data = _read(report)
    rows = [r for r in data["rows"] if r["run"] == other]
    if not rows:
      raise ValueError(f"--borrow={spec!r}: {report} has no run {other!r}"
                       f" ({[r['run'] for r in data['rows']]})")
    out[run].append(Source(report, other, rows[0], data["command"]))
  return out


def choose(offered: list[Source]) -> Source | None:
  """The last finished row; if none finished, the furthest-trained (the later on a tie)."""
  finished = [s for s in offered if s.row["finished"]]
  if finished:
    return finished[-1]
  return max(reversed(offered), key=lambda s: s.row["step"], default=None)


def merge(cfg, reports: list[str], borrows: list[str]) -> tuple[list[dict], list[Source]]:
  """The merged rows, in the sweep's run order, and the source of each."""
  rows, used = [], []
  offered = candidates(cfg, reports, borrows)
  for run in cfg.runs:
    source = choose(offered[run["name"]])
    if source is None:
      continue
    check_same_training(cfg, run["name"], source)
    if source.row["finished"] and source.row["step"] != cfg.train.num_steps:
      raise ValueError(f"{source.report}: run {source.run!r} finished at step"
                       f" {source.row['step']}, the config trains {cfg.train.num_steps}")
    rows.append(dict(source.row, run=run["name"], labels=dict(run["labels"]),
                     source=f"{source.report}:{source.run}"))
    used.append(source)
  return rows, used


def main(argv):
  del argv
  cfg = FLAGS.config
  if cfg is None or not FLAGS.out or not (FLAGS.reports or FLAGS.borrow):
    raise app.UsageError("--config, --out and --reports (or --borrow) are required")
  try:
    rows, used = merge(cfg, FLAGS.reports, FLAGS.borrow)
  except ValueError as e:  # a bad source: say which, without the flags' help
    raise SystemExit(f"merge_reports: {e}") from None
  if not rows:
    raise app.UsageError(f"no rows of {cfg.name} in {FLAGS.reports + FLAGS.borrow}")
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  command = shlex.join(["python", "-m", "experiments.merge_reports", *sys.argv[1:]])
  report.write_tables(cfg, rows, out, command)
  plots.plot(cfg, rows, out / f"{cfg.name}.png")
  verdict.append_to_report(cfg, rows, out)
  merged = {row["run"] for row in rows}
  missing = [r["name"] for r in cfg.runs if r["name"] not in merged]
  lines = ["", "Sources (each row is that report's row; its command trained it):", ""]
  lines += [f"- {row['run']}: `{s.report}`, run {s.run}, step {s.row['step']}"
            + ("" if s.row["finished"] else " (unfinished)") + f": `{s.command}`"
            for row, s in zip(rows, used)]
  if missing:
    lines += ["", "Not in any report: " + ", ".join(missing)]
  with open(out / "results.md", "a") as f:
    f.write("\n".join(lines) + "\n")
  print((out / "results.md").read_text())


if __name__ == "__main__":
  define_flags()
  flags.mark_flag_as_required("config")
  app.run(main)
