"""Command line: `python -m sse_jax.train --config_json=run.json --workdir=DIR`.

The JSON is a training config as `config.to_json()` writes it (e.g. a run's config.json);
a top-level field missing from it keeps its default. Multi-host: start one process per host with the same
--coordinator=host:port and --num_processes, and its own --process_id; each process then
reads its shard of every global batch. --cpu_devices=N simulates N devices per process on
CPU. Prints the summary as JSON on stdout (every process).
"""

from __future__ import annotations

import argparse
import json
import sys


def parse(argv):
  p = argparse.ArgumentParser(prog="python -m sse_jax.train", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config_json", required=True, help="training config as JSON")
  p.add_argument("--workdir", required=True)
  p.add_argument("--stop_after", type=int, default=None,
                 help="end after this step as a preemption would (resume drills)")
  p.add_argument("--cpu_devices", type=int, default=None,
                 help="simulated CPU devices per process")
  p.add_argument("--coordinator", default=None, help="host:port of process 0")
  p.add_argument("--num_processes", type=int, default=1)
  p.add_argument("--process_id", type=int, default=0)
  return p.parse_args(argv)


def load_config(path: str):
  """The defaults with each top-level field of the JSON replacing the default's."""
  from sse_jax.train.config import default_config  # pylint: disable=g-import-not-at-top
  with open(path) as f:
    fields = json.load(f)
  config = default_config()
  for key, value in fields.items():
    config[key] = value
  return config


def main(argv=None) -> int:
  args = parse(sys.argv[1:] if argv is None else argv)
  import jax  # pylint: disable=g-import-not-at-top
  if args.cpu_devices:
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if args.coordinator:
    # Must come before anything touches a device.
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id,
                               initialization_timeout=120)
  from sse_jax.train.loop import train_and_evaluate  # pylint: disable=g-import-not-at-top
  summary = train_and_evaluate(load_config(args.config_json), args.workdir,
                               stop_after=args.stop_after)
  print(json.dumps(summary))
  if args.coordinator:
    jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
