r"""Overlays the learning curves of several training runs (repeats, seeds, variants).

    python -m experiments.compare_runs --out=results/gpu_repeat \
        --runs="N16_k4 (1st)=workdir_a/fig7_gpu/N16_k4/lr0.003_s0,N16_k4 (2nd)=..."

Each run directory is one `sse_jax.train` workdir (its metrics.jsonl is read, finished
or not). Writes <out>/compare.json (the curves) and <out>/compare.png, one panel per
metric.
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
flags.DEFINE_string("title", "", "Figure title.")


def read_curves(run_dir: pathlib.Path) -> list[dict]:
  records = logs.read_records(str(run_dir / "metrics.jsonl"))
  if not records:
    raise app.UsageError(f"{run_dir}: no metrics.jsonl records")
  return [{k: v for k, v in h.items() if k != "router"} for h in logs.history(records)]


def main(argv):
  del argv
  if not FLAGS.runs or not FLAGS.out:
    raise app.UsageError("--runs and --out are required")
  runs = {}
  for item in FLAGS.runs:
    label, sep, path = item.partition("=")
    if not sep:
      raise app.UsageError(f"--runs item {item!r}: expected label=run_dir")
    runs[label] = read_curves(pathlib.Path(path))
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "compare.json").write_text(json.dumps(dict(title=FLAGS.title, runs=runs), indent=1))
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(FLAGS.metrics), figsize=(6 * len(FLAGS.metrics), 4.2))
  axes = axes if len(FLAGS.metrics) > 1 else [axes]
  for ax, name in zip(axes, FLAGS.metrics):
    for label, curve in runs.items():
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
