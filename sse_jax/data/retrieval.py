"""Single-needle retrieval probe on Shakespeare text (in the spirit of RULER S-NIAH).

One example is a byte sequence s of exactly seq_len + 1 bytes:

    <passage[:p]> The secret number for <word> is <digits>.\n <passage[p:]>
    \nWhat is the secret number for <word>? <digits>

  * passage: a contiguous span of the Shakespeare split (shakespeare.py), at a random offset,
    as long as needed to fill the context exactly;
  * the needle line is inserted at depth d in [0, 1] of the passage (random per example, or
    fixed by `depth`), moved back to the start of the line containing that point so that it
    never splits a line;
  * <word> comes from WORDS, <digits> is a num_digits-digit number (no leading zero).

inputs = s[:-1], targets = s[1:] (int32 [seq_len]); weights float32 [seq_len] is 1 exactly
on the num_digits last positions, whose targets are the answer digits, and 0 elsewhere.
An example is answered iff all its answer bytes are predicted: `exact_match(correct,
weights)`. Accuracy by context length = one RetrievalSource per seq_len.

Example i is computed from `np.random.default_rng([seed, split_id, i])` (split_id 0 for
train, 1 for validation): random access and reproducible. The default haystack is the
held-out (validation) text.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sse_jax.data import shakespeare
from sse_jax.data.tokenizer import encode_bytes

WORDS = (
    "anchor", "apple", "arrow", "badger", "banner", "barrel", "basket", "beacon", "bishop",
    "bottle", "bridge", "button", "candle", "carpet", "castle", "cellar", "cherry", "cobalt",
    "comet", "copper", "cradle", "dagger", "desert", "dragon", "falcon", "feather", "forest",
    "galaxy", "garden", "glacier", "goblet", "harbor", "helmet", "island", "jasmine", "kettle",
    "ladder", "lantern", "lemon", "marble", "meadow", "mirror", "nectar", "orchid", "oyster",
    "parrot", "pebble", "pepper", "pillow", "planet", "pocket", "puzzle", "quartz", "rabbit",
    "ribbon", "saddle", "silver", "spider", "summit", "thimble", "tunnel", "velvet", "walnut",
    "whistle",
)
NEEDLE = "The secret number for {word} is {digits}.\n"
QUESTION = "\nWhat is the secret number for {word}? "
SPLIT_IDS = {"train": 0, "validation": 1}


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
  """seq_len: context length T; depth None: uniform in [0, 1] per example."""

  seq_len: int = 1024
  split: str = "validation"
  valid_fraction: float = 0.1
  num_digits: int = 7
  depth: float | None = None
  seed: int = 0
  num_examples: int = 256


def min_seq_len(num_digits: int) -> int:
  """Shortest seq_len holding the longest needle, question and answer (no passage)."""
  longest = max(WORDS, key=len)
  fixed = NEEDLE.format(word=longest, digits="0" * num_digits)
  fixed += QUESTION.format(word=longest) + "0" * num_digits
  return len(fixed) - 1


class RetrievalSource:
  """Random-access probe examples: dict(inputs int32 [T], targets int32 [T], weights f32 [T])."""

  def __init__(self, config: RetrievalConfig):
    c = config
    if c.split not in SPLIT_IDS:
      raise ValueError(f"split={c.split!r}: must be one of {tuple(SPLIT_IDS)}")
    if c.num_digits < 1:
      raise ValueError(f"num_digits={c.num_digits}: must be >= 1")
    if c.depth is not None and not 0.0 <= c.depth <= 1.0:
      raise ValueError(f"depth={c.depth}: must lie in [0, 1] or be None (random)")
    if c.seq_len < min_seq_len(c.num_digits):
      raise ValueError(f"seq_len={c.seq_len} too short for the needle, question and a "
                       f"{c.num_digits}-digit answer: need >= {min_seq_len(c.num_digits)}")
    if c.seed < 0 or c.num_examples < 1:
      raise ValueError(f"seed={c.seed} must be >= 0 and num_examples={c.num_examples} >= 1")
    self.config = c
    self.text = shakespeare.corpus(c.split, c.valid_fraction)
    if len(self.text) < c.seq_len + 1:
      raise ValueError(f"seq_len={c.seq_len} exceeds the {c.split} text ({len(self.text)} B)")

  def __len__(self) -> int:
    return self.config.num_examples

  def describe(self, index: int) -> dict:
    """The example's sequence s (uint8 [seq_len + 1]) and what was hidden where."""
    c = self.config
    index = int(index)
    if not 0 <= index < c.num_examples:
      raise IndexError(f"retrieval index {index} out of range [0, {c.num_examples})")
    rng = np.random.default_rng([c.seed, SPLIT_IDS[c.split], index])
    word = WORDS[rng.integers(len(WORDS))]
    digits = str(rng.integers(1, 10)) + "".join(map(str, rng.integers(0, 10, c.num_digits - 1)))
    depth = rng.random() if c.depth is None else c.depth
    needle = encode_bytes(NEEDLE.format(word=word, digits=digits))
    tail = encode_bytes(QUESTION.format(word=word) + digits)

    passage_len = c.seq_len + 1 - len(needle) - len(tail)
    offset = rng.integers(0, len(self.text) - passage_len + 1)
    passage = self.text[offset:offset + passage_len]
    point = int(round(depth * passage_len))
    newlines = np.flatnonzero(passage[:point] == ord("\n"))
    point = int(newlines[-1]) + 1 if len(newlines) else 0
    seq = np.concatenate([passage[:point], needle, passage[point:], tail])
    return {"sequence": seq, "word": word, "digits": digits, "needle_start": point,
            "depth": point / max(passage_len, 1)}

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    seq = self.describe(index)["sequence"].astype(np.int32)
    n = self.config.seq_len
    weights = np.zeros((n,), np.float32)
    weights[n - self.config.num_digits:] = 1.0
    return {"inputs": seq[:-1], "targets": seq[1:], "weights": weights}

  def __repr__(self) -> str:
    return f"RetrievalSource({self.config!r})"


def exact_match(correct, weights):
  """Per-example exact match [B] (bool) from per-token correctness and weights [B, T].

  True iff every weighted position is correct (and the example has one); jit-friendly.
  """
  correct = jnp.asarray(correct, bool)
  scored = jnp.asarray(weights) > 0
  return jnp.all(correct | ~scored, axis=-1) & jnp.any(scored, axis=-1)
