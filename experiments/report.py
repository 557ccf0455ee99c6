"""A sweep's results: one row per run (`collect`) and the tables (`write_tables`).

Per run, the learning rate with the lowest final eval loss (mean over seeds) is kept;
its metric is reported as mean and spread over seeds. The selection uses the same
held-out stream the metric is measured on (the validation stream), which favours every
run alike. Runs trained with `eval_pairs` also report accuracy on held-out TEST sets, one
per MQAR pair count P (`by_pairs` in the eval record), at the lr chosen that way.

A row (results.json) holds, besides the metric: accuracy_by_pairs {"<P>": [per seed]},
state_floats_active / state_floats_total (floats of recurrent state per layer,
`state_floats`), labels.family ("sse" | "gla" | "transformer" | "hybrid" unless the
config names one) and, for SSE models, agreement (per SSE layer, mean over seeds).
"""

from __future__ import annotations

import csv
import json
import math
import pathlib
from typing import Any

import numpy as np

from experiments.sweep import Job
from experiments.sweep import read_summary
from sse_jax.train import config as config_lib
from sse_jax.train import logs


def read_partial(job: Job) -> dict[str, Any] | None:
  """A summary-like view of a run that did not finish: its last evaluation, or None."""
  records = logs.read_records(str(job.dir / "metrics.jsonl"))
  evals = [r for r in records if r.get("kind") == "eval"]
  if not evals:
    return None
  return {"step": evals[-1]["step"], "finished": False, "eval": evals[-1],
          "history": logs.history(records)}


MAX_PAIRS_ACCURACY = "max_pairs_accuracy"


def largest_pairs(by_pairs: dict[str, Any] | None) -> str | None:
  """The key of the largest pair count P in a `by_pairs` dict ({"<P>": ...}), or None."""
  return max(by_pairs, key=int) if by_pairs else None


def rows_largest_pairs(rows: list[dict[str, Any]]) -> str | None:
  """The largest pair count P (as its key) in any row's accuracy_by_pairs, or None."""
  return largest_pairs({p: None for r in rows for p in r.get("accuracy_by_pairs") or {}})


def metric(summary: dict[str, Any], name: str) -> float:
  """Summary metric by name: "eval_accuracy" -> summary["eval"]["accuracy"];
  "max_pairs_accuracy" -> the accuracy on the test set of the largest evaluated P."""
  if name == MAX_PAIRS_ACCURACY:
    by_pairs = summary["eval"].get("by_pairs")
    if not by_pairs:
      raise ValueError(f"metric {name!r}: the run's eval has no by_pairs (its train"
                       " config needs eval_pairs)")
    return float(by_pairs[largest_pairs(by_pairs)]["accuracy"])
  split, _, key = name.partition("_")
  return float(summary[split][key])


def curve_value(entry: dict[str, Any], name: str) -> float | None:
  """Metric `name` of one learning-curve (history) entry, None where it has none; the
  history keys are the eval record's prefixed "eval_" (by_pairs: "eval_by_pairs")."""
  if name == MAX_PAIRS_ACCURACY:
    by_pairs = entry.get("eval_by_pairs")
    return float(by_pairs[largest_pairs(by_pairs)]["accuracy"]) if by_pairs else None
  return entry.get(name)


def accuracy_by_pairs(summaries: list[dict[str, Any]]) -> dict[str, list[float | None]]:
  """{"<P>": [accuracy of each seed]} of the last eval's by_pairs, P ascending; None for
  a seed without that P; {} when no seed has by_pairs."""
  evals = [s["eval"].get("by_pairs") or {} for s in summaries]
  keys = sorted({p for e in evals for p in e}, key=int)
  return {p: [float(e[p]["accuracy"]) if p in e else None for e in evals] for p in keys}


def router_stats(summaries: list[dict[str, Any]]) -> dict[str, Any]:
  """Mean over SSE layers and seeds of the last eval's usage entropy and max usage, and
  `agreement`: per SSE layer, the mean over seeds of its answer route agreement (None
  for a layer no seed measured; left out when none did)."""
  routers = [s["eval"].get("router") or [] for s in summaries]
  routers = [r for r in routers if r]
  if not routers:
    return {}
  out = dict(usage_entropy=float(np.mean([[x["entropy"] for x in r] for r in routers])),
             usage_max=float(np.mean([[x["max"] for x in r] for r in routers])))
  agreement = []
  for i in range(max(map(len, routers))):
    values = [r[i]["agreement"] for r in routers
              if i < len(r) and r[i].get("agreement") is not None]
    agreement.append(float(np.mean(values)) if values else None)
  if any(a is not None for a in agreement):
    out["agreement"] = agreement
  return out


FAMILIES = {"S": "sse", "G": "gla", "A": "transformer", "W": "swa", "M": "mom",
            "D": "gdn"}


def family_of(pattern: str) -> str:
  """"sse" / "gla" / "transformer" / "swa" / "mom" / "gdn" for a pattern of one mixer
  letter, else "hybrid" (SSE on the delta rule is "sse" here: configs label it)."""
  letters = set(pattern)
  return FAMILIES[pattern[0]] if len(letters) == 1 else "hybrid"


