"""A sweep's jobs: the experiment config expanded into one training per run x lr x seed.

    jobs = expand(cfg, root)          # Job(run, labels, lr, seed, dir, config) each
    check_finished_runs(jobs)         # refuse a finished run trained with other settings
    groups = groups_of(pending, stack=True)   # the jobs trained together

Every job trains into <root>/<run>/lr<lr>_s<seed>/; `config` is the run's train config
(the experiment's `train` with the run's dotted-key overrides, lr and seed applied).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from absl import app
import ml_collections

from experiments import report
from sse_jax.train import config as config_lib


@dataclasses.dataclass
class Job:
  """One training of the sweep: run name and labels, its lr and seed, where it trains
  and the train config it trains with."""
  run: str
  labels: dict[str, Any]
  lr: float
  seed: int
  dir: pathlib.Path
  config: ml_collections.ConfigDict


def set_path(cfg: ml_collections.ConfigDict, path: str, value: Any) -> None:
  """cfg["a.b.c"] = value, creating nothing: every parent must exist."""
  *parents, leaf = path.split(".")
  node = cfg
  for p in parents:
    if p not in node:
      raise KeyError(f"override {path!r}: no field {p!r} in the train config")
    node = node[p]
  if isinstance(value, dict):
    value = ml_collections.ConfigDict(value)
  if isinstance(node, ml_collections.ConfigDict):
    with node.ignore_type():
      node[leaf] = value
  else:  # a plain dict inside the config (e.g. model kwargs)
    node[leaf] = value


def expand(cfg: ml_collections.ConfigDict, root: pathlib.Path) -> list[Job]:
  """Every run x lr x seed of the experiment config, runs in config order."""
  jobs = []
  for run in cfg.runs:
    for lr in cfg.lrs:
      for seed in cfg.seeds:
        c = ml_collections.ConfigDict(cfg.train.to_dict())
        for path, value in run["overrides"].items():
          set_path(c, path, value)
        c.lr, c.seed = float(lr), int(seed)
        jobs.append(Job(run["name"], dict(run["labels"]), float(lr), int(seed),
                        root / run["name"] / f"lr{lr:g}_s{seed}", c))
  return jobs


def job_id(job: Job) -> str:
  """"<run>/lr<lr>_s<seed>": how --job and the progress lines name a job."""
  return f"{job.run}/{job.dir.name}"


def groups_of(todo: list[Job], stack: bool) -> list[list[Job]]:
  """The jobs trained together: each alone, or with --stack those of one run."""
  if not stack:
    return [[job] for job in todo]
  by_run: dict[str, list[Job]] = {}
  for job in todo:
    by_run.setdefault(job.run, []).append(job)
  return list(by_run.values())


def check_finished_runs(jobs: list[Job]) -> None:
  """A finished run is skipped and reported as it is: refuse one trained for another
  number of steps than the config asks (e.g. a 2000-step workdir reused at 4000), or,
  where its config.json is there, with any other field a resume would refuse (model,
  data, batch size, ...; `sse_jax.train.config.fingerprint`)."""
  stale = []
  for job in jobs:
    summary = report.read_summary(job)
    if summary is None:
      continue
    if summary.get("step") != job.config.num_steps:
      stale.append((job, f"finished after {summary.get('step')} steps, but the config "
                         f"asks for {job.config.num_steps}"))
      continue
    saved = job.dir / "config.json"
    if saved.exists():
      differences = config_lib.diff(
          config_lib.fingerprint(ml_collections.ConfigDict(json.loads(saved.read_text()))),
          config_lib.fingerprint(job.config))
      if differences:
        stale.append((job, "was trained with another config: "
                           + "; ".join(differences[:5])))
  if stale:
    job, why = stale[0]
    raise app.UsageError(f"{job.dir} {why} ({len(stale)} such runs): use another "
                         "--workdir")
