r"""What a training step's forward pass keeps for its backward pass, by source line.

    python -m experiments.saved_residuals                       # 125M GLA vs SSE, T = 2K
    python -m experiments.saved_residuals --variants=gla_h,sse_h --length=32768
    python -m experiments.saved_residuals --size=tiny --length=64 --top=5

For each variant, the trainer's loss (`sse_jax.train.steps.forward`, one sequence of
`length` tokens, bf16 compute, fp32 parameters) is traced under `jax.grad` and every
array the backward pass reads from the forward pass (a residual) is charged to the
source line that made it. Parameters and the batch are left out: every variant holds
those anyway. Runs on any backend, CPU included: nothing is compiled, and the op layers
take the Pallas kernels (`--kernels`, the GPU's `impl="auto"`) or the XLA paths.

This counts the residuals as JAX hands them to XLA, before XLA's own scheduling and
fusion: it predicts which variant keeps more and where, not the device's peak memory
(which `experiments.throughput` measures). Prints one table per variant and a summary,
and with --out writes saved_residuals.json and .md there.
"""

from __future__ import annotations

import collections
import json
import pathlib
import shlex
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from sse_jax.model import presets
from sse_jax.ops import impl as impl_lib
from sse_jax.train import metrics as metrics_lib
from sse_jax.train import state as state_lib
from sse_jax.train import steps

FLAGS = flags.FLAGS
ROOT = pathlib.Path(__file__).resolve().parents[1]


def define_flags() -> None:
  flags.DEFINE_string("size", "125m", "Model size preset (sse_jax.model.presets.SIZES).")
  flags.DEFINE_list("variants", ["gla", "sse"], "Model variants (presets.VARIANTS).")
  flags.DEFINE_integer("length", 2048, "Tokens in the one sequence traced.", lower_bound=1)
  flags.DEFINE_bool("kernels", True, "The Pallas kernels' impls (else the XLA paths).")
  flags.DEFINE_integer("top", 12, "Source lines listed per variant.", lower_bound=1)
  flags.DEFINE_string("out", None, "Directory for saved_residuals.json / .md (optional).")


def residuals(variant: str, size: str, length: int, kernels: bool) -> list[dict]:
  """[{"shape", "dtype", "bytes", "source"}] of every non-argument residual of the
  loss's gradient for one sequence of `length` tokens."""
  # What impl="auto" picks with (or, on any backend, without) the Pallas kernels.
  config = presets.preset(size, variant, **{
      op: dict(impl=impl_lib.auto_choice(op, kernels).value) for op in ("sse", "gla", "gdn")})
  model = state_lib.new_model(config, 0, jnp.bfloat16, jnp.float32)
  graphdef, params = state_lib.split_model(model)
  tokens = np.ones((1, length), np.int32)
  batch = dict(inputs=tokens, targets=tokens, weights=np.ones((1, length), np.float32))

  def loss(p):
    return metrics_lib.train_metrics(steps.forward(graphdef, p, batch), batch)["loss"]

  # jax.ad_checkpoint.print_saved_residuals only prints this list: the same function,
  # from where JAX keeps it.
  from jax._src import ad_checkpoint  # pylint: disable=g-import-not-at-top
  rows = []
  for aval, why in ad_checkpoint.saved_residuals(loss, params):
    if "from the argument" in why:
      continue
    rows.append(dict(shape=list(aval.shape), dtype=str(aval.dtype),
                     bytes=int(np.prod(aval.shape)) * aval.dtype.itemsize,
                     source=relative(why.split(" from ")[-1])))
  return rows


def relative(source: str) -> str:
  """A residual's "file:line:column (function)" with the file relative to the
  repository (or to site-packages for a library's line)."""
  root = f"{ROOT}/"
  if source.startswith(root):
    return source[len(root):]
  return source.split("site-packages/")[-1]


def by_source(rows: list[dict]) -> list[tuple[str, int, int]]:
  """(source, bytes, arrays) per source line, largest first."""
  total, count = collections.Counter(), collections.Counter()
  for r in rows:
    total[r["source"]] += r["bytes"]
    count[r["source"]] += 1
  return [(s, b, count[s]) for s, b in total.most_common()]


def mib(n: int) -> str:
  return f"{n / 2**20:,.1f}"


def report(points: dict[str, list[dict]], top: int, header: str) -> str:
  """Markdown: the summary (MiB per variant, against the first) and the top lines."""
  first = sum(r["bytes"] for r in next(iter(points.values())))
  lines = [header, "", "| variant | residual MiB | arrays | vs first |", "|---|---|---|---|"]
  for variant, rows in points.items():
    total = sum(r["bytes"] for r in rows)
    lines.append(f"| {variant} | {mib(total)} | {len(rows)} | {total / first:.3f}x |")
  for variant, rows in points.items():
    lines += ["", f"{variant}: the {top} largest source lines", "",
              "| MiB | arrays | source |", "|---|---|---|"]
    lines += [f"| {mib(b)} | {n} | `{s}` |" for s, b, n in by_source(rows)[:top]]
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  header = (f"{FLAGS.size} models, one sequence of {FLAGS.length} tokens, "
            f"{'Pallas kernels' if FLAGS.kernels else 'XLA paths'}; before XLA's "
            "scheduling (not peak memory)")
  points = {}
  for variant in FLAGS.variants:
    points[variant] = residuals(variant, FLAGS.size, FLAGS.length, FLAGS.kernels)
    print(f"{variant}: {mib(sum(r['bytes'] for r in points[variant]))} MiB in "
          f"{len(points[variant])} residuals", flush=True)
  text = report(points, FLAGS.top, header)
  print(text)
  if FLAGS.out:
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m experiments.saved_residuals " + shlex.join(sys.argv[1:])
    (out / "saved_residuals.md").write_text(f"```bash\n{command}\n```\n\n{text}")
    meta = dict(size=FLAGS.size, length=FLAGS.length, kernels=FLAGS.kernels,
                jax=jax.__version__, command=command)
    (out / "saved_residuals.json").write_text(json.dumps(dict(meta=meta, points=points)))


if __name__ == "__main__":
  define_flags()
  app.run(main)
