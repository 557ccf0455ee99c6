r"""End-to-end training throughput and peak memory of equal-size models.

    python -m experiments.throughput                               # GPU: 125M, T = 2K/8K/32K
    python -m experiments.throughput --size=tiny --lengths=64 --tokens=512 --steps=2

The paper reports only op timings (Fig. 6). This times the trainer's own step
(`sse_jax.train.build(config).train_step`: forward, backward, global-norm clipping,
AdamW on the warm-up + cosine schedule, bf16 compute with fp32 parameters, donated
state, sharded over every device on the "data" axis) for pure SSE, SSE-H, GLA,
Transformer, GDN and SSE-GDN models of about the same size, at a fixed number of
tokens per step (batch = tokens / T, rounded up to a multiple of the devices), each
with its fastest implementation (`impl="auto"`: Pallas kernels on GPU; attention
through cuDNN when available). The batches are random tokens. Reports tokens/s
(median step time after warm-up) and the first device's peak memory. Writes
<out>/throughput.json, .md and .png. `--from_json=A.json,B.json` writes them again from
earlier runs' JSON, their rows merged in order (runs split across device sessions).

Each point runs in a child process of its own (the device's peak-memory statistic
never decreases within a process). With --workers=W, W of them build and compile the
(variant, T) points at once
(compilation is host work), but each holds an exclusive file lock while it is timed, so
no two timings share the device. Each child may use 0.9 / W of the device memory, which
then bounds the peak memory a point can reach (a point that does not fit is reported
as an error).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shlex
import statistics
import sys
import time

from absl import app
from absl import flags
import jax
import numpy as np

from experiments import pool
from sse_jax import train
from sse_jax.model import ModelConfig, count_params, presets
from sse_jax.model.config import MIXERS

FLAGS = flags.FLAGS


def define_point_flags(variants: list[str], lengths: list[str], tokens: int,
                       out: str) -> None:
  """The flags that choose the measured points (size, variants, lengths, tokens, impl)
  and the output directory, with these defaults; shared with experiments.profile_step."""
  flags.DEFINE_string("size", "125m", "Model size preset (sse_jax.model.presets.SIZES).")
  flags.DEFINE_list("variants", variants, "Model variants (presets.VARIANTS).")
  flags.DEFINE_list("lengths", lengths, "Sequence lengths T.")
  flags.DEFINE_integer("tokens", tokens, "Tokens per training step (batch = tokens // T).")
  flags.DEFINE_string("impl", "auto", "ops implementation of the SSE / GLA / GDN layers.")
  flags.DEFINE_string("out", out, "Output directory.")


def define_flags() -> None:
  """This tool's flags, defined only when it runs: as module-level flags they would clash
  with other experiments' (--out, --workers) in a process that imports several."""
  define_point_flags(["sse", "sse_h", "gla", "transformer", "gdn", "sse_gdn"],
                     ["2048", "8192", "32768"], 65536, "results/throughput")
  flags.DEFINE_integer("steps", 10, "Timed steps (median reported).")
  flags.DEFINE_integer("warmup", 2, "Untimed steps after compilation.")
  flags.DEFINE_integer("workers", 1, "Points compiled at once in child processes.")
  flags.DEFINE_string("lock", "", "(internal) hold this file locked while timing.")
  flags.DEFINE_list("from_json", [], "Only write throughput.json / .md / .png into --out "
                    "from these runs' throughput.json files (rows merged in order).")


def create_kwargs(model: ModelConfig) -> dict:
  """`ModelConfig.create` keyword arguments that rebuild `model` (the trainer's
  config.model takes these); checked by rebuilding it."""
  mixers = {field: getattr(model, field) for field, _ in MIXERS.values()}
  heads = next(m.num_heads for m in mixers.values() if m is not None)
  fields = lambda m: {k: v for k, v in dataclasses.asdict(m).items()
                      if k not in ("hidden", "num_heads")}
  kwargs = dict(pattern=model.pattern, vocab_size=model.vocab_size, hidden=model.hidden,
                num_heads=heads, mlp_dim=model.mlp.intermediate,
                **{f: None if m is None else fields(m) for f, m in mixers.items()},
                tie_embeddings=model.tie_embeddings, aux_loss_coef=model.aux_loss_coef,
                remat=model.remat, norm_eps=model.norm_eps)
  if ModelConfig.create(**kwargs) != model:
    raise ValueError(f"the model of pattern {model.pattern!r} does not rebuild from its "
                     "fields: create_kwargs misses one")
  return kwargs


