"""A sweep's jobs: the experiment config expanded into one training per run x lr x seed.

    jobs = expand(cfg, root)          # Job(run, labels, lr, seed, dir, config) each
    jobs = expand(cfg, root, defaults)   # the same, checking cfg.train's changes first
    check_finished_runs(jobs)         # refuse a finished run trained with other settings
    groups = groups_of(pending, stack=True)   # the jobs trained together

Every job trains into <root>/<run>/lr<lr>_s<seed>/; `config` is the run's train config
(the experiment's `train` with the run's dotted-key overrides, lr and seed applied).

Given the config as its file builds it (`defaults`), `expand` first checks the train
fields changed from it, e.g. on the command line (`check_train_changes`): one that a
run's overrides set again is refused, since it would be dropped silently for that run,
and a change to `data` also reaches `eval_data` when the file derives one from the other.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from absl import app
import ml_collections

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


def read_summary(job: Job) -> dict[str, Any] | None:
  """The job's summary.json (written when its training finished), or None."""
  path = job.dir / "summary.json"
  return json.loads(path.read_text()) if path.exists() else None


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


def expand(cfg: ml_collections.ConfigDict, root: pathlib.Path,
           defaults: ml_collections.ConfigDict | None = None,
           given: list[str] | None = None) -> list[Job]:
  """Every run x lr x seed of the experiment config, runs in config order.

  With `defaults` (the experiment config as its file builds it), the train fields
  changed from it are checked, and cfg.train completed, first (`check_train_changes`).
  """
  if defaults is not None:
    check_train_changes(cfg, defaults, given)
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


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
  """{dotted path: value} of every leaf under a config (dicts are descended into)."""
  node = config_lib.to_dict(node) if hasattr(node, "to_dict") else node
  if not isinstance(node, dict) or not node:
    return {prefix: node}
  out = {}
  for key, value in node.items():
    out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
  return out


def _overlap(a: str, b: str) -> bool:
  """Whether setting path a and setting path b touch the same field."""
  return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _names(runs: list[str]) -> str:
  return ", ".join(runs[:4]) + (f" and {len(runs) - 4} more" if len(runs) > 4 else "")


def check_train_changes(cfg: ml_collections.ConfigDict, defaults: ml_collections.ConfigDict,
                        given: list[str] | None = None) -> None:
  """Checks the train fields set on top of the config file (`given`: their dotted paths
  under `train`, as the command line names them; None: every leaf of cfg.train that
  differs from defaults.train) and completes cfg.train in place:

  - a field that a run sets again in its own overrides, or under a parent it sets
    (fig7's SSE runs set model.sse.top_k, its GLA runs all of `model`), is refused: the
    change would be dropped silently for those runs; so are lr and seed, which every
    job takes from the sweep's lrs and seeds;
  - a `data` field also goes to `eval_data` (the validation stream the learning rates
    are chosen on, from which the test sets of eval_pairs are made) when the file's
    eval_data is its data on another split (every field but `split` equal, as
    `configs.common.train` builds it), unless eval_data's field is given too: training
    on one stream and choosing and scoring on another must not happen by accident. Where
    the file's eval_data is a stream of its own, such a data change is refused.
    (eval_data None: the trainer derives it from data anyway.)

  Raises app.UsageError with a one-line message naming the --config.train flag.
  """
  if given is None:
    now, before = _leaves(cfg.train), _leaves(defaults.train)
    given = sorted(p for p in set(now) | set(before) if now.get(p, ...) != before.get(p, ...))
  for path in given:
    for field, flag in (("lr", "lrs"), ("seed", "seeds")):
      if _overlap(path, field):
        raise app.UsageError(f"--config.train.{path}: every job's {field} comes from the "
                             f"sweep's {flag}: set --config.{flag} instead, e.g. "
                             f"--config.{flag}=\"{tuple(cfg[flag])[:1]}\"")
    by_override: dict[str, list[str]] = {}
    for run in cfg.runs:
      for key in run["overrides"]:
        if _overlap(path, key):
          by_override.setdefault(key, []).append(run["name"])
    if by_override:
      runs = {r for names in by_override.values() for r in names}
      where = "; ".join(f"{key} in {_names(names)}" for key, names in by_override.items())
      raise app.UsageError(
          f"--config.train.{path}: {len(runs)} of {len(cfg.runs)} runs set it again in "
          f"their own overrides ({where}), so the flag would be ignored there: change it "
          "in the config file instead")
  if cfg.train.eval_data is None:
    return
  data, file_eval = _leaves(cfg.train.data), defaults.train.eval_data
  derived = file_eval is not None and (
      {k: v for k, v in _leaves(file_eval).items() if k != "split"}
      == {k: v for k, v in _leaves(defaults.train.data).items() if k != "split"})
  for path in given:
    for field in sorted(f for f in data if f != "split" and _overlap(path, "data." + f)):
      if any(_overlap("eval_data." + field, p) for p in given):
        continue  # the evaluation stream's own value, given on purpose
      if not derived:
        raise app.UsageError(
            f"--config.train.{path}: this config's eval_data is not its data on another "
            f"split, so the validation stream would keep eval_data.{field}="
            f"{_leaves(cfg.train.eval_data).get(field)!r}: give "
            f"--config.train.eval_data.{field} too")
      set_path(cfg.train, "eval_data." + field, data[field])


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
    summary = read_summary(job)
    if summary is None:
      continue
    if summary.get("step") != job.config.num_steps:
      stale.append((job, f"finished after {summary.get('step')} steps, but the config "
                         f"asks for {job.config.num_steps}"))
      continue
    saved = job.dir / "config.json"
    if saved.exists():
      differences = config_lib.diff(config_lib.fingerprint(config_lib.from_json(str(saved))),
                                    config_lib.fingerprint(job.config))
      if differences:
        stale.append((job, "was trained with another config: "
                           + "; ".join(differences[:5])))
  if stale:
    job, why = stale[0]
    raise app.UsageError(f"{job.dir} {why} ({len(stale)} such runs): use another "
                         "--workdir")
