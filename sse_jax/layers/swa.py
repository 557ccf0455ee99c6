"""Sliding-window softmax attention (SWA) with a window-sized ring-buffer cache
(docs/design.md, section 8).

    o_t = softmax(q_t K^T / sqrt(Dh) over the keys s with t - W < s <= t) V,   y = o W_o

i.e. `Attention` with a required window W: the same parameters (W_q, W_k, W_v, W_o,
GQA, RoPE, optional short conv), so an attention layer's weights load into it as they
are. The full-sequence path is `Attention`'s: `jax.nn.dot_product_attention` with
`local_window_size=(W - 1, 0)` (cuDNN flash attention on GPU), packed sequences
(`cu_seqlens`) through a [T, T] same-sequence mask.

Decoding keeps only the last W keys and values: a ring buffer of W slots, position p in
slot p mod W, keys stored after RoPE at their absolute positions (scores depend on
offsets only, so the slot order does not matter). A cached call of T tokens at
positions p0 .. p0 + T - 1 attends over [ring, the T new keys] with the mask
"filled, causal, within W" and then writes the last min(T, W) new keys into the ring.
The cache does not grow: there is no length limit (`max_len` is ignored).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sse_jax.layers import sequences
from sse_jax.layers import short_conv
from sse_jax.layers import validation as check
from sse_jax.layers.attention import Attention, AttentionConfig
from sse_jax.layers.mixer import MixerOutput
from sse_jax.layers.rope import apply_rope


@dataclasses.dataclass(frozen=True)
class SWAConfig(AttentionConfig):
  """`AttentionConfig` with a required window (default 512 positions: each token sees
  itself and the 511 before it)."""

  window: int = 512

  def validate(self) -> None:
    super().validate()
    check.positive_int("SWAConfig", "window", self.window)


class RingCache(NamedTuple):
  """k, v: [B, W, Hkv, Dh], position p in slot p mod W; index: int32 scalar, the number
  of positions seen (the position of the next token); conv: the (q, k, v) short-conv
  states [B, w - 1, heads, Dh], or None without short conv."""

  k: jax.Array
  v: jax.Array
  index: jax.Array
  conv: tuple[jax.Array, jax.Array, jax.Array] | None = None


def ring_positions(index: jax.Array, size: int) -> jax.Array:
  """int32 [size]: the position each ring slot holds after `index` positions were
  written (the latest p < index with p mod size == slot), negative for an empty slot."""
  slots = jnp.arange(size, dtype=jnp.int32)
  last = index - 1
  return last - jnp.mod(last - slots, size)


class SlidingWindowAttention(Attention):
  """SWA mixer: x [B, T, D] -> MixerOutput(y [B, T, D], cache)."""

  def init_cache(self, batch: int, max_len: int | None = None) -> RingCache:
    """An empty ring of W positions in the compute dtype; `max_len` is ignored."""
    del max_len
    shape = (batch, self.config.window, self.config.kv_heads, self.config.head)
    zeros = jnp.zeros(shape, self.dtype)
    conv = short_conv.init_states((self.q_conv, self.k_conv, self.v_conv), batch)
    return RingCache(zeros, zeros, jnp.zeros((), jnp.int32), conv)

  def __call__(self, x: jax.Array, cache: RingCache | None = None, *,
               cu_seqlens: jax.Array | None = None) -> MixerOutput:
    """The full sequence (cache None; `cu_seqlens`: packed sequences, see `Attention`),
    or this call's T tokens after the ring's contents (prefill or decode), returning the
    updated ring."""
    sequences.check("SlidingWindowAttention", x, cu_seqlens, cache)
    if cache is None:
      return super().__call__(x, cu_seqlens=cu_seqlens)
    cfg = self.config
    size, t = cache.k.shape[1], x.shape[1]
    pos = cache.index + jnp.arange(t, dtype=jnp.int32)
    (q, k, v), conv = short_conv.apply_all(
        (self.q_conv, self.k_conv, self.v_conv), (self.q(x), self.k(x), self.v(x)),
        cache.conv)
    q = apply_rope(q, pos, cfg.rope_base)
    k = apply_rope(k, pos, cfg.rope_base)
    old = ring_positions(cache.index, size)
    kpos = jnp.concatenate([old, pos])                                    # [W + T]
    mask = ((kpos[None, :] >= 0) & (kpos[None, :] <= pos[:, None])
            & (kpos[None, :] > pos[:, None] - cfg.window))                 # [T, W + T]
    keys = jnp.concatenate([cache.k.astype(q.dtype), k], axis=1)
    values = jnp.concatenate([cache.v.astype(q.dtype), v], axis=1)
    o = jax.nn.dot_product_attention(q, keys, values, mask=mask[None, None],
                                     implementation="xla")
    # Only the last min(T, W) new positions can still be seen: their slots are distinct.
    m = min(t, size)
    slots = jnp.mod(pos[t - m:], size)
    kc = cache.k.at[:, slots].set(k[:, t - m:].astype(cache.k.dtype))
    vc = cache.v.at[:, slots].set(v[:, t - m:].astype(cache.v.dtype))
    return MixerOutput(self.o(o), RingCache(kc, vc, cache.index + t, conv))
