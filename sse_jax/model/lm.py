"""LanguageModel: embedding -> pre-norm blocks (pattern of SSE / GLA / GDN / MoM /
attention / sliding-window attention) -> RMSNorm -> logits in float32.

    x_0 = E[tokens]                              [B, T, D]
    x_l = Block_l(x_{l-1})                       l = 1..L
    logits = RMSNorm(x_L) E^T  (or W_head)       [B, T, V], float32
    aux_loss = aux_loss_coef * sum_{routed layers} N/k sum_i f_i p_i   (SSE, MoM)

Training: `out = model(tokens)`; loss = cross_entropy(out.logits, targets) +
out.aux_loss. Decoding: `cache = model.init_cache(B, max_len)`, then
`out = model(tokens, cache=cache)` (a prompt: chunked prefill; one token: a decode
step) returns the updated cache in `out.cache`; see `sse_jax.generate`. Packed
sequences: `model(tokens[None], cu_seqlens=cu)` for S sequences laid end to end.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sse_jax.layers import params
from sse_jax.layers import sequences
from sse_jax.ops import checks
from sse_jax.layers.block import Block
from sse_jax.layers.norm import RMSNorm
from sse_jax.model.config import ModelConfig


class ModelOutput(NamedTuple):
  """logits: float32 [B, T, V].
  aux_loss: float32 scalar, aux_loss_coef * (sum of the routed (SSE, MoM) layers'
    load-balance losses): add it to the LM loss as is.
  router_usage: one float32 [N] per routed layer (in layer order, see
    `LanguageModel.routed_layers`): fraction of tokens whose write set holds partition
    (memory) i.
  router_aux: the unscaled per-routed-layer load-balance losses.
  cache: the updated per-layer caches when a cache was passed, else None.
  router_indices: per routed layer, (write int32 [B, T, Kw], read int32 [B, T, Kr]): the
    partitions each token writes and reads.
  """

  logits: jax.Array
  aux_loss: jax.Array
  router_usage: tuple[jax.Array, ...]
  router_aux: tuple[jax.Array, ...]
  cache: tuple[Any, ...] | None = None
  router_indices: tuple[tuple[jax.Array, jax.Array], ...] = ()


class LanguageModel(nnx.Module):
  """tokens int [B, T] -> ModelOutput. `dtype` is the compute dtype, `param_dtype` the
  storage dtype of the parameters (the SSE routers are always float32)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    config.validate()
    self.config = config
    self.dtype = dtype
    v, d = config.vocab_size, config.hidden
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.embed = params.param(rngs, params.default_init, (v, d), ("vocab", "embed"),
                              param_dtype)
    self.blocks = nnx.List([
        Block(config.mixer_config(letter), config.mlp, norm_eps=config.norm_eps,
              remat=config.remat, **kw) for letter in config.pattern])
    self.final_norm = RMSNorm(d, eps=config.norm_eps, **kw)
    self.lm_head = (None if config.tie_embeddings else
                    params.param(rngs, params.default_init, (d, v), ("embed", "vocab"),
                                 param_dtype))

  @property
  def routed_layers(self) -> tuple[int, ...]:
    """Indices of the routed (SSE, MoM) layers, the order of `router_usage` /
    `router_aux`."""
    return self.config.routed_layers

  def init_cache(self, batch: int, max_len: int) -> tuple[Any, ...]:
    """Per-layer caches: RecurrentCache (SSE / GLA / GDN / MoM states, conv states),
    KVCache (attention, `max_len` positions) or RingCache (sliding-window attention,
    `window` positions)."""
    return tuple(block.init_cache(batch, max_len) for block in self.blocks)

  def __call__(self, tokens: jax.Array, *, cache: tuple[Any, ...] | None = None,
               cu_seqlens: jax.Array | None = None,
               token_mask: jax.Array | None = None) -> ModelOutput:
    """cu_seqlens int [S + 1] (tokens [1, T], no cache): S sequences packed end to end,
    each computed as if alone (`sse_jax.layers.sequences`). token_mask bool [B, T]: the
    tokens the router statistics and the load-balance loss average over (None: all;
    the trainer passes tokens != PAD); logits do not depend on it."""
    sequences.check("LanguageModel", tokens, cu_seqlens, cache)
    vocab = self.embed.shape[0]
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    if checks.is_concrete(tokens) and tokens.size:
      lo, hi = int(tokens.min()), int(tokens.max())
      if lo < 0 or hi >= vocab:
        raise ValueError(f"token ids must lie in [0, vocab_size={vocab}), got values in "
                         f"[{lo}, {hi}]")
    # Under jit an id out of range cannot be checked here (the trainer checks its
    # batches); jnp.take would fill its row with NaN, which the causal matmuls spread.
    x = jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)
    caches, usage, aux, indices = [], [], [], []
    for i, block in enumerate(self.blocks):
      out = block(x, None if cache is None else cache[i], cu_seqlens=cu_seqlens,
                  token_mask=token_mask)
      x = out.y
      caches.append(out.cache)
      if out.aux_loss is not None:
        aux.append(out.aux_loss)
        usage.append(out.usage)
        indices.append(out.indices)
    h = self.final_norm(x)
    if self.lm_head is None:
      head, eqn = self.embed[...], "btd,vd->btv"
    else:
      head, eqn = self.lm_head[...], "btd,dv->btv"
    logits = jnp.einsum(eqn, h, head.astype(self.dtype),
                        preferred_element_type=jnp.float32)
    total = sum(aux, jnp.zeros((), jnp.float32))
    return ModelOutput(logits, self.config.aux_loss_coef * total, tuple(usage), tuple(aux),
                       None if cache is None else tuple(caches), tuple(indices))