def layer_state(letter: str, mixer, seq_len: int | None) -> tuple[int, int] | None:
  """(active, total) floats of one layer's recurrent state for one sequence.

  GLA and GDN: one H x Dk x Dv state. SSE (either transition): N routed partitions
  (+ the shared one) of that size, of which a token writes k (`writers`: top_k unless
  num_writers is set) and the shared one; with per-partition Q/K/V the states are the
  same. MoM: likewise N routed memories (+ the shared one), k of them written and read
  per token. Attention: the KV cache at the data's sequence length T (the window if
  shorter), 2 T Hkv Dh (keys and values), all of it active; None when T is unknown.
  Sliding-window attention: its ring cache of W positions, 2 min(T, W) Hkv Dh (W when T
  is unknown: the cache does not grow past it).
  """
  match letter:
    case "A" | "W":
      if seq_len is None and mixer.window is None:
        return None
      t = mixer.window if seq_len is None else min(seq_len, mixer.window or seq_len)
      cache = 2 * t * mixer.kv_heads * mixer.head
      return cache, cache
    case "G" | "D":
      head = mixer.num_heads * mixer.head_k * mixer.head_v
      return head, head
    case "S":
      head = mixer.num_heads * mixer.head_k * mixer.head_v
      shared = int(mixer.shared_partition)
      return head * (mixer.writers + shared), head * (mixer.num_partitions + shared)
    case "M":
      head = mixer.num_heads * mixer.head_k * mixer.head_v
      shared = int(mixer.shared_memory)
      return head * (mixer.top_k + shared), head * (mixer.num_memories + shared)
    case _:
      raise ValueError(f"layer_state: unknown mixer letter {letter!r}")


def state_floats(model, seq_len: int | None) -> dict[str, int | None]:
  """state_floats_active / state_floats_total of a model (a resolved `ModelConfig`,
  `sse_jax.train.config.model_config`) on sequences of seq_len tokens: the largest over
  its layers (see `layer_state`); None when a layer's size is unknown."""
  sizes = [layer_state(x, model.mixer_config(x), seq_len) for x in sorted(set(model.pattern))]
  known = None not in sizes
  return dict(state_floats_active=max(a for a, _ in sizes) if known else None,
              state_floats_total=max(t for _, t in sizes) if known else None)


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
    config = mine[0].config  # every lr and seed of a run trains one model
    model = config_lib.model_config(config)
    labels = dict(run["labels"])
    labels.setdefault("family", family_of(model.pattern))
    rows.append(dict(
        run=run["name"], labels=labels, lr=best, lr_eval_loss=lr_loss,
        seeds=len(ss), seeds_used=[s["seed"] for s in ss], metric=float(np.mean(values)),
        values=[float(v) for v in values],
        metric_std=float(np.std(values)) if len(values) > 1 else 0.0,
        eval_loss=float(np.mean([s["eval"]["loss"] for s in ss])),
        finished=finished, step=int(min(s["step"] for s in ss)),
        jobs=len(mine), jobs_missing=missing if finished else 0,
        lr_seeds={lr: [s["seed"] for s in ss_] for lr, ss_ in by_lr.items()},
        params=ss[0].get("params"), tokens_per_s=_mean_of(ss, "tokens_per_s"),
        wall_time_s=float(np.sum([s.get("wall_time_s", 0.0) for s in ss])),
        accuracy_by_pairs=accuracy_by_pairs(ss), **state_floats(model, config.data.get("seq_len")),
        curves=[s["history"] for s in ss], **router_stats(ss)))
  return rows


def label_text(labels: dict[str, Any]) -> str:
  return ", ".join(f"{k}={v}" for k, v in labels.items())


def mean_std(values: list[float | None]) -> tuple[float, float, int] | None:
  """Mean, standard deviation (ddof = 0) and count of the values that are not None."""
  known = [v for v in values if v is not None]
  return (float(np.mean(known)), float(np.std(known)), len(known)) if known else None


def _pairs_text(row, sep: str) -> str:
  """"P4 0.950 / P8 0.800": mean accuracy over seeds at each evaluated pair count."""
  means = {p: mean_std(v) for p, v in (row.get("accuracy_by_pairs") or {}).items()}
  return sep.join(f"P{p} {m[0]:.3f}" for p, m in means.items() if m)


def _agreement_text(row, sep: str) -> str:
  """"0.912 / 0.534": the router agreement of each SSE layer ("-" where unmeasured)."""
  return sep.join("-" if a is None else f"{a:.3f}" for a in row.get("agreement") or [])


def _state_text(row) -> str:
  active, total = row.get("state_floats_active"), row.get("state_floats_total")
  if active is None:
    return "-"
  return f"{active:,}" if active == total else f"{active:,} / {total:,}"