def train_config(variant: str, batch: int):
  """The trainer's default config (optimizer, schedule, clipping, dtypes) with the
  preset model of `variant` and `batch` sequences per step."""
  impl = {"impl": FLAGS.impl}
  config = train.default_config()
  config.model = create_kwargs(presets.preset(FLAGS.size, variant, sse=dict(impl),
                                              gla=dict(impl), gdn=dict(impl)))
  config.batch_size = batch
  return config


def build_point(variant: str, length: int):
  """(program, batch, local batch) of one point: the trainer's program for `variant` at
  FLAGS.tokens per step (batch rounded up to a multiple of the devices) and a batch of
  random tokens of length `length`."""
  devices = jax.device_count()
  batch = -(-max(1, FLAGS.tokens // length) // devices) * devices
  program = train.build(train_config(variant, batch))
  rng = np.random.default_rng(1)
  tokens = rng.integers(1, program.model_config.vocab_size, (batch, length + 1), np.int32)
  local = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:],
               weights=np.ones((batch, length), np.float32))
  return program, batch, local


def measure(variant: str, length: int) -> dict:
  program, batch, local = build_point(variant, length)
  devices = jax.device_count()
  with jax.set_mesh(program.mesh):
    state = program.init()
    data = program.global_batch(local)
    t0 = time.perf_counter()
    state, metrics = program.train_step(state, data)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    times = []
    with pool.exclusive(FLAGS.lock):  # warm-up too: the first runs autotune on the device
      for _ in range(FLAGS.warmup):
        state, metrics = program.train_step(state, data)
      jax.block_until_ready(metrics)
      for _ in range(FLAGS.steps):
        t0 = time.perf_counter()
        state, metrics = program.train_step(state, data)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
  stats = jax.devices()[0].memory_stats() or {}
  sec = statistics.median(times)
  return dict(variant=variant, length=length, batch=batch, devices=devices, step_s=sec,
              tokens_per_s=batch * length / sec, compile_s=compile_s,
              peak_gib=stats.get("peak_bytes_in_use", float("nan")) / 2**30,
              params=count_params(program.model_config).total,
              loss=float(metrics["loss"]))


def measure_in_children(points, out: pathlib.Path) -> list[dict]:
  """Measures each point in its own child process, FLAGS.workers at a time."""
  lock = str(out / ".timing.lock")
  rows = {}

  def folder(point) -> pathlib.Path:
    return out / "points" / f"{point[0]}_{point[1]}"

  def command(point) -> list[str]:
    variant, length = point
    return [sys.executable, "-m", "experiments.throughput", f"--size={FLAGS.size}",
            f"--variants={variant}", f"--lengths={length}", f"--tokens={FLAGS.tokens}",
            f"--steps={FLAGS.steps}", f"--warmup={FLAGS.warmup}", f"--impl={FLAGS.impl}",
            f"--out={folder(point)}", f"--lock={lock}", "--workers=1"]

  def log_path(point) -> pathlib.Path:
    folder(point).mkdir(parents=True, exist_ok=True)
    return folder(point) / "log.txt"

  def on_exit(point, returncode: int, seconds: float) -> None:
    del seconds
    sub = folder(point)
    try:
      row = json.loads((sub / "throughput.json").read_text())["rows"][0]
    except (OSError, ValueError, KeyError, IndexError):
      tail = (sub / "log.txt").read_text(errors="replace").splitlines()[-3:]
      row = dict(variant=point[0], length=point[1],
                 error=f"child exit {returncode}: " + " | ".join(tail)[:300])
    rows[point] = row
    print(json.dumps(row), flush=True)

  pool.run(points, FLAGS.workers, command, log_path, on_exit)
  return [rows[p] for p in points]


