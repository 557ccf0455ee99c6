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
directory receives results.json, results.csv, results.md and <sweep>.png; with
--results=DIR they are copied there too.

Per run, the learning rate with the lowest final eval loss (mean over seeds) is kept;
its metric is reported as mean and spread over seeds. The selection uses the same
held-out stream the metric is measured on, which favours every run alike.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import pathlib
import shutil
import sys
import time
from typing import Any

from absl import app
from absl import flags
from absl import logging
import ml_collections
from ml_collections import config_flags
import numpy as np

from experiments import pool
from sse_jax import train as train_lib
from sse_jax.train import config as config_lib
from sse_jax.train import logs

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Experiment config file, e.g."
                                " configs/fig7.py:cpu.", lock_config=False)
flags.DEFINE_string("workdir", "workdir", "Root of the run directories.")
flags.DEFINE_string("results", "", "Also copy the tables and figure into this directory.")
flags.DEFINE_list("only", [], "Run only these run names (the report covers all finished runs).")
flags.DEFINE_bool("report_only", False, "Only rebuild the report from finished runs.")
flags.DEFINE_integer("workers", 1, "Runs trained at once, each in its own process: a small"
                     " model leaves a GPU mostly idle. On GPU each process may take"
                     " 0.9 / workers of the device memory.")
flags.DEFINE_bool("stack", False, "Train each run's learning rates and seeds together as"
                  " one vmapped program (sse_jax.train.train_stacked), one process per"
                  " run: small models cost about one run's kernel launches for all.")
flags.DEFINE_list("job", [], "(internal) train these runs <run>/lr<lr>_s<seed> (several:"
                  " stacked) and exit.")


@dataclasses.dataclass
class Job:
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


def read_summary(job: Job) -> dict[str, Any] | None:
  path = job.dir / "summary.json"
  return json.loads(path.read_text()) if path.exists() else None


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


def read_partial(job: Job) -> dict[str, Any] | None:
  """A summary-like view of a run that did not finish: its last evaluation, or None."""
  records = logs.read_records(str(job.dir / "metrics.jsonl"))
  evals = [r for r in records if r.get("kind") == "eval"]
  if not evals:
    return None
  return {"step": evals[-1]["step"], "finished": False, "eval": evals[-1],
          "history": logs.history(records)}


def metric(summary: dict[str, Any], name: str) -> float:
  """Summary metric by name: "eval_accuracy" -> summary["eval"]["accuracy"]."""
  split, _, key = name.partition("_")
  return float(summary[split][key])


def router_stats(summaries: list[dict[str, Any]]) -> dict[str, float]:
  """Mean over SSE layers and seeds of the last eval's usage entropy and max usage."""
  routers = [s["eval"].get("router") or [] for s in summaries]
  routers = [r for r in routers if r]
  if not routers:
    return {}
  return dict(usage_entropy=float(np.mean([[x["entropy"] for x in r] for r in routers])),
              usage_max=float(np.mean([[x["max"] for x in r] for r in routers])))


def _mean_of(summaries: list[dict[str, Any]], key: str) -> float | None:
  values = [s[key] for s in summaries if s.get(key) is not None]
  return float(np.mean(values)) if values else None


