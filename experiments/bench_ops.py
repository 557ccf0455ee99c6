r"""Times the GLA / SSE and GDN / SSE-GDN op implementations at the paper's Fig. 6 setting.

    python -m experiments.bench_ops                       # full grid (GPU)
    python -m experiments.bench_ops --lengths=2048 --partitions=4 --reps=5   # quick

Setting (the paper's Fig. 6): bf16, 8 heads, head dim 128, K = 1, B = 1 with
cu_seqlens = [0, L/2, L]; SSE timings include the always-on shared partition (fused in
the same chunked call, as the authors' op does). Times are medians over `--reps` runs
under `jit`, after warm-up, each ended by `block_until_ready`; "fwd+bwd" is the gradient
of sum(o * cotangent) w.r.t. q, k, v, g (and beta for the delta rule, the router weights
for SSE). The delta-rule rows (gdn, sse_gdn) take the same q, v and router, keys
L2-normalised (as the GDN layer gives them), one log decay per head (the GLA gate's first
feature, logsigmoid / 16) and beta = sigmoid(N(0, 1)).

With `--check_length`, relative errors of o and every gradient against the float32
`lax.scan` reference are measured at that length (bf16 inputs upcast for the
reference). When `fla` (flash-linear-attention) is importable, `experiments.bench_fla`
runs in a separate process and its rows join the table.

Writes `<out>/bench_ops.json`, `<out>/bench_ops.md` and `<out>/bench_ops.png`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import shlex
import subprocess
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from experiments import op_setting
from experiments.op_setting import make_inputs, parse_variant, rel_err, time_fn  # pylint: disable=unused-import
from pallas_kernels import chunk_gdn as gdn_kernels
from pallas_kernels import chunk_gla as kernels
from sse_jax import ops
from sse_jax.ops import impl as impl_lib

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["2048", "8192", "32768"], "Sequence lengths L.")
flags.DEFINE_list("partitions", ["4", "8", "16"], "Numbers of partitions N.")
flags.DEFINE_list("gla_impls", ["chunk", "pallas_chunk"], "Dense GLA impls.")
flags.DEFINE_list("sse_impls", ["loop", "masking", "varlen", "pallas_masking",
                                "pallas_varlen"], "SSE impls.")
flags.DEFINE_list("gdn_impls", ["chunk", "pallas_chunk"], "Dense GDN impls.")
flags.DEFINE_list("sse_gdn_impls", ["masking", "varlen", "pallas_masking", "pallas_varlen"],
                  "SSE-GDN impls.")
flags.DEFINE_integer("loop_max_length", 8192, "Skip the slow 'loop' impl above this L.")
flags.DEFINE_integer("heads", 8, "Heads H.")
flags.DEFINE_integer("dim", 128, "Head dim Dk = Dv.")
flags.DEFINE_integer("top_k", 1, "K.")
flags.DEFINE_integer("reps", 20, "Timed repetitions (median reported).")
flags.DEFINE_integer("warmup", 3, "Untimed runs after compilation.")
flags.DEFINE_integer("check_length", 0, "Measure errors vs the fp32 scan at this L (0: off).")
flags.DEFINE_list("check_partitions", ["4"], "N values at which errors are measured.")
flags.DEFINE_bool("time_fwd", True, "Also time the forward pass alone (one more compile).")
flags.DEFINE_bool("fla", True, "Also run experiments.bench_fla when fla is importable.")
flags.DEFINE_integer("fla_timeout", 0, "Stop the fla run after this many seconds (0: no "
                     "limit; its first call autotunes for minutes); rows measured by then "
                     "are kept.")
flags.DEFINE_bool("memory", False, "Also record compiled temporary memory (recompiles).")
flags.DEFINE_string("from_json", "", "Only redraw table and plot from saved bench_ops.json"
                    " (merging <out>/bench_fla.json when present).")
flags.DEFINE_string("out", "results/bench_ops", "Output directory.")
flags.DEFINE_string("block_sizes", "", "BlockSizes fields for every Pallas impl, e.g. "
                    "'fused_states=false,sweep_k=64' (default: the kernels' defaults).")
flags.DEFINE_string("gdn_block_sizes", "", "chunk_gdn.BlockSizes fields for every Pallas "
                    "GDN / SSE-GDN impl, e.g. 'block_v=32,num_warps=8'.")


def with_block_sizes(impl: str, block_sizes: dict, op: str = "gla"):
  """`impl`, or for a Pallas impl when `block_sizes` (BlockSizes fields of `op`'s
  kernels: `chunk_gdn` for the delta-rule ops) is not empty, its `ops.Plan` with those
  tiles (the chunk size is BlockSizes' unless a field sets it)."""
  if not block_sizes or ops.Impl(impl) is ops.Impl.AUTO:
    return impl
  plan = impl_lib.named(impl)
  if not isinstance(plan.core, ops.PallasCore):
    return impl
  module = gdn_kernels if op in impl_lib.DELTA_OPS else kernels
  return dataclasses.replace(plan, core=ops.PallasCore(module.BlockSizes(**block_sizes)))


def op_fn(op, impl, n):
  """(forward, forward+backward) functions of the input dict; impl a string, or a Plan
  whose Pallas tiles set the chunk size."""
  kw = {}
  if isinstance(impl, ops.Plan) and isinstance(impl.core, ops.PallasCore):
    kw["chunk_size"] = impl.core.block_sizes.chunk
  delta = op in impl_lib.DELTA_OPS  # inputs from `op_setting.delta_inputs`
  match op:
    case "gla":
      def fwd(x, q, k, v, g, w, beta):
        del w, beta
        return ops.gla(q, k, v, g, cu_seqlens=x["cu"], impl=impl, **kw)[0]
    case "sse":
      def fwd(x, q, k, v, g, w, beta):
        del beta
        return ops.sse(q, k, v, g, w, x["idx"], num_partitions=n, cu_seqlens=x["cu"],
                       impl=impl, shared=(x["q0"], x["k0"], g), **kw)[0]
    case "gdn":
      def fwd(x, q, k, v, g, w, beta):
        del w
        return ops.gdn(q, k, v, g, beta, cu_seqlens=x["cu"], impl=impl, **kw)[0]
    case "sse_gdn":
      def fwd(x, q, k, v, g, w, beta):
        return ops.sse_gdn(q, k, v, g, beta, w, x["idx"], num_partitions=n,
                           cu_seqlens=x["cu"], impl=impl,
                           shared=(x["q0"], x["k0n"], g, beta), **kw)[0]
    case _:
      raise ValueError(f"unknown op {op!r}")
  names = ("q", "kn", "v", "gh", "w", "beta") if delta else ("q", "k", "v", "g", "w", "w")
  # Gradients (dq, dk, dv, dg, then dw for SSE, dbeta for the delta rule).
  argnums = {"gla": (0, 1, 2, 3), "sse": (0, 1, 2, 3, 4), "gdn": (0, 1, 2, 3, 5),
             "sse_gdn": (0, 1, 2, 3, 4, 5)}[op]

  def forward(x):
    return fwd(x, *(x[name] for name in names))

  def loss(q, k, v, g, w, beta, x):
    o = fwd(x, q, k, v, g, w, beta)
    return jnp.sum(o.astype(jnp.float32) * x["cot"].astype(jnp.float32))

  def forward_backward(x):
    # (loss, gradients): with the loss an output, o is computed, so the forward's output
    # kernel runs as in training (and as in the peers' timed backward); with the
    # gradients alone it is pruned.
    return jax.value_and_grad(loss, argnums=argnums)(*(x[name] for name in names), x)
  return jax.jit(forward), jax.jit(forward_backward)


def temp_mib(fn, x):
  try:
    mem = fn.lower(x).compile().memory_analysis()
    return mem.temp_size_in_bytes / 2**20
  except Exception:  # memory_analysis is not available on every backend
    return float("nan")


def errors(op, impl, n, x):
  """Relative errors of o and the gradients against the fp32 scan reference."""
  fwd, fb = op_fn(op, impl, n)
  rfwd, rfb = op_fn(op, "scan", n)
  x32 = {k: (v.astype(jnp.float32) if jnp.issubdtype(v.dtype, jnp.floating) else v)
         for k, v in x.items()}
  out = {"o": rel_err(fwd(x), rfwd(x32))}
  names = {"gla": ("dq", "dk", "dv", "dg"), "sse": ("dq", "dk", "dv", "dg", "dw"),
           "gdn": ("dq", "dk", "dv", "dg", "dbeta"),
           "sse_gdn": ("dq", "dk", "dv", "dg", "dw", "dbeta")}[op]
  for name, a, b in zip(names, fb(x)[1], rfb(x32)[1]):
    out[name] = rel_err(a, b)
  return out


def peer_ops() -> list[str]:
  """The ops this run measures (those with impls), which the fla peer run measures too."""
  impls = dict(gla=FLAGS.gla_impls, sse=FLAGS.sse_impls, gdn=FLAGS.gdn_impls,
               sse_gdn=FLAGS.sse_gdn_impls)
  return [op for op, names in impls.items() if names]


def run_fla(out_dir):
  """Runs the PyTorch / fla peer benchmark in its own process; returns its rows."""
  try:
    import importlib.util  # pylint: disable=g-import-not-at-top
    if importlib.util.find_spec("fla") is None or importlib.util.find_spec("torch") is None:
      print("fla or torch not importable: peer rows skipped")
      return []
  except Exception:  # pragma: no cover
    return []
  path = pathlib.Path(out_dir) / "bench_fla.json"
  cmd = [sys.executable, "-m", "experiments.bench_fla", f"--out={path}",
         f"--lengths={','.join(FLAGS.lengths)}", f"--partitions={','.join(FLAGS.partitions)}",
         f"--heads={FLAGS.heads}", f"--dim={FLAGS.dim}", f"--top_k={FLAGS.top_k}",
         f"--reps={FLAGS.reps}", f"--ops={','.join(peer_ops())}",
         f"--check_length={FLAGS.check_length}"]
  print("running", " ".join(cmd), flush=True)
  path.unlink(missing_ok=True)
  try:
    status = subprocess.run(cmd, check=False, timeout=FLAGS.fla_timeout or None).returncode
  except subprocess.TimeoutExpired:
    status = f"stopped after --fla_timeout={FLAGS.fla_timeout} s"
  rows = json.loads(path.read_text())["rows"] if path.exists() else []
  if status != 0:  # bench_fla saves after every row: keep what it measured
    print(f"bench_fla did not finish ({status}): {len(rows)} peer rows kept", flush=True)
  return rows


# Peer numbers measured earlier and quoted here (one H200, bf16, same setting, PyTorch
# eager): fla `chunk_gla`, and the SSE authors' varlen / mask ops. Drawn in grey as
# reference lines; they were not measured by this script.
QUOTED_PEERS = {
    ("fla chunk_gla", None): {2048: 2.22, 8192: 2.92, 32768: 4.59},
    ("authors varlen", 4): {2048: 7.30, 8192: 6.70, 32768: 12.5},
    ("authors varlen", 8): {2048: 4.62, 8192: 6.12, 32768: 13.2},
    ("authors varlen", 16): {2048: 6.01, 8192: 5.92, 32768: 12.6},
    ("authors mask", 4): {2048: 3.28, 8192: 6.41, 32768: 22.6},
    ("authors mask", 8): {2048: 4.34, 8192: 10.1, 32768: 38.1},
    ("authors mask", 16): {2048: 5.99, 8192: 18.0, 32768: 69.0},
}


def plot(rows, path, meta):
  """Time vs L: one colour per implementation, one line style per N."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(9, 6))
  styles = {None: "-", 4: "-", 8: "--", 16: ":"}
  series = {}
  for r in rows:
    if r.get("fwd_bwd_ms") is not None:
      series.setdefault((r["source"], r["op"], r["impl"], r.get("n")), []).append(
          (r["length"], r["fwd_bwd_ms"]))
  impls = sorted({(s, o, i) for s, o, i, _ in series})
  colors = dict(zip(impls, plt.cm.tab20.colors * 2))
  for (source, op, impl, n), pts in sorted(series.items(), key=str):
    pts.sort()
    ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(n, "-"), marker="o",
            color=colors[(source, op, impl)], label=f"{op} {impl}" + (f" N={n}" if n else "")
            + ("" if source == "sse-jax" else f" ({source})"))
  for (name, n), pts in QUOTED_PEERS.items():
    xs = sorted(pts)
    ax.plot(xs, [pts[x] for x in xs], styles[n], marker="x", color="black" if n is None
            else "0.55", linewidth=0.8, label=f"{name}" + (f" N={n}" if n else "")
            + " (quoted)")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("sequence length L (cu_seqlens = [0, L/2, L])")
  ax.set_ylabel("forward + backward (ms, median)")
  ax.set_title(f"GLA / SSE / GDN / SSE-GDN ops, bf16, H={meta['heads']}, D={meta['dim']}, "
               f"K={meta['top_k']}, {meta['device']}")
  ax.legend(fontsize=6, ncol=3)
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=130)


def _code(command: str) -> str:
  """A command as Markdown code; a description of merged runs (which quotes its
  commands itself) as it is."""
  return command if "`" in command else f"`{command}`"


def markdown(rows):
  """One line per row; a "run" column when rows of several runs were merged (each
  such row names its run, which the table's header describes)."""
  runs = any("run" in r for r in rows)
  lines = ["| source | op | impl | L | N | fwd ms | fwd+bwd ms | temp MiB | compile s |"
           " GB/s (dense) |" + (" run |" if runs else ""),
           "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if runs else "")]
  fmt = lambda v, f="{:.2f}": "-" if v is None or v != v else f.format(v)
  for r in rows:
    lines.append(f"| {r['source']} | {r['op']} | {r['impl']} | {r['length']} | "
                 f"{r.get('n') or '-'} | {fmt(r.get('fwd_ms'))} | {fmt(r.get('fwd_bwd_ms'))} | "
                 f"{fmt(r.get('temp_mib'), '{:.0f}')} | {fmt(r.get('compile_s'), '{:.1f}')} |"
                 f" {fmt(r.get('achieved_GBps'), '{:.0f}')} |"
                 + (f" {r.get('run', '-')} |" if runs else ""))
  return "\n".join(lines)


def main(argv):
  del argv
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  if FLAGS.from_json:
    saved = json.loads(pathlib.Path(FLAGS.from_json).read_text())
    fla = out / "bench_fla.json"
    rows = [r for r in saved["rows"] if r["source"] == "sse-jax"]
    rows += json.loads(fla.read_text())["rows"] if fla.exists() else []
    return report(rows, saved["meta"], out)
  lengths = [int(v) for v in FLAGS.lengths]
  parts = [int(v) for v in FLAGS.partitions]
  device = jax.devices()[0].device_kind
  print(f"device: {device}, jax {jax.__version__}", flush=True)
  rows = []
  block_sizes = parse_variant(FLAGS.block_sizes)
  gdn_block_sizes = parse_variant(FLAGS.gdn_block_sizes)
  meta = dict(device=device, jax=jax.__version__, heads=FLAGS.heads, dim=FLAGS.dim,
              top_k=FLAGS.top_k, reps=FLAGS.reps, block_sizes=block_sizes,
              gdn_block_sizes=gdn_block_sizes,
              command=shlex.join(["python", "-m", "experiments.bench_ops", *sys.argv[1:]]))

  def save(rows):
    (out / "bench_ops.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))

  def record(op, impl, length, n, x):
    tiles = gdn_block_sizes if op in impl_lib.DELTA_OPS else block_sizes
    fwd, fb = op_fn(op, with_block_sizes(impl, tiles, op), n)
    t_fwd = time_fn(fwd, x, FLAGS.reps, FLAGS.warmup)[0] if FLAGS.time_fwd else None
    t_fb, c_fb = time_fn(fb, x, FLAGS.reps, FLAGS.warmup)
    row = dict(source="sse-jax", op=op, impl=impl, length=length, n=n, fwd_ms=t_fwd,
               fwd_bwd_ms=t_fb, compile_s=c_fb,
               temp_mib=temp_mib(fb, x) if FLAGS.memory else None)
    if FLAGS.check_length == length and (n is None or str(n) in FLAGS.check_partitions):
      row["errors"] = errors(op, with_block_sizes(impl, tiles, op), n, x)
    rows.append(row)
    save(rows)  # after every row, so that a run cut short keeps what it measured
    print(f"{op:7s} {impl:15s} L={length:6d} N={n or '-':>2} fwd {t_fwd or 0:8.3f} ms  "
          f"fwd+bwd {t_fb:8.3f} ms  compile {c_fb:5.1f} s"
          + (f"  err {row['errors']}" if "errors" in row else ""), flush=True)

  for length in lengths:
    x = op_setting.delta_inputs(make_inputs(length, max(parts), FLAGS.heads, FLAGS.dim, FLAGS.top_k))
    for impl in FLAGS.gla_impls:
      record("gla", impl, length, None, x)
    for impl in FLAGS.gdn_impls:
      record("gdn", impl, length, None, x)
    for n in parts:
      xn = op_setting.delta_inputs(make_inputs(length, n, FLAGS.heads, FLAGS.dim, FLAGS.top_k))
      for impl in FLAGS.sse_impls:
        if ops.Impl(impl) is ops.Impl.LOOP and length > FLAGS.loop_max_length:
          continue
        record("sse", impl, length, n, xn)
      for impl in FLAGS.sse_gdn_impls:
        record("sse_gdn", impl, length, n, xn)

  if FLAGS.fla and peer_ops():
    rows += run_fla(out)

  save(rows)
  report(rows, meta, out)


def notes(rows) -> str:
  """What the table cannot hold: each distinct note rows carry (which rows), and the
  errors measured against the float32 reference."""
  lines, seen = [], {}
  for r in rows:
    if r.get("note"):
      seen.setdefault(r["note"], []).append(f"{r['source']} {r['op']} {r['impl']}")
  for note, who in seen.items():
    lines.append(f"- {', '.join(dict.fromkeys(who))}: {note}")
  for r in rows:
    if r.get("errors"):
      errs = ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items())
      lines.append(f"- relative error vs float32, {r['source']} {r['op']} {r['impl']} "
                   f"L={r['length']}" + (f" N={r['n']}" if r.get("n") else "") + f": {errs}")
  return "\n\nNotes:\n" + "\n".join(lines) if lines else ""


def report(rows, meta, out):
  """Markdown table (with achieved bandwidth of the dense rows) and the plot."""
  # Achieved bandwidth of dense GLA: the bytes a fused fwd+bwd must move at least (read
  # q, k, v, do in bf16 and g in fp32 once; write dq, dk, dv in bf16 and dg in fp32
  # once) over the measured time.
  for r in rows:
    if r["op"] == "gla" and r["source"] == "sse-jax" and r.get("fwd_bwd_ms"):
      elems = r["length"] * meta["heads"] * meta["dim"]
      r["min_bytes"] = elems * (2 * 4 + 4) + elems * (2 * 3 + 4)
      r["achieved_GBps"] = r["min_bytes"] / (r["fwd_bwd_ms"] * 1e-3) / 1e9
  table = markdown(rows) + notes(rows)
  (out / "bench_ops.md").write_text(
      f"Command: {_code(meta['command'])} on {meta['device']} (jax {meta['jax']})\n\n{table}\n")
  plot(rows, out / "bench_ops.png", meta)
  print(table)


if __name__ == "__main__":
  app.run(main)
