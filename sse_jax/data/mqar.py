"""Synthetic multi-query associative recall (MQAR, as in Zoology / Based).

Vocabulary of V ids:   0 = PAD / zero token;  keys = [1, 1 + H);  values = [1 + H, V),
with H = (V - 1) // 2, so keys and values never share an id.

One sequence s of length seq_len + 1 (P pairs, G = gap_len, Q queries):

    s = k_1 v_1 k_2 v_2 ... k_P v_P | g_1 ... g_G | q_1 a_1 q_2 a_2 ... q_Q a_Q | 0 0 ... 0
        `--- 2P key-value pairs ---'   `- gap --'   `--- 2Q query / answer ---'   `- pad -'

  * P is num_pairs, or, with min_pairs set, drawn per example uniformly from
    {min_pairs, ..., num_pairs} (a mixture of pair counts, as in Zoology: the lookup is
    learnt on the easy examples and the state's capacity is stressed by the hard ones);
    Q is num_queries, or P when num_queries is None;
  * keys are distinct within a sequence (values are distinct too);
  * the queries q_j are Q distinct keys of the pairs, in random order; a_j is the value that
    was paired with q_j;
  * gap tokens: mode "none" (G must be 0), "zero" (all PAD = 0), or "noise" (uniform over
    [1, V), i.e. random keys and values act as distractors; the SSE paper's Fig. 9 setting).

Next-token prediction on s: inputs = s[:-1], targets = s[1:], both int32 [seq_len].
weights float32 [seq_len] is 1 exactly at the Q input positions holding a query (index
2P + G + 2j), whose target is the answer a_j; 0 elsewhere, so loss and accuracy count only
answers. The trailing PAD tokens (id 0) are not part of the example: the trainer keeps
them out of the load-balance loss and the router statistics too. The answers also appear as inputs after each query (teacher forcing), as in Zoology.

Example i of `MQARSource(config, split_seed)` is computed from
`np.random.default_rng([config.seed, split_seed, i])`: random access, reproducible, and
independent of iteration order, process count or shuffling. Use different split_seeds
for training and held-out streams.
"""

from __future__ import annotations

import dataclasses

import numpy as np

GAP_MODES = ("none", "zero", "noise")
PAD_ID = 0


@dataclasses.dataclass(frozen=True)
class MQARConfig:
  """MQAR knobs. num_pairs: P, or the largest P when min_pairs is set (P uniform in
  [min_pairs, num_pairs] per example). num_queries None means P (every key is queried
  once)."""

  vocab_size: int = 8192
  num_pairs: int = 16
  min_pairs: int | None = None
  seq_len: int = 128
  num_queries: int | None = None
  gap_mode: str = "none"
  gap_len: int = 0
  seed: int = 0
  num_examples: int = 1 << 30  # "infinite" for training; shuffling stays O(1) in grain

  def __post_init__(self):
    validate(self)

  @property
  def queries(self) -> int:
    """Q of the longest example (P = num_pairs)."""
    return self.num_pairs if self.num_queries is None else self.num_queries

  @property
  def pair_counts(self) -> tuple[int, ...]:
    """Every P an example can have."""
    low = self.num_pairs if self.min_pairs is None else self.min_pairs
    return tuple(range(low, self.num_pairs + 1))

  @property
  def num_keys(self) -> int:
    return (self.vocab_size - 1) // 2