def collect(cfg, jobs: list[Job]) -> list[dict[str, Any]]:
  """One row per run: the best learning rate and its metric over seeds.

  A run none of whose jobs finished is reported from its last evaluation, marked
  finished=False with the step it reached (an interrupted sweep still shows where
  every run got to); finished jobs always take precedence.
  """
  rows = []
  for run in cfg.runs:
    mine = [job for job in jobs if job.run == run["name"]]
    by_lr: dict[float, list[dict[str, Any]]] = {}
    for job in mine:
      summary = read_summary(job)
      if summary is not None:
        by_lr.setdefault(job.lr, []).append(dict(summary, seed=job.seed))
    finished = bool(by_lr)
    # A finished run is reported from its finished jobs only: count the others.
    missing = len(mine) - sum(map(len, by_lr.values()))
    if not finished:
      for job in mine:
        partial = read_partial(job)
        if partial is not None:
          by_lr.setdefault(job.lr, []).append(dict(partial, seed=job.seed))
    if not by_lr:
      continue
    lr_loss = {lr: float(np.mean([s["eval"]["loss"] for s in ss])) for lr, ss in by_lr.items()}
    best = min(lr_loss, key=lambda lr: (math.isnan(lr_loss[lr]), lr_loss[lr]))
    ss = by_lr[best]
    values = [metric(s, cfg.metric) for s in ss]
    rows.append(dict(
        run=run["name"], labels=dict(run["labels"]), lr=best, lr_eval_loss=lr_loss,
        seeds=len(ss), seeds_used=[s["seed"] for s in ss], metric=float(np.mean(values)),
        values=[float(v) for v in values],
        metric_std=float(np.std(values)) if len(values) > 1 else 0.0,
        eval_loss=float(np.mean([s["eval"]["loss"] for s in ss])),
        finished=finished, step=int(min(s["step"] for s in ss)),
        jobs=len(mine), jobs_missing=missing if finished else 0,
        lr_seeds={lr: [s["seed"] for s in ss_] for lr, ss_ in by_lr.items()},
        params=ss[0].get("params"), tokens_per_s=_mean_of(ss, "tokens_per_s"),
        wall_time_s=float(np.sum([s.get("wall_time_s", 0.0) for s in ss])),
        curves=[s["history"] for s in ss], **router_stats(ss)))
  return rows


def label_text(labels: dict[str, Any]) -> str:
  return ", ".join(f"{k}={v}" for k, v in labels.items())


def write_tables(cfg, rows, out: pathlib.Path, command: str) -> None:
  plain = [{k: v for k, v in r.items() if k != "curves"} for r in rows]
  many = any(r["seeds"] > 1 for r in plain)
  (out / "results.json").write_text(json.dumps(dict(
      name=cfg.name, description=cfg.description, metric=cfg.metric, command=command,
      paper=cfg.paper.to_dict() if hasattr(cfg.paper, "to_dict") else dict(cfg.paper),
      rows=rows), indent=1))
  fields = ["run", "labels", "lr", "seeds", "metric", "metric_std", "per_seed", "eval_loss",
            "step",
            "finished", "params",
            "usage_entropy", "usage_max", "tokens_per_s", "wall_time_s"]
  with open(out / "results.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    for r in plain:
      w.writerow(dict(r, labels=label_text(r["labels"]), per_seed=_per_seed(r, " ")))
  fmt = lambda v, f="{:.4f}": "-" if v is None else f.format(v)
  lines = [f"# {cfg.name}: {cfg.description}", "", f"Command: `{command}`", "",
           f"Metric: `{cfg.metric}` (mean over seeds {list(cfg.seeds)}, at the best"
           f" learning rate of {list(cfg.lrs)} by final eval loss"
           + ("; ± is the standard deviation over seeds (ddof = 0), and every seed's"
              " value is listed as s<seed> value; router statistics and tokens/s are means over"
              " seeds" if many else "") + ").", "",
           "| run | labels | best lr | metric | " + ("per seed | " if many else "")
           + "eval loss | params | router usage entropy | router max usage | tokens/s |",
           "|---|---|---|---|" + ("---|" if many else "") + "---|---|---|---|---|"]
  for r in plain:
    m = fmt(r["metric"]) + (f" ± {r['metric_std']:.4f}" if r["seeds"] > 1 else "")
    if not r["finished"]:
      m += f" (unfinished: step {r['step']} of {cfg.train.num_steps})"
    elif r.get("jobs_missing"):
      m += f" ({r['jobs_missing']} of {r['jobs']} lr/seed jobs not finished)"
    per_seed = (_per_seed(r, " / ") + " | ") if many else ""
    lines.append(f"| {r['run']} | {label_text(r['labels'])} | {r['lr']:g} | {m} | {per_seed}"
                 f"{fmt(r['eval_loss'])} | {fmt(r['params'], '{:,}')} | "
                 f"{fmt(r.get('usage_entropy'), '{:.3f}')} | {fmt(r.get('usage_max'), '{:.3f}')}"
                 f" | {fmt(r['tokens_per_s'], '{:,.0f}')} |")
  if not all(r["finished"] for r in plain):
    lines += ["", "Unfinished runs were stopped before the last step: their value is their"
              " last evaluation (hollow markers / white bars in the figure)."]
  if any(r.get("jobs_missing") for r in plain):
    lines += ["", "Some runs have lr/seed jobs that did not finish: such a run is reported"
              " from its finished jobs only, and its best lr was chosen among learning rates"
              " that may have different numbers of seeds (`lr_seeds` in results.json)."]
  if cfg.paper:
    lines += ["", "Paper: " + ", ".join(f"{k}: {v}" for k, v in dict(cfg.paper).items())]
  (out / "results.md").write_text("\n".join(lines) + "\n")


def _per_seed(row, sep: str) -> str:
  """"s0 0.626 / s2 0.194": each seed that reported, by number (some may be missing)."""
  return sep.join(f"s{seed} {v:.3f}" for seed, v in zip(row["seeds_used"], row["values"]))


def _seed_dots(ax, rows, x_of, color, shift=1.0):
  """Every seed's value of each row with several seeds, as a dot at x_of(row) * shift
  (beside the mean: the spread can be bimodal)."""
  pts = [(x_of(r) * shift, v) for r in rows if r["seeds"] > 1 for v in r["values"]]
  if pts:
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, alpha=0.6, color=color,
               zorder=3)


