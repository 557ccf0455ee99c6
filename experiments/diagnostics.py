r"""State diagnostics of trained runs (the paper's Fig. 3, 5, 8 and 10, and the router's
write/read agreement), drawn side by side for a run and the runs it is compared with.

    python -m experiments.diagnostics --run=workdir/fig7_gpu/GLA_dk16 \
        --compare=workdir/fig7_gpu/N4_k1 --out=results/diagnostics

A run is one training directory (config.json and checkpoints/, as `sse_jax.train`
writes it), or a sweep's run directory holding one such directory per lr and seed
(<run>/lr<lr>_s<seed>/, `experiments.ablation`): every seed is diagnosed and the figures
show their mean (with several learning rates: --lr, or the one with the lowest final
validation loss in the seeds' summary.json). Each seed's model, as its checkpoint holds
it (the latest, or --step), reads held-out data of the seed's own config: the MQAR test
set of --pairs pairs (default: the largest of the config's eval_pairs), or its
evaluation stream (--pairs=0, and configs without eval_pairs), --batches batches of
--batch_size sequences.

Writes to --out (default <run>/diagnostics): diagnostics.json (every number, per seed and
averaged over seeds; definitions in docs/design.md, "State diagnostics") and one figure
each: similarity.png (state-row cosine similarity heatmaps: GLA state, SSE routed and
shared partitions, each of the last layer that has it, or of --layer), entropy.png
(singular-value energy entropy per layer), small_keys.png (fraction of key entries below
1e-5 per partition type and layer), receptive_field.png (mean and std over heads per
layer) and agreement.png (router write/read agreement per SSE layer against chance;
drawn when some run has an SSE layer and MQAR data).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import pathlib
import re
import shlex
import sys
from typing import Any

SEED_DIR = re.compile(r"^lr(?P<lr>[^_]+)_s(?P<seed>\d+)$")
FIGURES = ("similarity", "entropy", "small_keys", "receptive_field", "agreement")
TYPE_NAMES = {"gla": "GLA state", "routed": "SSE routed", "shared": "SSE shared"}


class UsageError(Exception):
  """A problem with the command line or a run directory: one line, exit status 2."""


def parse(argv):
  # argparse, not absl flags: --out and --run would clash with other experiment
  # modules' absl flags in a process that imports several.
  p = argparse.ArgumentParser(prog="python -m experiments.diagnostics", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--run", required=True, help="a run directory (see above)")
  p.add_argument("--compare", action="append", default=[],
                 help="another run directory to draw beside it (repeatable)")
  p.add_argument("--out", default="", help="output directory [<run>/diagnostics]")
  p.add_argument("--pairs", type=int, default=None,
                 help="MQAR pair count of the test set to read; 0: the evaluation stream "
                      "[the largest eval_pairs of the config, else 0]")
  p.add_argument("--batches", type=int, default=4, help="batches per seed [4]")
  p.add_argument("--batch_size", type=int, default=None,
                 help="sequences per batch [the run's batch_size]")
  p.add_argument("--step", type=int, default=None, help="checkpoint step [latest]")
  p.add_argument("--lr", type=float, default=None,
                 help="learning rate to diagnose when a run directory holds several")
  p.add_argument("--layer", type=int, default=None,
                 help="layer of the similarity heatmaps [each run's last recurrent layer]")
  p.add_argument("--window", type=int, default=128,
                 help="receptive field: query positions at the end of each sequence [128]")
  p.add_argument("--threshold", type=float, default=1e-3,
                 help="receptive field: smallest decay still counted [1e-3]")
  args = p.parse_args(argv)
  if args.batches < 1 or (args.batch_size is not None and args.batch_size < 1):
    raise UsageError("--batches and --batch_size must be positive")
  if args.window < 1 or not 0 < args.threshold < 1:
    raise UsageError("--window must be positive and --threshold in (0, 1)")
  return args


# --- runs ------------------------------------------------------------------------------


def _summary_loss(seed_dir: pathlib.Path) -> float | None:
  path = seed_dir / "summary.json"
  if not path.exists():
    return None
  loss = json.loads(path.read_text()).get("eval", {}).get("loss")
  return None if loss is None or math.isnan(loss) else float(loss)


def seed_dirs(run: pathlib.Path, lr: float | None) -> list[pathlib.Path]:
  """The training directories of `run`: itself, or its lr<lr>_s<seed> subdirectories
  (those of one learning rate)."""
  if not run.is_dir():
    raise UsageError(f"run directory {run} does not exist")
  if (run / "config.json").exists():
    return [run]
  found = sorted(d for d in run.iterdir()
                 if SEED_DIR.match(d.name) and (d / "config.json").exists())
  if not found:
    raise UsageError(f"{run} is not a run directory: no config.json in it or in "
                     "lr<lr>_s<seed>/ subdirectories")
  by_lr: dict[float, list[pathlib.Path]] = {}
  for d in found:
    by_lr.setdefault(float(SEED_DIR.match(d.name)["lr"]), []).append(d)
  if lr is not None:
    if lr not in by_lr:
      raise UsageError(f"{run} has no seeds at --lr={lr:g}; it has lr {sorted(by_lr)}")
    return by_lr[lr]
  if len(by_lr) == 1:
    return next(iter(by_lr.values()))
  losses = {}
  for value, dirs in by_lr.items():
    seen = [_summary_loss(d) for d in dirs]
    if None not in seen:
      losses[value] = sum(seen) / len(seen)
  if not losses:
    raise UsageError(f"{run} holds several learning rates {sorted(by_lr)} and no finished "
                     "summaries to choose one by: pass --lr")
  return by_lr[min(losses, key=losses.get)]


def label_of(run: pathlib.Path) -> str:
  run = run.resolve()
  return run.parent.name if SEED_DIR.match(run.name) else run.name


# --- one seed --------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _traced():
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from sse_jax.diagnostics import trace  # pylint: disable=g-import-not-at-top

  @functools.partial(jax.jit, static_argnums=0)
  def run(graphdef, params, tokens):
    return trace(nnx.merge(graphdef, params), tokens)
  return run


def data_config(config, pairs: int | None) -> dict:
  """The held-out data the diagnostics read (see the module docstring)."""
  from sse_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  evals = config_lib.eval_data_config(config)
  if pairs is None:
    pairs = max(config.eval_pairs) if config.eval_pairs else 0
  if not pairs:
    return evals
  if evals["kind"] != "mqar":
    raise UsageError(f"--pairs={pairs} needs MQAR evaluation data, the run's is "
                     f"{evals['kind']!r}")
  try:
    return config_lib.test_config(evals, pairs)
  except ValueError as e:
    raise UsageError(str(e)) from None


def diagnose_seed(seed_dir: pathlib.Path, args, label: str) -> dict[str, Any]:
  """Every layer's numbers (`sse_jax.diagnostics.LayerStats`) for one training run."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from sse_jax.data import PAD_ID, make_dataset, make_source  # pylint: disable=g-import-not-at-top
  from sse_jax.diagnostics import LayerStats  # pylint: disable=g-import-not-at-top
  from sse_jax.train import build, load_state  # pylint: disable=g-import-not-at-top
  from sse_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.from_json(str(seed_dir / "config.json"))
  data = data_config(config, args.pairs)
  batch_size = args.batch_size or config.batch_size
  state, step = load_state(config, str(seed_dir), args.step)
  program = build(config)
  kinds = {"S": "sse", "G": "gla", "A": "attention"}
  stats = [LayerStats(i, kinds.get(letter, letter), window=args.window,
                      threshold=args.threshold)
           for i, letter in enumerate(program.model_config.pattern)]
  source = make_source(data)
  dataset = make_dataset(source, batch_size=batch_size, seed=0, shuffle=False, num_epochs=1)
  recall = data["kind"] == "mqar"
  name = f"{label} {seed_dir.name}" if SEED_DIR.match(seed_dir.name) else label
  sequences = 0
  with jax.set_mesh(program.mesh):
    for i, local in enumerate(itertools.islice(iter(dataset), args.batches)):
      print(f"[diagnostics] {name}: step {step}, batch {i + 1}/{args.batches}", flush=True)
      batch = program.global_batch(local)
      traces = jax.device_get(_traced()(program.graphdef, state.params, batch["inputs"]))
      mask = np.asarray(local["inputs"]) != PAD_ID
      for s, tr in zip(stats, traces):
        s.add(tr, mask, local if recall else None)
      sequences += len(local["inputs"])
  if not sequences:
    raise UsageError(f"{seed_dir}: the held-out data {data} gave no batch of {batch_size}")
  return {"dir": str(seed_dir), "seed": int(config.seed), "lr": float(config.lr),
          "step": int(step), "data": data, "sequences": sequences,
          "layers": [s.result() for s in stats]}


