r"""Where one training step's device time goes: per source file and pass.

    python -m experiments.profile_step                    # GPU: 125M SSE and GLA, T = 2K, 32K
    python -m experiments.profile_step --size=tiny --lengths=64 --tokens=256 --reps=2

For each (variant, T) it builds the trainer's own step exactly as
`experiments.throughput` times it (forward, backward, clipping, AdamW; bf16 compute,
fp32 parameters, `impl="auto"`), runs it once to compile and warm up, then records a
profiler trace of `--reps` steps and sums the device time of every compiled HLO op
(`traces.device_ms_by_op`). Each op is attributed through the metadata JAX attached to
it (`traces.hlo_sources`): the Python file that emitted it (`sse_jax/layers/router.py`,
`pallas_kernels/chunk_gla.py`, `optax/...`) and the pass: forward, backward (a
transposed op) or optimizer. Ops XLA created without a source (copies, layout changes,
collectives) are listed as "(no source)". A fusion counts for the file of its root
instruction, so a matmul fused into an elementwise epilogue goes to the epilogue's
file: read the per-op list in the JSON for such cases.

Writes <out>/profile_step.json (per point: step ms by wall clock, traced device ms, and
every op with its ms, file, line and pass), profile_step.md (ms per part of the step --
the op's kernels, the packing around them, projections, router, low-rank maps, norms,
short conv, MLP, loss, optimizer: `PARTS` -- then per file, and per pass, per point,
largest first) and profile_step.png (one stacked bar of parts per point);
`--from_json` writes the last two again from a saved JSON. XLA's command buffers are
turned off (they would fold a step's kernels into one traced op with no source), so
the wall-clock step time can be a little longer than in training.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import shlex
import statistics
import sys
import time

from absl import app
from absl import flags
import jax
import numpy as np

from experiments import throughput
from experiments import traces

FLAGS = flags.FLAGS
PHASES = ("forward", "backward", "optimizer")
NO_SOURCE = "(no source)"


def define_flags() -> None:
  """This tool's flags (defined when it runs, beside `experiments.throughput`'s names)."""
  throughput.define_point_flags(["sse", "gla"], ["2048", "32768"], 32768,
                                "results/profile_step")
  flags.DEFINE_integer("reps", 5, "Traced steps (device time is their mean).")
  flags.DEFINE_integer("steps", 5, "Wall-clock timed steps before tracing (median).")
  flags.DEFINE_integer("top", 25, "Files listed per point in the markdown table.")
  flags.DEFINE_string("hlo_dir", "", "Also write each point's optimised HLO here "
                      "(<variant>_<T>.hlo.txt), to look up what a fusion computes.")
  flags.DEFINE_string("from_json", "", "Only write profile_step.md / .png into --out from "
                      "this saved profile_step.json (e.g. of a run stopped by a time limit).")


def breakdown(times: dict[str, float], sources: dict[str, traces.Source]) -> list[dict]:
  """Per-op rows {op, ms, file, line, phase} of a trace: `times` {HLO op: ms} joined with
  the compiled module's `sources`; an op without metadata gets file NO_SOURCE."""
  rows = []
  for op, ms in times.items():
    src = sources.get(op)
    rows.append(dict(op=op, ms=ms, file=(src.file if src and src.file else NO_SOURCE),
                     line=src.line if src else 0,
                     phase=src.phase if src else "unknown"))
  return rows


# The parts of a step the time is reported in, by the file that emitted each op (first
# matching prefix wins; a fusion counts for the file of its root instruction).
PARTS = (
    ("pallas_kernels/", "op: Pallas kernels"),
    ("sse_jax/ops/", "op: packing, casts and checks around the kernels"),
    ("sse_jax/layers/router.py", "router, top-k and load balance"),
    ("sse_jax/layers/lowrank.py", "LoRA and decay gates (low-rank maps)"),
    ("sse_jax/layers/delta.py", "LoRA and decay gates (low-rank maps)"),
    ("sse_jax/layers/features.py", "feature maps (key softmax, L2 norm)"),
    ("sse_jax/layers/short_conv.py", "short conv"),
    ("sse_jax/layers/norm.py", "norms"),
    ("sse_jax/layers/mlp.py", "MLP"),
    ("sse_jax/layers/params.py", "projections (einsums)"),
    ("sse_jax/layers/linear.py", "projections (einsums)"),
    ("sse_jax/layers/", "rest of the layers"),
    ("sse_jax/data/", "input batch"),
    ("sse_jax/model/", "embedding, logits and residual stream"),
    ("sse_jax/train/metrics.py", "loss"),
    ("sse_jax/train/", "optimizer and clipping"),
    ("optax/", "optimizer and clipping"),
)


