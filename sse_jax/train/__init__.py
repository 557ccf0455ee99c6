"""Training: sharded jitted steps, grain input, orbax resume, JSONL / TensorBoard metrics.

    from sse_jax import train
    config = train.default_config()          # every field documented there
    config.num_steps = 500
    summary = train.train_and_evaluate(config, "/tmp/run")   # resumes if interrupted

Files under the workdir: config.json, metrics.jsonl, tb/ (TensorBoard events),
checkpoints/<step>/ (orbax), summary.json (when finished).
`train_stacked(configs, workdirs)` trains runs that differ only in lr and seed as one
vmapped program (each still gets its own workdir). Lower level: `build(config) -> Program` (mesh, shardings, init, jitted train / eval
steps) and `load_state(config, workdir)`; `probe.retrieval_by_length` scores a
byte-level run's needle retrieval by context length. Multi-host: call `jax.distributed.initialize`
first (or use `python -m sse_jax.train --coordinator=...`).
"""

from sse_jax.train.checkpoint import CheckpointError, load_state
from sse_jax.train.config import default_config
from sse_jax.train.loop import NonFiniteLossError, train_and_evaluate
from sse_jax.train.program import Program, build
from sse_jax.train.stacked import train_stacked
from sse_jax.train.state import TrainState

__all__ = ["CheckpointError", "NonFiniteLossError", "Program", "TrainState", "build",
           "default_config", "load_state", "train_and_evaluate", "train_stacked"]
