r"""Trains one run: `python -m sse_jax.train --config=FILE[:ARG] --workdir=DIR`.

    python -m sse_jax.train --config=configs/train_default.py --workdir=/tmp/run \
        --config.num_steps=200 --config.model.pattern=SSA --config.lr=1e-3
    python -m sse_jax.train --config=configs/train_default.py:/tmp/run/config.json \
        --workdir=/tmp/run           # a run's saved config: resume it

--config names an ml_collections config file whose get_config(ARG) returns a training
config (`sse_jax.train.default_config`; configs/train_default.py is the default one);
--config.<field>=<value> sets one of its fields, as with `python -m experiments.ablation`.
The run trains in --workdir, resuming from its latest checkpoint (`train_and_evaluate`),
and prints its summary as JSON on stdout (every process).

A mistake on the command line (a config file or argument that does not exist, a field
the config does not have, an impossible value, a workdir that cannot be created) is one
line on stderr and exit status 2, before anything trains; a run that fails (a non-finite
loss, a checkpoint that cannot be resumed or saved) is one line and exit status 1.

Logging: progress lines (config.progress) and the library's warnings go through
absl.logging; orbax's per-save INFO lines are hidden unless --verbosity is given.
Multi-host: start one process per host with the same --coordinator=host:port and
--num_processes, and its own --process_id; each process then reads its shard of every
global batch. --cpu_devices=N simulates N devices per process on CPU.
"""

from __future__ import annotations

import json
import re
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from sse_jax import cli
from sse_jax.train import config as config_lib

PROG = "python -m sse_jax.train"
FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags, on absl's global FLAGS (once)."""
  if "workdir" in FLAGS:
    return
  config_flags.DEFINE_config_file(
      "config", None, "Training config file and its argument, e.g."
      " configs/train_default.py (or configs/train_default.py:RUN/config.json). Its fields"
      " are set with --config.<field>=<value>, e.g. --config.num_steps=200.",
      lock_config=False)
  flags.DEFINE_string("workdir", None, "The run's directory (created; a run there resumes).")
  flags.DEFINE_integer("stop_after", None,
                       "End after this step as a preemption would (resume drills).")
  flags.DEFINE_integer("cpu_devices", None, "Simulated CPU devices per process.")
  flags.DEFINE_string("coordinator", None, "host:port of process 0 (multi-host).")
  flags.DEFINE_integer("num_processes", 1, "Processes of a multi-host run.")
  flags.DEFINE_integer("process_id", 0, "This process's index in a multi-host run.")


def load_train_config(argument: str):
  """The training config --config=`argument` builds; an experiment config (a sweep) is
  refused with the command that runs it."""
  cfg = cli.load_config_file(argument)
  if {"train", "runs"} <= set(cfg):
    raise app.UsageError(f"--config={argument} is an experiment config (a sweep of runs):"
                         f" run it with python -m experiments.ablation --config={argument}")
  return cfg


def parse_flags(argv: list[str]) -> list[str]:
  """app.run's flag parser: the config file and every --config.<field> flag checked
  first (`sse_jax.cli`), then absl's; every mistake one line and exit status 2."""
  try:
    argument = cli.config_argument(argv[1:])
    if argument:
      cli.check_override_paths(argv[1:], argument, load_train_config(argument))
    return FLAGS(argv)
  except (app.UsageError, flags.Error) as e:
    cli.usage_exit(e)


def _checked_config():
  """FLAGS.config, validated (and its model built) now: a bad value is one line naming
  the --config flag that set it."""
  config = FLAGS.config
  try:
    config_lib.validate(config)
    config_lib.model_config(config)
  except ValueError as e:
    # "train config: <path>=" (a training field), or "<Layer>Config.<field>=" (a model
    # field, named by the layer: the flag is the override ending in that field)
    found = re.match(r"train config: ([\w.]+)=|\w+Config\.(\w+)=", str(e))
    overrides = FLAGS["config"].override_values
    if found and found[1]:
      given = [p for p in overrides if p == found[1] or p.startswith(found[1] + ".")]
    else:
      given = [p for p in overrides if found and p.startswith("model.")
               and p.rsplit(".", 1)[-1] == found[2]]
    by = f" (set by --config.{given[0]})" if given else ""
    raise app.UsageError(f"--config={FLAGS['config'].config_filename}: {e}{by}") from None
  return config


def run(argv: list[str]) -> None:
  """Trains FLAGS.config in FLAGS.workdir and prints the summary."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected argument {argv[1]!r}: flags are --name=value, the"
                         " config --config=FILE[:ARG]")
  if FLAGS.config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/train_default.py"
                         " (from the repository root)")
  if not FLAGS.workdir:
    raise app.UsageError("--workdir is required: the run's directory")
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  config = _checked_config()
  import jax  # pylint: disable=g-import-not-at-top
  if FLAGS.cpu_devices:
    jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices)
  if FLAGS.coordinator:
    # Must come before anything touches a device.
    jax.distributed.initialize(coordinator_address=FLAGS.coordinator,
                               num_processes=FLAGS.num_processes,
                               process_id=FLAGS.process_id, initialization_timeout=120)
  # pylint: disable=g-import-not-at-top
  from sse_jax.train.checkpoint import CheckpointError
  from sse_jax.train.loop import NonFiniteLossError, prepare_workdir, train_and_evaluate
  # pylint: enable=g-import-not-at-top
  try:
    prepare_workdir(FLAGS.workdir)
  except CheckpointError as e:
    raise app.UsageError(f"--workdir={FLAGS.workdir}: {e}: give a directory you can"
                         " write to") from None
  try:
    summary = train_and_evaluate(config, FLAGS.workdir, stop_after=FLAGS.stop_after)
  except (NonFiniteLossError, CheckpointError) as e:
    print(" ".join(f"{type(e).__name__}: {e}".split()), file=sys.stderr, flush=True)
    sys.exit(1)
  print(json.dumps(summary), flush=True)
  if FLAGS.coordinator:
    jax.distributed.shutdown()


def _main(argv: list[str]) -> None:
  try:
    run(argv)
  except app.UsageError as e:
    cli.usage_exit(e)


def main(argv: list[str] | None = None) -> None:
  """The command line, `argv` without the program name (default: sys.argv's); exits."""
  define_flags()
  args = sys.argv[1:] if argv is None else list(argv)
  app.run(_main, argv=[PROG, *args], flags_parser=parse_flags)


if __name__ == "__main__":
  main()