# --- averaging over seeds ---------------------------------------------------------------


def mean_over(values: list[Any]) -> Any:
  """Leaf-wise mean of same-shaped JSON trees (None left out; equal leaves kept as is)."""
  first = values[0]
  if isinstance(first, dict):
    return {k: mean_over([v[k] for v in values]) for k in first}
  if isinstance(first, list):
    if len({len(v) for v in values}) != 1:
      return first
    return [mean_over(list(items)) for items in zip(*values)]
  if all(v == first for v in values):
    return first
  numbers = [v for v in values if isinstance(v, (int, float)) and v is not None]
  return sum(numbers) / len(numbers) if numbers else None


def diagnose_run(run: pathlib.Path, args, label: str) -> dict[str, Any]:
  """The run's numbers: per seed, and their mean over seeds (the figures'); the heatmap
  matrices are kept in the mean only."""
  seeds = [diagnose_seed(d, args, label) for d in seed_dirs(run, args.lr)]
  layers = mean_over([s["layers"] for s in seeds])
  for seed in seeds:
    for entry in seed["layers"]:
      for numbers in entry["types"].values():
        del numbers["similarity_matrix"]
  return {"label": label, "dir": str(run), "data": seeds[0]["data"], "seeds": seeds,
          "layers": layers}


# --- figures ----------------------------------------------------------------------------


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def heatmap_layer(run: dict[str, Any], kind: str, layer: int | None
                  ) -> dict[str, Any] | None:
  """The layer whose `kind` states the heatmap shows: `layer`, or the last with them."""
  having = [entry for entry in run["layers"] if kind in entry["types"]]
  if layer is not None:
    having = [entry for entry in having if entry["layer"] == layer]
  return having[-1] if having else None


