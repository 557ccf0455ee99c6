"""Causal softmax attention with RoPE, grouped KV heads and an optional sliding window.

    o = softmax(q k^T / sqrt(Dh) + causal/window mask) v,   y = o W_o

The full-sequence path calls `jax.nn.dot_product_attention` with `is_causal=True`
(and `local_window_size` for a window), which runs cuDNN flash attention on GPU when
`implementation` resolves to "cudnn" (measured ~3x faster than the Pallas-Triton
attention on the H200). The cached path (prefill into / decode from a KV cache) always uses the XLA
implementation with an explicit [T, S] mask over the cache.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sse_jax.layers import validation as check
from sse_jax.ops import checks
from sse_jax.layers.mixer import MixerOutput
from sse_jax.layers.params import Einsum
from sse_jax.layers.rope import apply_rope
from sse_jax.layers import sequences
from sse_jax.layers import short_conv
from sse_jax.layers.short_conv import ShortConv

IMPLEMENTATIONS = ("auto", "xla", "cudnn", None)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Attention sizes and options.

  hidden: D. num_heads: H query heads (D must be divisible by H).
  num_kv_heads: key/value heads (GQA; H divisible by it); None = H (MHA).
  head_dim: Dh; None = D / H.
  rope_base: RoPE theta base.
  window: sliding window length (each token sees itself and the window - 1 before
    it); None = full causal attention.
  implementation: for `jax.nn.dot_product_attention` on the full-sequence path:
    "auto" (cuDNN on GPU for bf16/fp16 with Dh a multiple of 8 and <= 128, falling
    back to XLA if cuDNN's trace-time checks reject the call; else XLA),
    "xla", "cudnn", or None (JAX's own default).
  short_conv: width w of a causal depthwise conv + SiLU on the q / k / v projections
    (before RoPE), as the linear-attention mixers have it; 0 = none (a plain
    Transformer). It gives each position its few predecessors directly, which small
    models otherwise have to learn with a previous-token head.
  """

  hidden: int
  num_heads: int
  num_kv_heads: int | None = None
  head_dim: int | None = None
  rope_base: float = 10000.0
  window: int | None = None
  implementation: str | None = "auto"
  short_conv: int = 0

  def __post_init__(self):
    self.validate()

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def head(self) -> int:
    return self.hidden // self.num_heads if self.head_dim is None else self.head_dim

  def validate(self) -> None:
    name = "AttentionConfig"
    check.positive_int(name, "hidden", self.hidden)
    check.positive_int(name, "num_heads", self.num_heads)
    check.divides(name, "hidden", self.hidden, "num_heads", self.num_heads)
    check.optional_positive_int(name, "num_kv_heads", self.num_kv_heads)
    if self.num_heads % self.kv_heads:
      check.fail(name, "num_kv_heads", self.num_kv_heads,
                 f"must divide num_heads={self.num_heads}")
    check.optional_positive_int(name, "head_dim", self.head_dim)
    if self.head % 2:
      check.fail(name, "head_dim", self.head, "must be even (RoPE rotates pairs)")
    check.positive_float(name, "rope_base", self.rope_base)
    check.optional_positive_int(name, "window", self.window)
    check.choice(name, "implementation", self.implementation, IMPLEMENTATIONS)
    check.nonnegative_int(name, "short_conv", self.short_conv)


class KVCache(NamedTuple):
  """k, v: [B, S, Hkv, Dh] for S = max_len positions; index: int32 scalar, the number
  of positions already filled (the position of the next token); conv: the (q, k, v)
  short-conv states [B, w - 1, heads, Dh], or None without short conv."""

  k: jax.Array
  v: jax.Array
  index: jax.Array
  conv: tuple[jax.Array, jax.Array, jax.Array] | None = None


def resolve_implementation(implementation: str | None, dtype, head_dim: int) -> str | None:
  """"auto" -> "cudnn" where cuDNN flash attention supports the call, else "xla"."""
  if implementation != "auto":
    return implementation
  on_gpu = jax.default_backend() in ("gpu", "cuda")
  ok = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0
  return "cudnn" if on_gpu and ok and head_dim <= 128 else "xla"