def validate(c: MQARConfig) -> None:
  """Raises ValueError naming the offending field for impossible configs."""
  if c.vocab_size < 3:
    raise ValueError(f"vocab_size={c.vocab_size}: need >= 3 (pad, one key, one value)")
  if c.num_pairs < 1:
    raise ValueError(f"num_pairs={c.num_pairs}: need >= 1")
  if c.num_pairs > c.num_keys:
    raise ValueError(
        f"num_pairs={c.num_pairs} needs that many distinct keys, but vocab_size="
        f"{c.vocab_size} has only {c.num_keys} key ids (need vocab_size >= "
        f"{2 * c.num_pairs + 1})")
  if c.min_pairs is not None and not 1 <= c.min_pairs <= c.num_pairs:
    raise ValueError(f"min_pairs={c.min_pairs}: must lie in [1, num_pairs={c.num_pairs}] "
                     "(or None for a fixed pair count)")
  fewest = c.num_pairs if c.min_pairs is None else c.min_pairs
  if c.num_queries is not None and not 1 <= c.num_queries <= fewest:
    raise ValueError(f"num_queries={c.num_queries}: must lie in [1, {fewest}], the fewest "
                     "pairs an example has (each query is a distinct key)")
  if c.gap_mode not in GAP_MODES:
    raise ValueError(f"gap_mode={c.gap_mode!r}: must be one of {GAP_MODES}")
  if c.gap_len < 0:
    raise ValueError(f"gap_len={c.gap_len}: must be >= 0")
  if c.gap_mode == "none" and c.gap_len:
    raise ValueError(f"gap_len={c.gap_len} with gap_mode='none': use 'zero' or 'noise'")
  if c.seed < 0:
    raise ValueError(f"seed={c.seed}: must be >= 0")
  if c.num_examples < 1:
    raise ValueError(f"num_examples={c.num_examples}: must be >= 1")
  used = 2 * c.num_pairs + c.gap_len + 2 * c.queries
  if used > c.seq_len + 1:
    raise ValueError(
        f"seq_len={c.seq_len} too short: num_pairs={c.num_pairs}, gap_len={c.gap_len}, "
        f"num_queries={c.queries} need 2*pairs + gap + 2*queries = {used} tokens, i.e. "
        f"seq_len >= {used - 1}")


def answer_start(c: MQARConfig, pairs: int | None = None) -> int:
  """Input position of the first query of an example with `pairs` pairs (None:
  num_pairs); answers sit at answer_start + 2j."""
  return 2 * (c.num_pairs if pairs is None else pairs) + c.gap_len


class MQARSource:
  """Random-access MQAR examples: dict(inputs int32 [T], targets int32 [T], weights f32 [T])."""

  def __init__(self, config: MQARConfig, split_seed: int = 0):
    validate(config)
    if split_seed < 0:
      raise ValueError(f"split_seed={split_seed}: must be >= 0")
    self.config = config
    self.split_seed = int(split_seed)

  def __len__(self) -> int:
    return self.config.num_examples

  def sequence(self, index: int) -> np.ndarray:
    """The full int32 sequence s [seq_len + 1] of example `index`."""
    return self.sequence_and_pairs(index)[0]

  def sequence_and_pairs(self, index: int) -> tuple[np.ndarray, int]:
    """(s [seq_len + 1], P) of example `index`."""
    c = self.config
    index = int(index)
    if not 0 <= index < c.num_examples:
      raise IndexError(f"MQAR index {index} out of range [0, {c.num_examples})")
    rng = np.random.default_rng([c.seed, self.split_seed, index])
    p = c.num_pairs if c.min_pairs is None else int(rng.integers(c.min_pairs, c.num_pairs + 1))
    g, h = c.gap_len, c.num_keys
    q = p if c.num_queries is None else c.num_queries
    keys = 1 + rng.choice(h, size=p, replace=False)
    values = 1 + h + rng.choice(c.vocab_size - 1 - h, size=p, replace=False)
    picked = rng.permutation(p)[:q]

    s = np.full((c.seq_len + 1,), PAD_ID, np.int32)
    s[0:2 * p:2] = keys
    s[1:2 * p:2] = values
    if c.gap_mode == "noise":
      s[2 * p:2 * p + g] = rng.integers(1, c.vocab_size, size=g)
    start = 2 * p + g  # "zero" gaps are already PAD
    s[start:start + 2 * q:2] = keys[picked]
    s[start + 1:start + 2 * q:2] = values[picked]
    return s, p

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    s, p = self.sequence_and_pairs(index)
    c = self.config
    q = p if c.num_queries is None else c.num_queries
    weights = np.zeros((c.seq_len,), np.float32)
    start = answer_start(c, p)
    weights[start:start + 2 * q:2] = 1.0
    return {"inputs": s[:-1], "targets": s[1:], "weights": weights}

  def __repr__(self) -> str:
    return f"MQARSource({self.config!r}, split_seed={self.split_seed})"
