r"""Needle retrieval accuracy of a trained byte-level run, by context length.

    python -m experiments.retrieval_probe --workdir=workdir/lm_run \
        --lengths=256,512,1024,2048 --out=results/retrieval_probe

Reads the run's config.json and latest checkpoint (`sse_jax.train.probe`), prints a
table and, with --out, writes retrieval.json, retrieval.md and retrieval.png (exact
match and answer-digit accuracy against context length).
"""

from __future__ import annotations

import json
import os
import pathlib

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "A training run's directory (config.json, "
                    "checkpoints/).")
flags.DEFINE_list("lengths", ["256", "512", "1024"], "Context lengths T to probe.")
flags.DEFINE_integer("num_examples", 64, "Examples per length.")
flags.DEFINE_integer("batch_size", 8, "Global batch of the probe.")
flags.DEFINE_integer("num_digits", 7, "Digits of the hidden value.")
flags.DEFINE_integer("seed", 0, "Seed of the probe examples.")
flags.DEFINE_string("out", "", "Write retrieval.json / .md / .png here.")


def plot(rows, path: pathlib.Path, title: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  lengths = [r["seq_len"] for r in rows]
  ax.plot(lengths, [r["exact_match"] for r in rows], "o-", label="needle retrieved (exact)")
  ax.plot(lengths, [r["digit_accuracy"] for r in rows], "s--", label="answer digits correct")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("context length (bytes)")
  ax.set_ylabel("accuracy")
  ax.set_ylim(-0.02, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  if not FLAGS.workdir:
    raise app.UsageError("--workdir is required (a training run's directory)")
  saved = os.path.join(FLAGS.workdir, "config.json")
  if not os.path.exists(saved):
    raise app.UsageError(f"--workdir={FLAGS.workdir}: no config.json (not a run directory)")
  from sse_jax.train import probe  # pylint: disable=g-import-not-at-top
  from sse_jax.train.__main__ import load_config  # pylint: disable=g-import-not-at-top
  rows = probe.retrieval_by_length(
      load_config(saved), FLAGS.workdir, [int(t) for t in FLAGS.lengths],
      num_examples=FLAGS.num_examples, batch_size=FLAGS.batch_size,
      num_digits=FLAGS.num_digits, seed=FLAGS.seed)
  lines = [f"Retrieval probe of `{FLAGS.workdir}` (step {rows[0]['step']}), "
           f"{FLAGS.num_examples} examples per length, {FLAGS.num_digits}-digit values",
           "", "| context length | needle retrieved (exact) | answer digits correct | "
           "answer loss (nats / byte) |", "|---|---|---|---|"]
  lines += [f"| {r['seq_len']} | {r['exact_match']:.3f} | {r['digit_accuracy']:.3f} | "
            f"{r['answer_ce']:.3f} |" for r in rows]
  print("\n".join(lines))
  if FLAGS.out:
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "retrieval.json").write_text(json.dumps(dict(workdir=FLAGS.workdir, rows=rows),
                                                   indent=1))
    (out / "retrieval.md").write_text("\n".join(lines) + "\n")
    plot(rows, out / "retrieval.png", f"retrieval probe, step {rows[0]['step']}")


if __name__ == "__main__":
  app.run(main)