class Attention(nnx.Module):
  """Attention mixer: x [B, T, D] -> MixerOutput(y [B, T, D], cache)."""

  def __init__(self, config: AttentionConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    config.validate()
    self.config = config
    self.dtype = dtype
    d, h, hk, dh = config.hidden, config.num_heads, config.kv_heads, config.head
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.q = Einsum("btd,dhk->bthk", (d, h, dh), ("embed", "heads", "head_dim"), **kw)
    self.k = Einsum("btd,dhk->bthk", (d, hk, dh), ("embed", "kv_heads", "head_dim"), **kw)
    self.v = Einsum("btd,dhk->bthk", (d, hk, dh), ("embed", "kv_heads", "head_dim"), **kw)
    self.o = Einsum("bthk,hkd->btd", (h, dh, d), ("heads", "head_dim", "embed"), **kw)
    w = config.short_conv
    self.q_conv = ShortConv(w, (h, dh), ("heads", "head_dim"), **kw) if w else None
    self.k_conv = ShortConv(w, (hk, dh), ("kv_heads", "head_dim"), **kw) if w else None
    self.v_conv = ShortConv(w, (hk, dh), ("kv_heads", "head_dim"), **kw) if w else None

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    """An empty cache for `max_len` positions, in the compute dtype."""
    shape = (batch, max_len, self.config.kv_heads, self.config.head)
    zeros = jnp.zeros(shape, self.dtype)
    conv = short_conv.init_states((self.q_conv, self.k_conv, self.v_conv), batch)
    return KVCache(zeros, zeros, jnp.zeros((), jnp.int32), conv)

  def __call__(self, x: jax.Array, cache: KVCache | None = None, *,
               cu_seqlens: jax.Array | None = None) -> MixerOutput:
    """Full causal attention (cache None), or attention over the cache after writing
    this call's T tokens at positions index .. index + T - 1 (prefill or decode).
    index + T > max_len is an error where index is concrete; under `jit` the caller
    keeps index + T <= max_len (past it, the write would be clamped: wrong outputs).

    `cu_seqlens` int [S + 1] (B == 1, no cache): S packed sequences, each attending only
    to itself, with RoPE positions from 0 at its start (see `sequences`). That passes
    a [T, T] mask to the attention (with cuDNN, a [T, T] bias kept for the backward
    pass: O(T^2) memory, ~2 GiB per layer at T = 32K in bf16, unlike the O(T) of
    unpacked flash attention; XLA's path builds [B, H, T, T] logits either way)."""
    cfg = self.config
    t = x.shape[1]
    sequences.check("Attention", x, cu_seqlens, cache)
    start = jnp.zeros((), jnp.int32) if cache is None else cache.index
    packed = sequences.positions_or_none(cu_seqlens, t)
    pos = start + jnp.arange(t, dtype=jnp.int32) if packed is None else packed
    (q, k, v), conv = short_conv.apply_all(
        (self.q_conv, self.k_conv, self.v_conv), (self.q(x), self.k(x), self.v(x)),
        None if cache is None else cache.conv, packed)
    q = apply_rope(q, pos, cfg.rope_base)
    k = apply_rope(k, pos, cfg.rope_base)
    if cache is None:
      window = None if cfg.window is None else (cfg.window - 1, 0)
      mask = (None if cu_seqlens is None
              else sequences.same_sequence(cu_seqlens, t)[None, None])  # [1, 1, T, T]
      attend = lambda impl: jax.nn.dot_product_attention(
          q, k, v, mask=mask, is_causal=True, local_window_size=window,
          implementation=impl)
      impl = resolve_implementation(cfg.implementation, self.dtype, cfg.head)
      if cfg.implementation == "auto" and impl == "cudnn":
        try:  # cuDNN's support checks run at trace time: fall back to XLA if it declines
          return MixerOutput(self.o(attend("cudnn")))
        except (NotImplementedError, ValueError, RuntimeError):
          impl = "xla"
      return MixerOutput(self.o(attend(impl)))
    max_len = cache.k.shape[1]
    if t > max_len:
      raise ValueError(f"{t} tokens do not fit a KV cache of max_len={max_len}")
    if checks.is_concrete(start) and int(start) + t > max_len:
      raise ValueError(f"the KV cache holds {int(start)} of max_len={max_len} positions: "
                       f"{t} more do not fit (init_cache with a larger max_len)")
    at = (0, start, 0, 0)
    kc = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), at)
    vc = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), at)
    kpos = jnp.arange(kc.shape[1], dtype=jnp.int32)
    mask = kpos[None, :] <= pos[:, None]                                  # [T, S]
    if cfg.window is not None:
      mask &= kpos[None, :] > pos[:, None] - cfg.window
    o = jax.nn.dot_product_attention(q, kc.astype(q.dtype), vc.astype(q.dtype),
                                     mask=mask[None, None], implementation="xla")
    return MixerOutput(self.o(o), KVCache(kc, vc, start + t, conv))