def write_tables(cfg, rows, out: pathlib.Path, command: str) -> None:
  """results.json (every row, learning curves included), results.csv and results.md."""
  plain = [{k: v for k, v in r.items() if k != "curves"} for r in rows]
  (out / "results.json").write_text(json.dumps(dict(
      name=cfg.name, description=cfg.description, metric=cfg.metric, command=command,
      paper=cfg.paper.to_dict() if hasattr(cfg.paper, "to_dict") else dict(cfg.paper),
      rows=rows), indent=1))
  fields = ["run", "labels", "lr", "seeds", "metric", "metric_std", "per_seed", "eval_loss",
            "step", "finished", "params", "state_floats_active", "state_floats_total",
            "accuracy_by_pairs", "agreement",
            "usage_entropy", "usage_max", "tokens_per_s", "wall_time_s"]
  with open(out / "results.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    for r in plain:
      w.writerow(dict(r, labels=label_text(r["labels"]), per_seed=_per_seed(r, " "),
                      accuracy_by_pairs=_pairs_text(r, " "), agreement=_agreement_text(r, " ")))
  lines = _main_table(cfg, plain, command) + _pairs_table(plain)
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


def _fmt(v, f="{:.4f}") -> str:
  return "-" if v is None else f.format(v)


def _main_table(cfg, rows, command: str) -> list[str]:
  """results.md's title, metric note and one line per run."""
  many = any(r["seeds"] > 1 for r in rows)
  agree = any(r.get("agreement") for r in rows)
  lines = [f"# {cfg.name}: {cfg.description}", "", f"Command: `{command}`", "",
           f"Metric: `{cfg.metric}` (mean over seeds {list(cfg.seeds)}, at the best"
           f" learning rate of {list(cfg.lrs)} by final eval loss"
           + ("; ± is the standard deviation over seeds (ddof = 0), and every seed's"
              " value is listed as s<seed> value; router statistics and tokens/s are means over"
              " seeds" if many else "") + ").", "",
           "State floats: recurrent state per layer of one sequence (SSE: the partitions"
           " a token writes plus the shared one / all partitions; attention: its KV cache"
           " at the data's sequence length).", "",
           "| run | labels | best lr | metric | " + ("per seed | " if many else "")
           + "eval loss | params | state floats (active / total) | "
           + ("router agreement per layer | " if agree else "")
           + "router usage entropy | router max usage | tokens/s |",
           "|---|---|---|---|" + ("---|" if many else "") + "---|---|---|"
           + ("---|" if agree else "") + "---|---|---|"]
  for r in rows:
    m = _fmt(r["metric"]) + (f" ± {r['metric_std']:.4f}" if r["seeds"] > 1 else "")
    if not r["finished"]:
      m += f" (unfinished: step {r['step']} of {cfg.train.num_steps})"
    elif r.get("jobs_missing"):
      m += f" ({r['jobs_missing']} of {r['jobs']} lr/seed jobs not finished)"
    per_seed = (_per_seed(r, " / ") + " | ") if many else ""
    agreement = f"{_agreement_text(r, ' / ') or '-'} | " if agree else ""
    lines.append(f"| {r['run']} | {label_text(r['labels'])} | {r['lr']:g} | {m} | {per_seed}"
                 f"{_fmt(r['eval_loss'])} | {_fmt(r['params'], '{:,}')} | {_state_text(r)} | "
                 f"{agreement}{_fmt(r.get('usage_entropy'), '{:.3f}')} | "
                 f"{_fmt(r.get('usage_max'), '{:.3f}')} | {_fmt(r['tokens_per_s'], '{:,.0f}')} |")
  return lines


def _pairs_table(rows) -> list[str]:
  """results.md's accuracy by pair count, one column per evaluated P (none without)."""
  keys = sorted({p for r in rows for p in r.get("accuracy_by_pairs") or {}}, key=int)
  if not keys:
    return []
  lines = ["", "## Accuracy by pair count", "",
           "On held-out test sets, one per pair count P (`eval_pairs`), at each run's"
           " learning rate (chosen by the validation loss, not by these); mean ± std over"
           " seeds, with the number of seeds where some did not report.", "",
           "| run | " + " | ".join(f"P={p}" for p in keys) + " |",
           "|---|" + "---|" * len(keys)]
  for r in rows:
    by_pairs = r.get("accuracy_by_pairs") or {}
    cells = []
    for p in keys:
      values = by_pairs.get(p, [])
      m = mean_std(values)
      cell = "-" if m is None else f"{m[0]:.4f}" + (f" ± {m[1]:.4f}" if m[2] > 1 else "")
      if m is not None and m[2] < len(values):
        cell += f" ({m[2]} of {len(values)} seeds)"
      cells.append(cell)
    lines.append(f"| {r['run']} | " + " | ".join(cells) + " |")
  return lines


def _per_seed(row, sep: str) -> str:
  """"s0 0.626 / s2 0.194": each seed that reported, by number (some may be missing)."""
  return sep.join(f"s{seed} {v:.3f}" for seed, v in zip(row["seeds_used"], row["values"]))
