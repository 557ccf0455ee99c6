r"""Overlays the learning curves of several training runs (repeats, seeds, variants).

    python -m experiments.compare_runs --out=results/gpu_repeat \
        --runs="N16_k4 (1st)=workdir_a/fig7_gpu/N16_k4/lr0.003_s0,N16_k4 (2nd)=..."

Each run directory is one `sse_jax.train` workdir (its metrics.jsonl is read, finished
or not). Writes <out>/compare.json (the curves), <out>/compare.md (each run's last
evaluation: step and the --metrics; with --reach=eval_accuracy:0.5 also the first step at
which that metric reached 0.5) and <out>/compare.png, one panel per metric, with the runs
--draw names (all by default).
"""

from __future__ import annotations

import json
import pathlib

from absl import app
from absl import flags

from sse_jax.train import logs

FLAGS = flags.FLAGS
flags.DEFINE_list("runs", [], "label=run_dir pairs.")
flags.DEFINE_list("metrics", ["eval_accuracy", "eval_loss"], "History metrics to draw.")
flags.DEFINE_string("out", None, "Output directory.")
flags.DEFINE_string("title", "", "Figure and table title.")
flags.DEFINE_list("draw", [], "Labels of the runs to draw (default: all).")
flags.DEFINE_list("reach", [], "metric:threshold pairs: the table adds, per run, the first "
                  "evaluated step with metric >= threshold ('not by <last step>' if none), e.g. "
                  "eval_accuracy:0.5 for when a run left the MQAR plateau.")


def read_curves(run_dir: pathlib.Path) -> list[dict]:
  records = logs.read_records(str(run_dir / "metrics.jsonl"))
  if not records:
    raise app.UsageError(f"{run_dir}: no metrics.jsonl records")
  return [{k: v for k, v in h.items() if k != "router"} for h in logs.history(records)]


def parse_reach(items: list[str]) -> list[tuple[str, float]]:
  """--reach items "metric:threshold" -> [(metric, threshold)]."""
  out = []
  for item in items:
    name, _, value = item.rpartition(":")
    try:
      threshold = float(value)
    except ValueError:
      threshold = None
    if not name or threshold is None:
      raise app.UsageError(f"--reach item {item!r}: expected metric:threshold")
    out.append((name, threshold))
  return out


def first_reached(curve: list[dict], metric: str, threshold: float) -> int | None:
  """The first step of the curve with metric >= threshold, None if never."""
  return next((h["step"] for h in curve
               if h.get(metric) is not None and h[metric] >= threshold), None)


def last_evaluations(runs: dict[str, list[dict]], metrics: list[str], title: str,
                     reach: list[tuple[str, float]] = ()) -> str:
  """Markdown table: per run, the step and the metrics of its last evaluation, and the
  first step at which each (metric, threshold) of `reach` was reached."""
  heads = [m.replace("_", " ") for m in metrics]
  heads += [f"first step with {m.replace('_', ' ')} >= {t:g}" for m, t in reach]
  lines = [f"# {title}\n" if title else "",
           "| run | step | " + " | ".join(heads) + " |",
           "|---|---|" + "---|" * len(heads)]
  for label, curve in runs.items():
    last = [h for h in curve if any(h.get(m) is not None for m in metrics)][-1:]
    h = last[0] if last else {}  # a run with no evaluation yet: "-" cells
    step = h.get("step", "-")
    # "not by <step>" rather than "never": the run may have been stopped early.
    firsts = [first_reached(curve, m, t) for m, t in reach]
    firsts = [f"not by {step}" if f is None else str(f) for f in firsts]
    cells = [f"{h[m]:.4f}" if h.get(m) is not None else "-" for m in metrics] + firsts
    lines.append(f"| {label} | {step} | " + " | ".join(cells) + " |")
  return "\n".join(lines).lstrip("\n") + "\n"


def main(argv):
  del argv
  if not FLAGS.runs or not FLAGS.out:
    raise app.UsageError("--runs and --out are required")
  reach = parse_reach(FLAGS.reach)
  runs = {}
  for item in FLAGS.runs:
    label, sep, path = item.partition("=")
    if not sep:
      raise app.UsageError(f"--runs item {item!r}: expected label=run_dir")
    runs[label] = read_curves(pathlib.Path(path))
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  unknown = [label for label in FLAGS.draw if label not in runs]
  if unknown:
    raise app.UsageError(f"--draw: no runs labelled {unknown}; labels: {list(runs)}")
  (out / "compare.json").write_text(json.dumps(dict(title=FLAGS.title, runs=runs), indent=1))
  (out / "compare.md").write_text(last_evaluations(runs, FLAGS.metrics, FLAGS.title, reach))
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(FLAGS.metrics), figsize=(6 * len(FLAGS.metrics), 4.2))
  axes = axes if len(FLAGS.metrics) > 1 else [axes]
  drawn = {label: runs[label] for label in FLAGS.draw} if FLAGS.draw else runs
  for ax, name in zip(axes, FLAGS.metrics):
    for label, curve in drawn.items():
      pts = [(h["step"], h[name]) for h in curve if h.get(name) is not None]
      ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", markersize=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(name.replace("_", " "))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(FLAGS.title, fontsize=10)
  fig.tight_layout()
  fig.savefig(out / "compare.png", dpi=120)
  plt.close(fig)
  print(f"wrote {out}/compare.json and compare.png")


if __name__ == "__main__":
  app.run(main)
