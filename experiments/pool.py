"""Child processes run a few at a time: small jobs that share one accelerator.

    failed = pool.run(tasks, workers=4, command=lambda t: [...argv...],
                      log_path=lambda t: run_dir / "train.log",
                      on_exit=lambda t, returncode, seconds: ...)

`exclusive(path)` serialises a section across processes (e.g. timing on a shared
device). Each child gets `child_env(workers)`; SIGTERM or Ctrl-C in the parent terminates every
running child before the exception propagates, so a time limit on the parent bounds
the whole pool.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import signal
import subprocess
import time
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def exclusive(path: str | os.PathLike):
  """Holds an exclusive lock on the file `path` (created if missing) across processes;
  a no-op for an empty path."""
  if not path:
    yield
    return
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def child_env(workers: int) -> dict[str, str]:
  """The parent's environment, with a GPU memory share of 0.9 / workers per child."""
  env = dict(os.environ)
  # Each process would otherwise reserve 75% of a GPU's memory for itself.
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / workers:.3f}")
  return env


def _stop(signum, frame):
  del frame
  raise SystemExit(f"stopped by signal {signum}")


def run(tasks: Sequence[T], workers: int, command: Callable[[T], list[str]],
        log_path: Callable[[T], pathlib.Path],
        on_exit: Callable[[T, int, float], None],
        on_start: Callable[[T], None] | None = None) -> None:
  """Runs command(task) for every task, at most `workers` at once, in order.

  A child's stdout and stderr go to log_path(task) (its folder must exist);
  on_exit(task, returncode, seconds) is called as each child ends.
  """
  env = child_env(workers)
  queue, running = list(tasks), []
  previous = signal.signal(signal.SIGTERM, _stop)
  try:
    while queue or running:
      while queue and len(running) < workers:
        task = queue.pop(0)
        log = open(log_path(task), "ab")
        proc = subprocess.Popen(command(task), stdout=log, stderr=subprocess.STDOUT, env=env)
        running.append((proc, log, task, time.time()))
        if on_start is not None:
          on_start(task)
      time.sleep(0.5)
      for item in [r for r in running if r[0].poll() is not None]:
        proc, log, task, started = item
        running.remove(item)
        log.close()
        on_exit(task, proc.returncode, time.time() - started)
  finally:
    signal.signal(signal.SIGTERM, previous)
    for proc, _, _, _ in running:
      proc.terminate()
    for proc, log, _, _ in running:
      proc.wait()
      log.close()
