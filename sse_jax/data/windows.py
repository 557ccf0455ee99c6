"""Random-access language-modelling windows over one byte stream.

Window i covers tokens[i * stride : i * stride + seq_len + 1] and yields

    inputs  int32   [seq_len]   window[:-1]
    targets int32   [seq_len]   window[1:]   (next-token prediction)
    weights float32 [seq_len]   all ones (every position is a real prediction)

stride defaults to seq_len, so consecutive windows share exactly one byte and every byte
of the stream (after the first) is a target exactly once per epoch.
"""

from __future__ import annotations

import numpy as np


class ByteWindows:
  """`__len__` / `__getitem__` source of LM windows over a uint8 token stream."""

  def __init__(self, tokens: np.ndarray, seq_len: int, stride: int | None = None,
               name: str = "bytes"):
    if seq_len < 1:
      raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    stride = seq_len if stride is None else stride
    if stride < 1:
      raise ValueError(f"stride must be >= 1, got {stride}")
    if len(tokens) < seq_len + 1:
      raise ValueError(f"{name}: stream of {len(tokens)} tokens is shorter than one window "
                       f"(seq_len + 1 = {seq_len + 1})")
    self.tokens = tokens
    self.seq_len = seq_len
    self.stride = stride
    self.name = name

  def __len__(self) -> int:
    return (len(self.tokens) - self.seq_len - 1) // self.stride + 1

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < len(self):
      raise IndexError(f"{self.name}: window {index} out of range [0, {len(self)})")
    start = index * self.stride
    window = self.tokens[start:start + self.seq_len + 1].astype(np.int32)
    return {"inputs": window[:-1], "targets": window[1:],
            "weights": np.ones((self.seq_len,), np.float32)}

  def __repr__(self) -> str:
    # Stable (no memory address): grain stores the source repr in some checkpoints.
    return (f"ByteWindows(name={self.name!r}, tokens={len(self.tokens)}, "
            f"seq_len={self.seq_len}, stride={self.stride})")