def main(argv):
  del argv
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  if FLAGS.from_json:
    meta, rows = merge_runs([pathlib.Path(f) for f in FLAGS.from_json])
    write_report(out, meta, rows, figure=True)
    return
  meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, size=FLAGS.size,
              tokens_per_step=FLAGS.tokens, impl=FLAGS.impl,
              command=shlex.join(["python", "-m", "experiments.throughput", *sys.argv[1:]]))
  points = [(v, int(t)) for t in FLAGS.lengths for v in FLAGS.variants]
  # Several points run in child processes even one at a time: the device's peak-memory
  # statistic only grows within a process, so each point needs its own to report its
  # own peak.
  if FLAGS.workers > 1 or (len(points) > 1 and not FLAGS.lock):
    meta["workers"] = FLAGS.workers
    rows = measure_in_children(points, out)
  else:
    rows = []
    for variant, length in points:
      try:
        row = measure(variant, length)
      except Exception as e:  # e.g. out of memory: record it and go on
        row = dict(variant=variant, length=length, error=f"{type(e).__name__}: {e}"[:300])
      rows.append(row)
      print(json.dumps(row), flush=True)
  write_report(out, meta, rows, figure=not FLAGS.lock)  # a child: the parent draws it


def merge_runs(paths: list[pathlib.Path]) -> tuple[dict, list[dict]]:
  """(meta, rows) of several runs' throughput.json: the rows in order, and the first
  run's meta with every run's command. Runs on different devices or model settings
  are refused: their rows do not compare."""
  runs = [json.loads(p.read_text()) for p in paths]
  first = runs[0]["meta"]
  for path, run in zip(paths, runs):
    for key in ("device", "size", "tokens_per_step", "impl"):
      if run["meta"].get(key) != first.get(key):
        raise ValueError(f"{path}: {key}={run['meta'].get(key)!r} differs from "
                         f"{paths[0]}'s {first.get(key)!r}; only runs of one setting merge")
  commands = [run["meta"]["command"] for run in runs]
  meta = dict(first, command=" && ".join(commands))
  return meta, [row for run in runs for row in run["rows"]]


def write_report(out: pathlib.Path, meta: dict, rows: list[dict], figure: bool) -> None:
  """<out>/throughput.json and .md of `rows`, and with `figure` the .png."""
  (out / "throughput.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  lines = [f"Command: `{meta['command']}` on {meta['device']}", "",
           "| model | T | batch | tokens/s | step ms | peak GiB | compile s |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['variant']} | {r['length']} | - | {r['error']} | | | |")
    else:
      lines.append(f"| {r['variant']} | {r['length']} | {r['batch']} | {r['tokens_per_s']:,.0f}"
                   f" | {r['step_s'] * 1e3:.1f} | {r['peak_gib']:.1f} | {r['compile_s']:.0f} |")
  (out / "throughput.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  if not figure:
    return
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
  for variant in dict.fromkeys(r["variant"] for r in rows):
    pts = sorted((r for r in rows if r["variant"] == variant and "error" not in r),
                 key=lambda r: r["length"])
    a1.plot([r["length"] for r in pts], [r["tokens_per_s"] for r in pts], "o-", label=variant)
    a2.plot([r["length"] for r in pts], [r["peak_gib"] for r in pts], "o-", label=variant)
  for a, y in ((a1, "training tokens / s"), (a2, "peak device memory (GiB)")):
    a.set_xscale("log", base=2)
    a.set_xlabel("sequence length T")
    a.set_ylabel(y)
    a.grid(alpha=0.3)
    a.legend()
  fig.suptitle(f"{meta['size']} models, {meta['tokens_per_step']} tokens/step, "
               f"{meta['device']}")
  fig.tight_layout()
  fig.savefig(out / "throughput.png", dpi=120)


if __name__ == "__main__":
  define_flags()
  app.run(main)