def _curve(ax, history, name, label, color=None):
  steps = [h["step"] for h in history if name in h]
  ax.plot(steps, [h[name] for h in history if name in h], label=label, linewidth=1,
          color=color)


def plot(cfg, rows, path: pathlib.Path) -> None:
  """The paper-shaped panel, and learning curves of every run beside it."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (ax, ax_curve) = plt.subplots(1, 2, figsize=(12, 4.8))
  ylabel = cfg.metric.replace("_", " ")
  if cfg.figure == "vs_partitions":
    start = [r for r in rows if r["labels"].get("ratio") == "all"]
    for ratio, style in ((0.25, "o-"), (0.5, "s-")):
      pts = sorted([(r["labels"]["N"], r["metric"], r["metric_std"]) for r in rows
                    if r["labels"].get("ratio") == ratio]
                   + [(r["labels"]["N"], r["metric"], r["metric_std"]) for r in start])
      if pts:
        line = ax.errorbar([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts],
                           fmt=style, capsize=3, label=f"k/N = {ratio:.0%}")
        own = (ratio, "all") if ratio == 0.25 else (ratio,)  # the shared start once
        _seed_dots(ax, [r for r in rows if r["labels"].get("ratio") in own],
                   lambda r: r["labels"]["N"], line[0].get_color(),
                   shift=0.94 if ratio == 0.25 else 1.06)
        late = [(r["labels"]["N"], r["metric"]) for r in rows if not r["finished"]
                and r["labels"].get("ratio") in (ratio, "all")]
        if late:  # unfinished runs: hollow markers
          ax.plot([p[0] for p in late], [p[1] for p in late], style[0], markersize=9,
                  markerfacecolor="white", color=line[0].get_color(), zorder=3)
    for r in rows:
      if "baseline" in r["labels"]:
        ax.axhline(r["metric"], linestyle="--", linewidth=1, color="gray")
        # x in axes coordinates: at the left edge whichever N the sweep has.
        ax.text(0.01, r["metric"], f" {r['labels']['baseline']}", va="bottom", fontsize=8,
                transform=ax.get_yaxis_transform())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("number of partitions N")
  elif cfg.figure == "vs_width":
    for gap, style in (("zero", "-"), ("noise", "--")):
      for variant, marker in (("dense", "o"), ("top-k", "s")):
        mine = sorted((r for r in rows if r["labels"].get("gap") == gap
                       and r["labels"].get("variant") == variant),
                      key=lambda r: r["labels"]["width"])
        if mine:
          line = ax.errorbar([r["labels"]["width"] for r in mine], [r["metric"] for r in mine],
                             [r["metric_std"] for r in mine], fmt=style, marker=marker,
                             capsize=3, label=f"{variant}, {gap} gap")
          _seed_dots(ax, mine, lambda r: r["labels"]["width"], line[0].get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("model width")
  else:  # bars
    names = [r["labels"].get("variant", r["run"]) for r in rows]
    ax.bar(range(len(rows)), [r["metric"] for r in rows],
           yerr=[r["metric_std"] for r in rows], capsize=3,
           color=["tab:blue" if r["finished"] else "white" for r in rows],
           edgecolor="tab:blue")
    position = {id(r): i for i, r in enumerate(rows)}
    _seed_dots(ax, rows, lambda r: position[id(r)], "black")
    names = [n if r["finished"] else f"{n}\n(unfinished, step {r['step']})"
             for n, r in zip(names, rows)]
    ax.set_xticks(range(len(rows)), names, rotation=20, ha="right", fontsize=8)
    paper = {k: v for k, v in dict(cfg.paper).items() if isinstance(v, (int, float))}
    if paper:
      ax.set_title("paper (real-retrieval avg.): "
                   + ", ".join(f"{k} {v}" for k, v in paper.items()), fontsize=7)
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  colors = plt.cm.tab20.colors
  for i, r in enumerate(rows):  # every seed's curve, one colour per run
    for j, history in enumerate(r["curves"]):
      _curve(ax_curve, history, cfg.metric, r["run"] if j == 0 else None,
             colors[i % len(colors)])
  ax_curve.set_xlabel("step")
  ax_curve.set_ylabel(f"{ylabel} (learning curves"
                      + (", every seed)" if len(cfg.seeds) > 1 else ")"))
  ax_curve.grid(alpha=0.3)
  ax_curve.legend(fontsize=6, ncol=2)
  fig.suptitle(f"{cfg.name}: {cfg.description}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _job_id(job: Job) -> str:
  return f"{job.run}/{job.dir.name}"


def groups_of(todo: list[Job], stack: bool) -> list[list[Job]]:
  """The jobs trained together: each alone, or with --stack those of one run."""
  if not stack:
    return [[job] for job in todo]
  by_run: dict[str, list[Job]] = {}
  for job in todo:
    by_run.setdefault(job.run, []).append(job)
  return list(by_run.values())


def train_group(group: list[Job]) -> None:
  if len(group) == 1:
    train_lib.train_and_evaluate(group[0].config, str(group[0].dir))
  else:
    train_lib.train_stacked([j.config for j in group], [str(j.dir) for j in group])


def train_serially(groups: list[list[Job]]) -> list[str]:
  """Trains the groups one after another; returns the failed job ids. A run that fails
  (e.g. a non-finite loss at a too-large learning rate) is reported and the sweep goes
  on, as in train_in_parallel."""
  t0, failed = time.time(), []
  for i, group in enumerate(groups, 1):
    what = ", ".join(f"lr={j.lr:g} seed={j.seed}" for j in group)
    print(f"[{i}/{len(groups)}] {group[0].run} {what} ({label_text(group[0].labels)}) -> "
          f"{group[0].dir.parent}  [{time.time() - t0:.0f}s elapsed]", flush=True)
    try:
      train_group(group)
    except Exception as e:  # pylint: disable=broad-exception-caught
      failed += [_job_id(j) for j in group]
      print(f"FAILED {', '.join(map(_job_id, group))}: {type(e).__name__}: "
            f"{str(e)[:500]}", flush=True)
  return failed


_BOOL_FLAGS = ("--report_only",)  # flags that never take a separate value


def _without(argv: list[str], names: tuple[str, ...]) -> list[str]:
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


def train_in_parallel(groups: list[list[Job]], workers: int) -> list[str]:
  """Trains the groups (see `groups_of`) in up to `workers` child processes; returns the
  failed job ids.

  A child re-runs this program with the same flags plus --job; its output goes to
  train.log in the run directory of the group's first job. Killing the parent (Ctrl-C,
  SIGTERM) ends the children too.
  """
  argv = _without(sys.argv[1:], ("--workers", "--only", "--results", "--report_only",
                                 "--job"))
  failed, ended, t0 = [], [], time.time()
  total = sum(map(len, groups))

  def log_path(group: list[Job]) -> pathlib.Path:
    for job in group:
      job.dir.mkdir(parents=True, exist_ok=True)
    return group[0].dir / "train.log"

  def on_start(group: list[Job]) -> None:
    print(f"[{time.time() - t0:5.0f}s] start  {', '.join(map(_job_id, group))} "
          f"({label_text(group[0].labels)})", flush=True)

  def on_exit(group: list[Job], returncode: int, seconds: float) -> None:
    for job in group:
      ended.append(_job_id(job))
      summary = read_summary(job)
      if returncode == 0 and summary is not None:
        ev = summary.get("eval") or {}
        result = ", ".join(f"{k}={ev[k]:.4f}" for k in ("loss", "accuracy") if k in ev)
      else:
        failed.append(_job_id(job))
        tail = (group[0].dir / "train.log").read_text(errors="replace").splitlines()[-5:]
        result = f"FAILED (exit {returncode}): " + " | ".join(tail)
      print(f"[{time.time() - t0:5.0f}s] {len(ended)}/{total} done {_job_id(job)} in "
            f"{seconds:.0f}s: {result}", flush=True)

  pool.run(groups, workers,
           lambda group: [sys.executable, "-m", "experiments.ablation", *argv,
                          "--job=" + ",".join(map(_job_id, group))],
           log_path, on_exit, on_start)
  return failed


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # checkpointing logs every save at INFO
  cfg = FLAGS.config
  if cfg is None:
    raise app.UsageError("--config is required, e.g. --config=configs/fig7.py:cpu")
  if FLAGS.workers < 1:
    raise app.UsageError(f"--workers={FLAGS.workers}: must be >= 1")
  root = pathlib.Path(FLAGS.workdir) / cfg.name
  root.mkdir(parents=True, exist_ok=True)
  jobs = expand(cfg, root)
  if FLAGS.job:
    by_id = {_job_id(j): j for j in jobs}
    unknown = [i for i in FLAGS.job if i not in by_id]
    if unknown:
      raise app.UsageError(f"--job: no such run {unknown} in {cfg.name}; runs: "
                           + ", ".join(by_id))
    train_group([by_id[i] for i in FLAGS.job])
    return
  names = {j.run for j in jobs}
  unknown = [n for n in FLAGS.only if n not in names]
  if unknown:
    raise app.UsageError(f"--only: unknown run names {unknown}; runs: {sorted(names)}")
  check_finished_runs(jobs)
  command = "python -m experiments.ablation " + " ".join(  # what reproduces the runs
      _without(sys.argv[1:], ("--workdir", "--report_only", "--workers")))
  failed, interrupted = [], False
  if not FLAGS.report_only:
    todo = [j for j in jobs if not FLAGS.only or j.run in FLAGS.only]
    pending = [j for j in todo if read_summary(j) is None]
    if len(pending) < len(todo):
      print(f"{len(todo) - len(pending)} of {len(todo)} runs already finished: skipped",
            flush=True)
    groups = groups_of(pending, FLAGS.stack)
    try:
      if FLAGS.workers > 1 and len(groups) > 1:
        failed = train_in_parallel(groups, FLAGS.workers)
      else:
        failed = train_serially(groups)
    except KeyboardInterrupt:
      # Still report what finished (and how far the rest got), then exit as interrupted.
      interrupted = True
      print("interrupted: reporting the runs so far", flush=True)
  rows = collect(cfg, jobs)
  if not rows:
    raise SystemExit(f"no finished runs under {root}")
  write_tables(cfg, rows, root, command)
  plot(cfg, rows, root / f"{cfg.name}.png")
  print((root / "results.md").read_text())
  if FLAGS.results:
    dest = pathlib.Path(FLAGS.results)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("results.json", "results.csv", "results.md", f"{cfg.name}.png"):
      shutil.copy(root / name, dest / name)
    print(f"copied the report to {dest}")
  if interrupted:
    raise SystemExit(130)
  if failed:
    raise SystemExit(f"{len(failed)} runs failed (see the output above, or their "
                     f"train.log with --workers): {failed}")


if __name__ == "__main__":
  app.run(main)