def part_of(file: str) -> str:
  """The step part (`PARTS`) an op emitted from `file` belongs to; ops with no source
  (copies, layout changes XLA added) and files no prefix names keep their own name."""
  return next((part for prefix, part in PARTS if prefix in file), file)


def by_part(ops: list[dict]) -> list[tuple[str, dict[str, float]]]:
  """`by_file` with files grouped into `PARTS`."""
  return by_file([dict(r, file=part_of(r["file"])) for r in ops])


def by_file(ops: list[dict]) -> list[tuple[str, dict[str, float]]]:
  """[(file, {phase: ms, "total": ms})] from per-op rows, largest total first."""
  table = collections.defaultdict(lambda: collections.Counter())
  for r in ops:
    table[r["file"]][r["phase"]] += r["ms"]
    table[r["file"]]["total"] += r["ms"]
  return sorted(((f, dict(c)) for f, c in table.items()), key=lambda fc: -fc[1]["total"])


def profile(variant: str, length: int) -> dict:
  """One point: the state's creation and the step's compilation (seconds: each is paid
  once per run), the wall-clock step time, then the traced device time by op and file."""
  program, batch, local = throughput.build_point(variant, length)
  with jax.set_mesh(program.mesh):
    t0 = time.perf_counter()
    holder = [jax.block_until_ready(program.init())]  # compiles the initialiser too
    init_s = time.perf_counter() - t0
    print(f"  state created in {init_s:.1f} s (compiling included)", flush=True)
    data = program.global_batch(local)
    t0 = time.perf_counter()
    step = program.train_step.lower(holder[0], data).compile()
    compile_s = time.perf_counter() - t0
    module = step.as_text()
    if FLAGS.hlo_dir:
      hlo = pathlib.Path(FLAGS.hlo_dir)
      hlo.mkdir(parents=True, exist_ok=True)
      (hlo / f"{variant}_{length}.hlo.txt").write_text(module)
    print(f"  step compiled in {compile_s:.1f} s", flush=True)

    def run():  # the compiled step itself (jit would compile it again); the state is
      holder[0], metrics = step(holder[0], data)  # donated: thread it through
      jax.block_until_ready(metrics)

    run()  # warm-up
    wall = []
    for _ in range(FLAGS.steps):
      t0 = time.perf_counter()
      run()
      wall.append(time.perf_counter() - t0)
    times = traces.device_ms_by_op(run, FLAGS.reps)
  ops = breakdown(times, traces.hlo_sources(module))
  return dict(variant=variant, length=length, batch=batch, step_ms=statistics.median(wall) * 1e3,
              device_ms=sum(times.values()), init_s=init_s, compile_s=compile_s, ops=ops)


def _table(name: str, rows: list[tuple[str, dict[str, float]]], total: float,
           top: int | None = None) -> list[str]:
  """Markdown lines: one row per (name, {phase: ms, "total": ms}), the first `top`
  (None: all) and the rest summed in one row."""
  lines = [f"| {name} | forward ms | backward ms | optimizer ms | total ms | share |",
           "|---|---|---|---|---|---|"]
  shown, hidden = (rows, []) if top is None else (rows[:top], rows[top:])
  for f, c in shown:
    cells = " | ".join(f"{c.get(ph, 0.0):.2f}" for ph in PHASES)
    lines.append(f"| {f} | {cells} | {c['total']:.2f} | {c['total'] / total:.1%} |")
  rest = sum(c["total"] for _, c in hidden)
  if rest:
    lines.append(f"| {len(hidden)} more {name}s | | | | {rest:.2f} | {rest / total:.1%} |")
  return lines


