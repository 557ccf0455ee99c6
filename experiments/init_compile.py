r"""How long the trainer's state initialiser takes to compile, per threefry lowering.

    python -m experiments.init_compile                      # GPU: 125M SSE and GLA
    python -m experiments.init_compile --size=tiny --variants=sse

For each variant it compiles `jit(init_state)` (the model's parameters and AdamW's
moments, as `sse_jax.train.build(config).init` creates them) twice: with jax.random's
threefry draws lowered to one GPU kernel call each (what the trainer does,
`state.rng_kernel_lowering`) and with XLA's default lowering, which inlines every draw
into a fusion of its own. Each compile is timed, then run, and the two states must be
equal bit for bit (the same threefry2x32 bits either way). On CPU both lowerings are
XLA's, so the two times are the same up to noise.

Writes <out>/init_compile.json after every compile (a run stopped at its time limit
keeps what it measured) and prints one line per compile.
"""

from __future__ import annotations

import json
import pathlib
import shlex
import sys
import time

from absl import app
from absl import flags
import jax
import numpy as np

from experiments import throughput
from sse_jax.train import config as config_lib
from sse_jax.train import optim
from sse_jax.train import program
from sse_jax.train import state as state_lib

FLAGS = flags.FLAGS
LOWERINGS = (("kernel", True), ("xla", False))


def define_flags() -> None:
  flags.DEFINE_string("size", "125m", "Model size preset (sse_jax.model.presets.SIZES).")
  flags.DEFINE_list("variants", ["sse", "gla"], "Model variants (presets.VARIANTS).")
  flags.DEFINE_string("impl", "auto", "ops implementation of the SSE / GLA / GDN layers.")
  flags.DEFINE_string("out", "results/init_compile", "Output directory.")


def initialiser(variant: str):
  """The trainer's jit(init_state) for `variant` (unsharded: one device)."""
  config = throughput.train_config(variant, batch=1)
  return jax.jit(program.initialiser(config, config_lib.model_config(config),
                                     optim.optimizer(config)))


def measure(variant: str, lowering: bool):
  """(compile seconds, run seconds, the state as numpy arrays)."""
  init = initialiser(variant)
  with state_lib.rng_kernel_lowering(lowering):
    t0 = time.perf_counter()
    compiled = init.lower().compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = jax.block_until_ready(compiled())
    run_s = time.perf_counter() - t0
  return compile_s, run_s, jax.tree.map(np.asarray, state)


def same_bits(a, b) -> bool:
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(leaves_a) == len(leaves_b) and all(
      x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
      for x, y in zip(leaves_a, leaves_b))


def main(argv):
  del argv
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  report = dict(command="python -m experiments.init_compile " + shlex.join(sys.argv[1:]),
                device=jax.devices()[0].device_kind, jax=jax.__version__, points=[])
  for variant in FLAGS.variants:
    states = {}
    for name, lowering in LOWERINGS:
      compile_s, run_s, states[name] = measure(variant, lowering)
      point = dict(variant=variant, lowering=name, compile_s=compile_s, run_s=run_s)
      if len(states) == 2:
        point["same_bits_as_kernel"] = same_bits(states["kernel"], states[name])
      report["points"].append(point)
      (out / "init_compile.json").write_text(json.dumps(report, indent=1) + "\n")
      print(f"{FLAGS.size} {variant}, {name} lowering: compiled in {compile_s:.1f} s, "
            f"ran in {run_s:.2f} s" + (f", same bits: {point['same_bits_as_kernel']}"
                                      if "same_bits_as_kernel" in point else ""),
            flush=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
