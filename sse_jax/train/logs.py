"""Where metrics go: workdir/metrics.jsonl, TensorBoard files in workdir/tb, and progress
lines through absl.logging (`Progress`). Only process 0 writes (metrics are global, every
process has them).

metrics.jsonl holds one JSON object per event, in step order:
    {"kind": "train", "step": s, <train metrics averaged over the last log_every steps>,
     "steps_per_s", "tokens_per_s", "time"}   (no rates in a window of only the
                                              invocation's first, compiling step)
    {"kind": "eval", "step": s, "train_loss": <mean training loss since the previous
     eval>, <eval metrics>, "router": [{"layer", "usage", "entropy", "max"}, ...],
     "time"}
("time": seconds since this invocation started.) A resumed run first drops the records
after its checkpoint's step (the killed run wrote them; they are computed again), so
the file reads like one uninterrupted run.
"""

from __future__ import annotations

import json
import logging as std_logging
import math
import os
from typing import Any

from absl import logging

from sse_jax.train import metrics as metrics_lib
from sse_jax.train.tensorboard import EventWriter

TIMING = ("steps_per_s", "tokens_per_s", "time")


def read_records(path: str) -> list[dict[str, Any]]:
  """Records of a metrics.jsonl (a torn last line from a killed run is skipped)."""
  if not os.path.exists(path):
    return []
  records = []
  with open(path) as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return records


def history(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The eval records as learning-curve entries: step, train_loss, eval_*, router."""
  out = []
  for r in records:
    if r.get("kind") != "eval":
      continue
    entry = {"step": r["step"], "train_loss": r.get("train_loss")}
    entry.update({f"eval_{k}": v for k, v in r.items()
                  if k not in ("kind", "step", "train_loss", "router", "time")})
    entry["router"] = r.get("router", [])
    out.append(entry)
  return out


class MetricsLog:
  """Appends records to metrics.jsonl and TensorBoard; a no-op unless `active`."""

  def __init__(self, workdir: str, active: bool, resume_step: int | None):
    self.active = active
    self.path = os.path.join(workdir, "metrics.jsonl")
    kept = [r for r in read_records(self.path)
            if resume_step is not None and r.get("step", math.inf) <= resume_step]
    self.records = kept
    if not active:
      return
    # Rewrite (drops what a killed run logged later) atomically: other processes may be
    # reading the file at the same moment.
    with open(self.path + ".tmp", "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(self.path + ".tmp", self.path)
    self._file = open(self.path, "a")
    self._tb = EventWriter(os.path.join(workdir, "tb"))
    # TensorBoard then hides what earlier (killed) runs in this workdir logged from here on.
    self._tb.session_start((resume_step or 0) + 1)

  def write(self, record: dict[str, Any]) -> None:
    self.records.append(record)
    if not self.active:
      return
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    scalars = {k: v for k, v in record.items() if k not in ("kind", "step", "time")}
    self._tb.scalars(record["step"], metrics_lib.flat_scalars(record["kind"], scalars))
    self._tb.flush()

  def last(self, kind: str) -> dict[str, Any] | None:
    found = [r for r in self.records if r.get("kind") == kind]
    return found[-1] if found else None

  def history(self) -> list[dict[str, Any]]:
    """One entry per evaluation: step, train_loss, eval_* metrics, router statistics."""
    return history(self.records)

  def close(self) -> None:
    if self.active:
      self._file.close()
      self._tb.close()


def _duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = int(round(seconds))
  h, rest = divmod(seconds, 3600)
  m, s = divmod(rest, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class Progress:
  """Progress lines, `[train] step 120/1000 (12%) | 3.42 steps/s | 14,008 tok/s | loss
  2.3456 | ETA 4m17s`, as INFO records of absl's logger.

  config.progress switches them, not the verbosity: they are written whatever absl's
  verbosity (the ablation runner and the trainer's command line set WARNING to hide
  orbax's per-save INFO lines), by the handlers absl's logger reaches (absl's own under
  absl.app; a caller's, e.g. pytest's), else by absl's handler (a notebook, a plain
  script). The first window of an invocation has the compiling step left out of its
  rate; a window of that step alone has no rate and says how long the step took.
  """

  def __init__(self, num_steps: int, active: bool):
    self.num_steps = num_steps
    self.active = active

  def line(self, step: int, loss: float, steps_per_s: float | None,
           tokens_per_s: float | None, first_step_s: float | None = None) -> str:
    done = f"[train] step {step}/{self.num_steps} ({100 * step / self.num_steps:.0f}%)"
    if steps_per_s is None:
      took = "" if first_step_s is None else f" in {first_step_s:.1f}s"
      return f"{done} | first step{took} (compiling) | loss {loss:.4f}"
    eta = (self.num_steps - step) / steps_per_s if steps_per_s > 0 else math.inf
    return (f"{done} | {steps_per_s:.2f} steps/s | {tokens_per_s:,.0f} tok/s | "
            f"loss {loss:.4f} | ETA {_duration(eta)}")

  def update(self, step: int, loss: float, steps_per_s: float | None,
             tokens_per_s: float | None, first_step_s: float | None = None) -> None:
    if self.active:
      info(self.line(step, loss, steps_per_s, tokens_per_s, first_step_s))


def info(message: str) -> None:
  """`message` as an INFO record of absl's logger, written whatever the verbosity (see
  `Progress`)."""
  logger = logging.get_absl_logger()
  filename, lineno, function, _ = logger.findCaller()
  record = logger.makeRecord(logger.name, std_logging.INFO, filename, lineno, message, (),
                             None, function)
  if logger.hasHandlers():
    logger.handle(record)  # the level check is left out: handle() filters, then emits
  else:
    logging.get_absl_handler().handle(record)
