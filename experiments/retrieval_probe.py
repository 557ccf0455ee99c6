r"""Needle retrieval accuracy of a trained byte-level run, by context length.

    python -m experiments.retrieval_probe --workdir=workdir/lm_run \
        --lengths=256,512,1024,2048 --out=results/retrieval_probe

Reads the run's config.json and latest checkpoint (`sse_jax.train.probe`), prints a
table and, with --out, writes retrieval.json, retrieval.md and retrieval.png (exact
match and answer-digit accuracy against context length).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys



def parse(argv):
  # argparse, not absl flags: its flag names (--workdir, --out, ...) would clash with
  # the other experiment modules' absl flags in a process that imports several.
  p = argparse.ArgumentParser(prog="python -m experiments.retrieval_probe",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", required=True,
                 help="a training run's directory (config.json, checkpoints/)")
  p.add_argument("--lengths", default="256,512,1024", help="context lengths T to probe")
  p.add_argument("--num_examples", type=int, default=64, help="examples per length")
  p.add_argument("--batch_size", type=int, default=8, help="global batch of the probe")
  p.add_argument("--num_digits", type=int, default=7, help="digits of the hidden value")
  p.add_argument("--seed", type=int, default=0, help="seed of the probe examples")
  p.add_argument("--out", default="", help="write retrieval.json / .md / .png here")
  return p.parse_args(argv)


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


def main(argv=None) -> None:
  args = parse(sys.argv[1:] if argv is None else argv)
  saved = os.path.join(args.workdir, "config.json")
  if not os.path.exists(saved):
    raise SystemExit(f"--workdir={args.workdir}: no config.json (not a run directory)")
  from sse_jax.train import probe  # pylint: disable=g-import-not-at-top
  from sse_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  rows = probe.retrieval_by_length(
      config_lib.from_json(saved), args.workdir, [int(t) for t in args.lengths.split(",")],
      num_examples=args.num_examples, batch_size=args.batch_size,
      num_digits=args.num_digits, seed=args.seed)
  lines = [f"Retrieval probe of `{args.workdir}` (step {rows[0]['step']}), "
           f"{args.num_examples} examples per length, {args.num_digits}-digit values",
           "", "| context length | needle retrieved (exact) | answer digits correct | "
           "answer loss (nats / byte) |", "|---|---|---|---|"]
  lines += [f"| {r['seq_len']} | {r['exact_match']:.3f} | {r['digit_accuracy']:.3f} | "
            f"{r['answer_ce']:.3f} |" for r in rows]
  print("\n".join(lines))
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "retrieval.json").write_text(json.dumps(dict(workdir=args.workdir, rows=rows),
                                                   indent=1))
    (out / "retrieval.md").write_text("\n".join(lines) + "\n")
    plot(rows, out / "retrieval.png", f"retrieval probe, step {rows[0]['step']}")


if __name__ == "__main__":
  main()
