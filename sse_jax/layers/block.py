"""Pre-norm residual block: x + mixer(RMSNorm(x)), then + SwiGLU(RMSNorm(.)).

    h = x + Mixer(RMSNorm_1(x))          mixer: Attention, SWA, GLA, GDN, SSE or MoM
    y = h + SwiGLU(RMSNorm_2(h))          [B, T, D]

`remat` (a `jax.checkpoint_policies` name, or None) rematerialises the block in the
backward pass through `nnx.remat` (training path only; cached calls never remat).
"""

from __future__ import annotations

from typing import Any, Union

import jax
import jax.numpy as jnp
from flax import nnx

from sse_jax.layers import validation as check
from sse_jax.layers.attention import Attention, AttentionConfig
from sse_jax.layers.gdn import GDN, GDNConfig
from sse_jax.layers.gla import GLA, GLAConfig
from sse_jax.layers.mixer import MixerOutput
from sse_jax.layers.mlp import MLPConfig, SwiGLU
from sse_jax.layers.mom import MoM, MoMConfig
from sse_jax.layers.norm import RMSNorm
from sse_jax.layers import sequences
from sse_jax.layers.sse import SSE, SSEConfig
from sse_jax.layers.swa import SlidingWindowAttention, SWAConfig

MixerConfig = Union[AttentionConfig, GLAConfig, GDNConfig, SSEConfig, SWAConfig, MoMConfig]
MIXERS = {AttentionConfig: Attention, GLAConfig: GLA, GDNConfig: GDN, SSEConfig: SSE,
          SWAConfig: SlidingWindowAttention, MoMConfig: MoM}

# Policies usable as `remat` (attribute names of jax.checkpoint_policies).
REMAT_POLICIES = ("nothing_saveable", "everything_saveable", "dots_saveable",
                  "dots_with_no_batch_dims_saveable")


def check_remat(owner: str, remat: Any) -> None:
  if remat is not None:
    check.choice(owner, "remat", remat, REMAT_POLICIES)


def make_mixer(config: MixerConfig, **kwargs) -> nnx.Module:
  """The mixer module for a mixer config (exact type)."""
  cls = MIXERS.get(type(config))
  if cls is None:
    raise ValueError(f"no mixer for config type {type(config).__name__}; expected one of"
                     f" {', '.join(t.__name__ for t in MIXERS)}")
  return cls(config, **kwargs)


def _forward(block: "Block", x: jax.Array, cu_seqlens, token_mask) -> MixerOutput:
  return block.forward(x, None, cu_seqlens, token_mask)


class Block(nnx.Module):
  """x [B, T, D] -> MixerOutput(y [B, T, D], cache, aux_loss, usage) of the mixer."""

  def __init__(self, mixer: MixerConfig, mlp: MLPConfig, *, norm_eps: float = 1e-6,
               remat: str | None = None, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    if mixer.hidden != mlp.hidden:
      raise ValueError(f"mixer hidden={mixer.hidden} != MLPConfig.hidden={mlp.hidden}")
    check_remat("Block", remat)
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.remat = remat
    self.mixer_norm = RMSNorm(mixer.hidden, eps=norm_eps, **kw)
    self.mixer = make_mixer(mixer, **kw)
    self.mlp_norm = RMSNorm(mixer.hidden, eps=norm_eps, **kw)
    self.mlp = SwiGLU(mlp, **kw)

  def init_cache(self, batch: int, max_len: int):
    return self.mixer.init_cache(batch, max_len)

  def forward(self, x: jax.Array, cache=None, cu_seqlens=None, token_mask=None
              ) -> MixerOutput:
    # token_mask only steers a routed mixer's statistics: attention has none.
    kw = {} if isinstance(self.mixer, Attention) else dict(token_mask=token_mask)
    out = self.mixer(self.mixer_norm(x), cache, cu_seqlens=cu_seqlens, **kw)
    h = x + out.y
    return out._replace(y=h + self.mlp(self.mlp_norm(h)))

  def __call__(self, x: jax.Array, cache=None, *, cu_seqlens=None, token_mask=None
               ) -> MixerOutput:
    """cu_seqlens: packed sequences (B == 1, no cache), see `sequences`; token_mask
    bool [B, T]: the tokens a routed mixer's balance loss and usage count (None: all)."""
    # checked here: under remat the mixer sees cu_seqlens as a tracer (no value checks)
    sequences.check("Block", x, cu_seqlens, cache)
    if self.remat is None or cache is not None:
      return self.forward(x, cache, cu_seqlens, token_mask)
    policy = getattr(jax.checkpoint_policies, self.remat)
    # graph=False treats the block as a pytree, so remat also works when the caller
    # closes over the model in a plain jax.grad (graph mode would refuse to update
    # Variables created at an outer trace level).
    return nnx.remat(_forward, policy=policy, graph=False)(self, x, cu_seqlens, token_mask)
