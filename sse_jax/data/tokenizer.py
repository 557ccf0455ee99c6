"""Byte-level tokenizer: one token per UTF-8 byte, vocabulary of 256.

    encode(text: str) -> int32 [L]      token id = byte value, 0..255
    decode(ids: int [L]) -> str         bytes that are not valid UTF-8 (e.g. a window cut
                                        inside a multi-byte character) become U+FFFD

Special tokens: only id 0 (the NUL byte), which does not occur in the corpora used here.
It is `PAD_ID` (padding; always weight 0) and `EOS_ID` (end of a document when documents
are packed into one stream). Keeping it inside the 256 byte values keeps the vocabulary
at exactly 256 and makes every id decodable.

Because each token is one byte, a mean cross-entropy in nats per token converts directly
to bits per byte: `bits_per_byte(nats) = nats / ln 2`.
"""

from __future__ import annotations

import math

import numpy as np

VOCAB_SIZE = 256
PAD_ID = 0
EOS_ID = 0


def encode_bytes(text: str | bytes) -> np.ndarray:
  """UTF-8 bytes of `text` as uint8 [L] (the compact form used to store corpora)."""
  data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
  return np.frombuffer(data, dtype=np.uint8).copy()


def encode(text: str | bytes) -> np.ndarray:
  """Token ids int32 [L] of `text` (str is UTF-8 encoded; bytes are taken as they are)."""
  return encode_bytes(text).astype(np.int32)


def decode(ids) -> str:
  """Text of token ids [L]; ids must lie in [0, 256)."""
  ids = np.asarray(ids)
  if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
    raise ValueError(f"token ids must lie in [0, {VOCAB_SIZE}); got range "
                     f"[{ids.min()}, {ids.max()}]")
  return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def bits_per_byte(mean_nats_per_token):
  """Bits per byte from a mean cross-entropy in nats per (byte) token."""
  return mean_nats_per_token / math.log(2.0)