def plot_similarity(runs, path: pathlib.Path, layer: int | None) -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top
  plt = _pyplot()
  types = [t for t in TYPE_NAMES if any(heatmap_layer(r, t, layer) for r in runs)]
  cols = max(len(types), 1)
  fig, axes = plt.subplots(len(runs), cols, figsize=(3.2 * cols + 1, 3.4 * len(runs) + 0.8),
                           squeeze=False, layout="constrained")
  image = None
  for row, run in zip(axes, runs):
    for ax, kind in itertools.zip_longest(row, types):
      entry = heatmap_layer(run, kind, layer) if kind else None
      numbers = entry["types"][kind] if entry else None
      if numbers is None:
        ax.axis("off")
        ax.set_title(f"{run['label']}: no {TYPE_NAMES.get(kind, 'recurrent state')}",
                     fontsize=8)
        continue
      matrix = np.array([[np.nan if x is None else x for x in r]
                         for r in numbers["similarity_matrix"]], float)
      image = ax.imshow(matrix, vmin=-1, vmax=1, cmap="RdBu_r")
      sim = numbers["similarity"]
      ax.set_title(f"{run['label']} L{entry['layer']}: {TYPE_NAMES[kind]}\nmean "
                   f"off-diagonal {sim:.2f}" if sim is not None else TYPE_NAMES[kind],
                   fontsize=8)
      ax.set_xlabel("state row", fontsize=7)
      ax.set_ylabel("state row", fontsize=7)
      # Row indices are integers; matplotlib would put ticks at half rows on small states.
      ticks = range(0, len(matrix), max(1, len(matrix) // 8))
      ax.set_xticks(ticks)
      ax.set_yticks(ticks)
  if image is not None:
    fig.colorbar(image, ax=axes, shrink=0.8, label="cosine similarity")
  fig.suptitle("State-row cosine similarity (mean over sequences, heads and partitions)",
               fontsize=9)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _series(run, metric: str):
  """{(type, layers, values, errors)} of one run for a per-layer figure."""
  out = {}
  for entry in run["layers"]:
    if metric == "agreement":
      if "agreement" in entry and entry["agreement"] is not None:
        out.setdefault("router", []).append(
            (entry["layer"], entry["agreement"], entry["agreement_chance"]))
      continue
    for kind, numbers in entry["types"].items():
      value = numbers[metric]
      if isinstance(value, dict):
        value, extra = value["mean"], value["std"]
      else:
        extra = None
      if value is not None:
        out.setdefault(kind, []).append((entry["layer"], value, extra))
  return out


PER_LAYER = {
    "entropy": ("Normalised singular-value energy entropy of the states",
                "entropy (0: rank one, 1: flat spectrum)"),
    "small_keys": ("Fraction of key entries below 1e-5", "fraction of key entries"),
    "receptive_field": ("Receptive field (mean and std over heads, last {window} tokens, "
                        "decay >= {threshold:g})", "tokens"),
    "agreement": ("Router write/read agreement on MQAR answers (dotted: chance)",
                  "fraction of answers"),
}


def plot_per_layer(runs, metric: str, path: pathlib.Path, args) -> bool:
  """One marker line per run and partition type over the layers; False if nothing to
  draw."""
  series = [(run["label"], _series(run, metric)) for run in runs]
  if not any(s for _, s in series):
    return False
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6.4, 4.0))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  markers = {"gla": "o", "routed": "s", "shared": "^", "router": "D"}
  for i, (label, by_type) in enumerate(series):
    shift = 0.06 * (i - (len(series) - 1) / 2)  # runs side by side at each layer
    for kind, points in by_type.items():
      layers = [p[0] + shift for p in points]
      values = [p[1] for p in points]
      color = colors[i % len(colors)]
      name = f"{label}: {TYPE_NAMES.get(kind, 'router')}"
      if metric == "receptive_field":
        ax.errorbar(layers, values, yerr=[p[2] for p in points], marker=markers[kind],
                    color=color, capsize=3, label=name)
      else:
        ax.plot(layers, values, marker=markers[kind], color=color, label=name)
      if metric == "agreement":
        ax.plot(layers, [p[2] for p in points], ":", color=color)
  title, ylabel = PER_LAYER[metric]
  ax.set_title(title.format(window=args.window, threshold=args.threshold), fontsize=9)
  ax.set_xlabel("layer")
  ax.set_ylabel(ylabel)
  ax.xaxis.get_major_locator().set_params(integer=True)
  if metric != "receptive_field":
    ax.set_ylim(-0.02, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


# --- main -------------------------------------------------------------------------------


def labels_for(runs: list[pathlib.Path]) -> list[str]:
  labels = []
  for run in runs:
    label = label_of(run)
    base, n = label, 2
    while label in labels:
      label, n = f"{base} ({n})", n + 1
    labels.append(label)
  return labels


def diagnose(args, argv) -> pathlib.Path:
  runs = [pathlib.Path(args.run)] + [pathlib.Path(c) for c in args.compare]
  for run in runs:
    seed_dirs(run, args.lr)  # every directory checked before any model loads
  out = pathlib.Path(args.out) if args.out else runs[0] / "diagnostics"
  results = [diagnose_run(run, args, label) for run, label in zip(runs, labels_for(runs))]
  out.mkdir(parents=True, exist_ok=True)
  settings = {"window": args.window, "threshold": args.threshold, "small_key": 1e-5,
              "batches": args.batches, "pairs": args.pairs, "step": args.step,
              "command": shlex.join(["python", "-m", "experiments.diagnostics", *argv])}
  (out / "diagnostics.json").write_text(json.dumps(
      {"settings": settings, "runs": results}, indent=1, allow_nan=False) + "\n")
  plot_similarity(results, out / "similarity.png", args.layer)
  drawn = ["similarity.png"]
  for metric in FIGURES[1:]:
    if plot_per_layer(results, metric, out / f"{metric}.png", args):
      drawn.append(f"{metric}.png")
  print(f"[diagnostics] wrote {out / 'diagnostics.json'} and {', '.join(drawn)}",
        flush=True)
  return out


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    args = parse(argv)
    diagnose(args, argv)
  except UsageError as e:
    print(f"diagnostics: {e}", file=sys.stderr)
    return 2
  except Exception as e:  # pylint: disable=broad-except
    from sse_jax.train import CheckpointError  # pylint: disable=g-import-not-at-top
    if not isinstance(e, CheckpointError):
      raise
    print(f"diagnostics: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
