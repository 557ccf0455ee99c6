"""A sweep's results: one row per run (`collect`) and the tables (`write_tables`).

Per run, the learning rate with the lowest final eval loss (mean over seeds) is kept;
its metric is reported as mean and spread over seeds. The selection uses the same
held-out stream the metric is measured on, which favours every run alike.
"""

from __future__ import annotations

import csv
import json
import math
import pathlib
from typing import TYPE_CHECKING, Any

import numpy as np

from sse_jax.train import logs

if TYPE_CHECKING:
  from experiments.sweep import Job


def read_summary(job: Job) -> dict[str, Any] | None:
  """The job's summary.json (written when its training finished), or None."""
  path = job.dir / "summary.json"
  return json.loads(path.read_text()) if path.exists() else None


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
  """results.json (every row, learning curves included), results.csv and results.md."""
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