def markdown(meta: dict, points: list[dict], top: int) -> str:
  lines = [f"Command: `{meta['command']}` on {meta['device']} (jax {meta['jax']})", ""]
  for p in points:
    if "error" in p:
      lines += [f"## {p['variant']}, T = {p['length']}: {p['error']}", ""]
      continue
    total = p["device_ms"]
    lines += [f"## {p['variant']}, T = {p['length']}, batch {p['batch']}: step "
              f"{p['step_ms']:.1f} ms wall clock, {total:.1f} ms traced device time", "",
              f"Once per run: the state created in {p['init_s']:.1f} s and the step "
              f"compiled in {p['compile_s']:.1f} s (compiling included in both).", ""]
    lines += _table("part", by_part(p["ops"]), total)
    lines += ["", "By file:", ""] + _table("file", by_file(p["ops"]), total, top)
    phases = collections.Counter()
    for r in p["ops"]:
      phases[r["phase"]] += r["ms"]
    lines += ["", "By pass: " + ", ".join(f"{ph} {ms:.1f} ms ({ms / total:.0%})"
                                          for ph, ms in phases.most_common()), ""]
  return "\n".join(lines) + "\n"


def plot(points: list[dict], path: pathlib.Path, top: int = 8) -> None:
  """One stacked bar per point: the `top` largest parts overall, the rest as "other"."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  points = [p for p in points if "error" not in p]
  tables = [by_part(p["ops"]) for p in points]
  overall = collections.Counter()
  for table in tables:
    for f, c in table:
      overall[f] += c["total"]
  names = [f for f, _ in overall.most_common(top)]
  fig, ax = plt.subplots(figsize=(2 + 1.4 * len(points), 4.5))
  bottom = np.zeros(len(points))
  for name in names + ["other"]:
    ms = np.array([sum(c["total"] for f, c in table
                       if (f == name) or (name == "other" and f not in names))
                   for table in tables])
    ax.bar(range(len(points)), ms, bottom=bottom, label=name)
    bottom += ms
  short = lambda t: f"{t // 1024}K" if t % 1024 == 0 else str(t)
  ax.set_xticks(range(len(points)), [f"{p['variant']}\nT={short(p['length'])}" for p in points])
  ax.set_ylabel("device ms per training step")
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def write_report(meta: dict, points: list[dict], out: pathlib.Path) -> None:
  """profile_step.md (printed too) and, if any point succeeded, profile_step.png."""
  text = markdown(meta, points, FLAGS.top)
  (out / "profile_step.md").write_text(text)
  print(text)
  if any("error" not in p for p in points):
    plot(points, out / "profile_step.png")


def main(argv):
  del argv
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    # Read when the backend starts (below, at jax.devices()): one traced op per kernel.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_enable_command_buffer=").strip()
  if FLAGS.from_json:
    saved = json.loads(pathlib.Path(FLAGS.from_json).read_text())
    write_report(saved["meta"], saved["points"], out)
    return
  meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, size=FLAGS.size,
              tokens_per_step=FLAGS.tokens, impl=FLAGS.impl, reps=FLAGS.reps,
              command=shlex.join(["python", "-m", "experiments.profile_step", *sys.argv[1:]]))
  points = []
  for length in (int(t) for t in FLAGS.lengths):
    for variant in FLAGS.variants:
      print(f"profiling {variant} at T = {length}", flush=True)
      try:
        point = profile(variant, length)
      except Exception as e:  # e.g. out of memory: record it and go on
        point = dict(variant=variant, length=length, error=f"{type(e).__name__}: {e}"[:300])
      points.append(point)
      if "error" not in point:
        print(f"  step {point['step_ms']:.1f} ms, traced {point['device_ms']:.1f} ms",
              flush=True)
      (out / "profile_step.json").write_text(json.dumps(dict(meta=meta, points=points),
                                                        indent=1))
  write_report(meta, points, out)
  if any("error" in p for p in points):
    raise SystemExit(f"{sum('error' in p for p in points)} points failed (see above)")


if __name__ == "__main__":
  define_flags()
  app.run(main)
