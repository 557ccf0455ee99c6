"""Byte-level LM examples from any prepared tensorflow-datasets text dataset.

The dataset is opened with `tfds.data_source(name, split=..., data_dir=...)` (random access
over ArrayRecord files; TensorFlow is not needed, nothing is downloaded: prepare it first
with `tfds build` or `tfds.builder(name).download_and_prepare(file_format="array_record")`;
tensorflow-datasets itself comes with the `tfds` extra).
Each record's `text_key` feature (str or UTF-8 bytes) is one document, tokenized to bytes.

mode "pack" (default): every document followed by EOS (byte 0) is concatenated, in record
  order, into one stream read into memory at construction; examples are the stream's
  windows (windows.py): weights all ones, a window may span documents. The models take
  no segment ids, so their recurrent and short-conv states carry across a document
  boundary inside a window (the EOS byte marks it), as in usual packed LM training.
  Best for LM training on many short documents; needs the split's text to fit in memory.
mode "pad": example i is document i followed by EOS, truncated to seq_len + 1 bytes and
  padded with PAD (byte 0); weights are 1 for the targets that are real bytes (up to and
  including the EOS) and 0 on padding. Lazy (one record per example), for big splits or
  per-document evaluation.

Either way: inputs / targets int32 [seq_len], weights float32 [seq_len].
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sse_jax.data.tokenizer import EOS_ID, PAD_ID, encode_bytes
from sse_jax.data.windows import ByteWindows

MODES = ("pack", "pad")
EXTRA = "tfds"  # the setup.cfg extra that installs tensorflow-datasets


@dataclasses.dataclass(frozen=True)
class TfdsConfig:
  """name/split/data_dir are passed to tfds.data_source; split is any TFDS split spec."""

  name: str = "tiny_shakespeare"
  split: str = "train"
  text_key: str = "text"
  seq_len: int = 256
  mode: str = "pack"
  data_dir: str | None = None
  stride: int | None = None  # pack mode only; None = seq_len


def _open(config: TfdsConfig):
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ModuleNotFoundError(f"the tfds data source needs `pip install 'sse-jax[{EXTRA}]'` "
                              f"(in a checkout: `pip install -e '.[{EXTRA}]'`)") from None
  return tfds.data_source(config.name, split=config.split, data_dir=config.data_dir)


def _document(record, config: TfdsConfig) -> np.ndarray:
  """uint8 bytes of one record's text followed by EOS."""
  if config.text_key not in record:
    raise KeyError(f"tfds dataset {config.name!r} has no feature {config.text_key!r}; "
                   f"features: {sorted(record)}; set text_key")
  text = record[config.text_key]
  if isinstance(text, np.ndarray):  # scalar string tensors may come back as 0-d arrays
    text = text.item()
  return np.append(encode_bytes(text), np.uint8(EOS_ID))


class TfdsTextSource:
  """Random-access LM examples: dict(inputs int32 [T], targets int32 [T], weights f32 [T])."""

  def __init__(self, config: TfdsConfig):
    if config.mode not in MODES:
      raise ValueError(f"mode={config.mode!r}: must be one of {MODES}")
    if config.seq_len < 1:
      raise ValueError(f"seq_len={config.seq_len}: must be >= 1")
    self.config = config
    self.records = _open(config)
    self.windows = None
    if config.mode == "pack":
      docs = [_document(self.records[i], config) for i in range(len(self.records))]
      stream = np.concatenate(docs) if docs else np.zeros((0,), np.uint8)
      self.windows = ByteWindows(stream, config.seq_len, config.stride,
                                 name=f"tfds/{config.name}/{config.split}")

  def __len__(self) -> int:
    return len(self.windows) if self.windows is not None else len(self.records)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if self.windows is not None:
      return self.windows[index]
    n = self.config.seq_len
    doc = _document(self.records[int(index)], self.config)[:n + 1].astype(np.int32)
    seq = np.full((n + 1,), PAD_ID, np.int32)
    seq[:len(doc)] = doc
    weights = (np.arange(n) < len(doc) - 1).astype(np.float32)
    return {"inputs": seq[:-1], "targets": seq[1:], "weights": weights}

  def __repr__(self) -> str:
    return f"TfdsTextSource({self.config!r})"
