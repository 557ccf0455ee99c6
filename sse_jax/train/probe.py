"""Retrieval probe of a trained byte-level model: needle accuracy by context length.

    rows = retrieval_by_length(config, workdir, lengths=(256, 512, 1024))

For each context length T, `sse_jax.data.RetrievalSource` hides a key and a
`num_digits`-digit value at a random depth of a held-out Shakespeare passage and asks for
it at the end (RULER-style single needle). The model of the run's latest checkpoint
reads each example once (teacher forcing, as in training); an example counts as
retrieved when every answer byte is the model's top prediction (`exact_match`), and
`digit_accuracy` is the fraction of answer bytes that are. Only byte-level models
(vocabulary >= 256, e.g. trained on `kind="shakespeare"` or `"tfds"`) can be probed.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import jax

from sse_jax.data import VOCAB_SIZE
from sse_jax.data import pipeline
from sse_jax.data.retrieval import RetrievalConfig, RetrievalSource
from sse_jax.train import checkpoint
from sse_jax.train import config as config_lib
from sse_jax.train import metrics as metrics_lib
from sse_jax.train import program as program_lib


def retrieval_by_length(config, workdir: str, lengths: Sequence[int], *,
                        num_examples: int = 64, batch_size: int = 8, num_digits: int = 7,
                        seed: int = 0, step: int | None = None) -> list[dict[str, Any]]:
  """One row per length: {seq_len, exact_match, digit_accuracy, answer_ce (nats per
  answer byte: smoother than the accuracies for a weak model), examples, step}.

  config: the run's training config (e.g. its config.json,
  `sse_jax.train.config.from_json`); workdir: the run directory (its latest checkpoint, or `step`).
  num_examples per length (a multiple of batch_size, the global batch).
  """
  model = config_lib.model_config(config)
  if model.vocab_size < VOCAB_SIZE:
    raise ValueError(f"the model's vocabulary ({model.vocab_size} ids) is not byte-level "
                     f"(>= {VOCAB_SIZE}): the retrieval probe is Shakespeare bytes")
  if batch_size < 1 or num_examples < batch_size or num_examples % batch_size:
    raise ValueError(f"num_examples={num_examples} must be a positive multiple of "
                     f"batch_size={batch_size}")
  if not lengths or any(int(t) < 1 for t in lengths):
    raise ValueError(f"lengths={list(lengths)} must be positive context lengths")
  state, step = checkpoint.load_state(config, workdir, step)
  program = program_lib.build(config)
  rows = []
  with jax.set_mesh(program.mesh):
    for seq_len in lengths:
      source = RetrievalSource(RetrievalConfig(
          seq_len=int(seq_len), num_digits=num_digits, seed=seed,
          num_examples=num_examples))
      ds = pipeline.make_dataset(source, batch_size=batch_size, seed=seed, shuffle=False,
                                 num_epochs=1)
      iterator = iter(ds)
      sums = [program.eval_step(state.params, program.global_batch(local))
              for local in itertools.islice(iterator, num_examples // batch_size)]
      del iterator
      result = metrics_lib.finish_eval(jax.device_get(sums), (), False)
      rows.append({"seq_len": int(seq_len), "exact_match": result["exact_match"],
                   "digit_accuracy": result["accuracy"], "answer_ce": result["ce"],
                   "examples": num_examples, "step": int(step)})
  return rows
